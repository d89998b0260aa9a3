"""``--profile-steps A:B``: record training steps A..B on every rank, write the trace and the
measured pipeline timeline.

:class:`StepProfiler` is attached to an Engine (:func:`attach`) and driven by three one-line
hooks: :func:`phase` / :func:`end_phase` around each of the Engine's timed phases (the first
phase of step A starts the recording, every phase becomes a span) and :func:`after_step` after
each optimizer step (step B's ends it). Steps count as the Engine's ``global_steps`` do (and
Megatron's iterations): step 1 is the first optimizer step of a run, a resumed run goes on from
the checkpoint's. What is recorded, and how on CPU and CUDA: :mod:`zerotron.distributed.trace`.

After step B every rank writes ``<dir>/profile/rank<R>.json`` (its spans and layout); after a
barrier, rank 0 merges them into

- ``<dir>/trace.json``: the Chrome trace (Perfetto, chrome://tracing), one process per rank,
  one thread per stream (compute, p2p, collectives);
- with pipeline parallelism, ``<dir>/figures/pipeline_timeline.png``: step B's measured
  forwards and backwards per stage, drawn as ``zerotron schedule`` draws a simulated one, and
  a printed line per recorded step: the measured bubble against (p − 1)/(v·m).

Rank 0 needs every rank's file: ``<dir>`` must be on a file system all nodes share (as
``--save`` is). Each rank's ``profile`` record in the run's metrics file (the Engine's
:mod:`~zerotron.engine.run_metrics` writer, or :attr:`StepProfiler.metrics`) names the steps
and the trace (relative to ``<dir>``); rank 0's also holds the bubbles and the figure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zerotron.config.sections.runtime import parse_steps
from zerotron.distributed import comm, trace
from zerotron.distributed.init import get_rank, get_world_size
from zerotron.distributed.state import is_model_parallel_initialized, state
from zerotron.errors import ConfigError
from zerotron.fileio import atomic_write_text
from zerotron.pipeline.measured import measured_timeline, windows
from zerotron.pipeline.timeline import BubbleReport, draw_timeline, report

TRACE = "trace.json"
FIGURE = "figures/pipeline_timeline.png"
RANK_FILES = "profile"


class StepProfiler:
    """Records steps ``first``..``last`` and writes the results into ``directory``."""

    def __init__(self, first: int, last: int, directory: str | os.PathLike) -> None:
        self.first, self.last = first, last
        self.directory = Path(directory)
        self.recorder: trace.Recorder | None = None
        self.done = False
        self.metrics: Any = None  # anything with write(kind, **fields), e.g. the metrics file
        self.bubbles: list[dict[str, Any]] = []  # rank 0: one per recorded pipeline step

    def phase(self, global_steps: int, name: str) -> trace.Span | None:
        """An Engine phase begins in step ``global_steps + 1``: maybe start, then a span."""
        if self.recorder is None:
            if self.done or not self.first <= global_steps + 1 <= self.last:
                return None
            self.recorder = trace.start()
            self.recorder.step = global_steps + 1
        return self.recorder.begin(name, "compute", phase=True)

    def after_step(self, global_steps: int) -> None:
        """Optimizer step ``global_steps`` is done: the next step, or the end of the recording."""
        if self.recorder is None:
            return
        if global_steps < self.last:
            self.recorder.step = global_steps + 1
            return
        recorder = trace.stop()
        self.recorder, self.done = None, True
        self._write(recorder)

    # ---- output ----------------------------------------------------------------------------

    def _write(self, recorder: trace.Recorder) -> None:
        spans = [s.to_json() for s in recorder.finish()]
        rank = get_rank()
        layout = _layout()
        files = self.directory / RANK_FILES
        files.mkdir(parents=True, exist_ok=True)
        mine = {"rank": rank, "layout": layout, "steps": [self.first, self.last], "spans": spans}
        atomic_write_text(files / f"rank{rank}.json", json.dumps(mine))
        if get_world_size() > 1:
            comm.barrier()  # every rank's file is written
        record: dict[str, Any] = {
            "iteration_range": [self.first, self.last],
            "trace": self._relative(TRACE),
        }
        if rank == 0:
            ranks = [_read(files / f"rank{r}.json") for r in range(get_world_size())]
            write_trace(self.directory / TRACE, ranks)
            self.bubbles = pipeline_outputs(self.directory, ranks)
            if self.bubbles:
                record["bubbles"] = self.bubbles
                record["figure"] = self._relative(FIGURE)
            print(f" profile of steps {self.first}..{self.last}: {self.directory / TRACE} "
                  "(open in https://ui.perfetto.dev)", flush=True)  # fmt: skip
        if self.metrics is not None:
            self.metrics.write("profile", **record)

    def _relative(self, name: str) -> str:
        """``name`` in the profile directory, relative to the metrics file's directory (the
        same directory unless --profile-dir moved the profile elsewhere)."""
        base = getattr(self.metrics, "directory", None)
        if base is None:
            return name
        return os.path.relpath(self.directory / name, base)


def _layout() -> dict[str, int]:
    if not is_model_parallel_initialized():
        return {"pp_rank": 0, "tp_rank": 0, "dp_rank": 0, "pp": 1, "tp": 1, "dp": 1}
    ps = state()
    return {
        "pp_rank": ps.pp_rank, "tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank,
        "pp": ps.pp_size, "tp": ps.tp_size, "dp": ps.dp_size,
    }  # fmt: skip


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(
            f"rank file {path} of the profile is missing",
            where="--profile-steps",
            fix="the profile directory must be on a file system every node shares (like --save)",
        )
    return json.loads(path.read_text())


def write_trace(path: Path, ranks: list[dict[str, Any]]) -> None:
    """The Chrome trace of every rank's spans, times from the earliest span."""
    origin = min((s["start_ns"] for r in ranks for s in r["spans"]), default=0)
    events: list[dict[str, Any]] = []
    for r in ranks:
        lay = r["layout"]
        label = f"rank {r['rank']} (pp {lay['pp_rank']}, tp {lay['tp_rank']}, dp {lay['dp_rank']})"
        spans = [
            {**s, "start_ns": s["start_ns"] - origin, "end_ns": s["end_ns"] - origin}
            for s in r["spans"]
        ]
        events += trace.chrome_events(r["rank"], spans, label)
    atomic_write_text(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def stage_spans(ranks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Pipeline stage -> the spans of its rank with tensor- and data-parallel rank 0."""
    return {
        r["layout"]["pp_rank"]: r["spans"]
        for r in ranks
        if r["layout"]["tp_rank"] == 0 and r["layout"]["dp_rank"] == 0
    }


def pipeline_outputs(directory: Path, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's pipeline part: print each recorded step's bubble against theory and draw the
    last one. Returns the bubbles; [] when no pipeline step was recorded."""
    stages = stage_spans(ranks)
    steps = [w["args"]["step"] for w in windows(stages.get(0, []))]
    out = []
    timeline = None
    for step in steps:
        timeline = measured_timeline(stages, step)
        b = report(timeline)
        out.append({"step": step, "bubble": b.bubble, "theory": b.theory,
                    "makespan_s": timeline.makespan})  # fmt: skip
        print(" " + bubble_line(step, b), flush=True)
    if timeline is not None:
        kind = windows(stages[0])[-1]["args"]["kind"]
        (directory / FIGURE).parent.mkdir(parents=True, exist_ok=True)
        draw_timeline(
            timeline,
            directory / FIGURE,
            unit=1e-3,
            xlabel="time (ms) since the step began;  F forward, B backward (hatched), "
            "colour = micro-batch, grey = idle (waiting, communicating)",
            title=f"measured {kind} schedule, step {steps[-1]}",
            # as wide as the simulated picture of the same schedule: by actions, not by time
            width=min(max(8.0, 0.75 * max(map(len, timeline.events)) + 1.3), 60.0),
        )
    return out


def bubble_line(step: int, b: BubbleReport) -> str:
    """``pipeline bubble of step 5 (idle / busy): measured 0.0712, theory (p-1)/(v*m) 0.0625``"""
    return (
        f"pipeline bubble of step {step} (idle / busy): measured {b.bubble:.4f}, "
        f"theory (p-1)/(v*m) = {b.theory:.4f}  (step {b.makespan * 1e3:.1f} ms)"
    )


# ---- the Engine's hooks ---------------------------------------------------------------------


def attach(engine: Any, steps: str | None, directory: str | os.PathLike | None) -> None:
    """Give ``engine`` a profiler when ``steps`` ("A:B") are asked for (else nothing)."""
    if not steps:
        return
    if directory is None:
        raise ConfigError(
            "--profile-steps has nowhere to write the trace",
            where="--profile-steps",
            fix="add --save DIR, --metrics-dir DIR or --profile-dir DIR",
        )
    engine._step_profiler = StepProfiler(*parse_steps(steps, "--profile-steps"), directory)


def phase(engine: Any, name: str) -> trace.Span | None:
    """At the start of an Engine phase; a span to close with :func:`end_phase`, or None."""
    profiler = vars(engine).get("_step_profiler")  # not getattr: a Module's lookup is slow
    return None if profiler is None else profiler.phase(engine.global_steps, name)


def end_phase(span: trace.Span | None) -> None:
    if span is not None:
        recorder = trace.active()
        if recorder is not None:
            recorder.end(span)


def after_step(engine: Any) -> None:
    """After each optimizer step."""
    profiler = vars(engine).get("_step_profiler")
    if profiler is not None:
        if profiler.metrics is None:  # the run's metrics file (zerotron.engine.run_metrics)
            profiler.metrics = vars(engine).get("_run_metrics")
        profiler.after_step(engine.global_steps)
