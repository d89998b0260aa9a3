"""comm.all_reduce of a CPU tensor on a group whose backend takes CUDA tensors only (nccl)
stages it through the GPU: which groups need that (pure function, no process group)."""

import pytest
import torch

from zerotron.distributed import comm
from zerotron.distributed.comm import Group


class _FakeProcessGroup:  # weak-referenceable stand-in: comm caches backends by group
    pass


@pytest.mark.parametrize(
    ("backend", "staged"),
    [("nccl", True), ("gloo", False), ("mpi", False), ("cpu:gloo,cuda:nccl", False)],
)
def test_cpu_tensors_are_staged_on_cuda_only_backends(backend, staged):
    pg = _FakeProcessGroup()
    comm._backends[pg] = backend
    group = Group("dp", (0, 1), 0, pg)
    assert comm._cuda_only(torch.zeros(1), group) is staged
    assert comm._cuda_only(torch.zeros(1, device="meta"), group) is False  # not a CPU tensor
