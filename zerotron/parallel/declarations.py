"""What a module declares about its weights, so that parallelism never needs to know the model.

Any ``nn.Module`` may provide either method; ZeRO-3, the Engine and the pipeline read them with
the functions below and import no model:

- ``external_parameters() -> Iterable[nn.Parameter]``: parameters its ``forward`` reads that
  another module owns (a tied output layer reading the word embedding, a slice of a child's
  weight). ZeRO-3 gathers them for the module's whole forward and backward.
- ``tied_weights() -> Iterable[TiedWeight]``: weights of which other ranks hold copies (the
  same layer on two pipeline stages), each with the group whose gradients are summed after
  backward, so that every copy takes the same step. The order must be the same on every rank of
  a group (the all-reduces are matched in order).

:func:`allreduce_tied_grads` is that sum, for the modules a rank runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.precision.grads import grad_of


@dataclass(frozen=True)
class TiedWeight:
    """A weight with copies on other ranks; ``group`` (this rank among them) sums their grads."""

    weight: torch.Tensor
    group: Group


@runtime_checkable
class DeclaresExternalParameters(Protocol):
    """A module whose forward reads parameters another module owns."""

    def external_parameters(self) -> Iterable[nn.Parameter]: ...


@runtime_checkable
class DeclaresTiedWeights(Protocol):
    """A module holding weights that are tied to copies on other ranks."""

    def tied_weights(self) -> Iterable[TiedWeight]: ...


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """What ``module`` declares with ``external_parameters()`` (none if it declares nothing)."""
    if isinstance(module, DeclaresExternalParameters):
        return list(module.external_parameters())
    return []


def tied_weights(module: nn.Module) -> list[TiedWeight]:
    """What ``module`` declares with ``tied_weights()`` (none if it declares nothing)."""
    if isinstance(module, DeclaresTiedWeights):
        return list(module.tied_weights())
    return []


def allreduce_tied_grads(modules: Iterable[nn.Module]) -> None:
    """Sum each declared tied weight's gradient over its group (after backward, before the step).

    ``modules`` are the modules this rank runs (a pipeline rank's model chunks); their
    submodules' declarations count too, each weight once. Groups of one rank, and ranks outside
    a group, have nothing to sum. The gradient is the weight's ``main_grad`` where it has one
    (data-parallel buffers, 16-bit parameters), else ``.grad``; a copy that got no gradient this
    step contributes zeros.
    """
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            for tied in tied_weights(module):
                group = tied.group
                if id(tied.weight) in seen or not group.is_member or group.size == 1:
                    continue
                seen.add(id(tied.weight))
                grad = grad_of(tied.weight)
                if grad is None:
                    tied.weight.grad = grad = torch.zeros_like(tied.weight)
                comm.all_reduce(grad, group)
