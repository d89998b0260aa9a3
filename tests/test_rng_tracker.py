"""RNG tracker: forked streams draw what a generator with their seed draws, and leave the
default stream exactly where it was. (Tensor-parallel ranks: tests/distributed/
test_rng_tracker_ranks.py.)"""

import io

import pytest
import torch

from zerotron.distributed.rng import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_seed,
)
from zerotron.errors import DistributedError


def draws(seed, *sizes):
    """Consecutive torch.rand draws of a fresh generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, generator=g) for n in sizes]


def test_fork_draws_from_the_stream_and_restores_the_default():
    tracker = RNGStatesTracker()
    tracker.add("a", 7)
    torch.manual_seed(1)
    with tracker.fork("a"):
        first = torch.rand(3)
    between = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(2)
    after = torch.rand(5)
    # The stream continues across forks; the default stream never sees them.
    assert [torch.equal(x, y) for x, y in zip([first, second], draws(7, 3, 2))] == [True, True]
    assert [torch.equal(x, y) for x, y in zip([between, after], draws(1, 4, 5))] == [True, True]


def test_default_stream_is_restored_when_the_block_raises():
    tracker = RNGStatesTracker()
    tracker.add("a", 7)
    torch.manual_seed(2)
    with pytest.raises(KeyError), tracker.fork("a"):
        torch.rand(10)
        raise KeyError("inside")
    assert torch.equal(torch.rand(3), draws(2, 3)[0])
    with tracker.fork("a"):  # and the stream kept what it drew
        assert torch.equal(
            torch.rand(2), torch.rand(12, generator=torch.Generator().manual_seed(7))[10:]
        )


def test_add_leaves_the_default_stream_alone_and_refuses_duplicates():
    tracker = RNGStatesTracker()
    torch.manual_seed(3)
    tracker.add("a", 10)
    assert torch.equal(torch.rand(2), draws(3, 2)[0])
    with pytest.raises(DistributedError, match="'a' already exists"):
        tracker.add("a", 11)
    with pytest.raises(DistributedError, match="seed 10 is already used"):
        tracker.add("b", 10)
    with pytest.raises(DistributedError, match="'c' is not set up"), tracker.fork("c"):
        pass
    tracker.reset()
    assert tracker.names() == []
    tracker.add("a", 10)  # allowed again after reset


def test_states_round_trip_through_a_weights_only_checkpoint():
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, 5)
    with tracker.fork():
        torch.rand(3)
    saved = tracker.get_states()
    with tracker.fork():
        expected = torch.rand(4)
    buf = io.BytesIO()
    torch.save({"rng_tracker": saved}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["rng_tracker"]
    restored = RNGStatesTracker()
    restored.set_states(loaded)
    with restored.fork():
        assert torch.equal(torch.rand(4), expected)
    # get_states is a copy: drawing afterwards does not change what was saved.
    assert torch.equal(saved[MODEL_PARALLEL_RNG]["cpu"], loaded[MODEL_PARALLEL_RNG]["cpu"])
    with pytest.raises(DistributedError, match="has no 'cpu' state"):
        restored.set_states({"x": {}})


def test_model_parallel_seed_in_one_process():
    model_parallel_seed(42)
    assert model_parallel_cuda_manual_seed is model_parallel_seed
    assert get_rng_tracker().names() == [MODEL_PARALLEL_RNG]
    default = torch.rand(3)
    with get_rng_tracker().fork():
        mp = torch.rand(3)
    assert torch.equal(default, draws(42, 3)[0])
    assert torch.equal(mp, draws(42 + 2718 + 0, 3)[0])
    get_rng_tracker().reset()
