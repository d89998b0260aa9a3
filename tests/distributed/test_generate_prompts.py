"""Interactive ``zerotron generate`` under the launcher: rank 0's prompts reach every rank."""

from __future__ import annotations

import torch

from zerotron.inference.cli import _share

from .spawn import run_ranks


def _rank(rank: int) -> list:
    said = ["Elizabeth said: « très bien »", "", None]  # text (UTF-8), empty, end of input
    return [_share(text if rank == 0 else "ignored", torch.device("cpu")) for text in said]


def test_rank_zero_prompts_are_shared():
    expected = ["Elizabeth said: « très bien »", "", None]
    assert run_ranks(_rank, 2) == [expected, expected]
