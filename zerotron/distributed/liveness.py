"""Which rank is stuck: a heartbeat per rank in the rendezvous store, read when a wait times out.

A collective that times out only tells the waiting rank that *someone* did not come. To name
that someone, every rank publishes, every ``period`` seconds from a daemon thread, a beat
counter and how many collectives it has entered on each of its groups (the calls counted by
:mod:`zerotron.distributed.comm`), under ``zerotron/alive/<rank>`` in the job's store. When a
wait times out, :func:`diagnose` reads the group's members twice, ``1.5 × period`` apart:

- a member whose beat did not move is *stopped* (SIGSTOP, a debugger, a hang that holds the
  interpreter lock): it is stuck;
- a member whose count for the group is below this rank's is alive but has not reached this
  call (it sleeps, loops or waits elsewhere): it is stuck too.

Nothing is compared across hosts' clocks. The store is the rendezvous store every rank already
has; the thread talks over its own connection (``store.clone()``), so collectives never wait on
it. Costs: one small store write per period per rank, and one counter increment per collective.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

_KEY = "zerotron/alive/"
_counts: dict[str, int] = {}  # group name -> collectives entered on it by this rank
_beat: _Heartbeat | None = None


def count(group: str) -> int:
    """Count one more collective on ``group``; return its number (1, 2, ...)."""
    n = _counts.get(group, 0) + 1
    _counts[group] = n
    return n


def period_for(timeout_s: float) -> float:
    """A beat often enough to tell a stopped rank within the timeout, at most every 5 s."""
    return min(5.0, max(0.2, timeout_s / 6))


@dataclass
class _Heartbeat:
    store: Any
    rank: int
    period: float
    stop: threading.Event
    thread: threading.Thread | None = None


def start(store: Any, rank: int, timeout_s: float) -> None:
    """Publish this rank's beat every period (idempotent; call after the process group exists)."""
    global _beat
    if _beat is not None or store is None:
        return
    try:
        own = store.clone()
    except (RuntimeError, AttributeError):  # an older store without clone(): share it
        own = store
    beat = _Heartbeat(own, rank, period_for(timeout_s), threading.Event())
    _publish(beat, 0)
    beat.thread = threading.Thread(target=_run, args=(beat,), name="zerotron-alive", daemon=True)
    beat.thread.start()
    _beat = beat


def stop() -> None:
    """Stop publishing (at teardown, before the store goes away)."""
    global _beat
    beat, _beat = _beat, None
    _counts.clear()
    if beat is None:
        return
    beat.stop.set()
    if beat.thread is not None:
        beat.thread.join(timeout=2 * beat.period + 1)
    beat.store = None  # close the heartbeat's own connection before the process group goes


def _run(beat: _Heartbeat) -> None:
    seq = 0
    while not beat.stop.wait(beat.period):
        seq += 1
        if not _publish(beat, seq):
            return  # the store is gone: the job is ending


def _publish(beat: _Heartbeat, seq: int) -> bool:
    value = json.dumps({"seq": seq, "counts": dict(_counts)})
    try:
        beat.store.set(_KEY + str(beat.rank), value)
    except Exception:  # noqa: BLE001 - a heartbeat must never take the rank down
        return False
    return True


def _read(store: Any, ranks: list[int]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in ranks:
        key = _KEY + str(r)
        with contextlib.suppress(Exception):
            if store.check([key]):  # get() of a missing key would block for the store timeout
                out[r] = json.loads(store.get(key))
    return out


def calls_of(group: str, members: list[int]) -> dict[int, int]:
    """How many calls on ``group`` each member had entered at its last beat (one reading; the
    members without a beat left out). For the collective watchdog's reports."""
    beat = _beat
    if beat is None or not members:
        return {}
    return {r: seen["counts"].get(group, 0) for r, seen in _read(beat.store, members).items()}


def diagnose(group: str, members: list[int], my_call: int) -> dict[str, list[int]]:
    """The stuck members of ``group`` seen from here: ``{"stopped": [...], "behind": [...]}``.

    ``my_call`` is the number of the call that timed out on this rank. Takes ``1.5 × period``
    (the two readings). Empty lists when there is no heartbeat to read.
    """
    beat = _beat
    if beat is None or not members:
        return {"stopped": [], "behind": []}
    first = _read(beat.store, members)
    time.sleep(1.5 * beat.period)
    second = _read(beat.store, members)
    stopped = [r for r in members if r in first and second.get(r, {}).get("seq") == first[r]["seq"]]
    behind = [
        r
        for r in members
        if r in second and r not in stopped and second[r]["counts"].get(group, 0) < my_call
    ]
    silent = [r for r in members if r not in first and r not in second]
    return {"stopped": sorted(stopped + silent), "behind": behind}
