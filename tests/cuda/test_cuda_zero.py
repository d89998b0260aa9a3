"""ZeRO on one GPU: stages 0-3 give the same losses; pinned-memory CPU offload of the optimizer.

One process, a data-parallel group of one: every stage partitions nothing away, so each must
train exactly as stage 0 does up to the order of floating-point sums. CPU tests compare the
stages bit for bit (tests/distributed/test_zero.py); on CUDA some kernels sum in an order that
varies from run to run (the embedding's backward adds with atomics), so fp32 losses are compared
within ``REL`` (1e-4) and bf16 ones (offload, whose AdamW runs on the CPU and the reference's
on the GPU) within ``REL_16`` (2e-3: a master differing in its last bits can round a bf16
weight the other way).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import batch, build
from zerotron.zero import ZeroOptimizer

STEPS = 4
REL, REL_16 = 1e-4, 2e-3
ARGS = (
    *("--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 100),
    *("--hidden-dropout", 0, "--attention-dropout", 0, "--lr-warmup-iters", 0),
)


def train(engine) -> list[float]:
    """STEPS steps of two micro-batches each (gradient accumulation included)."""
    mbs = [batch(2, seed=s) for s in range(2)]
    return [float(engine.train_batch(iter(mbs))) for _ in range(STEPS)]


def assert_close(got: list[float], want: list[float], rel: float) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= rel * abs(b), f"step {i}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"


@pytest.fixture(scope="module")
def stage0() -> list[float]:
    return train(build(*ARGS, "--zero-stage", 0).engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_trains_as_stage_0(stage0, stage, device):
    engine = build(*ARGS, "--zero-stage", stage).engine
    assert isinstance(engine.optimizer, ZeroOptimizer) and engine.optimizer.stage == stage
    assert engine.device == device
    losses = train(engine)
    assert losses[-1] < losses[0]
    assert_close(losses, stage0, REL)


@pytest.mark.parametrize("stage", [2, 3])
def test_pinned_cpu_offload_keeps_params_on_the_device(stage, device):
    flags = ("--bf16", "--zero-stage", stage)
    offload = ("--offload-optimizer-device", "cpu", "--offload-optimizer-pin-memory")
    reference = train(build(*ARGS, *flags).engine)
    engine = build(*ARGS, *flags, *offload).engine
    opt = engine.optimizer
    losses = train(engine)
    # The masters and Adam's moments live in host memory, page-locked on a CUDA machine (the
    # copies to and from the GPU go through them); the 16-bit parameters stay on the device.
    masters = [s.master for s in opt.sub_groups]
    states = [v for m in masters for v in opt.optimizer.state[m].values() if v.dim() > 0]
    assert masters and states
    assert all(t.device.type == "cpu" for t in masters + states)
    if device.type == "cuda":
        assert all(t.is_pinned() for t in masters)
    assert {p.device for p in engine.module.parameters()} == {device}
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    assert losses[-1] < losses[0]
    assert_close(losses, reference, REL_16)
