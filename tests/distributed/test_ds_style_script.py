"""A DeepSpeed-style script (launch_scripts/ds_style_train.py: comm, accelerator, utils, ops,
runtime, zero.Init, the engine's surface, checkpoints, zero_to_fp32, 16-bit saving; per-rank
seeds) runs under ``zerotron launch`` with 1 and 2 processes at ZeRO stages 0-3, with
``engine.backward(loss)`` and plain ``loss.backward()``, the config's Adam and DeepSpeed's
``DeepSpeedCPUAdam`` / ``FusedAdam`` (the same AdamW math), CPU offload and zero.Init — and every
run ends with the model of one process at stage 0 (the global batch is the same: 1e-6, fp32).

The script asserts what each answer means as it goes; here each run must exit 0 and match.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "distributed", "launch_scripts", "ds_style_train.py")

pytestmark = pytest.mark.xdist_group("ds_style_script")

# (processes, stage, backward, optimizer, extra flags)
# One process once (stage 3 with zero.Init, the most machinery); the rest on two ranks, where
# every stage, both backward calls, every optimizer, offload and zero.Init each appear.
RUNS = [
    (1, 3, "loss", "config", ["--zero-init"]),
    (2, 0, "loss", "cpu_adam", []),
    (2, 1, "engine", "config", []),
    (2, 2, "loss", "cpu_adam", ["--offload"]),
    (2, 3, "engine", "fused_adam", ["--zero-init"]),
    (2, 3, "loss", "config", []),
]


def run(tmp, nproc, stage, backward, optimizer, extra) -> dict[str, torch.Tensor]:
    name = f"n{nproc}_s{stage}_{backward}_{optimizer}{''.join(extra)}"
    out = tmp / f"{name}.pt"
    cmd = [sys.executable, "-m", "zerotron.launcher.launch", "--nproc_per_node", str(nproc)]
    cmd += [SCRIPT, "--stage", str(stage), "--backward", backward, "--optimizer", optimizer]
    cmd += ["--save-dir", str(tmp / name), "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (r.stdout + r.stderr).count("step 3 loss") == 1  # log_dist: rank 0 only
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), 1, 0, "engine", "config", [])


@pytest.mark.parametrize("nproc,stage,backward,optimizer,extra", RUNS)
def test_the_script_trains_one_process_stage_0s_model(
    tmp_path, reference, nproc, stage, backward, optimizer, extra
):
    got = run(tmp_path, nproc, stage, backward, optimizer, extra)
    assert sorted(got) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
