"""The GPT's attention core is ``F.scaled_dot_product_attention`` with a causal mask, for every
dtype, in training and generation, eager and under ``torch.compile``."""

import torch
import torch.nn.functional as F

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


def test_core_attention_is_causal_sdpa_in_every_dtype():
    upstream = torch.randn(2, 4, 32, 16, generator=torch.Generator().manual_seed(1))
    ref = out_and_grads(reference, *(t.double() for t in qkv(torch.float64)), upstream)

    def core(q, k, v):
        return gpt_module._core_attention(q, k, v, None, True, 0.0)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        ours = out_and_grads(core, *qkv(dtype), upstream)
        theirs = out_and_grads(sdpa, *qkv(dtype), upstream)
        for name, a, b, r in zip(("out", "grad q", "grad k", "grad v"), ours, theirs, ref):
            assert torch.equal(a, b), (dtype, name)  # SDPA itself, bit for bit
            assert rel_err(a, r) < tol, (dtype, name)  # a wrong mask would be off by O(1)


def test_gpt_attention_goes_through_sdpa(monkeypatch):
    """Every layer calls SDPA, training and generating, eager and compiled (16-bit included)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(gpt_module.F, "scaled_dot_product_attention", counting)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=64,
        orig_vocab_size=60,
    )
    tokens = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        model = GPT(cfg).to(dtype)
        calls.clear()
        model(tokens, labels=tokens).float().mean().backward()
        assert calls == [dtype] * 2
        calls.clear()
        with torch.no_grad():
            model.eval()(tokens)
        assert calls == [dtype] * 2
    torch._dynamo.reset()
    compiled = torch.compile(GPT(cfg).to(torch.bfloat16))
    calls.clear()
    compiled(tokens, labels=tokens).float().mean().backward()
    assert calls == [torch.bfloat16] * 2  # traced through the counting wrapper once
    torch._dynamo.reset()
