"""Timeline recording: the start and end of what a rank does, per stream, for a few steps.

A :class:`Recorder`, once :func:`start`-ed, collects :class:`Span` s (name, stream, start, end,
arguments) from three places until :func:`stop`:

- the pipeline runtime, one span per schedule action (forwards and backwards on the
  ``compute`` stream, each communication action on ``p2p``);
- the Engine's phases (``forward``, ``backward``, ``step``, ``forward-backward``, ...; its
  timers' seam), on ``compute``;
- every blocking wait of :mod:`~zerotron.distributed.comm`, through the collective watchdog's
  seam (:func:`zerotron.distributed.watchdog.enter` / ``leave`` call :meth:`Recorder.begin_wait`
  and :meth:`Recorder.end` while a recorder is active): collectives on ``collectives``,
  point-to-point on ``p2p``. A wait span is the time the rank was held by the call: for a
  collective started earlier (a data-parallel bucket overlapping the backward), its wait.

Clocks. On CPU a span is two ``time.perf_counter_ns()`` readings. On CUDA each end is a
``torch.cuda.Event`` recorded on the current stream, so a span covers the device work queued
between its ends (kernels run after the CPU moved on), and a communication wait covers the time
the stream was held by its ``work.wait()`` — no synchronization inside the recorded steps. At
:meth:`Recorder.finish` the device is synchronized once and every event is read against an
anchor event recorded at :func:`start` beside the CPU clock. Times are nanoseconds since the
epoch (``time.time_ns()`` read once at the start, plus the monotonic clock since): ranks on one
host share a clock; across hosts the alignment is as good as the hosts' clock synchronization.

When no recorder is active every hook is one global read (:func:`active` is None): nothing is
recorded and nothing is allocated.

Chrome trace (:func:`chrome_events`): one process per rank, one thread per stream, complete
("X") events in microseconds; ``{"traceEvents": [...]}`` opens in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotron.distributed import watchdog

STREAMS = ("compute", "p2p", "collectives")
"""The recorded streams, in the order their threads are listed in a Chrome trace."""


@dataclass
class Span:
    """One recorded interval. ``start``/``end``: ns (CPU clock) or CUDA events until resolved."""

    name: str
    stream: str
    start: Any
    end: Any = None
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stream": self.stream,
            "start_ns": self.start,
            "end_ns": self.end,
            "args": self.args,
        }


class Recorder:
    """Collects the spans of one rank (see the module docstring); thread-safe appends."""

    def __init__(self, cuda: bool | None = None) -> None:
        if cuda is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = cuda
        self.spans: list[Span] = []
        self.step: int | None = None  # the training step being recorded (set by its driver)
        self._lock = threading.Lock()
        if cuda:
            torch.cuda.synchronize()
        self._perf0 = time.perf_counter_ns()
        self._epoch0 = time.time_ns()
        self._anchor = None
        if cuda:
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record()  # the device is idle: it reaches this event at _perf0

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def begin(self, name: str, stream: str, **args: Any) -> Span:
        """Open a span now; close it with :meth:`end`."""
        if self.step is not None:
            args["step"] = self.step
        span = Span(name, stream, self._now(), None, args)
        with self._lock:
            self.spans.append(span)
        return span

    def end(self, span: Span) -> None:
        span.end = self._now()

    def span(self, name: str, stream: str, **args: Any) -> _Open:
        """``with recorder.span("F0", "compute", mb=0): ...``"""
        return _Open(self, name, stream, args)

    def begin_wait(self, call: Any) -> Span:
        """A span for a blocking wait of :mod:`~zerotron.distributed.comm` (a ``Call``)."""
        args: dict[str, Any] = {"group": call.group.name, "bytes": call.nbytes}
        if call.peers is not None:
            args["peers"] = list(call.peers)
            return self.begin(call.op, "p2p", **args)
        args["ranks"] = list(call.group.ranks)
        return self.begin(call.op, "collectives", **args)

    def finish(self) -> list[Span]:
        """Resolve every span to nanoseconds since the epoch (one device sync on CUDA); drop
        spans that never ended (a step cut short by an error)."""
        if self.cuda:
            torch.cuda.synchronize()
        done = []
        for s in self.spans:
            if s.end is None:
                continue
            s.start, s.end = self._ns(s.start), self._ns(s.end)
            done.append(s)
        self.spans = done
        return done

    def _ns(self, t: Any) -> int:
        if isinstance(t, int):
            return self._epoch0 + (t - self._perf0)
        return self._epoch0 + round(self._anchor.elapsed_time(t) * 1e6)  # ms -> ns


class _Open:
    __slots__ = ("recorder", "name", "stream", "args", "span")

    def __init__(self, recorder: Recorder, name: str, stream: str, args: dict[str, Any]):
        self.recorder, self.name, self.stream, self.args = recorder, name, stream, args

    def __enter__(self) -> Span:
        self.span = self.recorder.begin(self.name, self.stream, **self.args)
        return self.span

    def __exit__(self, *exc: Any) -> None:
        self.recorder.end(self.span)


_active: Recorder | None = None


def active() -> Recorder | None:
    """The recorder collecting spans now, or None (the hooks' one check)."""
    return _active


def start(recorder: Recorder | None = None) -> Recorder:
    """Make ``recorder`` (default: a new one) the active recorder, and hook comm's waits."""
    global _active
    _active = recorder or Recorder()
    watchdog.observe(_active)
    return _active


def stop() -> Recorder | None:
    """Stop recording; returns the recorder that was active (its spans not yet resolved)."""
    global _active
    recorder, _active = _active, None
    watchdog.observe(None)
    return recorder


# --------------------------------------------------------------------------------------------
# Chrome trace


def chrome_events(rank: int, spans: list[dict[str, Any]], label: str | None = None) -> list[dict]:
    """One rank's spans (as :meth:`Span.to_json` gives them) as Chrome trace events: process
    ``rank`` named ``label``, one thread per stream, complete events in microseconds."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
         "args": {"name": label or f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
         "args": {"sort_index": rank}},
    ]  # fmt: skip
    for tid, stream in enumerate(STREAMS):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}}
        )
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
             "args": {"sort_index": tid}}
        )  # fmt: skip
    tids = {s: i for i, s in enumerate(STREAMS)}
    for s in spans:
        events.append(
            {
                "ph": "X",
                "name": s["name"],
                "cat": s["stream"],
                "pid": rank,
                "tid": tids.get(s["stream"], len(STREAMS)),
                "ts": s["start_ns"] / 1000.0,
                "dur": max(s["end_ns"] - s["start_ns"], 0) / 1000.0,
                "args": s["args"],
            }
        )
    return events
