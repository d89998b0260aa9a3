"""Re-partition a ZeRO checkpoint for another data-parallel size, at load time.

A rank's ZeRO file holds its chunks of every parameter inside flat fp32 partitions: the masters
(``fp32_partitions``) and, for an elementwise optimizer (Adam's ``exp_avg``, ``exp_avg_sq``,
SGD's momentum), optimizer state of the same flat shape. The ``layout`` entries say where each
parameter's piece lies (see :mod:`zerotron.checkpoint.zero_to_fp32`), so the N files saved by N
ranks can be cut again for M ranks: every flat tensor of the new rank is filled, element range by
element range, from the old files' pieces. Scalar state (Adam's ``step``) is the same in every
sub-group and is copied; padding elements start at zero, as in a fresh partition.

:func:`repartition_zero_state` builds the state dict that the new rank's
``ZeroOptimizer.load_state_dict`` accepts, from the old files and the new rank's own (fresh)
``state_dict()``, which gives the target layout. The old files are memory-mapped; one
parameter's full tensor (per state key) is assembled at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import layout
from zerotron.checkpoint.zero_to_fp32 import _load, plan_parameters
from zerotron.errors import CheckpointError

MASTER = "fp32_partitions"


def _elementwise_keys(opt_state: Mapping[str, Any], sizes: list[int]) -> tuple[set[str], dict]:
    """State keys holding one value per partition element, and the scalar ones (first seen)."""
    elementwise: set[str] = set()
    scalars: dict[str, Any] = {}
    for idx, entry in opt_state.get("state", {}).items():
        for key, value in entry.items():
            if (
                key != "step"
                and isinstance(value, torch.Tensor)
                and value.dim() >= 1
                and isinstance(idx, int)
                and idx < len(sizes)
                and value.numel() == sizes[idx]
            ):
                elementwise.add(key)
            else:
                scalars.setdefault(key, value)
    return elementwise, scalars


def repartition_zero_state(
    tag_dir: str | Path, tp_rank: int, pp_rank: int, target: Mapping[str, Any]
) -> dict[str, Any]:
    """The ZeRO state for the rank whose current (layout-defining) state dict is ``target``,
    rebuilt from the files of model-parallel rank (tp_rank, pp_rank) under ``tag_dir``, saved
    with any data-parallel size."""
    tag_dir = Path(tag_dir)
    where = str(tag_dir)
    names = sorted(
        n.name for n in tag_dir.glob(f"zero_dp_rank_*_mp_rank_{tp_rank:02d}_{pp_rank:03d}_*")
    )
    old_n = len(names)
    files = [layout.zero_file(d, tp_rank, pp_rank) for d in range(old_n)]
    if sorted(files) != names or not files:
        raise CheckpointError(
            f"ZeRO files of model-parallel rank tp={tp_rank} pp={pp_rank} are incomplete "
            f"({old_n} found)",
            where=where,
            fix="copy the complete checkpoint directory",
        )
    old = [_load(tag_dir, f) for f in files]
    sizes = [[t.numel() for t in st[MASTER]] for st in old]
    plans = {p.name: p for p in plan_parameters(old, where, sizes)}

    new_layout = target["layout"]
    new_sizes = [t.numel() for t in target[MASTER]]
    missing = [e["name"] for e in new_layout if e["name"] not in plans]
    if missing or len(plans) != len(new_layout):
        raise CheckpointError(
            f"the checkpoint's parameters do not match this model's (missing here: "
            f"{missing[:5]}; {len(plans)} saved, {len(new_layout)} now)",
            where=where,
            fix="resume with the model that saved the checkpoint",
        )
    elementwise: set[str] = set()
    scalars: dict[str, Any] = {}
    for st, sz in zip(old, sizes):
        keys, sc = _elementwise_keys(st["optimizer"], sz)
        elementwise |= keys
        for k, v in sc.items():
            scalars.setdefault(k, v)

    def source(r: int, key: str, partition: int) -> torch.Tensor:
        if key == MASTER:
            return old[r][MASTER][partition]
        return old[r]["optimizer"]["state"][partition][key]

    out: dict[str, list[torch.Tensor]] = {}
    for key in (MASTER, *sorted(elementwise)):
        dst = [torch.zeros(n, dtype=torch.float32) for n in new_sizes]
        for e in new_layout:
            plan = plans[e["name"]]
            full = torch.zeros(plan.numel, dtype=torch.float32)
            for piece in plan.pieces:
                src = source(piece.rank, key, piece.partition).reshape(-1)
                full[piece.start : piece.start + piece.length] = src[
                    piece.offset : piece.offset + piece.length
                ]
            start, length, offset = int(e["start"]), int(e["length"]), int(e["offset"])
            dst[int(e["partition"])][offset : offset + length] = full[start : start + length]
        out[key] = dst

    groups = target["optimizer"]["param_groups"]
    # The learning rate the schedule had reached (the same in every group, unless a group
    # scales it: then the new groups keep the values they were built with).
    old_lrs = {g.get("lr") for st in old for g in st["optimizer"]["param_groups"]}
    hyper = {"lr": old_lrs.pop()} if len(old_lrs) == 1 else {}
    state = {}
    for g in groups:
        for idx in g["params"]:
            entry = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()
            }
            for key in elementwise:
                entry[key] = out[key][idx]
            if entry:
                state[idx] = entry
    new_groups = [{**g, **hyper} for g in groups]
    first = old[0]
    return {
        **{k: v for k, v in target.items() if k not in ("optimizer", MASTER)},
        "zero_stage": target.get("zero_stage", first.get("zero_stage")),
        "optimizer": {"state": state, "param_groups": new_groups},
        MASTER: out[MASTER],
        "grad_scaler": first.get("grad_scaler"),
        "num_skipped_steps": first.get("num_skipped_steps", 0),
    }
