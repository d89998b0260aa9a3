"""The GPT's attention core: 16-bit causal training attention on CPU is two matmuls and an fp32
softmax (faster there than SDPA's flash kernel); everything else stays on SDPA."""

import torch
import torch.nn.functional as F

import zerotron.models.gpt as gpt_module


def qkv(dtype, b=2, heads=4, s=32, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, s, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def out_and_grads(fn, q, k, v, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(upstream.to(out.dtype))
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)]


def rel_err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max()).item()


def test_bf16_math_attention_matches_sdpa_in_fp64():
    q, k, v = qkv(torch.bfloat16)
    assert gpt_module._math_attention_is_faster(q, k, None, True, 0.0)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    def core(q, k, v):
        return gpt_module._core_attention(q, k, v, None, True, 0.0)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref = out_and_grads(sdpa, *(t.double() for t in (q, k, v)), upstream)
    flash = out_and_grads(sdpa, q, k, v, upstream)
    ours = out_and_grads(core, q, k, v, upstream)
    for name, a, f, r in zip(("out", "grad q", "grad k", "grad v"), ours, flash, ref):
        # bf16 rounding of scores and probabilities: within a few bf16 ulps, as flash in bf16
        # is; a wrong mask or scale would be off by O(1)
        assert rel_err(a, r) < 2e-2, name
        assert rel_err(a, r) < 4 * max(rel_err(f, r), 2**-8), name


def test_math_attention_only_where_it_is_faster():
    q, k, v = qkv(torch.bfloat16)
    ok = gpt_module._math_attention_is_faster
    assert ok(q, k, None, True, 0.0)
    assert not ok(q.float(), k.float(), None, True, 0.0)  # fp32: flash is as fast
    assert not ok(q, k, None, True, 0.1)  # dropout: SDPA's
    assert not ok(q, k, torch.ones(32, 32, dtype=torch.bool), False, 0.0)  # explicit mask
    with torch.no_grad():  # inference (generation) keeps SDPA
        assert not ok(q, k, None, True, 0.0)
    long_q = torch.zeros(1, 1, gpt_module.MATH_ATTENTION_MAX_SEQ + 1, 8, dtype=torch.bfloat16)
    assert not ok(long_q, long_q, None, True, 0.0)  # memory grows with s^2
