"""`zerotron pretrain` writes its metrics file, `zerotron report` draws it, Chromium opens it.

One module fixture trains two tiny runs in process (2 layers, hidden 64, the bundled corpus):
A in fp32 with evaluations and checkpoints, stopped at iteration 2 and resumed to 4; B in fp16
with one poisoned (skipped) iteration, written with --metrics-dir (no --save), its metrics file
then cut mid-line as a crash leaves it. ``zerotron report A B`` makes one page; headless
Chromium (Debian's ``chromium``, installed by ``make report-deps``, which ``make test`` runs)
loads it with a checker script injected into a copy: no errors, every image decoded, every plot
and picture captioned; and takes a screenshot.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import zerotron.cli
import zerotron.training.build
from zerotron.config import parse_megatron_args
from zerotron.training.build import lm_loss
from zerotron.training.metrics import metrics_path, read_metrics
from zerotron.training.pretrain import pretrain
from zerotron.training.report_plots import PLOTS

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--split", "80,10,10", "--eval-iters", "1", "--seed", "1234",
    "--train-iters", "4", "--num-workers", "0",
]  # fmt: skip
# (--num-workers 0: a DataLoader's worker processes outlive an in-process run and cost seconds
# each to shut down when collected)

pytestmark = pytest.mark.xdist_group("report")


def _pretrain(data: str, *flags: object) -> None:
    pretrain(parse_megatron_args([*TINY, "--data-path", data, *map(str, flags)]))


def _tiny_png(path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1), dpi=50)
    FigureCanvasAgg(fig)
    fig.add_subplot().plot([0, 1], [1, 0])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    a, b = root / "run_a", root / "run_b"
    fp32 = ["--log-interval", 1, "--eval-interval", 2, "--save", a, "--save-interval", 2]
    _pretrain(data_prefix, *fp32, "--exit-interval", 2)
    _pretrain(data_prefix, *fp32, "--load", a)  # resumed at iteration 2
    calls = {"train": 0}

    def poisoned(model, batch):  # iteration 2's first micro-batch overflows: a skipped step
        loss = lm_loss(model, batch)
        if model.training:
            calls["train"] += 1
            if calls["train"] == 3:
                return loss * math.inf
        return loss

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zerotron.training.build, "lm_loss", poisoned)
        _pretrain(data_prefix, "--fp16", "--initial-loss-scale", 1024, "--hysteresis", 1,
                  "--log-interval", 1, "--eval-iters", 0, "--train-iters", 2,
                  "--metrics-dir", b)  # fmt: skip
    with open(metrics_path(b, 0), "a") as f:
        f.write('{"kind": "step", "time": 1.0, "iteration": 3, "lo')  # a crash mid-line
    _tiny_png(a / "figures" / "pipeline_timeline.png")  # a picture another tool wrote
    out = root / "out" / "report.html"
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        assert zerotron.cli.main(["report", str(a), str(b), "--out", str(out)]) == 0
    out.with_name("stderr.txt").write_text(said.getvalue())
    return a, b, out


def _kinds(records, kind):
    return [r for r in records if r["kind"] == kind]


# ---- what the run wrote ---------------------------------------------------------------------


def test_run_record_has_config_layout_and_peak(runs):
    a, _, _ = runs
    start = _kinds(read_metrics(metrics_path(a, 0)), "run")[0]
    assert start["iteration"] == 0 and start["rank"] == 0
    assert start["layout"] == {"tp": 1, "pp": 1, "dp": 1, "vpp": 1, "zero_stage": 0,
                               "world_size": 1}  # fmt: skip
    assert start["config"]["model"]["hidden_size"] == 64
    assert start["peak_flops"] > 0 and "6·N + 12·L·h·s" in start["flops_convention"]


def test_step_records_at_each_log_interval(runs):
    a, _, _ = runs
    steps = _kinds(read_metrics(metrics_path(a, 0)), "step")
    assert [s["iteration"] for s in steps] == [1, 2, 3, 4]
    assert steps[0]["lr"] > steps[-1]["lr"] >= 0  # linear decay over the 4 iterations
    for s in steps:
        assert s["loss"] > 0 and s["grad_norm"] > 0
        assert s["tokens_per_s"] > 0 and 0 < s["mfu"] < 1 and s["rss_bytes"] > 0
        assert s["skipped"] is False and s["loss_scale"] == 1.0


def test_eval_and_checkpoint_records(runs):
    a, _, _ = runs
    records = read_metrics(metrics_path(a, 0))
    evals = _kinds(records, "eval")
    assert [(e["iteration"], e["split"]) for e in evals] == [
        (2, "valid"), (4, "valid"), (4, "valid"), (4, "test")
    ]  # fmt: skip
    assert evals[0]["ppl"] == pytest.approx(math.exp(evals[0]["loss"]))
    ckpts = _kinds(records, "checkpoint")
    assert [(c["iteration"], Path(c["path"]).name) for c in ckpts] == [
        (2, "iter_0000002"), (4, "iter_0000004")
    ]  # fmt: skip
    assert records[-1]["kind"] == "end" and records[-1]["exited_early"] is False


def test_skipped_step_and_loss_scale_recorded(runs):
    """Run B: fp16, --metrics-dir without --save, its file cut mid-line by a "crash"."""
    _, b, _ = runs
    steps = _kinds(read_metrics(metrics_path(b, 0)), "step")
    assert [s["iteration"] for s in steps] == [1, 2]
    first = {s["iteration"]: s for s in steps}
    assert first[2]["skipped"] is True and first[2]["skipped_iterations"] == 1
    assert first[2]["loss"] is None  # inf is no JSON number: recorded as none
    assert (first[1]["loss_scale"], first[2]["loss_scale"]) == (1024.0, 512.0)


def test_resume_writes_a_second_run_record(runs):
    a, _, _ = runs
    records = read_metrics(metrics_path(a, 0))
    starts = _kinds(records, "run")
    assert [s["iteration"] for s in starts] == [0, 2]
    assert Path(starts[1]["resumed_from"]).name == "iter_0000002"
    assert [s["iteration"] for s in _kinds(records, "step")] == [1, 2, 3, 4]


# ---- the page -------------------------------------------------------------------------------


def test_page_is_self_contained(runs):
    *_, out = runs
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", page)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    sources = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(sources) == len(PLOTS) + 1
    assert all(s.startswith("data:image/png;base64,") for s in sources)


def test_report_says_its_progress_in_plain_lines_off_a_terminal(runs):
    *_, out = runs
    last = out.with_name("stderr.txt").read_text().splitlines()[-1]
    assert last.startswith(f"report: {len(PLOTS)}/{len(PLOTS)} plots (100%), ")
    assert last.endswith(f", {PLOTS[-1][0]}")  # the plot drawn last


def test_pngs_written_beside_the_page(runs):
    *_, out = runs
    for name, _, _ in PLOTS:
        assert (out.parent / f"report-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_summarizes_both_runs(runs):
    *_, out = runs
    page = html.unescape(out.read_text())
    assert "run_a" in page and "run_b" in page
    # restarts, checkpoints and end: A resumed at 2, saved at 2 and 4; B neither
    assert "<td>2</td><td>2</td><td>finished</td>" in page
    assert "<td>none</td><td>0</td><td>finished</td>" in page
    assert "6·N + 12·L·h·s" in page  # the FLOP convention, stated under the MFU plot
    assert '<tr class="diff"><td>precision.fp16</td>' in page  # the runs differ in fp16


CHECKER = """<script>
window.__errors = [];
window.addEventListener("error",
  e => window.__errors.push(String(e.message || (e.target && e.target.src) || e)), true);
const __ce = console.error;
console.error = (...a) => { window.__errors.push(a.join(" ")); __ce(...a); };
window.addEventListener("load", () => {
  const imgs = [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}));
  const figs = [...document.querySelectorAll("figure")].map(f => ({
    id: f.id, caption: f.querySelector("figcaption").textContent, img: !!f.querySelector("img")}));
  const pre = document.createElement("pre"); pre.id = "zt-check";
  pre.textContent = JSON.stringify({errors: window.__errors, imgs, figs});
  document.body.appendChild(pre);
});
</script>"""


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("Debian's chromium is not installed: run `make report-deps` (as root)")
    return exe


def _headless(exe: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-extensions", "--enable-logging=stderr", "--v=0",
           f"--user-data-dir={tmp / 'profile'}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def chromium_dom(runs, tmp_path_factory):
    """The page's DOM after load, with the checker's findings, and Chromium's log."""
    *_, out = runs
    tmp = tmp_path_factory.mktemp("chromium")
    probe = out.with_name("probe.html")  # beside the page: the same relative paths
    probe.write_text(out.read_text().replace("<head>", "<head>" + CHECKER, 1))
    done = _headless(_chromium(), tmp, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    m = re.search(r'<pre id="zt-check">(.*?)</pre>', done.stdout, re.S)
    assert m, f"no checker output; chromium said:\n{done.stderr[-3000:]}"
    return json.loads(html.unescape(m.group(1))), done.stderr


def test_chromium_loads_page_without_errors(chromium_dom):
    check, log = chromium_dom
    assert check["errors"] == []
    console_errors = [line for line in log.splitlines() if "CONSOLE" in line and "rror" in line]
    assert console_errors == []


def test_chromium_decodes_every_plot_and_picture(chromium_dom):
    check, _ = chromium_dom
    assert len(check["imgs"]) == len(PLOTS) + 1 and all(i["ok"] for i in check["imgs"])
    figs = {f["id"]: f for f in check["figs"]}
    for name, caption, _ in PLOTS:
        assert figs[f"plot-{name}"]["img"] and figs[f"plot-{name}"]["caption"] == caption
    picture = figs["figure-run_a-pipeline_timeline"]
    assert picture["img"] and picture["caption"] == "pipeline_timeline.png (run_a)"


def test_chromium_screenshot(runs, tmp_path_factory):
    *_, out = runs
    tmp = tmp_path_factory.mktemp("shot")
    shot = tmp / "report.png"
    done = _headless(_chromium(), tmp, "--hide-scrollbars", "--window-size=1400,1800",
                     f"--screenshot={shot}", out.as_uri())  # fmt: skip
    assert shot.exists(), done.stderr[-3000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
