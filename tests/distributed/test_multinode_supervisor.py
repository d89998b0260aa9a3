"""launcher/remote.py's Supervisor without hosts: each "node" is a shell script that writes what a
node's launcher writes (its own failure account, ``node I exits with code C``) and exits as it
would. Checks which node is named, the exit code, stopping the others, and signals. (The real
thing, over ssh, pdsh, mpirun and srun: test_multinode.py.)
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from zerotron.launcher import remote
from zerotron.launcher.multinode import MultiNodePlan, NodeCommand

HOSTS = ["w0", "w1"]
REPO = str(Path(__file__).resolve().parents[2])


def account(rank: int, node: int, cause: str, code: int) -> str:
    """What a node's launcher says when its rank ``rank`` failed, as shell commands."""
    lines = [
        f"zerotron launch: rank {rank} failed first: exit code {code}",
        f"zerotron launch: cause: {cause}",
        f"zerotron launch: rank {rank}'s traceback:",
        "zerotron launch:   Traceback (most recent call last):",
        f"zerotron launch:   {cause}",
        f"zerotron launch: node {node} exits with code {code}",
    ]
    return "; ".join(f"echo {line!r} >&2" for line in lines) + f"; exit {code}"


# A node whose launcher waits for its input to close (its lifeline), then stops as on SIGTERM.
WAITS = (
    "echo ready; cat >/dev/null; echo 'zerotron launch: stopped by SIGTERM; all local ranks "
    "were shut down' >&2; echo 'zerotron launch: node {n} exits with code 143' >&2; exit 143"
)


def supervise(scripts: list[str], launcher: str = "ssh", timeout: float = 0.3):
    if launcher == "ssh":
        commands = [NodeCommand([h], ["sh", "-c", s]) for h, s in zip(HOSTS, scripts)]
    else:
        (script,) = scripts
        commands = [NodeCommand(HOSTS, ["sh", "-c", script])]
    plan = MultiNodePlan({h: [0] for h in HOSTS}, "w0", 29500, launcher, commands)
    out, err = io.StringIO(), io.StringIO()
    code = remote.Supervisor(plan, timeout, stdout=out, stderr=err).run()
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def _no_grace(monkeypatch):
    monkeypatch.setattr(remote, "GRACE_S", 0.0)


def test_the_node_whose_rank_failed_on_its_own_is_named_not_the_first_to_report():
    peer = "RuntimeError: Connection closed by peer [w1]:1234"
    code, out, err = supervise([
        account(0, 0, peer, 1),  # reports at once
        "sleep 0.5; echo '[rank1]: boom' >&2; " + account(1, 1, "ValueError: boom", 3),
    ], timeout=30)  # fmt: skip
    assert code == 3, err
    assert "w1: [rank1]: boom\n" in err  # each line with its node's host
    assert "zerotron launch: node 1 (w1) failed first: rank 1, exit code 3\n" in err
    assert "zerotron launch: cause: ValueError: boom\n" in err
    assert "zerotron launch: node 1 (w1)'s report:\nzerotron launch:   rank 1 failed first" in err
    assert "then: node 0 (w0): rank 0, exit code 1 (a peer left)\n" in err


def test_a_node_that_never_started_is_named_with_its_last_lines():
    code, _, err = supervise([
        "echo 'ssh: connect to host w0 port 22: Connection refused' >&2; exit 255",
        WAITS.format(n=1),
    ])  # fmt: skip
    assert code == 255
    said = "node 0 (w0) failed first: its ssh exited with code 255 before naming a failed rank\n"
    assert said in err
    assert "zerotron launch:   ssh: connect to host w0 port 22: Connection refused\n" in err
    # the other node was stopped through its lifeline after --shutdown_timeout
    assert "zerotron launch: stopping the nodes that are still running\n" in err
    assert "then: node 1 (w1): stopped by SIGTERM (exit code 143)\n" in err


def test_a_failed_node_never_gives_exit_code_0():
    # a node launcher that dies without a word (exit 0 from the back end would hide it)
    code, _, err = supervise(["exit 0", "echo 'zerotron launch: node 1 exits with code 7' >&2"])
    assert code == 7
    assert "node 1 (w1) failed first: its ssh exited with code 7" in err


def test_pdsh_lines_are_given_to_their_node_by_the_host_in_front():
    script = (
        "echo 'w0: zerotron launch: node 0 exits with code 0' >&2; echo 'w0: [rank0]: hi'; "
        "echo 'pdsh@here: w1: ssh exited with exit code 2' >&2; "
        "echo 'w1: zerotron launch: rank 1 failed first: exit code 2' >&2; exit 2"
    )
    code, out, err = supervise([script], launcher="pdsh")  # node 1's last line never came
    assert out == "w0: [rank0]: hi\n"
    assert "pdsh@here: w1: ssh exited with exit code 2\n" in err  # pdsh's own line, as it is
    assert code == 2
    assert "node 1 (w1) failed first: rank 1, exit code 2\n" in err


def test_a_back_end_failure_without_a_failed_node_is_not_exit_0():
    code, _, err = supervise(["echo 'mpirun: a daemon died' >&2; exit 5"], launcher="openmpi")
    assert code == 5
    assert "openmpi exited with code 5, but no node's launcher reported a failure" in err


def test_sigterm_stops_every_node_through_its_lifeline():
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    before = signal.getsignal(signal.SIGTERM)
    code, out, err = supervise([WAITS.format(n=0), WAITS.format(n=1)], timeout=30)
    timer.join()
    assert code == 128 + signal.SIGTERM
    assert out.count("ready") == 2
    assert "w1: zerotron launch: node 1 exits with code 143\n" in err
    assert err.endswith("zerotron launch: stopped by SIGTERM; every node was stopped\n")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


SUPERVISE_PDSH = """
from zerotron.launcher import remote
from zerotron.launcher.multinode import MultiNodePlan, NodeCommand
command = NodeCommand(["w0", "w1"], ["sh", "-c", "echo $$; exec sleep 60"])
remote.Supervisor(MultiNodePlan({"w0": [0], "w1": [0]}, "w0", 1, "pdsh", [command]), 1).run()
"""


def test_the_back_end_process_dies_with_a_killed_launcher():
    """pdsh (mpirun, srun) would outlive a SIGKILLed launcher, and its nodes with it."""
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.Popen([sys.executable, "-c", SUPERVISE_PDSH], stdout=subprocess.PIPE, env=env)
    backend = psutil.Process(int(p.stdout.readline()))
    p.kill()
    p.wait()
    backend.wait(timeout=10)  # its parent-death signal ended it (else: psutil.TimeoutExpired)
    assert not backend.is_running()
