"""The Engine as DeepSpeed's engine, in one process: an nn.Module wrapping the model (attributes
fall through to it), DeepSpeed's ranks, config questions and step results with their meaning,
plain ``loss.backward()`` equal to ``engine.backward(loss)`` (fp32, fp16 loss scaling, ZeRO 2,
gradient accumulation), DeepSpeed's checkpoint signatures, 16-bit saving and the throughput
timer."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import zerotron
from zerotron.engine.timers import ThroughputTimer
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError

MICRO, GAS = 4, 2


class Net(nn.Module):
    """A tiny MLP with a method and an attribute of its own (for the fall-through)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.custom_attribute = 7

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def describe(self) -> str:
        return f"net with {self.fc1.out_features} hidden"


class LossAndOutput(Net):
    """Returns ``(output, loss)`` like a Hugging Face model given labels: the loss is computed
    from the returned output inside forward."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(x)
        return out, nn.functional.mse_loss(out.float(), y.float())


def config(stage: int = 0, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    cfg.update(extra)
    return cfg


def engine_for(cfg: dict, model: nn.Module | None = None):
    engine, *_ = zerotron.initialize(model=model or Net(), config=cfg)
    return engine


def batches(n: int, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(MICRO, 8, generator=g).to(dtype), torch.randn(MICRO, 1, generator=g))
        for _ in range(n)
    ]


def params_of(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


# ---- an nn.Module wrapping the model ------------------------------------------------------------


def test_engine_is_an_nn_module_with_the_model_as_its_only_child():
    model = Net()
    engine = engine_for(config(), model)
    assert isinstance(engine, nn.Module) and engine.module is model
    assert dict(engine.named_children()) == {"module": model}
    assert [p for p in engine.parameters()] == [p for p in model.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [
        "module.fc1.weight",
        "module.fc1.bias",
        "module.fc2.weight",
        "module.fc2.bias",
    ]
    assert "module.fc1" in dict(engine.named_modules())


def test_engine_state_dict_is_the_modules_under_module_prefix():
    model = Net()
    engine = engine_for(config(), model)
    sd = engine.state_dict()
    assert list(sd) == [f"module.{k}" for k in model.state_dict()]
    assert all(torch.equal(sd[f"module.{k}"], v) for k, v in model.state_dict().items())


def test_unknown_attributes_fall_through_to_the_module():
    engine = engine_for(config())
    assert engine.custom_attribute == 7
    assert engine.describe() == "net with 16 hidden"
    assert engine.fc1 is engine.module.fc1


def test_an_attribute_neither_has_raises_attribute_error_naming_the_engine():
    engine = engine_for(config())
    with pytest.raises(AttributeError, match="'Engine' object has no attribute 'nope'"):
        _ = engine.nope


def test_a_refused_engine_method_says_why():
    engine = engine_for(config())
    assert not hasattr(engine, "offload_states")
    with pytest.raises(AttributeError, match="DeepSpeedEngine.offload_states is not served"):
        engine.offload_states()


def test_train_and_eval_switch_the_module_and_return_the_engine():
    engine = engine_for(config())
    assert engine.eval() is engine and not engine.module.training and not engine.training
    assert engine.train() is engine and engine.module.training and engine.training


def test_calling_the_engine_runs_the_module_and_nn_module_hooks():
    engine = engine_for(config())
    seen = []
    engine.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(MICRO, 8)
    with torch.no_grad():
        assert torch.equal(engine(x), engine.module(x))
    assert seen == [torch.Size([MICRO, 1])]


def test_loss_fn_module_is_not_registered_as_a_child():
    engine = engine_for(config())
    engine.loss_fn = nn.MSELoss()
    assert list(dict(engine.named_children())) == ["module"]


# ---- ranks, sizes, config questions --------------------------------------------------------------


def test_ranks_and_sizes_of_one_process():
    engine = engine_for(config())
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert (engine.dp_world_size, engine.mp_world_size) == (1, 1)
    assert engine.device == torch.device("cpu")
    assert engine.train_batch_size() == MICRO * GAS


@pytest.mark.parametrize(
    "extra,fp16,bf16",
    [
        ({}, False, False),
        ({"fp16": {"enabled": True}}, True, False),
        ({"bf16": {"enabled": True}}, False, True),
    ],
)
def test_fp16_and_bfloat16_enabled_say_the_training_dtype(extra, fp16, bf16):
    engine = engine_for(config(**extra))
    assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (fp16, bf16)


def test_steps_per_print_is_the_configs():
    assert engine_for(config(steps_per_print=7)).steps_per_print() == 7


def test_gradient_clipping_is_the_configs():
    assert engine_for(config(gradient_clipping=0.5)).gradient_clipping() == 0.5
    assert engine_for(config()).gradient_clipping() == 1.0  # DeepSpeed's default since 0.19.3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_questions_follow_the_stage(stage):
    engine = engine_for(config(stage))
    assert engine.zero_optimization_stage() == stage
    assert engine.zero_optimization() == (stage > 0)
    assert engine.zero_optimization_partition_gradients() == (stage >= 2)
    assert engine.zero_optimization_partition_weights() == (stage == 3)


def test_zero_offload_optimizer_gives_the_offload_options_when_on():
    on = config(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    assert engine_for(on).zero_offload_optimizer().device == "cpu"
    assert engine_for(on).zero_cpu_offload()
    assert engine_for(config(2)).zero_offload_optimizer() is None


def test_offload_param_below_stage_3_is_ignored():
    cfg = config(2, zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})
    engine = engine_for(cfg)
    assert engine.zero_offload_param() is None


def test_zero_gather_16bit_weights_on_model_save_is_the_configs():
    z = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    assert engine_for(config(3, zero_optimization=z)).zero_gather_16bit_weights_on_model_save()
    assert not engine_for(config(3)).zero_gather_16bit_weights_on_model_save()


def test_get_lr_and_get_mom_per_parameter_group():
    engine = engine_for(config())
    assert engine.get_lr() == [1e-2]
    assert engine.get_mom() == [(0.9, 0.999)]
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}}
    assert engine_for(config(optimizer=sgd)).get_mom() == [0.5]


# ---- step results ------------------------------------------------------------------------------


def micro_batch(engine, x, y):
    loss = nn.functional.mse_loss(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return loss


def test_was_step_applied_only_at_the_accumulation_boundary():
    engine = engine_for(config())
    assert not engine.was_step_applied()
    applied = []
    for x, y in batches(4):
        micro_batch(engine, x, y)
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]


def test_was_step_applied_is_false_for_a_step_skipped_on_overflow():
    engine = engine_for(config(fp16={"enabled": True, "initial_scale_power": 4}, **{
        "gradient_accumulation_steps": 1}))  # fmt: skip
    x, y = batches(1, torch.float16)[0]
    loss = nn.functional.mse_loss(engine(x).float(), y) * float("inf")
    engine.backward(loss)
    engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    assert engine.get_global_grad_norm() is None


def test_get_global_grad_norm_is_the_norm_of_the_averaged_gradients():
    engine = engine_for(config(gradient_clipping=1e-3))
    ref = Net()
    data = batches(GAS)
    for x, y in data:
        (nn.functional.mse_loss(ref(x), y) / GAS).backward()
        micro_batch(engine, x, y)
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
    assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-6)


def test_get_global_grad_norm_is_none_before_the_first_step():
    assert engine_for(config()).get_global_grad_norm() is None


def test_is_gradient_accumulation_boundary_names_the_current_micro_batch():
    engine = engine_for(config())
    seen = []
    for x, y in batches(4):
        before = engine.is_gradient_accumulation_boundary()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        seen.append((before, engine.is_gradient_accumulation_boundary()))
        engine.step()
    assert seen == [(False, False), (True, True)] * 2


def test_set_train_batch_size_changes_the_micro_batches_of_the_next_steps():
    """One step at GAS 2, then set_train_batch_size to 3 micro-batches a step: two more steps
    of 3 micro-batches each, as torch's AdamW over the same micro-batches steps them."""
    data = batches(2 + 3 + 3)
    resized = engine_for(config(gradient_clipping=0.0))  # the reference below does not clip
    for x, y in data[:2]:
        micro_batch(resized, x, y)
    resized.set_train_batch_size(3 * MICRO)
    assert (resized.gradient_accumulation_steps(), resized.train_batch_size()) == (3, 3 * MICRO)
    steps = []
    for x, y in data[2:]:
        micro_batch(resized, x, y)
        steps.append(resized.was_step_applied())
    assert steps == [False, False, True] * 2
    # the reference: the same optimizer steps by hand, each over its own micro-batches
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for chunk in (data[:2], data[2:5], data[5:]):
        for x, y in chunk:
            (nn.functional.mse_loss(ref(x), y) / len(chunk)).backward()
        opt.step()
        opt.zero_grad()
    got = params_of(resized)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_set_train_micro_batch_size_keeps_the_accumulation():
    engine = engine_for(config())
    engine.set_train_micro_batch_size(2)
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.train_batch_size() == 2 * GAS


def test_the_batch_size_cannot_change_inside_an_accumulation():
    engine = engine_for(config())
    x, y = batches(1)[0]
    micro_batch(engine, x, y)
    with pytest.raises(ConfigError, match="middle of a gradient accumulation .1 of 2"):
        engine.set_train_batch_size(4 * MICRO)
    with pytest.raises(ConfigError, match="not a positive multiple of"):
        engine_for(config()).set_train_batch_size(MICRO + 1)


def test_set_gradient_accumulation_boundary_lets_one_step_close_the_accumulation():
    """DeepSpeed's example: boundary False for the first micro-batches, True for the last,
    one step() at the end: the same parameters as the counted loop."""
    data = batches(GAS)
    counted = engine_for(config())
    for x, y in data:
        micro_batch(counted, x, y)
    manual = engine_for(config())
    manual.set_gradient_accumulation_boundary(False)
    for i, (x, y) in enumerate(data):
        if i == GAS - 1:
            manual.set_gradient_accumulation_boundary(True)
        manual.backward(nn.functional.mse_loss(manual(x), y))
    manual.step()
    assert manual.global_steps == counted.global_steps == 1
    a, b = params_of(counted), params_of(manual)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_set_gradient_accumulation_boundary_true_steps_every_micro_batch():
    engine = engine_for(config())
    engine.set_gradient_accumulation_boundary(True)
    for x, y in batches(3):
        micro_batch(engine, x, y)
    assert engine.global_steps == 3


# ---- loss.backward() as engine.backward(loss) ---------------------------------------------------

CASES = {
    "stage0_fp32": config(),
    "stage0_fp16": config(fp16={"enabled": True, "initial_scale_power": 8}),
    "stage2_fp32": config(2),
    "stage2_fp16": config(2, fp16={"enabled": True, "initial_scale_power": 8}),
    "stage1_bf16": config(1, bf16={"enabled": True}),
}


def train(cfg: dict, how: str, model: nn.Module | None = None) -> object:
    engine = engine_for(cfg, model)
    dtype = next(engine.parameters()).dtype
    for x, y in batches(3 * GAS, dtype):
        if isinstance(engine.module, LossAndOutput):
            loss = engine(x, y)[1]
        else:
            loss = nn.functional.mse_loss(engine(x).float(), y)
        if how == "engine":
            engine.backward(loss)
        elif how == "scale":
            engine.scale(loss).backward()
        else:
            loss.backward()
        engine.step()
    return engine


@pytest.mark.parametrize("case", list(CASES))
def test_loss_backward_trains_exactly_as_engine_backward(case):
    a, b = train(CASES[case], "engine"), train(CASES[case], "torch")
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert (b.micro_steps, b.global_steps, b.global_samples) == (
        a.micro_steps, a.global_steps, a.global_samples)  # fmt: skip
    assert b.cur_scale == a.cur_scale


def test_loss_backward_scales_by_the_loss_scale():
    """Under fp16 the gradients reaching the parameters are scaled (the optimizer unscales):
    after one micro-batch, the accumulated gradient is loss_scale / gas times the plain one."""
    engine = engine_for(config(fp16={"enabled": True, "initial_scale_power": 8}))
    ref = Net().half()
    x, y = batches(1, torch.float16)[0]
    nn.functional.mse_loss(engine(x).float(), y).backward()
    nn.functional.mse_loss(ref(x).float(), y).backward()
    grad = engine.module.fc2.bias
    got = getattr(grad, "main_grad", None)
    got = grad.grad if got is None else got
    assert engine.cur_scale == 2.0**8
    torch.testing.assert_close(got.float(), ref.fc2.bias.grad.float() * 2.0**8 / GAS)


def test_loss_backward_through_a_returned_output_and_loss_scales_once():
    """A model returning (output, loss made from output): the loss path is scaled once."""
    a = train(config(), "engine", LossAndOutput())
    b = train(config(), "torch", LossAndOutput())
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_outputs_can_be_modified_in_place_before_loss_backward():
    """Hugging Face's Trainer multiplies the returned loss in place before backward."""
    a, b = engine_for(config(), LossAndOutput()), engine_for(config(), LossAndOutput())
    for x, y in batches(GAS):
        la = a(x, y)[1]
        a.backward(la * 3)
        a.step()
        lb = b(x, y)[1]
        lb *= 3
        lb.backward()
        b.step()
    pa, pb = params_of(a), params_of(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_scale_then_backward_trains_exactly_as_engine_backward():
    cfg = config(fp16={"enabled": True, "initial_scale_power": 8})
    pa, pb = params_of(train(cfg, "engine")), params_of(train(cfg, "scale"))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_backward_returns_the_loss_divided_by_the_accumulation_steps():
    engine = engine_for(config())
    x, y = batches(1)[0]
    loss = nn.functional.mse_loss(engine(x), y)
    assert torch.equal(engine.backward(loss), loss / GAS)


# ---- checkpoints ---------------------------------------------------------------------------------


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_save_checkpoint_signature_is_deepspeeds():
    names = _parameters(engine_for(config()).save_checkpoint)[:5]
    assert names == [
        ("save_dir", inspect.Parameter.empty),
        ("tag", None),
        ("client_state", None),
        ("save_latest", True),
        ("exclude_frozen_parameters", False),
    ]


def test_load_checkpoint_signature_is_deepspeeds():
    names = _parameters(engine_for(config()).load_checkpoint)[:7]
    assert names == [
        ("load_dir", inspect.Parameter.empty),
        ("tag", None),
        ("load_module_strict", True),
        ("load_optimizer_states", True),
        ("load_lr_scheduler_states", True),
        ("load_module_only", False),
        ("custom_load_fn", None),
    ]


def test_save_16bit_model_signature_is_deepspeeds():
    assert _parameters(engine_for(config()).save_16bit_model) == [
        ("save_dir", inspect.Parameter.empty),
        ("save_filename", "pytorch_model.bin"),
        ("exclude_frozen_parameters", False),
    ]


def test_load_checkpoint_returns_path_and_client_state(tmp_path):
    engine = engine_for(config())
    engine.save_checkpoint(tmp_path, tag="t1", client_state={"epoch": 3})
    path, client = engine_for(config()).load_checkpoint(tmp_path)
    assert path == str(tmp_path / "t1") and client == {"epoch": 3}


def test_load_checkpoint_without_a_latest_file_returns_none_none(tmp_path):
    engine = engine_for(config())
    before = params_of(engine)
    with pytest.warns(UserWarning, match="no checkpoint to load"):
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    after = params_of(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


def frozen_engine(cfg: dict | None = None):
    model = Net()
    model.fc1.requires_grad_(False)
    return engine_for(cfg or config(), model)


def test_exclude_frozen_parameters_leaves_them_out_of_the_checkpoint(tmp_path):
    engine = frozen_engine()
    engine.save_checkpoint(tmp_path, tag="t", exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "t" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert sorted(saved["model"]) == ["fc2.bias", "fc2.weight"]


def test_a_checkpoint_without_frozen_weights_loads_with_load_module_strict_false(tmp_path):
    engine = frozen_engine()
    for x, y in batches(GAS):
        micro_batch(engine, x, y)
    engine.save_checkpoint(tmp_path, tag="t", exclude_frozen_parameters=True)
    other = Net(seed=5)
    other.fc1.requires_grad_(False)
    fc1 = {k: v.clone() for k, v in other.fc1.state_dict().items()}
    fresh = engine_for(config(), other)
    fresh.load_checkpoint(tmp_path, load_module_strict=False)
    assert torch.equal(fresh.module.fc2.weight, engine.module.fc2.weight)
    assert torch.equal(fresh.module.fc1.weight, fc1["weight"])  # kept its own


def test_a_checkpoint_without_frozen_weights_is_refused_when_strict(tmp_path):
    engine = frozen_engine()
    engine.save_checkpoint(tmp_path, tag="t", exclude_frozen_parameters=True)
    with pytest.raises(CheckpointError):
        engine_for(config()).load_checkpoint(tmp_path)


def test_custom_load_fn_loads_the_weights(tmp_path):
    engine = engine_for(config())
    engine.save_checkpoint(tmp_path, tag="t")
    calls = []

    def load(src, dst):
        calls.append(sorted(src))
        dst.load_state_dict(src)

    fresh = engine_for(config(), Net(seed=3))
    fresh.load_checkpoint(tmp_path, custom_load_fn=load)
    assert calls == [sorted(engine.module.state_dict())]
    assert torch.equal(fresh.module.fc1.weight, engine.module.fc1.weight)


# ---- 16-bit weights ---------------------------------------------------------------------------


def test_save_16bit_model_writes_the_modules_weights(tmp_path):
    engine = engine_for(config(fp16={"enabled": True}))
    assert engine.save_16bit_model(tmp_path) is True
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == engine.module.state_dict().keys()
    assert all(v.dtype == torch.float16 for v in saved.values())
    assert all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())


def test_save_16bit_model_leaves_out_frozen_parameters_when_asked(tmp_path):
    engine = frozen_engine()
    engine.save_16bit_model(tmp_path, "w.bin", exclude_frozen_parameters=True)
    assert sorted(torch.load(tmp_path / "w.bin", weights_only=True)) == ["fc2.bias", "fc2.weight"]


def test_save_16bit_model_at_stage_3_without_gathering_saves_nothing(tmp_path):
    engine = engine_for(config(3))
    assert engine.save_16bit_model(tmp_path) is False
    assert not (tmp_path / "pytorch_model.bin").exists()


def test_zero3_consolidated_16bit_state_dict_is_the_whole_model():
    model = Net()
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    engine = engine_for(config(3), model)
    sd = engine._zero3_consolidated_16bit_state_dict()
    assert sd.keys() == whole.keys() and all(torch.equal(sd[k], whole[k]) for k in whole)


def test_zero3_consolidated_16bit_state_dict_refuses_below_stage_3():
    with pytest.raises(UnsupportedError, match="needs ZeRO stage 3"):
        engine_for(config(2))._zero3_consolidated_16bit_state_dict()


# ---- throughput timer, destroy, training data ---------------------------------------------


def test_throughput_timer_averages_samples_per_second_after_its_start_step(monkeypatch):
    clock = iter(float(t) for t in range(1, 100))
    monkeypatch.setattr("zerotron.engine.timers.time.time", lambda: next(clock))
    timer = ThroughputTimer(batch_size=8, start_step=2)
    assert timer.avg_samples_per_sec() == float("-inf")
    for _ in range(5):  # steps 3, 4, 5 are timed, each start..stop one clock tick
        timer.start()
        timer.stop(global_step=True)
    assert timer.global_step_count == 5 and timer.total_elapsed_time == 3.0
    assert timer.avg_samples_per_sec() == 8 / 1.0


def test_engine_tput_timer_counts_micro_and_global_steps():
    engine = engine_for(config())
    for x, y in batches(2 * GAS):
        micro_batch(engine, x, y)
    t = engine.tput_timer
    assert (t.micro_step_count, t.global_step_count) == (2 * GAS, 2)
    assert t.batch_size == engine.train_batch_size()


def test_counters_count_micro_batches_steps_and_samples():
    engine = engine_for(config())
    for x, y in batches(2 * GAS + 1):
        micro_batch(engine, x, y)
    assert (engine.micro_steps, engine.global_steps) == (2 * GAS + 1, 2)
    assert engine.global_samples == 2 * engine.train_batch_size()


def test_destroy_closes_the_monitors_and_the_engine_still_trains():
    engine = engine_for(config())
    engine.destroy()
    x, y = batches(1)[0]
    micro_batch(engine, x, y)
    assert engine.micro_steps == 1


def test_train_batch_without_data_iter_or_training_data_is_refused():
    engine = engine_for(config())
    engine.loss_fn = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
    with pytest.raises(ConfigError, match="no training data"):
        engine.train_batch()


def test_train_batch_keeps_drawing_from_the_last_data_iter():
    engine = engine_for(config())
    engine.loss_fn = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
    data = iter(batches(2 * GAS))
    engine.train_batch(data)
    engine.train_batch()
    assert engine.global_steps == 2 and next(data, None) is None
