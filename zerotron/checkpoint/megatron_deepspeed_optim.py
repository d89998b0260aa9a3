"""Megatron-DeepSpeed's optimizer state: DeepSpeed's partitions read back per parameter.

Under ZeRO stages 1-2 (and with ``--bf16`` at any stage: DeepSpeed's bf16 optimizer partitions
too), every model-parallel rank ``MM`` of a Megatron-DeepSpeed run has one optimizer file per
data-parallel rank ``D`` in its tag directory::

    [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt

``MM`` counts tensor ranks fastest: pipeline stage ``MM // tp``, tensor rank ``MM % tp`` (the
pipeline engine), or the tensor rank alone (``--no-pipeline-parallel``). Each holds DeepSpeed's
ZeRO-1/2 state: per parameter group, the data-parallel rank's slice of the group's flat fp32
vector (the parameters of ``mp_rank_MM_model_states.pt``'s ``param_shapes`` one after
another) and of each Adam moment, with Adam's step. :func:`read_optimizer` puts every
parameter's fp32 master and moments back together
(:func:`~zerotron.checkpoint.deepspeed_format.consolidate`, as for DeepSpeed's own checkpoints)
and names them as :mod:`~zerotron.checkpoint.megatron_deepspeed` names the weights (the legacy
GPTModel's names, global layer indices), one state dict per tensor rank and kind, so
:func:`zerotron.checkpoint.megatron.read_megatron_optimizer` merges them exactly as it merges
the weights (tensor-parallel shards, the QKV row order of the commit that wrote them).

The pipeline engine's DeepSpeed names are its layer list's: ``tied_modules.embed.*`` (the word
and position embeddings, held by the first and the last stage; the first stage's are read, the
last stage's are its tied copies) and ``L.<name>`` for layer index ``L`` (as in the
``layer_LL-model_TT-model_states.pt`` file names). Without the pipeline engine they are the
legacy GPTModel's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from zerotron.checkpoint import megatron_io as mio
from zerotron.checkpoint.deepspeed_format import (
    OSD,
    PARTITION_COUNT,
    DeepSpeedCheckpoint,
    consolidate,
    load_deepspeed_file,
    require_entries,
)
from zerotron.checkpoint.megatron_deepspeed import (
    ZERO3_FIX,
    ZERO3_REFUSAL,
    layer_files,
    layer_roles,
    legacy_prefix,
)
from zerotron.errors import CheckpointError, UnsupportedError

OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2,})_optim_states\.pt")
KINDS = ("master", "exp_avg", "exp_avg_sq")
STEP_KEY = "base_optimizer_state_step"  # DeepSpeed's copy of a group-held step (elastic form)
"""The per-parameter tensors read: the fp32 master and Adam's two moments."""
_EMBEDDING = "tied_modules.embed."


@dataclass
class MegatronDeepSpeedOptimizer:
    """A Megatron-DeepSpeed run's optimizer state, per tensor rank, under the legacy names."""

    states: dict[str, dict[int, dict[str, Tensor]]] = field(default_factory=dict)
    """Kind (:data:`KINDS`) -> tensor rank -> legacy name -> the rank's whole shard."""
    step: Any = None
    """Adam's step count as saved (the same for every parameter)."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The torch optimizer's groups as saved by the first model-parallel rank (hyperparameters;
    ``params`` indices)."""
    zero_stage: int = 0
    data_parallel: int = 1


def optimizer_files(tag: Path) -> dict[int, list[str]]:
    """``{model-parallel rank: [its optimizer files by data-parallel rank]}`` (empty: none)."""
    found: dict[int, dict[int, str]] = {}
    for child in tag.iterdir():
        m = OPTIM_FILE.fullmatch(child.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = child.name
    return {mp: [files[d] for d in sorted(files)] for mp, files in sorted(found.items())}


def _legacy_name(name: str, roles: dict[int, str] | None, stage: int, where: str) -> str | None:
    """The legacy GPTModel name of DeepSpeed's parameter ``name`` (None: a later stage's tied
    copy of the embeddings, not read)."""
    if roles is None:  # --no-pipeline-parallel: the GPTModel's own names
        return name
    if name.startswith(_EMBEDDING):
        return None if stage else legacy_prefix("embedding") + name.removeprefix(_EMBEDDING)
    index, _, rest = name.partition(".")
    role = roles.get(int(index)) if index.isdigit() else None
    if role is not None:
        return legacy_prefix(role) + rest
    raise UnsupportedError(
        f"optimizer state of {name!r}, which is not a parameter of a GPT-2 GPTModelPipe "
        "(embedding, transformer layers, final LayerNorm)",
        where=where,
        fix="only GPT-2-style Megatron-DeepSpeed models convert",
    )


def read_optimizer(tag: Path, tp: int, pp: int) -> MegatronDeepSpeedOptimizer | None:
    """The optimizer state of the Megatron-DeepSpeed checkpoint in ``tag`` (tensor size ``tp``,
    pipeline size ``pp``), or None when it has no optimizer files (ZeRO stage 0 in fp32 or fp16:
    DeepSpeed keeps the optimizer state in the model-states files, which is not read)."""
    by_mp = optimizer_files(tag)
    if not by_mp:
        return None
    pipeline = layer_files(tag)
    roles = layer_roles(next(iter(pipeline.values()))) if pipeline else None
    expected = list(range(tp * (pp if pipeline else 1)))
    if list(by_mp) != expected:
        raise CheckpointError(
            f"optimizer files of model-parallel ranks {list(by_mp)}; the run's layout has "
            f"{expected}",
            where=str(tag),
            fix="copy the whole checkpoint directory",
        )
    out = MegatronDeepSpeedOptimizer()
    for mp, files in by_mp.items():
        t, stage = mp % tp, mp // tp
        part = read_rank(tag, mp, files)
        for kind, tensors in (("master", part.masters), *part.moments.items()):
            if kind not in KINDS:
                continue
            dest = out.states.setdefault(kind, {}).setdefault(t, {})
            for name, tensor in tensors.items():
                legacy = _legacy_name(name, roles, stage, str(tag / files[0]))
                if legacy is not None:
                    dest[legacy] = tensor
        if mp == 0:
            out.step = _step(part, str(tag / files[0]))
            out.param_groups = part.param_groups
            out.zero_stage, out.data_parallel = part.zero_stage, part.dp_size
    return out


def _step(part: DeepSpeedCheckpoint, where: str) -> Any:
    """Adam's step count: per parameter (torch's Adam), or per param group (apex's
    ``FusedAdam``, Megatron-DeepSpeed's optimizer on GPUs), or DeepSpeed's own copy of it."""
    step = part.scalars.get("step")
    if step is None:
        steps = {float(g["step"]) for g in part.param_groups if g.get("step") is not None}
        if len(steps) > 1:
            raise CheckpointError(
                f"the param groups hold different steps {sorted(steps)}", where=where
            )
        step = next(iter(steps), part.scalars.get(STEP_KEY))
    if step is None:
        raise CheckpointError(
            "the optimizer state holds no step count (neither per parameter nor per group)",
            where=where,
            fix="load the weights alone (--finetune), or --no-load-optim to go on from its "
            "iteration with a fresh optimizer",
        )
    return step


def read_rank(tag: Path, mp: int, files: list[str]) -> DeepSpeedCheckpoint:
    """Model-parallel rank ``mp``'s optimizer state put back together from its data-parallel
    ranks' ``files``: fp32 masters and moments per DeepSpeed parameter name (its
    ``mp_rank_MM_model_states.pt``'s ``param_shapes``), Adam's step, the param groups."""
    model_states = tag / f"mp_rank_{mp:02d}_model_states.pt"
    saved = mio.load_safe(model_states, mmap=True)
    shapes_of = require_entries(saved, ("param_shapes",), model_states)["param_shapes"]
    osds = [require_entries(load_deepspeed_file(tag / f), (OSD,), tag / f)[OSD] for f in files]
    zero_stage = int(osds[0].get("zero_stage", 0))
    count = osds[0].get(PARTITION_COUNT)
    dp = int(max(count) if isinstance(count, (list, tuple)) else count or 1)
    if dp != len(files):
        raise CheckpointError(
            f"the optimizer files of model-parallel rank {mp} say {dp} data-parallel ranks, "
            f"{len(files)} are present",
            where=str(tag),
            fix="copy the whole checkpoint directory (every rank wrote one file)",
        )
    if zero_stage == 3:
        raise UnsupportedError(ZERO3_REFUSAL, where=str(tag), fix=ZERO3_FIX)
    shapes = [{n: tuple(s) for n, s in g.items()} for g in shapes_of]
    part = DeepSpeedCheckpoint(tag, zero_stage, dp, {}, {})
    consolidate(part, osds, shapes, zero_stage)
    missing = [k for k in KINDS[1:] if k not in part.moments]
    if missing:
        raise UnsupportedError(
            f"the optimizer state has no {', '.join(missing)} (not Adam's)",
            where=str(tag / files[0]),
            fix="only Adam's state converts; take the weights alone (--finetune)",
        )
    return part
