"""DeepSpeed's monitors and checkpoint tag validation through ``zerotron.initialize``.

One process: with ``csv_monitor`` and ``tensorboard`` enabled, three optimizer steps (two
micro-batches each, fp16 so the loss scale is logged too) write ``Train/Samples/train_loss``
(the mean of the step's micro-batch losses), ``Train/Samples/lr`` and ``Train/Samples/loss_scale``
keyed by samples seen: the CSV rows hold the engine's values exactly, and TensorBoard's
EventAccumulator reads the same values back (as float32). ``wandb`` enabled without wandb
importable is a ConfigError; a stand-in wandb module gets ``init(project, group, entity)``, one
``log`` per event at its step, and ``finish``. The two-rank checks (pipeline stages, tag
validation) are in tests/distributed/test_monitor_ranks.py.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zerotron
from zerotron.engine.monitors import CsvMonitor
from zerotron.errors import ConfigError

MICRO, GAS, STEPS, LR = 4, 2, 3, 1e-2
NAMES = ("Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def _config(tmp: Path | None = None, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        **extra,
    }
    if tmp is not None:
        config["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4},
        }
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
        for section in ("csv_monitor", "tensorboard"):
            config[section] = {"enabled": True, "output_path": str(tmp), "job_name": "job"}
    return config


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def test_csv_and_tensorboard_hold_the_engine_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, _, _, _ = zerotron.initialize(model=_mlp(), config=_config(tmp_path))
    g = torch.Generator().manual_seed(1)
    expected: dict[str, list[tuple[int, float]]] = {name: [] for name in NAMES}
    for _ in range(STEPS):
        losses = []
        for _ in range(GAS):
            x = torch.randn(MICRO, 8, generator=g).half()
            y = torch.randn(MICRO, 1, generator=g).half()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        samples = engine.global_samples
        mean = torch.stack(losses).float().mean().item()
        expected[NAMES[0]].append((samples, mean))
        expected[NAMES[1]].append((samples, engine.get_lr()[0]))
        expected[NAMES[2]].append((samples, engine.cur_scale))
    engine.destroy()
    assert [s for s, _ in expected[NAMES[0]]] == [8, 16, 24]
    assert len({v for _, v in expected[NAMES[1]]}) == STEPS  # the warmup moves the lr

    for name in NAMES:
        header, rows = _read_csv(tmp_path / "job" / CsvMonitor.filename(name))
        assert header == ["step", name.rsplit("/", 1)[-1]]
        assert rows == expected[name]

    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    assert set(NAMES) <= set(acc.Tags()["scalars"])
    for name in NAMES:
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        want = [(s, float(torch.tensor(v, dtype=torch.float32))) for s, v in expected[name]]
        assert got == want


def test_csv_appends_to_a_restarted_job(tmp_path):
    for start in (0, 2):
        m = CsvMonitor(str(tmp_path), "job")
        m.write_events([("Train/Samples/lr", 0.5 + start, start), ("Train/Samples/lr", 0.25, 9)])
        m.close()
    header, rows = _read_csv(tmp_path / "job" / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert rows == [(0, 0.5), (9, 0.25), (2, 2.5), (9, 0.25)]


def test_wandb_without_wandb_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like
    with pytest.raises(ConfigError, match="pip install wandb"):
        zerotron.initialize(model=_mlp(), config=_config(wandb={"enabled": True}))


def test_wandb_logs_each_event_at_its_step(fake_wandb):
    calls = fake_wandb
    config = _config(wandb={"enabled": True, "project": "p", "group": "g", "team": "t"})
    engine, _, _, _ = zerotron.initialize(model=_mlp(), config=config)
    for _ in range(GAS):
        engine.backward(nn.functional.mse_loss(engine(torch.ones(MICRO, 8)), torch.zeros(MICRO, 1)))
        engine.step()
    engine.destroy()
    assert calls[0] == (
        "init",
        {"project": "p", "group": "g", "entity": "t", "name": None, "dir": None},
    )
    assert [c[0] for c in calls] == ["init", "log", "log", "finish"]
    assert calls[2] == ("log", {"Train/Samples/lr": engine.get_lr()[0]}, MICRO * GAS)
    assert set(calls[1][1]) == {"Train/Samples/train_loss"}  # fp32: no loss scale
