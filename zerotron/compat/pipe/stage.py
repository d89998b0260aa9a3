"""A :class:`~zerotron.pipe.module.PipelineModule` on zerotron's pipeline runtime.

:class:`PipelineModuleRuntime` is a :class:`~zerotron.pipeline.PipelineRuntime` whose
one model chunk is :class:`PipeStage`, an adapter from DeepSpeed's data format to the runtime's
chunk protocol (``chunk(hidden, batch)``, see :mod:`zerotron.pipeline.runtime`):

- a micro-batch is DeepSpeed's ``(inputs, labels)`` tuple, as the data iterator yields it;
- the first stage runs ``module(inputs)``; with activation checkpointing on, its floating-point
  inputs are made to require grad first (DeepSpeed does the same: a checkpointed call whose
  inputs need no gradient would give its parameters none);
- later stages run ``module(received activation)``;
- the last stage's loss is ``module.loss_fn(outputs, labels)``, or the output itself when the
  module has no ``loss_fn`` (DeepSpeed's rule).

Activations between stages are single tensors (the runtime sends one tensor per micro-batch
and boundary, with a shape header at the first step); a stage returning a tuple is an error
that says so.

Tied layers (``TiedLayerSpec``): :meth:`PipeStage.tied_weights` declares their weights with
the group of the stages sharing each (:mod:`zerotron.parallel.declarations`), and the Engine
sums their gradients over it after the schedule's backwards
(:func:`~zerotron.parallel.declarations.allreduce_tied_grads`, as for any model's chunks), the
reduction :meth:`~zerotron.pipe.module.PipelineModule.allreduce_tied_weight_gradients` makes.
With data parallelism it comes where the Engine puts it for every pipeline: before ZeRO's
reduce-scatter, after the plain data-parallel average (the two sums commute).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerotron.compat.pipe.module import PipelineModule
from zerotron.errors import ConfigError, DataError
from zerotron.parallel.declarations import TiedWeight
from zerotron.pipeline import PipelineRuntime


class PipeStage(nn.Module):
    """The runtime's chunk for a :class:`PipelineModule` (see the module docstring)."""

    def __init__(self, module: PipelineModule):
        super().__init__()
        self.module = module
        self.pre_process = module.is_first_stage()
        self.post_process = module.is_last_stage()
        self.layer_range = range(module.parts[module.stage_id], module.parts[module.stage_id + 1])

    def tied_weights(self) -> list[TiedWeight]:
        """This stage's tied-layer weights, each with the group of the stages sharing it (keys
        in sorted order, the same on every stage)."""
        m = self.module
        return [
            TiedWeight(weight, group)
            for key, group in m.tied_comms.items()
            for weight in m._tied_weights(key)
        ]

    def forward(self, hidden: torch.Tensor | None, batch: Any) -> Any:
        if self.pre_process:
            x = _requiring_grad(_inputs(batch), self.module.activation_checkpoint_interval > 0)
        elif hidden is None:
            raise ConfigError(
                f"pipeline stage {self.module.stage_id} got no input activation",
                where="PipeStage.forward",
            )
        else:
            x = hidden
        out = self.module(x)
        if self.post_process:
            return out
        if not isinstance(out, torch.Tensor):
            raise ConfigError(
                f"pipeline stage {self.module.stage_id} returned {type(out).__name__}; zerotron's "
                "pipeline runtime passes one tensor between stages",
                where=f"PipelineModule layers {self.layer_range.start}.."
                f"{self.layer_range.stop - 1}",
                fix="make each stage's last layer return a single tensor (concatenate, or "
                "partition so that the boundary falls where one tensor flows)",
            )
        return _sendable(out)

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        """The runtime's ``loss_fn``: ``module.loss_fn(outputs, labels)``, else ``outputs``."""
        if self.module.loss_fn is None:
            return outputs
        return self.module.loss_fn(outputs, _labels(batch))


class PipelineModuleRuntime(PipelineRuntime):
    """The pipeline runtime running a :class:`PipelineModule` (module docstring).

    ``schedule_kind``: ``"1f1b"`` (DeepSpeed's TrainSchedule) or ``"gpipe"``; one model chunk
    per stage, so no ``"interleaved"``.
    """

    def __init__(self, module: PipelineModule, schedule_kind: str, num_microbatches: int):
        self.pipe_module = module
        self.chunk = PipeStage(module)  # (self.stage is the runtime's stage index)
        super().__init__(
            [self.chunk],
            schedule_kind,
            num_microbatches,
            loss_fn=self.chunk.loss,
            variable_seq_lengths=module.dynamic_shape,
        )


def _inputs(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0]
    raise DataError(
        f"a pipeline micro-batch must be an (inputs, labels) pair, got {type(batch).__name__}",
        where="PipelineModule data iterator",
        fix="yield (inputs, labels) tuples, as DeepSpeed's pipeline engine expects",
    )


def _labels(batch: Any) -> Any:
    _inputs(batch)
    return batch[1]


def _requiring_grad(x: Any, needed: bool) -> Any:
    if not needed or not torch.is_grad_enabled():
        return x
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point()) if not x.requires_grad else x
    if isinstance(x, tuple):
        return tuple(_requiring_grad(t, needed) for t in x)
    return x


def _sendable(out: torch.Tensor) -> torch.Tensor:
    """``out``, or a view of it when its own backward needs its values.

    The runtime frees a sent output's storage (keeping its graph); that is only safe when the
    operation that made it did not save it for backward (ReLU, tanh and in-place ops do). A view
    is never freed.
    """
    node = out.grad_fn
    if node is None:
        return out
    ptr = out.untyped_storage().data_ptr()
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            saved = getattr(node, name)
        except RuntimeError:
            continue
        if isinstance(saved, torch.Tensor) and saved.untyped_storage().data_ptr() == ptr:
            return out.view_as(out)
    return out
