"""RNG tracker on 4 gloo ranks (tp2 x dp2): tensor-parallel ranks share the default stream and
differ in the model-parallel one; data-parallel replicas draw the same masks."""

import torch

from tests.test_rng_tracker import draws
from zerotron.distributed.rng import get_rng_tracker, model_parallel_seed
from zerotron.distributed.state import initialize_model_parallel

from .spawn import run_ranks


def _seeded_rank(rank):
    s = initialize_model_parallel(2)  # 4 ranks: tp [0,1] [2,3], dp [0,2] [1,3]
    model_parallel_seed(1234)
    before = torch.rand(4)
    with get_rng_tracker().fork():
        mp = torch.rand(4)
    after = torch.rand(4)
    return s.tp_rank, before, mp, after


def test_tensor_parallel_ranks_share_the_default_stream_only():
    results = run_ranks(_seeded_rank, 4)
    ref_default = draws(1234, 4, 4)
    for tp_rank, before, mp, after in results:
        assert torch.equal(before, ref_default[0]) and torch.equal(after, ref_default[1])
        assert torch.equal(mp, draws(1234 + 2718 + tp_rank, 4)[0])
    assert [r[0] for r in results] == [0, 1, 0, 1]
    assert not torch.equal(results[0][2], results[1][2])  # TP ranks: different dropout masks
    assert torch.equal(results[0][2], results[2][2])  # DP replicas: the same ones
