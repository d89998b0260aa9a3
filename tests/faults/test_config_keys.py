"""A misspelt DeepSpeed key inside a known section (issue 19): an error with a did-you-mean, not
a warning while the run goes on without the feature; ``warn`` (flag, environment, argument)
relaxes it; unknown top-level keys stay warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zerotron.cli
from zerotron.config import load_deepspeed_config, parse_megatron_args
from zerotron.config.deepspeed import UNKNOWN_KEYS_ENV
from zerotron.errors import ConfigError

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
MODEL += ["--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "1"]


def ds_file(tmp_path: Path, ds: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds, indent=2))
    return path


STAG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stag": 2}}


def test_misspelt_key_in_a_section_is_an_error_with_did_you_mean(tmp_path):
    path = ds_file(tmp_path, STAG)
    with pytest.raises(ConfigError) as e:
        load_deepspeed_config(path)
    assert e.value.what == (
        "unknown DeepSpeed key 'zero_optimization.stag' (did you mean 'zero_optimization.stage'?)"
    )
    assert e.value.where == f"{path}:4"
    assert "--deepspeed-unknown-keys warn" in e.value.fix


@pytest.mark.parametrize(
    "ds,key",
    [
        ({"optimizer": {"type": "Adam", "params": {"lr": 0.1, "wieght_decay": 0.1}}},
         "optimizer.params.wieght_decay"),
        ({"optimizer": {"type": "Adam", "parms": {}}}, "optimizer.parms"),
        ({"fp16": {"enabled": True, "loss_scal": 0}}, "fp16.loss_scal"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}},
         "zero_optimization.offload_param.devise"),
    ],
)  # fmt: skip
def test_every_nested_unknown_key_is_an_error(ds, key):
    with pytest.raises(ConfigError, match=f"unknown DeepSpeed key '{key}'"):
        load_deepspeed_config({"train_micro_batch_size_per_gpu": 2, **ds})


def test_pretrain_with_a_misspelt_key_exits_2_before_training(tmp_path, capsys):
    path = ds_file(tmp_path, STAG)
    argv = ["pretrain", *MODEL, "--deepspeed", "--deepspeed_config", str(path)]
    assert zerotron.cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "unknown DeepSpeed key 'zero_optimization.stag'" in err


def test_flag_relaxes_it_to_a_warning(tmp_path):
    path = ds_file(tmp_path, STAG)
    argv = [*MODEL, "--deepspeed_config", str(path), "--deepspeed-unknown-keys", "warn"]
    cfg = parse_megatron_args(argv)
    assert any("'zero_optimization.stag' ignored (did you mean" in w for w in cfg.warnings)
    assert cfg.zero.zero_stage == 0


def test_environment_relaxes_it_to_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv(UNKNOWN_KEYS_ENV, "warn")
    cfg, _ = load_deepspeed_config(ds_file(tmp_path, STAG))
    assert any("'zero_optimization.stag' ignored" in w for w in cfg.warnings)


def test_bad_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv(UNKNOWN_KEYS_ENV, "maybe")
    with pytest.raises(ConfigError, match="unknown-keys mode 'maybe'"):
        load_deepspeed_config(STAG)


def test_unknown_top_level_key_stays_a_warning():
    cfg, _ = load_deepspeed_config({"train_micro_batch_size_per_gpu": 2, "gradient_clippin": 1})
    assert any("'gradient_clippin' ignored" in w for w in cfg.warnings)
