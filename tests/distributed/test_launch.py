"""zerotron launch, real runs: ranks and their environment, rank-prefixed output, per-rank logs,
a failing rank taking the job down (named, with its traceback and exit code), restarts, two
nodes on one machine. (Bad flags and the launcher's pieces: tests/test_launch.py.)

Each test starts the launcher as a subprocess (``python -m zerotron.launcher.launch``) on scripts
in tests/distributed/launch_scripts/ that use plain torch.distributed (gloo).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "tests", "distributed", "launch_scripts")
ALLREDUCE = os.path.join(SCRIPTS, "allreduce.py")
FAIL_AT_STEP = os.path.join(SCRIPTS, "fail_at_step.py")


def _env(drop=(), **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def _launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 60):
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "zerotron.launcher.launch", *args],
        cwd=REPO,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - start


def _reports(stdout: str) -> dict[int, dict[str, str]]:
    """rank -> fields of the 'report' line that rank printed (through its [rankN]: prefix)."""
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\[rank(\d+)\]: report (.*?) argv=(.*)$", line)
        if m:
            fields = dict(kv.split("=", 1) for kv in m.group(2).split(" ") if "=" in kv)
            fields["argv"] = m.group(3)
            out[int(m.group(1))] = fields
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- real runs ----------------------------------------------------------------------------------


def test_three_ranks_allreduce_prefixed_output_logs_local_rank_omp(tmp_path):
    n, logs = 3, tmp_path / "logs"
    r, _ = _launch(
        ["--nproc_per_node", str(n), "--log_dir", str(logs), ALLREDUCE, "--tag", "a b"],
        env=_env(drop=("OMP_NUM_THREADS",)),
    )
    assert r.returncode == 0, r.stderr
    omp = str(max(1, len(os.sched_getaffinity(0)) // n))
    reports = _reports(r.stdout)
    assert sorted(reports) == list(range(n))
    for rank, f in reports.items():
        assert f["rank"] == str(rank) and f["world"] == str(n)
        assert float(f["sum"]) == sum(range(1, n + 1))  # all_reduce of rank + 1
        assert f["local_rank_arg"] == f["local_rank_env"] == str(rank)
        assert f["omp"] == omp
        # --local_rank goes first; the script's own arguments follow untouched (no shell).
        assert f["argv"] == repr([f"--local_rank={rank}", "--tag", "a b"])
    # Every line the workers printed carries its rank; stderr lines too.
    assert all(re.match(r"\[rank\d\]: ", line) for line in r.stdout.splitlines())
    for rank in range(n):
        assert f"[rank{rank}]: to stderr from rank {rank}\n" in r.stderr
    # One log per rank, holding that rank's stdout and stderr, without prefixes.
    assert sorted(os.listdir(logs)) == [f"rank{i}.log" for i in range(n)]
    for rank in range(n):
        text = (logs / f"rank{rank}.log").read_text()
        assert text.startswith(f"report rank={rank} ")
        assert f"to stderr from rank {rank}\n" in text
        assert "[rank" not in text and len(text.splitlines()) == 2


def test_module_form_without_local_rank_keeps_omp_setting():
    r, _ = _launch(
        ["--nproc_per_node", "2", "--no_local_rank"]
        + ["-m", "tests.distributed.launch_scripts.allreduce", "--tag", "m"],
        env=_env(OMP_NUM_THREADS="5"),
    )
    assert r.returncode == 0, r.stderr
    reports = _reports(r.stdout)
    assert sorted(reports) == [0, 1]
    for rank, f in reports.items():
        assert float(f["sum"]) == 3 and f["local_rank_arg"] == "None"
        assert f["local_rank_env"] == str(rank) and f["omp"] == "5"
        assert f["argv"] == repr(["--tag", "m"])


def test_zerotron_cli_gets_no_local_rank_flag():
    # A --local_rank in front of zerotron's subcommand would be an unknown command (exit 2).
    r, _ = _launch(["--nproc_per_node", "2", "-m", "zerotron", "--help"])
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: usage: zerotron <command>" in r.stdout


@pytest.mark.timing  # bounds the launcher's wall-clock time
def test_rank_raising_at_step_2_takes_the_job_down_and_is_named(tmp_path):
    # Rank 1 raises at step 2 while rank 0 waits in that step's all-reduce.
    r, seconds = _launch(["--nproc_per_node", "2", "--log_dir", str(tmp_path), FAIL_AT_STEP])
    assert seconds < 30
    assert r.returncode == 1
    summary = [
        line.removeprefix("zerotron launch: ")
        for line in r.stderr.splitlines()
        if line.startswith("zerotron launch: ")
    ]
    # rank 1 may still be exiting when the launcher stops it: it still raised, exit code 1
    assert re.fullmatch(
        r"rank 1 failed first: (exit code 1|raised an exception, then was killed by signal 15 "
        r"\(SIGTERM\) while exiting)",
        summary[1],
    )
    assert summary[2] == "cause: RuntimeError: rank 1 gives up at step 2"
    assert summary[3] == "rank 1's traceback:"
    assert summary[4] == "  Traceback (most recent call last):"
    assert summary[-3] == "  RuntimeError: rank 1 gives up at step 2"
    assert summary[-2].startswith("then: rank 0 ")
    assert summary[-1] == f"rank 1's full output: {tmp_path / 'rank1.log'}"
    assert "[rank0]: step 1 done" in r.stdout and "step 2 done" not in r.stdout
    pids = [int(p) for p in re.findall(r"pid rank=\d pid=(\d+)", r.stdout)]
    assert len(pids) == 2 and all(_gone(p) for p in pids)


@pytest.mark.parametrize("mode,signum,name", [("kill9", 9, "SIGKILL"), ("segv", 11, "SIGSEGV")])
def test_rank_killed_by_a_signal_is_named_with_it(mode, signum, name):
    # Rank 1 dies of a signal at step 2 (no Python error at all) while rank 0 waits in the
    # all-reduce and then fails because its peer left: rank 1 is the cause, its exit code a
    # shell's 128 + N.
    r, seconds = _launch(["--nproc_per_node", "2", FAIL_AT_STEP, "--mode", mode])
    assert seconds < 30
    assert r.returncode == 128 + signum
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("zerotron launch: ")]
    assert lines[1] == f"zerotron launch: rank 1 failed first: killed by signal {signum} ({name})"
    assert any(ln.startswith("zerotron launch: then: rank 0 ") for ln in lines)
    pids = [int(p) for p in re.findall(r"pid rank=\d pid=(\d+)", r.stdout)]
    assert len(pids) == 2 and all(_gone(p) for p in pids)


@pytest.mark.timing  # the SIGKILL deadline is told apart from the agent's wait by wall-clock
def test_rank_dying_with_exit_3_is_named_and_sigterm_ignorers_are_killed():
    # Rank 1 calls os._exit(3); rank 0 ignores SIGTERM and sleeps: the deadline must SIGKILL it
    # (the agent alone would wait 30 s).
    r, seconds = _launch(
        ["--nproc_per_node", "2", "--shutdown_timeout", "1", FAIL_AT_STEP, "--mode", "exit3"]
    )
    assert r.returncode == 3
    # ~5 s alone; under a loaded 2-core suite start-up alone has taken 15 s. Without the kill
    # the agent's own 30 s wait comes on top, so 25 s still tells the two apart.
    assert seconds < 25
    assert "zerotron launch: rank 1 failed first: exit code 3\n" in r.stderr
    assert "zerotron launch: rank 1 wrote nothing to stderr\n" in r.stderr
    assert "zerotron launch: then: rank 0 killed by signal 9 (SIGKILL)\n" in r.stderr
    pids = [int(p) for p in re.findall(r"pid rank=\d pid=(\d+)", r.stdout)]
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_max_restarts_starts_the_workers_again_on_a_fresh_store(tmp_path):
    # The first attempt fails at step 2; the restarted workers must rendezvous anew (a reused
    # store hands them the dead attempt's addresses) and finish all 5 steps (2.5 s), outliving
    # the first failure's 1 s SIGKILL deadline, which is not theirs.
    r, _ = _launch(
        ["--nproc_per_node", "2", "--max_restarts", "1", "--shutdown_timeout", "1"]
        + ["--log_dir", str(tmp_path), FAIL_AT_STEP, "--fail-attempts", "1"]
        + ["--step-seconds", "0.5"]
    )
    assert r.returncode == 0, r.stderr
    assert "zerotron launch: a rank failed; restart 1\n" in r.stderr
    log = (tmp_path / "rank1.log").read_text().splitlines()
    marker = log.index("--- zerotron launch: restart 1 ---")
    assert log[marker - 1] == "[rank1]: RuntimeError: rank 1 gives up at step 2"
    assert log[marker + 2 :] == [f"step {i} done" for i in range(5)]
    assert r.stdout.count("[rank0]: step 4 done") == 1


def test_two_nodes_on_localhost_make_one_job_of_four_ranks():
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc_per_node", "2", "--master_port", port]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "zerotron.launcher.launch", *common, "--node_rank", "1", ALLREDUCE],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        r0, _ = _launch([*common, "--node_rank", "0", ALLREDUCE])
        out1, err1 = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert r0.returncode == 0 and node1.returncode == 0, r0.stderr + err1
    node0, node1_reports = _reports(r0.stdout), _reports(out1)
    assert sorted(node0) == [0, 1] and sorted(node1_reports) == [2, 3]
    for rank, f in {**node0, **node1_reports}.items():
        assert f["world"] == "4" and float(f["sum"]) == 1 + 2 + 3 + 4
        assert f["local_rank_env"] == str(rank % 2)
