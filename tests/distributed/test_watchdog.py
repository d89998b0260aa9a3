"""The collective watchdog without processes: a rank's reports, and the launcher's summary.

The rank side (zerotron.distributed.watchdog) runs in this process on a fake call; the
launcher side (zerotron.launcher.hangs) reads report files written here. The end-to-end runs
under zerotron launch are in test_watchdog_launch.py.
"""

import json
import os
import time
from types import SimpleNamespace

import pytest

from zerotron.distributed import watchdog
from zerotron.launcher.hangs import HANG_EXIT_CODE, HangWatch, summarize


def _call(op="all_reduce", group="dp", ranks=(0, 1), number=2, peers=None, nbytes=16):
    return SimpleNamespace(
        op=op, group=SimpleNamespace(name=group, ranks=ranks), number=number, peers=peers,
        nbytes=nbytes,
    )  # fmt: skip


def test_enter_and_leave_keep_one_wait_per_thread():
    outer = watchdog.enter(_call(number=1))
    inner = watchdog.enter(_call(op="barrier", number=2))
    assert list(watchdog._waits.values()) == [inner]
    watchdog.leave(inner)
    assert list(watchdog._waits.values()) == [outer]
    watchdog.leave(outer)
    assert watchdog._waits == {}


def test_threshold_default_is_a_quarter_of_the_timeout_and_the_env_overrides(monkeypatch):
    monkeypatch.delenv(watchdog.ENV_TIMEOUT, raising=False)
    assert watchdog.threshold_for(600) == 150
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "2.5")
    assert watchdog.threshold_for(600) == 2.5
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "0")
    assert watchdog.threshold_for(600) is None


def _wait_for(path, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def _stuck_here(dog, tmp_path):
    """Wait 'in' an all-reduce until the watchdog reported it (this frame is in the stack)."""
    wait = watchdog.enter(_call())
    try:
        return _wait_for(tmp_path / f"rank3.{os.getpid()}.json")
    finally:
        watchdog.leave(wait)


def test_a_wait_past_the_threshold_is_reported_with_the_stacks(tmp_path, capsys):
    dog = watchdog._Dog(3, 0.2, str(tmp_path))
    dog.thread.start()
    try:
        report = _stuck_here(dog, tmp_path)
        # Asked while waiting in nothing: it answers with waiting None.
        os.remove(tmp_path / f"rank3.{os.getpid()}.json")
        (tmp_path / watchdog.REQUEST).write_text("1")
        answer = _wait_for(tmp_path / f"rank3.{os.getpid()}.json")
    finally:
        dog.stop.set()
        dog.thread.join()
    assert report["kind"] == "stuck" and report["rank"] == 3 and report["pid"] == os.getpid()
    w = report["waiting"]
    assert (w["op"], w["group"], w["ranks"], w["seq"], w["bytes"]) == (
        "all_reduce",
        "dp",
        [0, 1],
        2,
        16,
    )
    assert 0.2 <= w["waited_s"] < 5
    main = next(iter(report["stacks"].values()))
    assert "in _stuck_here" in main and "zerotron-watchdog" not in report["stacks"]
    assert capsys.readouterr().err.startswith(
        "zerotron watchdog: rank 3 has waited 0.2 s in all_reduce on the dp group [0, 1] "
        "(call 2 on the group, 16 bytes)"
    )
    assert answer["kind"] == "answer" and answer["waiting"] is None
    assert report["heard"] == {}  # no heartbeat in this process to read the members' counts
    assert report["busy"] is None and answer["busy"] is None


def test_a_rank_busy_on_purpose_says_so_in_its_answer(tmp_path):
    dog = watchdog._Dog(3, 0.2, str(tmp_path))
    dog.thread.start()
    try:
        with watchdog.busy("writing its checkpoint files"):
            (tmp_path / watchdog.REQUEST).write_text("1")
            answer = _wait_for(tmp_path / f"rank3.{os.getpid()}.json")
    finally:
        dog.stop.set()
        dog.thread.join()
    assert answer["busy"] == "writing its checkpoint files"
    assert watchdog._busy == []


# -- the launcher's summary --------------------------------------------------------------------


def _report(rank, waiting=None, threshold=1.0, kind="answer"):
    stacks = {"MainThread": f'  File "train.py", line {rank}\n'}
    return {"kind": kind, "rank": rank, "pid": 100 + rank, "threshold_s": threshold,
            "waiting": waiting, "stacks": stacks}  # fmt: skip


def _w(op="all_reduce", group="dp", ranks=(0, 1, 2), seq=5, peers=None, waited=3.0):
    return {"op": op, "group": group, "ranks": list(ranks), "seq": seq, "bytes": 64,
            "peers": peers, "waited_s": waited}  # fmt: skip


def test_summary_names_the_rank_that_is_busy_elsewhere():
    reports = {0: _report(0, _w()), 1: _report(1), 2: _report(2, _w())}
    lines = summarize(reports, {0, 1, 2}, [0, 1, 2])
    assert lines[0] == (
        "ranks 0, 2 waited 3.0 s in all_reduce on the dp group [0, 1, 2] (call 5 on the group, "
        "64 bytes)"
    )
    assert lines[1] == "never arrived: rank 1"
    assert lines[2].startswith("rank 1 is not waiting in a collective")
    assert lines[3] == '    File "train.py", line 1'  # the stack's own indent, and two more


def test_summary_names_a_rank_behind_in_another_op_or_silent():
    reports = {
        0: _report(0, _w()),
        1: _report(1, _w(op="barrier", seq=4, waited=0.5)),
        2: _report(2, _w(op="all_gather", group="tp", ranks=(2, 3), seq=1)),
    }
    lines = summarize(reports, {0, 1, 2}, [0, 1, 2, 3])
    assert "never arrived: ranks 1, 2, 3" in lines
    assert "rank 1 is behind: it waits in call 4 (barrier) on that group" in lines
    assert any(line.startswith("rank 2 waits elsewhere: in all_gather on the tp group [2, 3]")
               for line in lines)  # fmt: skip
    # Rank 2's own wait: rank 3 did not answer; a rank on another node is said to be there.
    assert (
        "rank 3 did not answer (stopped, crashed in C++, or holding the interpreter lock)" in lines
    )
    lines = summarize({0: _report(0, _w(ranks=(0, 7)))}, {0}, [0])
    assert lines[-1] == "rank 7 is on another node (its own launcher reports on it)"


def test_summary_judges_a_member_on_another_node_by_its_heartbeat():
    behind = _report(0, _w(ranks=(0, 7)))
    behind["heard"] = {"7": 4}  # rank 7 entered 4 calls on the group; this is call 5
    lines = summarize({0: behind}, {0}, [0])
    assert lines[1:] == [
        "never arrived: rank 7",
        "rank 7 is on another node, and behind: its heartbeat says it entered 4 calls on that "
        "group",
    ]
    there = _report(0, _w(ranks=(0, 7)))
    there["heard"] = {"7": 5}  # in this call too, waiting on its own node
    assert summarize({0: there}, {0}, [0])[-1] == (
        "no rank could be named as missing: every member is waiting"
    )


def test_summary_of_point_to_point_names_the_peer_or_an_ordering_deadlock():
    p2p = _w(op="batch_isend_irecv", peers=[1])
    lines = summarize({0: _report(0, p2p), 1: _report(1)}, {0, 1}, [0, 1])
    assert lines[:2] == ["rank 0 waited 3.0 s in batch_isend_irecv with rank 1 (64 bytes)",
                         "never arrived: rank 1"]  # fmt: skip
    both = {0: _report(0, p2p), 1: _report(1, _w(op="batch_isend_irecv", peers=[0]))}
    lines = summarize(both, {0, 1}, [0, 1])
    assert (
        "ranks 0, 1 wait for each other in point-to-point messages that do not match (an "
        "ordering deadlock)" in lines
    )
    assert lines[-1] == "no rank could be named as missing: every member is waiting"


def _write(tmp_path, report):
    (tmp_path / f"rank{report['rank']}.{report['pid']}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("action", ["abort", "wait"])
def test_hang_watch_asks_every_rank_then_acts(tmp_path, action):
    said = []
    watch = HangWatch(str(tmp_path), action, said.append, grace_s=0.0)
    workers = {100: 0, 101: 1}
    assert watch.poll(workers) is False and said == []
    _write(tmp_path, _report(0, _w(ranks=(0, 1)), kind="stuck"))
    assert watch.poll(workers) is False
    assert said[-1].endswith("; asking every rank where it is")
    assert (tmp_path / watchdog.REQUEST).exists()
    time.sleep(0.01)
    _write(tmp_path, _report(0, _w(ranks=(0, 1))))
    _write(tmp_path, _report(1))
    assert watch.poll(workers) is (action == "abort")
    assert "watchdog: never arrived: rank 1" in said
    if action == "abort":
        assert said[-1].startswith(f"watchdog: ending the job (exit code {HANG_EXIT_CODE})")
        assert watch.aborted
    else:
        assert said[-1] == "watchdog: --watchdog-action wait: the job keeps waiting"
        assert watch.poll(workers) is False  # the same wait is not reported twice


def test_hang_watch_keeps_waiting_while_a_rank_writes_its_checkpoint(tmp_path):
    said = []
    watch = HangWatch(str(tmp_path), "abort", said.append, grace_s=0.0)
    workers = {100: 0, 101: 1}
    _write(tmp_path, _report(0, _w(ranks=(0, 1)), threshold=0.2, kind="stuck"))
    assert watch.poll(workers) is False  # asks
    time.sleep(0.01)
    _write(tmp_path, _report(0, _w(ranks=(0, 1)), threshold=0.2))
    _write(tmp_path, {**_report(1), "busy": "writing its checkpoint files"})
    assert watch.poll(workers) is False and not watch.aborted
    assert said[-1] == "watchdog: rank 1 is writing its checkpoint files: the job keeps waiting"
    assert watch.poll(workers) is False  # not asked again before another threshold
    time.sleep(0.25)
    assert watch.poll(workers) is False  # the wait outlasted a threshold: asks again
    assert said[-1].endswith("; asking every rank where it is")
    time.sleep(0.01)
    _write(tmp_path, _report(0, _w(ranks=(0, 1)), threshold=0.2))
    _write(tmp_path, _report(1))  # done writing, and still not arriving: a hang
    assert watch.poll(workers) is True and watch.aborted


def test_launch_flags_and_environment(monkeypatch):
    from zerotron.errors import ConfigError
    from zerotron.launcher.launch import plan_from_args

    script = os.path.join(os.path.dirname(__file__), "launch_scripts", "hang.py")
    monkeypatch.delenv("ZEROTRON_WATCHDOG_TIMEOUT", raising=False)
    monkeypatch.delenv("ZEROTRON_WATCHDOG_ACTION", raising=False)
    plan = plan_from_args([script])
    assert (plan.watchdog_timeout, plan.watchdog_action) == (None, "abort")
    plan = plan_from_args(["--watchdog-timeout", "30", "--watchdog-action", "wait", script])
    assert (plan.watchdog_timeout, plan.watchdog_action) == (30.0, "wait")
    monkeypatch.setenv("ZEROTRON_WATCHDOG_TIMEOUT", "45")
    monkeypatch.setenv("ZEROTRON_WATCHDOG_ACTION", "wait")
    plan = plan_from_args([script])
    assert (plan.watchdog_timeout, plan.watchdog_action) == (45.0, "wait")
    with pytest.raises(ConfigError, match="--watchdog-timeout must be >= 0 seconds"):
        plan_from_args(["--watchdog-timeout", "-1", script])
    monkeypatch.setenv("ZEROTRON_WATCHDOG_ACTION", "explode")
    with pytest.raises(ConfigError, match="watchdog action 'explode' is not one of abort, wait"):
        plan_from_args([script])
