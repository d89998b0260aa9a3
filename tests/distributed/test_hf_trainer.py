"""Hugging Face's Trainer on zerotron: examples/huggingface/run_clm.py (HF's run_clm style, a tiny
GPT-2 built from a config, synthetic data) under ``zerotron launch --as-deepspeed
--nproc_per_node 2`` with ``--deepspeed ds_zero{2,3}.json`` ("auto" values, as HF users write
them) trains, saves a checkpoint at step 3, resumes from it (stage 3), and logs the losses of the
same Trainer run without DeepSpeed (torch DDP, same launcher) within 1e-5 (fp32); the weights it
saves equal DDP's too. Evaluation alone (``--do_eval``, no training: an engine without an
optimizer under ZeRO-3) gives DDP's evaluation loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.xdist_group("hf_trainer")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "huggingface"
STEPS, SAVE_AT = 6, 3
RESUMED_STAGE = 3  # resuming is checked at stage 3 (partitioned weights too); each run is a launch
TOL = 1e-5
TRAINER_ARGS = [
    "--max_steps", str(STEPS), "--save_steps", str(SAVE_AT), "--logging_steps", "1",
    "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
    "--learning_rate", "1e-3", "--weight_decay", "0.0", "--seed", "42",
    "--report_to", "none", "--disable_tqdm", "true",
]  # fmt: skip


def _train(out: Path, extra: list[str], as_deepspeed: bool) -> list[dict]:
    """Run the example on 2 ranks into ``out``; returns its logged ``{"step", "loss"}`` lines."""
    losses = out.with_suffix(".jsonl")
    launch = ["--nproc_per_node", "2", *(["--as-deepspeed"] if as_deepspeed else [])]
    cmd = [sys.executable, "-m", "zerotron", "launch", *launch, str(EXAMPLE / "run_clm.py")]
    cmd += [*TRAINER_ARGS, "--output_dir", str(out), "--losses_file", str(losses), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return [json.loads(line) for line in losses.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DDP once; per ZeRO stage a full run, and at stage 3 a run resumed from its step-3
    checkpoint."""
    root = tmp_path_factory.mktemp("hf")
    # accelerate runs torch DDP on CPU only when told so (on GPUs it needs no flag)
    cpu = [] if torch.cuda.is_available() else ["--use_cpu"]
    out = {"ddp": (root / "ddp", _train(root / "ddp", cpu, as_deepspeed=False))}
    for stage in (2, 3):
        full = root / f"zero{stage}"
        ds = ["--deepspeed", str(EXAMPLE / f"ds_zero{stage}.json")]
        out[f"zero{stage}"] = (full, _train(full, ds, as_deepspeed=True))
        if stage != RESUMED_STAGE:
            continue
        resume = [*ds, "--resume_from_checkpoint", str(full / f"checkpoint-{SAVE_AT}")]
        resumed = root / f"zero{stage}_resumed"
        out[f"zero{stage}_resumed"] = (resumed, _train(resumed, resume, as_deepspeed=True))
    return out


def _evaluate(out: Path, extra: list[str], as_deepspeed: bool) -> float:
    """Evaluate the untrained model alone (``--do_eval``, no training) on 2 ranks."""
    launch = ["--nproc_per_node", "2", *(["--as-deepspeed"] if as_deepspeed else [])]
    cmd = [sys.executable, "-m", "zerotron", "launch", *launch, str(EXAMPLE / "run_clm.py")]
    cmd += ["--do_eval", "--per_device_eval_batch_size", "4", "--seed", "42"]
    cmd += ["--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (line,) = [x for x in r.stdout.splitlines() if "eval_loss " in x]
    return float(line.split("eval_loss ")[1])


def test_evaluate_alone_under_zero3_equals_ddp(tmp_path: Path) -> None:
    # Without training, the Trainer has DeepSpeed build an engine with no optimizer
    # (ZeRO-3 inference), which zerotron refused before.
    cpu = [] if torch.cuda.is_available() else ["--use_cpu"]
    ddp = _evaluate(tmp_path / "ddp", cpu, as_deepspeed=False)
    zero3 = ["--deepspeed", str(EXAMPLE / "ds_zero3.json")]
    assert abs(_evaluate(tmp_path / "zero3", zero3, as_deepspeed=True) - ddp) <= TOL


def _by_step(logged: list[dict]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in logged}


def test_ddp_logs_every_step(runs: dict) -> None:
    assert sorted(_by_step(runs["ddp"][1])) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_losses_match_ddp(runs: dict, stage: int) -> None:
    ddp, zero = _by_step(runs["ddp"][1]), _by_step(runs[f"zero{stage}"][1])
    assert sorted(zero) == sorted(ddp)
    assert max(abs(zero[s] - ddp[s]) for s in ddp) <= TOL, (zero, ddp)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_is_where_trainer_resumes_from(runs: dict, stage: int) -> None:
    ckpt = runs[f"zero{stage}"][0] / f"checkpoint-{SAVE_AT}"
    assert (ckpt / "latest").read_text().strip() == f"global_step{SAVE_AT}"
    names = sorted(os.listdir(ckpt / f"global_step{SAVE_AT}"))
    assert [n for n in names if n.startswith("zero_dp_rank_")] == [
        f"zero_dp_rank_{dp}_mp_rank_00_000_optim_states.pt" for dp in (0, 1)
    ]


def test_resumed_losses_match_ddp(runs: dict) -> None:
    ddp = _by_step(runs["ddp"][1])
    resumed = _by_step(runs[f"zero{RESUMED_STAGE}_resumed"][1])
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert max(abs(resumed[s] - ddp[s]) for s in resumed) <= TOL, (resumed, ddp)


@pytest.mark.parametrize("stage", [2, 3])
def test_saved_model_matches_ddp(runs: dict, stage: int) -> None:
    name = f"checkpoint-{STEPS}/model.safetensors"
    ddp = load_file(runs["ddp"][0] / name)
    zero = load_file(runs[f"zero{stage}"][0] / name)
    # The tied output layer is written once more: accelerate clones each tensor before saving
    # (clone_tensors_for_torch_save, as with DeepSpeed), so the Trainer sees no shared storage.
    assert set(zero) - set(ddp) == {"lm_head.weight"} and set(ddp) <= set(zero)
    ddp["lm_head.weight"] = ddp["transformer.wte.weight"]
    worst = max((zero[k] - ddp[k]).abs().max().item() for k in zero)
    assert worst <= TOL, worst
