"""zerotron launch, what happens to the worker processes: with --bind_core_list each rank runs on
exactly its share of the CPUs, --save_pid writes the launcher's PID, and when the launcher is
killed with SIGKILL (no chance to clean up) the kernel takes both ranks with it.

One 2-rank job serves every test (module fixture): the ranks report and wait; the fixture reads
the PID file, SIGKILLs the launcher and watches the ranks' PIDs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "distributed", "launch_scripts", "report_and_wait.py")
GONE_WITHIN_S = 5.0

pytestmark = pytest.mark.xdist_group("launch_process")


def _gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for its new parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    cpus = sorted(os.sched_getaffinity(0))[:2]  # the first two CPUs this test may use
    assert len(cpus) == 2, "the test needs 2 CPUs"
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("OMP_NUM_THREADS", None)  # the launcher sets it to each rank's share
    argv = [sys.executable, "-m", "zerotron", "launch", "--nproc_per_node", "2", "--save_pid"]
    argv += ["--bind_core_list", ",".join(map(str, cpus)), "--no_local_rank", SCRIPT, str(out)]
    with open(out / "launcher.err", "w") as err:
        launcher = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    pid_path = f"/tmp/{launcher.pid}.zerotron"
    ranks: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"rank{r}.json").exists() for r in (0, 1)):
            assert launcher.poll() is None, (out / "launcher.err").read_text()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
        with open(pid_path) as f:
            saved_pid = f.read()
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        killed_at = time.monotonic()
        pids = [ranks[r]["pid"] for r in (0, 1)]
        while not all(map(_gone, pids)) and time.monotonic() < killed_at + GONE_WITHIN_S:
            time.sleep(0.05)
        alive = [pid for pid in pids if not _gone(pid)]
    finally:
        for pid in [launcher.pid] + [r["pid"] for r in ranks.values()]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)  # only what this test started
        if os.path.exists(pid_path):
            os.remove(pid_path)  # SIGKILL left it
    return {"cpus": cpus, "ranks": ranks, "saved_pid": saved_pid, "launcher": launcher.pid,
            "alive": alive}  # fmt: skip


def test_each_rank_runs_on_exactly_its_share_of_the_listed_cores(job):
    a, b = job["cpus"]
    assert [job["ranks"][r]["cpus"] for r in (0, 1)] == [[a], [b]]
    assert [job["ranks"][r]["omp"] for r in (0, 1)] == ["1", "1"]


def test_save_pid_writes_the_launchers_pid(job):
    assert job["saved_pid"] == str(job["launcher"])


def test_sigkill_of_the_launcher_takes_both_ranks_with_it(job):
    assert job["alive"] == []
