"""Loss scalers, gradient checks and the master-weight optimizer (zerotron.precision)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from zerotron.errors import CheckpointError, ConfigError, ZerotronError
from zerotron.optim import OptimizerParamScheduler, build_optimizer, get_param_groups
from zerotron.precision import (
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    StaticLossScaler,
    clip_grad_norm_,
    count_zeros,
    get_grad_norm,
    has_overflow,
    make_loss_scaler,
    unscale_and_check_overflow_,
)
from zerotron.precision import grads as grads_mod
from zerotron.precision.grads import ROW

# ---- loss scalers ------------------------------------------------------------------------------


def run_scaler(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    """Feed an overflow pattern ("O" overflow, "." clean) and record the scale after each."""
    scales = []
    for c in pattern:
        scaler.update(c == "O")
        scales.append(scaler.cur_scale)
    return scales


def test_dynamic_scaler_hysteresis_window_and_min_scale():
    s = DynamicLossScaler(
        16, scale_window=2, min_scale=2, hysteresis=2, raise_error_at_min_scale=False
    )
    # Worked out by hand from DeepSpeed's rule:
    #  O   first overflow spends hysteresis (2 -> 1): scale kept
    #  O O budget spent: every further overflow halves
    #  . . stable steps 0 and 1 since the last overflow: nothing
    #  .   stable step 2 = window: double, hysteresis refilled to 2
    #  . . stable 3 (no), 4 (double)
    #  O   hysteresis 2 -> 1, kept;  .  stable 0
    #  O O O  halve, halve, then clamped at min_scale 2
    pattern = "OOO" + "..." + ".." + "O." + "OOOO"
    expected = [16, 8, 4] + [4, 4, 8] + [8, 16] + [16, 16] + [8, 4, 2, 2]
    assert run_scaler(s, pattern) == expected


def test_dynamic_scaler_consecutive_hysteresis():
    # Alternating overflows never lower the scale when each clean step refills the budget...
    s = DynamicLossScaler(1024, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    assert run_scaler(s, "O.O.O.OO") == [1024] * 7 + [512]
    # ...but do without consecutive hysteresis: the second overflow already halves.
    s = DynamicLossScaler(1024, scale_window=100, hysteresis=2)
    assert run_scaler(s, "O.O.O.") == [1024, 1024, 512, 512, 256, 256]


def test_dynamic_scaler_hysteresis_one_and_growth_from_start():
    s = DynamicLossScaler(2.0**10, scale_window=3, hysteresis=1)
    # From the start, the first doubling comes at the 4th clean update (stable steps 0,1,2,3).
    assert run_scaler(s, "....") == [1024, 1024, 1024, 2048]
    assert run_scaler(s, "O") == [1024]  # hysteresis 1: every overflow halves


def test_dynamic_scaler_raises_at_min_scale():
    s = DynamicLossScaler(4, min_scale=2, hysteresis=1)
    s.update(True)
    assert s.cur_scale == 2
    with pytest.raises(ZerotronError, match="minimum loss scale"):
        s.update(True)


def test_dynamic_scaler_initial_scale_and_validation():
    assert DynamicLossScaler().cur_scale == 2.0**32
    assert DynamicLossScaler(initial_scale_power=16).loss_scale == 65536.0
    assert DynamicLossScaler(65536, initial_scale_power=16).loss_scale == 65536.0
    with pytest.raises(ConfigError, match="given twice"):
        DynamicLossScaler(1024, initial_scale_power=16)
    with pytest.raises(ConfigError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)
    with pytest.raises(ConfigError, match="loss_scale_window"):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ConfigError, match="loss scale"):
        StaticLossScaler(0)


def test_dynamic_scaler_state_dict_resumes_sequence():
    pattern = "O.O....O...O..O...."
    full = run_scaler(DynamicLossScaler(64, scale_window=3, hysteresis=2), pattern)
    a = DynamicLossScaler(64, scale_window=3, hysteresis=2)
    first = run_scaler(a, pattern[:9])
    b = DynamicLossScaler(1, scale_window=3, hysteresis=2, min_scale=1)
    b.load_state_dict(a.state_dict())
    assert first + run_scaler(b, pattern[9:]) == full


def test_scale_and_make_loss_scaler():
    loss = torch.tensor(3.0)
    assert StaticLossScaler(128).scale(loss).item() == 384.0
    assert make_loss_scaler(torch.bfloat16) is None
    assert make_loss_scaler(torch.float32) is None
    static = make_loss_scaler(torch.float16, loss_scale=128)
    assert isinstance(static, StaticLossScaler) and static.cur_scale == 128
    dyn = make_loss_scaler(torch.float16, initial_scale_power=12, hysteresis=3)
    assert isinstance(dyn, DynamicLossScaler) and dyn.cur_scale == 4096 and dyn.hysteresis == 3
    assert isinstance(make_loss_scaler(torch.float16, loss_scale=0), DynamicLossScaler)


# ---- gradient norm, clipping, overflow ---------------------------------------------------------


def params_with_grads(seed: int = 0, scale: float = 1.0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (33, 4), (1,), (16, 16)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


def exact_grads(seed: int = 0) -> list[torch.Tensor]:
    """Gradients whose norms fp64 computes exactly: multiples of 2^-6, one constant-magnitude
    tensor longer than a row (its fp32 row norms are exact too: sqrt(1024 c^2) = 32 c)."""
    g = torch.Generator().manual_seed(seed)
    small = [torch.randint(-50, 51, s, generator=g).float() / 64 for s in [(7, 5), (5,), (33, 4)]]
    signs = torch.randint(0, 2, (3 * ROW + 17,), generator=g).float() * 2 - 1
    return [*small, signs * 0.375]


def fp64_norm(grads: list[torch.Tensor], norm_type: float) -> float:
    """The reference: the norm of all gradients as one vector, summed in Python floats (fp64)."""
    values = [abs(v) for t in grads for v in t.double().flatten().tolist()]
    if norm_type == float("inf"):
        return max(values)
    if norm_type == 1.0:
        return math.fsum(values)
    return math.sqrt(math.fsum(v * v for v in values))


def fp64_clip_(grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """The reference clip: the fp64 norm, its coefficient rounded once to fp32, then multiply."""
    norm = fp64_norm(grads, norm_type)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for t in grads:
            t.mul_(torch.tensor(coef, dtype=torch.float32))
    return norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_equals_fp64_reference_exactly(norm_type):
    ours, ref = exact_grads(), exact_grads()
    assert ours[-1].numel() > ROW  # the row path is taken too
    total = clip_grad_norm_(ours, 0.5, norm_type)
    ref_total = fp64_clip_(ref, 0.5, norm_type)
    assert total.dtype == torch.float64 and total.item() == ref_total  # bit for bit
    assert ref_total > 0.5  # so clipping happened
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    # The clipped gradients hold fp32-rounded values: their norm is max_norm to fp32 precision,
    # and ours of them is off by at most the fp32 rounding of a row's norm.
    clipped = fp64_norm(ours, norm_type)
    assert clipped == pytest.approx(0.5 * ref_total / (ref_total + 1e-6), rel=1.2e-7)
    assert get_grad_norm(ours, norm_type).item() == pytest.approx(clipped, rel=2e-7)


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_grad_norm_of_a_large_gradient_is_fp64_accurate(norm_type):
    # A GPT-2-sized embedding gradient (3.2M elements): one fp32 reduction over it (torch's
    # clip_grad_norm_ on CPU) is off by 6e-5 (2-norm) to 2e-4 (1-norm); fp32 rows summed in
    # fp64 stay within 2e-9 of the exact norm.
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(6283, 512, generator=g) * 1e-3

    def exact() -> float:
        return grad.double().abs().pow(norm_type).sum().pow(1 / norm_type).item()

    assert abs(get_grad_norm([grad], norm_type).item() - exact()) <= 2e-9 * exact()
    # Split like two tensor-parallel shards and combined through reduce_fn: the same norm.
    a, b = grad[:3000], grad[3000:]
    b_pow = get_grad_norm([b], norm_type).item() ** norm_type
    split = get_grad_norm([a], norm_type, reduce_fn=lambda t, op: t + b_pow)
    assert abs(split.item() - exact()) <= 2e-9 * exact()
    # One dominant row (a frequent token's): its fp32 rounding is what is left, < 2e-7
    # (torch's fp32 2-norm: 1.4e-3).
    grad[17] += 0.5
    assert abs(get_grad_norm([grad], norm_type).item() - exact()) <= 2e-7 * exact()


def test_clip_grad_norm_leaves_small_gradients_alone():
    ps = params_with_grads()
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm_(ps, 1e6)
    assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))
    expected = math.sqrt(sum((b.double() ** 2).sum().item() for b in before))
    assert norm.item() == pytest.approx(expected, rel=1e-6)


def test_grad_norm_reduce_fn_and_is_counted():
    ps = params_with_grads()
    full = get_grad_norm(ps).item()
    part_a, part_b = ps[:2], ps[2:]
    sq_b = get_grad_norm(part_b).double().item() ** 2
    inf_b = get_grad_norm(part_b, float("inf"))
    calls = []

    def reduce_fn(t, op):  # stands in for an all-reduce with a rank holding part_b
        calls.append(op)
        return t + sq_b if op == "sum" else torch.maximum(t, inf_b)

    assert get_grad_norm(part_a, reduce_fn=reduce_fn).item() == pytest.approx(full, rel=1e-6)
    full_inf = get_grad_norm(ps, float("inf"))
    assert torch.equal(get_grad_norm(part_a, float("inf"), reduce_fn=reduce_fn), full_inf)
    assert calls == ["sum", "max"]
    # is_counted drops the replicated parameters from the norm, but clipping scales them too.
    replicated = {id(p) for p in part_b}
    counted = get_grad_norm(ps, is_counted=lambda p: id(p) not in replicated)
    assert torch.equal(counted, get_grad_norm(part_a))
    clip_grad_norm_(ps, 0.1, is_counted=lambda p: id(p) not in replicated)
    assert get_grad_norm(part_a).item() == pytest.approx(0.1, rel=1e-5)
    assert get_grad_norm(part_b).item() == pytest.approx(
        math.sqrt(sq_b) * 0.1 / counted.item(), rel=1e-5
    )


def test_main_grad_is_the_gradient_of_a_parameter():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    p.main_grad = torch.full((3,), 2.0)
    assert get_grad_norm([p]).item() == pytest.approx(math.sqrt(12.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_has_overflow_finds_nan_and_inf(bad, dtype):
    ps = []
    for p32 in params_with_grads():
        p = torch.nn.Parameter(p32.detach().to(dtype))
        p.grad = p32.grad.to(dtype)
        ps.append(p)
    assert not has_overflow(ps)
    ps[3].grad[0] = bad
    assert has_overflow(ps)
    assert has_overflow([p.grad for p in ps])  # gradients given directly


def test_has_overflow_large_finite_is_not_overflow_and_reduce():
    # A sum of squares would overflow fp32 here; the check must not.
    grads = [torch.full((1000,), 1e30), torch.ones(3)]
    assert not has_overflow(grads)
    assert has_overflow(grads, reduce_fn=lambda t, op: torch.ones_like(t))  # another rank's inf
    assert not has_overflow([])


def test_unscale_and_check_overflow():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    assert not unscale_and_check_overflow_(grads, 0.25)
    assert torch.equal(grads[0], torch.tensor([0.5, 1.0])) and grads[1].item() == 2.0
    assert unscale_and_check_overflow_([torch.tensor([1.0, float("nan")])], 0.5)


def test_count_zeros():
    grads = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([[0.0, -0.0], [3.0, 4.0]])]
    assert count_zeros(grads) == 4
    assert count_zeros(grads, reduce_fn=lambda t, op: t * 2) == 8


# ---- master weights ----------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.to(dtype)

    def forward(self, x, y):
        h = self.fc2(self.ln(torch.nn.functional.gelu(self.fc1(x.to(self.fc1.weight.dtype)))))
        return torch.nn.functional.mse_loss(h.float(), y)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def wrap(model, *, scaler=None, clip=0.0, lr=1e-2, impl="auto", **kw):
    groups = get_param_groups(model, weight_decay=0.1)
    opt = build_optimizer(groups, "adamw", lr=lr, betas=(0.9, 0.95), eps=1e-8, impl=impl)
    return MixedPrecisionOptimizer(opt, loss_scaler=scaler, clip_grad=clip, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_master_weights_step_equals_fp32_adamw_on_master(dtype, clip):
    """16-bit model + wrapper == torch AdamW stepping fp32 copies with the fp32-summed grads."""
    model = Tiny(dtype)
    shadow = copy.deepcopy(model)  # same weights, no hooks: yields the per-micro-batch grads
    scaler = StaticLossScaler(1024.0) if dtype == torch.float16 else None
    opt = wrap(model, scaler=scaler, clip=clip)

    ref_params = [p.detach().float().clone() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    ref_groups = get_param_groups(zip(names, [torch.nn.Parameter(t) for t in ref_params]), 0.1)
    ref_params = [p for g in ref_groups for p in g["params"]]
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    order = [p for g in get_param_groups(shadow, 0.1) for p in g["params"]]
    scale = 1024.0 if scaler else 1.0

    data = batches(6)
    for step in range(3):
        acc = [torch.zeros_like(p) for p in ref_params]
        for x, y in data[2 * step : 2 * step + 2]:  # two micro-batches
            opt.scale_loss(model(x, y)).backward()
            grads = torch.autograd.grad(shadow(x, y) * scale, order)
            for a, g in zip(acc, grads):
                a += g.float()
        for p, a in zip(ref_params, acc):
            p.grad = a * (1.0 / scale)
        ref_grads = [p.grad for p in ref_params]
        ref_norm = fp64_clip_(ref_grads, clip) if clip else fp64_norm(ref_grads, 2.0)
        ref_opt.step()
        result = opt.step()
        assert result.update_successful
        # Small tensors: summed in fp64 outright, so only the summation order differs.
        assert result.grad_norm == pytest.approx(ref_norm, rel=1e-14)
        assert not clip or ref_norm > clip  # the clipped case does clip
        for master, ref in zip(opt.master_params, ref_params):
            assert master.dtype == torch.float32
            assert torch.equal(master, ref)
        for p, master in zip(opt.model_params, opt.master_params):
            assert p.dtype == dtype
            assert torch.equal(p, master.to(dtype))
        with torch.no_grad():  # keep the shadow model on the same 16-bit weights
            for s, p in zip(order, opt.model_params):
                s.copy_(p)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in model.parameters())


def test_fp32_path_equals_plain_adamw_and_clip():
    model, ref = Tiny(), Tiny()
    opt = wrap(model, clip=0.05)
    ref_opt = build_optimizer(get_param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95))
    assert opt.master_params == list(opt.model_params)  # no copies in fp32
    for x, y in batches(3):
        opt.scale_loss(model(x, y)).backward()
        ref(x, y).backward()
        ref_norm = fp64_clip_([p.grad for p in ref.parameters()], 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        update_ok, norm, zeros = opt.step()
        assert update_ok and zeros is None and norm > 0.05
        assert norm == pytest.approx(ref_norm, rel=1e-14)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.equal(a, b)


def snapshot(opt):
    state = {
        k: v.clone() if torch.is_tensor(v) else v
        for i, s in enumerate(opt.optimizer.state.values())
        for k, v in ((f"{i}.{k}", v) for k, v in s.items())
    }
    return (
        [p.detach().clone() for p in opt.model_params],
        [m.detach().clone() for m in opt.master_params],
        state,
    )


def same(a, b):
    (pa, ma, sa), (pb, mb, sb) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(pa, pb))
        and all(torch.equal(x, y) for x, y in zip(ma, mb))
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
    )


def test_fp16_overflow_skips_step_and_halves_scale_after_hysteresis():
    model = Tiny(torch.float16)
    scaler = DynamicLossScaler(2.0**10, hysteresis=2, scale_window=1000)
    opt = wrap(model, scaler=scaler)
    (x, y), (x2, y2) = batches(2)
    opt.scale_loss(model(x, y)).backward()
    assert opt.step().update_successful
    before = snapshot(opt)
    assert before[2]["0.step"].item() == 1

    for i, expected_scale in enumerate([1024.0, 512.0]):
        # A huge loss overflows the fp16 gradients to inf: a real forced overflow.
        opt.scale_loss(model(x2, y2) * 1e6).backward()
        assert any(torch.isinf(p.main_grad).any() for p in model.parameters())
        result = opt.step()
        assert result == (False, None, None)
        assert same(snapshot(opt), before)  # weights, masters, Adam moments and step count
        assert scaler.cur_scale == expected_scale  # kept on the 1st overflow, halved on the 2nd
        assert opt.num_skipped_steps == i + 1
        assert all(p.grad is None and not p.main_grad.any() for p in model.parameters())

    opt.scale_loss(model(x2, y2)).backward()
    assert opt.step().update_successful
    assert opt.optimizer.state[opt.master_params[0]]["step"].item() == 2  # skips never counted


def test_nan_gradient_is_skipped_in_bf16_when_checking():
    model = Tiny(torch.bfloat16)
    opt = wrap(model, check_overflow=True)
    x, y = batches(1)[0]
    model(x, y).backward()
    model.fc1.weight.main_grad[0, 0] = float("nan")
    before = snapshot(opt)
    assert opt.step().update_successful is False
    assert same(snapshot(opt), before) and opt.num_skipped_steps == 1


def test_unused_parameter_is_not_stepped_in_bf16_as_in_fp32():
    for dtype in (torch.float32, torch.bfloat16):
        model = Tiny(dtype)
        model.unused = torch.nn.Parameter(torch.ones(3, 3, dtype=dtype))
        opt = wrap(model)
        x, y = batches(1)[0]
        model(x, y).backward()
        opt.step()
        assert torch.equal(model.unused, torch.ones(3, 3, dtype=dtype))
        idx = [id(p) for p in opt.model_params].index(id(model.unused))
        assert opt.master_params[idx] not in opt.optimizer.state


def test_zero_count_and_wrapping_a_used_optimizer():
    model = Tiny()
    opt = wrap(model, log_num_zeros_in_grad=True)
    x, y = batches(1)[0]
    model(x, y).backward()
    expected = sum(int((p.grad == 0).sum()) for p in model.parameters())
    assert opt.step().num_zeros_in_grad == expected
    with pytest.raises(ConfigError, match="fresh optimizer"):
        MixedPrecisionOptimizer(opt.optimizer)


def test_a_dropped_optimizer_and_its_masters_are_freed():
    """Neither the owner table (zerotron.precision.owners) nor the wrapper's gradient hooks
    keep it alive: a strong reference in either (the hooks live in autograd's C++ accumulator,
    out of gc's sight) kept every optimizer a process made, masters and Adam moments, until
    exit."""
    import gc
    import weakref

    from zerotron.precision.owners import owner_of

    model = Tiny(torch.bfloat16)
    opt = wrap(model)
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    assert owner_of(next(model.parameters())) is opt
    gone = weakref.ref(opt)
    master = weakref.ref(opt.master_params[0])
    del model, opt  # (the wrapper's gradient hooks on the parameters are a cycle gc frees)
    gc.collect()
    assert gone() is None and master() is None


def train(model, opt, sched, data):
    losses = []
    for x, y in data:
        loss = model(x, y)
        opt.scale_loss(loss).backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_dict_round_trip_continues_bitwise(dtype):
    def build(seed):
        model = Tiny(dtype, seed=seed)
        scaler = DynamicLossScaler(2.0**8, scale_window=2) if dtype == torch.float16 else None
        opt = wrap(model, scaler=scaler, clip=1.0)
        sched = OptimizerParamScheduler(
            opt, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=8,
            lr_decay_style="cosine",
        )  # fmt: skip
        return model, opt, sched

    data = batches(7)
    model, opt, sched = build(0)
    train(model, opt, sched, data[:3])
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf
    )
    expected = train(model, opt, sched, data[3:])

    model2, opt2, sched2 = build(1)  # other initial weights: everything must come from the file
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert train(model2, opt2, sched2, data[3:]) == expected
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt.loss_scale == opt2.loss_scale


def test_load_state_dict_mismatch_is_a_checkpoint_error():
    opt = wrap(Tiny(torch.bfloat16))
    state = opt.state_dict()
    state["fp32_from_fp16_params"][0][0] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match="master weights"):
        wrap(Tiny(torch.bfloat16)).load_state_dict(state)
    other = torch.nn.Linear(3, 3)
    bad = build_optimizer([other.weight], lr=1.0).state_dict()
    with pytest.raises(CheckpointError, match="parameter groups"):
        wrap(Tiny()).load_state_dict({"optimizer": bad})


def test_reload_model_params_after_loading_weights_only():
    model = Tiny(torch.bfloat16)
    opt = wrap(model)
    model.load_state_dict(Tiny(torch.bfloat16, seed=5).state_dict())
    opt.reload_model_params()
    for p, m in zip(opt.model_params, opt.master_params):
        assert torch.equal(m, p.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulate_grad_in_pieces_equals_add(monkeypatch, dtype):
    """16-bit gradients go into fp32 buffers piece by piece: the bits of one mixed ``add_``,
    for lengths that do and do not divide into pieces, and for a strided (fallback) buffer."""
    monkeypatch.setattr(grads_mod, "ACCUMULATE_PIECE", 7)
    g = torch.Generator().manual_seed(0)
    for shape in [(5, 7), (9, 13), (3,)]:
        main = torch.randn(shape, generator=g)
        grad = torch.randn(shape, generator=g).to(dtype)
        ref = main.clone().add_(grad)
        grads_mod.accumulate_grad_(main, grad)
        assert torch.equal(main, ref), shape
    main = torch.randn(13, 9, generator=g).t()  # not contiguous: add_ directly
    grad = torch.randn(9, 13, generator=g).to(dtype)
    ref = main.clone().add_(grad)
    grads_mod.accumulate_grad_(main, grad)
    assert torch.equal(main, ref)
