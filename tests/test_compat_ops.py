"""zerotron.ops (DeepSpeed's optimizer classes): each update against DeepSpeed's math written
per element, signatures and defaults, state round trips, op builders, and use as the client
optimizer of initialize() at ZeRO stages 1-3 with the optimizer offloaded to the CPU.

The references run in fp64 Python floats, one element at a time, in the order DeepSpeed's
kernels compute; the optimizers run in fp32 on torch's kernels (fused or foreach), whose
rounding order differs a little. After STEPS steps every element agrees to within ULPS units in
the last place of fp32 (measured: at most 5; Lion's update is lr * sign, so it agrees to the
same bound unless a sign flips, which these seeds do not hit). A second check compares with
what real DeepSpeed's compiled CPU ops computed (a committed fixture, made by
tests/fixtures/make_ds_optimizers.py).
"""

from __future__ import annotations

import inspect
import io
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import zerotron
from zerotron.errors import UnsupportedError
from zerotron.ops.adagrad import DeepSpeedCPUAdagrad
from zerotron.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerotron.ops.lion import DeepSpeedCPULion, FusedLion

STEPS, N, ULPS = 6, 64, 8
LR, WD = 1e-2, 0.1


def _start(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(N, generator=g)
    grads = [torch.randn(N, generator=g) for _ in range(STEPS)]
    return p, grads


def _run(opt_cls, p0: torch.Tensor, grads: list[torch.Tensor], **kw) -> torch.Tensor:
    p = p0.clone().requires_grad_()
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _ref_adam(p0, grads, lr, b1, b2, eps, wd, adamw, bias_correction) -> list[float]:
    """DeepSpeed's CPU Adam (csrc/includes/cpu_adam.h), one element at a time."""
    out = []
    for i in range(p0.numel()):
        p, m, v = float(p0[i]), 0.0, 0.0
        for t, gs in enumerate(grads, start=1):
            g = float(gs[i])
            if wd > 0 and not adamw:
                g = g + wd * p
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            c1 = 1 - b1**t if bias_correction else 1.0
            c2 = 1 / math.sqrt(1 - b2**t) if bias_correction else 1.0
            update = m / (math.sqrt(v) * c2 + eps)
            if wd > 0 and adamw:
                p = p + (-lr * wd) * p
            p = p + (-lr / c1) * update
        out.append(p)
    return out


def _ref_lion(p0, grads, lr, b1, b2, wd) -> list[float]:
    """DeepSpeed's CPU Lion (csrc/lion/cpu_lion_impl.cpp), one element at a time."""
    out = []
    for i in range(p0.numel()):
        p, m = float(p0[i]), 0.0
        for gs in grads:
            g = float(gs[i])
            c = b1 * m + (1 - b1) * g
            step = -math.copysign(lr, c)
            p = p * (1 - lr * wd) + step if wd > 0 else p + step
            m = b2 * m + (1 - b2) * g
        out.append(p)
    return out


def _ref_adagrad(p0, grads, lr, eps, wd) -> list[float]:
    """DeepSpeed's CPU Adagrad (csrc/adagrad/cpu_adagrad.cpp, 0.19.8), one element at a time."""
    out = []
    for i in range(p0.numel()):
        p, v = float(p0[i]), 0.0
        for gs in grads:
            g = float(gs[i])
            if wd > 0:
                g = p * wd + g
            v = v + g * g
            p = (g / (math.sqrt(v) + eps)) * -lr + p
        out.append(p)
    return out


def _assert_ulps(got: torch.Tensor, ref: list[float]) -> None:
    want = torch.tensor(ref, dtype=torch.float64)
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(1e-30)
    worst = ((got.double() - want).abs() / ulp).max().item()
    assert worst <= ULPS, f"{worst:.1f} ulps from the reference"


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, FusedAdam])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("wd", [0.0, WD])
def test_adam_matches_deepspeed_math(cls, adamw, bias_correction, wd):
    p0, grads = _start()
    mode = {"adamw_mode" if cls is DeepSpeedCPUAdam else "adam_w_mode": adamw}
    b1, b2, eps = 0.9, 0.99, 1e-6
    got = _run(
        cls, p0, grads, lr=LR, betas=(b1, b2), eps=eps, weight_decay=wd,
        bias_correction=bias_correction, **mode,
    )  # fmt: skip
    _assert_ulps(got, _ref_adam(p0, grads, LR, b1, b2, eps, wd, adamw, bias_correction))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_fused_and_foreach_kernels_both_match_deepspeed_math(fused, bias_correction):
    from zerotron.optim import Adam

    p0, grads = _start()
    kw = dict(lr=LR, weight_decay=WD, adam_w_mode=False, bias_correction=bias_correction)
    got = _run(Adam, p0, grads, fused=fused, **kw)
    _assert_ulps(got, _ref_adam(p0, grads, LR, 0.9, 0.999, 1e-8, WD, False, bias_correction))


@pytest.mark.parametrize("adamw", [True, False])
def test_adam_with_bias_correction_is_torchs_adam_bitwise(adamw):
    p0, grads = _start()
    got = _run(DeepSpeedCPUAdam, p0, grads, lr=LR, weight_decay=WD, adamw_mode=adamw)
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    want = _run(torch_cls, p0, grads, lr=LR, weight_decay=WD, fused=True)
    assert torch.equal(got, want)


@pytest.fixture(params=["compiled", "foreach"])
def lion_path(request, monkeypatch) -> str:
    """Lion's two CPU paths: the compiled kernel (the default) and torch's foreach ops."""
    if request.param == "foreach":
        monkeypatch.setenv("ZEROTRON_COMPILED_LION", "0")
    return request.param


@pytest.mark.parametrize("cls", [DeepSpeedCPULion, FusedLion])
@pytest.mark.parametrize("wd", [0.0, WD])
def test_lion_matches_deepspeed_math(cls, wd, lion_path):
    p0, grads = _start()
    b1, b2 = 0.9, 0.99
    got = _run(cls, p0, grads, lr=LR, betas=(b1, b2), weight_decay=wd)
    _assert_ulps(got, _ref_lion(p0, grads, LR, b1, b2, wd))


def test_lion_leaves_an_element_with_zero_gradient_and_momentum_in_place(lion_path):
    p = torch.zeros(4, requires_grad=True)
    opt = DeepSpeedCPULion([p], lr=LR, weight_decay=WD)
    p.grad = torch.tensor([0.0, 1.0, -1.0, 0.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.0, -LR, LR, 0.0]))


@pytest.mark.parametrize("wd", [0.0, WD])
def test_adagrad_matches_deepspeed_math(wd):
    p0, grads = _start()
    got = _run(DeepSpeedCPUAdagrad, p0, grads, lr=LR, eps=1e-8, weight_decay=wd)
    _assert_ulps(got, _ref_adagrad(p0, grads, LR, 1e-8, wd))


@pytest.mark.parametrize("fused", [True, False])
def test_adagrad_is_torchs_adagrad_bitwise(fused):
    from zerotron.optim import Adagrad

    p0, grads = _start()
    got = _run(Adagrad, p0, grads, lr=LR, eps=1e-8, weight_decay=WD, fused=fused)
    want = _run(torch.optim.Adagrad, p0, grads, lr=LR, eps=1e-8, weight_decay=WD, fused=fused)
    assert torch.equal(got, want)


DS_FIXTURE = Path(__file__).parent / "fixtures" / "ds_optimizers.pt"
DS_CASES = torch.load(DS_FIXTURE, weights_only=True)


@pytest.mark.parametrize("case", sorted(DS_CASES["results"]))
def test_equals_what_real_deepspeeds_op_computed(case):
    """Against DeepSpeed 0.19.8's compiled CPU ops (tests/fixtures/make_ds_optimizers.py):
    within 2e-5 of the largest change the 6 steps made (measured: at most 8.2e-6; the ops
    round in another order, e.g. DeepSpeed forms beta**t and 1/sqrt in fp32)."""
    import zerotron.ops

    name, kwargs = DS_CASES["args"][case]
    module = {"Adam": "adam", "Lion": "lion", "Adagrad": "adagrad"}[
        name.removeprefix("DeepSpeedCPU")
    ]
    cls = getattr(getattr(zerotron.ops, module), name)
    start, want = DS_CASES["start"], DS_CASES["results"][case]
    got = _run(cls, start, list(DS_CASES["grads"]), **kwargs)
    tolerance = 2e-5 * (want - start).abs().max()
    assert (got - want).abs().max() <= tolerance


DEEPSPEED_SIGNATURES = {  # DeepSpeed's own (deepspeed/ops/*), argument order included
    DeepSpeedCPUAdam: dict(
        model_params=inspect.Parameter.empty, lr=1e-3, bias_correction=True,
        betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
        fp32_optimizer_states=True,
    ),
    FusedAdam: dict(
        params=inspect.Parameter.empty, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
        eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
    ),
    DeepSpeedCPUAdagrad: dict(
        model_params=inspect.Parameter.empty, lr=1e-2, eps=1e-10, weight_decay=0,
        amsgrad=False, fp32_optimizer_states=True,
    ),
    DeepSpeedCPULion: dict(
        model_params=inspect.Parameter.empty, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
        fp32_optimizer_states=True,
    ),
    FusedLion: dict(
        params=inspect.Parameter.empty, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
        set_grad_none=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("cls", list(DEEPSPEED_SIGNATURES), ids=lambda c: c.__name__)
def test_signature_and_defaults_are_deepspeeds(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert {p.name: p.default for p in params} == DEEPSPEED_SIGNATURES[cls]
    assert [p.name for p in params] == list(DEEPSPEED_SIGNATURES[cls])


@pytest.mark.parametrize("cls", list(DEEPSPEED_SIGNATURES), ids=lambda c: c.__name__)
def test_state_dict_round_trip_continues_identically(cls):
    p0, grads = _start()
    a = p0.clone().requires_grad_()
    opt_a = cls([a], lr=LR, weight_decay=WD)
    for g in grads[:3]:
        a.grad = g.clone()
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b = a.detach().clone().requires_grad_()
    opt_b = cls([b], lr=1.0, weight_decay=0.0)  # the loaded groups' values must win
    opt_b.load_state_dict(torch.load(buf, weights_only=True))
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)
    assert int(opt_b.state[b]["step"]) == STEPS


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, DeepSpeedCPULion, DeepSpeedCPUAdagrad])
def test_bf16_parameters_keep_fp32_states_and_step_in_fp32(cls):
    p0, grads = _start()
    half = p0.bfloat16().requires_grad_()
    opt = cls([half], lr=LR, weight_decay=WD)
    full = half.detach().float().requires_grad_()
    ref = cls([full], lr=LR, weight_decay=WD)
    half.grad, full.grad = grads[0].bfloat16(), grads[0].bfloat16().float()
    opt.step()
    ref.step()
    state = opt.state[half]
    assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step")
    assert torch.equal(half.detach(), full.detach().bfloat16())


def test_fused_adam_refuses_amsgrad_and_cpu_adam_ignores_it():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(UnsupportedError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
    with pytest.warns(UserWarning, match="amsgrad=True is ignored"):
        DeepSpeedCPUAdam([p], amsgrad=True)


def test_sparse_gradients_are_refused():
    emb = nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    opt = DeepSpeedCPUAdagrad(emb.parameters())
    with pytest.raises(UnsupportedError, match="sparse gradients"):
        opt.step()


def test_fused_optimizers_zero_grad_sets_none():
    p = torch.zeros(2, requires_grad=True)
    for opt in (FusedAdam([p], set_grad_none=True), FusedLion([p], set_grad_none=True)):
        p.grad = torch.ones(2)
        opt.zero_grad()
        assert p.grad is None


def test_op_builders_are_compatible_and_load_is_refused_with_the_class_to_use():
    from zerotron.ops.op_builder import CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder

    assert zerotron.ops.__compatible_ops__["cpu_adam"] is True
    assert CPUAdamBuilder().is_compatible() and CPUAdamBuilder.NAME == "cpu_adam"
    assert CPUAdagradBuilder.NAME == "cpu_adagrad" and CPULionBuilder.NAME == "cpu_lion"
    with pytest.raises(UnsupportedError, match=r"deepspeed\.ops\.adam\.DeepSpeedCPUAdam"):
        CPUAdamBuilder().load()


def test_deepspeed_import_paths_are_the_same_classes():
    from zerotron.ops.adam.cpu_adam import DeepSpeedCPUAdam as cpu_adam
    from zerotron.ops.lion.fused_lion import FusedLion as fused_lion

    assert cpu_adam is DeepSpeedCPUAdam and fused_lion is FusedLion
    assert isinstance(DeepSpeedCPUAdam([torch.zeros(1, requires_grad=True)]), torch.optim.Optimizer)


def _train(cls, zero: dict) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = cls(model.parameters(), lr=LR, weight_decay=WD)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero}
    engine, *_ = zerotron.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls", list(DEEPSPEED_SIGNATURES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_client_optimizer_with_zero_and_cpu_offload_equals_no_zero(cls, stage):
    offload = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    assert _train(cls, offload) == _train(cls, {"stage": 0})


@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, DeepSpeedCPULion, DeepSpeedCPUAdagrad])
def test_client_optimizer_with_nvme_offload_in_small_sub_groups_equals_no_zero(cls, tmp_path):
    zero = {
        "stage": 3,
        "sub_group_size": 100,  # several sub-groups, streamed through the swap buffers
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_param": {"device": "cpu"},
    }
    assert _train(cls, zero) == _train(cls, {"stage": 0})


def test_lion_in_cache_sized_batches_equals_one_pass(monkeypatch):
    import zerotron.optim.lion as lion

    monkeypatch.setenv("ZEROTRON_COMPILED_LION", "0")  # the batches are the foreach path's
    g = torch.Generator().manual_seed(0)
    shapes = [(lion.BLOCK * 2 + 5,), (3, 7), (lion.BLOCK - 1,), (5,)]
    start = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(6, 4, generator=g).t()]
    grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(3)]

    def run() -> list[torch.Tensor]:
        ps = [t.clone().requires_grad_() for t in start[:-1]]
        ps.append(start[-1].clone().t().contiguous().t().requires_grad_())  # a strided one
        opt = DeepSpeedCPULion(ps, lr=LR, weight_decay=WD)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return [p.detach() for p in ps]

    blocked = run()
    monkeypatch.setattr(lion, "BLOCK", 1 << 40)
    assert all(torch.equal(a, b) for a, b in zip(blocked, run()))


def _lion_run(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    before_step: Callable[[int], None] = lambda step: None,
) -> list[torch.Tensor]:
    """Each parameter after the steps, its momentum after it (the paths' roundings differ
    there first); ``before_step(i)`` runs before step i."""
    ps = [t.clone().requires_grad_() for t in params]
    opt = DeepSpeedCPULion(ps, lr=LR, weight_decay=WD)
    for i, gs in enumerate(grads):
        for p, gr in zip(ps, gs):
            p.grad = gr.clone()
        before_step(i)
        opt.step()
    return [torch.cat([p.detach().reshape(-1), opt.state[p]["exp_avg"].reshape(-1)]) for p in ps]


def test_compiled_lion_gives_each_element_the_same_bits_however_a_tensor_is_cut():
    """What ZeRO relies on: a flat tensor stepped whole, or cut into pieces of any length (the
    kernel's vector loop and its tail; the small pieces joined into one call), gives the same
    bits."""
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(100_003, generator=g)
    grads = [torch.randn(whole.shape, generator=g) for _ in range(3)]
    cuts = [0, 7, 20, 4_115, 50_000, 100_003]
    pieces = _lion_run(
        [whole[a:b] for a, b in zip(cuts, cuts[1:])],
        [[gr[a:b] for a, b in zip(cuts, cuts[1:])] for gr in grads],
    )
    n = [b - a for a, b in zip(cuts, cuts[1:])]
    joined = torch.cat(
        [piece[:k] for piece, k in zip(pieces, n)] + [piece[k:] for piece, k in zip(pieces, n)]
    )
    assert torch.equal(joined, _lion_run([whole], [[gr] for gr in grads])[0])


def test_lion_steps_by_foreach_when_compiling_fails(monkeypatch):
    """A compile that fails (no C++ compiler, say) warns once, and the tensors it had not
    stepped are stepped by foreach, none twice: failing at the second tensor of the second
    step, the first tensor is stepped as the compiled kernel steps it, the second as foreach
    does (momenta compared too: the paths round them differently)."""
    import zerotron.optim.lion as lion

    g = torch.Generator().manual_seed(2)
    n = lion.SMALL  # large enough for a kernel call each
    start = [torch.randn(n, generator=g), torch.randn(3, n // 2, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(2)]

    def foreach_from(first: int) -> Callable[[int], None]:
        return lambda step: monkeypatch.setenv("ZEROTRON_COMPILED_LION", str(int(step < first)))

    compiled = _lion_run(start, grads, foreach_from(2))
    foreach_second = _lion_run(start, grads, foreach_from(1))
    monkeypatch.delenv("ZEROTRON_COMPILED_LION")
    kernel, calls = lion._kernel(), []

    def fourth_call_fails(*args):
        calls.append(1)
        if len(calls) == 4:
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")
        return kernel(*args)

    monkeypatch.setattr(lion, "_kernel", lambda: fourth_call_fails)
    monkeypatch.setattr(lion, "_failed", False)
    with pytest.warns(UserWarning, match="compiled CPU kernel is unavailable"):
        got = _lion_run(start, grads)
    assert torch.equal(got[0], compiled[0]) and torch.equal(got[1], foreach_second[1])
    assert not torch.equal(compiled[1], foreach_second[1])  # (so the check above can fail)
    assert lion._failed and len(calls) == 4
