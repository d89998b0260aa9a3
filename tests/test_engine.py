"""The Engine as a user of DeepSpeed's API drives it: engine(batch), backward, step, get_lr,
accumulation boundaries, checkpoints with client state, and fp16 overflow skipping.

Engines are built by ``build_run`` from Megatron flags (the tiny 2-layer, 64-wide GPT-2); batches
are random token ids, so no data files are needed.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerotron.checkpoint.layout import DEEPSPEED_TRACKER, MEGATRON_TRACKER
from zerotron.config import parse_megatron_args
from zerotron.engine import Engine
from zerotron.training.build import Run, build_run, lm_loss

SEQ, VOCAB = 32, 50257


def build(*extra: object) -> Run:
    argv = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4]
    argv += ["--seq-length", SEQ, "--lr", 1e-3, "--seed", 1234]
    return build_run(parse_megatron_args([str(a) for a in [*argv, *extra]]))


def batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` samples of random tokens; the loss counts every position."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return {
        "tokens": ids[:, :-1],
        "labels": ids[:, 1:],
        "loss_mask": torch.ones(n, SEQ),
        "position_ids": torch.arange(SEQ).expand(n, SEQ),
    }


def cat(*batches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def masters(engine: Engine) -> list[torch.Tensor]:
    return [m.clone() for m in engine.optimizer.master_params]


def adam_state(engine: Engine) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in engine.optimizer.optimizer.state[m].items()}
        for m in engine.optimizer.master_params
        if m in engine.optimizer.optimizer.state
    ]


def assert_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal(x, y)
    else:
        assert torch.equal(a, b)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


NO_DROPOUT = ("--hidden-dropout", 0, "--attention-dropout", 0)


def test_accumulating_two_micro_batches_equals_one_step_on_both():
    mb1, mb2 = batch(2, seed=1), batch(2, seed=2)
    flags = (*NO_DROPOUT, "--train-iters", 10, "--lr-warmup-iters", 2)
    acc = build(*flags, "--micro-batch-size", 2, "--global-batch-size", 4).engine
    one = build(*flags, "--micro-batch-size", 4, "--global-batch-size", 4).engine
    assert acc.gradient_accumulation_steps() == 2 and one.gradient_accumulation_steps() == 1
    assert acc.train_batch_size() == one.train_batch_size() == 4
    assert_equal(weights(acc), weights(one))  # same seed, same model
    assert acc.get_lr() == one.get_lr() == [0.0, 0.0]  # warmup starts at 0

    losses = []
    for i, mb in enumerate((mb1, mb2)):
        losses.append(lm_loss(acc, mb))  # engine(batch...) is the model's forward
        acc.backward(losses[-1])
        assert acc.is_gradient_accumulation_boundary() == (i == 1)
        if i == 0:
            assert acc.step() is None  # not at the boundary: nothing happens
            assert acc.global_steps == 0 and acc.get_lr() == [0.0, 0.0]
    acc_grads = [p.grad.clone() for p in acc.module.parameters()]
    big = lm_loss(one, cat(mb1, mb2))
    one.backward(big)
    assert one.is_gradient_accumulation_boundary()
    one_grads = [p.grad.clone() for p in one.module.parameters()]

    assert abs((losses[0] + losses[1]).item() / 2 - big.item()) <= 1e-6 * big.item()
    for g_acc, g_one in zip(acc_grads, one_grads):
        assert rel(g_acc, g_one) < 1e-6
    r_acc, r_one = acc.step(), one.step()
    assert r_acc.update_successful and r_one.update_successful
    assert abs(r_acc.grad_norm - r_one.grad_norm) <= 1e-6 * r_one.grad_norm
    for (name, w_acc), w_one in zip(weights(acc).items(), weights(one).values()):
        assert (w_acc - w_one).abs().max().item() < 1e-9, name
    # One step advanced the scheduler by one global batch (4 samples of an 8-sample warmup).
    assert acc.get_lr() == one.get_lr() == [1e-3 / 2, 1e-3 / 2]
    assert (acc.global_steps, acc.global_samples) == (one.global_steps, one.global_samples)
    assert (acc.global_steps, acc.global_samples) == (1, 4)


def train_step(engine: Engine, *micro_batches: dict[str, torch.Tensor]) -> torch.Tensor:
    return engine.train_batch(iter(micro_batches))


def test_checkpoint_round_trip_with_client_state_and_latest(tmp_path):
    flags = (*NO_DROPOUT, "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 10)
    a = build(*flags).engine
    mbs = [batch(2, seed=s) for s in range(6)]
    train_step(a, mbs[0], mbs[1])
    client = {"epoch": 3, "note": "hello", "ids": torch.arange(5)}
    path = a.save_checkpoint(tmp_path, client_state=client)
    assert path == tmp_path / "global_step1"
    train_step(a, mbs[2], mbs[3])
    a.save_checkpoint(tmp_path, client_state={"epoch": 4})
    # DeepSpeed's tracker names the newest tag; Megatron's cannot name a non-iteration tag.
    assert (tmp_path / DEEPSPEED_TRACKER).read_text().strip() == "global_step2"
    assert not (tmp_path / MEGATRON_TRACKER).exists()

    b = build(*flags, "--seed", 99).engine  # other initial weights
    assert any(not torch.equal(x, y) for x, y in zip(weights(a).values(), weights(b).values()))
    where, got = b.load_checkpoint(tmp_path)  # tag None: follow `latest`
    assert where.endswith("global_step2") and got == {"epoch": 4}
    assert_equal(weights(a), weights(b))
    assert_equal(adam_state(a), adam_state(b))
    assert b.get_lr() == a.get_lr() and (b.global_steps, b.global_samples) == (2, 8)
    loss_a, loss_b = train_step(a, mbs[4], mbs[5]), train_step(b, mbs[4], mbs[5])
    assert loss_a.item() == loss_b.item()
    assert_equal(weights(a), weights(b))  # the resumed engine continues bitwise

    c = build(*flags, "--seed", 99).engine
    where, got = c.load_checkpoint(tmp_path, tag="global_step1")
    assert where.endswith("global_step1")
    assert got.keys() == {"epoch", "note", "ids"}
    assert got["epoch"] == 3 and got["note"] == "hello" and torch.equal(got["ids"], torch.arange(5))
    assert (c.global_steps, c.global_samples) == (1, 4)

    d = build(*flags, "--seed", 99).engine
    assert d.load_checkpoint(tmp_path, load_module_only=True)[1] == {}
    assert (d.global_steps, d.global_samples) == (0, 0) and not adam_state(d)


FP16 = (
    *NO_DROPOUT,  # the poisoned forwards must not shift the engine's dropout RNG stream
    *("--fp16", "--initial-loss-scale", 4096, "--hysteresis", 3, "--lr-warmup-iters", 2),
    *("--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 10),
)


@pytest.fixture
def poisoned_engine() -> tuple[Engine, dict[str, bool]]:
    """An fp16 engine whose loss becomes inf (so its gradients overflow) while ``flag['on']``."""
    engine = build(*FP16).engine
    flag = {"on": False}

    def loss_fn(model, b):
        loss = lm_loss(model, b)
        return loss * math.inf if flag["on"] else loss

    engine.loss_fn = loss_fn
    return engine, flag


def snapshot(engine: Engine) -> tuple:
    return weights(engine), masters(engine), adam_state(engine)


def test_fp16_overflow_skips_the_step_and_halves_the_scale_after_hysteresis(poisoned_engine):
    engine, poison = poisoned_engine
    reference = build(*FP16).engine  # never sees an overflow
    mbs = [batch(2, seed=s) for s in range(8)]
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    assert engine.cur_scale == 4096.0

    train_step(engine, mbs[0], mbs[1])
    train_step(reference, mbs[0], mbs[1])
    assert engine.last_step.update_successful and engine.skipped_steps == 0
    lr, sched_steps = engine.get_lr(), engine.lr_scheduler.num_steps
    assert sched_steps == 4

    for overflow in (1, 2):  # within the hysteresis: skipped, scale kept
        before = snapshot(engine)
        poison["on"] = True
        loss = train_step(engine, mbs[2], mbs[3])
        poison["on"] = False
        assert loss.item() == math.inf
        assert not engine.last_step.update_successful and engine.last_step.grad_norm is None
        assert engine.skipped_steps == overflow
        assert_equal(snapshot(engine), before)  # fp16 weights, fp32 masters, Adam moments
        assert engine.get_lr() == lr and engine.lr_scheduler.num_steps == sched_steps
        assert engine.cur_scale == 4096.0
        assert all(p.grad is None for p in engine.module.parameters())
        assert all(not p.main_grad.any() for p in engine.module.parameters())

    # The skipped steps left no trace: the next step equals the reference's second step.
    train_step(engine, mbs[4], mbs[5])
    train_step(reference, mbs[4], mbs[5])
    assert engine.last_step.update_successful and reference.last_step.update_successful
    assert_equal(snapshot(engine), snapshot(reference))
    assert engine.get_lr() == reference.get_lr() != lr

    poison["on"] = True  # the third overflow spends the hysteresis: the scale halves
    train_step(engine, mbs[6], mbs[7])
    assert engine.skipped_steps == 3 and engine.cur_scale == 2048.0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_frees_its_optimizer(stage):
    """Nothing global keeps an Engine's optimizer (masters, moments, gradient buckets) alive
    after the run is dropped: gradient hooks hold their owners weakly (precision.weak_hook)."""
    import gc
    import weakref

    run = build("--bf16", "--micro-batch-size", 2, "--train-iters", 2, "--zero-stage", stage)
    train_step(run.engine, batch(2, seed=0))
    gone = weakref.ref(run.engine.optimizer)
    del run
    gc.collect()
    assert gone() is None
