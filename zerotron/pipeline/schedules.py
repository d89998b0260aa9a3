"""Pipeline schedules as data: the forwards, backwards, sends and receives of each stage, in order.

A schedule is a pure function ``(num_stages, num_microbatches, virtual_stages) -> Schedule``:
one ordered list of actions per pipeline stage. The runtime executes the actions;
:mod:`~zerotron.pipeline.simulator` executes them without processes (deadlock and
validity check, timing); :mod:`~zerotron.pipeline.timeline` measures the bubble and
draws the picture.

Actions (small frozen dataclasses):

- ``Forward(mb, chunk)`` / ``Backward(mb, chunk)``: run model chunk ``chunk`` of this stage on
  micro-batch ``mb``. Without virtual stages every chunk is 0.
- ``SendActivation`` / ``RecvActivation`` / ``SendGrad`` / ``RecvGrad`` ``(peer, mb, chunk)``:
  point-to-point with pipeline stage ``peer``. ``chunk`` is always the *local* chunk: the one
  whose output is sent (SendActivation), whose input is received (RecvActivation), whose input
  gradient is sent (SendGrad), whose output gradient is received (RecvGrad).
- ``CommBatch(ops)``: p2p ops issued together (one ``batch_isend_irecv``) and waited on
  together; a lone op is a batch of one.

Semantics the runtime must keep, and the simulator models: a batch blocks its stage until every
op in it is matched by the peer (a send completes only when the peer posts the receive), and the
messages between an ordered pair of stages are matched first-in first-out, whatever their kind
(NCCL has no tags), so sender and receiver must post them in the same order.

How a runtime executes a stage's list, in order: ``Forward`` runs the chunk on the received
activation (virtual stage 0 reads the micro-batch instead) and keeps the output for the send and
the backward; ``Backward`` runs autograd from the received output gradient (the last virtual
stage starts from the loss); a communication action posts all its ops at once
(``batch_isend_irecv``) and waits for all of them. A sent output may be freed right after its
batch completes (its autograd graph is kept). Tensor shapes are not part of the schedule.

Where the p2p ops go is planned (see ``_with_communication``) so that no schedule can deadlock
and, with backward = 2 × forward, blocking p2p waits no longer than pure data flow would: the
simulated bubble is the theoretical one.

Virtual stages (interleaved schedule): with p stages and v chunks per stage, model chunk c on
stage s is virtual stage ``c * p + s``; activations flow through virtual stages 0, 1, ...,
p·v − 1, wrapping from the last stage back to the first.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from zerotron.errors import ConfigError, DistributedError


class ScheduleError(DistributedError):
    """A schedule is inconsistent: it deadlocks, mismatches messages or skips work."""


# --------------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward of local model chunk ``chunk`` on micro-batch ``mb``."""

    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"F{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, slots=True)
class Backward:
    """Backward of local model chunk ``chunk`` on micro-batch ``mb``."""

    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"B{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, slots=True)
class SendActivation:
    """Send the output of local chunk ``chunk`` for micro-batch ``mb`` to stage ``peer``."""

    peer: int
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"send act {self.mb}.{self.chunk} -> {self.peer}"


@dataclass(frozen=True, slots=True)
class RecvActivation:
    """Receive the input of local chunk ``chunk`` for micro-batch ``mb`` from stage ``peer``."""

    peer: int
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"recv act {self.mb}.{self.chunk} <- {self.peer}"


@dataclass(frozen=True, slots=True)
class SendGrad:
    """Send the gradient of local chunk ``chunk``'s input for ``mb`` to stage ``peer``."""

    peer: int
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"send grad {self.mb}.{self.chunk} -> {self.peer}"


@dataclass(frozen=True, slots=True)
class RecvGrad:
    """Receive the gradient of local chunk ``chunk``'s output for ``mb`` from stage ``peer``."""

    peer: int
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"recv grad {self.mb}.{self.chunk} <- {self.peer}"


P2POp = SendActivation | RecvActivation | SendGrad | RecvGrad
SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)


@dataclass(frozen=True, slots=True)
class CommBatch:
    """P2P ops issued together and completed together (``batch_isend_irecv``)."""

    ops: tuple[P2POp, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.ops)) + "]"


Compute = Forward | Backward
Action = Compute | P2POp | CommBatch
Schedule = list[list[Action]]  # one ordered action list per pipeline stage


def comm_ops(action: Action) -> tuple[P2POp, ...]:
    """The p2p ops of a communication action (a lone op is a batch of one); () for compute."""
    if isinstance(action, CommBatch):
        return action.ops
    return () if isinstance(action, (Forward, Backward)) else (action,)


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """Position of (stage, chunk) in the model: chunk c on stage s is virtual stage c*p + s."""
    return chunk * num_stages + stage


def stage_and_chunk(vstage: int, num_stages: int) -> tuple[int, int]:
    """Inverse of :func:`virtual_stage`: the (stage, chunk) holding virtual stage ``vstage``."""
    chunk, stage = divmod(vstage, num_stages)
    return stage, chunk


def schedule_shape(schedule: Schedule) -> tuple[int, int, int]:
    """(num_stages, num_microbatches, virtual_stages) read off the compute actions."""
    computes = [a for stage in schedule for a in stage if isinstance(a, (Forward, Backward))]
    if not computes:
        raise ScheduleError("schedule has no forward or backward actions")
    return (
        len(schedule),
        1 + max(a.mb for a in computes),
        1 + max(a.chunk for a in computes),
    )


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, actions separated by two spaces (for debugging and error messages)."""
    return "\n".join(f"stage {s}: " + "  ".join(map(str, acts)) for s, acts in enumerate(schedule))


def activations_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most (micro-batch, chunk) activations held at once: forwarded, and not
    yet backwarded. This is what bounds a stage's activation memory."""
    peaks = []
    for actions in schedule:
        held = peak = 0
        for a in actions:
            if isinstance(a, Forward):
                held += 1
                peak = max(peak, held)
            elif isinstance(a, Backward):
                held -= 1
        peaks.append(peak)
    return peaks


# --------------------------------------------------------------------------------------------
# Schedules


def gpipe(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards, then all backwards (GPipe). Holds m activations on every stage."""
    _check_sizes(num_stages, num_microbatches, virtual_stages, "gpipe")
    if virtual_stages != 1:
        raise ConfigError(
            f"the gpipe schedule has no virtual stages (got {virtual_stages})",
            fix="use --kind interleaved for virtual stages, or --virtual 1",
        )
    m = num_microbatches
    orders = [[Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]] * num_stages
    return _with_communication(orders, num_stages, 1)


def one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): warm up, alternate one forward and one backward, cool down.

    Stage s runs ``min(p - s - 1, m)`` warm-up forwards, so it never holds more than
    ``min(p - s, m)`` micro-batches' activations; same bubble as GPipe, far less memory.
    """
    _check_sizes(num_stages, num_microbatches, virtual_stages, "1f1b")
    if virtual_stages != 1:
        raise ConfigError(
            f"the 1f1b schedule has no virtual stages (got {virtual_stages})",
            fix="use --kind interleaved for virtual stages, or --virtual 1",
        )
    p, m = num_stages, num_microbatches
    orders = []
    for stage in range(p):
        warmup = min(p - stage - 1, m)
        order: list[Compute] = [Forward(i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Forward(warmup + i), Backward(i)]
        order += [Backward(i) for i in range(m - warmup, m)]
        orders.append(order)
    return _with_communication(orders, p, 1)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): each stage holds ``v`` model chunks.

    Micro-batches go through the chunks in groups of p: chunk 0 forwards micro-batches
    0..p-1, then chunk 1 the same ones, ..., then chunk 0 the next p. Backwards walk the same
    groups with chunks in reverse. Stage s warms up with ``(p - s - 1) + (v - 1) p`` forwards
    (capped at m·v), so it holds at most ``p - s + (v - 1) p`` chunk activations. That is
    fewer than Megatron-LM's ``2 (p - s - 1) + (v - 1) p``, which its lock-step communication
    needs; our receives are planned ahead (see ``_with_communication``), and the simulated
    bubble is exactly (p - 1) / (v m) with backward = 2 × forward.
    Needs m divisible by p. With v == 1 this is :func:`one_f_one_b`.
    """
    _check_sizes(num_stages, num_microbatches, virtual_stages, "interleaved")
    p, m, v = num_stages, num_microbatches, virtual_stages
    if v == 1:
        return one_f_one_b(p, m)
    if p == 1:
        raise ConfigError(
            f"the interleaved schedule needs at least 2 pipeline stages (got {p} with "
            f"{v} virtual stages)",
            fix="use --virtual 1, or a pipeline-parallel size of 2 or more",
        )
    if m % p != 0:
        lower, upper = (m // p) * p, (m // p + 1) * p
        near = f"{lower} or {upper}" if lower else f"{upper}"
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches ({m}) to be divisible "
            f"by the pipeline-parallel size ({p})",
            fix=f"use {near} micro-batches (or any multiple of {p}), or no virtual stages",
        )
    total = m * v

    def nth(k: int, backward: bool) -> Compute:
        group, within = divmod(k, p * v)
        chunk, i = divmod(within, p)
        if backward:
            return Backward(group * p + i, v - 1 - chunk)
        return Forward(group * p + i, chunk)

    orders = []
    for stage in range(p):
        warmup = min((p - stage - 1) + (v - 1) * p, total)
        order = [nth(k, False) for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(warmup + k, False), nth(k, True)]
        order += [nth(k, True) for k in range(total - warmup, total)]
        orders.append(order)
    return _with_communication(orders, p, v)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def build_schedule(
    kind: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """The schedule named ``kind`` (one of :data:`SCHEDULES`: gpipe, 1f1b, interleaved)."""
    if kind not in SCHEDULES:
        raise ConfigError(
            f"unknown pipeline schedule {kind!r}", fix=f"use one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[kind](num_stages, num_microbatches, virtual_stages)


def _check_sizes(p: int, m: int, v: int, kind: str) -> None:
    for name, value in (("pipeline stages", p), ("micro-batches", m), ("virtual stages", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"number of {name} must be a positive integer, got {value!r}",
                where=f"{kind} schedule",
            )


# Relative costs the p2p placement plans with: the usual backward ≈ 2 × forward. Any costs give
# a correct, deadlock-free schedule; these only decide where a stage may have to wait.
_PLAN_FWD, _PLAN_BWD = 1, 2


def _with_communication(orders: list[list[Compute]], p: int, v: int) -> Schedule:
    """Insert the p2p ops around each stage's compute order.

    Plan: run the compute orders as pure data flow (each compute starts when its stage is free
    and its input exists) and give every message a rendezvous time ``tau`` between its
    production and its consumption, preferably one at which neither stage is computing. On each
    stage the message is posted at ``tau``: after every compute that starts before ``tau``,
    before every compute that starts at or after it; messages with the same ``tau`` form one
    batch, ordered by production time.

    Why it cannot deadlock: order all batches by ``tau``. By induction every stage reaches its
    batch at ``tau`` (what it computes before needs only messages of earlier batches), and each
    op there is matched by an op of the peer's batch at the same ``tau``. Messages between two
    stages are posted in (tau, production time) order on both sides, so FIFO matching pairs
    the right ones. When ``tau`` is a common idle point, the blocking execution reproduces the
    data-flow times exactly: the communication adds no bubble of its own. Receives are thus
    posted early (as Megatron prefetches the next receive), sends as soon as the peer is free.
    """
    times = _dataflow_times(orders, p, v)
    posts = _plan_messages(orders, times, p, v)
    schedule: Schedule = []
    for stage, order in enumerate(orders):
        # Order by time; at equal times a batch goes before the compute that starts then.
        items = [((begin, 1, 0), a) for a, (begin, _) in zip(order, times[stage])]
        items += [((tau, 0, made), op) for tau, made, op in posts[stage]]
        items.sort(key=lambda item: item[0])
        actions: list[Action] = []
        batch: list[P2POp] = []
        for i, ((tau, is_compute, _), item) in enumerate(items):
            if is_compute:
                actions.append(item)
                continue
            batch.append(item)
            next_key = items[i + 1][0] if i + 1 < len(items) else None
            if next_key is None or next_key[1] or next_key[0] != tau:
                _append_batch(actions, batch)
                batch = []
        schedule.append(actions)
    return schedule


def _plan_messages(
    orders: list[list[Compute]], times: list[list[tuple[int, int]]], p: int, v: int
) -> list[list[tuple[int, int, P2POp]]]:
    """Per stage, (tau, production time, op) for every send and receive it takes part in."""
    made_at, needed_at = {}, {}  # (receiving stage, receive op) -> time
    for stage, order in enumerate(orders):
        for a, (begin, end) in zip(order, times[stage]):
            for send in _sends(a, stage, p, v):
                made_at[send.peer, _matching_receive(send, stage, p)] = end
            for recv in _receives(a, stage, p, v):
                needed_at[stage, recv] = begin
    posts: list[list[tuple[int, int, P2POp]]] = [[] for _ in range(p)]
    for stage, order in enumerate(orders):
        for a in order:
            for send in _sends(a, stage, p, v):
                key = (send.peer, _matching_receive(send, stage, p))
                made, needed = made_at[key], needed_at[key]
                tau = _rendezvous(times[stage], times[send.peer], made, needed)
                posts[stage].append((tau, made, send))
                posts[send.peer].append((tau, made, key[1]))
    return posts


def _dataflow_times(orders: list[list[Compute]], p: int, v: int) -> list[list[tuple[int, int]]]:
    """(start, end) of every compute when each waits only for its stage and its input."""
    done: dict[tuple[type, int, int], int] = {}  # (kind, mb, virtual stage) -> end time
    times: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for stage, order in enumerate(orders):
            while len(times[stage]) < len(order):
                a = order[len(times[stage])]
                begin = times[stage][-1][1] if times[stage] else 0
                vs = virtual_stage(stage, a.chunk, p)
                if _receives(a, stage, p, v):
                    source = (type(a), a.mb, vs - 1 if isinstance(a, Forward) else vs + 1)
                    if source not in done:
                        break
                    begin = max(begin, done[source])
                end = begin + (_PLAN_FWD if isinstance(a, Forward) else _PLAN_BWD)
                times[stage].append((begin, end))
                done[type(a), a.mb, vs] = end
                progress = True
    stuck = [s for s in range(p) if len(times[s]) < len(orders[s])]
    if stuck:
        raise ScheduleError(
            "compute orders wait on each other: "
            + "; ".join(f"stage {s} at {orders[s][len(times[s])]}" for s in stuck)
        )
    return times


def _rendezvous(sender: list, receiver: list, made: int, needed: int) -> int:
    """Earliest time in [made, needed] at which neither stage is computing, else ``made``."""
    candidates = {made, needed}
    for times in (sender, receiver):
        first = max(bisect.bisect_left(times, (made,)) - 1, 0)
        last = bisect.bisect_left(times, (needed,))
        candidates.update(t for span in times[first:last] for t in span if made < t < needed)
    for t in sorted(candidates):
        if _idle_at(sender, t) and _idle_at(receiver, t):
            return t
    return made


def _idle_at(times: list[tuple[int, int]], t: int) -> bool:
    """Whether no compute of a stage runs across time ``t`` (it may end or start at ``t``)."""
    i = bisect.bisect_left(times, (t,))  # first compute starting at or after t
    return i == 0 or times[i - 1][1] <= t


def _matching_receive(send: P2POp, stage: int, p: int) -> P2POp:
    """The receive, on ``send.peer``, of what ``stage`` sends."""
    step = 1 if isinstance(send, SendActivation) else -1
    _, chunk = stage_and_chunk(virtual_stage(stage, send.chunk, p) + step, p)
    kind = RecvActivation if isinstance(send, SendActivation) else RecvGrad
    return kind(stage, send.mb, chunk)


def _receives(a: Compute, stage: int, p: int, v: int) -> list[P2POp]:
    vs = virtual_stage(stage, a.chunk, p)
    if isinstance(a, Forward) and vs > 0:
        return [RecvActivation(stage_and_chunk(vs - 1, p)[0], a.mb, a.chunk)]
    if isinstance(a, Backward) and vs < p * v - 1:
        return [RecvGrad(stage_and_chunk(vs + 1, p)[0], a.mb, a.chunk)]
    return []


def _sends(a: Compute, stage: int, p: int, v: int) -> list[P2POp]:
    vs = virtual_stage(stage, a.chunk, p)
    if isinstance(a, Forward) and vs < p * v - 1:
        return [SendActivation(stage_and_chunk(vs + 1, p)[0], a.mb, a.chunk)]
    if isinstance(a, Backward) and vs > 0:
        return [SendGrad(stage_and_chunk(vs - 1, p)[0], a.mb, a.chunk)]
    return []


def _append_batch(actions: list[Action], ops: list[P2POp]) -> None:
    if len(ops) == 1:
        actions.append(ops[0])
    elif ops:
        actions.append(CommBatch(tuple(ops)))
