"""zerotron.utils on two gloo ranks: safe_get_full_fp32_param / _grad / _optimizer_state at ZeRO
stages 0-3 return, on every rank, exactly what one process accumulating the same global batch
holds; the setters write whole values; zero_to_fp32 consolidates the two ranks' partitions of a
checkpoint into those same weights."""

from __future__ import annotations

import pytest
import torch

from tests.test_compat_utils import KEYS, assert_same, train_and_read

from .spawn import run_ranks

STAGES = (0, 1, 2, 3)
GROUP = pytest.mark.xdist_group("compat_utils_ranks")  # one spawn for the tests that read it


def _all_stages(rank: int, save_root: str) -> dict[int, dict]:
    return {s: train_and_read(rank, s, f"{save_root}/stage{s}" if s else None) for s in STAGES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], str]:
    root = str(tmp_path_factory.mktemp("ranks"))
    return run_ranks(_all_stages, 2, root, timeout=300), root


@pytest.fixture(scope="module")
def one_process() -> dict[int, dict]:
    return {s: train_and_read(0, s) for s in STAGES}


@GROUP
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("what", ["fp32", "grad", *KEYS])
def test_every_rank_gets_the_one_process_values(two_ranks, one_process, stage, what):
    results, _ = two_ranks
    for rank in (0, 1):
        assert_same(results[rank][stage][what], one_process[stage][what])


@GROUP
@pytest.mark.parametrize("stage", STAGES)
def test_setters_write_the_whole_value_on_every_rank(two_ranks, stage):
    results, _ = two_ranks
    new = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    for rank in (0, 1):
        fp32, exp_avg = results[rank][stage]["after_set"]
        assert torch.equal(fp32, new) and torch.equal(exp_avg, new * 2)


@GROUP
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_to_fp32_of_two_ranks_is_the_trained_model(two_ranks, one_process, stage):
    from zerotron.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, root = two_ranks
    got = get_fp32_state_dict_from_zero_checkpoint(f"{root}/stage{stage}")
    for name, want in one_process[stage]["fp32"].items():
        if want is not None:
            assert torch.equal(got[name], want), name
