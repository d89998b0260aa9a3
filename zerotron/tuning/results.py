"""What the autotuner leaves in ``results_dir``, with DeepSpeed's names where it has them:

- ``results.csv``: one row per experiment (knobs, estimated memory, status, metrics, seconds);
- ``summary.txt``: DeepSpeed's table (tuning space, experiments, best metric, best
  experiment) and every experiment as a markdown table;
- ``metric.png``: the metric per experiment (matplotlib, Agg), failed ones marked;
- ``ds_config_optimal.json`` and ``cmd_optimal.txt``: the best experiment's DeepSpeed config
  (without the autotuning block) and the command that trains with it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerotron.fileio import atomic_write_text, human_bytes
from zerotron.tuning.experiments import Experiment, Outcome

Record = tuple[Experiment, Outcome]
SETTING_COLUMNS = (
    "zero_stage",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "tp",
    "pp",
    "recompute",
)
METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "flops": "flops"}
UNITS = {"throughput": "samples/s", "latency": "ms/step", "flops": "FLOP/s per rank"}


def metric_value(outcome: Outcome, metric: str) -> float | None:
    """The experiment's value of ``metric`` (None: not measured)."""
    value = outcome.metrics.get(METRIC_KEYS[metric]) if outcome.ok else None
    return None if value is None else float(value)


def better(a: float, b: float | None, metric: str) -> bool:
    """Whether ``a`` beats ``b``: lower latency, higher throughput or FLOP/s. (DeepSpeed
    maximizes every metric, latency too; zerotron minimizes latency.)"""
    if b is None:
        return True
    return a < b if metric == "latency" else a > b


def best_record(records: Sequence[Record], metric: str) -> Record | None:
    """The measured experiment with the best ``metric`` (first one on a tie)."""
    best, best_value = None, None
    for exp, outcome in records:
        value = metric_value(outcome, metric)
        if value is not None and better(value, best_value, metric):
            best, best_value = (exp, outcome), value
    return best


def write_csv(records: Sequence[Record], path: Path) -> None:
    columns = [
        "name",
        "space",
        *SETTING_COLUMNS,
        "other_settings",
        "estimated_bytes",
        "status",
        "latency_ms",
        "throughput",
        "flops",
        "seconds",
        "error",
    ]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(columns)
    for exp, out in records:
        others = {k: v for k, v in exp.settings.items() if k not in SETTING_COLUMNS}
        writer.writerow(
            [
                exp.name,
                exp.space,
                *(exp.settings.get(k, "") for k in SETTING_COLUMNS),
                json.dumps(others) if others else "",
                "" if exp.estimated_bytes is None else exp.estimated_bytes,
                out.status,
                _num(out.metrics.get("latency")),
                _num(out.metrics.get("throughput")),
                _num(out.metrics.get("flops")),
                f"{out.seconds:.1f}",
                out.error,
            ]
        )
    atomic_write_text(path, buf.getvalue())


def _num(value: Any) -> str:
    return "" if value is None else f"{float(value):.6g}"


def summary(records: Sequence[Record], metric: str, header: Sequence[str] = ()) -> str:
    """DeepSpeed's per-space table, then every experiment (markdown)."""
    spaces: dict[str, list[Record]] = {}
    for rec in records:
        spaces.setdefault(rec[0].space, []).append(rec)
    lines = [*header, ""] if header else []
    lines += [
        "| tuning_space | num_experiments | best_metric_val | best_exp_name |",
        "|:---|---:|---:|:---|",
    ]
    overall = best_record(records, metric)
    rows = [(name, recs) for name, recs in spaces.items()] + [("global", list(records))]
    for name, recs in rows:
        best = best_record(recs, metric)
        value = f"{metric_value(best[1], metric):.6g}" if best else "-"
        lines.append(f"| {name} | {len(recs)} | {value} | {best[0].name if best else '-'} |")
    lines += [
        "",
        f"| experiment | status | {metric} ({UNITS[metric]}) | estimated memory | seconds | note |",
        "|:---|:---|---:|---:|---:|:---|",
    ]
    for exp, out in records:
        value = metric_value(out, metric)
        mem = "-" if exp.estimated_bytes is None else human_bytes(exp.estimated_bytes)
        mark = " (best)" if overall is not None and exp is overall[0] else ""
        lines.append(
            f"| {exp.name}{mark} | {out.status} | {'-' if value is None else f'{value:.6g}'} "
            f"| {mem} | {out.seconds:.1f} | {out.error.replace('|', '/')[:120]} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: Sequence[Record], metric: str, path: Path) -> None:
    """Bars of ``metric`` per experiment; experiments without a value are marked at zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [exp.name for exp, _ in records]
    values = [metric_value(out, metric) for _, out in records]
    best = best_record(records, metric)
    colors = [
        "tab:green" if best is not None and exp is best[0] else "tab:blue" if v else "tab:red"
        for (exp, _), v in zip(records, values)
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(names) + 2), 4.5))
    ax.bar(range(len(names)), [v or 0.0 for v in values], color=colors)
    for i, ((_, out), v) in enumerate(zip(records, values)):
        if v is None:
            ax.text(i, 0, out.status, rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(f"{metric} ({UNITS[metric]})")
    ax.set_title(f"{metric} per experiment\n(green: best; red: not measured)", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def write_optimal(
    best: Record, ds_config: dict[str, Any], cmd: list[str], results_dir: Path
) -> tuple[Path, Path]:
    """``ds_config_optimal.json`` and ``cmd_optimal.txt`` in ``results_dir``."""
    config = {k: v for k, v in ds_config.items() if k != "autotuning"}
    config_path = results_dir / "ds_config_optimal.json"
    cmd_path = results_dir / "cmd_optimal.txt"
    atomic_write_text(config_path, json.dumps(config, indent=2) + "\n")
    atomic_write_text(cmd_path, shlex.join(cmd) + "\n")
    return config_path, cmd_path


def write_all(
    records: Sequence[Record], metric: str, results_dir: Path, header: Sequence[str] = ()
) -> str:
    """results.csv, summary.txt and metric.png; returns the summary text."""
    results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(records, results_dir / "results.csv")
    text = summary(records, metric, header)
    atomic_write_text(results_dir / "summary.txt", text)
    if records:
        plot(records, metric, results_dir / "metric.png")
    return text
