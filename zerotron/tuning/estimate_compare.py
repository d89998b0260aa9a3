"""``zerotron estimate --compare RUN_DIR``: the estimate beside what a run measured, per rank.

A run started with ``--memory-breakdown-step N`` left a ``memory`` record per rank in its
metrics files (``RUN_DIR/metrics/rank<R>.jsonl``, :mod:`zerotron.training.memory_breakdown`).
This module estimates each of those ranks (its pipeline stage) for the run's own config and
layout, read from the same file's ``run`` record (or, where the run wrote none, from the
``zerotron pretrain`` flags given on the command line), with the run's tokenizer size and
device kind, and prints per term: estimated, measured, their ratio. On CUDA the allocator's
peak of the step is printed under the measured total. A figure of both, side by side per rank,
goes to ``RUN_DIR/figures/memory_estimate_vs_measured.png`` (``zerotron report`` shows it).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from zerotron.config import Config
from zerotron.errors import ConfigError
from zerotron.fileio import read_metrics
from zerotron.kernels.policy import KernelChoices
from zerotron.tuning.estimate import Layout, ModelShape, estimate

MIB = 2**20
SCALARS = 64  # bytes: a loss or norm reduced on its own, no term of the estimate
FIGURE = Path("figures") / "memory_estimate_vs_measured.png"


@dataclasses.dataclass
class RankComparison:
    """One rank's measured terms and the estimate of its stage (bytes per term)."""

    rank: int
    coords: str
    iteration: int
    measured: dict[str, int]
    estimated: dict[str, int]
    cuda_max_allocated: int | None = None

    def rows(self) -> list[tuple[str, int | None, int | None]]:
        """``(term, estimated, measured)`` for every term either side has, then ``total``
        (a term the run does not measure apart, the recompute workspace, is None on its side;
        it has a row only where it is estimated above 0)."""
        terms = list(dict.fromkeys([*self.estimated, *self.measured]))
        out = [
            (t, self.estimated.get(t), self.measured.get(t))
            for t in terms
            if t in self.measured or self.estimated.get(t)  # nothing either side: no row
        ]
        out.append(("total", sum(self.estimated.values()), sum(self.measured.values())))
        return out


def _records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    files = sorted((run_dir / "metrics").glob("rank*.jsonl"))
    if not files:
        raise ConfigError(
            f"no metrics files in {run_dir / 'metrics'}",
            where="--compare",
            fix="give the directory a run wrote its metrics to (--metrics-dir, else --save)",
        )
    out = {}
    for path in files:
        try:
            out[int(path.stem.removeprefix("rank"))] = read_metrics(path)
        except ValueError:
            continue  # not a rank's file
    return out


def _config(records: list[dict[str, Any]], flags_cfg: Config | None, where: str) -> Any:
    runs = [r for r in records if r.get("kind") == "run" and r.get("config")]
    if not runs:
        if flags_cfg is not None:
            return flags_cfg
        raise ConfigError(
            f"{where} has no run record, so the run's config is not known",
            where="--compare",
            fix="give the run's zerotron pretrain flags too (zerotron estimate FLAGS --compare "
            "RUN_DIR)",
        )
    return config_of(runs[-1]["config"])


def config_of(data: dict[str, Any]) -> Any:
    """The config a ``run`` record holds, for :meth:`ModelShape.from_config` and
    :meth:`Layout.from_config`: every section's resolved values (what ``zerotron pretrain``
    records: derived values included, so read as they are, not validated again), or a Config's
    inputs (:meth:`Config.to_dict`)."""
    sections = Config.model_fields
    resolved = all(
        isinstance(data.get(name), dict) and set(data[name]) >= set(field.annotation.model_fields)
        for name, field in sections.items()
    )
    if not resolved:
        return Config.from_dict(data)
    return SimpleNamespace(
        **{name: f.annotation.model_construct(**data[name]) for name, f in sections.items()}
    )


def compare(run_dir: str | Path, flags_cfg: Config | None = None) -> list[RankComparison]:
    """Every rank's last ``memory`` record in ``run_dir`` with the estimate of its stage."""
    run_dir = Path(run_dir)
    out = []
    for rank, records in sorted(_records(run_dir).items()):
        memory = [r for r in records if r.get("kind") == "memory"]
        if not memory:
            continue
        m = memory[-1]
        cfg = _config(records, flags_cfg, f"{run_dir}/metrics/rank{rank}.jsonl")
        shape = ModelShape.from_config(cfg, vocab_size=m["vocab_size"])
        kernels = KernelChoices(**m["kernels"]) if "kernels" in m else None
        layout = Layout.from_config(cfg, device=m.get("device", "cuda"), kernels=kernels)
        mem = estimate(shape, layout, m.get("pp_rank", 0))
        estimated = {k: v for k, v in dataclasses.asdict(mem).items() if k != "host"}
        out.append(
            RankComparison(
                rank=rank,
                coords=f"tp{m.get('tp_rank', 0)} pp{m.get('pp_rank', 0)} dp{m.get('dp_rank', 0)}",
                iteration=m["iteration"],
                measured=dict(m["terms"]),
                estimated=estimated,
                cuda_max_allocated=m.get("cuda_max_allocated_bytes"),
            )
        )
    if not out:
        raise ConfigError(
            f"no memory record in {run_dir / 'metrics'}",
            where="--compare",
            fix="run zerotron pretrain with --memory-breakdown-step N (N <= --train-iters)",
        )
    return out


def _ratio(estimated: int | None, measured: int | None) -> str:
    if estimated is None or measured is None:
        return "-"
    if measured == 0:
        return "=" if estimated == 0 else "inf"
    if estimated == 0 and measured <= SCALARS:
        return "scalars only"
    return f"{estimated / measured:.3f}"


def _mib(value: int | None) -> str:
    return "not measured" if value is None else f"{value / MIB:.3f}"


def print_comparison(results: list[RankComparison], file: Any = None) -> None:
    """One table per rank: term, estimated and measured MiB, estimated / measured."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=100)
    for r in results:
        table = Table(
            title=f"rank {r.rank} ({r.coords}), iteration {r.iteration}: MiB",
            title_justify="left",
        )
        for name in ("term", "estimated", "measured", "estimated / measured"):
            table.add_column(name, justify="left" if name == "term" else "right")
        for term, e, m in r.rows():
            style = "bold" if term == "total" else None
            table.add_row(term.replace("_", " "), _mib(e), _mib(m), _ratio(e, m), style=style)
        if r.cuda_max_allocated is not None:
            table.add_row("allocator peak (CUDA)", "", _mib(r.cuda_max_allocated), "")
        console.print(table)


def as_json(results: list[RankComparison]) -> list[dict[str, Any]]:
    """The comparison as plain data (``--json``)."""
    return [
        {
            **dataclasses.asdict(r),
            "rows": [
                {"term": t, "estimated": e, "measured": m, "ratio": _ratio(e, m)}
                for t, e, m in r.rows()
            ],
        }
        for r in results
    ]


def draw(results: list[RankComparison], path: str | Path) -> None:
    """Estimated and measured stacked bars, side by side per rank."""
    from zerotron.training.memory_figure import draw_stacked

    bars, marks = [], []
    for r in results:
        bars += [
            (f"rank {r.rank}\nestimated", r.estimated),
            (f"rank {r.rank}\nmeasured", r.measured),
        ]
        marks += [None, r.cuda_max_allocated]
    draw_stacked(bars, path, "zerotron estimate vs measured, per rank", marks=marks)
