"""zerotron launch without starting ranks: bad flags (raised before anything starts, exit 2
through the CLI), worker arguments, the plan from argv, rank-prefixed streams and the failure
summary. (Real runs: tests/distributed/test_launch.py.)
"""

from __future__ import annotations

import io
import os
import re
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from zerotron import cli
from zerotron.errors import ConfigError, LaunchError
from zerotron.launcher import launch
from zerotron.launcher.failures import summarize_failures, traceback_start
from zerotron.launcher.output import RankStreams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLREDUCE = os.path.join(REPO, "tests", "distributed", "launch_scripts", "allreduce.py")


# -- bad flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, error, text",
    [
        (["--nproc_per_node", "0", ALLREDUCE], ConfigError, "--nproc_per_node must be at least 1"),
        (["--nnodes", "2", "--node_rank", "2", ALLREDUCE], ConfigError, "--node_rank 2 is not"),
        (["--master_port", "70000", ALLREDUCE], ConfigError, "--master_port must be in"),
        (["--nproc_per_node", "2"], ConfigError, "no program to run"),
        (["--nproc_per_node", "2", "no/such/train.py"], LaunchError, "not found"),
        (["-m", "no_such_module_xyz"], LaunchError, "no module named 'no_such_module_xyz'"),
        (["--nproc_per_nod", "2", ALLREDUCE], ConfigError, "--nproc_per_node"),
    ],
)
def test_bad_flags_raise_before_anything_starts(argv, error, text):
    with pytest.raises(error, match=re.escape(text)):
        launch.main(argv)


def test_bad_flags_exit_2_through_the_cli(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "launch", ("zerotron.launcher.launch", "launch"))
    assert cli.main(["launch", "--nproc_per_node", "0", ALLREDUCE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerotron launch: error: --nproc_per_node must be at least 1, got 0")
    assert cli.main(["launch", "missing.py"]) == 2
    assert "training script 'missing.py' not found" in capsys.readouterr().err


# -- pieces -------------------------------------------------------------------------------------


def test_worker_args_place_local_rank_after_the_program():
    assert launch.worker_args("t.py", ["--x", "1"], module=False, no_local_rank=False) == [
        "-u",
        "t.py",
        "--local_rank=${local_rank}",
        "--x",
        "1",
    ]
    assert launch.worker_args("pkg.t", ["a"], module=True, no_local_rank=True) == [
        "-u",
        "-m",
        "pkg.t",
        "a",
    ]
    assert launch.worker_args("zerotron", ["pretrain"], module=True, no_local_rank=False) == [
        "-u",
        "-m",
        "zerotron",
        "pretrain",
    ]


def _wait_for(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_everything_after_the_script_belongs_to_it():
    plan = launch.plan_from_args(
        ["--nproc_per_node", "2", ALLREDUCE, "--nproc_per_node", "3", "-m", "--log_dir", "x"]
    )
    assert plan.nproc_per_node == 2 and plan.log_dir is None
    assert plan.worker_args == ["-u", ALLREDUCE, "--local_rank=${local_rank}"] + [
        "--nproc_per_node",
        "3",
        "-m",
        "--log_dir",
        "x",
    ]


def test_rank_streams_prefix_lines_once_and_keep_stderr_tail(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    streams = RankStreams(log_dir=str(tmp_path), stdout=out, stderr=err)
    with streams:
        dest = streams.reify({0: {"RANK": "5"}, 1: {"RANK": "6"}})
        with open(dest.stdouts[0], "wb") as o, open(dest.stderrs[0], "wb") as e:
            o.write(b"one\ntw")
            o.flush()
            _wait_for(lambda: "one" in out.getvalue())
            e.write(b"[rank5]: Traceback\n")  # torch.distributed's own excepthook prefix
            e.flush()
            _wait_for(lambda: err.getvalue())
            o.write(b"o\nthree")  # no newline at the end: still printed at the end
        # A progress bar redraws with \r: each state is a line; \r\n split over writes is one end.
        with open(dest.stdouts[1], "wb") as o, open(dest.stderrs[1], "wb"):
            o.write(b"10%\r20%\r")
            o.flush()
            _wait_for(lambda: "10%" in out.getvalue())
            o.write(b"\nend\n")
    lines = out.getvalue().splitlines()
    assert [x for x in lines if x.startswith("[rank5]")] == [
        "[rank5]: one",
        "[rank5]: two",
        "[rank5]: three",
    ]
    assert [x for x in lines if x.startswith("[rank6]")] == [
        "[rank6]: 10%",
        "[rank6]: 20%",
        "[rank6]: end",
    ]
    assert len(lines) == 6
    assert err.getvalue() == "[rank5]: Traceback\n"
    assert [text for _, text in streams.tail(5)] == ["Traceback"] and streams.tail(6) == []
    assert (tmp_path / "rank5.log").read_bytes() == b"one\n[rank5]: Traceback\ntwo\nthree\n"
    assert (tmp_path / "rank6.log").read_bytes() == b"10%\n20%\nend\n"


def test_rank_streams_restart_for_changed_nodes_under_the_same_restart_count(tmp_path):
    """torch starts the workers again without counting a restart when a node joins or leaves
    (TORCHELASTIC_RESTART_COUNT stays): each start still gets its own pipes, its output follows
    the last start's in the rank's log, and the console says why it restarted."""
    out, err = io.StringIO(), io.StringIO()
    streams = RankStreams(log_dir=str(tmp_path), stdout=out, stderr=err)
    with streams:
        for i, (count, text) in enumerate(((0, b"first\n"), (0, b"second\n"), (1, b"third\n"))):
            dest = streams.reify({0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": str(count)}})
            with open(dest.stdouts[0], "wb") as o, open(dest.stderrs[0], "wb"):
                o.write(text)
            _wait_for(lambda text=text: text.decode().strip() in out.getvalue())
            _wait_for(lambda i=i: err.getvalue().count("restart") == i)
    assert err.getvalue() == (
        "zerotron launch: the nodes changed; restart 1\nzerotron launch: a rank failed; restart 2\n"
    )
    log = (tmp_path / "rank0.log").read_text()
    assert log == (
        "first\n--- zerotron launch: restart 1 ---\nsecond\n--- zerotron launch: restart 2 ---\n"
        "third\n"
    )


class _Tails:
    """Stands in for RankStreams: stderr lines per rank with arrival times, last output times."""

    def __init__(self, tails: dict[int, list[tuple[float, str]]], last: dict[int, float]):
        self.tails, self.last = tails, last

    def tail(self, rank):
        return self.tails.get(rank, [])

    def last_output(self, rank):
        return self.last.get(rank, float("-inf"))

    def log_path(self, rank):
        return None


def _failure(rank: int, pid: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file="/nonexistent")


def _traceback(t: float, error: str) -> list[tuple[float, str]]:
    return [(t, "Traceback (most recent call last):"), (t, '  File "x"'), (t, error)]


def test_summary_names_the_rank_that_failed_first_not_the_lowest_or_first_to_exit():
    # Rank 2 raised first (t=4.0) but was still tearing down when rank 0 failed on the broken
    # connection (t=4.5) and the launcher stopped it; rank 1 had handled an exception long
    # before and kept printing (until 3.9), then was stopped too.
    failures = {0: _failure(0, 100, 1), 1: _failure(1, 101, -15), 2: _failure(2, 102, -15)}
    exit_times = {100: 4.6, 101: 4.7, 102: 4.8}
    tails = {
        0: _traceback(4.5, "RuntimeError: Connection closed by peer"),
        1: _traceback(0.2, "KeyError: handled"),
        2: [(0.5, "noise")] + _traceback(4.0, "ValueError: v"),
    }
    last = {0: 4.5, 1: 3.9, 2: 4.0}
    code, text = summarize_failures(failures, exit_times, _Tails(tails, last))
    assert code == 1
    assert text.splitlines() == [
        "rank 2 failed first: raised an exception, then was killed by signal 15 (SIGTERM) "
        "while exiting",
        "cause: ValueError: v",
        "rank 2's traceback:",
        "  Traceback (most recent call last):",
        '    File "x"',
        "  ValueError: v",
        "then: rank 0 exit code 1, rank 1 killed by signal 15 (SIGTERM)",
    ]
    # Without rank 2, the handled exception of rank 1 does not count: rank 0 failed first.
    del failures[2]
    code, text = summarize_failures(failures, exit_times, _Tails(tails, last))
    assert (code, text.splitlines()[0]) == (1, "rank 0 failed first: exit code 1")
    # A rank that died without a word (exit time 1.2) is first if its peers' tracebacks came
    # later; a signal N gives the shell's exit code 128 + N; an exit code is passed on as is.
    failures = {0: _failure(0, 100, 1), 3: _failure(3, 5, -9)}
    tails = {0: _traceback(1.3, "RuntimeError: Connection reset"), 3: [(0.1, "a"), (0.2, "b")]}
    last = {0: 1.3, 3: 0.2}
    code, text = summarize_failures(failures, {5: 1.2, 100: 1.4}, _Tails(tails, last))
    assert code == 137
    assert text.splitlines() == [
        "rank 3 failed first: killed by signal 9 (SIGKILL)",
        "rank 3's last lines on stderr:",
        "  a",
        "  b",
        "then: rank 0 exit code 1",
    ]
    code, _ = summarize_failures({0: _failure(0, 100, 2)}, {}, _Tails({}, {}))
    assert code == 2


def test_traceback_start_keeps_chained_exceptions_and_drops_older_ones():
    lines = [
        "Traceback (most recent call last):",
        "OldError: handled long ago",
        "step 7",
        "Traceback (most recent call last):",
        "KeyError: 1",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        "ValueError: 2",
    ]
    assert traceback_start(lines) == 3
    assert traceback_start(["no", "traceback"]) is None
