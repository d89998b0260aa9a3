"""The ledger of zerotron's communication: every collective and point-to-point call as
``(group, op, bytes)``.

:mod:`zerotron.distributed.comm` records each call it makes in :data:`ledger` (its module
docstring lists what each op records); tests assert exact traffic with ``ledger.capture()``,
benchmarks compare the totals with closed-form theory. This module only keeps the books: it
calls no ``torch.distributed`` function.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Ledger:
    """Collective calls recorded as ``(group, op, bytes)``.

    ``total()``/``count()`` are exact for the whole life of the ledger. ``entries`` keeps the
    calls themselves; the module-level ledger keeps only the most recent ``max_entries`` of
    them (a long run makes millions of calls), ledgers from :meth:`capture` keep all.
    """

    def __init__(self, max_entries: int | None = None):
        self.max_entries = max_entries
        self.entries: list[tuple[str, str, int]] = []
        self._totals: dict[tuple[str, str], list[int]] = {}
        self._captures: list[Ledger] = []
        # Gradient hooks may run on autograd's device threads.
        self._lock = threading.Lock()

    def record(self, group: str, op: str, nbytes: int) -> None:
        """Add one call; active captures see it too."""
        with self._lock:
            self._add(group, op, nbytes)
            for sub in self._captures:
                sub._add(group, op, nbytes)

    def _add(self, group: str, op: str, nbytes: int) -> None:
        self.entries.append((group, op, nbytes))
        if self.max_entries is not None and len(self.entries) > self.max_entries:
            del self.entries[: len(self.entries) - self.max_entries // 2]
        slot = self._totals.setdefault((group, op), [0, 0])
        slot[0] += nbytes
        slot[1] += 1

    def reset(self) -> None:
        """Forget everything recorded so far (active captures keep theirs)."""
        with self._lock:
            self.entries.clear()
            self._totals.clear()

    def total(self, group: str | None = None, op: str | None = None) -> int:
        """Bytes recorded, optionally only for one group name and/or one op."""
        return sum(v[0] for k, v in self._select(group, op))

    def count(self, group: str | None = None, op: str | None = None) -> int:
        """Number of calls recorded, filtered like :meth:`total`."""
        return sum(v[1] for k, v in self._select(group, op))

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(group, op): (bytes, calls)}`` over everything recorded."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in sorted(self._totals.items())}

    def _select(self, group: str | None, op: str | None) -> list[tuple[tuple[str, str], list]]:
        with self._lock:
            return [
                (k, list(v))
                for k, v in self._totals.items()
                if (group is None or k[0] == group) and (op is None or k[1] == op)
            ]

    @contextmanager
    def capture(self) -> Iterator[Ledger]:
        """A fresh ledger that records every call made inside the ``with`` block."""
        sub = Ledger()
        with self._lock:
            self._captures.append(sub)
        try:
            yield sub
        finally:
            with self._lock:
                self._captures.remove(sub)


ledger = Ledger(max_entries=100_000)
"""Every call made through :mod:`zerotron.distributed.comm`, in this process."""
