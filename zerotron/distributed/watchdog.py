"""The collective watchdog: a rank that has waited too long in a collective says what it waits in.

:mod:`zerotron.distributed.comm` marks every blocking wait (a collective's ``wait()``, a
barrier, a batch of point-to-point messages) with :func:`enter` and :func:`leave`: the op, the
group's name and ranks, the bytes, the call's number on the group (every member numbers its
calls on a group alike, so a member with a lower number has not reached this call yet) and, for
point-to-point, the peers. That costs one ``time.monotonic()``, one small object and a dict
write per call; nothing else runs on the calling thread. While a timeline is recorded
(:mod:`~zerotron.distributed.trace`, :func:`observe`), the same marks open and close its spans.

One daemon thread per rank (:func:`start`, from :func:`zerotron.distributed.init_distributed`)
looks every ``period`` seconds. When a wait has lasted ``threshold`` seconds it reports once:

- on stderr, one line: ``zerotron watchdog: rank 1 has waited 30.0 s in all_reduce on the dp
  group [0, 1] (call 2 on the group, 16 bytes)``, followed by every thread's Python stack when
  no launcher collects the reports;
- when ``ZEROTRON_WATCHDOG_DIR`` names a directory (``zerotron launch`` sets it), the whole
  report as JSON in ``<dir>/rank<R>.<pid>.json`` (written atomically): rank, pid, host, what it
  waits in, for how long, every thread's stack, and for a collective how many calls on the group
  each other member had entered at its last heartbeat (:mod:`~zerotron.distributed.liveness`:
  read from the job's store, so it covers members on other nodes too).
  :mod:`zerotron.launcher.hangs` reads these.

The launcher, once one rank reported, asks every rank where it is by writing
``<dir>/request``; each rank's thread answers within a period with the same report, also when
it waits in nothing (then the stack shows what it is doing instead). A rank that cannot answer
(stopped, or holding the interpreter lock) is thereby named too.

The threshold is ``ZEROTRON_WATCHDOG_TIMEOUT`` seconds (``zerotron launch --watchdog-timeout``;
0 turns the watchdog off), by default a quarter of the process-group timeout
(``--distributed-timeout-minutes``): late enough that a slow but healthy wait (a checkpoint
save on one rank while the others wait at the barrier) does not fire, early enough that the
reports and the launcher's summary are done long before torch's own timeout errors begin.
The watchdog only reports; the rank keeps waiting, and ending the job is the launcher's choice.

A rank doing something long on purpose while its peers wait (writing its checkpoint files) says
so with :func:`busy`; its reports carry that, and the launcher keeps the job waiting while it
lasts rather than ending a slow save as a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from threading import get_ident
from typing import Any

from zerotron.distributed import liveness
from zerotron.fileio import atomic_write_text

ENV_TIMEOUT = "ZEROTRON_WATCHDOG_TIMEOUT"
ENV_DIR = "ZEROTRON_WATCHDOG_DIR"
REQUEST = "request"  # the file the launcher writes to ask every rank for a report
MARK = "zerotron watchdog: "
DEFAULT_FRACTION = 0.25  # of the process-group timeout

_waits: dict[int, Wait] = {}  # thread id -> the wait it is in (at most one per thread)
_dog: _Dog | None = None
_busy: list[str] = []  # what this rank is doing on purpose that may keep its peers waiting
_observer: Any = None  # the timeline recorder (zerotron.distributed.trace) while one records


class Wait:
    """What one thread waits in (a :class:`~.failures.Call`), since when (``time.monotonic()``).

    Only a reference to the call is kept: reading its fields is the watchdog thread's work.
    """

    __slots__ = ("call", "since", "previous", "told", "span")

    def __init__(self, call: Any, previous: Wait | None) -> None:
        self.call = call
        self.since = time.monotonic()
        self.previous = previous
        self.told = False
        self.span: Any = None  # the recorder's span of this wait, while one records

    def describe(self, now: float) -> dict[str, Any]:
        call = self.call
        peers = call.peers
        return {
            "op": call.op,
            "group": call.group.name,
            "ranks": list(call.group.ranks),
            "seq": call.number,
            "bytes": getattr(call, "nbytes", 0),
            "peers": None if peers is None else list(peers),
            "waited_s": round(now - self.since, 3),
        }


def enter(call: Any) -> Wait:
    """Mark the calling thread as waiting in ``call`` (a :class:`~.failures.Call`)."""
    tid = get_ident()
    wait = _waits[tid] = Wait(call, _waits.get(tid))
    if _observer is not None:
        wait.span = _observer.begin_wait(call)
    return wait


def leave(wait: Wait) -> None:
    """The wait of :func:`enter` is over (finished or failed)."""
    if wait.span is not None and _observer is not None:
        _observer.end(wait.span)
    tid = get_ident()
    if wait.previous is None:
        _waits.pop(tid, None)
    else:
        _waits[tid] = wait.previous


def observe(observer: Any) -> None:
    """Tell ``observer`` of every wait (``begin_wait(call) -> span`` at :func:`enter`,
    ``end(span)`` at :func:`leave`); None stops. The timeline recorder uses this seam."""
    global _observer
    _observer = observer


def threshold_for(timeout_s: float) -> float | None:
    """The watchdog's threshold in seconds for a process-group timeout; None: switched off."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value < 0:
            print(f"{MARK}ignoring {ENV_TIMEOUT}={raw!r}: not a number of seconds >= 0",
                  file=sys.stderr, flush=True)  # fmt: skip
        else:
            return value or None
    return timeout_s * DEFAULT_FRACTION


class _Dog:
    def __init__(self, rank: int, threshold: float, directory: str | None) -> None:
        self.rank = rank
        self.threshold = threshold
        self.period = min(1.0, max(0.05, threshold / 10))
        self.dir = directory
        self.request_seen: float | None = None  # mtime of the last request answered
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zerotron-watchdog", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self._look()
            except Exception as e:  # noqa: BLE001 - the watchdog must never take the rank down
                print(f"{MARK}rank {self.rank}: stopped looking: {e!r}", file=sys.stderr)
                return

    def _look(self) -> None:
        now = time.monotonic()
        for wait in list(_waits.values()):
            if not wait.told and now - wait.since >= self.threshold:
                wait.told = True
                self._report(wait, now, "stuck")
        if self.dir is not None:
            with contextlib.suppress(OSError):
                asked = os.stat(os.path.join(self.dir, REQUEST)).st_mtime
                if asked != self.request_seen:
                    self.request_seen = asked
                    waits = sorted(_waits.values(), key=lambda w: w.since)
                    self._report(waits[0] if waits else None, now, "answer")

    def _report(self, wait: Wait | None, now: float, kind: str) -> None:
        heard: dict[int, int] = {}
        if wait is not None and wait.call.peers is None:
            # The members' own count of calls on the group, from their heartbeats: tells a member
            # on another node that is behind from one that is waiting too.
            group = wait.call.group
            key = f"{group.name}{list(group.ranks)}"  # as distributed.failures.key names it
            heard = liveness.calls_of(key, [r for r in group.ranks if r != self.rank])
        report = {
            "kind": kind,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "threshold_s": self.threshold,
            "waiting": None if wait is None else wait.describe(now),
            "busy": _busy[-1] if _busy else None,
            "heard": {str(r): n for r, n in heard.items()},
            "stacks": stacks(),
        }
        if wait is not None and kind == "stuck":
            print(MARK + describe(report), file=sys.stderr, flush=True)
        if self.dir is None:
            for name, text in report["stacks"].items():
                print(f"{MARK}rank {self.rank}, thread {name}:\n{text}", file=sys.stderr)
            sys.stderr.flush()
            return
        path = os.path.join(self.dir, f"rank{self.rank}.{os.getpid()}.json")
        atomic_write_text(path, json.dumps(report))


def describe(report: dict[str, Any]) -> str:
    """One line saying what a report's rank waits in (or that it waits in nothing)."""
    w = report["waiting"]
    who = f"rank {report['rank']}"
    if w is None:
        return f"{who} is not waiting in a collective"
    return f"{who} has waited {w['waited_s']:.1f} s in {where(w)}"


def where(w: dict[str, Any]) -> str:
    """A reported wait in words: op, group (or peers), call number, bytes."""
    if w["peers"] is not None:
        plural = "s" if len(w["peers"]) > 1 else ""
        peers = ", ".join(map(str, w["peers"]))
        return f"{w['op']} with rank{plural} {peers} ({w['bytes']} bytes)"
    return (
        f"{w['op']} on the {w['group']} group {w['ranks']} (call {w['seq']} on the group, "
        f"{w['bytes']} bytes)"
    )


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark a long task of this rank that may keep its peers waiting in a collective (e.g.
    ``"writing its checkpoint files"``): while it lasts the launcher names it and keeps waiting
    instead of ending the job; the process group's own timeout still bounds the wait."""
    _busy.append(what)
    try:
        yield
    finally:
        _busy.pop()


def stacks() -> dict[str, str]:
    """Every thread's Python stack, the main thread first, this watchdog's own left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    out = {}
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    for tid, frame in frames:
        if tid == me:
            continue
        out[names.get(tid, f"thread {tid}")] = "".join(traceback.format_stack(frame))
    return out


def start(rank: int, timeout_s: float) -> None:
    """Start this rank's watchdog thread (idempotent; after the process group exists)."""
    global _dog
    if _dog is not None:
        return
    threshold = threshold_for(timeout_s)
    if threshold is None:
        return
    _dog = _Dog(rank, threshold, os.environ.get(ENV_DIR) or None)
    _dog.thread.start()


def stop() -> None:
    """Stop the watchdog thread (at teardown)."""
    global _dog
    dog, _dog = _dog, None
    if dog is not None:
        dog.stop.set()
        dog.thread.join(timeout=2 * dog.period + 1)


def threshold() -> float | None:
    """The running watchdog's threshold in seconds (None when it is off)."""
    return None if _dog is None else _dog.threshold
