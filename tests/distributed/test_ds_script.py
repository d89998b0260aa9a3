"""examples/deepspeed/train.py, a DeepSpeed script with only its import changed, runs under
`zerotron launch --nproc_per_node 2` with the ZeRO-2 and ZeRO-3 configs of examples/ (which hold
"auto" values), and as a plain single process: it exits 0, its printed losses fall, and the
checkpoint's client_state comes back (the script asserts it). And initialize() lays out its groups
as a passed mpu says (refusing one that disagrees with the rank grid)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "deepspeed")
SCRIPT = os.path.join(EXAMPLE, "train.py")


def _run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _losses(stdout: str, stage: int) -> list[float]:
    found = re.findall(rf"step (\d+) loss ([\d.]+) lr \S+ zero_stage {stage}", stdout)
    assert [int(s) for s, _ in found] == list(range(1, len(found) + 1)), stdout
    return [float(loss) for _, loss in found]


@pytest.mark.parametrize("config,stage", [("ds_zero2.json", 2), ("ds_zero3.json", 3)])
def test_deepspeed_script_under_zerotron_launch(tmp_path, config, stage):
    save = tmp_path / "ckpt"
    r = _run(
        [sys.executable, "-m", "zerotron.launcher.launch", "--nproc_per_node", "2", SCRIPT]
        + ["--deepspeed", "--deepspeed_config", os.path.join(EXAMPLE, config)]
        + ["--train_iters", "8", "--save_dir", str(save)]
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = _losses(r.stdout, stage)
    assert len(losses) == 8
    assert losses[-1] < 0.9 * losses[0], losses
    assert "[rank0]: client_state restored from" in r.stdout
    # "auto" resolved: 4 per rank x 2 accumulation x 2 ranks, printed once (rank 0)
    assert r.stdout.count("auto values resolved") == 1
    assert '[rank0]:   "train_batch_size": 16,' in r.stdout
    # one ZeRO partition file per data-parallel rank, beside the model file
    files = sorted(os.listdir(save / "global_step8"))
    for dp in (0, 1):
        assert f"zero_dp_rank_{dp}_mp_rank_00_000_optim_states.pt" in files, files
    assert (save / "latest").read_text().strip() == "global_step8"


def test_deepspeed_script_as_a_plain_single_process(tmp_path):
    r = _run(
        [sys.executable, SCRIPT, "--deepspeed", "--deepspeed_config"]
        + [os.path.join(EXAMPLE, "ds_zero2.json"), "--model", "mlp", "--train_iters", "6"]
        + ["--save_dir", str(tmp_path / "ckpt")]
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = _losses(r.stdout, 2)
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert "client_state restored from" in r.stdout


class _Mpu:
    """A Megatron-style mpu: tensor-parallel 2, pipeline 1, data-parallel rank from ``dp_rank``."""

    def __init__(self, rank: int, swap: bool = False):
        self.dp = (rank // 2) ^ int(swap)

    def get_tensor_model_parallel_world_size(self) -> int:
        return 2

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_world_size(self) -> int:
        return 2

    def get_data_parallel_rank(self) -> int:
        return self.dp


def _initialize_with_mpu(rank: int) -> dict:
    from torch import nn

    import zerotron
    from zerotron.distributed.state import state
    from zerotron.errors import DistributedError

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    try:  # an mpu whose data-parallel ranks disagree with the rank grid
        zerotron.initialize(model=model, config=config, mpu=_Mpu(rank, swap=True))
        refused = ""
    except DistributedError as e:
        refused = str(e)
    data = [(torch.randn(4), torch.randn(1)) for _ in range(16)]
    engine, _, loader, _ = zerotron.initialize(
        model=model, config=config, mpu=_Mpu(rank), training_data=data
    )
    for x, y in loader:
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    ps = state()
    return {
        "refused": refused,
        "tp": ps.tp_size,
        "dp": (ps.dp_rank, engine.data_parallel_size, engine.train_batch_size()),
        "steps": engine.global_steps,
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "batches": len(loader),
    }


MPU = pytest.mark.xdist_group("ds_script_mpu")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def with_mpu() -> list[dict]:
    from .spawn import run_ranks

    return run_ranks(_initialize_with_mpu, 4)


@MPU
def test_initialize_honours_a_passed_mpu(with_mpu):
    for rank, r in enumerate(with_mpu):
        assert r["tp"] == 2
        assert r["dp"] == (rank // 2, 2, 8)  # 2 per micro-batch x 2 accumulation x dp 2
        assert r["steps"] == 2 and r["batches"] == 4  # 16 samples / dp 2 / 2 per batch


@MPU
def test_an_mpu_that_disagrees_with_the_rank_grid_is_refused(with_mpu):
    for r in with_mpu:
        assert "data-parallel rank" in r["refused"] and "of 2" in r["refused"]


@MPU
def test_data_parallel_replicas_stay_equal(with_mpu):
    for r in with_mpu:
        assert torch.equal(r["weights"], with_mpu[0]["weights"])
