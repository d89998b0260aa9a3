"""``--profile-steps``: the recorded timeline of a pipeline run.

One ``zerotron pretrain`` run on 2 gloo ranks (pp=2, 1F1B, 4 micro-batches, the tiny GPT of
test_pretrain_parallel) records steps 2..3. Each stage must have executed exactly its schedule's
actions, in order, in each recorded step; the Chrome trace must be valid JSON with a process per
rank, a thread per stream and the expected events; the timeline picture and the bubble lines
must be there, and each rank's metrics file must hold a ``profile`` record (--metrics-dir is
also where the profile goes). The analysis itself is checked without processes: a simulated
timeline turned into recorded spans must measure the simulator's bubble.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from zerotron.config import parse_megatron_args
from zerotron.distributed import trace
from zerotron.errors import ConfigError
from zerotron.pipeline import Backward, Forward, build_schedule, measure, simulate
from zerotron.pipeline.measured import decode, encode, executed_actions, measured_timeline
from zerotron.pipeline.profile import FIGURE, TRACE, stage_spans
from zerotron.pipeline.timeline import report
from zerotron.training.metrics import metrics_path, read_metrics
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

M = 4  # micro-batches: global batch 8 / micro-batch 2
STEPS = (2, 3)
ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", str(2 * M),
    "--hidden-dropout", "0", "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
    "--lr", "1e-3", "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "0", "--train-iters", "3", "--num-workers", "0",
    "--profile-steps", f"{STEPS[0]}:{STEPS[1]}",
]  # fmt: skip

REQUIRED = [*ARGS[:10], "--train-iters", "3", "--lr", "1"]  # what a parse needs


def _rank(rank: int, data: str, directory: str) -> str:
    out = io.StringIO()
    argv = [*ARGS, "--data-path", data, "--metrics-dir", directory]  # no --save: no checkpoint
    with contextlib.redirect_stdout(out):
        pretrain(parse_megatron_args(argv, world_size=2))
    return out.getvalue()


RUN = pytest.mark.xdist_group("profile_pp2")


@pytest.fixture(scope="module")
def run(data_prefix, tmp_path_factory) -> tuple[Path, list[str], list[dict]]:
    save = tmp_path_factory.mktemp("profile_pp2")
    stdout = run_ranks(_rank, 2, data_prefix, str(save), timeout=240)
    ranks = [json.loads((save / "profile" / f"rank{r}.json").read_text()) for r in range(2)]
    return save, stdout, ranks


@RUN
def test_every_stage_ran_its_schedule_in_order(run):
    _, _, ranks = run
    schedule = build_schedule("1f1b", 2, M)
    stages = stage_spans(ranks)
    assert sorted(stages) == [0, 1]
    for stage, spans in stages.items():
        for step in range(STEPS[0], STEPS[1] + 1):
            assert executed_actions(spans, step) == schedule[stage], (stage, step)
        assert executed_actions(spans, STEPS[0] - 1) == []  # step 1 was not recorded


@RUN
def test_chrome_trace_has_a_process_per_rank_and_a_thread_per_stream(run):
    save, _, _ = run
    events = json.loads((save / TRACE).read_text())["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "process_name"}
    assert names == {(0, "rank 0 (pp 0, tp 0, dp 0)"), (1, "rank 1 (pp 1, tp 0, dp 0)")}
    threads = {
        (e["pid"], e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"
    }
    assert threads == {(p, t, s) for p in (0, 1) for t, s in enumerate(trace.STREAMS)}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    for pid in (0, 1):
        mine = [e for e in spans if e["pid"] == pid]
        computes = [e["name"] for e in mine if e["tid"] == 0 and e["name"][0] in "FB"]
        assert len(computes) == 2 * M * 2  # F and B of every micro-batch, two steps
        windows = [e for e in mine if e["name"] == "schedule"]
        assert [w["args"]["step"] for w in windows] == [2, 3]
        # the pipeline's sends and receives wait in comm's batches, on the p2p thread
        assert {e["name"] for e in mine if e["tid"] == 1} >= {"batch_isend_irecv"}
        # the loss's broadcast from the last stage and the tied embedding's all-reduce
        assert {e["name"] for e in mine if e["tid"] == 2} >= {"broadcast", "all_reduce"}
        assert {e["name"] for e in mine if e["args"].get("phase")} >= {"forward-backward"}


@RUN
def test_figure_and_bubble_lines(run):
    save, stdout, _ = run
    assert (save / FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    theory = f"theory (p-1)/(v*m) = {1 / M:.4f}"
    for step in range(STEPS[0], STEPS[1] + 1):
        assert f"pipeline bubble of step {step} (idle / busy): measured" in stdout[0]
        assert theory in stdout[0]
    assert "pipeline bubble" not in stdout[1]  # rank 0 reports


@RUN
def test_profile_record_in_the_metrics_file(run):
    save, _, _ = run
    for rank in (0, 1):
        (record,) = [r for r in read_metrics(metrics_path(save, rank)) if r["kind"] == "profile"]
        assert record["iteration_range"] == list(STEPS)
        assert record["trace"] == TRACE
        if rank == 0:
            assert [b["step"] for b in record["bubbles"]] == [2, 3]
            assert all(b["theory"] == 1 / M for b in record["bubbles"])
            assert record["figure"] == FIGURE


# ---- without processes ----------------------------------------------------------------------


def test_encode_decode_round_trip():
    for kind, p, m, v in (("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("gpipe", 2, 2, 1)):
        for actions in build_schedule(kind, p, m, v):
            assert [decode(json.loads(json.dumps(encode(a)))) for a in actions] == actions


def _spans_of(timeline, step):
    """The spans the runtime would have recorded for a simulated timeline (times in ns)."""
    out = {}
    for stage, events in enumerate(timeline.events):
        shape = {
            "kind": "x",
            "stage": stage,
            "stages": timeline.num_stages,
            "microbatches": timeline.num_microbatches,
            "chunks": timeline.virtual_stages,
            "step": step,
        }
        end = round(timeline.makespan * 1e9)
        window = {"name": "schedule", "stream": "compute", "start_ns": 0, "end_ns": end}
        spans = [{**window, "args": shape}]
        for e in events:
            args = {"action": encode(e.action), "pipeline": True, "step": step}
            start, end = round(e.start * 1e9), round(e.end * 1e9)
            spans.append(
                {"name": str(e.action), "stream": "compute", "start_ns": start, "end_ns": end,
                 "args": args}
            )  # fmt: skip
        out[stage] = spans
    return out


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_measured_bubble_of_a_simulated_run_is_the_simulators(kind, p, m, v):
    schedule = build_schedule(kind, p, m, v)
    simulated = simulate(schedule, 1.0, 2.0)
    measured = measured_timeline(_spans_of(simulated, 7), 7)
    assert report(measured).bubble == pytest.approx(measure(schedule).bubble, abs=1e-9)
    assert report(measured).theory == (p - 1) / (v * m)
    computes = [[e.action for e in row] for row in measured.events]
    assert computes == [[a for a in s if isinstance(a, (Forward, Backward))] for s in schedule]


def test_recorder_spans_and_chrome_events_on_cpu():
    recorder = trace.start(trace.Recorder(cuda=False))
    try:
        assert trace.active() is recorder
        recorder.step = 4
        with recorder.span("F0", "compute", mb=0):
            pass
        recorder.begin("never ended", "p2p")
    finally:
        assert trace.stop() is recorder
    assert trace.active() is None
    spans = [s.to_json() for s in recorder.finish()]
    assert [(s["name"], s["args"]) for s in spans] == [("F0", {"mb": 0, "step": 4})]
    assert spans[0]["end_ns"] >= spans[0]["start_ns"]
    events = trace.chrome_events(3, spans)
    assert [e for e in events if e["ph"] == "X"] == [
        {"ph": "X", "name": "F0", "cat": "compute", "pid": 3, "tid": 0,
         "ts": spans[0]["start_ns"] / 1000.0,
         "dur": (spans[0]["end_ns"] - spans[0]["start_ns"]) / 1000.0,
         "args": {"mb": 0, "step": 4}}
    ]  # fmt: skip


@pytest.mark.parametrize("text", ["0:2", "3:2", "a:b", "1:2:3", "", "-1:2"])
def test_bad_profile_steps_are_refused(text):
    with pytest.raises(ConfigError, match="profile.steps"):
        parse_megatron_args([*REQUIRED, "--profile-steps", text], world_size=1)


def test_profile_steps_need_a_directory():
    from zerotron.pipeline.profile import attach

    with pytest.raises(ConfigError, match="nowhere to write"):
        attach(object(), "1:2", None)


class _Event:
    """Stands for a CUDA event: ``anchor.elapsed_time(event)`` in milliseconds."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: _Event) -> float:
        return other.ms - self.ms


def test_cuda_events_resolve_against_the_anchor():
    recorder = trace.Recorder(cuda=False)
    recorder._anchor = _Event(10.0)  # recorded at the CPU clock reading _perf0
    recorder.spans = [trace.Span("B0", "compute", _Event(12.5), _Event(13.0), {})]
    (span,) = recorder.finish()
    assert (span.start, span.end) == (recorder._epoch0 + 2_500_000, recorder._epoch0 + 3_000_000)


def test_deepspeed_script_records_its_steps(tmp_path):
    """A DeepSpeed-style loop (engine(x), engine.backward, engine.step) with the config's
    ``profile_steps`` / ``profile_dir``: steps 2..3 of 4 land in the trace, phases by step."""
    import torch
    from torch import nn

    import zerotron

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "profile_steps": "2:3",
        "profile_dir": str(tmp_path),
    }
    engine, *_ = zerotron.initialize(model=nn.Linear(8, 1), config=config)
    for _ in range(4 * 2):
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    events = json.loads((tmp_path / TRACE).read_text())["traceEvents"]
    phases = [(e["name"], e["args"]["step"]) for e in events if e["ph"] == "X"]
    per_step = ["forward", "backward", "backward_allreduce"]  # x2 micro-batches, then "step"
    expected = [(n, s) for s in (2, 3) for n in ["forward", "backward"] + per_step + ["step"]]
    assert phases == expected
    assert not (tmp_path / FIGURE).exists()  # no pipeline: no pipeline picture


def test_megatrons_profile_flags_point_to_profile_steps():
    from zerotron.errors import UnsupportedError

    for extra in (["--profile"], ["--profile-step-start", "10"]):
        with pytest.raises(UnsupportedError, match="--profile-steps A:B"):
            parse_megatron_args([*REQUIRED, *extra], world_size=1)
