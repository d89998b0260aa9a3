"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` (``deepspeed.utils.tensor_fragment``):
a model parameter's whole fp32 master, optimizer state or gradient, at any ZeRO stage.

Call them with a parameter of a model an engine trains. The ``full`` getters return a new fp32
tensor shaped like the parameter, the same on every rank: under ZeRO (stages 1-3) they
all-gather the data-parallel chunks, so **every rank of the data-parallel group must call
them, for the same parameters in the same order**; at stage 0 the values are whole on every
rank. The setters take the whole value (the same on every rank) and each rank keeps its chunk;
they change the fp32 master or state, and the model's 16-bit weights follow at the next step
(as in DeepSpeed).

Differences from DeepSpeed: at stage 0 DeepSpeed answers only for bf16 training (its
BF16_Optimizer); here every stage-0 run answers (the master, or the fp32 parameter itself). A
parameter no optimizer steps (frozen) gives None, as in DeepSpeed.

The ``local`` variants (ZeRO-3 parameters only, as in DeepSpeed) read or write this rank's
chunk (``ceil(numel / world)`` elements, zero-padded) without communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerotron.errors import ConfigError
from zerotron.precision.owners import owner_of
from zerotron.zero import full_values
from zerotron.zero.full_values import gather_full, info_of, set_local


def _zero(p: Tensor) -> tuple[Any, Any]:
    """``(ZeroOptimizer, ParamInfo)`` for a parameter under ZeRO, else ``(owner, None)``."""
    owner = owner_of(p)
    if owner is None or not hasattr(owner, "sub_groups"):
        return owner, None
    return owner, info_of(owner, p)


def _stage0_master(owner: Any, p: Tensor) -> Tensor | None:
    return owner.master_of(p) if owner is not None and hasattr(owner, "master_of") else None


def safe_get_full_fp32_param(param: Tensor) -> Tensor | None:
    """The whole fp32 master weight of ``param`` (collective under ZeRO)."""
    zero, info = _zero(param)
    if info is not None:
        return gather_full(zero, info, full_values.local_fp32_param(zero, info))
    master = _stage0_master(zero, param)
    return None if master is None else master.detach().float().clone()


def safe_set_full_fp32_param(param: Tensor, value: Tensor) -> None:
    """Replace the fp32 master weight of ``param`` with the whole ``value``."""
    zero, info = _zero(param)
    if info is not None:
        set_local(zero, info, full_values.local_fp32_param(zero, info), value)
        return
    master = _stage0_master(zero, param)
    if master is not None:
        with torch.no_grad():
            master.copy_(value.view_as(master))


def safe_get_full_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` of ``param`` (Adam: ``exp_avg``,
    ``exp_avg_sq``); None before the first step (collective under ZeRO)."""
    zero, info = _zero(param)
    if info is not None:
        local = full_values.local_optimizer_state(zero, info, optim_state_key)
        # every rank steps the same sub-groups, so all or none have the state
        return None if local is None else gather_full(zero, info, local)
    state = _stage0_state(zero, param, optim_state_key)
    return None if state is None else state.detach().float().clone()


def safe_set_full_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Replace optimizer state ``optim_state_key`` of ``param`` with the whole ``value``."""
    zero, info = _zero(param)
    if info is not None:
        local = full_values.local_optimizer_state(zero, info, optim_state_key)
        if local is None:
            raise _no_state(param, optim_state_key)
        set_local(zero, info, local, value)
        return
    state = _stage0_state(zero, param, optim_state_key)
    if state is None:
        if _stage0_master(zero, param) is None:
            return
        raise _no_state(param, optim_state_key)
    with torch.no_grad():
        state.copy_(value.view_as(state))


def _stage0_state(owner: Any, p: Tensor, key: str) -> Tensor | None:
    master = _stage0_master(owner, p)
    if master is None:
        return None
    value = owner.optimizer.state.get(master, {}).get(key)
    return value if isinstance(value, Tensor) and value.shape == master.shape else None


def _no_state(param: Tensor, key: str) -> ConfigError:
    return ConfigError(
        f"the optimizer keeps no per-element state {key!r} for this parameter "
        f"(shape {tuple(param.shape)}) yet",
        where="safe_set_full_optimizer_state",
        fix="call it after the first optimizer step, with a key the optimizer uses "
        "(Adam: exp_avg, exp_avg_sq)",
    )


def safe_get_full_grad(param: Tensor) -> Tensor | None:
    """The whole gradient of ``param`` after backward and before the step: ``param.grad``
    when the parameter still holds one (stage 0, or a ZeRO micro-batch that did not reduce),
    else the reduced (data-parallel averaged) fp32 gradient from the ZeRO partitions
    (collective); None when there is none. Loss-scaled under fp16, as in DeepSpeed.

    Difference: at stage 0 with more than one data-parallel rank the gradients live in the
    data-parallel buffer (``param.main_grad``), which the step zeroes rather than frees, so
    after the step this returns zeros where DeepSpeed returns None."""
    if param.grad is not None:
        return param.grad
    zero, info = _zero(param)
    if info is not None:
        local = full_values.local_grad(zero, info)
        return None if local is None else gather_full(zero, info, local)
    main_grad = getattr(param, "main_grad", None)  # stage 0, 16-bit: the fp32 accumulator
    return main_grad if zero is not None else None


def safe_set_full_grad(param: Tensor, value: Tensor) -> None:
    """Replace the gradient of ``param`` (see :func:`safe_get_full_grad` for which)."""
    if param.grad is not None:
        with torch.no_grad():
            param.grad.copy_(value)
        return
    zero, info = _zero(param)
    if info is not None:
        local = full_values.local_grad(zero, info)
        if local is not None:
            set_local(zero, info, local, value)
        return
    main_grad = getattr(param, "main_grad", None)
    if zero is not None and main_grad is not None:
        with torch.no_grad():
            main_grad.copy_(value)


# ---- ZeRO-3 local chunks -------------------------------------------------------------------


def _zero3(param: Tensor, what: str) -> tuple[Any, Any]:
    zero, info = _zero(param)
    if info is None or getattr(zero, "stage", 0) != 3:
        raise ConfigError(
            f"{what} is defined for parameters trained with ZeRO stage 3 only",
            where=what,
            fix="use the safe_get_full_* functions at other stages",
        )
    return zero, info


def safe_get_local_fp32_param(param: Tensor) -> Tensor:
    """This rank's chunk of the fp32 master of a ZeRO-3 parameter (a view)."""
    zero, info = _zero3(param, "safe_get_local_fp32_param")
    return full_values.local_fp32_param(zero, info)


def safe_get_local_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """This rank's chunk of optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    zero, info = _zero3(param, "safe_get_local_optimizer_state")
    return full_values.local_optimizer_state(zero, info, optim_state_key)


def safe_get_local_grad(param: Tensor) -> Tensor | None:
    """This rank's chunk of the reduced gradient of a ZeRO-3 parameter."""
    zero, info = _zero3(param, "safe_get_local_grad")
    return full_values.local_grad(zero, info)


def _set_chunk(local: Tensor | None, value: Tensor, what: str) -> None:
    if local is None:
        raise ConfigError(f"there is nothing to set yet for {what}", where=what)
    with torch.no_grad():
        local.copy_(value.reshape(-1)[: local.numel()])


def safe_set_local_fp32_param(param: Tensor, value: Tensor) -> None:
    """Replace this rank's chunk of the fp32 master of a ZeRO-3 parameter."""
    zero, info = _zero3(param, "safe_set_local_fp32_param")
    _set_chunk(full_values.local_fp32_param(zero, info), value, "safe_set_local_fp32_param")


def safe_set_local_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Replace this rank's chunk of optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    zero, info = _zero3(param, "safe_set_local_optimizer_state")
    local = full_values.local_optimizer_state(zero, info, optim_state_key)
    _set_chunk(local, value, "safe_set_local_optimizer_state")


def safe_set_local_grad(param: Tensor, value: Tensor) -> None:
    """Replace this rank's chunk of the reduced gradient of a ZeRO-3 parameter."""
    zero, info = _zero3(param, "safe_set_local_grad")
    _set_chunk(full_values.local_grad(zero, info), value, "safe_set_local_grad")
