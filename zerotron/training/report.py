"""``zerotron report RUN_DIR [RUN_DIR ...] [--out report.html]``: one page that shows a run.

Reads the metrics files a run wrote (``<RUN_DIR>/metrics/rank<R>.jsonl``: ``zerotron
pretrain`` writes them into ``--save`` or ``--metrics-dir``, the Engine of a DeepSpeed script
into the config's ``"metrics_dir"``; see :mod:`zerotron.training.metrics`) and writes one
self-contained HTML page, every picture embedded as a base64 PNG (no script, nothing fetched:
it opens offline and can be mailed), plus the PNGs beside it (``<stem>-<plot>.png``):

- a summary per run (layout, iterations, last losses, restarts, checkpoints, how it ended);
- the curves of :mod:`zerotron.training.report_plots`: train/validation loss and perplexity,
  learning rate, loss scale with skipped steps marked, grad norm, tokens/s and MFU (the peak
  and FLOP convention stated under them), memory per rank; checkpoint saves and restarts
  marked on each;
- every ``<RUN_DIR>/figures/*.png`` (pictures other tools write there, e.g. the measured
  pipeline timeline), captioned with its file name;
- the layout and the configuration as tables, the keys where runs differ first.

Several run directories overlay their curves (the legend names each by its directory). A
metrics file cut by a crash still reports (its last, partial line is skipped).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import time
from pathlib import Path
from typing import Any

from zerotron.fileio import atomic_write_bytes, atomic_write_text
from zerotron.progress import Progress
from zerotron.training.report_plots import PLOTS, RunLog, draw_all, load_run

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1600px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
figure { margin: 0; border: 1px solid #ddd; padding: 0.4em; background: #fff; }
figure img { display: block; max-width: 100%; }
figcaption { font-size: 0.9em; color: #444; margin-top: 0.3em; }
table { border-collapse: collapse; font-size: 0.88em; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr.diff td { background: #fff6d6; }
.note { font-size: 0.9em; color: #444; max-width: 70em; }
"""


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _figure(png: bytes, name: str, caption: str, ident: str) -> str:
    return (
        f'<figure id="{html.escape(ident)}" data-name="{html.escape(name)}">{_img(png, name)}'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _table(head: list[str], rows: list[list[Any]], diff: list[bool] | None = None) -> str:
    out = ["<table><tr>", *(f"<th>{html.escape(str(h))}</th>" for h in head), "</tr>"]
    for i, row in enumerate(rows):
        cls = ' class="diff"' if diff and diff[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(_text(v))}</td>" for v in row))
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of a nested config dict."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def _ended(run: RunLog) -> str:
    ends = run.records("end")
    last_start = max((i for i, r in enumerate(run.main) if r.get("kind") == "run"), default=-1)
    if not ends or run.main.index(ends[-1]) < last_start:
        return "no end record: still running, crashed or killed"
    end = ends[-1]
    if end.get("preempted"):
        return f"stopped on {end['preempted']} (checkpoint saved)"
    return "exited early" if end.get("exited_early") else "finished"


def summary_rows(runs: list[RunLog]) -> list[list[Any]]:
    rows = []
    for run in runs:
        start = run.starts[0] if run.starts else {}
        lay = start.get("layout", {})
        steps = run.records("step")
        evals = [r for r in run.records("eval") if r.get("loss") is not None]
        layout = (
            f"tp {lay.get('tp', '?')} · pp {lay.get('pp', '?')} · dp {lay.get('dp', '?')}"
            f" · vpp {lay.get('vpp', '?')} · ZeRO {lay.get('zero_stage', '?')}"
            f" (world {lay.get('world_size', len(run.ranks))})"
        )
        iters = f"{steps[0]['iteration']}…{steps[-1]['iteration']}" if steps else "none"
        rows.append(
            [
                run.name,
                layout,
                len(run.ranks),
                iters,
                steps[-1].get("loss") if steps else None,
                evals[-1]["loss"] if evals else None,
                ", ".join(map(str, run.restarts)) or "none",
                len(run.checkpoints),
                _ended(run),
            ]
        )
    return rows


SUMMARY_HEAD = [
    "run",
    "layout",
    "ranks",
    "iterations logged",
    "last train loss",
    "last validation loss",
    "restarts / resumes at",
    "checkpoints",
    "how it ended",
]


def _peaks(runs: list[RunLog]) -> str:
    parts = []
    for run in runs:
        start = run.starts[-1] if run.starts else {}
        peak = start.get("peak_flops")
        conv = start.get("flops_convention") or "no FLOP convention recorded"
        rate = f"{peak / 1e12:.4g} TFLOP/s per rank" if peak else "no peak known"
        parts.append(f"<b>{html.escape(run.name)}</b>: peak {rate}; {html.escape(conv)}")
    return "<p class=note>MFU: " + "<br>".join(parts) + "</p>"


def _config_tables(runs: list[RunLog]) -> str:
    flat = [flatten(run.starts[-1].get("config", {})) if run.starts else {} for run in runs]
    keys = sorted(set().union(*flat))
    differ = [len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1 for k in keys]
    order = sorted(range(len(keys)), key=lambda i: (not differ[i], keys[i]))
    rows = [[keys[i], *(f.get(keys[i]) for f in flat)] for i in order]
    head = ["key", *(run.name for run in runs)]
    layouts = [[run.name, *(_layout(run).values())] for run in runs]
    lay_head = ["run", *(_layout(runs[0]).keys())]
    return (
        _table(lay_head, layouts)
        + "<p class=note>Highlighted: keys whose values differ between the runs.</p>"
        + _table(head, rows, [differ[i] for i in order])
    )


def _layout(run: RunLog) -> dict[str, Any]:
    keys = ("tp", "pp", "dp", "vpp", "zero_stage", "world_size")
    lay = run.starts[-1].get("layout", {}) if run.starts else {}
    host = sorted({r.get("host") for rows in run.ranks.values() for r in rows if r.get("host")})
    return {**{k: lay.get(k) for k in keys}, "hosts": ", ".join(host)}


def build_html(runs: list[RunLog], plots: list[tuple[str, str, bytes]], title: str) -> str:
    """The page (see the module docstring) for ``runs`` and their drawn ``plots``."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    body.append(f"<p class=note>zerotron report, {stamp}: {len(runs)} run(s).</p>")
    body.append("<h2>Runs</h2>" + _table(SUMMARY_HEAD, summary_rows(runs)))
    body.append('<h2>Curves</h2><div class="plots">')
    body += [_figure(png, f"{name}.png", caption, f"plot-{name}") for name, caption, png in plots]
    body.append("</div>" + _peaks(runs))
    pictures = [(run, path) for run in runs for path in run.figures]
    if pictures:
        body.append('<h2>Pictures from the runs</h2><div class="plots">')
        for run, path in pictures:
            caption = f"{path.name}" + (f" ({run.name})" if len(runs) > 1 else "")
            body.append(
                _figure(path.read_bytes(), path.name, caption, f"figure-{run.name}-{path.stem}")
            )
        body.append("</div>")
    body.append("<h2>Layout and configuration</h2>" + _config_tables(runs))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def report(run_dirs: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Write the page for ``run_dirs`` to ``out`` and its PNGs beside it; returns ``out``."""
    runs = [load_run(d) for d in run_dirs]
    _unique_names(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with Progress("report", total=len(PLOTS), unit="plots") as bar:
        plots = draw_all(runs, done=lambda name: bar.update(1, info=name))
    for name, _, png in plots:
        atomic_write_bytes(out.with_name(f"{out.stem}-{name}.png"), png)
    title = title or "zerotron report: " + ", ".join(run.name for run in runs)
    atomic_write_text(out, build_html(runs, plots, title))
    return out


def _unique_names(runs: list[RunLog]) -> None:
    """Two runs in directories of the same name get the parent's name too (legends differ)."""
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.directory.resolve().parent.name}/{run.name}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="zerotron report",
        description="One self-contained HTML page (plus PNGs) of what training runs recorded "
        "in their metrics files; several runs overlay their curves.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run's --save or --metrics-dir directory")  # fmt: skip
    parser.add_argument(
        "--out",
        help="the HTML file (default: RUN_DIR/report.html for one run, ./report.html for "
        "several); the PNGs go beside it as <stem>-<plot>.png",
    )
    parser.add_argument("--title", help="the page's title (default: the run names)")
    args = parser.parse_args(argv)
    out = args.out or (
        Path(args.run_dirs[0]) / "report.html" if len(args.run_dirs) == 1 else "report.html"
    )
    path = report(args.run_dirs, out, args.title)
    print(f"zerotron report: wrote {path} (and its PNGs beside it)")
    return 0
