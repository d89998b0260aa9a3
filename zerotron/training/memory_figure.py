"""Stacked bars of per-rank memory terms, as a PNG: the one figure of memory.

Drawn by ``--memory-breakdown-step`` (:mod:`zerotron.training.memory_breakdown`, measured per
rank) and ``zerotron estimate`` (``--plot``: estimated per layout; ``--compare``: both side by
side). Imports nothing heavy: matplotlib only when drawing.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from zerotron.errors import ConfigError
from zerotron.fileio import atomic_write_bytes

MIB = 2**20
ORDER = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_states",
    "activations",
    "recompute_workspace",
    "comm_buffers",
    "loss_workspace",
)
"""The terms bottom to top, each with its own colour in every figure."""


def draw_stacked(
    bars: Sequence[tuple[str, Mapping[str, int]]],
    path: str | os.PathLike,
    title: str,
    marks: Sequence[int | None] | None = None,
    line: tuple[str, int] | None = None,
) -> None:
    """A PNG of stacked bars of memory terms (bytes, drawn in GiB or MiB), one per ``(label,
    terms)``; ``marks``: a byte count per bar drawn as a black tick (e.g. the allocator's
    peak); ``line``: a labelled horizontal line (e.g. the device's memory). Written
    crash-safe; :class:`~zerotron.errors.ConfigError` when matplotlib cannot be imported."""
    try:  # lazy: matplotlib is an extra, and slow to import
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ConfigError(
            f"drawing the memory breakdown needs matplotlib, which cannot be imported ({e})",
            where=str(path),
            fix="pip install 'zerotron[plot]'",
        ) from e
    heights = [sum(t.values()) for _, t in bars] + [m or 0 for m in marks or []]
    largest = max([*heights, line[1] if line is not None else 0])
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", MIB)
    fig = Figure(figsize=(max(5.0, 1.3 * len(bars) + 3.0), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = [label for label, _ in bars]
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    given = [t for t in dict.fromkeys(k for _, b in bars for k in b) if t != "total"]
    terms = [t for t in ORDER if t in given] + [t for t in given if t not in ORDER]
    for term in terms:
        values = [b.get(term, 0) / scale for _, b in bars]
        if not any(values):
            continue
        slot = ORDER.index(term) if term in ORDER else len(ORDER) + terms.index(term)
        ax.bar(x, values, bottom=bottom, label=term.replace("_", " "), color=f"C{slot % 10}")
        bottom = [b + v for b, v in zip(bottom, values)]
    label = "allocator peak"
    for i, mark in enumerate(marks or []):
        if mark is not None:
            ax.plot([i - 0.4, i + 0.4], [mark / scale] * 2, color="black", label=label)
            label = None  # one legend entry
    if line is not None:
        ax.axhline(line[1] / scale, color="black", linestyle="--", linewidth=1, label=line[0])
    ax.set_xticks(x, labels)
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
