"""A Megatron-DeepSpeed checkpoint with its training state in ``--load`` of a multi-rank run
(2 gloo ranks): tensor parallel 2, and data parallel 2 under ZeRO 1, go on from it with the
losses of the same run loading its one-process conversion (each rank reads the whole state and
keeps its part; the conversion is re-cut by zerotron's own resume on another layout)."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.test_megatron_deepspeed_optim import FIXTURES, RUN
from zerotron.checkpoint.megatron_import import import_megatron
from zerotron.config import parse_megatron_args
from zerotron.distributed import comm
from zerotron.distributed.state import destroy_model_parallel
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"], "dp2_zero1": ["--zero-stage", "1"]}


def _losses(*flags: str) -> dict[int, float]:
    with contextlib.redirect_stdout(io.StringIO()):
        summary = pretrain(parse_megatron_args([*RUN, "--train-iters", "5", *flags], world_size=2))
    destroy_model_parallel()
    return summary.losses


def _rank(rank: int, root: str) -> dict[str, dict[str, dict[int, float]]]:
    source = str(FIXTURES / "pipe_tp2pp2")
    if rank == 0:
        import_megatron(source, f"{root}/converted")
    comm.barrier()
    out = {}
    for name, flags in LAYOUTS.items():
        out[name] = {
            "direct": _losses(*flags, "--load", source),
            "converted": _losses(*flags, "--load", f"{root}/converted"),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank, 2, str(tmp_path_factory.mktemp("mds")), timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_of_another_layout_goes_on_from_it_as_from_its_conversion(runs, layout):
    for by_layout in runs:
        got = by_layout[layout]
        assert sorted(got["direct"]) == [4, 5]
        assert got["direct"] == got["converted"]
