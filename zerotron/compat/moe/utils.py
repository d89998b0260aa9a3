"""DeepSpeed's ``deepspeed.moe.utils``: without MoE layers every parameter is dense, so the
optimizer groups stay as they are."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def is_moe_param(param: Tensor) -> bool:
    """Whether ``param`` belongs to an expert (DeepSpeed marks them ``allreduce=False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | list[dict[str, Any]] | tuple[dict[str, Any], ...],
    max_group_size: int | None = 178956971,
) -> list[dict[str, Any]]:
    """DeepSpeed moves expert parameters into groups of their own; with none (zerotron has no
    MoE layers) the groups come back as a list, unchanged."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)
