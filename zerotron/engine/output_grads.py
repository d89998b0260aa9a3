"""Plain ``loss.backward()`` on an Engine's output, done as ``engine.backward(loss)`` does it.

DeepSpeed accepts both ``engine.backward(loss)`` and ``loss.backward()`` (the latter is what
Hugging Face accelerate and hand-written loops call). The Engine's backward does three things
around autograd: it divides the loss by the gradient accumulation steps and multiplies it by
the loss scale (fp16), it tells the data-parallel part whether this micro-batch ends an
accumulation (only then do plain data parallelism and ZeRO 1 reduce; ZeRO 2/3 reduce-scatter
every micro-batch), and after autograd it finishes that reduction and counts the micro-batch.

The rule for ``loss.backward()``: every tensor the Engine's forward returns (in tuples, lists,
dicts and Hugging Face ``ModelOutput``\\ s) is passed through :class:`_EngineOutput`, an identity
whose backward

1. at the first gradient it sees in a backward pass: sets the data-parallel part's ``sync``
   for this micro-batch and queues the end of the micro-batch with autograd
   (``queue_callback``: it runs once the whole backward pass is done, after every parameter's
   gradient hook, so the reduction is complete when ``loss.backward()`` returns);
2. multiplies the gradient by ``loss_scale / gradient_accumulation_steps`` — the same factor
   ``engine.backward`` applies to the loss, applied where the gradient enters the model, so
   the parameters' gradients (and the fp16 overflow check) are the same.

A tensor computed inside the model (the logits a returned loss was made from) is never scaled
twice: the returned tensors are new autograd nodes (copies, so that they can be modified in
place: one copy of each returned tensor per forward with gradients), and each path from the
user's loss into the model goes through exactly one of them. While ``engine.backward(loss)``
runs (it scales the loss itself), and after ``engine.scale(loss)`` (DeepSpeed's explicit loss
scaling, which leaves only the accumulation division to the Engine), the identity scales by
what remains.

Gradients of a module called directly (``engine.module(x)``), bypassing the Engine, get none of
this: call the Engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor


class MicroBatchEnds(Protocol):
    """What the Engine gives the identity: the factor and the two ends of a backward."""

    def _output_grad_factor(self) -> float: ...

    def _begin_output_backward(self) -> bool:
        """Start the micro-batch if none is running; True if this call started it."""

    def _end_output_backward(self) -> None: ...


class _EngineOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, engine: MicroBatchEnds, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.engine = engine
        # A copy, not a view: callers modify returned tensors in place (Hugging Face's Trainer
        # does ``loss *= num_processes``), which autograd forbids on a custom Function's views.
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        engine = ctx.engine
        if engine._begin_output_backward():
            torch.autograd.Variable._execution_engine.queue_callback(engine._end_output_backward)
        factor = engine._output_grad_factor()
        return None, grad if factor == 1.0 else grad * factor


def wrap_outputs(engine: MicroBatchEnds, out: Any) -> Any:
    """``out`` with each tensor that requires grad passed through :class:`_EngineOutput`."""
    return _map(out, lambda t: _EngineOutput.apply(engine, t))


def _map(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(out, Tensor):
        return fn(out) if out.requires_grad and out.is_floating_point() else out
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*(_map(v, fn) for v in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_map(v, fn) for v in out)
    if isinstance(out, dict):  # in place: a ModelOutput keeps its attributes in step
        for key in list(out.keys()):
            value = out[key]
            mapped = _map(value, fn)
            if mapped is not value:
                out[key] = mapped
        return out
    if isinstance(out, Mapping):
        return {k: _map(v, fn) for k, v in out.items()}
    return out
