"""An Engine's checkpoints: what it writes into the one layout, and how it reads them back.

Files (names in :mod:`zerotron.checkpoint.layout`): one model file per model-parallel rank,
written by data-parallel rank 0 (weights, scheduler, RNG, counters and, with a whole optimizer
state, the optimizer); under ZeRO one partition file per rank (``ZeroOptimizer.state_dict()``),
which ``zerotron zero-to-fp32`` consolidates offline, and under stage 3 with
``gather_16bit_weights_on_model_save`` also ``pytorch_model.bin`` (the consolidated 16-bit state
dict of this model-parallel rank; ``pytorch_model_mp_rank_XX_YYY.bin`` when there are several).
What goes where is the optimizer part's to say (:mod:`zerotron.engine.optimizers`); fitting the
loaded weights to the model is the fitter's (:mod:`zerotron.checkpoint.fit`); a checkpoint of
another layout is converted for this rank by :mod:`zerotron.engine.relayout`, and its files are
read through a :class:`~zerotron.checkpoint.relayout.CheckpointFiles`.

The functions take the Engine whose state they save or load; every rank calls them.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zerotron.checkpoint import (
    get_rng_state,
    model_file,
    read_latest_tag,
    read_metadata,
    resolve_tag,
    save_checkpoint,
    set_rng_state,
)
from zerotron.checkpoint.canonical import ENGINE_ENTRIES
from zerotron.checkpoint.in_memory import InMemoryCheckpoint
from zerotron.checkpoint.layout import (
    CHECKPOINT_VERSION,
    DP_SIZE_KEY,
    GATHERED_16BIT_FILE,
    RNG_TRACKER_KEY,
    ZERO_STAGE_KEY,
    zero_file,
)
from zerotron.checkpoint.layout import tag_dir as layout_tag_dir
from zerotron.checkpoint.relayout import CheckpointFiles
from zerotron.checkpoint.reshard import checkpoint_layout, load_shared_entries
from zerotron.checkpoint.state import refuse_non_finite
from zerotron.checkpoint.zero_repartition import repartition_zero_state
from zerotron.checkpoint.zero_to_fp32 import BUFFER_NAMES_KEY, SHARED_PARAMS_KEY
from zerotron.distributed import comm
from zerotron.distributed.rng import get_rng_tracker
from zerotron.distributed.state import ParallelState, state
from zerotron.engine import deepspeed_checkpoint, relayout, run_metrics
from zerotron.errors import CheckpointError, ConfigError
from zerotron.fileio import atomic_open

if TYPE_CHECKING:
    from zerotron.engine.core import Engine


# ---- save ----------------------------------------------------------------------------------


def save_engine_checkpoint(
    engine: Engine,
    save_dir: str | Path,
    tag: str,
    client_state: Mapping[str, Any] | None,
    save_latest: bool,
    save_optimizer: bool,
    save_rng: bool,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write ``<save_dir>/<tag>/`` (see the module docstring); see ``Engine.save_checkpoint``."""
    ps = state()
    validate_tag(tag, ps, engine.checkpoint_tag_validation, engine.device)
    part = engine.optimizer_part
    module_state = part.module_state_dict(engine.module, rank0_only=True)  # may be collective
    if module_state is not None and exclude_frozen_parameters:
        module_state = without_frozen(engine.module, module_state)
    saved: dict[str, Any] = dict(client_state or {})
    saved.update(
        model=module_state,
        checkpoint_version=CHECKPOINT_VERSION,
        global_steps=engine.global_steps,
        global_samples=engine.global_samples,
    )
    # zero-to-fp32 tells buffers from frozen parameters by these (exclude_frozen_parameters)
    saved[BUFFER_NAMES_KEY] = [name for name, _ in engine.module.named_buffers()]
    shared = shared_params(engine.module)
    if shared:
        saved[SHARED_PARAMS_KEY] = shared
    files: dict[str, Any] = {}
    saved.update(part.checkpoint_entries())
    if save_optimizer:
        part.save_optimizer_state(saved, files, ps)
        if engine.lr_scheduler is not None:
            saved["opt_param_scheduler"] = engine.lr_scheduler.state_dict()
    if save_rng:
        tracker = get_rng_tracker().get_states()
        saved["rng_state"] = [get_rng_state({RNG_TRACKER_KEY: tracker} if tracker else None)]
    # One model file per model-parallel rank, from its data-parallel rank 0 (the replicas
    # are equal); every rank takes part in the save's barriers.
    if ps.dp_rank == 0:
        files[_model_file(ps)] = saved
        files.update(part.extra_files(module_state, ps))
    deepspeed_checkpoint.add_deepspeed_view(engine, files, ps)  # for DeepSpeed's zero_to_fp32
    path = save_checkpoint(
        save_dir,
        tag,
        files,
        _metadata(engine, ps),
        save_latest=save_latest,
        is_writer=ps.rank == 0,
        barrier=comm.barrier if ps.world_size > 1 else None,
        any_rank=_any_rank(ps, engine.device) if ps.world_size > 1 else None,
        # --save-keep-last and --async-save (zerotron.checkpoint.retention / .async_save)
        keep_last=getattr(engine, "checkpoint_keep_last", None),
        writer=getattr(engine, "checkpoint_writer", None),
    )
    run_metrics.saved(engine, path)  # the metrics file's "checkpoint" record
    return path


def _any_rank(ps: ParallelState, device: torch.device) -> Callable[[bool], bool]:
    """Whether a flag holds on any rank (a collective): ranks stop a failed save together."""

    def any_rank(flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        return bool(comm.all_reduce(t, ps.world, op="max").item())

    return any_rank


def without_frozen(module: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without the parameters of ``module`` that do not require grad."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    return {k: v for k, v in weights.items() if k not in frozen}


def save_16bit_model(
    engine: Engine, save_dir: str | Path, save_filename: str, exclude_frozen: bool = False
) -> Path:
    """Write the module's (gathered) state dict to ``save_dir/save_filename`` on rank 0 of
    each model-parallel rank's data-parallel group (DeepSpeed's API; a collective)."""
    ps = state()
    module_state = engine.module_state_dict(True, exclude_frozen)
    path = Path(save_dir) / save_filename
    if ps.dp_rank == 0 and ps.mp.size > 1:
        path = path.with_name(f"{path.stem}_{_model_file(ps).split('/')[0]}{path.suffix}")
    if ps.dp_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path) as f:
            torch.save(module_state, f)
    if ps.world_size > 1:
        comm.barrier()
    return path


TAG_VALIDATION_MODES = ("Ignore", "Warn", "Fail")


def check_tag_validation(mode: str) -> None:
    """Refuse a ``checkpoint_tag_validation`` that is none of :data:`TAG_VALIDATION_MODES`."""
    if mode not in TAG_VALIDATION_MODES:
        raise ConfigError(
            f"checkpoint_tag_validation is {mode!r}",
            where="Engine",
            fix="use 'Ignore', 'Warn' or 'Fail'",
        )


def validate_tag(tag: str, ps: ParallelState, mode: str, device: torch.device) -> None:
    """Check that every rank saves under ``tag`` (``checkpoint_tag_validation`` ``mode``).

    All-gathers an 8-byte hash of the tag over the world; every rank sees the same result, so
    under ``Fail`` they all raise together and none is left waiting in the save's barriers.
    """
    if mode == "Ignore" or ps.world_size == 1:
        return
    digest = hashlib.sha256(tag.encode("utf-8")).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    hashes = comm.all_gather(mine.to(device), ps.world).cpu().tolist()
    if len(set(hashes)) == 1:
        return
    by_hash: dict[int, list[int]] = {}
    for i, h in enumerate(hashes):
        by_hash.setdefault(h, []).append(ps.world.global_rank(i))
    groups = sorted(by_hash.values())
    detail = "; ".join(f"ranks {ranks}" for ranks in groups)
    what = (
        f"ranks save under different checkpoint tags ({len(groups)} distinct tags: "
        f"{detail}); this rank's tag is {tag!r}"
    )
    fix = "pass the same tag on every rank (or none: the default is global_step<N>)"
    if mode == "Fail":
        raise CheckpointError(what, where="checkpoint.tag_validation", fix=fix)
    warnings.warn(f"checkpoint.tag_validation: {what} -> {fix}", stacklevel=4)


def shared_params(module: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for every parameter reachable under a second name (tied weights)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def gathered_16bit_file(ps: ParallelState) -> str:
    """The consolidated 16-bit weights' file of this model-parallel rank in a tag directory."""
    if ps.mp.size == 1:
        return GATHERED_16BIT_FILE
    return f"pytorch_model_mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}.bin"


def _metadata(engine: Engine, ps: ParallelState) -> dict[str, Any]:
    meta = dict(engine.checkpoint_metadata)
    lay = dict(meta.get("layout") or {})
    lay.setdefault("tensor_model_parallel_size", ps.tp_size)
    lay.setdefault("pipeline_model_parallel_size", ps.pp_size)
    lay["data_parallel_size"] = ps.dp_size
    lay["zero_stage"] = engine.optimizer_part.zero_stage
    lay.update(relayout.layout_entries(engine, ps))
    meta["layout"] = lay
    return meta


def _model_file(ps: ParallelState) -> str:
    return model_file(ps.tp_rank, ps.pp_rank, ps.pp_size)


# ---- load ----------------------------------------------------------------------------------


def load_engine_checkpoint(
    engine: Engine,
    load_dir: str | Path,
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    load_rng: bool,
    strict: bool = True,
    custom_load_fn: Callable[..., None] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a checkpoint into ``engine``; returns ``(path, client_state)``.

    ``load_module_only`` (Megatron's ``--finetune``) loads weights and nothing else: step
    counters stay at zero. Under ZeRO each rank reads its own partition file; a checkpoint saved
    with another data-parallel size or stage is re-partitioned from all of them (masters and
    elementwise optimizer state, see :mod:`zerotron.checkpoint.zero_repartition`) unless
    ``engine.repartition_zero_checkpoints`` is off (then another data-parallel size is refused,
    naming ``zerotron zero-to-fp32``). Saved on another tensor, pipeline or virtual pipeline
    layout, with a whole optimizer state against a partitioned one or another vocabulary
    padding, each rank's files are converted in memory (:mod:`zerotron.engine.relayout`). Not
    ``strict``: weights the checkpoint lacks keep the module's values, and those the module
    lacks are dropped. ``custom_load_fn(src=weights, dst=module)``
    loads the weights in the fitter's place (DeepSpeed's). ``tag`` None and no tracker file in
    ``load_dir``: nothing is loaded and ``(None, None)`` returned, with a warning, as DeepSpeed
    does (scripts test it to start fresh).
    """
    writer = getattr(engine, "checkpoint_writer", None)
    if writer is not None:
        writer.wait()  # a save still in flight is committed before anything is read
    ds_dir = deepspeed_checkpoint.deepspeed_tag_dir(load_dir, tag, engine.load_universal)
    if ds_dir is not None:  # a checkpoint DeepSpeed itself wrote
        return deepspeed_checkpoint.load_deepspeed_checkpoint(
            engine,
            ds_dir,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            strict=strict,
            custom_load_fn=custom_load_fn,
        )
    if tag is None and read_latest_tag(load_dir) is None:
        warnings.warn(
            f"no checkpoint to load in {load_dir}: found no 'latest' file; starting from the "
            "model as it is (pass a tag to load one explicitly)",
            stacklevel=3,
        )
        return None, None
    tag = resolve_tag(load_dir, tag)
    where = str(Path(load_dir) / tag)
    ps = state()
    meta = read_metadata(load_dir, tag)
    weights_only = load_module_only or not load_optimizer_states
    files = CheckpointFiles(load_dir, tag)
    if not weights_only:
        # Saved on another layout: this rank's files as its own save would have written them.
        converted = relayout.converted_files(engine, load_dir, tag, meta, ps, where)
        if converted is not None:
            files, meta = converted
    return _load_files(
        engine, files, meta, where, ps, load_optimizer_states, load_lr_scheduler_states,
        load_module_only, load_rng, strict, custom_load_fn,
    )  # fmt: skip


def load_imported_checkpoint(
    engine: Engine, ckpt: InMemoryCheckpoint, load_optimizer_states: bool = True
) -> tuple[str, dict[str, Any]]:
    """Load a checkpoint another tool wrote, read into memory (``ckpt``: weights, and the
    training state when it has one), as if this Engine had saved it: this rank's part is cut
    as its own save would have written it. No RNG state (another tool's streams do not carry
    over). Returns ``(where, client_state)``."""
    writer = getattr(engine, "checkpoint_writer", None)
    if writer is not None:
        writer.wait()
    ps = state()
    files, meta = relayout.imported_files(engine, ckpt, ps)
    load = load_optimizer_states and ckpt.has_optimizer
    return _load_files(engine, files, meta, ckpt.where, ps, load, load, False, False, True, None)


def _load_files(
    engine: Engine,
    files: CheckpointFiles,
    meta: Mapping[str, Any],
    where: str,
    ps: ParallelState,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    load_rng: bool,
    strict: bool,
    custom_load_fn: Callable[..., None] | None,
) -> tuple[str, dict[str, Any]]:
    """:func:`load_engine_checkpoint` once this rank's ``files`` and their ``meta`` are known."""
    part, fitter = engine.optimizer_part, engine.state_fitter
    weights_only = load_module_only or not load_optimizer_states
    saved = _read_model_file(engine, files, meta, ps, weights_only)
    if "model" not in saved:
        raise CheckpointError("no 'model' entry in the checkpoint", where=where)
    refuse_non_finite(saved["model"], f"{where}/{_model_file(ps)}", "model")
    opt_state = None
    if load_optimizer_states and not load_module_only:
        opt_state = part.read_optimizer_state(
            files, saved, meta, where, engine.repartition_zero_checkpoints
        )
        refuse_non_finite(opt_state, where, "optimizer")
    refitted = fit_weights(engine, saved["model"], meta, where, strict, custom_load_fn)
    if load_module_only:
        reload_masters(engine)
        run_metrics.loaded(engine, where)
        return where, {}
    if opt_state is not None:
        part.load_optimizer_state(
            opt_state,
            engine.module,
            refitted,
            lambda s: fitter.fit_optimizer_state(part.optimizer, engine.module, s, refitted, meta),
            where,
        )
        clear_modified(engine.module)  # the masters came from the file, not from the weights
    else:
        reload_masters(engine)
    scheduler_state = saved.get("opt_param_scheduler")
    if load_lr_scheduler_states and engine.lr_scheduler is not None and scheduler_state:
        engine.lr_scheduler.load_state_dict(scheduler_state)
    if load_rng and saved.get("rng_state"):
        extra = set_rng_state(saved["rng_state"][0], where=where)
        if extra.get(RNG_TRACKER_KEY):
            get_rng_tracker().set_states(extra[RNG_TRACKER_KEY])
    engine.global_steps = int(saved.get("global_steps", 0))
    engine.global_samples = int(saved.get("global_samples", 0))
    run_metrics.loaded(engine, where)  # the metrics file's next "run" record: a resume
    return where, {k: v for k, v in saved.items() if k not in ENGINE_ENTRIES}


def fit_weights(
    engine: Engine,
    weights: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    where: str,
    strict: bool = True,
    custom_load_fn: Callable[..., None] | None = None,
) -> list[str]:
    """Put this rank's ``weights`` into the module through the engine's fitter (or
    ``custom_load_fn(src=weights, dst=module)``) and its optimizer part (ZeRO stage 3 keeps
    this rank's partition); returns the refitted keys. ``meta`` is the checkpoint's
    metadata.json; not ``strict``, weights the checkpoint lacks keep the module's values."""
    if not strict:
        weights = _loosely(engine, weights)
    model_config = engine.checkpoint_metadata.get("model")

    def fit() -> list[str]:
        if custom_load_fn is not None:
            custom_load_fn(src=weights, dst=engine.module)
            return []
        return engine.state_fitter.load_model_state(
            engine.module, weights, meta=meta, model_config=model_config, where=where
        )

    return engine.optimizer_part.load_module_state(engine.module, weights, fit, where)


def load_weights(
    engine: Engine, weights: Mapping[str, Tensor], meta: Mapping[str, Any], where: str
) -> None:
    """Load this rank's ``weights`` from any source (``meta``: what a zerotron checkpoint of
    them would record); the masters follow, the optimizer state and counters are untouched."""
    refuse_non_finite(weights, where, "model")
    fit_weights(engine, weights, meta, where)
    reload_masters(engine)
    run_metrics.loaded(engine, where)


def _loosely(engine: Engine, weights: Mapping[str, Any]) -> dict[str, Any]:
    """``weights`` for exactly the module's keys: missing ones from the module itself."""
    current = engine.module_state_dict()
    assert current is not None
    loose = {k: v for k, v in weights.items() if k in current}
    for k, v in current.items():
        loose.setdefault(k, v)
    return loose


def reload_masters(engine: Engine) -> None:
    """Masters from the (just loaded) model weights."""
    engine.optimizer_part.reload_model_params()
    clear_modified(engine.module)


def clear_modified(module: nn.Module) -> None:
    # stage3.load_full_state_dict flags what it wrote so that an optimizer reloads those
    # masters; the Engine has just set them (from the file or the weights) itself.
    for p in module.parameters():
        if getattr(p, "zero_modified", False):
            p.zero_modified = False


def _read_model_file(
    engine: Engine,
    files: CheckpointFiles,
    meta: Mapping[str, Any],
    ps: ParallelState,
    weights_only: bool,
) -> dict[str, Any]:
    """This rank's model file. Weights alone (no optimizer state wanted) from another tensor or
    (virtual) pipeline layout: this rank's weights merged and split from every file
    (``checkpoint.reshard``, through the fitter) with the counters all files share; no RNG
    state. (With the optimizer state, ``files`` were converted already.)"""
    saved_vpp = meta.get("layout", {}).get(relayout.VPP_KEY, ps.virtual_pipeline_size or 1)
    same = checkpoint_layout(meta) == (ps.tp_size, ps.pp_size)
    if (
        files.memory is not None
        or not weights_only
        or (same and saved_vpp == (ps.virtual_pipeline_size or 1))
    ):
        return files.read(_model_file(ps))
    weights = engine.state_fitter.load_resharded(files.load_dir, files.tag, ps)
    return {**load_shared_entries(files.load_dir, files.tag), "model": weights}


def saved_zero_stage(model_state: Mapping[str, Any], meta: Mapping[str, Any]) -> int:
    """The ZeRO stage a checkpoint was saved with (0: a whole optimizer state)."""
    return int(model_state.get(ZERO_STAGE_KEY, meta.get("layout", {}).get("zero_stage", 0)))


def read_zero_partition(
    files: CheckpointFiles,
    model_state: Mapping[str, Any],
    meta: Mapping[str, Any],
    where: str,
    *,
    stage: int,
    dp_size: int,
    current_state: Callable[[], dict[str, Any]],
    repartition: bool,
) -> dict[str, Any]:
    """This rank's ZeRO partition file, after checking it was saved by this layout.

    A checkpoint saved with another data-parallel size or ZeRO stage (whose sub-groups may be
    cut otherwise) is re-partitioned from all of them (masters and elementwise optimizer state;
    ``current_state()`` gives this rank's layout) when ``repartition`` is on; another
    data-parallel size is refused otherwise, naming ``zerotron zero-to-fp32``.
    """
    ps = state()
    load_dir, tag = files.load_dir, files.tag
    if not saved_zero_stage(model_state, meta):
        raise CheckpointError(
            f"the checkpoint holds a whole (not partitioned) optimizer state; this engine "
            f"runs ZeRO stage {stage}",
            where=where,
            fix="resume without ZeRO, or load weights only (load_optimizer_states=False)",
        )
    saved_dp = int(
        model_state.get(DP_SIZE_KEY, meta.get("layout", {}).get("data_parallel_size", 0))
    )
    saved_stage = saved_zero_stage(model_state, meta)
    if (saved_dp != dp_size or saved_stage != stage) and repartition and files.memory is None:
        # Cut the saved partitions again for this data-parallel size and stage (masters and
        # elementwise optimizer state), from the layout entries of all saved files; another
        # stage may group the partitions in sub-groups of another size.
        return repartition_zero_state(
            layout_tag_dir(load_dir, tag), ps.tp_rank, ps.pp_rank, current_state()
        )
    if saved_dp != dp_size:
        raise CheckpointError(
            f"the ZeRO optimizer state is partitioned over {saved_dp} data-parallel ranks; "
            f"this run has {dp_size}",
            where=where,
            fix=f"resume with {saved_dp} data-parallel ranks, or consolidate the weights with "
            f"`zerotron zero-to-fp32 {load_dir} OUT --tag {tag}` and start from them "
            "(load_optimizer_states=False also loads the weights alone)",
        )
    zero_state = files.read(zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank))
    if zero_state.get("dp_rank", ps.dp_rank) != ps.dp_rank:
        raise CheckpointError(
            f"the partition file names dp_rank {zero_state.get('dp_rank')}",
            where=f"{where}/{zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank)}",
            fix="the files were renamed or mixed: restore the checkpoint as saved",
        )
    return zero_state
