"""A failed or timed-out collective as a :class:`DistributedError` that names who is to blame.

:mod:`zerotron.distributed.comm` wraps each call's start and wait in :meth:`Call.guard`. torch
reports a timeout as a backend message without a rank ("Timed out waiting 60000ms for recv
operation to complete") and a peer's exit as "Connection closed by peer"; here they become

- ``all_reduce on the dp group [0, 1] did not finish within 5 s: rank 1 is stuck (stopped: ...)``
  (the stuck members come from :func:`zerotron.distributed.liveness.diagnose`), or
- ``all_reduce on the dp group [0, 1] failed: a peer left (Connection closed by peer ...)``.

The launcher reads these phrases ("is stuck", "a peer left") to name the rank that caused a
failure rather than the ones that saw it (:mod:`zerotron.launcher.failures`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerotron.distributed import init, liveness
from zerotron.errors import DistributedError

PEER_LEFT = "a peer left"
_TIMEOUT_WORDS = ("timed out", "timeout")
_CLOSED_WORDS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "eof",
    "closed by peer",
    "connection was likely closed",  # gloo, when a peer process is gone
    "caused by a remote worker",
)
_FIX_TIMEOUT = (
    "the stuck rank's own output shows where it stopped; if it is only slow (a long save, a "
    "first compile), raise --distributed-timeout-minutes"
)
_FIX_LEFT = "the rank that left first is the cause: see its own error above"


@dataclass
class Call:
    """One communication call: the group it ran on, its op, its number on the group, for
    point-to-point calls the peers (global ranks), and the bytes the ledger recorded."""

    group: Any  # comm.Group
    op: str
    number: int = 0
    peers: tuple[int, ...] | None = None
    nbytes: int = 0

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a torch error inside the block into a :class:`DistributedError` about it."""
        try:
            yield
        except RuntimeError as err:
            raise self.error(err) from err

    def error(self, err: BaseException) -> DistributedError:
        text = _first_line(err)
        low = text.lower()
        if any(w in low for w in _TIMEOUT_WORDS):
            return self._timed_out()
        what = self._what()
        if any(w in low for w in _CLOSED_WORDS):
            return DistributedError(
                f"{what} failed: {PEER_LEFT} ({text})", where=f"comm.{self.op}", fix=_FIX_LEFT
            )
        return DistributedError(f"{what} failed: {text}", where=f"comm.{self.op}")

    def _what(self) -> str:
        if self.peers is not None:
            return f"{self.op} with {_ranks(list(self.peers))}"
        return f"{self.op} on the {self.group.name} group {list(self.group.ranks)}"

    def _others(self) -> list[int]:
        me = init.get_rank()
        pool = self.peers if self.peers is not None else self.group.ranks
        return [r for r in pool if r != me]

    def _timed_out(self) -> DistributedError:
        seconds = init.timeout().total_seconds()
        others = self._others()
        found = liveness.diagnose(key(self.group), others, self.number if self.peers is None else 0)
        clauses = []
        if found["stopped"]:
            clauses.append(
                f"{_ranks(found['stopped'])} {_be(found['stopped'])} stuck (stopped: no "
                "heartbeat; a SIGSTOP, a debugger, or a hang outside Python)"
            )
        if found["behind"]:
            clauses.append(
                f"{_ranks(found['behind'])} {_be(found['behind'])} stuck (running, but "
                f"{'it has' if len(found['behind']) == 1 else 'they have'} not reached this "
                f"call, number {self.number} on the group)"
            )
        if not clauses and len(others) == 1:  # the only other member: it must be the one
            clauses.append(f"{_ranks(others)} is stuck (it never answered)")
        if not clauses:
            clauses.append(f"waiting for {_ranks(others)}; none could be told apart as stuck")
        return DistributedError(
            f"{self._what()} did not finish within {seconds:g} s: {'; '.join(clauses)}",
            where=f"comm.{self.op}",
            fix=_FIX_TIMEOUT,
        )


def key(group: Any) -> str:
    """The heartbeat's name for a group: every member derives the same one."""
    return f"{group.name}{list(group.ranks)}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _be(ranks: list[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
