"""Execute a pipeline schedule without processes: deadlock check, validity check, timing.

:func:`simulate` runs every stage's action list the way the runtime will: computes take a fixed
time, each communication action is a batch that blocks its stage until every op in it is
matched by the peer, and the messages between an ordered pair of stages are matched in the order
they were posted (first in, first out, whatever their kind, as NCCL does). It reports a
deadlock, a message received as something else, a compute whose input has not arrived, or a
(micro-batch, chunk) not run exactly once, as a :class:`ScheduleError`; otherwise it returns the
per-stage :class:`Timeline` that :mod:`~zerotron.pipeline.timeline` draws and measures.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from zerotron.pipeline.schedules import (
    SENDS,
    Action,
    Backward,
    Compute,
    Forward,
    P2POp,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    comm_ops,
    schedule_shape,
    stage_and_chunk,
    virtual_stage,
)


@dataclass(frozen=True, slots=True)
class Event:
    """One compute action on a stage, from ``start`` to ``end`` in simulated time."""

    start: float
    end: float
    action: Compute


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` saw: each stage's compute events in order, and the makespan."""

    num_stages: int
    num_microbatches: int
    virtual_stages: int
    events: list[list[Event]]
    makespan: float

    def busy(self, stage: int) -> float:
        return sum(e.end - e.start for e in self.events[stage])


def simulate(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> Timeline:
    """Execute every stage's actions with blocking, FIFO-matched p2p; return the timeline.

    Each Forward takes ``fwd_cost`` and each Backward ``bwd_cost`` (per model chunk);
    communication takes no time. A batch completes when all its ops are matched; a stage waits
    for that. Raises :class:`ScheduleError` on deadlock (naming each stuck stage's action), on a
    message received as something else, on a compute whose input has not arrived, or when some
    (micro-batch, virtual stage) is not run forward and backward exactly once.
    """
    return _Simulator(schedule, fwd_cost, bwd_cost).run()


class _Simulator:
    def __init__(self, schedule: Schedule, fwd_cost: float, bwd_cost: float):
        self.schedule = schedule
        self.p, self.m, self.v = schedule_shape(schedule)
        self.cost = {Forward: fwd_cost, Backward: bwd_cost}
        p = self.p
        self.pc = [0] * p
        self.clock = [0.0] * p
        self.waiting = [0] * p  # unmatched ops of the batch the stage is blocked on
        self.posted = [False] * p
        self.batch_end = [0.0] * p
        self.events: list[list[Event]] = [[] for _ in range(p)]
        # Per stage: what it has done / holds, keyed by (mb, chunk).
        self.done = [{Forward: set(), Backward: set()} for _ in range(p)]
        self.arrived = [{RecvActivation: set(), RecvGrad: set()} for _ in range(p)]
        # (src, dst) -> FIFO of unmatched sends and of unmatched receives: (stage, op, time).
        self.pending: dict[tuple[int, int], tuple[collections.deque, collections.deque]] = {}
        self.ready: collections.deque[int] = collections.deque(range(p))

    def run(self) -> Timeline:
        while self.ready:
            self._advance(self.ready.popleft())
        stuck = [s for s in range(self.p) if self.pc[s] < len(self.schedule[s])]
        if stuck:
            lines = [
                f"stage {s} waits at action {self.pc[s]}: {self.schedule[s][self.pc[s]]}"
                for s in stuck
            ]
            raise ScheduleError("deadlock: " + "; ".join(lines))
        self._check_complete()
        return Timeline(self.p, self.m, self.v, self.events, max(self.clock))

    def _advance(self, s: int) -> None:
        actions = self.schedule[s]
        while self.pc[s] < len(actions):
            action = actions[self.pc[s]]
            if isinstance(action, (Forward, Backward)):
                self._compute(s, action)
            else:
                if not self.posted[s]:
                    self._post_batch(s, comm_ops(action))
                if self.waiting[s]:
                    return
                self.posted[s] = False
                self.clock[s] = self.batch_end[s]
            self.pc[s] += 1

    def _compute(self, s: int, a: Compute) -> None:
        key, vs, last = (a.mb, a.chunk), virtual_stage(s, a.chunk, self.p), self.p * self.v - 1
        if not (0 <= a.chunk < self.v and 0 <= a.mb < self.m):
            self._fail(s, a, "refers to a micro-batch or chunk out of range")
        if key in self.done[s][type(a)]:
            self._fail(s, a, "runs twice")
        if isinstance(a, Forward) and vs > 0 and key not in self.arrived[s][RecvActivation]:
            self._fail(s, a, "runs before its input activation was received")
        if isinstance(a, Backward):
            if key not in self.done[s][Forward]:
                self._fail(s, a, "runs before its forward")
            if vs < last and key not in self.arrived[s][RecvGrad]:
                self._fail(s, a, "runs before its output gradient was received")
        start = self.clock[s]
        self.clock[s] = start + self.cost[type(a)]
        self.events[s].append(Event(start, self.clock[s], a))
        self.done[s][type(a)].add(key)

    def _post_batch(self, s: int, ops: tuple[P2POp, ...]) -> None:
        self.posted[s] = True
        self.waiting[s] = len(ops)
        self.batch_end[s] = self.clock[s]
        for op in ops:
            self._check_op(s, op)
            send = isinstance(op, SENDS)
            channel = (s, op.peer) if send else (op.peer, s)
            sends, recvs = self.pending.setdefault(
                channel, (collections.deque(), collections.deque())
            )
            mine, theirs = (sends, recvs) if send else (recvs, sends)
            entry = (s, op, self.clock[s])
            if theirs:
                other = theirs.popleft()
                self._match(*((entry, other) if send else (other, entry)))
            else:
                mine.append(entry)

    def _check_op(self, s: int, op: P2POp) -> None:
        vs, last = virtual_stage(s, op.chunk, self.p), self.p * self.v - 1
        # Which way the message goes in the model, and which compute must precede a send.
        step = 1 if isinstance(op, (SendActivation, RecvGrad)) else -1
        if not 0 <= vs + step <= last:
            self._fail(s, op, "has no peer: it is at the end of the model")
        expected_peer = stage_and_chunk(vs + step, self.p)[0]
        if op.peer != expected_peer:
            self._fail(s, op, f"names peer stage {op.peer}, expected {expected_peer}")
        produced_by = {SendActivation: Forward, SendGrad: Backward}.get(type(op))
        if produced_by and (op.mb, op.chunk) not in self.done[s][produced_by]:
            self._fail(s, op, f"sends before its {produced_by.__name__.lower()} ran")

    def _match(self, send: tuple, recv: tuple) -> None:
        (src, sop, t_send), (dst, rop, t_recv) = send, recv
        kind_ok = (type(sop), type(rop)) in (
            (SendActivation, RecvActivation),
            (SendGrad, RecvGrad),
        )
        step = 1 if isinstance(sop, SendActivation) else -1
        target = virtual_stage(src, sop.chunk, self.p) + step
        if not (kind_ok and sop.mb == rop.mb and virtual_stage(dst, rop.chunk, self.p) == target):
            raise ScheduleError(
                f"stage {src}'s '{sop}' is matched by stage {dst}'s '{rop}': messages "
                "between two stages are received in the order they are sent",
                fix="post sends and receives between each pair of stages in the same order",
            )
        self.arrived[dst][type(rop)].add((rop.mb, rop.chunk))
        t = max(t_send, t_recv)
        for stage in (src, dst):
            self.waiting[stage] -= 1
            self.batch_end[stage] = max(self.batch_end[stage], t)
            if self.waiting[stage] == 0:
                self.ready.append(stage)

    def _check_complete(self) -> None:
        want = {(mb, c) for mb in range(self.m) for c in range(self.v)}
        for s in range(self.p):
            for kind in (Forward, Backward):
                missing = sorted(want - self.done[s][kind])
                if missing:
                    raise ScheduleError(
                        f"stage {s} never runs {kind.__name__.lower()} of (micro-batch, chunk) "
                        f"{missing[:5]}"
                    )

    def _fail(self, s: int, action: Action, why: str) -> None:
        raise ScheduleError(f"stage {s} action {self.pc[s]} '{action}' {why}")
