"""Parameter groups: which parameters get weight decay.

Megatron's rule: biases and every 1-D parameter (LayerNorm weights and biases) are not decayed;
matrices and embeddings are. Each group carries ``wd_mult`` (0 or 1) and ``lr_mult`` so a
scheduler that sets weight decay and learning rate per step keeps the exemption.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

NoDecayPredicate = Callable[[str, torch.nn.Parameter], bool]


def is_no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default: no weight decay on biases and 1-D parameters (norm weights)."""
    return name.endswith(".bias") or name == "bias" or param.ndim <= 1


def get_param_groups(
    model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
    weight_decay: float,
    no_decay_predicate: NoDecayPredicate | None = None,
) -> list[dict[str, Any]]:
    """Split the trainable parameters of ``model`` into a decayed and a non-decayed group.

    Args:
        model: a module (shared parameters, such as tied embeddings, are listed once) or
            ``(name, param)`` pairs.
        weight_decay: the decay of the decayed group.
        no_decay_predicate: ``(name, param) -> True`` for parameters that must not be decayed;
            default :func:`is_no_decay`.

    Returns:
        Up to two groups in this order, empty ones left out: ``{"params", "weight_decay",
        "wd_mult": 1.0, "lr_mult": 1.0}`` and the same with weight decay 0 and ``wd_mult`` 0.
        Frozen parameters (``requires_grad=False``) are in neither.
    """
    pred = no_decay_predicate or is_no_decay
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    decay, no_decay = [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        (no_decay if pred(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0, "lr_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0},
    ]
    return [g for g in groups if g["params"]]
