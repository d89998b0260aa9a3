"""Measured pipeline timelines: the runtime's recorded actions back as a schedule and a timeline.

While a :mod:`~zerotron.distributed.trace` recorder is active, the runtime records one span
per action it executes (:func:`begin_action`: the action in :func:`encode`'s JSON form in the
span's ``action`` argument, forwards and backwards on the ``compute`` stream, communication on
``p2p``) inside a ``schedule`` span that carries the schedule's shape (kind, stage, stages,
micro-batches, chunks) and the step number.

From those spans (one list per pipeline stage, as the ranks wrote them):

- :func:`executed_actions`: the actions one stage ran in one step, as
  :mod:`~zerotron.pipeline.schedules` actions: comparable with ``build_schedule(...)[stage]``;
- :func:`measured_timeline`: a :class:`~zerotron.pipeline.simulator.Timeline` of the step's
  forwards and backwards in seconds from the first stage's start, the picture
  :func:`~zerotron.pipeline.timeline.draw_timeline` draws, and whose bubble
  :func:`~zerotron.pipeline.timeline.report` measures as for a simulated one: idle / busy, where
  busy is the forwards' and backwards' time and everything else between the step's first start
  and last end on any stage (waits, transfers, the runtime's own work) is idle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zerotron.errors import DataError
from zerotron.pipeline.schedules import (
    Action,
    Backward,
    CommBatch,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    comm_ops,
)
from zerotron.pipeline.simulator import Event, Timeline

_OPS = {c.__name__: c for c in (SendActivation, RecvActivation, SendGrad, RecvGrad)}
WINDOW = "schedule"  # the name of a step's span around its actions


def encode(action: Action) -> list[Any]:
    """An action as JSON: ``["F", mb, chunk]``, ``["B", mb, chunk]`` or ``["comm", [[op, peer,
    mb, chunk], ...], batched]`` (op: SendActivation, RecvActivation, SendGrad, RecvGrad)."""
    if isinstance(action, Forward):
        return ["F", action.mb, action.chunk]
    if isinstance(action, Backward):
        return ["B", action.mb, action.chunk]
    ops = [[type(op).__name__, op.peer, op.mb, op.chunk] for op in comm_ops(action)]
    return ["comm", ops, isinstance(action, CommBatch)]


def decode(data: list[Any]) -> Action:
    """The action :func:`encode` wrote."""
    kind = data[0]
    if kind == "F":
        return Forward(data[1], data[2])
    if kind == "B":
        return Backward(data[1], data[2])
    ops = tuple(_OPS[name](peer, mb, chunk) for name, peer, mb, chunk in data[1])
    return CommBatch(ops) if data[2] else ops[0]


def begin_action(recorder: Any, action: Action) -> Any:
    """Open the span of one executed action on ``recorder`` (the runtime's hook)."""
    compute = isinstance(action, (Forward, Backward))
    return recorder.begin(
        str(action), "compute" if compute else "p2p", action=encode(action), pipeline=True
    )


def _of_step(spans: Iterable[Mapping[str, Any]], step: int) -> list[Mapping[str, Any]]:
    return [s for s in spans if s["args"].get("step") == step]


def windows(spans: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``schedule`` spans of one rank, one per recorded training step, in order."""
    return sorted(
        (s for s in spans if s["name"] == WINDOW and "stages" in s["args"]),
        key=lambda s: s["start_ns"],
    )


def executed_actions(spans: Iterable[Mapping[str, Any]], step: int) -> list[Action]:
    """The actions one rank's pipeline runtime executed in ``step``, in the order it ran them."""
    recorded = [s for s in _of_step(spans, step) if s["args"].get("pipeline")]
    recorded.sort(key=lambda s: s["start_ns"])
    return [decode(s["args"]["action"]) for s in recorded]


def measured_timeline(stage_spans: Mapping[int, list[Mapping[str, Any]]], step: int) -> Timeline:
    """The forwards and backwards every stage ran in ``step`` (``stage_spans``: pipeline stage
    -> one of its ranks' spans), in seconds since the earliest stage began the step."""
    shapes, starts, ends = {}, [], []
    for stage, spans in stage_spans.items():
        found = [w for w in windows(spans) if w["args"].get("step") == step]
        if not found:
            raise DataError(
                f"no recorded pipeline step {step} on stage {stage}",
                where="the profile's rank files",
                fix="record the same steps on every rank (--profile-steps)",
            )
        shapes[stage] = found[0]["args"]
        starts.append(found[0]["start_ns"])
        ends.append(found[0]["end_ns"])
    shape = next(iter(shapes.values()))
    p, m, v = shape["stages"], shape["microbatches"], shape["chunks"]
    if sorted(stage_spans) != list(range(p)):
        raise DataError(
            f"the profile holds pipeline stages {sorted(stage_spans)} of {p}",
            where="the profile's rank files",
            fix="every stage's rank file must be in the profile directory (a shared file system)",
        )
    origin = min(starts)
    events = []
    for stage in range(p):
        computes = [
            s
            for s in _of_step(stage_spans[stage], step)
            if s["args"].get("pipeline") and s["stream"] == "compute"
        ]
        computes.sort(key=lambda s: s["start_ns"])
        events.append(
            [
                Event(
                    (s["start_ns"] - origin) / 1e9,
                    (s["end_ns"] - origin) / 1e9,
                    decode(s["args"]["action"]),
                )
                for s in computes
            ]
        )
    return Timeline(p, m, v, events, (max(ends) - origin) / 1e9)
