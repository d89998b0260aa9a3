"""The Engine loads the weights of a checkpoint saved on another tensor/pipeline layout when no
optimizer state is asked for (--finetune / --no-load-optim), as resharding offline does; with the
optimizer state the checkpoint is converted (tests/distributed/test_resume_layouts.py checks
that the run continues as the uninterrupted one)."""

from __future__ import annotations

import contextlib
import io

import pytest

from zerotron.checkpoint.reshard import reshard_checkpoint
from zerotron.config import parse_megatron_args
from zerotron.distributed import comm
from zerotron.distributed.state import destroy_model_parallel
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
    "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--seed", "1234", "--save-interval", "1000", "--num-workers", "0",
]  # fmt: skip


def _run(data, *flags):
    argv = [*TINY, "--data-path", data, *map(str, flags)]
    with contextlib.redirect_stdout(io.StringIO()):
        s = pretrain(parse_megatron_args(argv, world_size=4))
    destroy_model_parallel()
    return s.losses


def _rank(rank, data, root):
    tp2pp2 = ("--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2)
    tp1pp2 = ("--pipeline-model-parallel-size", 2)
    _run(data, *tp2pp2, "--train-iters", 2, "--save", f"{root}/a")
    # a longer run than the saved one: its own schedule
    longer = ("--train-iters", 3, "--override-opt-param-scheduler")
    out = {"with_optimizer": _run(data, *tp1pp2, *longer, "--load", f"{root}/a")}
    out["direct"] = _run(
        data, *tp1pp2, "--train-iters", 3, "--load", f"{root}/a", "--no-load-optim"
    )
    if rank == 0:
        reshard_checkpoint(f"{root}/a", f"{root}/b", 1, 2)
    comm.barrier()
    out["converted"] = _run(
        data, *tp1pp2, "--train-iters", 3, "--load", f"{root}/b", "--no-load-optim"
    )
    out["finetune"] = _run(data, *tp1pp2, "--train-iters", 1, "--load", f"{root}/a", "--finetune")
    return out


LOADS = pytest.mark.xdist_group("load_other_layout")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def loads(data_prefix, tmp_path_factory) -> list[dict]:
    return run_ranks(_rank, 4, data_prefix, str(tmp_path_factory.mktemp("layouts")), timeout=240)


@LOADS
def test_optimizer_state_of_another_layout_resumes_the_iteration(loads):
    for r in loads:
        assert sorted(r["with_optimizer"]) == [3]


@LOADS
def test_weights_load_across_layouts_and_resume_the_iteration(loads):
    for r in loads:
        assert sorted(r["direct"]) == [3]  # the iteration was restored: one more step
        assert r["direct"] == r["converted"]  # online and offline resharding: the same weights


@LOADS
def test_finetune_from_another_layout_starts_at_iteration_0(loads):
    for r in loads:
        assert sorted(r["finetune"]) == [1]
