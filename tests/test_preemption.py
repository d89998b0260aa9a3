"""``zerotron pretrain --save-on-signal`` (Megatron's ``--exit-signal-handler``), in one process:
the signal is caught and named, the previous handler comes back, and the flag needs --save. The
multi-rank save at one agreed iteration and the exact resume are
tests/distributed/test_elastic.py."""

from __future__ import annotations

import os
import signal

import pytest

from zerotron.config import parse_megatron_args
from zerotron.errors import ConfigError
from zerotron.training.preemption import Preemption
from zerotron.training.pretrain import pretrain

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1",
        "--lr", "1e-3"]  # fmt: skip


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_is_caught_named_and_the_old_handler_restored(name):
    num = getattr(signal, name)
    before = signal.getsignal(num)
    with Preemption() as p:
        assert p.agreed() is None
        os.kill(os.getpid(), num)
        os.kill(os.getpid(), signal.SIGUSR1 if name == "SIGTERM" else signal.SIGTERM)
        assert p.agreed() == name  # the first signal is the one named
    assert signal.getsignal(num) is before


def test_megatron_spelling_is_the_same_flag():
    cfg = parse_megatron_args(
        [*TINY, "--exit-signal-handler", "--save", "/tmp/x", "--save-interval", "5"], world_size=1
    )
    assert cfg.checkpoint.save_on_signal is True


def test_save_on_signal_needs_somewhere_to_save():
    cfg = parse_megatron_args([*TINY, "--save-on-signal"], world_size=1)
    with pytest.raises(ConfigError, match="nowhere to save it"):
        pretrain(cfg)
