"""fp32 linear layers on oneDNN (zerotron.kernels.onednn): the same results as
``F.linear`` up to summation order, eager and under ``torch.compile`` without a graph break;
other dtypes and autocast keep ``F.linear`` itself."""

import pytest
import torch
import torch.nn.functional as F

from zerotron.kernels import onednn
from zerotron.kernels.onednn import linear
from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 24, generator=g).to(dtype).requires_grad_()
    w = torch.randn(40, 24, generator=g).to(dtype).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).requires_grad_() if bias else None
    up = torch.randn(3, 7, 40, generator=g).to(dtype)
    return x, w, b, up


def run(fn, x, w, b, up):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = fn(*leaves, None) if b is None else fn(*leaves)
    y.backward(up)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [True, False])
def test_fp32_matches_f_linear_eager_and_compiled(bias):
    x, w, b, up = inputs(bias=bias)
    ref = run(F.linear, x, w, b, up)
    eager = run(linear, x, w, b, up)
    torch._dynamo.reset()
    compiled = run(torch.compile(linear, fullgraph=True), x, w, b, up)  # no graph break
    torch._dynamo.reset()
    for a, c, r in zip(eager, compiled, ref):
        assert a.shape == r.shape and a.dtype == r.dtype
        torch.testing.assert_close(a, r, rtol=1e-6, atol=2e-6)  # summation order only
        torch.testing.assert_close(c, r, rtol=1e-6, atol=2e-6)


def test_fp32_goes_to_onednn_and_others_to_f_linear(monkeypatch):
    assert onednn.ONEDNN_AVAILABLE  # every official CPU build of torch has it
    called = []
    real = onednn.onednn_mm_t
    monkeypatch.setattr(onednn, "onednn_mm_t", lambda a, b: called.append(1) or real(a, b))
    x, w, b, up = inputs()
    run(linear, x, w, b, up)
    assert len(called) == 3  # forward, grad x, grad W
    called.clear()
    x16, w16, b16, up16 = inputs(torch.bfloat16)
    for got, ref in zip(run(linear, x16, w16, b16, up16), run(F.linear, x16, w16, b16, up16)):
        assert torch.equal(got, ref)  # F.linear itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, w, b).dtype == torch.bfloat16  # autocast's cast, as F.linear
    assert called == []
    assert onednn.use_onednn(x) and not onednn.use_onednn(x16)


def test_tp1_layers_use_it(monkeypatch):
    called = []
    real = onednn.onednn_mm_t
    monkeypatch.setattr(onednn, "onednn_mm_t", lambda a, b: called.append(1) or real(a, b))
    torch.manual_seed(0)
    col = ColumnParallelLinear(24, 40, tp_size=1, tp_rank=0)
    row = RowParallelLinear(40, 24, tp_size=1, tp_rank=0)
    x = torch.randn(3, 7, 24)
    ref = F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias)
    torch.testing.assert_close(row(col(x)), ref, rtol=1e-6, atol=2e-6)
    assert len(called) == 2


@pytest.mark.parametrize("rows_per_call", [1, 7, 39, 40, 1000])  # uneven, exact, one call
def test_mm_t_into_slices_equal_one_call(monkeypatch, rows_per_call):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(9, 24, generator=g)
    b = torch.randn(64, 24, generator=g)[:40]  # a row prefix, as the fused loss's weight
    start = torch.randn(9, 40, generator=g)
    whole = onednn.onednn_mm_t(a, b)
    ref = a.double() @ b.double().t()
    widths = []
    real = onednn.onednn_mm_t
    monkeypatch.setattr(onednn, "onednn_mm_t", lambda a, b: widths.append(b.shape[0]) or real(a, b))
    out = torch.full((9, 40), float("nan"))
    assert onednn.onednn_mm_t_into(out, a, b, rows_per_call) is out
    step = min(rows_per_call, 40)
    assert widths == [step] * (40 // step) + ([40 % step] if 40 % step else [])
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=2e-6)
    acc = start.clone()
    onednn.onednn_mm_t_into(acc, a, b, rows_per_call, add=True)
    torch.testing.assert_close(acc, start + whole, rtol=1e-6, atol=1e-6)
    wide = torch.zeros(9, 50)  # a column slice of a wider buffer: only its columns change
    onednn.onednn_mm_t_into(wide[:, 5:45], a, b, rows_per_call)
    torch.testing.assert_close(wide[:, 5:45], whole, rtol=1e-6, atol=1e-6)
    assert torch.all(wide[:, :5] == 0) and torch.all(wide[:, 45:] == 0)
