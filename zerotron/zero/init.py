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

Each parameter is partitioned by :func:`~zerotron.zero.stage3.shards.partition_param`, which
broadcasts data-parallel rank 0's values first (as DeepSpeed's ``Init`` does): a script that
seeds each rank differently still builds rank 0's model on every rank.

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
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.zero.stage3 import ShardStore, is_zero_param, partition_param

_active: list[Init] = []  # innermost last; the classes are patched while it is non-empty
_building: dict[int, int] = {}  # id(module) -> nesting depth of its __init__ calls
_patched: dict[type, Any] = {}  # class -> its original __init__
_orig_init_subclass: Any = None

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what DeepSpeed's Init accepts


class Init:
    """Partition parameters at construction: DeepSpeed's ``deepspeed.zero.Init``, with its
    signature.

    ``with Init(): model = Net()`` builds ``model`` partitioned; ``Init(module=model)``
    partitions a built one at once. Either way data-parallel rank 0's values are broadcast
    first, so every rank holds chunks of rank 0's model (DeepSpeed does the same).

    Args:
        module: an already built module to partition now (instead of using the context).
        data_parallel_group: a :class:`~zerotron.distributed.comm.Group` or a torch process
            group; default ``zerotron.distributed.state().dp`` (initializing the process group
            from the launcher's environment first if nothing did, as DeepSpeed does).
        mem_efficient_linear: accepted; stage 3 always keeps saved views of weights as
            references to the parameter (see :mod:`zerotron.zero.stage3`), which is what it
            asks for, for every op.
        remote_device: ``"cpu"`` or ``"nvme"`` keeps the shards in a
            :class:`~zerotron.zero.offload.ParamOffloadStore` (``offload_param``); ``None`` or
            ``"none"``: on the parameters' device. A config's ``offload_param`` decides when
            given (as in DeepSpeed); a different ``remote_device`` is an error.
        pin_memory: pin the host copies (``remote_device="cpu"``, with CUDA only).
        config_dict_or_path: a DeepSpeed config (dict or JSON file). Read from it:
            ``zero_optimization.stage3_param_persistence_threshold`` and ``offload_param``, and
            unless ``dtype`` is given the parameters' dtype (bf16, fp16, else fp32, as
            DeepSpeed). ``"auto"`` values count as unset.
        config: DeepSpeed's deprecated name for ``config_dict_or_path``.
        enabled: False makes the context do nothing.
        dtype: cast floating parameters to this dtype (fp32, fp16 or bf16) before partitioning.
            Without it and without a config they keep their dtype (DeepSpeed would pick fp16).
        mpu: accepted (DeepSpeed only reads its config through it); the default group is
            already zerotron's data-parallel group.
        zero_param_parallel_group: must be None: hierarchical partitioning (ZeRO++ hpZ) is not
            implemented.
        zero_quantized_weights: must be False: quantized weights (ZeRO++) are not implemented.
        zero_quantized_nontrainable_weights: must be False, likewise.
        sequence_data_parallel_group: DeepSpeed's deprecated name for ``data_parallel_group``.
        param_swapper: a ready :class:`~zerotron.zero.offload.ParamOffloadStore` to keep the
            shards in (zerotron's counterpart of DeepSpeed's parameter swapper; overrides
            ``remote_device``).
        tensor_overrides: accepted: zerotron does not redirect tensor creation inside the
            block; ``dtype`` casts each parameter when it is partitioned.
        persistence_threshold: zerotron's: parameters of at most this many elements stay whole
            (default: the config's, else 1e5, DeepSpeed's).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Mapping[str, Any] | str | Path | None = None,
        config: Mapping[str, Any] | str | Path | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: ShardStore | None = None,
        tensor_overrides: Any = None,
        *,
        persistence_threshold: int | None = None,
    ):
        if config is not None:
            if config_dict_or_path is not None:
                raise ConfigError(
                    "both config and config_dict_or_path were given",
                    where="zero.Init",
                    fix="pass config_dict_or_path only (config is its deprecated name)",
                )
            warnings.warn(
                "zero.Init(config=...) is deprecated: use config_dict_or_path", stacklevel=2
            )
            config_dict_or_path = config
        if sequence_data_parallel_group is not None:
            if data_parallel_group is not None:
                raise ConfigError(
                    "both data_parallel_group and sequence_data_parallel_group were given",
                    where="zero.Init",
                    fix="pass data_parallel_group only",
                )
            data_parallel_group = sequence_data_parallel_group
        cfg = _read_config(config_dict_or_path)
        zero = _zero_section(cfg)
        _refuse_unsupported(
            zero, zero_param_parallel_group, zero_quantized_weights,
            zero_quantized_nontrainable_weights, param_swapper,
        )  # fmt: skip
        self.enabled = enabled
        self.dtype = dtype if dtype is not None else _config_dtype(cfg)
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ConfigError(
                f"dtype {self.dtype} is not a training dtype",
                where="zero.Init(dtype=)",
                fix="use torch.float32, torch.float16 or torch.bfloat16",
            )
        self.mem_efficient_linear = mem_efficient_linear
        if persistence_threshold is None:
            persistence_threshold = _threshold(zero)
        self.persistence_threshold = persistence_threshold
        self.group = _as_group(data_parallel_group) if enabled else None
        self.param_store = param_swapper
        if enabled and param_swapper is None:
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
            if is_zero_param(p):
                continue
            if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            self._count += 1
            partition_param(  # broadcasts rank 0's values first
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
        from zerotron.distributed.init import init_distributed, is_initialized
        from zerotron.distributed.state import state

        if not is_initialized():  # DeepSpeed's Init starts deepspeed.comm the same way
            init_distributed()
        return state().dp
    if isinstance(group, Group):
        return group
    from zerotron.distributed.state import group_of

    return dataclasses.replace(group_of(group), name="dp")  # the ledger's name for it


def _read_config(config: Mapping[str, Any] | str | Path | None) -> Mapping[str, Any]:
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
        if not isinstance(config, Mapping):
            raise ConfigError("a DeepSpeed config must be a JSON object", where=str(path))
    return config


def _zero_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError("must be a mapping", where="zero_optimization")
    return zero


def _threshold(zero: Mapping[str, Any]) -> int:
    value = zero.get("stage3_param_persistence_threshold", "auto")
    if value in ("auto", None):  # unset: DeepSpeed's default
        return int(1e5)
    try:
        threshold = int(float(value))
    except (TypeError, ValueError):
        threshold = -1
    if threshold < 0:
        raise ConfigError(
            f"must be a count of elements, not {value!r}",
            where="zero_optimization.stage3_param_persistence_threshold",
        )
    return threshold


def _enabled(config: Mapping[str, Any], *keys: str) -> bool:
    for key in keys:
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return True
    return False


def _config_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The parameters' dtype a DeepSpeed config implies (None without a config)."""
    if not config:
        return None
    bf16, fp16 = _enabled(config, "bf16", "bfloat16"), _enabled(config, "fp16")
    if bf16 and fp16:
        raise ConfigError("bf16 and fp16 cannot both be enabled", where="bf16.enabled")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def _refuse_unsupported(
    zero: Mapping[str, Any],
    param_group: Any,
    quantized: bool,
    quantized_nontrainable: bool,
    param_swapper: Any,
) -> None:
    if param_group is not None or zero.get("zero_hpz_partition_size", 1) not in (1, None):
        raise UnsupportedError(
            "hierarchical partitioning (ZeRO++ hpZ) is not implemented",
            where="zero.Init(zero_param_parallel_group=)",
            fix="leave zero_param_parallel_group None and zero_hpz_partition_size 1",
        )
    for name, arg in (
        ("zero_quantized_weights", quantized),
        ("zero_quantized_nontrainable_weights", quantized_nontrainable),
    ):
        if arg or zero.get(name):
            raise UnsupportedError(
                "quantized weights (ZeRO++) are not implemented",
                where=f"zero.Init({name}=)",
                fix=f"leave {name} False",
            )
    if param_swapper is not None and not all(
        hasattr(param_swapper, a) for a in ("put", "get", "device")
    ):
        raise UnsupportedError(
            f"param_swapper must be a zerotron.zero.offload.ParamOffloadStore, got "
            f"{type(param_swapper).__name__}",
            where="zero.Init(param_swapper=)",
            fix="pass remote_device='nvme' (or a config's offload_param) instead",
        )


def _make_store(
    section: Mapping[str, Any] | None, remote_device: str | None, pin_memory: bool
) -> ShardStore | None:
    from zerotron.zero.offload import ParamOffloadStore
    from zerotron.zero.options import OffloadOptions

    where = "zero_optimization.offload_param"
    if remote_device not in (None, "none", "cpu", "nvme"):
        raise ConfigError(
            f"remote_device must be None, 'none', 'cpu' or 'nvme', not {remote_device!r}",
            where="zero.Init(remote_device=)",
            fix="leave it None to keep the shards on the parameters' device",
        )
    if section is not None:
        opts = OffloadOptions.from_dict(section, where)
        if remote_device not in (None, opts.device):
            raise ConfigError(
                f"remote_device={remote_device!r} but the config's offload_param.device is "
                f"{opts.device!r}",
                where="zero.Init(remote_device=)",
                fix="leave remote_device None (the config decides) or make them agree",
            )
    else:
        opts = OffloadOptions()
        if remote_device is not None:
            opts = dataclasses.replace(opts, device=remote_device)
        if pin_memory:
            opts = dataclasses.replace(opts, pin_memory=True)
    if opts.device == "none":
        return None
    return ParamOffloadStore(opts, where=where)
