"""One autotuning experiment: a short training job in its own launched process group, with a
time limit, and what became of it.

Each experiment is ``python -m zerotron launch <launch flags> SCRIPT <args>`` started in a new
session (its own process group), its output kept in ``<results_dir>/<name>/`` (``cmd.txt``,
``stdout.log``, ``stderr.log``, ``exp.json``, and ``ds_config.json`` for a DeepSpeed script),
as DeepSpeed's scheduler lays it out. The engine of an enabled experiment writes
``metrics.json`` and ends (:mod:`zerotron.engine.autotuning_metrics`). A job that runs past its
limit gets SIGTERM, then SIGKILL, as a group; one that fails, runs out of memory or ends
without a metric is recorded as such. Nothing here raises for a bad experiment: the tuner
goes on to the next one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zerotron.fileio import atomic_write_text

STATUSES = ("ok", "failed", "oom", "timeout", "no-metric", "pruned", "invalid")
"""What became of an experiment: measured; exited non-zero; ran out of memory; ran past its
limit; ended without writing a metric; not run because the estimator says it does not fit;
not run because its config is refused before launch."""

KILL_GRACE_S = 10.0  # after SIGTERM, seconds the job gets before SIGKILL
_OOM = re.compile(
    r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory|std::bad_alloc", re.I
)


@dataclass
class Experiment:
    """One point of the search: its knobs and how to run it."""

    name: str
    space: str  # the tuning space it belongs to ("z0", "z1", ...), DeepSpeed's names
    settings: dict[str, Any]  # zero_stage, micro_batch_size, gradient_accumulation_steps, tp, ...
    script_args: list[str] = field(default_factory=list)
    ds_config: dict[str, Any] | None = None  # written to ds_config.json (DeepSpeed scripts)
    estimated_bytes: int | None = None  # the estimator's per-rank total (None: not estimated)


@dataclass
class Outcome:
    """What running an experiment gave."""

    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _last_error(text: str) -> str:
    """The line that says what went wrong: the last one naming an error, else the last one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line[-300:]
    return lines[-1][-300:] if lines else ""


def classify(
    returncode: int | None, timed_out: bool, stderr: str, metrics: dict | None
) -> tuple[str, str]:
    """``(status, error)`` of a finished job from its exit, its stderr and its metric file."""
    if timed_out:
        return "timeout", "ran past the experiment's time limit; stopped"
    if returncode == 0:
        if metrics:
            return "ok", ""
        return "no-metric", "ended without writing its metric (fewer steps than end_profile_step?)"
    if _OOM.search(stderr) or returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "oom", _last_error(stderr) or f"killed (exit {returncode}): out of memory?"
    return "failed", _last_error(stderr) or f"exit code {returncode}"


def _descendants(pid: int) -> list[Any]:
    """The processes started under ``pid`` (psutil handles), found while it still runs."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the job's process group, then SIGKILL what is left after ``grace_s``.

    torch's elastic agent starts each rank in a session of its own, outside the job's group:
    the launcher stops them on SIGTERM, and any the launcher left (killed before it could) are
    killed by pid, from the list of the job's descendants taken first.
    """
    import psutil

    below = _descendants(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    _, alive = psutil.wait_procs(below, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=5.0)


def run_experiment(
    exp: Experiment,
    launch_cmd: list[str],
    result_dir: str | os.PathLike,
    *,
    time_limit_s: float,
    metric_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    grace_s: float = KILL_GRACE_S,
) -> Outcome:
    """Run ``launch_cmd + exp.script_args`` in its own process group for at most
    ``time_limit_s``; read ``metric_path`` (default ``result_dir/metrics.json``) if it ran."""
    out_dir = Path(result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metric_file = Path(metric_path) if metric_path else out_dir / "metrics.json"
    metric_file.unlink(missing_ok=True)  # a stale file must not pass for this run's
    cmd = [*launch_cmd, *exp.script_args]
    atomic_write_text(out_dir / "cmd.txt", shlex.join(cmd) + "\n")
    if exp.ds_config is not None:
        atomic_write_text(out_dir / "ds_config.json", json.dumps(exp.ds_config, indent=2) + "\n")
    atomic_write_text(out_dir / "exp.json", json.dumps(asdict(exp), indent=2, default=str) + "\n")
    started = time.perf_counter()
    timed_out = False
    with open(out_dir / "stdout.log", "wb") as out, open(out_dir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        try:
            proc.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc, grace_s)
        except BaseException:  # the tuner is interrupted: leave no job behind
            _stop_group(proc, grace_s)
            raise
        else:
            _stop_group(proc, 0.0)  # anything the launcher left behind in the group
    seconds = time.perf_counter() - started
    stderr = (out_dir / "stderr.log").read_text(errors="replace")
    metrics = None
    if metric_file.is_file():
        try:
            metrics = json.loads(metric_file.read_text())
        except ValueError:
            metrics = None
    status, error = classify(proc.returncode, timed_out, stderr, metrics)
    outcome = Outcome(status, metrics or {}, seconds, proc.returncode, error)
    atomic_write_text(out_dir / "outcome.json", json.dumps(asdict(outcome), indent=2) + "\n")
    return outcome
