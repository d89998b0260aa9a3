"""``--memory-breakdown-step N``: what each rank holds at iteration N, recorded and drawn.

The loop wraps every ``train_batch`` in :meth:`MemoryBreakdownRecorder.around`; for iteration
N it measures the step with :class:`zerotron.engine.memory_breakdown.StepMemory` (for every
other iteration it hands back one shared empty context: no hooks, no cost), then

- every rank appends a ``memory`` record to the run's metrics file, if it writes one
  (``<dir>/metrics/rank<R>.jsonl``, ``<dir>`` = ``--metrics-dir``, else ``--save``):
  ``iteration``, ``terms`` (bytes per term of :data:`~zerotron.engine.memory_breakdown.TERMS`,
  each at its peak in the step), ``total`` (their sum), ``rank``, ``tp_rank`` / ``pp_rank`` /
  ``dp_rank``, ``device``, ``vocab_size`` (the tokenizer's, for the estimate) and on CUDA
  ``cuda_max_allocated_bytes`` (the allocator's peak of the step, to put beside ``total``; the
  allocator's peak statistic is reset as the step starts);
- rank 0 gathers every rank's terms, prints one line per rank, and (with a metrics file) draws
  ``<dir>/figures/memory_breakdown.png`` (a stacked bar per rank; needs matplotlib, else a
  warning).

``zerotron estimate --compare <dir>`` prints these records beside the estimate of the run's
layout; both draw with :func:`zerotron.training.memory_figure.draw_stacked`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from zerotron.distributed import comm
from zerotron.distributed.state import state
from zerotron.engine.memory_breakdown import TERMS, StepMemory
from zerotron.engine.run_metrics import RunMetrics
from zerotron.errors import ConfigError
from zerotron.kernels import current_choices
from zerotron.training.memory_figure import MIB, draw_stacked

FIGURE = Path("figures") / "memory_breakdown.png"
"""Where rank 0 draws the breakdown, relative to the run directory."""

_OFF = contextlib.nullcontext()


class MemoryBreakdownRecorder:
    """Measures iteration ``cfg.training.memory_breakdown_step`` of ``run`` (see the module
    docstring). ``metrics``: the run's metrics writer
    (:class:`~zerotron.engine.run_metrics.RunMetrics`; None: the breakdown is only printed)."""

    def __init__(self, run: Any, metrics: RunMetrics | None = None) -> None:
        self.run = run
        self.step = run.cfg.training.memory_breakdown_step
        self.metrics = metrics
        self.directory = Path(metrics.directory) if metrics is not None else None
        self.record: dict[str, Any] | None = None  # this rank's, once measured
        last = run.cfg.training.train_iters
        if self.step is not None and last is not None and self.step > last and state().rank == 0:
            print(
                f" WARNING: --memory-breakdown-step {self.step} is past --train-iters {last}: "
                "no step's memory is measured",
                flush=True,
            )

    def around(self, iteration: int) -> contextlib.AbstractContextManager[Any]:
        """The context to run iteration ``iteration``'s ``train_batch`` in."""
        if iteration != self.step:
            return _OFF
        return self._measured(iteration)

    @contextlib.contextmanager
    def _measured(self, iteration: int) -> Iterator[None]:
        with StepMemory(self.run.engine) as measured:
            yield
        assert measured.terms is not None
        self._finish(iteration, measured)

    def _finish(self, iteration: int, measured: StepMemory) -> None:
        ps = state()
        record: dict[str, Any] = {
            "iteration": iteration,
            "terms": measured.terms,
            "total": sum(measured.terms.values()),
            "rank": ps.rank,
            "tp_rank": ps.tp_rank,
            "pp_rank": ps.pp_rank,
            "dp_rank": ps.dp_rank,
            "device": self.run.engine.device.type,
            "vocab_size": self.run.tokenizer.vocab_size,
            "kernels": dataclasses.asdict(current_choices()),  # the CPU paths' buffers
        }
        if measured.cuda_max_allocated is not None:
            record["cuda_max_allocated_bytes"] = measured.cuda_max_allocated
        self.record = record
        if self.metrics is not None:
            self.metrics.write("memory", **record)
        rows = self._gather(record)  # every rank takes part, rank 0 gets the rows
        if ps.rank != 0:
            return
        for row in rows:
            print(breakdown_line(row), flush=True)
        if self.directory is not None:
            path = self.directory / FIGURE
            try:
                draw_stacked(
                    [(f"rank {r['rank']}\n{_coords(r)}", r["terms"]) for r in rows],
                    path,
                    f"measured per-rank memory at iteration {iteration}",
                    marks=[r.get("cuda_max_allocated_bytes") for r in rows],
                )
                print(f" memory breakdown drawn in {path}", flush=True)
            except ConfigError as e:  # a missing plotting extra costs the picture, not the run
                print(f" WARNING: no {FIGURE}: {e.what}", flush=True)

    def _gather(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's record (terms, place, CUDA peak) on every rank, in rank order."""
        group = comm.world_group()
        if group.size == 1:
            return [record]
        fields = [record["rank"], record["tp_rank"], record["pp_rank"], record["dp_rank"]]
        fields += [record["terms"][t] for t in TERMS]
        fields.append(record.get("cuda_max_allocated_bytes", -1))
        mine = torch.tensor(fields, dtype=torch.int64, device=self.run.engine.device)
        every = comm.all_gather(mine.unsqueeze(0), group).cpu().tolist()
        rows = []
        for values in every:
            rank, tp, pp, dp = values[:4]
            terms = dict(zip(TERMS, values[4 : 4 + len(TERMS)]))
            row = {"rank": rank, "tp_rank": tp, "pp_rank": pp, "dp_rank": dp, "terms": terms}
            row["total"] = sum(terms.values())
            if values[-1] >= 0:
                row["cuda_max_allocated_bytes"] = values[-1]
            rows.append(row)
        return rows


def _coords(row: Mapping[str, Any]) -> str:
    return f"tp{row['tp_rank']} pp{row['pp_rank']} dp{row['dp_rank']}"


def breakdown_line(row: Mapping[str, Any]) -> str:
    """`` memory breakdown rank 0 (tp0 pp0 dp0), MiB: parameters 1.50 | ... | total 9.00``."""
    parts = [f"{t.replace('_', ' ')} {v / MIB:.2f}" for t, v in row["terms"].items()]
    parts.append(f"total {row['total'] / MIB:.2f}")
    if row.get("cuda_max_allocated_bytes") is not None:
        parts.append(f"allocator peak {row['cuda_max_allocated_bytes'] / MIB:.2f}")
    return f" memory breakdown rank {row['rank']} ({_coords(row)}), MiB: " + " | ".join(parts)
