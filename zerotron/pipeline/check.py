"""A schedule checked before any process waits on it: messages match, nothing deadlocks.

A pipeline rank blocks in each communication action until its peer posts the matching op,
and the messages between two stages are matched first-in first-out. A schedule whose sends
and receives disagree in number or order between two neighbouring stages therefore hangs
(or, worse, hands a gradient to a receive that expected an activation). :func:`check_schedule`
finds that on the data alone, in milliseconds, and :class:`~zerotron.pipeline.runtime.
PipelineRuntime` runs it on the whole schedule (every stage's list) before its first step:

1. pairwise, in order: for every ordered pair of stages, the k-th message one posts to the
   other is the k-th receive the other posts from it, of the same kind (activation or
   gradient), micro-batch, and the next (or previous) virtual stage; and only neighbouring
   virtual stages talk;
2. then a blocking execution of all stages (:func:`~zerotron.pipeline.simulator.simulate`):
   no cycle of waits, every (micro-batch, chunk) forward and backward exactly once.

Either failure is a :class:`~zerotron.pipeline.schedules.ScheduleError` naming the stages, the
position and the two ops.
"""

from __future__ import annotations

from zerotron.pipeline.schedules import (
    RECVS,
    SENDS,
    P2POp,
    RecvActivation,
    Schedule,
    ScheduleError,
    SendActivation,
    comm_ops,
    schedule_shape,
    virtual_stage,
)
from zerotron.pipeline.simulator import simulate

_FIX = "post the sends and receives between each pair of stages in the same order on both sides"


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` matches pairwise and cannot deadlock."""
    check_pairwise(schedule)
    simulate(schedule)


def check_pairwise(schedule: Schedule) -> None:
    """Every stage's sends to a peer match that peer's receives from it, one for one, in order."""
    p, _, v = schedule_shape(schedule)
    sends: dict[tuple[int, int], list[P2POp]] = {}  # (from, to) -> ops in posting order
    recvs: dict[tuple[int, int], list[P2POp]] = {}
    for stage, actions in enumerate(schedule):
        for action in actions:
            for op in comm_ops(action):
                if not 0 <= op.peer < p or op.peer == stage:
                    raise ScheduleError(
                        f"stage {stage}'s '{op}' names stage {op.peer}, not another of 0..{p - 1}"
                    )
                if isinstance(op, SENDS):
                    sends.setdefault((stage, op.peer), []).append(op)
                else:
                    recvs.setdefault((op.peer, stage), []).append(op)
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (send, recv) in enumerate(zip(out, into)):
            if not _match(send, src, recv, dst, p, v):
                raise ScheduleError(
                    f"message {k + 1} from stage {src} to stage {dst} does not match: stage "
                    f"{src} sends '{send}' where stage {dst} receives '{recv}'",
                    fix=_FIX,
                )
        if len(out) != len(into):
            more = "sends" if len(out) > len(into) else "receives"
            raise ScheduleError(
                f"stage {src} posts {len(out)} sends to stage {dst}, which posts {len(into)} "
                f"receives from it: the last {abs(len(out) - len(into))} {more} have no match, "
                "so a rank would wait forever",
                fix=_FIX,
            )


def _match(send: P2POp, src: int, recv: P2POp, dst: int, p: int, v: int) -> bool:
    """Whether ``recv`` on ``dst`` is the receive of ``send`` from ``src`` (kind, mb, chunks)."""
    forward = isinstance(send, SendActivation)
    if forward != isinstance(recv, RecvActivation) or not isinstance(recv, RECVS):
        return False
    step = 1 if forward else -1
    target = virtual_stage(src, send.chunk, p) + step
    return (
        send.mb == recv.mb
        and 0 <= target < p * v
        and virtual_stage(dst, recv.chunk, p) == target
        and send.peer == dst
        and recv.peer == src
    )
