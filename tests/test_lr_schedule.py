"""OptimizerParamScheduler against closed-form learning rates written out here."""

from __future__ import annotations

import math

import pytest
import torch

from zerotron.errors import ConfigError
from zerotron.optim import OptimizerParamScheduler, get_param_groups

MAX, MIN = 6e-4, 6e-5


def make_opt(n_groups: int = 1) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(n_groups)]
    return torch.optim.SGD(groups, lr=123.0)


def lrs(sched: OptimizerParamScheduler, n: int, increment: int = 1) -> list[float]:
    """lr in effect at steps 0..n (step k's lr is read after k increments)."""
    out = [sched.optimizer.param_groups[0]["lr"]]
    for _ in range(n):
        sched.step(increment)
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def expected(n: int, style: str, warmup: float, decay: int) -> float:
    """The schedule in closed form, written independently of the implementation."""
    if warmup and n <= warmup:
        return MAX * n / warmup
    if style == "constant":
        return MAX
    if n >= decay:
        return MIN
    progress = (n - warmup) / (decay - warmup)
    if style == "linear":
        return MAX - (MAX - MIN) * progress
    return MIN + (MAX - MIN) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_schedule_matches_closed_form(style):
    s = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, min_lr=MIN, lr_warmup_steps=10, lr_decay_steps=100,
        lr_decay_style=style,
    )  # fmt: skip
    got = lrs(s, 130)
    want = [expected(n, style, 10, 100) for n in range(131)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    # Spot checks of the landmarks.
    assert got[0] == 0.0 and got[5] == pytest.approx(MAX / 2) and got[10] == pytest.approx(MAX)
    if style != "constant":
        assert got[55] == pytest.approx((MAX + MIN) / 2)  # halfway: linear and cosine agree
        assert got[100] == pytest.approx(MIN) and got[130] == MIN
    else:
        assert got[130] == MAX


def test_no_warmup_and_warmup_fraction():
    s = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, min_lr=MIN, lr_decay_steps=50, lr_decay_style="cosine"
    )
    assert lrs(s, 60) == pytest.approx(
        [expected(n, "cosine", 0, 50) for n in range(61)], rel=1e-12, abs=0
    )
    frac = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, min_lr=MIN, lr_warmup_fraction=0.1, lr_decay_steps=100,
        lr_decay_style="linear",
    )  # fmt: skip
    assert frac.lr_warmup_steps == pytest.approx(10.0)
    assert lrs(frac, 110) == pytest.approx(
        [expected(n, "linear", 10, 100) for n in range(111)], rel=1e-12, abs=0
    )


def test_samples_units_give_the_same_schedule():
    gbs = 32
    iters = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, min_lr=MIN, lr_warmup_steps=4, lr_decay_steps=40,
        lr_decay_style="cosine",
    )  # fmt: skip
    samples = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, min_lr=MIN, lr_warmup_steps=4 * gbs, lr_decay_steps=40 * gbs,
        lr_decay_style="cosine",
    )  # fmt: skip
    assert lrs(samples, 50, increment=gbs) == pytest.approx(lrs(iters, 50), rel=1e-12, abs=0)


def test_inverse_square_root():
    s = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, min_lr=MIN, lr_warmup_steps=4, lr_decay_steps=10_000,
        lr_decay_style="inverse-square-root",
    )  # fmt: skip
    got = lrs(s, 400)
    assert got[4] == pytest.approx(MAX)
    assert got[16] == pytest.approx(MAX / 2)  # sqrt(4/16)
    assert got[100] == pytest.approx(MAX / 5)
    assert got[400] == pytest.approx(MAX / 10)


def test_applies_to_every_group_with_mults_and_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = get_param_groups(model, weight_decay=0.1)
    groups[0]["lr_mult"] = 0.5
    opt = torch.optim.AdamW(groups, lr=1.0)
    s = OptimizerParamScheduler(
        opt, max_lr=MAX, min_lr=MIN, lr_warmup_steps=2, lr_decay_steps=10, start_wd=0.1
    )
    s.step(3)
    want = expected(3, "linear", 2, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * want)
    assert opt.param_groups[1]["lr"] == pytest.approx(want)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no-decay group kept
    # A group's own max_lr/min_lr override the scheduler's.
    opt.param_groups[1]["max_lr"] = 2 * MAX
    s.step(7)  # step 10: end of decay
    assert opt.param_groups[1]["lr"] == pytest.approx(MIN)
    s.step(-8)  # back to step 2: end of warmup
    assert opt.param_groups[1]["lr"] == pytest.approx(2 * MAX)


def test_weight_decay_increment():
    s = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, lr_decay_steps=100, start_wd=0.0, end_wd=0.1,
        wd_incr_steps=100, wd_incr_style="linear",
    )  # fmt: skip
    s.step(25)
    assert s.get_wd() == pytest.approx(0.025)
    s.wd_incr_style = "cosine"
    assert s.get_wd() == pytest.approx(0.1 * (1 - math.cos(math.pi * 0.25)) / 2)
    s.step(200)
    assert s.get_wd() == 0.1


def test_state_dict_round_trip_and_checkpoint_precedence():
    def make(max_lr=MAX, **kw):
        return OptimizerParamScheduler(
            make_opt(), max_lr=max_lr, min_lr=MIN, lr_warmup_steps=5, lr_decay_steps=60,
            lr_decay_style="cosine", **kw,
        )  # fmt: skip

    a = make()
    lrs(a, 37)
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 37
    assert lrs(b, 30) == lrs(a, 30)

    changed = make(max_lr=1e-3)
    with pytest.raises(ConfigError, match="max_lr"):
        changed.load_state_dict(a.state_dict())
    taken = make(max_lr=1e-3, use_checkpoint_opt_param_scheduler=True)
    taken.load_state_dict(a.state_dict())
    assert taken.max_lr == MAX and taken.get_lr() == a.get_lr()
    kept = make(max_lr=1e-3, override_opt_param_scheduler=True)
    kept.load_state_dict(a.state_dict())
    assert kept.max_lr == 1e-3 and kept.num_steps == a.num_steps

    # Megatron's older key names are understood.
    old = {"start_lr": MAX, "warmup_iter": 5, "end_iter": 60, "decay_style": "cosine"}
    c = make()
    c.load_state_dict({**old, "min_lr": MIN, "num_iters": 12})
    assert c.num_steps == 12


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"min_lr": 1.0}, "min-lr"),
        ({"lr_warmup_steps": 100}, "warmup"),
        ({"lr_decay_steps": 0}, "decay-iters"),
        ({"lr_decay_style": "wsd"}, "decay-style"),
        ({"lr_warmup_steps": 5, "lr_warmup_fraction": 0.1}, "warmup-fraction"),
    ],
)
def test_bad_settings_are_config_errors(kw, key):
    args = {"max_lr": MAX, "lr_decay_steps": 100, **kw}
    with pytest.raises(ConfigError, match=key):
        OptimizerParamScheduler(make_opt(), **args)


def test_constant_schedule_needs_no_decay_length():
    """--lr-decay-style constant --lr-decay-iters 0 passes the config; the scheduler agrees:
    warmup, then the peak for ever."""
    sched = OptimizerParamScheduler(
        make_opt(), max_lr=MAX, lr_decay_steps=0, lr_decay_style="constant", lr_warmup_steps=4
    )
    assert lrs(sched, 10) == pytest.approx([expected(n, "constant", 4, 0) for n in range(11)])
