"""Activation recompute: a checkpointed call keeps only its *inputs* and reruns in backward.

::

    from zerotron.parallel.recompute import checkpoint
    y = checkpoint(block, x, mask)                # instead of y = block(x, mask)

This is the machinery; DeepSpeed's ``deepspeed.checkpointing`` API over it (``configure`` from a
DeepSpeed JSON or an mpu object, Megatron's seeding) is :mod:`zerotron.compat.checkpointing`,
importable as ``zerotron.checkpointing``.

How :func:`checkpoint` works (DeepSpeed's ``CheckpointFunction``, one autograd Function):

- **forward**: snapshot the random state (torch's CPU generator, the CUDA generator when CUDA is
  in use, and every stream of the tensor-parallel RNG tracker,
  :mod:`zerotron.distributed.rng`); run ``function`` under ``no_grad``; keep the inputs.
- **backward**: put the snapshot back, run ``function`` again with gradients on, backpropagate
  the output gradients through that second graph, put the backward's own random state back. The
  second pass draws the same dropout masks as the first, so gradients equal an ordinary run's
  bit for bit.

What is kept of the inputs, by :class:`CheckpointingConfig` (set with :func:`set_config`):

- ``partition_activations``: each floating tensor input is split across the tensor-parallel
  group (its flattened values, padded to a multiple of the group size); a rank keeps its
  1/tp piece and backward all-gathers the pieces first. The inputs must be equal on every TP
  rank (the replicated residual stream of a Megatron layer), as DeepSpeed assumes. The group is
  zerotron's (:func:`zerotron.distributed.state`) unless a :class:`TensorParallelSource` says
  otherwise.
- ``checkpoint_in_cpu``: the kept tensors are copies in host memory; backward moves them back
  to the device each input came from.
- ``contiguous_checkpointing`` (needs ``partition_activations`` and ``num_checkpoints``): the
  pieces of one call live in one flat buffer (one allocation, no fragmentation); at most
  ``num_checkpoints`` such buffers may be alive at once (one per checkpointed layer of a
  forward), more is an error naming the setting.
- ``synchronize``: the device is synchronized at the start and end of each checkpointed forward
  and backward (DeepSpeed's meaning: a device sync, not a collective; a collective would hang
  pipeline stages that checkpoint different layer counts).
- ``profile``: wall-clock time of forwards, recomputes and backwards, see :func:`timings`.

Non-tensor arguments, and tensors that do not require grad, pass through (they get no
gradient). ``function`` may return a tensor or a tuple (of tensors and other objects); integer
outputs are non-differentiable. Autocast state at the forward is re-entered for the recompute.

Megatron's selective recompute (``--recompute-granularity selective``) is not this module: the
GPT itself checkpoints only its attention core (see ``docs/activation-checkpointing.md``).

The configuration is module state, as in DeepSpeed, whose API is functions on a module: one
:class:`CheckpointingConfig` and tensor-parallel source set by :func:`set_config`, and the live
contiguous buffers and timings that :func:`reset` clears.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.rng import get_rng_tracker
from zerotron.distributed.state import state
from zerotron.errors import ConfigError

# The configuration section's name, for error messages that point at the setting to change.
SECTION = "activation_checkpointing"


@dataclass(frozen=True)
class CheckpointingConfig:
    """How :func:`checkpoint` keeps its inputs (DeepSpeed's defaults: everything off)."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


@dataclass(frozen=True)
class TensorParallelSource:
    """Where partitioned activations find the tensor-parallel group and this rank in it.

    Both are called when needed (not at :func:`set_config`), so the groups may be built later.
    """

    group: Callable[[], Group]
    rank: Callable[[], int]


PARALLEL_STATE = TensorParallelSource(group=lambda: state().tp, rank=lambda: state().tp_rank)


class _Module:
    """The module's state: configuration, tensor-parallel source, live buffers, timings."""

    def __init__(self) -> None:
        self.config = CheckpointingConfig()
        self.configured = False
        self.tp = PARALLEL_STATE
        self.buffers: list[weakref.ref[torch.Tensor]] = []
        self.timings: dict[str, list[float]] = {}
        self.recomputing = 0  # checkpointed functions being rerun in backward right now


_M = _Module()


def recomputing() -> bool:
    """Whether a checkpointed function is being rerun in backward now: what autograd saves
    meanwhile is the recompute's workspace, not the forward's activations (what
    :mod:`zerotron.engine.memory_breakdown` measures)."""
    return _M.recomputing > 0


# ---- configuration ----------------------------------------------------------------------------


def set_config(cfg: CheckpointingConfig, tp: TensorParallelSource | None = None) -> None:
    """Replace the configuration and the tensor-parallel source (None: zerotron's
    :class:`~zerotron.distributed.state.ParallelState`); forget buffers and timings."""
    _M.config, _M.tp, _M.configured = cfg, tp or PARALLEL_STATE, True
    reset()


def update_config(**changes: Any) -> None:
    """Change some fields of the configuration in effect, keeping the rest (and the buffers)."""
    _M.config = replace(_M.config, **changes)


def is_configured() -> bool:
    """Whether :func:`set_config` has been called since the last ``reset(configuration=True)``."""
    return _M.configured


def config() -> CheckpointingConfig:
    """The configuration in effect (defaults until :func:`set_config`)."""
    return _M.config


def reset(*, configuration: bool = False) -> None:
    """Forget the contiguous buffers and the timings (DeepSpeed's ``reset``: call it after
    forwards that had no backward, e.g. evaluation with gradients on).

    ``configuration=True`` also returns to the unconfigured defaults.
    """
    _M.buffers.clear()
    _M.timings.clear()
    if configuration:
        _M.config, _M.tp, _M.configured = CheckpointingConfig(), PARALLEL_STATE, False


def tp_rank() -> int:
    """This rank's index in the tensor-parallel group the configuration partitions over."""
    return _M.tp.rank()


def _tp_group() -> Group:
    return _M.tp.group()


# ---- random state ------------------------------------------------------------------------------


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
                _M.recomputing += 1
                try:
                    with torch.enable_grad(), contextlib.ExitStack() as stack:
                        ctx.autocast.enter(stack)
                        outputs = ctx.function(*detached)
                finally:
                    _M.recomputing -= 1
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
