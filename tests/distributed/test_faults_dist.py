"""Faults across ranks (issue 19): a stuck rank ends the job within the timeout and is named.

Two or three gloo ranks with a collective timeout of a few seconds; one rank stops coming to a
collective (it sleeps, or is SIGSTOPped), the others must fail within the timeout with a
DistributedError that names the op, the group and the stuck rank. Without the job's timeout on
the groups made by initialize_model_parallel (torch's default is 30 minutes) they would wait
until the test's own deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from zerotron.distributed import comm
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel

from .spawn import RankError, run_ranks

TIMEOUT_S = 3.0  # the collectives' timeout inside the ranks
DEADLINE_S = 40.0  # the test's own: far below torch's 30 minutes, far above TIMEOUT_S


def _stuck_in_dp_all_reduce(rank: int, stuck: int, how: str) -> float:
    """Every rank all-reduces on the dp group twice; ``stuck`` stops before the second one."""
    st = initialize_model_parallel()
    x = torch.ones(4)
    comm.all_reduce(x, st.dp)
    if rank == stuck:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(DEADLINE_S)
    start = time.monotonic()
    try:
        comm.all_reduce(x, st.dp)
    finally:
        destroy_model_parallel()
    return time.monotonic() - start


def _failure(world: int, stuck: int, how: str) -> tuple[RankError, float]:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(
            _stuck_in_dp_all_reduce, world, stuck, how,
            timeout=DEADLINE_S, collective_timeout=TIMEOUT_S,
        )  # fmt: skip
    return info.value, time.monotonic() - start


@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_rank_stuck_before_a_dp_all_reduce_is_named_within_the_timeout(how):
    err, seconds = _failure(2, 1, how)
    assert err.rank == 0
    assert "DistributedError" in err.details
    assert (
        "comm.all_reduce: all_reduce on the dp group [0, 1] did not finish within 3 s: "
        "rank 1 is stuck"
    ) in err.details
    word = "stopped: no heartbeat" if how == "stop" else "running, but it has not reached"
    assert word in err.details
    assert seconds < DEADLINE_S / 2  # start-up + 3 s + the diagnosis, not the deadline


def test_three_ranks_name_the_one_that_is_stuck():
    # Rank 0 and rank 2 both wait; each must name rank 1 only (alive, but behind).
    err, _ = _failure(3, 1, "sleep")
    assert err.rank in (0, 2)
    assert "all_reduce on the dp group [0, 1, 2] did not finish within 3 s" in err.details
    assert "rank 1 is stuck (running, but it has not reached this call, number 2" in err.details


def _stuck_in(rank: int, op: str) -> None:
    """Rank 1 sleeps instead of joining ``op``: a pairwise all-gather on the dp group (gloo's
    exchange of point-to-point messages), or a recv from rank 1 on the default group."""
    st = initialize_model_parallel()
    try:
        if rank == 1:
            time.sleep(DEADLINE_S)
        if op == "all_gather":
            comm.all_gather(torch.ones(4), st.dp)
        else:
            comm.recv(torch.empty(4), 1)
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize(
    "op, what",
    [
        ("all_gather", "all_gather on the dp group [0, 1] did not finish within 3 s"),
        ("recv", "recv with rank 1 did not finish within 3 s"),
    ],
)
def test_a_rank_stuck_in_a_pairwise_exchange_or_recv_is_named(op, what):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_stuck_in, 2, op, timeout=DEADLINE_S, collective_timeout=TIMEOUT_S)
    assert info.value.rank == 0
    assert f"DistributedError: rank 0: comm.{op}: {what}: rank 1 is stuck" in info.value.details
    assert time.monotonic() - start < DEADLINE_S / 2


# -- under zerotron launch -------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, "tests", "distributed", "launch_scripts", "faults.py")
ALLREDUCE = os.path.join(REPO, "tests", "distributed", "launch_scripts", "allreduce.py")


def _launch(args: list[str], timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    start = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "zerotron", "launch", *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:  # a hang: leave no rank behind (they print their pid)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        for pid in re.findall(r"pid rank=\d+ pid=(\d+)", out):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        raise
    return r, time.monotonic() - start


def _summary(stderr: str) -> list[str]:
    prefix = "zerotron launch: "
    return [line.removeprefix(prefix) for line in stderr.splitlines() if line.startswith(prefix)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_launch_ends_a_job_with_a_stopped_rank_and_names_it():
    r, seconds = _launch(
        # The watchdog (test_watchdog_launch.py) would end the job before the timeout: off here.
        ["--nproc_per_node", "2", "--shutdown_timeout", "1", "--watchdog-timeout", "0"]
        + [FAULTS, "--mode", "stop", "--timeout-s", "3"]
    )
    summary = _summary(r.stderr)
    assert r.returncode == 1, r.stderr
    assert summary[1] == "rank 1 is stuck, named by rank 0", r.stderr
    assert summary[2] == "rank 0 failed first: exit code 1"
    assert summary[3].startswith(
        "cause: zerotron.errors.DistributedError: rank 0: comm.all_reduce: all_reduce on the dp "
        "group [0, 1] did not finish within 3 s: rank 1 is stuck (stopped: no heartbeat"
    )
    assert summary[-1] == "then: rank 1 killed by signal 9 (SIGKILL)"
    assert seconds < 40  # start-up, 3 s, the diagnosis, 1 s to SIGKILL: not 30 minutes
    pids = [int(p) for p in re.findall(r"pid rank=\d pid=(\d+)", r.stdout)]
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_launch_names_the_rank_with_the_clean_error_not_the_peer_that_saw_it_leave():
    r, _ = _launch(["--nproc_per_node", "2", FAULTS, "--mode", "clean-error"])
    summary = _summary(r.stderr)
    assert r.returncode == 2, r.stderr
    assert summary[1:4] == [
        "rank 1 failed first: exit code 2",
        "cause: zerotron pretrain: error: rank 1: data: bad batch at step 2",
        "rank 1's error:",
    ], r.stderr
    assert summary[-1].startswith("then: rank 0 ")  # exit code 1, or stopped while exiting


def test_launch_reports_a_rank_that_exited_0_while_its_peers_still_ran():
    r, _ = _launch(["--nproc_per_node", "2", FAULTS, "--mode", "exit0"])
    summary = _summary(r.stderr)
    assert r.returncode == 1, r.stderr
    assert summary[1] == (
        "rank 1 exited with code 0 while the other ranks were still running: the likely cause "
        "(rank 0 then failed waiting for it)"
    ), r.stderr
    assert summary[2] == "rank 0 failed first: exit code 1"
    assert "a peer left" in summary[3]


def test_launch_waiting_for_a_missing_node_says_so_and_times_out_cleanly():
    # Node 0 of 2 alone, with a 3 s rendezvous timeout: progress lines, then a clean error.
    with socket.socket() as s:
        s.bind(("", 0))
        port = str(s.getsockname()[1])
    r, seconds = _launch(
        ["--nnodes", "2", "--node_rank", "0", "--master_port", port, "--rdzv_timeout", "3"]
        + [ALLREDUCE]
    )
    summary = _summary(r.stderr)
    assert r.returncode == 2
    assert f"waiting for node 1 of 2 at 127.0.0.1:{port}, 1 s of 3" in summary
    assert r.stderr.endswith(
        f"zerotron launch: error: node 0: rendezvous timed out after 3 s: node 1 of 2 never "
        f"joined at 127.0.0.1:{port}\n  -> start `zerotron launch` on every node with the same "
        "--nnodes, --master_addr and --master_port, and a distinct --node_rank; raise "
        "--rdzv_timeout if nodes start late\n"
    )
    assert "frame #" not in r.stderr and seconds < 30


def test_launch_refuses_an_unresolvable_master_addr_in_seconds():
    r, seconds = _launch(
        ["--nnodes", "2", "--node_rank", "1", "--master_addr", "no-such-host.invalid", ALLREDUCE]
    )
    assert r.returncode == 2
    assert r.stderr.startswith(
        "zerotron launch: error: --master_addr 'no-such-host.invalid' does not resolve: "
    )
    assert "Traceback" not in r.stderr and seconds < 30  # was the 900 s --rdzv_timeout
