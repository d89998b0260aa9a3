"""initialize() broadcasts rank 0's weights over the data-parallel group, as DeepSpeed does: a
DeepSpeed-style script seeding torch with its rank trains, on 2 processes under
``zerotron launch``, rank 0's model on every rank at ZeRO stages 0-3 (stage 3 without zero.Init
here), equal to one process seeded like rank 0 on the same global batches. Plain
``loss.backward()`` does the same as ``engine.backward(loss)`` across the ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "distributed", "launch_scripts", "seed_per_rank.py")


def _run(out, nproc: int, *args: str) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "zerotron.launcher.launch", "--nproc_per_node", str(nproc)]
    cmd = (launch if nproc > 1 else [sys.executable]) + [SCRIPT, "--out", str(out), *args]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [torch.load(out / f"rank{i}.pt", weights_only=True) for i in range(nproc)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one") / "out", 1)[0]


def _same(a: dict, b: dict, atol: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank runs by ZeRO stage, each launched once."""
    runs: dict[int, list[dict]] = {}

    def get(stage: int) -> list[dict]:
        if stage not in runs:
            runs[stage] = _run(tmp_path_factory.mktemp(f"stage{stage}") / "out", 2,
                               "--stage", str(stage))  # fmt: skip
        return runs[stage]

    return get


@pytest.mark.xdist_group("rank0_broadcast")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_seeds_train_rank0s_model_on_every_rank(two_ranks, one_process, stage):
    ranks = two_ranks(stage)
    assert _same(ranks[0]["initial"], one_process["initial"])  # rank 0's seed
    assert _same(ranks[1]["initial"], ranks[0]["initial"])  # broadcast, not seed 1's
    assert _same(ranks[1]["final"], ranks[0]["final"])
    assert _same(ranks[0]["final"], one_process["final"], atol=1e-6)


@pytest.mark.xdist_group("rank0_broadcast")
@pytest.mark.parametrize("stage", [2])  # stage 0's plain backward: test_ds_style_script
def test_loss_backward_on_two_ranks_equals_one_process(tmp_path, one_process, stage):
    ranks = _run(tmp_path / "out", 2, "--stage", str(stage), "--backward", "torch")
    assert _same(ranks[1]["final"], ranks[0]["final"])
    assert _same(ranks[0]["final"], one_process["final"], atol=1e-6)


@pytest.mark.xdist_group("rank0_broadcast")
def test_engine_ranks_and_sizes_on_two_ranks(two_ranks, one_process):
    # [local_rank, global_rank, world_size, dp_world_size, mp_world_size]
    assert [r["ranks"] for r in two_ranks(0)] == [[0, 0, 2, 2, 1], [1, 1, 2, 2, 1]]
    assert one_process["ranks"] == [0, 0, 1, 1, 1]
