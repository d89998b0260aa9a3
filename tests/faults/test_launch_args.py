"""Launcher faults without starting ranks (issue 19): an unresolvable --master_addr is refused in
seconds (F6), and the failure summary names the rank that failed on its own, not the peer that
saw it leave, reports a rank that exited 0 early (F3), names a stuck rank, and shows the cause
before the details with C++ frames folded. (Runs with ranks: tests/distributed/test_faults_dist.py.)
"""

from __future__ import annotations

import os
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from zerotron.errors import ConfigError
from zerotron.launcher import launch
from zerotron.launcher.failures import summarize_failures

SCRIPT = __file__  # any existing file will do: nothing is started


class _Tails:
    """Stands in for RankStreams: stderr lines per rank with arrival times, last output times."""

    def __init__(self, tails: dict[int, list[tuple[float, str]]]):
        self.tails = tails

    def tail(self, rank):
        return self.tails.get(rank, [])

    def last_output(self, rank):
        lines = self.tails.get(rank)
        return lines[-1][0] if lines else float("-inf")

    def log_path(self, rank):
        return None


def _failure(rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="/none")


def _traceback(t: float, *error: str) -> list[tuple[float, str]]:
    frames = [(t, "Traceback (most recent call last):"), (t, '  File "x.py", line 1, in <module>')]
    return frames + [(t, line) for line in error]


def test_unresolvable_master_addr_is_refused_at_once():
    start = time.monotonic()
    with pytest.raises(ConfigError, match="--master_addr 'no-such-host.invalid' does not resolve"):
        launch.plan_from_args(
            ["--nnodes", "2", "--node_rank", "1", "--master_addr", "no-such-host.invalid", SCRIPT]
        )
    assert time.monotonic() - start < launch.RESOLVE_LIMIT_S


def test_unwritable_log_dir_is_refused_before_any_rank_starts(tmp_path):
    """--log_dir on a read-only directory is a ConfigError naming the flag (F5), found when the
    plan is made, not when the first rank writes its log."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK) and os.geteuid() == 0:  # root writes anyway: use a file
            target = tmp_path / "a-file"
            target.write_text("x")
        else:
            target = ro / "logs"
        with pytest.raises(ConfigError) as e:
            launch.plan_from_args(["--nproc_per_node", "1", "--log_dir", str(target), SCRIPT])
        assert e.value.where == "--log_dir"
    finally:
        ro.chmod(0o700)


def test_the_rank_with_a_clean_error_is_named_over_a_peer_that_failed_earlier():
    # Rank 0 saw the connection close (t=1.0) before rank 1's own error line arrived (t=1.1)
    # and before rank 1 exited (t=2.0): rank 1 failed on its own, rank 0 because it left.
    failures = {0: _failure(0, 1), 1: _failure(1, 2)}
    tails = {
        0: _traceback(1.0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"),
        1: [(1.1, "zerotron pretrain: error: rank 1: data: bad batch"), (1.1, "  -> fix it")],
    }
    code, text = summarize_failures(failures, {100: 1.2, 101: 2.0}, _Tails(tails))
    assert code == 2
    assert text.splitlines() == [
        "rank 1 failed first: exit code 2",
        "cause: zerotron pretrain: error: rank 1: data: bad batch",
        "rank 1's error:",
        "  zerotron pretrain: error: rank 1: data: bad batch",
        "    -> fix it",
        "then: rank 0 exit code 1",
    ]


def test_a_rank_that_exited_0_while_its_peer_waited_is_named_as_the_cause():
    failures = {0: _failure(0, 1)}
    tails = {0: _traceback(3.0, "DistributedError: all_reduce ... failed: a peer left (...)")}
    code, text = summarize_failures(failures, {100: 3.5}, _Tails(tails), finished={1: 3.2})
    assert code == 1
    assert text.splitlines()[:2] == [
        "rank 1 exited with code 0 while the other ranks were still running: the likely cause "
        "(rank 0 then failed waiting for it)",
        "rank 0 failed first: exit code 1",
    ]


def test_a_stuck_rank_named_by_a_timed_out_collective_is_said_first():
    failures = {0: _failure(0, 1), 1: _failure(1, -9)}
    error = (
        "zerotron.errors.DistributedError: rank 0: comm.all_reduce: all_reduce on the dp group "
        "[0, 1] did not finish within 3 s: rank 1 is stuck (stopped: no heartbeat)"
    )
    code, text = summarize_failures(
        failures, {100: 5.0, 101: 6.0}, _Tails({0: _traceback(4.0, error)}), killed={101}
    )
    assert code == 1
    assert text.splitlines()[:3] == [
        "rank 1 is stuck, named by rank 0",
        "rank 0 failed first: exit code 1",
        f"cause: {error}",
    ]
    assert text.splitlines()[-1] == "then: rank 1 killed by signal 9 (SIGKILL)"


def test_a_rank_killed_by_sigkill_is_the_cause_even_when_its_exit_is_seen_late():
    # kill -9 (or the OOM killer) of rank 1; rank 0's gloo error arrives at 1.0, but the agent
    # reaped rank 1 before the watchdog looked, so its exit is stamped 1.5. The launcher never
    # sent SIGKILL (killed is empty): rank 1 failed on its own.
    failures = {0: _failure(0, 1), 1: _failure(1, -9)}
    error = (
        "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:62617: Software caused connection "
        "abort. This is typically caused by a remote worker crashing. Check the logs of the "
        "remote worker before reporting an error. GLHF!"
    )
    code, text = summarize_failures(
        failures, {100: 1.2, 101: 1.5}, _Tails({0: _traceback(1.0, error)}), killed=set()
    )
    assert code == 137
    assert text.splitlines()[0] == "rank 1 failed first: killed by signal 9 (SIGKILL)"


def test_cause_comes_first_and_cpp_frames_are_folded():
    cpp = [f"frame #{i}: <unknown function> + 0x{i:x} (0x7f in libtorch_cpu.so)" for i in range(50)]
    error = [
        "torch.distributed.DistNetworkError: The client socket has timed out",
        "Exception raised from throwTimeoutError at socket.cpp:1030 (most recent call first):",
        *cpp,
    ]
    code, text = summarize_failures(
        {0: _failure(0, 1)}, {100: 2.0}, _Tails({0: _traceback(1.0, *error)})
    )
    lines = text.splitlines()
    assert lines[:3] == [
        "rank 0 failed first: exit code 1",
        "cause: torch.distributed.DistNetworkError: The client socket has timed out",
        "rank 0's traceback:",
    ]
    assert lines[-1] == "  [50 C++ stack frames left out]" and len(lines) == 8
