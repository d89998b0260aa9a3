"""``zero.Init``: build a model whose parameters are partitioned (ZeRO stage 3) from the start.

Inside ``with Init():`` every ``nn.Module`` constructed has its parameters split over the
data-parallel group (by :func:`zerotron.zero.stage3.partition_param`) soon after its own
``__init__`` returns: a layer creates and initializes its weights as usual, then keeps only its
chunk. "Soon": a finished module stays whole until the next module starts being built, or until
the outermost construction returns, so that a parent may still initialize a child it has just
built (GPT's ``Embedding`` draws ``position_embeddings.weight`` after ``nn.Embedding`` made it).
A rank thus holds in full only the module being built and the one finished just before. Random
numbers are drawn exactly as without ``Init``, so the model is the one an eager construction
with the same seed gives (and stage 3 training matches one process).

How: on entering, the ``__init__`` of every ``nn.Module`` subclass (and of those defined inside
the block) is wrapped; a module counts as finished when the *outermost* ``__init__`` call for
that instance returns (a subclass calling ``super().__init__()`` is still being built). Leaving
the block restores the classes.

Afterwards the model runs once :func:`zerotron.zero.stage3.partition_parameters` (the Engine
calls it for stage 3) has installed the gather hooks. Code that changes parameters after a
module's ``__init__`` (a re-initialization pass over the finished model) must do it inside
:class:`~zerotron.zero.stage3.GatheredParameters` with ``modifier_rank=0``: outside, a
partitioned parameter is an empty tensor and an in-place write does nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError
from zerotron.zero.stage3 import ShardStore, partition_param

_active: list[Init] = []  # innermost last; the classes are patched while it is non-empty
_building: dict[int, int] = {}  # id(module) -> nesting depth of its __init__ calls
_patched: dict[type, Any] = {}  # class -> its original __init__
_orig_init_subclass: Any = None


class Init:
    """Partition parameters at construction (DeepSpeed's ``deepspeed.zero.Init``).

    Args:
        module: an already built module to partition now (instead of using the context).
        data_parallel_group: a :class:`~zerotron.distributed.comm.Group` or a torch process
            group; default ``zerotron.distributed.state().dp``.
        enabled: False makes the context do nothing.
        dtype: cast floating parameters to this dtype before partitioning.
        config_dict_or_path: a DeepSpeed config (dict or JSON file); its
            ``zero_optimization.stage3_param_persistence_threshold`` and ``offload_param``
            are used.
        remote_device: ``"cpu"`` or ``"nvme"`` keeps the shards in a
            :class:`~zerotron.zero.offload.ParamOffloadStore` (default: the config's
            ``offload_param.device``).
        pin_memory: pin the host copies (``remote_device="cpu"``, with CUDA only).
        mem_efficient_linear: accepted for DeepSpeed compatibility; stage 3 always keeps saved
            views of weights as references to the parameter (see :mod:`zerotron.zero.stage3`).
        persistence_threshold: parameters of at most this many elements stay whole (default:
            the config's, else 1e5, DeepSpeed's).
        param_store: a ready :class:`~zerotron.zero.offload.ParamOffloadStore` (overrides
            ``remote_device``).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        config_dict_or_path: Mapping[str, Any] | str | Path | None = None,
        remote_device: str | None = None,
        pin_memory: bool = False,
        mem_efficient_linear: bool = True,
        *,
        persistence_threshold: int | None = None,
        param_store: ShardStore | None = None,
    ):
        self.enabled = enabled
        self.dtype = dtype
        self.mem_efficient_linear = mem_efficient_linear
        zero = _zero_section(config_dict_or_path)
        if persistence_threshold is None:
            persistence_threshold = int(float(zero.get("stage3_param_persistence_threshold", 1e5)))
        self.persistence_threshold = persistence_threshold
        self.group = _as_group(data_parallel_group) if enabled else None
        self.param_store = param_store
        if enabled and param_store is None:
            self.param_store = _make_store(zero.get("offload_param"), remote_device, pin_memory)
        self._count = 0
        self._pending: list[nn.Module] = []  # finished, not yet partitioned
        if enabled and module is not None:
            self._partition(module)

    def __enter__(self) -> Init:
        if self.enabled:
            if not _active:
                _patch_classes()
            _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self._flush()
            _active.remove(self)
            if not _active:
                _unpatch_classes()

    def _finished(self, module: nn.Module) -> None:
        self._pending.append(module)
        if not _building:  # the outermost construction returned
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for module in pending:
            self._partition(module)

    def _partition(self, module: nn.Module) -> None:
        assert self.group is not None
        for p in module.parameters():
            if hasattr(p, "ds_persist"):
                continue
            if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            self._count += 1
            partition_param(
                p,
                self.group,
                persistence_threshold=self.persistence_threshold,
                key=f"init{self._count}",
                store=self.param_store,
            )


# --------------------------------------------------------------------------------------------
# Wrapping nn.Module.__init__ of every class


def _wrap(cls: type) -> None:
    orig = cls.__dict__["__init__"]

    @functools.wraps(orig)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        key = id(self)
        depth = _building.get(key, 0)
        if depth == 0 and _active:  # a new module: the one finished before may go now
            _active[-1]._flush()
        _building[key] = depth + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            if depth:
                _building[key] = depth
            else:
                del _building[key]
        if depth == 0 and _active:  # the outermost __init__ of this module is done
            _active[-1]._finished(self)

    _patched[cls] = orig
    cls.__init__ = __init__  # type: ignore[misc]


def _all_module_classes() -> list[type]:
    seen: list[type] = []
    todo = [nn.Module]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def _patch_classes() -> None:
    global _orig_init_subclass
    for cls in _all_module_classes():
        if "__init__" in cls.__dict__ and cls not in _patched:
            _wrap(cls)
    _orig_init_subclass = nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:  # classes defined inside the block
        super(nn.Module, cls).__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__ and cls not in _patched:
            _wrap(cls)

    nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]


def _unpatch_classes() -> None:
    for cls, orig in _patched.items():
        cls.__init__ = orig  # type: ignore[misc]
    _patched.clear()
    if _orig_init_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = _orig_init_subclass  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------
# Arguments


def _as_group(group: Any) -> Group:
    if group is None:
        from zerotron.distributed.state import state

        return state().dp
    if isinstance(group, Group):
        return group
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    return Group("dp", ranks, ranks.index(dist.get_rank()), group if len(ranks) > 1 else None)


def _zero_section(config: Mapping[str, Any] | str | Path | None) -> Mapping[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"cannot read the DeepSpeed config: {e}",
                where=str(path),
                fix="pass a readable JSON file or a dict",
            ) from e
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError("must be a mapping", where="zero_optimization")
    return zero


def _make_store(
    section: Mapping[str, Any] | None, remote_device: str | None, pin_memory: bool
) -> ShardStore | None:
    from zerotron.zero.offload import ParamOffloadStore
    from zerotron.zero.options import OffloadOptions

    where = "zero_optimization.offload_param"
    opts = OffloadOptions.from_dict(section, where) if section else OffloadOptions()
    if remote_device is not None:
        opts = dataclasses.replace(opts, device=remote_device)
    if pin_memory:
        opts = dataclasses.replace(opts, pin_memory=True)
    if opts.device == "none":
        return None
    return ParamOffloadStore(opts, where=where)
