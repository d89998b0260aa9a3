"""The curves of ``zerotron report``: a run directory's metrics files, read and drawn.

:func:`load_run` reads ``<dir>/metrics/rank*.jsonl`` (:mod:`zerotron.training.metrics`) into a
:class:`RunLog`; :func:`draw_all` draws every plot of the page as PNG bytes, the runs overlaid
(one colour per run, the legend its directory name). Iteration axes carry the run's
checkpoint saves (dotted) and restarts/resumes (dashed red). A plot with nothing to draw (no
evaluation, no loss scaling) is drawn anyway, saying so, so the page has the same plots for
every run. matplotlib's object API with the Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotron.errors import ConfigError, DataError
from zerotron.fileio import read_metrics

RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")


@dataclass
class RunLog:
    """One run directory's records, by rank, in the order they were written."""

    name: str
    directory: Path
    ranks: dict[int, list[dict[str, Any]]]
    figures: list[Path] = field(default_factory=list)

    @property
    def main(self) -> list[dict[str, Any]]:
        """The lowest rank's records (losses, rates and counters are the same on every rank)."""
        return self.ranks[min(self.ranks)]

    def records(self, kind: str, rank: int | None = None) -> list[dict[str, Any]]:
        rows = self.main if rank is None else self.ranks[rank]
        return [r for r in rows if r.get("kind") == kind]

    @property
    def starts(self) -> list[dict[str, Any]]:
        return self.records("run")

    @property
    def restarts(self) -> list[int]:
        """Iterations at which the run restarted or resumed (every ``run`` record but a fresh
        start)."""
        return [
            int(r.get("iteration") or 0)
            for i, r in enumerate(self.starts)
            if i > 0 or (r.get("iteration") or 0) > 0
        ]

    @property
    def checkpoints(self) -> list[int]:
        return [int(r["iteration"]) for r in self.records("checkpoint") if "iteration" in r]


def load_run(directory: str | Path) -> RunLog:
    """The records of a run directory (its ``metrics/`` folder, or that folder itself)."""
    directory = Path(directory)
    folder = directory / "metrics"
    if not folder.is_dir() and any(RANK_FILE.search(p.name) for p in directory.glob("*.jsonl")):
        folder, directory = directory, directory.parent  # given the metrics folder itself
    files = sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []
    ranks = {}
    for path in files:
        m = RANK_FILE.search(path.name)
        if m:
            ranks[int(m.group(1))] = read_metrics(path)
    ranks = {r: rows for r, rows in ranks.items() if rows}
    if not ranks:
        raise DataError(
            f"no metrics records in {directory} (looked for {folder}/rank<R>.jsonl)",
            where=str(directory),
            fix="pass the --save (or --metrics-dir) directory of a `zerotron pretrain` run, or "
            'the "metrics_dir" of a DeepSpeed config; runs record from this version on',
        )
    figures = sorted((directory / "figures").glob("*.png"))
    return RunLog(directory.resolve().name or str(directory), directory, ranks, figures)


# ---- series -----------------------------------------------------------------------------


def series(
    run: RunLog, kind: str, value: Callable[[dict], Any], rank: int | None = None
) -> tuple[list[float], list[float]]:
    """``(iterations, values)`` of ``kind`` records; a restart breaks the line (a NaN gap)."""
    xs: list[float] = []
    ys: list[float] = []
    rows = run.main if rank is None else run.ranks[rank]
    for r in rows:
        if r.get("kind") == "run" and xs:
            xs.append(math.nan)
            ys.append(math.nan)
        if r.get("kind") != kind or r.get("iteration") is None:
            continue
        y = value(r)
        xs.append(float(r["iteration"]))
        ys.append(float(y) if y is not None else math.nan)
    return xs, ys


def _field(name: str) -> Callable[[dict], Any]:
    return lambda r: r.get(name)


def _ppl(r: dict) -> float | None:
    loss = r.get("loss")
    return math.exp(min(20.0, loss)) if loss is not None else None


def _has(ys: list[float]) -> bool:
    return any(not math.isnan(y) for y in ys)


# ---- drawing ----------------------------------------------------------------------------


def _figure(rows: int = 1, height: float = 3.4) -> Any:
    try:  # lazy: keeps the CLI fast; matplotlib is an extra
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ConfigError(
            f"zerotron report draws with matplotlib, which cannot be imported ({e})",
            where="zerotron report",
            fix="pip install 'zerotron[plot]'",
        ) from e
    fig = Figure(figsize=(7.0, height * rows), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _events(ax: Any, runs: list[RunLog]) -> None:
    """Checkpoint saves (dotted) and restarts/resumes (dashed red) on an iteration axis."""
    labelled = set()
    for i, run in enumerate(runs):
        for it in run.checkpoints:
            label = None if "ckpt" in labelled else "checkpoint saved"
            labelled.add("ckpt")
            ax.axvline(it, color=f"C{i}", linestyle=":", linewidth=1, alpha=0.7, label=label)
        for it in run.restarts:
            label = None if "restart" in labelled else "restart / resume"
            labelled.add("restart")
            ax.axvline(it, color="red", linestyle="--", linewidth=1.2, alpha=0.8, label=label)


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)


def _finish(ax: Any, runs: list[RunLog], ylabel: str, drew: bool, what: str) -> None:
    if drew:
        _events(ax, runs)
        # beside the axes: never over a curve, and no "best" search (slow on long runs)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        _empty(ax, what)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _lines(ax: Any, runs: list[RunLog], kind: str, value: Callable, label: str = "") -> bool:
    drew = False
    for i, run in enumerate(runs):
        xs, ys = series(run, kind, value)
        if _has(ys):
            ax.plot(xs, ys, color=f"C{i}", marker=".", label=f"{run.name}{label}")
            drew = True
    return drew


def plot_loss(runs: list[RunLog], value: Callable, ylabel: str, log: bool = False) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    drew = _lines(ax, runs, "step", value, " train")
    for i, run in enumerate(runs):
        xs, ys = series(run, "eval", value)
        if _has(ys):
            ax.plot(xs, ys, color=f"C{i}", linestyle="--", marker="o", label=f"{run.name} valid")
            drew = True
    if log and drew:
        ax.set_yscale("log")
    ax.set_title(f"train and validation {ylabel}")
    _finish(ax, runs, ylabel, drew, ylabel)
    return _png(fig)


def plot_field(runs: list[RunLog], name: str, title: str, ylabel: str, log: bool = False) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    drew = _lines(ax, runs, "step", _field(name))
    if log and drew:
        ax.set_yscale("log")
    ax.set_title(title)
    _finish(ax, runs, ylabel, drew, title)
    return _png(fig)


def _skipped(r: dict) -> bool:
    return bool(r.get("skipped")) or bool(r.get("skipped_iterations"))


def plot_loss_scale(runs: list[RunLog]) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    drew = _lines(ax, runs, "step", _field("loss_scale"))
    marked = False
    for run in runs:
        hits = [r for r in run.records("step") if _skipped(r) and r.get("loss_scale") is not None]
        if hits:
            ax.scatter(
                [r["iteration"] for r in hits],
                [r["loss_scale"] for r in hits],
                marker="x",
                color="red",
                s=60,
                zorder=5,
                label=None if marked else "skipped step(s)",
            )
            marked = True
    if drew:
        ax.set_yscale("log", base=2)
    ax.set_title("loss scale (red x: skipped steps)")
    _finish(ax, runs, "loss scale", drew, "loss scale")
    return _png(fig)


def plot_throughput(runs: list[RunLog]) -> bytes:
    fig = _figure(rows=2, height=2.9)
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    drew = _lines(top, runs, "step", _field("tokens_per_s"))
    top.set_title("throughput")
    _finish(top, runs, "tokens/s", drew, "tokens/s")
    drew = _lines(bottom, runs, "step", lambda r: r["mfu"] * 100 if r.get("mfu") else None)
    _finish(bottom, runs, "MFU (%)", drew, "MFU (no FLOPs or peak known)")
    return _png(fig)


def memory_kinds(run: RunLog) -> list[tuple[str, str]]:
    """``(field, label)`` of the memory counters the run recorded."""
    steps = [r for rows in run.ranks.values() for r in rows if r.get("kind") == "step"]
    if any("cuda_allocated_bytes" in r for r in steps):
        return [("cuda_allocated_bytes", "allocated"), ("cuda_reserved_bytes", "reserved")]
    return [("rss_bytes", "RSS")]


def plot_memory(runs: list[RunLog]) -> bytes:
    fig = _figure(height=3.8)
    ax = fig.add_subplot()
    drew = False
    styles = ("-", "--", ":", "-.")
    for i, run in enumerate(runs):
        for k, (name, label) in enumerate(memory_kinds(run)):
            for j, rank in enumerate(sorted(run.ranks)):
                xs, ys = series(run, "step", _field(name), rank)
                if not _has(ys):
                    continue
                gib = [y / 2**30 for y in ys]
                tag = f"{run.name} rank {rank} {label}" if len(run.ranks) <= 8 or j == 0 else None
                ax.plot(xs, gib, color=f"C{i}", linestyle=styles[k % 4], alpha=0.85, label=tag)
                drew = True
    ax.set_title("memory per rank")
    _finish(ax, runs, "GiB", drew, "memory")
    return _png(fig)


PLOTS: tuple[tuple[str, str, Callable[[list[RunLog]], bytes]], ...] = (
    ("loss", "Train and validation loss", lambda r: plot_loss(r, _field("loss"), "loss")),
    (
        "perplexity",
        "Train and validation perplexity (exp of the loss, capped at e^20)",
        lambda r: plot_loss(r, _ppl, "perplexity", log=True),
    ),
    ("learning_rate", "Learning rate", lambda r: plot_field(r, "lr", "learning rate", "lr")),
    ("loss_scale", "Loss scale, skipped steps marked", plot_loss_scale),
    ("grad_norm", "Gradient norm", lambda r: plot_field(r, "grad_norm", "grad norm", "L2 norm")),
    ("throughput", "Tokens/s and MFU", plot_throughput),
    ("memory", "Memory per rank (allocated/reserved on CUDA, RSS on CPU)", plot_memory),
)
"""``(name, caption, draw)`` of every plot on the page, in order."""


def draw_all(
    runs: list[RunLog], done: Callable[[str], None] | None = None
) -> list[tuple[str, str, bytes]]:
    """``(name, caption, png)`` of every plot in :data:`PLOTS`; ``done(name)`` after each."""
    out = []
    for name, caption, draw in PLOTS:
        out.append((name, caption, draw(runs)))
        if done is not None:
            done(name)
    return out
