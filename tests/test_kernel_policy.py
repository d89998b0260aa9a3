"""The kernel policy: every fast path on the CPU, none on CUDA; each off switch gives the plain
path, which equals the fast one; the plain path compiles without a graph break."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import zerotron.kernels.policy as policy_module
import zerotron.models.gpt as gpt_module
from tests.test_model import config as model_config
from zerotron.kernels import (
    KernelChoices,
    KernelPolicy,
    apply_process_settings,
    kernel_policy,
    onednn,
)
from zerotron.kernels.policy import ENV_SWITCHES
from zerotron.models import GPT, GPTConfig

FIELDS = [f.name for f in dataclasses.fields(KernelPolicy)]


def config(**kw) -> GPTConfig:
    """test_model's tiny GPT, without dropout (paths are compared bit for bit)."""
    return model_config(**{"hidden_dropout": 0.0, "attention_dropout": 0.0, **kw})


def loss_and_grads(model: GPT, tokens, labels):
    model.zero_grad()
    loss = model(tokens, labels=labels)
    loss.float().mean().backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_cpu_takes_every_fast_path_cuda_none(monkeypatch):
    for env in ENV_SWITCHES.values():
        monkeypatch.delenv(env, raising=False)
    # the 16-bit attention is one of two fast paths (or SDPA's own), so each has its choices
    for attention, other in (("math16", "attention_fp32"), ("fp32", "attention_16bit")):
        policy_module.set_choices(KernelChoices(matmul16="fp32", attention=attention))
        fields = [f for f in FIELDS if f != other]
        assert all(getattr(kernel_policy("cpu"), f) for f in fields)
        assert all(getattr(kernel_policy(torch.device("cpu")), f) for f in fields)
        assert not getattr(kernel_policy("cpu"), other)
        assert not any(getattr(kernel_policy(torch.device("cuda", 0)), f) for f in FIELDS)
        for field, env in ENV_SWITCHES.items():
            monkeypatch.setenv(env, "0")
            assert not getattr(kernel_policy("cpu"), field)
            monkeypatch.delenv(env)


def test_kernel_choices_narrow_the_cpu_policy(monkeypatch):
    for env in ENV_SWITCHES.values():
        monkeypatch.delenv(env, raising=False)
    policy_module.set_choices(KernelChoices(linear="torch", attention="sdpa"))
    got = kernel_policy("cpu")
    assert not got.onednn_linear and not got.attention_16bit and not got.upcast_16bit
    assert got.fused_loss and got.eager_embedding and got.keep_freed_heap


def test_process_settings_only_for_one_cpu_process(monkeypatch):
    calls = []
    monkeypatch.setattr(policy_module, "keep_freed_heap", lambda: calls.append(1))
    apply_process_settings(torch.device("cuda"), 1)
    apply_process_settings("cpu", 2)
    assert calls == []
    apply_process_settings("cpu", 1)
    assert calls == [1]


def test_onednn_switched_off_is_f_linear(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40)
    assert onednn.use_onednn(x)
    monkeypatch.setenv("ZEROTRON_ONEDNN", "0")
    assert not onednn.use_onednn(x)
    assert torch.equal(onednn.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("attention", ["math16", "fp32"])
def test_16bit_attention_switched_off_is_sdpa(monkeypatch, attention):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g).bfloat16() for _ in range(3))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    policy_module.set_choices(KernelChoices(attention=attention))
    fast = gpt_module._core_attention(q, k, v, None, True, 0.0)
    monkeypatch.setenv("ZEROTRON_MATH_ATTENTION", "0")
    plain = gpt_module._core_attention(q, k, v, None, True, 0.0)
    assert torch.equal(plain, sdpa)
    torch.testing.assert_close(fast, plain, rtol=2e-2, atol=2e-2)  # another kernel, 16 bits


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpt_plain_path_equals_fast_path(monkeypatch, dtype, tol):
    """Every switch off (the path CUDA takes): the same loss and gradients, and the padded
    vocabulary still gets no probability."""
    cfg = config()
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 100, (2, 32), generator=g), torch.randint(0, 100, (2, 32))
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    fast_loss, fast_grads = loss_and_grads(model, tokens, labels)
    for env in ENV_SWITCHES.values():
        monkeypatch.setenv(env, "0")
    plain_loss, plain_grads = loss_and_grads(model, tokens, labels)
    torch.testing.assert_close(plain_loss, fast_loss, rtol=tol, atol=tol)
    for name, grad in fast_grads.items():
        torch.testing.assert_close(plain_grads[name], grad, rtol=tol, atol=tol, msg=name)
    assert torch.all(plain_grads["embedding.word_embeddings.weight"][100:] == 0)


def test_gpt_plain_path_compiles_without_graph_break(monkeypatch):
    for env in ENV_SWITCHES.values():
        monkeypatch.setenv(env, "0")
    torch.manual_seed(0)
    model = GPT(config())
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = loss_and_grads(model, tokens, tokens)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # a graph break would raise
    model.zero_grad()
    loss = compiled(tokens, labels=tokens)
    loss.mean().backward()
    torch.testing.assert_close(loss.detach(), eager_loss, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[n], rtol=1e-4, atol=1e-5, msg=n)
    torch._dynamo.reset()
