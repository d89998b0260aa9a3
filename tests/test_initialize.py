"""zerotron.initialize (DeepSpeed's API) in one process: exact equality with hand-written torch
loops, optimizer and scheduler sources, DeepSpeed's LR schedules against their closed forms,
data loader, precision, argument parsing, checkpoints with client_state."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import zerotron
from zerotron.errors import ConfigError
from zerotron.optim import Adagrad, Lion, build_ds_scheduler

LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.99)
MICRO, GAS, STEPS = 4, 2, 4


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 1, generator=g)) for _ in range(n)
    ]


def ds_config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": BETAS}},
        **extra,
    }


def train_engine(engine, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def reference(data, clip: float = 0.0) -> tuple[nn.Module, list[float]]:
    """The same training written with torch alone (fused AdamW: what build_optimizer picks)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    losses = []
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y)
        (loss / GAS).backward()
        losses.append(loss.item())
        if (i + 1) % GAS == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, losses


def test_fp32_stage0_equals_torch_adamw_loop_exactly(capsys):
    data = batches(STEPS * GAS)
    model = mlp()
    config = ds_config(gradient_clipping=0)  # DeepSpeed clips at 1.0 by default; torch's loop not
    engine, optimizer, loader, scheduler = zerotron.initialize(model=model, config=config)
    assert loader is None and scheduler is None and optimizer is engine.optimizer
    assert engine.train_batch_size() == MICRO * GAS and engine.zero_optimization_stage() == 0
    losses = train_engine(engine, data)
    ref, ref_losses = reference(data)
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert engine.global_steps == STEPS
    # The resolved config is printed once, with the derived batch size.
    out = capsys.readouterr().out
    assert out.count("auto values resolved") == 1 and '"train_batch_size": 8' in out


def test_gradient_clipping_from_config_equals_torch_clip():
    data = batches(STEPS * GAS)
    model = mlp()
    engine, *_ = zerotron.initialize(model=model, config=ds_config(gradient_clipping=0.05))
    losses = train_engine(engine, data)
    ref, ref_losses = reference(data, clip=0.05)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_optimizer_from_config_passed_or_callable_train_alike():
    data = batches(STEPS * GAS)
    config_only = {k: v for k, v in ds_config().items() if k != "optimizer"}

    def adamw(params):
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, fused=True)

    results = []
    for how in ("config", "passed", "callable"):
        model = mlp()
        if how == "config":
            engine, *_ = zerotron.initialize(model=model, config=ds_config())
        elif how == "passed":
            engine, *_ = zerotron.initialize(
                model=model, optimizer=adamw(model.parameters()), config=config_only
            )
        else:
            engine, *_ = zerotron.initialize(
                model=model,
                model_parameters=model.parameters(),
                optimizer=adamw,
                config=config_only,
            )
        results.append(
            (train_engine(engine, data), [p.detach().clone() for p in model.parameters()])
        )
    for losses, params in results[1:]:
        assert losses == results[0][0]
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][1]))


def test_config_optimizer_defaults_are_deepspeeds():
    # DeepSpeed's Adam: AdamW mode, weight_decay 0, betas (0.9, 0.999), eps 1e-8.
    engine, opt, *_ = zerotron.initialize(
        model=mlp(),
        config={"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.5}}},
    )
    inner = opt.optimizer
    assert isinstance(inner, torch.optim.AdamW)
    assert inner.defaults["weight_decay"] == 0 and inner.defaults["betas"] == (0.9, 0.999)
    assert engine.gradient_clipping() == 1.0 and engine.steps_per_print() == 10
    _, opt, *_ = zerotron.initialize(
        model=mlp(),
        config={
            "train_batch_size": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 0.5, "adam_w_mode": False}},
        },
    )
    assert type(opt.optimizer) is torch.optim.Adam
    _, opt, *_ = zerotron.initialize(
        model=mlp(), config={"train_batch_size": 2, "optimizer": {"type": "Lamb"}}
    )
    assert type(opt.optimizer).__name__ == "Lamb"


@pytest.mark.parametrize(
    "kind,params",
    [
        ("Lion", {"lr": 1e-3, "betas": [0.95, 0.98], "weight_decay": WD}),
        ("Adagrad", {"lr": LR, "eps": 1e-6, "weight_decay": WD}),
    ],
)
def test_config_lion_and_adagrad_train_as_the_class_passed(kind, params):
    """DeepSpeed's Lion / Adagrad from the config are zerotron.optim's classes with the config's
    hyperparameters, and train bitwise as the same class passed as the client optimizer."""
    cls = {"Lion": Lion, "Adagrad": Adagrad}[kind]
    hyper = {k: tuple(v) if k == "betas" else v for k, v in params.items()}
    data = batches(STEPS * GAS)
    config = ds_config(optimizer={"type": kind, "params": params})
    model = mlp()
    engine, opt, *_ = zerotron.initialize(model=model, config=config)
    assert type(opt.optimizer) is cls
    assert {k: opt.optimizer.defaults[k] for k in hyper} == hyper
    losses = train_engine(engine, data)
    client = mlp()
    no_opt = {k: v for k, v in config.items() if k != "optimizer"}
    engine, *_ = zerotron.initialize(
        model=client, optimizer=cls(client.parameters(), **hyper), config=no_opt
    )
    assert losses == train_engine(engine, data)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), client.parameters()))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_torch_scheduler_over_a_group_left_empty_follows_the_zero_optimizer(stage):
    # The HF Trainer under PEFT: decay and no-decay groups, the second empty (every trainable
    # parameter decays), and a torch scheduler built over them before initialize.
    def run(zero_stage: int) -> tuple[list[float], list[float]]:
        model = mlp()
        opt = torch.optim.AdamW(
            [{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}], lr=LR
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
        config["zero_optimization"] = {"stage": zero_stage}
        engine, wrapped, _, _ = zerotron.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=config
        )
        losses = train_engine(engine, batches(GAS * STEPS))
        return losses, [g["lr"] for g in wrapped.param_groups]

    zero_losses, lrs = run(stage)
    plain_losses, plain_lrs = run(0)
    assert zero_losses == plain_losses
    assert lrs == plain_lrs == [LR * 0.5**STEPS] * 2  # both groups: the empty one is kept


def test_a_torch_scheduler_over_groups_zero_splits_is_refused_with_the_fix():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    config = {"train_micro_batch_size_per_gpu": MICRO}
    config["zero_optimization"] = {"stage": 2, "sub_group_size": 100}  # the model: 161 elements
    with pytest.raises(ConfigError, match="built over 1 param groups, but ZeRO steps 2") as e:
        zerotron.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    assert "sub_group_size" in e.value.fix


def test_without_an_optimizer_the_engine_runs_forward_passes_only():
    model, x = mlp(), torch.randn(2, 8)
    engine, opt, _, sched = zerotron.initialize(model=model, config={"train_batch_size": 2})
    assert (opt, sched, engine.optimizer) == (None, None, None)
    with torch.no_grad():
        assert torch.equal(engine(x), model(x))
    with pytest.raises(ConfigError, match="this engine has no optimizer") as e:
        engine.backward(engine(x).sum())
    assert "pass optimizer=" in e.value.fix


def test_conflicting_configs_are_errors():
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        zerotron.initialize(model=mlp())
    args = argparse.Namespace(deepspeed_config="ds.json")
    with pytest.raises(ConfigError, match="both to initialize"):
        zerotron.initialize(args=args, model=mlp(), config=ds_config())


# ---- DeepSpeed's schedules against the formulas of its documentation


def closed_form(kind: str, n: int, p: dict, base_lr: float) -> float:
    """DeepSpeed's documented formulas, at last_batch_iteration n (n = -1 before any step)."""
    w = max(2, p.get("warmup_num_steps", 1000))
    log = p.get("warmup_type", "log") == "log"

    def warm(n):
        return math.log(n + 1) / math.log(w) if log else n / w

    if kind in ("WarmupLR", "WarmupDecayLR"):
        lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", base_lr)
        if n < 0:
            return lo
        if n < w:
            gamma = warm(n)
        elif kind == "WarmupLR":
            gamma = 1.0
        else:
            t = p["total_num_steps"]
            gamma = max(0.0, (t - n) / max(1.0, t - w))
        return lo + (hi - lo) * gamma
    if kind == "WarmupCosineLR":
        if n < 0:
            return 0.0
        r0, c, t = (
            p.get("warmup_min_ratio", 0.0),
            p.get("cos_min_ratio", 1e-4),
            p["total_num_steps"],
        )
        if n < w:
            return base_lr * (r0 + (1 - r0) * warm(n))
        progress = min(1.0, (n - w + 1) / max(1, t - w))
        return base_lr * (c + (1 - c) * (1 + math.cos(math.pi * progress)) / 2)
    if kind == "OneCycle":
        lo, hi, s1 = p["cycle_min_lr"], p["cycle_max_lr"], p["cycle_first_step_size"]
        s2 = p.get("cycle_second_step_size") or s1
        if n < 0:
            return lo
        it = n + 1
        if it <= s1:
            return lo + (hi - lo) * it / s1
        if it <= s1 + s2:
            return hi - (hi - lo) * (it - s1) / s2
        d, rate = p.get("decay_step_size", 0), p.get("decay_lr_rate", 0.0)
        return lo if not (d and rate) else lo / (1 + rate * (n - s1 - s2 + 1) / d)
    if kind == "LRRangeTest":
        lo, size, rate = (
            p["lr_range_test_min_lr"],
            p["lr_range_test_step_size"],
            p["lr_range_test_step_rate"],
        )
        interval = (n + 1) / size
        if p.get("lr_range_test_staircase"):
            interval = math.floor(interval)
        return lo * (1 + rate * interval)
    raise AssertionError(kind)


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 5, "total_num_steps": 20}),
    (
        "WarmupDecayLR",
        {
            "warmup_max_lr": 0.02,
            "warmup_num_steps": 4,
            "total_num_steps": 12,
            "warmup_type": "linear",
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3, "cos_min_ratio": 0.2}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.002,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 3,
            "cycle_second_step_size": 5,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 0.001,
            "lr_range_test_step_size": 3,
            "lr_range_test_step_rate": 2.0,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 0.001,
            "lr_range_test_step_size": 3,
            "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": True,
        },
    ),
]


@pytest.mark.parametrize("kind,params", SCHEDULES)
def test_ds_schedule_matches_closed_form(kind, params):
    base_lr = 0.05
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=base_lr)
    sched = build_ds_scheduler(kind, opt, params)
    got, want = [], []
    for n in range(-1, 30):
        if n >= 0:
            sched.step()
        got.append(opt.param_groups[0]["lr"])
        want.append(closed_form(kind, n, params, base_lr))
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if kind == "OneCycle":  # Adam's beta1 cycles against the lr (0.9 at the peak lr: 0.8)
        assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_scheduler_state_round_trips():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = build_ds_scheduler(
        "WarmupCosineLR", opt, {"total_num_steps": 10, "warmup_num_steps": 3}
    )
    for _ in range(4):
        sched.step()
    state, lr = sched.state_dict(), opt.param_groups[0]["lr"]
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    other = build_ds_scheduler(
        "WarmupCosineLR", opt2, {"total_num_steps": 10, "warmup_num_steps": 3}
    )
    other.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == lr and other.last_batch_iteration == 3


def test_engine_steps_config_scheduler_once_per_optimizer_step():
    params = {"warmup_max_lr": LR, "warmup_num_steps": 3, "total_num_steps": 6}
    config = ds_config(scheduler={"type": "WarmupDecayLR", "params": params})
    engine, _, _, sched = zerotron.initialize(model=mlp(), config=config)
    used = []
    for i, (x, y) in enumerate(batches(6 * GAS)):
        if i % GAS == 0:
            used.append(engine.get_lr()[0])  # the lr this optimizer step runs at
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert used == pytest.approx(
        [closed_form("WarmupDecayLR", k - 1, params, LR) for k in range(6)]
    )
    assert sched.last_batch_iteration == 5


def test_auto_scheduler_values_from_args_and_passed_scheduler():
    args = argparse.Namespace(lr=0.03, warmup_steps=4, train_iters=9, deepspeed_config=None)
    config = ds_config(
        optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        scheduler={
            "type": "WarmupDecayLR",
            "params": {
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    )
    engine, opt, _, sched = zerotron.initialize(args=args, model=mlp(), config=config)
    assert (sched.max_lrs, sched.warmup_num_steps, sched.total_num_steps) == ([0.03], 4, 9)
    assert opt.optimizer.defaults["weight_decay"] == 0.0  # DeepSpeed's default; args has none
    # A torch scheduler passed in (or a callable building one) is stepped once per step.
    for passed in ("instance", "callable"):
        model = mlp()
        no_sched = {k: v for k, v in ds_config().items() if k != "optimizer"}
        torch_opt = torch.optim.SGD(model.parameters(), lr=1.0)

        def halve(o):
            return torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step)

        engine, _, _, sched = zerotron.initialize(
            model=model,
            optimizer=torch_opt,
            lr_scheduler=halve(torch_opt) if passed == "instance" else halve,
            config=no_sched,
        )
        train_engine(engine, batches(3 * GAS))
        assert engine.get_lr() == [0.125]


# ---- data, precision, arguments, checkpoints


def test_training_data_loader_micro_batches_and_collate():
    data = [(torch.full((3,), float(i)), torch.tensor([float(i)])) for i in range(20)]
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.utils.data.default_collate(items)

    _, _, loader, _ = zerotron.initialize(
        model=mlp(), config=ds_config(), training_data=data, collate_fn=collate
    )
    xs = torch.cat([x for x, _ in loader])
    assert seen == [MICRO] * 5
    assert sorted(xs[:, 0].tolist()) == [float(i) for i in range(20)]  # every sample once


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_casts_module_and_trains(dtype):
    model = mlp()
    section = {"enabled": True}
    if dtype == "fp16":  # a loss-scale key; DeepSpeed's bf16 section refuses it, as zerotron does
        section["initial_scale_power"] = 8
    config = ds_config(**{dtype: section})
    engine, opt, *_ = zerotron.initialize(model=model, config=config)
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert all(p.dtype == want for p in model.parameters())
    if dtype == "fp16":
        assert engine.cur_scale == 2.0**8
    epoch = [(x.to(want), y.to(want)) for x, y in batches(4 * GAS)]
    losses = train_engine(engine, epoch * 5)
    first, last = sum(losses[: len(epoch)]), sum(losses[-len(epoch) :])
    assert last < 0.9 * first


def test_fp16_auto_cast_casts_float_inputs():
    model = mlp()
    config = ds_config(fp16={"enabled": True, "auto_cast": True})
    engine, *_ = zerotron.initialize(model=model, config=config)
    x, y = batches(1)[0]  # fp32 inputs
    out = engine(x)
    assert out.dtype == torch.float16
    engine.backward(nn.functional.mse_loss(out.float(), y))
    # without auto_cast an fp32 input meets fp16 weights
    engine, *_ = zerotron.initialize(model=mlp(), config=ds_config(fp16={"enabled": True}))
    with pytest.raises(RuntimeError):
        engine(x)


def test_add_config_arguments():
    parser = zerotron.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--local_rank=1"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and args.local_rank == 1
    assert not args.zerotron and args.zerotron_config is None
    # A script that declares --local_rank itself keeps its own.
    own = argparse.ArgumentParser()
    own.add_argument("--local_rank", type=int, default=7)
    args = zerotron.add_config_arguments(own).parse_args(["--zerotron_config", "z.json"])
    assert args.local_rank == 7 and args.zerotron_config == "z.json"


def test_config_from_args_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(zero_optimization={"stage": 0})))
    parser = zerotron.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, *_ = zerotron.initialize(args=args, model=mlp(), model_parameters=None)
    assert engine.gradient_accumulation_steps() == GAS


def test_checkpoint_round_trip_with_client_state(tmp_path):
    data = batches(4 * GAS)
    model = mlp()
    engine, *_ = zerotron.initialize(model=model, config=ds_config())
    train_engine(engine, data[: 2 * GAS])
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "note": "x"})
    after = train_engine(engine, data[2 * GAS :])

    other = mlp(seed=5)
    engine2, *_ = zerotron.initialize(model=other, config=ds_config())
    path, client = engine2.load_checkpoint(tmp_path)
    assert client == {"epoch": 3, "note": "x"} and path.endswith("global_step2")
    assert engine2.global_steps == 2
    assert train_engine(engine2, data[2 * GAS :]) == after


def test_import_zerotron_is_cheap():
    code = "import sys, zerotron; print('torch' in sys.modules, callable(zerotron.initialize))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def _record_kernel_shapes(monkeypatch) -> list:
    """The shapes initialize() asks the kernel chooser about."""
    import zerotron.kernels

    shapes, choose = [], zerotron.kernels.choose_kernels

    def recording(shape, *args, **kwargs):
        shapes.append(shape)
        return choose(shape, *args, **kwargs)

    monkeypatch.setattr(zerotron.kernels, "choose_kernels", recording)
    return shapes


def test_a_zerotron_gpt_gets_the_kernel_choices_pretrain_makes(monkeypatch, capsys):
    from zerotron.kernels import KernelShape, current_choices
    from zerotron.models.gpt import GPT, GPTConfig

    monkeypatch.setenv("ZEROTRON_KERNELS", "linear=torch")  # the suite forces onednn
    shapes = _record_kernel_shapes(monkeypatch)
    config = GPTConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128
    )
    zerotron.initialize(model=GPT(config), config=ds_config())
    assert shapes == [KernelShape(64, 4, 16, MICRO, 128, "fp32", torch.get_num_threads())]
    assert current_choices().linear == "torch"
    assert capsys.readouterr().out.count("kernels: linear=torch (forced)") == 1


def test_a_model_without_a_zerotron_gpt_chooses_no_kernels(monkeypatch, capsys):
    from zerotron.kernels import current_choices

    before = current_choices()
    shapes = _record_kernel_shapes(monkeypatch)
    zerotron.initialize(model=mlp(), config=ds_config())
    assert shapes == [] and current_choices() == before
    assert "kernels:" not in capsys.readouterr().out
