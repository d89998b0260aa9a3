"""This rank's ZeRO checkpoint file: what ``ZeroOptimizer.state_dict()`` holds and how it loads.

One file per data-parallel rank (``docs/zero-optimizer.md``): the torch optimizer's state over
the flat fp32 masters, the masters themselves (``fp32_partitions``, one per sub-group) and the
``layout`` that maps them to parameters (name, shape, chunk, offset), with which zero-to-fp32
rebuilds every parameter from the N files without processes. Loading checks the layout and
refuses a file of another data-parallel size or grouping by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerotron.errors import CheckpointError

if TYPE_CHECKING:
    from zerotron.zero.optimizer import ZeroOptimizer


def zero_state_dict(zero: ZeroOptimizer) -> dict[str, Any]:
    """This rank's ZeRO file (``docs/zero-optimizer.md``): optimizer state over the flat
    masters, the masters themselves and the layout that maps them to parameters.

    Without offload the tensors are the live ones (as torch optimizers do): serialize
    them before the next step."""
    if zero._offloaded is not None:
        sd = zero._offloaded.state_dict()
        optimizer_state, masters = sd["optimizer"], sd["fp32_partitions"]
    else:
        optimizer_state = zero.optimizer.state_dict()
        masters = [s.master for s in zero.sub_groups]
    return {
        "zero_stage": zero.stage,
        "dp_rank": zero.group.rank,
        "dp_size": zero.group.size,
        "optimizer": optimizer_state,
        "fp32_partitions": masters,
        "layout": [
            {
                "name": i.name,
                "shape": list(i.shape),
                "numel": i.numel,
                "chunk": i.chunk,
                "start": i.start,
                "length": i.length,
                "partition": i.sub_group,
                "offset": i.offset,
            }
            for i in zero.infos
        ],
        "grad_scaler": zero.loss_scaler.state_dict() if zero.loss_scaler else None,
        "num_skipped_steps": zero.num_skipped_steps,
    }


@torch.no_grad()
def load_zero_state_dict(zero: ZeroOptimizer, state: dict[str, Any]) -> None:
    """Restore masters, optimizer state, loss scale and skip count from this rank's file of
    the same layout (the optimizer then rebuilds the parameters from the masters)."""
    mine = [(i.name, i.numel, i.chunk, i.sub_group, i.offset) for i in zero.infos]
    saved = [
        (e["name"], e["numel"], e["chunk"], e["partition"], e["offset"])
        for e in state.get("layout", [])
    ]
    if state.get("dp_size") != zero.group.size or saved != mine:
        raise CheckpointError(
            f"the ZeRO partition file (dp_size {state.get('dp_size')}, "
            f"{len(saved)} parameters) does not fit this run (dp_size {zero.group.size}, "
            f"{len(mine)} parameters) or its layout differs",
            where=f"zero dp rank {zero.group.rank}",
            fix="resume with the same data-parallel size, model and parameter grouping, "
            "or consolidate with zero-to-fp32 and load the weights only",
        )
    masters = state["fp32_partitions"]
    if zero._offloaded is not None:
        zero._offloaded.load_state_dict(
            {"optimizer": state["optimizer"], "fp32_partitions": masters}
        )
    else:
        for s, t in zip(zero.sub_groups, masters, strict=True):
            s.master.copy_(t)
        zero.optimizer.load_state_dict(state["optimizer"])
    if zero.loss_scaler is not None and state.get("grad_scaler") is not None:
        zero.loss_scaler.load_state_dict(state["grad_scaler"])
    zero.num_skipped_steps = int(state.get("num_skipped_steps", 0))
