"""Small checkpoint helpers with DeepSpeed's names (``deepspeed.checkpoint.utils`` is this module).

accelerate's ``Accelerator.get_state_dict`` calls :func:`clone_tensors_for_torch_save` before a
Hugging Face Trainer writes the model of a ZeRO stage 0-2 run.
"""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor in it (nested in lists, tuples and dicts) replaced by a
    detached copy on ``device``, so ``torch.save`` writes each tensor's own elements only, not
    the whole storage a view shares (a bucket, a flat buffer)."""
    if isinstance(item, torch.Tensor):
        device = torch.device(device)
        moved = item.detach().to(device)
        return moved.clone() if moved.data_ptr() == item.data_ptr() else moved
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
