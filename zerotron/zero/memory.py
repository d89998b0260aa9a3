"""What a ZeRO rank holds in memory, found by walking its tensors (not by formula).

Each tensor's *storage* is counted once, whichever kind reaches it first (views into one flat
buffer cost the buffer once), so the totals are what the allocator holds for these tensors.
Kinds: ``params`` (the model's parameters as they are now: whole, or stage 3's shards),
``grads`` (full ``.grad`` tensors and the reduced gradient partitions), ``optimizer_states``
(fp32 master partitions and every tensor in the optimizer's state). States that offload keeps
in files are not in memory and are not counted.

The ZeRO paper's formulas (16-bit params, Adam, Ψ parameters, N ranks) to compare with:
stage 1: 2Ψ + 2Ψ + 12Ψ/N; stage 2: 2Ψ + (2 + 12)Ψ/N; stage 3: (2 + 2 + 12)Ψ/N.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor


class _Walker:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes(self, tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, Tensor) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _state_tensors(state: Any) -> Iterable[Tensor]:
    if isinstance(state, Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _state_tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _state_tensors(v)


def memory_report(zero: Any) -> dict[str, int]:
    """``{"params", "grads", "optimizer_states", "total"}`` bytes held by this ZeRO rank.

    ``zero`` is a :class:`~zerotron.zero.optimizer.ZeroOptimizer`.
    """
    walk = _Walker()
    model_params = list(zero.model.parameters())
    # States first: stage 3's shards may be views of the masters (counted here, once).
    if zero._offloaded is not None:  # it knows what it keeps resident (NVMe: a few slots)
        states = zero._offloaded.resident_state_bytes()
    else:
        masters = [s.master for s in zero.sub_groups]
        states = walk.bytes(masters + list(_state_tensors(zero.optimizer.state)))
    params = walk.bytes(
        [p.data for p in model_params] + [getattr(p, "ds_tensor", None) for p in model_params]
    )
    grads = walk.bytes(
        [p.grad for p in model_params]
        + [s.grad for s in zero.sub_groups]
        + [s.master.grad for s in zero.sub_groups]
    )
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": states,
        "total": params + grads + states,
    }
