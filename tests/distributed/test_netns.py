"""Two hosts on one machine: two network namespaces on one bridge (10.213.8.1 and 10.213.8.2;
tests/multihost.py). A host whose route to the master goes through loopback is refused before
any rank starts. (The job across two namespaces, with the interface the launcher names, runs in
tests/distributed/test_multinode.py.)

Needs root (or CAP_NET_ADMIN) and the ``ip`` tool; skipped with the reason where the kernel
refuses namespaces.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.multihost import REPO, hosts, ip, sweep_stale

ALLREDUCE = os.path.join(REPO, "tests", "distributed", "launch_scripts", "allreduce.py")
MASTER = "10.213.8.1"
PORT = "29517"  # each namespace has its own ports: no collision with the host's


@pytest.fixture
def two_hosts():
    """Namespaces (names, interfaces) of two hosts on one bridge (tests/multihost.py)."""
    with hosts(2) as made:
        yield [h.netns for h in made], [h.link for h in made]


def _start(
    ns: str, node_rank: int, env_extra: dict[str, str] | None = None, sink=None
) -> subprocess.Popen:
    """One launcher in namespace ``ns``; its output piped, or written to the file ``sink``."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(env_extra or {})
    args = ["--nnodes", "2", "--node_rank", str(node_rank), "--nproc_per_node", "1"]
    args += ["--master_addr", MASTER, "--master_port", PORT, "--rdzv_timeout", "120"]
    return subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "zerotron.launcher.launch",
            *args,
            ALLREDUCE,
        ],
        cwd=REPO,
        env=env,
        stdout=sink or subprocess.PIPE,
        stderr=subprocess.STDOUT if sink else subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, str]]:
    try:
        return [(p, *p.communicate(timeout=timeout)) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_remote_master_reached_only_through_loopback_is_refused(two_hosts):
    names, _ = two_hosts
    # Make node 1's route to the master go out through lo with a 127.x source: what a host
    # whose name resolves to 127.x and whose traffic to node 0 stays local looks like.
    ip("-n", names[1], "route", "replace", f"{MASTER}/32", "dev", "lo", "src", "127.0.0.1")
    ((p, out, err),) = _finish([_start(names[1], 1)], timeout=60)
    assert p.returncode == 2, out + err
    assert "Traceback" not in err
    assert "reaches --master_addr '10.213.8.1' only through loopback" in err
    assert "GLOO_SOCKET_IFNAME" in err and "/etc/hosts" in err


def test_the_hosts_a_killed_run_left_are_deleted_by_the_next(two_hosts):
    """A SIGKILLed test run leaves its namespaces and bridge (no ``finally`` runs): the next
    ``hosts()`` deletes those whose run's pid is gone, and leaves live runs' alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = str(gone.pid)
    try:
        ip("netns", "add", f"zt{dead}0")
        ip("link", "add", f"zb{dead}", "type", "bridge")
        assert sorted(sweep_stale()) == sorted([f"zt{dead}0", f"zb{dead}"])
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"zt{dead}0" not in names.split()
        live, _ = two_hosts  # this run's own hosts, made by the fixture: kept
        assert all(ns in names for ns in live)
    finally:
        subprocess.run(["ip", "netns", "del", f"zt{dead}0"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"zb{dead}"], capture_output=True)
