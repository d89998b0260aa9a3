"""The estimator against what zerotron really holds, per term, on CPU gloo ranks.

Each layout trains one step (two micro-batches) of a tiny GPT (2 layers, hidden 64, 4 heads,
sequence 32, a 257-token byte tokenizer) built as ``zerotron pretrain`` builds it
(:func:`zerotron.tuning.measure.measure_run`): model states are the bytes of the tensors the
optimizer holds on the rank (largest seen at the step and after each micro-batch), activations
the peak of the storages autograd saves (a micro-batch's forward; under a pipeline, the
schedule's micro-batches in flight), the loss workspace the fused loss's buffers. Every term of
:func:`zerotron.tuning.estimate.estimate` (``device="cpu"``) must be within 10% of the measured
one (a term measured 0 must be estimated 0; a few scalars' bytes are let pass); the ratios
are printed (``-s``). Communication buffers are the collectives' inputs and outputs in flight
(:class:`zerotron.engine.memory_breakdown.CommBuffers`).

Measured errors (per term, all layouts) are in docs/estimate.md. Cost: the one-process layouts
run in the test process, the two-rank ones in one spawn running them in turn (what costs is the
first build in a process: importing the model's stack).
"""

from __future__ import annotations

import tempfile

import pytest

from tests.distributed.spawn import run_ranks
from zerotron.config import parse_megatron_args
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel
from zerotron.tuning.estimate import Layout, ModelShape, estimate
from zerotron.tuning.estimate_cli import cpu_kernels
from zerotron.tuning.measure import measure_run, write_byte_tokenizer

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 1 --lr 1e-3"
)
VOCAB = 257  # write_byte_tokenizer's

# name -> (world size, extra flags); global batch = 2 micro-batches per DP rank
LAYOUTS_1 = {
    "fp32 zero0": "--hidden-dropout 0 --attention-dropout 0",
    "bf16 zero0 dropout": "--bf16",
    "bf16 selective": "--bf16 --hidden-dropout 0 --attention-dropout 0 "
    "--recompute-granularity selective",
    "bf16 full recompute": "--bf16 --recompute-granularity full --attention-dropout 0",
    "bf16 full recompute uniform 2": "--bf16 --recompute-granularity full "
    "--recompute-num-layers 2 --attention-dropout 0",
    "bf16 full recompute block 1": "--bf16 --recompute-granularity full "
    "--recompute-method block --recompute-num-layers 1 --attention-dropout 0",
    # DeepSpeed's CheckpointFunction; its host copies are this CPU rank's own memory
    "bf16 full recompute cpu checkpointing": "--bf16 --recompute-granularity full "
    "--attention-dropout 0 --checkpoint-in-cpu",
    # the other CPU kernel choices (zerotron.kernels.chooser), whose buffers differ
    "fp32 linear=torch": "--hidden-dropout 0 --attention-dropout 0 --kernels linear=torch",
    "bf16 attention=sdpa": "--bf16 --hidden-dropout 0 --attention-dropout 0 "
    "--kernels matmul16=native,attention=sdpa",
    "bf16 matmul16=fp32 attention=fp32": "--bf16 --hidden-dropout 0 --attention-dropout 0 "
    "--kernels matmul16=fp32,attention=fp32",
}
LAYOUTS_2 = {
    "dp2 bf16 zero0": "--bf16",
    "dp2 bf16 zero1": "--bf16 --zero-stage 1",
    "dp2 bf16 zero2": "--bf16 --zero-stage 2",
    "dp2 bf16 zero3": "--bf16 --zero-stage 3 --stage3-param-persistence-threshold 1000",
    "dp2 bf16 zero3 reuse": "--bf16 --zero-stage 3 --stage3-param-persistence-threshold 1000 "
    "--stage3-max-reuse-distance 1000000000",
    "tp2 sp fp32": "--tensor-model-parallel-size 2 --sequence-parallel "
    "--hidden-dropout 0 --attention-dropout 0",
    # the vocab-parallel loss keeps fp32 logits in a bf16 run
    "tp2 bf16 full recompute": "--tensor-model-parallel-size 2 --bf16 "
    "--recompute-granularity full --attention-dropout 0",
    "tp2 bf16 full recompute partitioned": "--tensor-model-parallel-size 2 --bf16 "
    "--recompute-granularity full --attention-dropout 0 --partition-activations",
    "pp2 bf16 1f1b": "--pipeline-model-parallel-size 2 --bf16 --attention-dropout 0",
    "pp2 vpp2 interleaved": "--pipeline-model-parallel-size 2 --num-layers 4 "
    "--num-layers-per-virtual-pipeline-stage 1 --hidden-dropout 0 --attention-dropout 0",
    # counted per stage: the first of each stage's two layers recomputed, the second kept
    "pp2 full recompute block 1": "--pipeline-model-parallel-size 2 --num-layers 4 --bf16 "
    "--recompute-granularity full --recompute-method block --recompute-num-layers 1 "
    "--attention-dropout 0",
}


def _size(extra: str, flag: str) -> int:
    words = extra.split()
    return int(words[words.index(flag) + 1]) if flag in words else 1


def _flags(extra: str, world: int, directory: str) -> list[str]:
    mp = _size(extra, "--tensor-model-parallel-size") * _size(
        extra, "--pipeline-model-parallel-size"
    )
    gbs = 2 * 2 * (world // mp)  # two micro-batches of 2 per data-parallel rank
    return write_byte_tokenizer(directory) + (BASE + f" --global-batch-size {gbs} " + extra).split()


def _measure_rank(rank: int, layouts: dict[str, str], world: int) -> dict[str, dict]:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in layouts.items():
            cfg = parse_megatron_args(_flags(extra, world, d), world_size=world)
            p = cfg.parallel
            if world > 1:
                initialize_model_parallel(
                    p.tensor_model_parallel_size,
                    p.pipeline_model_parallel_size,
                    p.virtual_pipeline_model_parallel_size,
                )
            try:
                out[name] = measure_run(cfg)
            finally:
                if world > 1:
                    destroy_model_parallel()
    return out


def _estimated(extra: str, world: int, pipeline_rank: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        cfg = parse_megatron_args(_flags(extra, world, d), world_size=world)
    shape = ModelShape.from_config(cfg, vocab_size=VOCAB)
    kernels = cpu_kernels(cfg, VOCAB).choices  # what measure_run takes: forced here
    layout = Layout.from_config(cfg, device="cpu", kernels=kernels)
    return estimate(shape, layout, pipeline_rank).as_dict()


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    one = [_measure_rank(0, LAYOUTS_1, 1)]  # one process: here, no spawn to pay for
    two = run_ranks(_measure_rank, 2, LAYOUTS_2, 2, timeout=300)
    results = {name: [one[0][name]] for name in LAYOUTS_1}
    results.update({name: [r[name] for r in two] for name in LAYOUTS_2})
    return results


SCALARS = 64  # bytes: a loss or norm all-reduced on its own is no term to estimate
TERMS = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_states",
    "activations",
    "loss_workspace",
    "comm_buffers",
)
CASES = [(n, 1, LAYOUTS_1[n]) for n in LAYOUTS_1] + [(n, 2, LAYOUTS_2[n]) for n in LAYOUTS_2]


@pytest.mark.xdist_group("estimate_measured")
@pytest.mark.parametrize("name,world,extra", CASES, ids=[c[0] for c in CASES])
def test_estimate_within_10_percent_of_measured(measured, name, world, extra):
    pp = _size(extra, "--pipeline-model-parallel-size")
    tp = _size(extra, "--tensor-model-parallel-size")
    bad = []
    for rank, got in enumerate(measured[name]):
        stage = rank // tp if pp > 1 else 0
        want = _estimated(extra, world, stage)
        for term in TERMS:
            m, e = got[term], want[term]
            ratio = e / m if m else (1.0 if e == 0 else float("inf"))
            print(f"{name:22s} rank {rank} {term:17s} measured {m:>9d} estimated {e:>9d} "
                  f"ratio {ratio:.3f}")  # fmt: skip
            if not 0.9 <= ratio <= 1.1 and abs(e - m) > SCALARS:
                bad.append((rank, term, m, e, round(ratio, 3)))
    assert not bad, bad
