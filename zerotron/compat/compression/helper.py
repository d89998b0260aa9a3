"""DeepSpeed's ``deepspeed.compression.helper``: reach a sub-module by its dotted name."""

from __future__ import annotations

from typing import Any

from torch import nn


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """The attribute at dotted path ``module_name`` of ``model`` (``"encoder.layer.0"``)."""
    target: Any = model
    for part in module_name.split("."):
        target = getattr(target, part)
    return target


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Replace the attribute at dotted path ``module_name`` of ``model`` with ``module``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
