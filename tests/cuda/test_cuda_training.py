"""One process on the GPU: bf16 and fp16 (dynamic loss scaling) training with the plain kernels.

On CUDA every CPU fast path is off (``kernel_policy``): attention is SDPA (its flash kernel in
16 bits), the loss ``F.cross_entropy`` over the logits, traced whole by ``torch.compile``. Each
run trains zerotron's tiny GPT-2 (tests/test_engine.py's ``build``: 2 layers, hidden 64,
GPT-2's vocabulary) on one repeated micro-batch, so its loss must fall step after step, and
compares it with the same run in fp32 on the same device.

Tolerances: a 16-bit run's loss is within ``REL_16`` (2%) of the fp32 run's at every step --
bf16 keeps 8 bits of mantissa, so its first loss (~10.8) is off by ~1e-3 relative and the
trajectories drift apart slowly over the steps; the compiled run's losses are within ``REL_16``
of the eager run's in the same dtype (the compiled graph fuses and reorders the same math).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.test_engine import batch, build
from zerotron.kernels import kernel_policy
from zerotron.kernels.policy import KernelPolicy
from zerotron.training.build import lm_loss

STEPS = 6
REL_16 = 2e-2
ARGS = (
    *("--micro-batch-size", 2, "--global-batch-size", 2, "--train-iters", 100),
    *("--hidden-dropout", 0, "--attention-dropout", 0, "--lr-warmup-iters", 0),
)


def train(engine, steps: int = STEPS) -> list[float]:
    b = batch(2, seed=3)
    return [float(engine.train_batch(iter([b]))) for _ in range(steps)]


def assert_close(got: list[float], want: list[float], rel: float) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= rel * abs(b), f"step {i}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"


def assert_falls(losses: list[float]) -> None:
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.fixture(scope="module")
def fp32_losses(device) -> list[float]:
    engine = build(*ARGS).engine
    assert engine.device == device
    return train(engine)


def test_cuda_takes_every_plain_kernel(device):
    if device.type == "cuda":
        assert kernel_policy(device) == KernelPolicy()
    else:  # ZEROTRON_CUDA_TESTS_ON_CPU: the conftest switched the fast paths off
        assert kernel_policy(device) == KernelPolicy(keep_freed_heap=True)


def test_model_runs_on_the_device_under_flash_attention_only(device):
    engine = build(*ARGS, "--bf16").engine
    assert {p.device for p in engine.module.parameters()} == {device}
    # Only the flash kernel allowed: the model's attention must be one it can serve (causal,
    # no explicit mask, 16 bits), or SDPA raises "No available kernel".
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        loss = lm_loss(engine.module, {k: v.to(device) for k, v in batch(2, seed=3).items()})
        loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # The engine's hooks move each gradient into its fp32 ``main_grad`` buffer (Megatron's).
    grads = [getattr(p, "main_grad", None) for p in engine.module.parameters()]
    grads = [g if g is not None else p.grad for g, p in zip(grads, engine.module.parameters())]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


def test_bf16_training_tracks_fp32_and_learns(fp32_losses):
    engine = build(*ARGS, "--bf16").engine
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    losses = train(engine)
    assert_falls(fp32_losses)
    assert_falls(losses)
    assert_close(losses, fp32_losses, REL_16)


def test_fp16_dynamic_loss_scaling_skips_overflows_then_tracks_fp32(fp32_losses):
    # Megatron's initial 2^32 overflows fp16 gradients at the start (any gradient above
    # 65504 / 2^32): the scaler halves the scale (hysteresis 1) and skips those steps until
    # none overflows.
    initial = 2.0**32
    engine = build(*ARGS, "--fp16", "--initial-loss-scale", initial, "--hysteresis", 1).engine
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    b = batch(2, seed=3)
    losses, stepped = [], []
    for _ in range(40):
        losses.append(float(engine.train_batch(iter([b]))))
        stepped.append(engine.last_step.update_successful)
        if sum(stepped) == STEPS:
            break
    assert engine.skipped_steps >= 1 and engine.cur_scale < initial, (engine.cur_scale, stepped)
    assert not stepped[0] and sum(stepped) == STEPS
    # A skipped step leaves the weights as they were: the losses seen before each successful
    # step are the fp32 run's trajectory.
    before_update = [loss for loss, ok in zip(losses, stepped) if ok]
    assert_falls(before_update)
    assert_close(before_update, fp32_losses, REL_16)


@pytest.mark.timeout(900)  # two compilations (inductor), minutes on a loaded CPU dry run
def test_compiled_bf16_equals_eager_and_learns():
    eager = train(build(*ARGS, "--bf16").engine)
    compiled = train(build(*ARGS, "--bf16", "--compile").engine)
    assert_falls(compiled)
    assert_close(compiled, eager, REL_16)
