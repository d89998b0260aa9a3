"""Cut canonical records for a target layout: the files one rank's own save would write.

:func:`rank_files` describes, for one rank (tp, pp, dp) of a target :class:`Layout`, exactly
the ``{relative path: object}`` mapping that rank's ``Engine.save_checkpoint`` writes
(``engine/checkpoint_io.py``), with every tensor a :class:`~zerotron.checkpoint.stream_save.
Pending` leaf produced from a :class:`~zerotron.checkpoint.canonical.CanonicalCheckpoint` on
demand. :func:`files_for_rank` produces them (an Engine loads that in memory as if read from
disk); the offline converter streams them to disk one tensor at a time.

What a target rank's files hold:

- data-parallel rank 0 of each model-parallel rank: ``mp_rank_XX[_YYY]/model_optim_rng.pt``:
  the client state (iteration, consumed samples; not the old run's ``args``), the rank's
  weights (its TP shard, its pipeline stage's layers in its module's order, the tied copy on
  the last stage, the vocabulary re-padded to the target rows), the step counters, the LR
  scheduler, that rank's RNG streams when the source has the same (tp, pp) rank, and at ZeRO
  stage 0 the whole optimizer state (``MixedPrecisionOptimizer.state_dict()``), at stages 1-3
  ``zero_stage`` and ``dp_world_size``;
- under ZeRO every rank: ``zero_dp_rank_D_mp_rank_XX_YYY_optim_states.pt`` in
  ``ZeroOptimizer.state_dict()``'s format: chunk D of every parameter laid out in flat fp32
  sub-groups (optimizer order: the weight-decay groups; a sub-group closes before it would pass
  ``sub_group_size`` elements), masters and elementwise state alike, the step per sub-group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerotron.checkpoint import layout as names
from zerotron.checkpoint.canonical import (
    LOW_PRECISION,
    CanonicalCheckpoint,
    Layout,
    module_order,
    no_decay_names,
)
from zerotron.checkpoint.reshard import TIED_COPY, WORD_EMBEDDING, partition_dim, split_model_state
from zerotron.checkpoint.state import repad_vocab
from zerotron.checkpoint.stream_save import Pending, materialize
from zerotron.checkpoint.zero_to_fp32 import BUFFER_NAMES_KEY
from zerotron.errors import CheckpointError, ConfigError

# metadata.json keys save_checkpoint / commit_tag write themselves.
WRITTEN_BY_SAVE = (
    "format_version",
    "tag",
    "iteration",
    "files",
    "versions",
    "saved_at",
    "checksums",
)


def _chunk_bounds(numel: int, world: int, rank: int) -> tuple[int, int, int]:
    """(chunk, start, length) of rank ``rank``'s chunk (zero/partition.py's rule)."""
    chunk = -(-numel // world)
    start = rank * chunk
    return chunk, start, max(0, min(chunk, numel - start))


class _Rank:
    """One model-parallel rank of the target: its keys, shapes and optimizer order."""

    def __init__(self, ckpt: CanonicalCheckpoint, target: Layout, t: int, p: int):
        self.ckpt, self.target, self.t, self.p = ckpt, target, t, p
        meta = {
            n: torch.empty(ckpt.shapes[n], dtype=ckpt.dtypes[n], device="meta") for n in ckpt.names
        }
        split = split_model_state(
            meta,
            t,
            target.tensor_parallel,
            p,
            target.pipeline_parallel,
            orig_vocab_size=ckpt.orig_vocab_size,
            padded_vocab_size=target.padded_vocab_size,
            virtual_stages=target.virtual_stages,
        )
        self.keys = module_order(list(split), target.pipeline_parallel)
        self.shapes = {k: split[k].shape for k in self.keys}
        self.dtypes = {k: split[k].dtype for k in self.keys}
        self.trained = [k for k in self.keys if _source(k) in set(ckpt.trained)]
        decay, no_decay = no_decay_names({k: self.shapes[k] for k in self.trained})
        self.groups = [(False, decay), (True, no_decay)]
        self.groups = [(nd, g) for nd, g in self.groups if g]
        self.buffers = [k for k in self.keys if _source(k) in ckpt.buffers]

    def shard(self, key: str, kind: str) -> Tensor:
        """This rank's shard of ``key``'s ``kind`` tensor (re-padded, TP-split), fresh."""
        ckpt, tp = self.ckpt, self.target.tensor_parallel
        full = ckpt.tensor(_source(key), kind)
        rows = self.target.padded_vocab_size
        if key in (WORD_EMBEDDING, TIED_COPY) and rows is not None and full.shape[0] != rows:
            if ckpt.orig_vocab_size is None:
                raise CheckpointError(
                    "re-padding the vocabulary needs its real size (metadata.json 'vocab')",
                    where=ckpt.where,
                )
            full = repad_vocab(full, ckpt.orig_vocab_size, rows)
        dim = partition_dim(key)
        if dim is not None and tp > 1:
            part = full.chunk(tp, dim=dim)[self.t]
            return part.contiguous() if not part.is_contiguous() else part.clone()
        return full

    def pending(self, key: str, kind: str) -> Pending:
        dtype = self.dtypes[key] if kind == "weight" else torch.float32
        return Pending(self.shapes[key], dtype, lambda: self.shard(key, kind))


def _source(key: str) -> str:
    return WORD_EMBEDDING if key == TIED_COPY else key


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


# ---- the model file ---------------------------------------------------------------------------


def _model_tree(rank: _Rank, target: Layout) -> dict[str, Any]:
    ckpt = rank.ckpt
    tree: dict[str, Any] = dict(ckpt.client_state())
    tree["model"] = {k: rank.pending(k, "weight") for k in rank.keys}
    tree["checkpoint_version"] = ckpt.engine_entry("checkpoint_version", names.CHECKPOINT_VERSION)
    for key in ("global_steps", "global_samples"):
        if ckpt.engine_entry(key) is not None:
            tree[key] = ckpt.engine_entry(key)
    if ckpt.engine_entry(BUFFER_NAMES_KEY) is not None:  # an Engine's save lists them
        tree[BUFFER_NAMES_KEY] = list(rank.buffers)
    if target.zero_stage:
        tree[names.ZERO_STAGE_KEY] = target.zero_stage
        tree[names.DP_SIZE_KEY] = target.data_parallel
    elif ckpt.has_optimizer:
        tree["optimizer"] = _stage0_optimizer(rank)
    scheduler = ckpt.engine_entry("opt_param_scheduler")
    if scheduler is not None:
        tree["opt_param_scheduler"] = scheduler
    rng = ckpt.rng_state(rank.t, rank.p)
    if rng is not None:
        tree["rng_state"] = rng
    return tree


def _stage0_optimizer(rank: _Rank) -> dict[str, Any]:
    """``MixedPrecisionOptimizer.state_dict()`` of the target rank."""
    ckpt = rank.ckpt
    stepped = bool(ckpt.entry_order)
    state: dict[int, dict[str, Any]] = {}
    groups, masters = [], []
    idx = 0
    for no_decay, members in rank.groups:
        ids, low = [], []
        for key in members:
            if stepped:
                scalars = ckpt.scalars(_source(key))
                state[idx] = {
                    k: rank.pending(key, k) if k in ckpt.state_keys else _clone(scalars[k])
                    for k in ckpt.entry_order
                }
            if rank.dtypes[key] in LOW_PRECISION:
                low.append(rank.pending(key, "master"))
            ids.append(idx)
            idx += 1
        groups.append({**ckpt.group_settings(no_decay), "params": ids})
        masters.append(low)
    return {
        "optimizer": {"state": state, "param_groups": groups},
        "fp32_from_fp16_params": masters,
        **ckpt.optimizer_extras(),
    }


# ---- the ZeRO files ---------------------------------------------------------------------------


def _zero_tree(rank: _Rank, target: Layout, dp_rank: int) -> dict[str, Any]:
    """``ZeroOptimizer.state_dict()`` of data-parallel rank ``dp_rank`` (zero/state_dict.py)."""
    ckpt, world, limit = rank.ckpt, target.data_parallel, target.sub_group
    entries: list[dict[str, Any]] = []
    subs: list[dict[str, Any]] = []  # {"no_decay", "numel", "members": [(key, entry)]}
    for no_decay, members in rank.groups:
        current: dict[str, Any] | None = None
        for key in members:
            numel = rank.shapes[key].numel()
            chunk, start, length = _chunk_bounds(numel, world, dp_rank)
            if current is None or (current["numel"] and current["numel"] + chunk > limit):
                current = {"no_decay": no_decay, "numel": 0, "members": []}
                subs.append(current)
            entry = {
                "name": key,
                "shape": list(rank.shapes[key]),
                "numel": numel,
                "chunk": chunk,
                "start": start,
                "length": length,
                "partition": len(subs) - 1,
                "offset": current["numel"],
            }
            entries.append(entry)
            current["members"].append((key, entry))
            current["numel"] += chunk

    def flat(sub: dict[str, Any], kind: str) -> Pending:
        def produce() -> Tensor:
            out = torch.zeros(sub["numel"], dtype=torch.float32)
            for key, e in sub["members"]:
                if e["length"]:
                    src = rank.shard(key, kind).reshape(-1)
                    out[e["offset"] : e["offset"] + e["length"]] = src[
                        e["start"] : e["start"] + e["length"]
                    ]
                    del src  # before the next parameter's full tensor is read
            return out

        return Pending((sub["numel"],), torch.float32, produce)

    state: dict[int, dict[str, Any]] = {}
    if ckpt.entry_order:
        for s, sub in enumerate(subs):
            scalars = ckpt.scalars(_source(sub["members"][0][0]))
            state[s] = {
                k: flat(sub, k) if k in ckpt.state_keys else _clone(scalars[k])
                for k in ckpt.entry_order
            }
    groups = [{**ckpt.group_settings(sub["no_decay"]), "params": [s]} for s, sub in enumerate(subs)]
    return {
        "zero_stage": target.zero_stage,
        "dp_rank": dp_rank,
        "dp_size": world,
        "optimizer": {"state": state, "param_groups": groups},
        "fp32_partitions": [flat(sub, "master") for sub in subs],
        "layout": entries,
        **ckpt.optimizer_extras(),
    }


# ---- public ---------------------------------------------------------------------------------


def check_target(ckpt: CanonicalCheckpoint, target: Layout) -> Layout:
    """``target`` with its defaults filled, checked against the model (layers per stage)."""
    target = target.with_defaults(ckpt.meta)
    stages = target.pipeline_parallel * target.virtual_stages
    if ckpt.num_layers < stages or ckpt.num_layers % stages:
        raise ConfigError(
            f"{ckpt.num_layers} layers do not divide evenly into {target.pipeline_parallel} "
            f"pipeline stages x {target.virtual_stages} virtual stages",
            where="--target-pipeline-parallel-size",
            fix="choose sizes whose product divides the number of layers",
        )
    if target.zero_stage and not ckpt.has_optimizer:
        raise CheckpointError(
            "the checkpoint holds no optimizer state to partition for ZeRO",
            where=ckpt.where,
            fix="convert to --target-zero-stage 0, or resume with --no-load-optim",
        )
    return target


def rank_files(
    ckpt: CanonicalCheckpoint, target: Layout, tp_rank: int, pp_rank: int, dp_rank: int
) -> dict[str, Any]:
    """One target rank's files, tensors as :class:`Pending` leaves (module docstring).

    ``target`` must have its defaults filled (:func:`check_target`).
    """
    for what, r, n in (
        ("tensor", tp_rank, target.tensor_parallel),
        ("pipeline", pp_rank, target.pipeline_parallel),
        ("data", dp_rank, target.data_parallel),
    ):
        if not 0 <= r < n:
            raise ConfigError(f"{what}-parallel rank {r} is outside 0..{n - 1}")
    rank = _Rank(ckpt, target, tp_rank, pp_rank)
    files: dict[str, Any] = {}
    if dp_rank == 0:
        rel = names.model_file(tp_rank, pp_rank, target.pipeline_parallel)
        files[rel] = _model_tree(rank, target)
    if target.zero_stage:
        files[names.zero_file(dp_rank, tp_rank, pp_rank)] = _zero_tree(rank, target, dp_rank)
    return files


def files_for_rank(
    ckpt: CanonicalCheckpoint, target: Layout, tp_rank: int, pp_rank: int, dp_rank: int
) -> dict[str, Any]:
    """``{relative path: object}``: exactly what rank (tp_rank, pp_rank, dp_rank) of the
    ``target`` layout writes when it saves this checkpoint, in memory (fresh tensors)."""
    target = check_target(ckpt, target)
    files = rank_files(ckpt, target, tp_rank, pp_rank, dp_rank)
    return {rel: materialize(tree, f"{ckpt.where} -> {rel}") for rel, tree in files.items()}


def target_metadata(ckpt: CanonicalCheckpoint, target: Layout) -> dict[str, Any]:
    """metadata.json of the converted checkpoint: the source's, with the target layout and
    vocabulary rows, and ``converted_from`` naming the source and its layout."""
    target = target.with_defaults(ckpt.meta)
    meta = {k: v for k, v in ckpt.meta.items() if k not in WRITTEN_BY_SAVE}
    meta.pop("resharded_from", None)
    lay = {
        **(ckpt.meta.get("layout") or {}),
        "tensor_model_parallel_size": target.tensor_parallel,
        "pipeline_model_parallel_size": target.pipeline_parallel,
        "data_parallel_size": target.data_parallel,
        "zero_stage": target.zero_stage,
    }
    lay.pop("virtual_pipeline_model_parallel_size", None)
    for key in [k for k in lay if k.startswith("offload")]:  # the loading run's choice
        del lay[key]
    if target.virtual_stages > 1:
        lay["virtual_pipeline_model_parallel_size"] = target.virtual_stages
    meta["layout"] = lay
    rows = target.padded_vocab_size
    if "model" in meta:
        meta["model"] = {**meta["model"], "vocab_size": rows}
    meta["vocab"] = {**(meta.get("vocab") or {}), "size": ckpt.orig_vocab_size, "padded_size": rows}
    meta["optimizer_states"] = ckpt.has_optimizer
    src = ckpt.layout
    meta["converted_from"] = {
        "load": str(ckpt.root),
        "tag": ckpt.tag,
        "tensor_model_parallel_size": src.tensor_parallel,
        "pipeline_model_parallel_size": src.pipeline_parallel,
        "virtual_pipeline_model_parallel_size": src.virtual_stages,
        "data_parallel_size": src.data_parallel,
        "zero_stage": src.zero_stage,
        "padded_vocab_size": src.padded_vocab_size,
    }
    return meta
