"""The run's metrics file (zerotron.training.metrics): round trip, crash-cut lines, repair.

Pure file tests; the records a real run writes are checked in tests/test_report.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from zerotron.errors import DataError
from zerotron.training.metrics import MetricsFile, metrics_path, read_metrics


def test_metrics_path_is_one_file_per_rank(tmp_path):
    assert metrics_path(tmp_path, 3) == tmp_path / "metrics" / "rank3.jsonl"


def test_round_trip(tmp_path):
    path = metrics_path(tmp_path, 0)
    records = [
        ("run", {"iteration": 0, "layout": {"tp": 1, "pp": 2}, "config": {"a": {"b": [1, 2]}}}),
        ("step", {"iteration": 1, "loss": 10.5, "lr": 1e-3, "skipped": False, "mfu": None}),
        ("eval", {"iteration": 1, "loss": 9.25, "ppl": 10403.0}),
        ("checkpoint", {"iteration": 1, "path": "ckpt/iter_0000001"}),
    ]
    with MetricsFile(path) as f:
        for kind, fields in records:
            f.write(kind, **fields)
    back = read_metrics(path)
    assert [(r.pop("kind"), r.pop("time") > 0)[0] for r in back] == [k for k, _ in records]
    assert back == [fields for _, fields in records]


def test_each_record_is_on_disk_once_written(tmp_path):
    """Flushed per line: another reader sees it while the file is still open (a crash after
    write() loses nothing)."""
    path = metrics_path(tmp_path, 0)
    f = MetricsFile(path)
    f.write("step", iteration=7)
    assert [r["iteration"] for r in read_metrics(path)] == [7]
    f.close()


def test_tensors_and_numpy_scalars_become_numbers(tmp_path):
    path = metrics_path(tmp_path, 0)
    with MetricsFile(path) as f:
        f.write("step", loss=torch.tensor(2.5), shape=torch.Size([2, 3]), it=torch.tensor(4))
    (r,) = read_metrics(path)
    assert (r["loss"], r["shape"], r["it"]) == (2.5, [2, 3], 4)


def test_truncated_last_line_is_skipped(tmp_path):
    path = metrics_path(tmp_path, 1)
    with MetricsFile(path) as f:
        f.write("step", iteration=1, loss=3.0)
        f.write("step", iteration=2, loss=2.0)
    line = json.dumps({"kind": "step", "time": 1.0, "iteration": 3, "loss": 1.0})
    with open(path, "a") as raw:
        raw.write(line[: len(line) // 2])  # what a kill in the middle of a write leaves
    assert [r["iteration"] for r in read_metrics(path)] == [1, 2]


def test_reopening_cuts_the_partial_line_and_appends(tmp_path):
    """A resumed run appends to its file: the fragment a crash left does not swallow the
    resume's first record."""
    path = metrics_path(tmp_path, 0)
    with MetricsFile(path) as f:
        f.write("step", iteration=1)
    with open(path, "a") as raw:
        raw.write('{"kind": "step", "iter')
    with MetricsFile(path) as f:
        f.write("run", iteration=1)
    assert [r["kind"] for r in read_metrics(path)] == ["step", "run"]
    assert path.read_text().count("\n") == 2


def test_corrupt_line_inside_the_file_names_it(tmp_path):
    path = metrics_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text('{"kind": "step", "time": 1}\nnot json\n{"kind": "step", "time": 2}\n')
    with pytest.raises(DataError, match=r"rank0\.jsonl:2"):
        read_metrics(path)


# ---- the Engine of a DeepSpeed-style script ("metrics_dir" in its config) -------------------


def test_deepspeed_engine_writes_steps_checkpoints_and_resumes(tmp_path):
    import zerotron

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "metrics_dir": str(tmp_path / "run"),
    }
    engine, *_ = zerotron.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    micro_losses = []

    def steps(n: int) -> None:
        for _ in range(2 * n):
            x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.item())

    steps(2)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")
    steps(1)
    engine.destroy()
    records = read_metrics(metrics_path(tmp_path / "run", 0))
    kinds = [(r["kind"], r["iteration"]) for r in records]
    assert kinds == [
        ("run", 0), ("step", 1), ("step", 2), ("checkpoint", 2), ("run", 2), ("step", 3)
    ]  # fmt: skip
    first = records[0]
    assert first["layout"]["world_size"] == 1 and first["config"]["metrics_dir"]
    steps_ = [r for r in records if r["kind"] == "step"]
    for i, s in enumerate(steps_):
        assert s["loss"] == pytest.approx(sum(micro_losses[2 * i : 2 * i + 2]) / 2, rel=1e-6)
        assert s["lr"] == 1e-2 and s["skipped"] is False and s["grad_norm"] > 0
        assert s["rss_bytes"] > 0 and s["samples_per_s"] > 0
    assert records[4]["resumed_from"].endswith("global_step2")
