"""One parameter's whole fp32 values out of the ZeRO partitions, and back in.

Each data-parallel rank holds chunk r of every parameter's fp32 master, of its optimizer states
and (after a reduction) of its gradient (:mod:`zerotron.zero.masters`). These functions read
or write the values of *one* parameter: ``local_*`` this rank's chunk (a view, ``chunk``
elements, zero-padded), ``full_*`` the whole tensor assembled by an all-gather over the
data-parallel group (a collective: every rank of the group calls it, for the same parameter),
``set_full_*`` each rank keeps its chunk of the value given (every rank passes the same value;
no communication). DeepSpeed's ``safe_get_full_fp32_param`` & co. are built on them
(:mod:`zerotron.compat.utils.tensor_fragment`).

Masters offloaded to NVMe are read through a copy of the whole offloaded state (slow, but
exact) and cannot be written here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zerotron.distributed import comm
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.zero.masters import ParamInfo

if TYPE_CHECKING:
    from zerotron.zero.optimizer import ZeroOptimizer


def info_of(zero: ZeroOptimizer, p: Tensor) -> ParamInfo | None:
    """Where ``p``'s chunk lives, or None when the optimizer does not hold ``p`` (frozen)."""
    return zero._info_of.get(id(p))


def _chunk(info: ParamInfo, flat: Tensor) -> Tensor:
    return flat[info.offset : info.offset + info.chunk]


def local_fp32_param(zero: ZeroOptimizer, info: ParamInfo) -> Tensor:
    """This rank's chunk of the fp32 master (a view, except with NVMe offload)."""
    if zero._on_nvme:
        return _chunk(info, zero._offloaded.state_dict()["fp32_partitions"][info.sub_group])
    return _chunk(info, zero.sub_groups[info.sub_group].master)


def local_optimizer_state(zero: ZeroOptimizer, info: ParamInfo, key: str) -> Tensor | None:
    """This rank's chunk of optimizer state ``key`` (Adam: ``exp_avg``, ``exp_avg_sq``);
    None before the first step or for a key the optimizer does not keep per element."""
    master = zero.sub_groups[info.sub_group].master
    if zero._on_nvme:
        states = zero._offloaded.state_dict()["optimizer"]["state"]
        value = states.get(info.sub_group, {}).get(key)
    else:
        value = zero.optimizer.state.get(master, {}).get(key)
    if not isinstance(value, Tensor) or value.dim() != 1:
        return None
    return _chunk(info, value)


def local_grad(zero: ZeroOptimizer, info: ParamInfo) -> Tensor | None:
    """This rank's chunk of the reduced (data-parallel averaged) gradient, as accumulated;
    None when no reduction delivered one since the last step."""
    grad = zero.sub_groups[info.sub_group].grad
    return None if grad is None else _chunk(info, grad)


def gather_full(zero: ZeroOptimizer, info: ParamInfo, local: Tensor) -> Tensor:
    """The whole fp32 tensor from every rank's ``local`` chunk (collective), on the
    parameter's device, shaped like the parameter."""
    chunks = comm.all_gather(local.to(info.param.device, torch.float32), zero.group)
    return chunks[: info.numel].clone().view(info.shape)


def set_local(zero: ZeroOptimizer, info: ParamInfo, local: Tensor, value: Tensor) -> None:
    """Keep this rank's chunk of the whole ``value`` in ``local`` (padding stays zero)."""
    if zero._on_nvme:
        raise UnsupportedError(
            "writing master weights or optimizer states offloaded to NVMe",
            where=f"parameter {info.name}",
            fix="set them with offload_optimizer.device cpu or none",
        )
    if tuple(value.shape) != tuple(info.shape):
        raise ConfigError(
            f"the value has shape {tuple(value.shape)}, the parameter {tuple(info.shape)}",
            where=f"parameter {info.name}",
            fix="pass the whole (unpartitioned) tensor",
        )
    flat = value.detach().reshape(-1)
    with torch.no_grad():
        local[: info.length].copy_(flat[info.start : info.start + info.length])
