"""The layout of a ZeRO rank's fp32 partitions: which chunk of which parameter sits where.

A rank owns chunk r of every parameter (:mod:`zerotron.zero.partition`). Its chunks are laid
out back to back (padding included, so offsets match the gradient buckets' rows) in a few flat
fp32 tensors, the *sub-groups* DeepSpeed steps one at a time (``sub_group_size``). The torch
optimizer steps those flat tensors, which is exact only for elementwise optimizers: padding
stays zero (zero gradient, zero weight decay), and every element's update depends on that
element alone.

The layout is what a checkpoint records (``ZeroOptimizer.state_dict()["layout"]``), so
zero-to-fp32 can rebuild every parameter from the N files without processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.precision.grads import IsCounted
from zerotron.zero.partition import chunk_bounds, chunk_size, full_shape
from zerotron.zero.stage3.shards import is_partitioned, read_shard

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)
"""Optimizers whose update of an element depends only on that element (and the step count).
Another class may declare ``zero_elementwise = True`` to be accepted."""


@dataclass
class ParamInfo:
    """Where one parameter's chunk lives on this rank."""

    param: nn.Parameter
    name: str
    shape: torch.Size
    numel: int
    chunk: int
    start: int
    """Element offset of this rank's chunk in the flattened parameter."""
    length: int
    """Real (unpadded) elements of this rank's chunk."""
    sub_group: int
    offset: int
    """Element offset of the chunk in its sub-group's flat tensors."""
    counted: bool
    partitioned: bool
    """Stage 3 holds the parameter as a shard (``p.ds_tensor``), not whole."""


class SubGroup:
    """A run of chunks of one dtype and torch param group, stepped as one flat fp32 tensor."""

    def __init__(self, dtype: torch.dtype, device: torch.device, group_index: int):
        self.dtype = dtype
        self.device = device
        self.group_index = group_index
        self.params: list[int] = []
        self.numel = 0
        self.master: Tensor = torch.empty(0)
        self.grad: Tensor | None = None
        """The reduced gradient partition in the parameters' dtype; None until a reduction."""


def build_partitions(
    param_groups: list[dict[str, Any]],
    names: dict[int, str],
    group: Group,
    *,
    stage3: bool,
    is_counted: IsCounted | None,
    sub_group_size: int,
) -> tuple[list[ParamInfo], list[SubGroup]]:
    """Lay out this rank's chunks of the optimizer's parameters in sub-groups and fill the
    fp32 masters from the parameters' current values.

    Parameters are taken in the optimizer's order; a sub-group never mixes torch param groups
    (their hyper-parameters), dtypes or devices, and closes before it would pass
    ``sub_group_size`` elements. ``names``: ``id(param) -> name`` for the checkpoint layout.
    """
    world, rank = group.size, group.rank
    infos: list[ParamInfo] = []
    subs: list[SubGroup] = []
    seen: set[int] = set()
    for g, pgroup in enumerate(param_groups):
        current: SubGroup | None = None
        for p in pgroup["params"]:
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            shape = full_shape(p)
            numel = shape.numel()
            chunk = chunk_size(numel, world)
            start, length = chunk_bounds(numel, world, rank)
            if (
                current is None
                or current.dtype != p.dtype
                or current.device != p.device
                or (current.numel and current.numel + chunk > sub_group_size)
            ):
                current = SubGroup(p.dtype, p.device, g)
                subs.append(current)
            partitioned = stage3 and is_partitioned(p)
            infos.append(
                ParamInfo(
                    p,
                    names.get(id(p), f"param{len(infos)}"),
                    shape,
                    numel,
                    chunk,
                    start,
                    length,
                    len(subs) - 1,
                    current.numel,
                    is_counted is None or bool(is_counted(p)),
                    partitioned,
                )
            )
            current.params.append(len(infos) - 1)
            current.numel += chunk
    for s in subs:
        s.master = torch.zeros(s.numel, dtype=torch.float32, device=s.device)
    for info in infos:
        load_master_chunk(info, subs[info.sub_group].master)
    return infos, subs


@torch.no_grad()
def load_master_chunk(info: ParamInfo, master: Tensor) -> None:
    """Copy this rank's chunk of the parameter's current value into its sub-group's master."""
    dst = master[info.offset : info.offset + info.length]
    if info.partitioned:
        dst.copy_(read_shard(info.param)[: info.length])
    else:
        dst.copy_(info.param.detach().reshape(-1)[info.start : info.start + info.length])


def check_args(
    optimizer: torch.optim.Optimizer,
    stage: int,
    clip_grad: float,
    sub_group_size: int,
    predivide: float,
) -> None:
    if stage not in (1, 2, 3):
        raise ConfigError(
            f"ZeRO stage {stage} is not 1, 2 or 3",
            where="zero_optimization.stage",
            fix="use 0 for plain data parallelism (no ZeroOptimizer) or 1-3",
        )
    if not (
        isinstance(optimizer, ELEMENTWISE_OPTIMIZERS)
        or getattr(optimizer, "zero_elementwise", False)
    ):
        raise UnsupportedError(
            f"ZeRO steps flat partitions made of many parameters' pieces, which is only exact for "
            f"elementwise optimizers; {type(optimizer).__name__} is not one of them",
            where="optimizer",
            fix="use Adam, AdamW or SGD with ZeRO, or turn ZeRO off (zero_optimization.stage 0)",
        )
    if len(optimizer.state) > 0:
        raise ConfigError(
            "ZeroOptimizer needs a fresh optimizer, but this one has already stepped",
            where=type(optimizer).__name__,
            fix="wrap the optimizer right after building it",
        )
    if clip_grad < 0:
        raise ConfigError(f"clip_grad={clip_grad} is negative", where="gradient_clipping")
    if sub_group_size <= 0:
        raise ConfigError(
            f"sub_group_size must be positive, got {sub_group_size}",
            where="zero_optimization.sub_group_size",
        )
    if predivide <= 0:
        raise ConfigError(
            f"gradient_predivide_factor must be positive, got {predivide}",
            where="gradient_predivide_factor",
        )
    if stage >= 2:
        from zerotron.distributed.state import is_model_parallel_initialized, state

        if is_model_parallel_initialized() and state().pp_size > 1:
            raise UnsupportedError(
                f"ZeRO stage {stage} with pipeline parallelism (pp={state().pp_size})",
                where="zero_optimization.stage",
                fix="use ZeRO stage 1 with pipeline parallelism, as DeepSpeed requires",
            )


STEP_PIECE = 1 << 21
"""Elements the torch optimizer steps at once (8 MiB of fp32): its temporaries (Adam's
denominator, the fp32 copy of a 16-bit gradient) are piece-sized however large a sub-group is.
A multiple of every SIMD width, so pieces split a sub-group where vector loops split it anyway."""


def step_in_pieces(
    optimizer: torch.optim.Optimizer,
    index: int,
    master: Tensor,
    grad_of: Callable[[int, int], Tensor],
    piece: int = STEP_PIECE,
) -> None:
    """Step ``optimizer.param_groups[index]`` (whose one parameter is the flat ``master``)
    ``piece`` elements at a time; ``grad_of(a, b)`` gives the fp32 gradient of ``master[a:b]``.

    Every other parameter of the optimizer must have no gradient (they are skipped). The
    optimizer is elementwise, so this is the whole-tensor step, bit for bit: each piece is a
    view of the master, and its state entries are views of the master's (made on the first
    step from the pieces' fresh states); state entries that are not per element (Adam's
    ``step``) are advanced once, not once per piece.
    """
    group = optimizer.param_groups[index]
    n = master.numel()
    full = optimizer.state.get(master) or {}
    fresh = not full
    before = dict(full)  # the per-step values as they were: every piece starts from them
    flat = master.detach()
    try:
        for a in range(0, n, piece):
            b = min(n, a + piece)
            view = flat[a:b]
            if not fresh:
                optimizer.state[view] = {k: _piece_of(v, master, a, b) for k, v in before.items()}
            view.grad = grad_of(a, b)
            group["params"] = [view]
            optimizer.step()
            view.grad = None
            state = optimizer.state.pop(view, {})
            for k, v in state.items():
                if isinstance(v, Tensor) and v.shape == view.shape and v.dim() == 1:
                    if fresh and b - a == n:
                        full[k] = v
                    elif fresh:
                        if a == 0:
                            full[k] = torch.empty(master.shape, dtype=v.dtype, device=v.device)
                        full[k][a:b].copy_(v)
                else:  # a per-step value: every piece advanced its own copy the same way
                    full[k] = v
    finally:
        group["params"] = [master]
    optimizer.state[master] = full


def _piece_of(value: Any, master: Tensor, a: int, b: int) -> Any:
    """A piece's view of a per-element state tensor; a copy of a per-step one."""
    if isinstance(value, Tensor):
        if value.shape == master.shape and value.dim() == 1:
            return value[a:b]
        return value.clone()
    return value
