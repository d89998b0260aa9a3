"""Elastic launch flags and the launcher's words about nodes, without starting anything: node
counts (torchrun's ``--nnodes MIN:MAX``, DeepSpeed's ``--min/max_elastic_nodes``),
``--rdzv_conf``, and the reports that name a lost node. The real node loss is
tests/distributed/test_elastic.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from zerotron.errors import ConfigError
from zerotron.launcher import elastic
from zerotron.launcher.launch import plan_from_args
from zerotron.launcher.rendezvous import lost_report, round_report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLREDUCE = os.path.join(REPO, "tests", "distributed", "launch_scripts", "allreduce.py")
LOCAL = ["--master_addr", "127.0.0.1", "--master_port", "29599"]


@pytest.mark.parametrize(
    ("flags", "nnodes", "min_nodes"),
    [
        (["--nnodes", "1:2"], 2, 1),
        (["--min_elastic_nodes", "2", "--max_elastic_nodes", "4"], 4, 2),
        (["--min_nodes", "1", "--nnodes", "3"], 3, 1),
        (["--nnodes", "2"], 2, None),
        (["--nnodes", "2:2"], 2, None),  # one count: fixed, the static rendezvous
    ],
)
def test_node_counts(flags, nnodes, min_nodes):
    plan = plan_from_args([*flags, *LOCAL, ALLREDUCE])
    assert (plan.nnodes, plan.min_nodes, plan.elastic) == (nnodes, min_nodes, min_nodes is not None)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "3:2"], "the fewest nodes (3) must be in 1 .. 2"),
        (["--nnodes", "0:2"], "the fewest nodes (0) must be in 1 .. 2"),
        (["--nnodes", "2", "--max_nodes", "3"], "--nnodes 2 and --max_nodes 3 disagree"),
        (["--nnodes", "1:2", "--rdzv_conf", "last_call_timeout"], "is not KEY=VALUE"),
    ],
)
def test_bad_node_counts_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_from_args([*flags, *LOCAL, ALLREDUCE])


def test_rdzv_conf_is_read_as_torchrun_reads_it():
    plan = plan_from_args(
        ["--nnodes", "1:2", "--rdzv_conf", "last_call_timeout=1, keep_alive_interval=2", *LOCAL,
         ALLREDUCE]
    )  # fmt: skip
    assert plan.rdzv_conf == {"last_call_timeout": "1", "keep_alive_interval": "2"}


def test_a_restart_names_who_left_and_who_came():
    lines = round_report(1, ["node 1 (10.0.0.2)"], [], 1, 1, 2)
    assert lines == [
        "node 1 (10.0.0.2) left the job (its launcher stopped answering)",
        "restart 1: going on with 1 node(s) of 1..2 nodes; the program resumes from its newest "
        "checkpoint",
    ]
    assert round_report(0, [], [], 2, 1, 2) == []  # the first round says nothing
    assert "of 2 node(s), the same nodes as before;" in round_report(2, [], [], 2, 2, 2)[-1]
    assert lost_report([(1, "node 1 (10.0.0.2)")]) == "node 1 (10.0.0.2) was lost (restart 1)"


def test_a_member_that_stops_its_heartbeats_restarts_the_nodes_left():
    """torch's own rendezvous, two nodes in one process on loopback: once node 1's heartbeats
    stop, node 0's handler counts it among the nodes to meet again for (torch's agent then
    restarts node 0's ranks), where torch counts only nodes waiting to join. A node whose
    ranks wait on a dead peer that their backend never fails (gloo, sometimes) depends on it."""
    from zerotron.launcher.rendezvous import ElasticRendezvous

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said: list[str] = []
    conf = {"last_call_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}

    def node(rank: int) -> ElasticRendezvous:
        return ElasticRendezvous("127.0.0.1", port, rank, "127.0.0.1", 1, 2, "lost", 30, conf,
                                 say=said.append if rank == 0 else lambda text: None)  # fmt: skip

    n0 = node(0)
    n1 = node(1)
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda n: n.next_rendezvous(), (n0, n1)))
    try:
        assert sorted(i.world_size for i in infos) == [2, 2]
        assert n0.num_nodes_waiting() == 0 and n0.members_gone() == []
        n1._inner._stop_heartbeats()  # torch's keep-alive timer: as if node 1 were killed
        deadline = time.monotonic() + 20
        while n0.num_nodes_waiting() == 0:
            assert time.monotonic() < deadline, "node 0 never counted node 1 as gone"
            time.sleep(0.5)
        assert n0.members_gone() == ["node 1 (127.0.0.1)"]
        assert said[-1] == (
            "node 1 (127.0.0.1) left the round (stopped answering, or meeting again): stopping "
            "the ranks here to meet again"
        )
    finally:
        n1.shutdown()
        n0.shutdown()


def test_a_failed_job_names_the_node_its_ranks_lost():
    rdzv = SimpleNamespace(
        label="node 0 (10.0.0.1)", members=["node 0 (10.0.0.1)", "node 2 (10.0.0.3)"], lost=[]
    )
    report = "rank 0's error: ... Connection closed by peer [10.0.0.3]:60584. This is ..."
    assert elastic.failure_note(report, rdzv) == (
        "the ranks here lost node 2 (10.0.0.3): its ranks (or the node) went away first"
    )
    assert elastic.failure_note("rank 0 failed: exit code 1", rdzv) == ""
    rdzv.lost = [(1, "node 1 (10.0.0.2)")]
    assert (
        elastic.failure_note("", rdzv) == "during the job, node 1 (10.0.0.2) was lost (restart 1)"
    )


def test_sigusr1_goes_on_to_the_ranks_and_stops_restarts():
    # A stand-in for the agent: one "rank" (a sleeping child) and torch's restart counter.
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent = SimpleNamespace(
        _remaining_restarts=3,
        get_worker_group=lambda: SimpleNamespace(workers=[SimpleNamespace(id=rank.pid)]),
    )
    before = signal.getsignal(signal.SIGUSR1)
    try:
        passed = elastic.pass_on_usr1(agent)
        os.kill(os.getpid(), signal.SIGUSR1)  # the launcher itself lives on
        assert rank.wait(timeout=30) == -signal.SIGUSR1
        assert agent._remaining_restarts == 0
        assert passed == ["SIGUSR1"]
    finally:
        signal.signal(signal.SIGUSR1, before)
        rank.kill()


@pytest.mark.parametrize(
    ("codes", "saved"),
    [
        ([75, 75], True),
        ([75, -15], True),  # saved, then stopped by the agent while exiting
        ([-15, -15], False),  # stopped before anyone saved
        ([75, 1], False),  # a rank failed on its own
        ([], False),
    ],
)
def test_which_exit_codes_mean_saved_on_a_signal(codes, saved):
    assert elastic.saved_codes(codes) is saved
