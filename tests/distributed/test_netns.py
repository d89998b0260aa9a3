"""Two hosts on one machine: two network namespaces joined by a veth pair (10.213.8.1 and
10.213.8.2), one ``zerotron launch`` in each (issue 15). Without the launcher naming the veth
interface, each host's gloo advertised the address its host name resolves to (127.x) and the
job failed with ``Gloo connectFullMesh failed ... remote=[127.0.0.1]``.

Needs root (or CAP_NET_ADMIN) and the ``ip`` tool; skipped with the reason where the kernel
refuses namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLREDUCE = os.path.join(REPO, "tests", "distributed", "launch_scripts", "allreduce.py")
MASTER, WORKER = "10.213.8.1", "10.213.8.2"
PORT = "29517"  # each namespace has its own ports: no collision with the host's


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Namespaces (names, interfaces) = (["zt<pid>a", "zt<pid>b"], ["zv<pid>a", "zv<pid>b"])."""
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed")
    tag = str(os.getpid())
    names, links = [f"zt{tag}a", f"zt{tag}b"], [f"zv{tag}a", f"zv{tag}b"]
    made: list[str] = []
    try:
        for ns in names:
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"network namespaces refused here (ip netns add: {e.stderr.strip()})")
            made.append(ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, (MASTER, WORKER)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names, links
    finally:
        for ns in made:  # deleting a namespace deletes the veth end inside it, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


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


def test_two_namespaces_make_one_job_over_the_veth_pair(two_hosts):
    names, links = two_hosts
    results = _finish([_start(names[0], 0), _start(names[1], 1)])
    for p, out, err in results:
        assert p.returncode == 0, out + err
    sums = {}
    for i, (_, out, err) in enumerate(results):
        m = re.search(r"\[rank(\d)\]: report rank=\d world=(\d) sum=(\S+)", out)
        assert m, out + err
        assert m.group(2) == "2"
        sums[int(m.group(1))] = float(m.group(3))
        # the launcher said which interface it gave the workers: this namespace's veth end
        assert f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={links[i]}" in err
    assert sums == {0: 3.0, 1: 3.0}  # 1 + 2


def test_a_remote_master_reached_only_through_loopback_is_refused(two_hosts):
    names, _ = two_hosts
    # Make node 1's route to the master go out through lo with a 127.x source: what a host
    # whose name resolves to 127.x and whose traffic to node 0 stays local looks like.
    _ip("-n", names[1], "route", "replace", f"{MASTER}/32", "dev", "lo", "src", "127.0.0.1")
    ((p, out, err),) = _finish([_start(names[1], 1)], timeout=60)
    assert p.returncode == 2, out + err
    assert "Traceback" not in err
    assert "reaches --master_addr '10.213.8.1' only through loopback" in err
    assert "GLOO_SOCKET_IFNAME" in err and "/etc/hosts" in err
