"""The GPT's attention core is ``F.scaled_dot_product_attention`` with a causal mask, for every
dtype, in training and generation, eager and under ``torch.compile`` (16 bits on CPU: its MATH
kernel kept in 16 bits, zerotron/kernels/attention_cpu.py)."""

import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import zerotron.models.gpt as gpt_module
from zerotron.models import GPT, GPTConfig


def qkv(dtype, b=2, heads=4, s=32, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, s, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def out_and_grads(fn, q, k, v, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(upstream.to(out.dtype))
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)]


def reference(q, k, v):
    """Causal attention written out, in fp64."""
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def rel_err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max()).item()


def sdpa_math_in_16bit(q, k, v):
    """SDPA's MATH backend with 16-bit reductions allowed (the flag restored after)."""
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


def test_core_attention_is_causal_sdpa_in_every_dtype():
    """fp32: SDPA as it picks its backend; 16 bits on CPU: SDPA's MATH kernel kept in 16 bits,
    bit for bit what SDPA and autograd give with that backend and flag, eager and compiled."""
    upstream = torch.randn(2, 4, 32, 16, generator=torch.Generator().manual_seed(1))
    ref = out_and_grads(reference, *(t.double() for t in qkv(torch.float64)), upstream)

    def core(q, k, v):
        return gpt_module._core_attention(q, k, v, None, True, 0.0)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(core, fullgraph=True)  # the 16-bit op does not break the graph
    cases = [
        (torch.float32, 1e-5, sdpa),
        (torch.bfloat16, 2e-2, sdpa_math_in_16bit),
        (torch.float16, 4e-3, sdpa_math_in_16bit),
    ]
    for dtype, tol, same in cases:
        ours = out_and_grads(core, *qkv(dtype), upstream)
        theirs = out_and_grads(same, *qkv(dtype), upstream)
        for name, a, b, r in zip(("out", "grad q", "grad k", "grad v"), ours, theirs, ref):
            assert torch.equal(a, b), (dtype, name)  # SDPA itself, bit for bit
            assert rel_err(a, r) < tol, (dtype, name)  # a wrong mask would be off by O(1)
        if dtype != torch.float32:
            for name, a, b in zip(
                ["out", "q", "k", "v"], out_and_grads(compiled, *qkv(dtype), upstream), ours
            ):
                assert torch.equal(a, b), ("compiled", dtype, name)
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # restored
    torch._dynamo.reset()


def test_gpt_attention_goes_through_sdpa(monkeypatch):
    """Every layer calls SDPA, training and generating, eager and compiled; 16 bits on CPU
    without attention dropout through SDPA's MATH kernel kept in 16 bits."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    math_16bit = gpt_module.sdpa_math_16bit

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return sdpa(*args, **kwargs)

    def counting_16bit(*args, **kwargs):
        calls.append(("math", args[0].dtype))
        return math_16bit(*args, **kwargs)

    monkeypatch.setattr(gpt_module.F, "scaled_dot_product_attention", counting)
    monkeypatch.setattr(gpt_module, "sdpa_math_16bit", counting_16bit)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=64,
        orig_vocab_size=60,
        attention_dropout=0.0,
    )
    tokens = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype, path in ((torch.float32, torch.float32), (torch.bfloat16, ("math", torch.bfloat16))):
        model = GPT(cfg).to(dtype)
        calls.clear()
        model(tokens, labels=tokens).float().mean().backward()
        assert calls == [path] * 2
        calls.clear()
        with torch.no_grad():
            model.eval()(tokens)
        assert calls == [path] * 2
    dropout = GPT(dataclasses.replace(cfg, attention_dropout=0.1)).to(torch.bfloat16)
    calls.clear()
    dropout(tokens, labels=tokens).float().mean().backward()  # attention dropout: SDPA's own
    assert calls == [torch.bfloat16] * 2
    torch._dynamo.reset()
    compiled = torch.compile(GPT(cfg).to(torch.bfloat16))
    calls.clear()
    compiled(tokens, labels=tokens).float().mean().backward()
    assert calls == [("math", torch.bfloat16)] * 2  # traced through the counting wrapper once
    torch._dynamo.reset()
