"""DeepSpeed's checkpoints and an Engine: load one DeepSpeed saved, and make the Engine's ZeRO
saves readable by DeepSpeed's ``zero_to_fp32``.

The file formats are :mod:`zerotron.checkpoint.deepspeed_format`'s (and
:mod:`zerotron.checkpoint.deepspeed_universal`'s for universal checkpoints); this module moves
their contents into and out of an Engine (its module, ZeRO optimizer, scheduler and counters).
:func:`deepspeed_tag_dir` tells ``Engine.load_checkpoint`` that a directory holds a DeepSpeed
checkpoint; :func:`load_deepspeed_checkpoint` then loads it in place of zerotron's own reader.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from zerotron.checkpoint.deepspeed_format import (
    deepspeed_tag,
    is_deepspeed_tag,
    read_deepspeed_checkpoint,
    zero_state_from_full,
)
from zerotron.checkpoint.deepspeed_universal import (
    UNIVERSAL_TRACKER,
    is_universal_tag,
    read_universal_checkpoint,
    universal_tag,
)
from zerotron.checkpoint.deepspeed_view import deepspeed_view
from zerotron.checkpoint.layout import zero_file
from zerotron.checkpoint.state import refuse_non_finite
from zerotron.distributed.state import ParallelState
from zerotron.engine import run_metrics
from zerotron.errors import CheckpointError

if TYPE_CHECKING:
    from zerotron.engine.core import Engine


def deepspeed_tag_dir(load_dir: str | Path, tag: str | None, universal: bool) -> Path | None:
    """The tag directory to load when it holds a checkpoint DeepSpeed wrote, else None.

    ``universal`` (the config's ``checkpoint.load_universal``), as in DeepSpeed: the tag comes
    from ``latest_universal`` and must hold a universal checkpoint. Without it a universal tag
    is refused, where DeepSpeed would load its weights and silently drop the optimizer state.
    """
    if universal:
        return _universal_tag_dir(load_dir, tag)
    tag = deepspeed_tag(load_dir, tag)
    if tag is None:
        return None
    tag_dir = Path(load_dir) / tag
    if is_universal_tag(tag_dir):
        raise CheckpointError(
            "this is a DeepSpeed universal checkpoint (ds_to_universal.py's output) and "
            "checkpoint.load_universal is not set",
            where=str(tag_dir),
            fix='set "checkpoint": {"load_universal": true} in the DeepSpeed config, as '
            "DeepSpeed needs too",
        )
    return tag_dir if is_deepspeed_tag(tag_dir) else None


def _universal_tag_dir(load_dir: str | Path, tag: str | None) -> Path:
    found = universal_tag(load_dir, tag)
    if found is None:
        raise CheckpointError(
            f"no {UNIVERSAL_TRACKER!r} file: with checkpoint.load_universal the tag comes from it",
            where=str(load_dir),
            fix="convert a checkpoint with DeepSpeed's ds_to_universal.py (it writes the file) "
            "or pass the universal tag; to load the checkpoint 'latest' names, remove "
            "load_universal from the config",
        )
    tag_dir = Path(load_dir) / found
    if not is_universal_tag(tag_dir):
        raise CheckpointError(
            "checkpoint.load_universal is set, but this is no universal checkpoint "
            "(no zero/optimizer_state.pt)",
            where=str(tag_dir),
            fix="pass the tag ds_to_universal.py wrote (its --output_folder), or remove "
            "load_universal from the config to load this checkpoint as it is",
        )
    return tag_dir


def load_deepspeed_checkpoint(
    engine: Engine,
    tag_dir: Path,
    *,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    strict: bool,
    custom_load_fn: Callable[..., None] | None,
) -> tuple[str, dict[str, Any]]:
    """Load the DeepSpeed checkpoint in ``tag_dir`` into ``engine`` (see
    ``Engine.load_checkpoint``); returns ``(path, client_state)``.

    Weights, fp32 masters and Adam moments are put together from every rank's file (or, from a
    universal checkpoint, read whole) and cut for
    this engine, so its ZeRO stage (1-3) and data-parallel size may differ from DeepSpeed's;
    the scheduler's position, the step counters and (fp16 into fp16) the loss scale and its
    counters follow. DeepSpeed saves no RNG state.
    """
    from zerotron.engine.checkpoint_io import clear_modified, fit_weights, reload_masters

    where = str(tag_dir)
    want_optimizer = load_optimizer_states and not load_module_only
    read = read_universal_checkpoint if is_universal_tag(tag_dir) else read_deepspeed_checkpoint
    ckpt = read(tag_dir, optimizer=want_optimizer)
    part = engine.optimizer_part
    refuse_non_finite(ckpt.module, where, "model")
    fit_weights(engine, ckpt.module, {}, where, strict, custom_load_fn)
    if load_module_only:
        reload_masters(engine)
        run_metrics.loaded(engine, where)
        return where, {}
    if want_optimizer and ckpt.masters:
        if part.zero_stage == 0:
            raise CheckpointError(
                f"the checkpoint holds DeepSpeed ZeRO stage {ckpt.zero_stage} optimizer states; "
                "this engine runs without ZeRO",
                where=where,
                fix='set "zero_optimization": {"stage": 1} (or 2, 3) in the config, or load the '
                "weights alone (load_optimizer_states=False)",
            )
        lrs = {g.get("lr") for g in ckpt.param_groups}
        state = zero_state_from_full(
            part.optimizer.state_dict(),
            ckpt.masters,
            ckpt.moments,
            ckpt.scalars,
            lrs.pop() if len(lrs) == 1 else None,
            where,
        )
        refuse_non_finite(state, where, "optimizer")
        part.load_optimizer_state(state, engine.module, [], lambda s: None, where)
        clear_modified(engine.module)  # the masters came from the file, not from the weights
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if scaler is not None and ckpt.loss_scaler is not None:  # fp16 into fp16
            scaler.load_state_dict(ckpt.loss_scaler)
    elif want_optimizer and ckpt.model_states.get("optimizer") is not None:
        raise CheckpointError(
            "the checkpoint holds a DeepSpeed optimizer state without ZeRO (stage 0), which "
            "zerotron does not read",
            where=where,
            fix="load the weights alone (load_optimizer_states=False)",
        )
    else:
        reload_masters(engine)
    scheduler_state = ckpt.model_states.get("lr_scheduler")
    if load_lr_scheduler_states and engine.lr_scheduler is not None and scheduler_state:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    engine.global_steps = int(ckpt.model_states.get("global_steps", 0) or 0)
    engine.global_samples = int(ckpt.model_states.get("global_samples", 0) or 0)
    run_metrics.loaded(engine, where)
    return where, ckpt.client_state


_warned_frozen_stage3 = False


def add_deepspeed_view(engine: Engine, files: dict[str, Any], ps: ParallelState) -> None:
    """Make this rank's part of a ZeRO save readable by DeepSpeed's ``zero_to_fp32``
    (:func:`~zerotron.checkpoint.deepspeed_view.deepspeed_view`): one model-parallel rank
    and an optimizer state saved, else nothing is added."""
    global _warned_frozen_stage3
    part = engine.optimizer_part
    zero = files.get(zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank))
    if part.zero_stage == 0 or ps.tp_size * ps.pp_size != 1 or zero is None:
        return
    module = engine.module
    frozen = {
        name: p.detach().cpu() for name, p in module.named_parameters() if not p.requires_grad
    }
    from zerotron.engine.checkpoint_io import shared_params

    extra = deepspeed_view(
        zero,
        dp_rank=ps.dp_rank,
        buffers=persistent_buffers(module),
        shared_params=shared_params(module),
        frozen=frozen,
    )
    if extra is None:
        if not _warned_frozen_stage3 and ps.rank == 0:
            warnings.warn(
                "ZeRO stage 3 with frozen parameters: the checkpoint has no files for "
                "DeepSpeed's zero_to_fp32 (zerotron zero-to-fp32 reads it)",
                stacklevel=3,
            )
            _warned_frozen_stage3 = True
        return
    files.update(extra)


def persistent_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The module's buffers that its state dict holds, by state-dict name, on the CPU."""
    out = {}
    for prefix, sub in module.named_modules():
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out[f"{prefix}.{name}" if prefix else name] = buf.detach().cpu()
    return out
