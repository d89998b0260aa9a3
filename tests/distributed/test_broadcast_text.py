"""comm.broadcast_text: rank 0's text (the interactive generate prompts) reaches every rank:
UTF-8, empty, and None (the end of input)."""

from __future__ import annotations

from zerotron.distributed import comm

from .spawn import run_ranks


def _rank(rank: int) -> list:
    said = ["Elizabeth said: « très bien »", "", None]  # text (UTF-8), empty, end of input
    return [
        comm.broadcast_text(text if rank == 0 else "ignored", comm.world_group()) for text in said
    ]


def test_rank_zero_prompts_are_shared():
    expected = ["Elizabeth said: « très bien »", "", None]
    assert run_ranks(_rank, 2) == [expected, expected]
