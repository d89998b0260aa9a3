"""examples/deepspeed/train.py, a DeepSpeed script with only its import changed, runs under
`zerotron launch --nproc_per_node 2` with the ZeRO-2 and ZeRO-3 configs of examples/ (which hold
"auto" values), and as a plain single process: it exits 0, its printed losses fall, and the
checkpoint's client_state comes back (the script asserts it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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
