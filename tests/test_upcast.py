"""The 16-bit matmuls on the fp32 GEMM (zerotron.kernels.upcast): each product is the fp32
product of the 16-bit values, rounded once, forward and backward; a model trained with them
follows the same losses as with torch's own 16-bit matmuls."""

import pytest
import torch

from tests.test_kernel_policy import config, loss_and_grads
from zerotron.kernels import upcast
from zerotron.kernels.policy import KernelChoices, set_choices
from zerotron.models import GPT


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_is_the_fp32_product_rounded_once(dtype, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=g).to(dtype).requires_grad_()
    w = torch.randn(40, 48, generator=g).to(dtype).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).requires_grad_() if bias else None
    grad_y = torch.randn(2, 5, 40, generator=g).to(dtype)
    y = upcast.linear(x, w, b)
    y.backward(grad_y)
    x32, w32, g32 = x.detach().float(), w.detach().float(), grad_y.float().reshape(10, 40)
    expected = x32 @ w32.t() + (b.detach().float() if bias else 0.0)
    assert y.dtype == dtype and torch.equal(y, expected.to(dtype))
    assert torch.equal(x.grad, (g32 @ w32).to(dtype).view(2, 5, 48))
    assert torch.equal(w.grad, (g32.t() @ x32.reshape(10, 48)).to(dtype))
    if bias:
        assert torch.equal(b.grad, grad_y.reshape(10, 40).sum(0))


def test_a_bf16_model_trains_alike_on_either_16bit_matmul():
    torch.manual_seed(0)
    model = GPT(config()).bfloat16()
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    runs = {}
    for matmul16 in ("native", "fp32"):
        set_choices(KernelChoices(matmul16=matmul16))
        runs[matmul16] = loss_and_grads(model, tokens, tokens)
    (native_loss, native_grads), (up_loss, up_grads) = runs["native"], runs["fp32"]
    # the same sums of the same products in another order: within bf16 rounding
    torch.testing.assert_close(up_loss, native_loss, rtol=1e-2, atol=0)
    for name, grad in native_grads.items():
        err = (up_grads[name].double() - grad.double()).norm() / grad.double().norm()
        assert err < 2e-2, (name, err.item())
