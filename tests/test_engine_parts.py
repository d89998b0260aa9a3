"""The Engine's parts on their own: which optimizer part a wrapper gets and what it answers,
the one timer implementation, the monitors' per-step events, and the checkpoint fitter that
re-pads a vocabulary."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotron.checkpoint.fit import StateFitter, VocabPadding
from zerotron.engine.monitors import training_events
from zerotron.engine.optimizers import MixedPrecisionPart, Zero3Part, ZeroPart, optimizer_part
from zerotron.engine.timers import NullTimers, Timers, wall_clock_line
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.precision import MixedPrecisionOptimizer


class FakeZero:
    """Just what the parts read of a ZeroOptimizer."""

    def __init__(self, stage: int):
        self.stage = stage
        self.group = type("Group", (), {"size": 2})()


def test_optimizer_part_follows_the_wrapper():
    model = nn.Linear(2, 2)
    mixed = optimizer_part(MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
    assert type(mixed) is MixedPrecisionPart and mixed.zero_stage == 0 and not mixed.grads_freed
    assert type(optimizer_part(FakeZero(1))) is ZeroPart
    assert type(optimizer_part(FakeZero(2))) is ZeroPart
    part = optimizer_part(FakeZero(3))
    assert type(part) is Zero3Part and part.zero_stage == 3 and part.grads_freed


def test_zero_part_is_its_own_data_parallel_part_and_refuses_another():
    zero = FakeZero(1)
    part = ZeroPart(zero)
    assert part.data_parallel(None) is zero
    assert part.data_parallel(zero) is zero
    with pytest.raises(ConfigError, match="another data-parallel part"):
        part.data_parallel(object())
    assert part.checkpoint_entries() == {"zero_stage": 1, "dp_world_size": 2}


def test_zero_above_stage_1_refuses_a_pipeline():
    ZeroPart(FakeZero(1)).check_pipeline(object())
    ZeroPart(FakeZero(2)).check_pipeline(None)
    with pytest.raises(UnsupportedError, match="ZeRO stage 2 with pipeline"):
        ZeroPart(FakeZero(2)).check_pipeline(object())


def test_partitioned_optimizer_state_is_not_refitted():
    with pytest.raises(CheckpointError, match="vocabulary padding differs"):
        ZeroPart(FakeZero(1)).load_optimizer_state({}, nn.Linear(1, 1), ["w"], print, "here")


def test_timers_accumulate_and_reset():
    timers = Timers()
    timers("a").start()
    timers("a").stop()
    assert timers("a").elapsed(reset=False) > 0
    line = timers.log_line(["a", "missing"])
    assert line.startswith(" time (ms) | a: ") and "missing" not in line
    assert timers("a").elapsed() == 0.0
    with pytest.raises(AssertionError, match="not started"):
        timers("a").stop()
    null = NullTimers()
    null("x").start()
    assert null("x").elapsed() == 0.0


def test_wall_clock_line():
    line = wall_clock_line({"forward": 1.234, "step": 2.0}, 10)
    assert line == "[step 10] time (ms) | forward: 1.23 | step: 2.00"


def test_training_events():
    losses = [torch.tensor(1.0), torch.tensor(3.0)]
    assert training_events(losses, 0.5, None, 64) == [
        ("Train/Samples/train_loss", 2.0, 64),
        ("Train/Samples/lr", 0.5, 64),
    ]
    assert training_events([], 0.5, 1024.0, 8) == [
        ("Train/Samples/lr", 0.5, 8),
        ("Train/Samples/loss_scale", 1024.0, 8),
    ]


class Embedder(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.embedding = nn.Embedding(rows, 3)
        self.norm = nn.LayerNorm(3)


def test_vocab_padding_repads_weights_and_adam_state():
    """A checkpoint with 8 padded rows (5 real) loads into a model with 6: real rows kept, in
    the weights and in Adam's moments; the plain fitter refuses the same checkpoint."""
    saved = Embedder(8)
    opt = MixedPrecisionOptimizer(torch.optim.Adam(saved.parameters(), lr=0.1))
    saved.embedding.weight.sum().backward()
    opt.step()
    weights, opt_state = saved.state_dict(), opt.state_dict()
    meta = {"vocab": {"size": 5}}

    with pytest.raises(CheckpointError, match="embedding.weight"):
        StateFitter().load_model_state(
            Embedder(6), weights, meta=meta, model_config=None, where="ckpt"
        )

    model = Embedder(6)
    fitter = VocabPadding(keys=("embedding.weight",), vocab_size=5, padded_size=6)
    refitted = fitter.load_model_state(model, weights, meta=meta, model_config=None, where="c")
    assert refitted == ["embedding.weight"]
    assert torch.equal(model.embedding.weight[:5], weights["embedding.weight"][:5])
    assert not model.embedding.weight[5:].any()

    new_opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    fitter.fit_optimizer_state(new_opt, model, opt_state, refitted, meta)
    new_opt.load_state_dict(opt_state)
    moment = new_opt.state_dict()["optimizer"]["state"][0]["exp_avg"]
    assert moment.shape == (6, 3) and not moment[5:].any()
