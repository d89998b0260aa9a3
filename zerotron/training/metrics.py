"""The run's metrics file: what ``zerotron pretrain`` and the Engine record for ``zerotron report``.

One JSON-lines file per rank, ``<dir>/metrics/rank<R>.jsonl`` (``<dir>``: ``--metrics-dir``,
else ``--save``), each record ``{"kind": KIND, "time": unix seconds, ...fields}``, appended and
flushed as written, so a crash loses at most the last line (readers skip it). Kinds and fields
are listed in docs/report.md: ``run``, ``step``, ``eval``, ``checkpoint``, ``memory``,
``profile``.

The file class lives in :mod:`zerotron.fileio` (the bottom layer) so that the Engine, below
training/, writes through the same class; this module is its documented entry.
"""

from __future__ import annotations

from zerotron.fileio import MetricsFile, metrics_path, read_metrics

__all__ = ["MetricsFile", "metrics_path", "read_metrics"]
