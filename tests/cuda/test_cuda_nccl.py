"""The nccl backend on one rank: zerotron's init picks nccl for CUDA and binds the group to this
rank's GPU, and collectives of the default group run on CUDA tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotron.distributed.init import destroy, init_distributed


def test_nccl_group_of_one_runs_collectives_on_the_gpu(device, backend, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rank, world = init_distributed(device=device.type, single_process_group=True)
    try:
        assert (rank, world) == (0, 1) and dist.get_backend() == backend
        t = torch.arange(6, dtype=torch.float32, device=device)
        out = t.clone()
        dist.all_reduce(out)
        gathered = torch.empty_like(t)
        dist.all_gather_into_tensor(gathered, t)
        dist.broadcast(out, 0)
        assert out.device == device and torch.equal(out, t) and torch.equal(gathered, t)
    finally:
        destroy()
