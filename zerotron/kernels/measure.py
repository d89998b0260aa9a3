"""The chooser's candidates as calls on a model's shapes: one forward and backward each.

:data:`RUNNERS` maps each choice of :mod:`~zerotron.kernels.chooser` to a function of a
:class:`~zerotron.kernels.chooser.KernelShape` returning ``{candidate: call}``. Each call runs the
candidate's path itself (not through the policy), on inputs drawn from a private generator, so
measuring leaves the global RNG (and so the run's dropout and initialization) untouched. Sizes
are capped to keep a measurement to a few seconds: up to 512 tokens for the linear layers,
1,024 for attention, 256 tokens and 16,384 vocabulary columns for the fused loss. With
``shape.tp`` > 1 they are one tensor-parallel rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from zerotron.kernels.attention_cpu import sdpa_fp32, sdpa_math_16bit
from zerotron.kernels.fused_cross_entropy import ChunkWorkspace, fused_linear_cross_entropy
from zerotron.kernels.onednn import _OneDNNLinear
from zerotron.kernels.policy import KernelChoices, using_choices
from zerotron.kernels.upcast import _UpcastLinear

if TYPE_CHECKING:
    from zerotron.kernels.chooser import KernelShape

LINEAR_TOKENS = 512
ATTENTION_TOKENS = 1024
LOSS_TOKENS = 256
LOSS_COLUMNS = 16384


def _randn(g: torch.Generator, *shape: int, dtype=torch.float32, grad: bool = True):
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


def linear_runners(shape: KernelShape) -> dict[Any, Callable[[], None]]:
    """fp32 ``onednn`` / ``torch``: the block's four linear layers, forward and backward."""
    block = _linear_block(shape, torch.float32)
    return {"onednn": block(_OneDNNLinear.apply), "torch": block(F.linear)}


def matmul16_runners(shape: KernelShape) -> dict[Any, Callable[[], None]]:
    """16-bit ``native`` / ``fp32`` (upcast): the block's four linear layers in the model's
    dtype, forward and backward."""
    block = _linear_block(shape, shape.torch_dtype)
    return {"native": block(F.linear), "fp32": block(_UpcastLinear.apply)}


def precision_runners(shape: KernelShape) -> dict[Any, Callable[[], None]]:
    """``bf16`` / ``fp32``: the block's four linear layers by ``F.linear`` in each dtype (what
    most of a training step is), forward and backward."""
    return {
        "bf16": _linear_block(shape, torch.bfloat16)(F.linear),
        "fp32": _linear_block(shape, torch.float32)(F.linear),
    }


def _linear_block(shape: KernelShape, dtype: torch.dtype):
    """A function of a linear (``F.linear``'s signature) giving a call that runs the block's
    four linear layers in ``dtype`` on ``shape``, forward and backward."""
    g = torch.Generator().manual_seed(0)
    h, tokens = shape.hidden, min(shape.seq * shape.micro_batch, LINEAR_TOKENS)
    x = _randn(g, tokens, h, dtype=dtype)
    tp = shape.tp  # column-parallel layers split their outputs, row-parallel their inputs
    layers = [(3 * h // tp, h), (h, h // tp), (4 * h // tp, h), (h, 4 * h // tp)]
    params = [(_randn(g, n, k, dtype=dtype), _randn(g, n, dtype=dtype)) for n, k in layers]
    inputs = {k: x if k == h else _randn(g, tokens, k, dtype=dtype) for _, k in layers}
    grads = {n: torch.randn(tokens, n, generator=g).to(dtype) for n, _ in layers}

    def run(linear) -> Callable[[], None]:
        def call() -> None:
            for w, b in params:
                y = linear(inputs[w.shape[1]], w, b)
                y.backward(grads[w.shape[0]])
            for t in (*inputs.values(), *(p for wb in params for p in wb)):
                t.grad = None

        return call

    return run


def attention_runners(shape: KernelShape) -> dict[Any, Callable[[], None]]:
    """16-bit ``math16`` / ``sdpa`` / ``fp32``: causal attention forward and backward, no
    dropout."""
    g = torch.Generator().manual_seed(0)
    b = max(1, min(shape.micro_batch, ATTENTION_TOKENS // shape.seq))
    d, heads = shape.hidden // shape.heads, max(1, shape.heads // shape.tp)
    qkv = [_randn(g, b, heads, shape.seq, d, dtype=shape.torch_dtype) for _ in range(3)]
    grad = torch.randn(b, heads, shape.seq, d, generator=g).to(shape.torch_dtype)

    def run(attention) -> Callable[[], None]:
        def call() -> None:
            attention(*qkv).backward(grad)
            for t in qkv:
                t.grad = None

        return call

    return {
        "math16": run(lambda q, k, v: sdpa_math_16bit(q, k, v, None, True)),
        "sdpa": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "fp32": run(lambda q, k, v: sdpa_fp32(q, k, v, None, True)),
    }


def loss_chunk_runners(shape: KernelShape) -> dict[Any, Callable[[], None]]:
    """fp32 fused loss on oneDNN, one candidate per slice width: forward and backward."""
    from zerotron.kernels.chooser import CANDIDATES

    g = torch.Generator().manual_seed(0)
    tokens = min(shape.seq * shape.micro_batch, LOSS_TOKENS)
    v = min(max(1, shape.vocab // shape.tp), LOSS_COLUMNS)
    x, w = _randn(g, tokens, shape.hidden), _randn(g, v, shape.hidden)
    target = torch.randint(0, v, (tokens,), generator=g)
    workspace = ChunkWorkspace()

    def run(columns: int) -> Callable[[], None]:
        def call() -> None:
            with using_choices(KernelChoices(linear="onednn", loss_chunk=columns)):
                fused_linear_cross_entropy(x, w, target, workspace=workspace).mean().backward()
            x.grad = w.grad = None

        return call

    return {columns: run(columns) for columns in CANDIDATES["loss_chunk"]}


RUNNERS: dict[str, Callable[[KernelShape], dict[Any, Callable[[], None]]]] = {
    "linear": linear_runners,
    "matmul16": matmul16_runners,
    "attention": attention_runners,
    "loss_chunk": loss_chunk_runners,
    "precision": precision_runners,
}
