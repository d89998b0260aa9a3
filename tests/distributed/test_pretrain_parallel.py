"""``zerotron pretrain`` on 2 data-parallel gloo ranks (and dp2 × tp2 on 4) against the same run
in one process.

The tiny GPT-2 (2 layers, hidden 64, sequence 16, fp32, dropout 0) trains on the first 20
documents of the bundled corpus with a global batch of 4: micro-batch 2 × 2 accumulation steps
in one process, micro-batch 2 on each rank under data parallelism. Every loss, the validation
loss and the saved weights must be the same bits; a run stopped at iteration 3 and resumed from
its checkpoint must end where the uninterrupted one did. Only rank 0 logs.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from zerotron.checkpoint import load_file, model_file, tag_for_iteration
from zerotron.config import parse_megatron_args
from zerotron.models import gpt
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

REPO = Path(__file__).resolve().parents[2]
ITERS = 5

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-3", "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "1", "--seed", "1234", "--train-iters", str(ITERS),
    "--save-interval", "1000", "--num-workers", "0",  # test ranks are daemons: no workers
]  # fmt: skip


def _pretrain(world_size: int, data: str, *extra: object):
    argv = [*TINY, "--data-path", data, *map(str, extra)]
    return pretrain(parse_megatron_args(argv, world_size=world_size))


def _dp2_rank(rank: int, data: str, root: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        whole = _pretrain(2, data, "--save", f"{root}/whole")
        first = _pretrain(2, data, "--save", f"{root}/parts", "--exit-interval", 3)
        second = _pretrain(2, data, "--load", f"{root}/parts", "--save", f"{root}/parts")
        ramped = _pretrain(2, data, *RAMP)
    return {
        "whole": whole,
        "first": first,
        "second": second,
        "ramped": ramped,
        "stdout": out.getvalue(),
    }


RAMP = ("--global-batch-size", 8, "--rampup-batch-size", 4, 4, 8)  # 4, 4, then 8


DP2_RUN = pytest.mark.xdist_group("pretrain_dp2")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def dp2(data_prefix, tmp_path_factory) -> tuple[list[dict], Path]:
    # Before any single-process run: the ranks find no index cache, so rank 0 builds it while
    # rank 1 waits at the barrier.
    root = tmp_path_factory.mktemp("dp2")
    return run_ranks(_dp2_rank, 2, data_prefix, str(root), timeout=240), root


def assert_same(a: object, b: object, path: str) -> None:
    """Nested dicts/lists of tensors and plain values are bitwise equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def model_state(save: Path) -> dict[str, torch.Tensor]:
    return load_file(save, tag_for_iteration(ITERS), model_file())["model"]


@DP2_RUN
def test_dp2_pretrain_equals_one_process(dp2, data_prefix, tmp_path):
    results, root = dp2
    single = _pretrain(1, data_prefix, "--save", tmp_path / "single")
    assert sorted(single.losses) == list(range(1, ITERS + 1))
    for r in results:
        assert r["whole"].losses == single.losses  # bitwise, every iteration, on every rank
        assert r["whole"].valid_loss == single.valid_loss is not None
        assert r["whole"].test_loss == single.test_loss is not None
        assert r["whole"].state.consumed_train_samples == ITERS * 4
    ref = model_state(tmp_path / "single")
    got = model_state(root / "whole")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@DP2_RUN
def test_dp2_batch_size_ramp_equals_one_process(dp2, data_prefix):
    results, _ = dp2
    single = _pretrain(1, data_prefix, *RAMP)
    assert single.state.consumed_train_samples == 4 + 4 + (ITERS - 2) * 8
    for r in results:
        assert r["ramped"].losses == single.losses  # bitwise, every iteration, on every rank
        assert r["ramped"].state.consumed_train_samples == single.state.consumed_train_samples


@DP2_RUN
def test_dp2_checkpoint_layout_and_exact_resume(dp2):
    results, root = dp2
    tag = root / "whole" / tag_for_iteration(ITERS)
    meta = json.loads((tag / "metadata.json").read_text())
    assert meta["layout"]["data_parallel_size"] == 2
    assert meta["layout"]["tensor_model_parallel_size"] == 1
    # One model file for the one model-parallel rank, written by data-parallel rank 0.
    assert meta["files"] == [model_file()]
    for r in results:
        assert sorted(r["first"].losses) == [1, 2, 3]
        assert sorted(r["second"].losses) == [4, 5]
        assert {**r["first"].losses, **r["second"].losses} == r["whole"].losses
        assert r["second"].valid_loss == r["whole"].valid_loss
    a = load_file(root / "whole", tag_for_iteration(ITERS), model_file())
    b = load_file(root / "parts", tag_for_iteration(ITERS), model_file())
    for key in ("model", "optimizer", "opt_param_scheduler", "rng_state", "iteration"):
        assert_same(a[key], b[key], key)


@DP2_RUN
def test_only_rank_0_logs(dp2):
    results, _ = dp2
    rank0, rank1 = results[0]["stdout"], results[1]["stdout"]
    line = " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): "
    assert rank0.count(line) == 4  # one per run
    assert rank0.count(" lm loss: ") == 3 * ITERS  # --log-interval 1: whole, parts, ramped
    assert "validation loss at the end of training" in rank0
    assert rank1 == ""  # data-parallel rank 1 prints nothing, not even the parameter count


FULL = ("--recompute-granularity", "full", "--recompute-num-layers", "1")
PP2_RAMP = ("--global-batch-size", "4", "--rampup-batch-size", "2", "2", "4")
PP2_RECOMPUTE = {  # name -> flags; 4 layers: 2 per stage
    "no dropout": ("--hidden-dropout", "0", "--attention-dropout", "0"),
    "plain": (),
    "uniform": (*FULL, "--recompute-method", "uniform"),  # each layer its own unit
    "block": (*FULL, "--recompute-method", "block"),  # each stage's first layer only
    # no dropout; 2 micro-batches a step, then 4: the schedule rebuilt between steps 2 and 3
    "ramp": ("--hidden-dropout", "0", "--attention-dropout", "0", *PP2_RAMP),
}


def _pp2_recompute_rank(rank: int, data: str) -> dict[str, tuple[dict[int, float], int]]:
    """pp2 (1F1B, 4 micro-batches a step) with dropout 0.1: without recompute and with each
    full-recompute method, whose backward reruns layers under the forward's RNG state while
    other micro-batches' forwards have drawn since. Per run: the losses, and how many layers
    the stage ran checkpointed."""
    from torch.utils import checkpoint

    from zerotron.distributed.state import destroy_model_parallel

    calls = [0]
    real = checkpoint.checkpoint

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    shape = ("--num-layers", "4", "--micro-batch-size", "1", "--pipeline-model-parallel-size", 2)
    out = {}
    with contextlib.redirect_stdout(io.StringIO()), mock.patch.object(gpt, "checkpoint", counted):
        for name, flags in PP2_RECOMPUTE.items():
            calls[0] = 0
            out[name] = (_pretrain(2, data, *shape, *dropout, *flags).losses, calls[0])
            destroy_model_parallel()
    return out


def test_pipeline_stages_recompute_with_dropout_as_without(data_prefix):
    runs = run_ranks(_pp2_recompute_rank, 2, data_prefix, timeout=240)[1]  # the last stage's
    (plain, none), (uniform, per_layer), (block, first_only) = (
        runs[name] for name in ("plain", "uniform", "block")
    )
    assert sorted(plain) == list(range(1, ITERS + 1))
    assert plain != runs["no dropout"][0]  # dropout is on
    assert uniform == plain
    assert block == plain
    # the batch-size ramp through a pipeline: one process's losses
    with contextlib.redirect_stdout(io.StringIO()):
        single = _pretrain(1, data_prefix, "--num-layers", "4", "--micro-batch-size", "1",
                           *PP2_RAMP)  # fmt: skip
    assert runs["ramp"][0] == single.losses
    # 5 steps x 4 micro-batches through the stage's 2 layers: both layers, or the first only
    assert (none, per_layer, first_only) == (0, ITERS * 4 * 2, ITERS * 4)


def _pp2_compile_rank(rank: int, data: str) -> dict[str, tuple[dict[int, float], int]]:
    """pp2 (1F1B, 4 micro-batches a step) eager, then with --compile: the losses, and how many
    graphs dynamo compiled during the run."""
    from torch._dynamo.utils import counters

    from zerotron.distributed.state import destroy_model_parallel

    shape = ("--micro-batch-size", "1", "--pipeline-model-parallel-size", 2)
    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for name, flags in (("eager", ()), ("compiled", ("--compile",))):
            before = counters["stats"]["unique_graphs"]
            losses = _pretrain(2, data, *shape, *flags).losses
            out[name] = (losses, counters["stats"]["unique_graphs"] - before)
            destroy_model_parallel()
    return out


def test_pipeline_stages_compile_as_eager(data_prefix):
    runs = run_ranks(_pp2_compile_rank, 2, data_prefix, timeout=400)
    (eager, none), (compiled, graphs) = runs[1]["eager"], runs[1]["compiled"]  # the last stage's
    assert sorted(eager) == list(range(1, ITERS + 1))
    assert sorted(compiled) == sorted(eager)
    assert all(abs(compiled[i] - eager[i]) <= 1e-5 * abs(eager[i]) for i in eager), (
        eager,
        compiled,
    )
    assert none == 0 and graphs > 0  # the compiled run ran compiled chunks
    assert runs[0]["compiled"][1] > 0  # on the first stage too


def _dp2_tp2_rank(rank: int, data: str, root: str, *extra: str) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        s = _pretrain(4, data, "--tensor-model-parallel-size", 2, "--save", root, *extra)
    return {"losses": s.losses, "valid_loss": s.valid_loss}


@pytest.mark.parametrize("extra", [(), ("--sequence-parallel",)], ids=["tp", "tp_sp"])
def test_dp2_tp2_pretrain_matches_one_process(data_prefix, tmp_path, extra):
    # TP 2 pads the vocabulary to a multiple of 2 × 128 (50432 rows): the reference pads the
    # same, so both initialize the same full weights. With --sequence-parallel the Engine must
    # also sum the LayerNorm gradients over TP.
    single = _pretrain(1, data_prefix, "--make-vocab-size-divisible-by", 256)
    root = str(tmp_path / "ckpt")
    results = run_ranks(_dp2_tp2_rank, 4, data_prefix, root, *extra, timeout=240)
    for r in results:
        assert r["losses"].keys() == single.losses.keys()
        assert list(r["losses"].values()) == pytest.approx(list(single.losses.values()), rel=1e-5)
        assert r["valid_loss"] == pytest.approx(single.valid_loss, rel=1e-5)
    meta = json.loads((tmp_path / "ckpt" / tag_for_iteration(ITERS) / "metadata.json").read_text())
    assert meta["files"] == [model_file(0), model_file(1)]  # one per TP rank, from dp rank 0
    assert meta["layout"]["tensor_model_parallel_size"] == 2
    assert meta["layout"]["data_parallel_size"] == 2


def _megatron_rank(rank: int, *flags: str) -> dict[int, float]:
    from tests.test_pretrain_megatron import MCORE, MODEL, RUN

    argv = [*MODEL, *RUN, "--load", str(MCORE), "--finetune", *flags]
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(parse_megatron_args(argv, world_size=4)).losses


def test_megatron_checkpoint_loads_into_tp2_pp2_as_into_one_process():
    """Megatron-LM's tp2 pp2 checkpoint (megatron-core's files) into a tp2 pp2 run: every rank
    cuts its part from the merged weights and trains as one process that loaded them (no
    dropout: tensor-parallel ranks draw their masks from other streams than one process)."""
    from tests.test_pretrain_megatron import MCORE
    from tests.test_pretrain_megatron import run as run_one

    no_dropout = ("--hidden-dropout", "0", "--attention-dropout", "0")
    layout = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    with contextlib.redirect_stdout(io.StringIO()):
        single = run_one("--load", MCORE, "--finetune", *no_dropout)
    for losses in run_ranks(_megatron_rank, 4, *layout, *no_dropout, timeout=240):
        assert losses.keys() == single.losses.keys() == {1, 2, 3}
        assert list(losses.values()) == pytest.approx(list(single.losses.values()), rel=1e-5)


def _partition_rank(rank: int, data: str) -> dict[str, Any]:
    from zerotron.parallel import recompute

    tp2 = ("--tensor-model-parallel-size", "2", "--checkpoint-activations")
    calls = []
    real = recompute.checkpoint
    with (
        contextlib.redirect_stdout(io.StringIO()),
        mock.patch.object(
            recompute, "checkpoint", lambda *a: calls.append(recompute.config()) or real(*a)
        ),
    ):
        plain = _pretrain(2, data, *tp2).losses
        partitioned = _pretrain(2, data, *tp2, "--partition-activations").losses
    return {"plain": plain, "partitioned": partitioned, "calls": calls}


def _sp_partition_rank(rank: int, data: str) -> tuple[dict, dict]:
    sp = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--checkpoint-activations")
    with contextlib.redirect_stdout(io.StringIO()):
        plain = _pretrain(2, data, *sp).losses
        return plain, _pretrain(2, data, *sp, "--partition-activations").losses


def test_partition_activations_under_sequence_parallelism_trains_as_without(data_prefix):
    """Under SP a rank's checkpointed layer input is its own part of the sequence, which
    DeepSpeed's partitioning (of an input every TP rank holds whole) would mix with the other
    ranks' parts: the config turns it off, and the losses are those of the run without it."""
    for plain, partitioned in run_ranks(_sp_partition_rank, 2, data_prefix, timeout=240):
        assert sorted(plain) == list(range(1, ITERS + 1))
        assert partitioned == plain


def test_partitioned_activations_train_as_whole_ones_under_tensor_parallelism(data_prefix):
    """--partition-activations (DeepSpeed's option, Megatron-DeepSpeed's flag) with tp2: each
    rank keeps half of every checkpointed layer input and gathers it for the recompute; the
    losses are the unpartitioned run's, bit for bit."""
    for r in run_ranks(_partition_rank, 2, data_prefix, timeout=240):
        assert sorted(r["plain"]) == list(range(1, ITERS + 1))
        assert r["partitioned"] == r["plain"]
        # the partitioned run's 5 steps x 2 micro-batches x 2 layers went through DeepSpeed's
        # checkpoint, partitioning; the plain run's through torch's
        assert len(r["calls"]) == ITERS * 2 * 2
        assert all(c.partition_activations for c in r["calls"])
