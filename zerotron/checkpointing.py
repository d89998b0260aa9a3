"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``) on zerotron's pieces.

A checkpointed call keeps only its *inputs* for backward and runs the function again there::

    import zerotron.checkpointing as checkpointing

    checkpointing.configure(mpu, deepspeed_config="ds.json")   # optional
    checkpointing.model_parallel_cuda_manual_seed(1234)
    y = checkpointing.checkpoint(block, x, mask)                # instead of y = block(x, mask)

How :func:`checkpoint` works (DeepSpeed's ``CheckpointFunction``, one autograd Function):

- **forward**: snapshot the random state (torch's CPU generator, the CUDA generator when CUDA is
  in use, and every stream of the tensor-parallel RNG tracker,
  :mod:`zerotron.distributed.rng`); run ``function`` under ``no_grad``; keep the inputs.
- **backward**: put the snapshot back, run ``function`` again with gradients on, backpropagate
  the output gradients through that second graph, put the backward's own random state back. The
  second pass draws the same dropout masks as the first, so gradients equal an ordinary run's
  bit for bit.

What is kept of the inputs, by configuration (:func:`configure`):

- ``partition_activations``: each floating tensor input is split across the tensor-parallel
  group (its flattened values, padded to a multiple of the group size); a rank keeps its
  1/tp piece and backward all-gathers the pieces first. The inputs must be equal on every TP
  rank (the replicated residual stream of a Megatron layer), as DeepSpeed assumes.
- ``checkpoint_in_cpu`` (``cpu_checkpointing``): the kept tensors are copies in host memory;
  backward moves them back to the device each input came from.
- ``contiguous_checkpointing`` (``contiguous_memory_optimization``, needs
  ``partition_activations`` and ``num_checkpoints``): the pieces of one call live in one flat
  buffer (one allocation, no fragmentation); at most ``num_checkpoints`` such buffers may be alive
  at once (one per checkpointed layer of a forward), more is an error naming the setting.
- ``synchronize`` (``synchronize_checkpoint_boundary``): the device is synchronized at the start
  and end of each checkpointed forward and backward (DeepSpeed's meaning: a device sync, not a
  collective; a collective would hang pipeline stages that checkpoint different layer counts).
- ``profile``: wall-clock time of forwards, recomputes and backwards, see :func:`timings`.

Non-tensor arguments, and tensors that do not require grad, pass through (they get no
gradient). ``function`` may return a tensor or a tuple (of tensors and other objects); integer
outputs are non-differentiable. Autocast state at the forward is re-entered for the recompute.

Megatron's selective recompute (``--recompute-granularity selective``) is not this module: the
GPT itself checkpoints only its attention core (see ``docs/activation-checkpointing.md``).

The configuration is module state, as in DeepSpeed, whose API is functions on a module: one
:class:`CheckpointingConfig` set by :func:`configure`, and the live contiguous buffers and
timings that :func:`reset` clears.
"""

from __future__ import annotations

import contextlib
import numbers
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerotron.distributed import comm
from zerotron.distributed import mpu as zerotron_mpu
from zerotron.distributed.comm import Group
from zerotron.distributed.rng import (
    MODEL_PARALLEL_RNG,
    MODEL_PARALLEL_SEED_OFFSET,
    RNGStatesTracker,
    get_rng_tracker,
)
from zerotron.distributed.state import state
from zerotron.errors import ConfigError

SECTION = "activation_checkpointing"
# DeepSpeed JSON key -> configure() argument.
JSON_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


@dataclass(frozen=True)
class CheckpointingConfig:
    """What :func:`configure` set (DeepSpeed's defaults: everything off)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


class _Module:
    """The module's state: configuration, partition group source, live buffers, timings."""

    def __init__(self) -> None:
        self.config = CheckpointingConfig()
        self.configured = False
        self.mpu: Any = None
        self.buffers: list[weakref.ref[torch.Tensor]] = []
        self.timings: dict[str, list[float]] = {}


_M = _Module()


# ---- configuration ----------------------------------------------------------------------------


def configure(
    mpu_: Any,
    deepspeed_config: str | Path | Mapping[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> CheckpointingConfig:
    """Set how :func:`checkpoint` keeps its inputs (DeepSpeed's ``checkpointing.configure``).

    ``mpu_``: where the tensor-parallel group comes from: None or :mod:`zerotron.distributed.mpu`
    for zerotron's parallel state, or a Megatron/DeepSpeed-style mpu object
    (``get_tensor_model_parallel_group``, else ``get_model_parallel_group``).
    ``deepspeed_config``: a JSON file path or a dict; its ``"activation_checkpointing"``
    section gives the settings. Explicit arguments override it. Each call replaces the whole
    configuration. Returns it.
    """
    where_file = None
    values: dict[str, Any] = {}
    if deepspeed_config is not None:
        section, where_file = _read_section(deepspeed_config)
        for key, value in section.items():
            if key not in JSON_KEYS:
                warnings.warn(
                    f"{_where(where_file, key)}: unknown activation checkpointing key {key!r} "
                    f"ignored (known: {', '.join(JSON_KEYS)})",
                    stacklevel=2,
                )
                continue
            values[JSON_KEYS[key]] = _checked(JSON_KEYS[key], value, _where(where_file, key))
    explicit = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    for name, value in explicit.items():
        if value is not None:
            values[name] = _checked(name, value, f"configure({name}=...)")
    cfg = replace(CheckpointingConfig(), **values)
    if cfg.contiguous_checkpointing and not cfg.partition_activations:
        raise ConfigError(
            "contiguous memory optimization needs partitioned activations",
            where=f"{SECTION}.contiguous_memory_optimization",
            fix="set partition_activations to true, or contiguous_memory_optimization to false",
        )
    if cfg.contiguous_checkpointing and cfg.num_checkpoints is None:
        raise ConfigError(
            "contiguous memory optimization needs the number of checkpoints",
            where=f"{SECTION}.number_checkpoints",
            fix="set number_checkpoints to the checkpointed layers of one forward",
        )
    _M.config, _M.mpu, _M.configured = cfg, mpu_, True
    reset()
    return cfg


def is_configured() -> bool:
    """Whether :func:`configure` has been called (DeepSpeed's ``is_configured``)."""
    return _M.configured


def config() -> CheckpointingConfig:
    """The configuration in effect (defaults until :func:`configure`)."""
    return _M.config


def reset(*, configuration: bool = False) -> None:
    """Forget the contiguous buffers and the timings (DeepSpeed's ``reset``: call it after
    forwards that had no backward, e.g. evaluation with gradients on).

    ``configuration=True`` also returns to the unconfigured defaults.
    """
    _M.buffers.clear()
    _M.timings.clear()
    if configuration:
        _M.config, _M.mpu, _M.configured = CheckpointingConfig(), None, False


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn ``partition_activations`` on or off, keeping the rest (DeepSpeed's helper)."""
    value = _checked("partition_activations", partition_activation, "partition_activations")
    _M.config = replace(_M.config, partition_activations=value)


def set_num_layers(nlayers: int) -> None:
    """Set ``num_checkpoints``, the bound on live contiguous buffers (DeepSpeed's helper)."""
    _M.config = replace(_M.config, num_checkpoints=_checked("num_checkpoints", nlayers, "nlayers"))


def _read_section(cfg: str | Path | Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    if isinstance(cfg, (str, Path)):
        from zerotron.config.files import read_config_file

        data, _ = read_config_file(cfg)
        source: str | None = str(cfg)
    elif isinstance(cfg, Mapping):
        data, source = cfg, None
    else:
        raise ConfigError(
            f"deepspeed_config must be a path or a dict, got {type(cfg).__name__}",
            where="checkpointing.configure",
        )
    section = data.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"must be an object, got {type(section).__name__} {section!r}",
            where=_where(source, None),
            fix='write "activation_checkpointing": {"partition_activations": true, ...}',
        )
    return section, source


def _where(source: str | None, key: str | None) -> str:
    path = SECTION if key is None else f"{SECTION}.{key}"
    return f"{source}: {path}" if source else path


def _checked(name: str, value: Any, where: str) -> Any:
    if name == "num_checkpoints":
        if value is None:
            return None
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (ok and float(value).is_integer() and value >= 1):
            raise ConfigError(
                f"must be a positive integer, got {value!r}",
                where=where,
                fix="give the number of checkpointed layers in one forward",
            )
        return int(value)
    if not isinstance(value, bool):
        raise ConfigError(
            f"must be true or false, got {type(value).__name__} {value!r}", where=where
        )
    return value


# ---- RNG ----------------------------------------------------------------------------------------


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The tensor-parallel RNG tracker (:func:`zerotron.distributed.rng.get_rng_tracker`)."""
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default stream gets ``seed`` (equal on all TP ranks), the
    tracker's model-parallel stream ``seed + 2718 + tp_rank``. Works without CUDA (the streams
    are then the CPU generator's)."""
    torch.manual_seed(seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + _tp_rank())


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass
class _RandomState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict[str, dict[str, torch.Tensor]]

    @classmethod
    def capture(cls) -> _RandomState:
        cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
        return cls(torch.get_rng_state(), cuda, get_rng_tracker().get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        get_rng_tracker().set_states(self.tracker)


# ---- the tensor-parallel group ----------------------------------------------------------------


def _tp_group() -> Group:
    mpu = _M.mpu
    if mpu is None or mpu is zerotron_mpu:
        return state().tp
    getter = _first_attr(
        mpu,
        "get_tensor_model_parallel_group",
        "get_slice_parallel_group",
        "get_model_parallel_group",
    )
    pg = getter()
    if not (dist.is_available() and dist.is_initialized()):
        return Group.single("tp", 0)
    ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else ()
    if not ranks:
        ranks = tuple(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    return Group("tp", ranks, me, pg) if len(ranks) > 1 else Group.single("tp", ranks[0])


def _tp_rank() -> int:
    mpu = _M.mpu
    if mpu is None or mpu is zerotron_mpu:
        return state().tp_rank
    return int(
        _first_attr(
            mpu,
            "get_tensor_model_parallel_rank",
            "get_slice_parallel_rank",
            "get_model_parallel_rank",
        )()
    )


def _first_attr(obj: Any, *names: str) -> Callable[[], Any]:
    for name in names:
        fn = getattr(obj, name, None)
        if fn is not None:
            return fn
    raise ConfigError(
        f"the mpu passed to checkpointing.configure has none of {', '.join(names)}",
        where="checkpointing.configure(mpu_)",
        fix="pass zerotron.distributed.mpu, a Megatron mpu, or None",
    )


# ---- profile and synchronize ------------------------------------------------------------------


def timings() -> dict[str, tuple[int, float]]:
    """With ``profile`` on: ``{"forward" | "recompute" | "backward": (calls, seconds)}``.

    ``backward`` includes its ``recompute``. Times are wall clock, the device synchronized
    around each measured span.
    """
    return {k: (int(v[0]), v[1]) for k, v in _M.timings.items()}


@contextlib.contextmanager
def _timed(name: str, cfg: CheckpointingConfig) -> Iterator[None]:
    if not cfg.profile:
        yield
        return
    _device_sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        _device_sync()
        entry = _M.timings.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - start


def _device_sync() -> None:
    if _cuda_in_use():
        torch.cuda.synchronize()


# ---- keeping the inputs -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Kept:
    """How one tensor input was kept: ``slot`` indexes ``ctx.saved_tensors``."""

    slot: int
    how: str  # "whole" | "cpu" | "partition"
    shape: torch.Size
    device: torch.device
    numel: int = 0  # partition: the unpadded element count
    offset: int = 0  # partition in a contiguous buffer: where this input's piece starts
    length: int = 0  # partition: the piece's element count


def _keep_inputs(ctx: Any, args: tuple[Any, ...], cfg: CheckpointingConfig) -> None:
    """Save what backward needs of ``args`` on ``ctx`` (see the module docstring)."""
    partition = cfg.partition_activations
    group = _tp_group() if partition else None
    size = group.size if group is not None else 1
    ctx.plan = []  # per argument: a _Kept, or the non-tensor argument itself
    saved: list[torch.Tensor] = []
    pieces: list[tuple[int, torch.Tensor]] = []  # (plan index, piece) for a contiguous buffer
    for arg in args:
        if not isinstance(arg, torch.Tensor):
            ctx.plan.append(arg)
            continue
        t = arg.detach()
        if partition and t.is_floating_point() and t.numel() >= size:
            piece = _my_piece(t, group)
            if cfg.checkpoint_in_cpu:
                piece = piece.to("cpu")
            kept = _Kept(len(saved), "partition", t.shape, t.device, t.numel(), 0, piece.numel())
            if cfg.contiguous_checkpointing:
                pieces.append((len(ctx.plan), piece))
            else:
                saved.append(piece)
            ctx.plan.append(kept)
        elif cfg.checkpoint_in_cpu:
            ctx.plan.append(_Kept(len(saved), "cpu", t.shape, t.device))
            saved.append(t.to("cpu", copy=True))
        else:
            ctx.plan.append(_Kept(len(saved), "whole", t.shape, t.device))
            saved.append(arg)
    if pieces:
        buffer = _contiguous_buffer(pieces, cfg)
        offset = 0
        for index, piece in pieces:
            ctx.plan[index] = replace(ctx.plan[index], slot=len(saved), offset=offset)
            offset += piece.numel()
        saved.append(buffer)
    ctx.save_for_backward(*saved)


def _my_piece(t: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's 1/size of ``t``'s flattened values (padded with zeros), a copy."""
    size = group.size
    flat = t.reshape(-1)
    per_rank = -(-flat.numel() // size)
    start = group.rank * per_rank
    piece = flat[start : start + per_rank]
    if piece.numel() < per_rank:
        piece = torch.cat([piece, piece.new_zeros(per_rank - piece.numel())])
    return piece.clone()  # a view would keep the whole input alive


def _contiguous_buffer(
    pieces: list[tuple[int, torch.Tensor]], cfg: CheckpointingConfig
) -> torch.Tensor:
    _M.buffers = [r for r in _M.buffers if r() is not None]
    if cfg.num_checkpoints is not None and len(_M.buffers) >= cfg.num_checkpoints:
        raise ConfigError(
            f"more than {cfg.num_checkpoints} checkpointed calls hold activations at once",
            where=f"{SECTION}.number_checkpoints",
            fix="raise number_checkpoints to the checkpointed layers of one forward, or call "
            "checkpointing.reset() after forwards without a backward",
        )
    first = pieces[0][1]
    dtypes = {p.dtype for _, p in pieces}
    dtype = first.dtype if len(dtypes) == 1 else torch.float32
    buffer = torch.cat([p.to(dtype) for _, p in pieces])
    _M.buffers.append(weakref.ref(buffer))
    return buffer


def _restore_inputs(ctx: Any, dtypes: list[torch.dtype | None]) -> list[Any]:
    saved = ctx.saved_tensors
    group = None
    out = []
    for item, dtype in zip(ctx.plan, dtypes):
        if not isinstance(item, _Kept):
            out.append(item)
            continue
        t = saved[item.slot]
        if item.how == "partition":
            if group is None:
                group = _tp_group()
            piece = t[item.offset : item.offset + item.length].to(item.device, dtype)
            full = comm.all_gather(piece, group)[: item.numel]
            t = full.view(item.shape)
        elif item.how == "cpu":
            t = t.to(item.device)
        out.append(t)
    return out


def active_partitioned_buffers() -> int:
    """Contiguous buffers of checkpointed calls still awaiting their backward."""
    _M.buffers = [r for r in _M.buffers if r() is not None]
    return len(_M.buffers)


# ---- the autograd Function --------------------------------------------------------------------


@dataclass(frozen=True)
class _Autocast:
    states: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls) -> _Autocast:
        types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        return cls(
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in types)
        )

    def enter(self, stack: contextlib.ExitStack) -> None:
        for device, enabled, dtype in self.states:
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))


class CheckpointFunction(torch.autograd.Function):
    """Runs ``function`` without keeping its graph; reruns it in backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], *args: Any) -> Any:
        cfg = _M.config
        ctx.function = function
        ctx.cfg = cfg
        ctx.dtypes = [a.dtype if isinstance(a, torch.Tensor) else None for a in args]
        if cfg.synchronize:
            _device_sync()
        with _timed("forward", cfg):
            ctx.random = _RandomState.capture()
            ctx.autocast = _Autocast.capture()
            with torch.no_grad():
                outputs = function(*args)
            _keep_inputs(ctx, args, cfg)
        if cfg.synchronize:
            _device_sync()
        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        ints = [o for o in flat if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        if ints:
            ctx.mark_non_differentiable(*ints)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise ConfigError(
                "checkpointed activations support .backward() only, not torch.autograd.grad()",
                where="zerotron.checkpointing.checkpoint",
                fix="call loss.backward(), or use torch.utils.checkpoint(use_reentrant=False)",
            )
        cfg = ctx.cfg
        if cfg.synchronize:
            _device_sync()
        with _timed("backward", cfg):
            inputs = _restore_inputs(ctx, ctx.dtypes)
            detached = []
            for i, x in enumerate(inputs):
                if isinstance(x, torch.Tensor):
                    x = x.detach().requires_grad_(ctx.needs_input_grad[i + 1])
                detached.append(x)
            with _timed("recompute", cfg):
                now = _RandomState.capture()
                ctx.random.restore()
                try:
                    with torch.enable_grad(), contextlib.ExitStack() as stack:
                        ctx.autocast.enter(stack)
                        outputs = ctx.function(*detached)
                finally:
                    now.restore()
            flat = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [
                (o, g)
                for o, g in zip(flat, grads)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if cfg.synchronize:
            _device_sync()
        input_grads = tuple(x.grad if isinstance(x, torch.Tensor) else None for x in detached)
        return (None, *input_grads)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, keeping only ``args`` for backward, which reruns it (see the module
    docstring). DeepSpeed's ``deepspeed.checkpointing.checkpoint``.

    As in DeepSpeed (and torch's reentrant checkpoint), the output requires grad only if some
    tensor input does: parameters used inside get no gradient otherwise, which is warned about.
    """
    if torch.is_grad_enabled() and not any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        warnings.warn(
            "checkpoint(): no tensor input requires grad, so the parameters used inside get no "
            "gradient; make the first input require grad (x.requires_grad_())",
            stacklevel=2,
        )
    return CheckpointFunction.apply(function, *args)


def saved_bytes(output: torch.Tensor) -> int:
    """Bytes a checkpointed call's ``output`` keeps for backward (its kept inputs)."""
    node = output.grad_fn
    if not isinstance(node, CheckpointFunction._backward_cls):
        return 0
    try:
        kept = node.saved_tensors
    except RuntimeError:  # backward already ran and freed them
        return 0
    return sum(t.numel() * t.element_size() for t in kept)


__all__ = [
    "CheckpointFunction",
    "CheckpointingConfig",
    "active_partitioned_buffers",
    "checkpoint",
    "config",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "partition_activations_in_checkpoint",
    "reset",
    "saved_bytes",
    "set_num_layers",
    "timings",
]
