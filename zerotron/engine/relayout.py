"""An Engine loading a checkpoint saved on another layout: which conversion it needs, and the
files each rank then reads from memory.

The saved layout comes from the checkpoint's metadata.json, the running one from the Engine
(its parallel state, ZeRO stage and sub-group size, padded vocabulary). What the load path
already carries itself is left to it: another data-parallel size or ZeRO stage between
partitioned optimizer states is re-partitioned from the saved files
(:mod:`zerotron.checkpoint.zero_repartition`), and offload changes nothing in the files. Any
other difference (tensor, pipeline or virtual pipeline size; a whole optimizer state against a
partitioned one; another vocabulary padding) goes through the conversion engine: each rank gets
from it (:mod:`zerotron.checkpoint.target`) exactly the files its own save would have written,
in memory, and loads them as usual. Rank 0 says once in the log what was
converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotron.checkpoint.canonical import CanonicalCheckpoint, Layout, open_checkpoint
from zerotron.checkpoint.in_memory import InMemoryCheckpoint
from zerotron.checkpoint.layout import model_file, zero_file
from zerotron.checkpoint.relayout import CheckpointFiles, describe_layout, refuse_other_model
from zerotron.checkpoint.stream_save import materialize
from zerotron.checkpoint.target import check_target, rank_files, target_metadata
from zerotron.distributed.state import ParallelState
from zerotron.errors import CheckpointError, ConfigError
from zerotron.zero.options import default_sizes

if TYPE_CHECKING:
    from zerotron.engine.core import Engine

VPP_KEY = "virtual_pipeline_model_parallel_size"
OFFLOAD_KEY = "offload_optimizer_device"


def running_layout(engine: Engine, ps: ParallelState) -> Layout:
    """The layout this Engine saves (and would have saved) its checkpoints in."""
    part = engine.optimizer_part
    sub_group_size = None
    if part.zero_stage:
        options = part.optimizer.options
        sub_group_size = default_sizes(part.zero_stage, None, options.sub_group_size)[1]
    return Layout(
        tensor_parallel=ps.tp_size,
        pipeline_parallel=ps.pp_size,
        virtual_stages=ps.virtual_pipeline_size or 1,
        data_parallel=ps.dp_size,
        zero_stage=part.zero_stage,
        sub_group_size=sub_group_size,
        padded_vocab_size=(engine.checkpoint_metadata.get("vocab") or {}).get("padded_size"),
    )


def offload_of(engine: Engine) -> str:
    """Where this Engine keeps its optimizer state: none, cpu or nvme."""
    options = getattr(engine.optimizer_part.optimizer, "options", None)
    offload = getattr(options, "offload_optimizer", None)
    return str(getattr(offload, "device", None) or "none")


def layout_entries(engine: Engine, ps: ParallelState) -> dict[str, Any]:
    """What metadata.json's ``layout`` records beyond the sizes and the ZeRO stage."""
    return {VPP_KEY: ps.virtual_pipeline_size or 1, OFFLOAD_KEY: offload_of(engine)}


def _saved_layout(meta: Mapping[str, Any], load_dir: str | Path, tag: str) -> Layout:
    saved = Layout.from_metadata(meta)
    if VPP_KEY not in meta["layout"] and saved.pipeline_parallel > 1:
        # Saved before metadata recorded virtual stages: the stage files' layers tell.
        with open_checkpoint(load_dir, tag) as ckpt:
            return replace(saved, virtual_stages=ckpt.layout.virtual_stages)
    return saved


def needs_conversion(saved: Layout, target: Layout) -> bool:
    """Whether a rank of ``target`` cannot read ``saved``'s files as they are (see the
    module docstring for what the load path carries itself)."""
    return (
        (saved.tensor_parallel, saved.pipeline_parallel, saved.virtual_stages)
        != (target.tensor_parallel, target.pipeline_parallel, target.virtual_stages)
        or (saved.zero_stage == 0) != (target.zero_stage == 0)
        or saved.padded_vocab_size != target.padded_vocab_size
    )


def converted_files(
    engine: Engine,
    load_dir: str | Path,
    tag: str,
    meta: Mapping[str, Any],
    ps: ParallelState,
    where: str,
) -> tuple[CheckpointFiles, dict[str, Any]] | None:
    """This rank's files and the metadata they go with, converted from the saved layout when
    the running one cannot read it as saved (None: read the files on disk)."""
    if not isinstance(meta.get("layout"), Mapping):
        return None  # not written by zerotron (no layout recorded): read as it is
    saved = _saved_layout(meta, load_dir, tag)
    target = running_layout(engine, ps)
    was = describe_layout(saved, str((meta.get("layout") or {}).get(OFFLOAD_KEY) or "none"))
    now = describe_layout(target, offload_of(engine))
    if not needs_conversion(saved, target):
        if was != now and ps.rank == 0:
            _say(was, now, _carried(saved, target))
        return None
    refuse_other_model(
        meta,
        engine.checkpoint_metadata.get("model"),
        (engine.checkpoint_metadata.get("vocab") or {}).get("size"),
        where,
        was,
        now,
    )
    try:
        with open_checkpoint(load_dir, tag) as ckpt:
            files, new_meta = _files_of(ckpt, target, ps)
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(
            f"the checkpoint, saved at {was}, cannot be converted for this run ({now}): {e.what}",
            where=e.where or where,
            fix=(f"{e.fix}; or " if e.fix else "")
            + f"resume on the saved layout ({_flags(saved)}), or load the weights alone "
            "(--finetune or --no-load-optim; load_optimizer_states=False)",
        ) from e
    if ps.rank == 0:
        _say(was, now, _converted(saved, target))
    return CheckpointFiles(load_dir, tag, files, converted_from=was), new_meta


def _files_of(
    ckpt: CanonicalCheckpoint | InMemoryCheckpoint, target: Layout, ps: ParallelState
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's files of ``ckpt`` laid out as ``target``, in memory, and their metadata."""
    t, p, d = ps.tp_rank, ps.pp_rank, ps.dp_rank
    wanted = [model_file(t, p, ps.pp_size)] + ([zero_file(d, t, p)] if target.zero_stage else [])
    target = check_target(ckpt, target)
    # Only data-parallel rank 0 writes the model file; every rank reads it.
    trees = {**rank_files(ckpt, target, t, p, 0), **rank_files(ckpt, target, t, p, d)}
    files = {rel: materialize(trees[rel], f"{ckpt.where} -> {rel}") for rel in wanted}
    return files, target_metadata(ckpt, target)


def imported_files(
    engine: Engine, ckpt: InMemoryCheckpoint, ps: ParallelState
) -> tuple[CheckpointFiles, dict[str, Any]]:
    """This rank's files of a checkpoint another tool wrote, held in memory (``ckpt``), as this
    Engine's own save would have written them, and the metadata they go with."""
    target = running_layout(engine, ps)
    was = f"{ckpt.meta.get('source', ckpt.where)} ({describe_layout(ckpt.layout, 'none')})"
    now = describe_layout(target, offload_of(engine))
    refuse_other_model(
        ckpt.meta,
        engine.checkpoint_metadata.get("model"),
        (engine.checkpoint_metadata.get("vocab") or {}).get("size"),
        ckpt.where,
        was,
        now,
    )
    files, meta = _files_of(ckpt, target, ps)
    return CheckpointFiles(ckpt.root, ckpt.tag, files, converted_from=was), meta


def _flags(layout: Layout) -> str:
    s = f"tensor parallel {layout.tensor_parallel}, pipeline parallel {layout.pipeline_parallel}"
    if layout.virtual_stages > 1:
        s += f" with {layout.virtual_stages} virtual stages"
    return s + f", ZeRO stage {layout.zero_stage}"


def _say(was: str, now: str, what: str) -> None:
    print(f" checkpoint saved at {was}; loading into {now}: {what}", flush=True)


def _carried(saved: Layout, target: Layout) -> str:
    """What the load path does itself to a checkpoint it reads as saved."""
    if target.zero_stage and (saved.data_parallel, saved.zero_stage) != (
        target.data_parallel,
        target.zero_stage,
    ):
        return "optimizer state re-partitioned"
    return "read as saved"


def _converted(saved: Layout, target: Layout) -> str:
    """What a conversion did."""
    done = []
    if (saved.tensor_parallel, saved.pipeline_parallel, saved.virtual_stages) != (
        target.tensor_parallel,
        target.pipeline_parallel,
        target.virtual_stages,
    ):
        done.append("weights re-sharded")
    if saved.padded_vocab_size != target.padded_vocab_size:
        rows = f"{saved.padded_vocab_size} to {target.padded_vocab_size}"
        done.append(f"vocabulary re-padded from {rows} rows")
    done.append("optimizer state re-cut")
    return ", ".join(done)
