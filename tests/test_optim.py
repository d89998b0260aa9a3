"""Weight-decay groups and the optimizer factory (zerotron.optim)."""

from __future__ import annotations

import pytest
import torch

from zerotron.errors import ConfigError, UnsupportedError
from zerotron.optim import Adagrad, Lion, build_optimizer, get_param_groups


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(10, 8)
        self.ln_1 = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.ln_f = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def names_of(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in params)


def test_param_groups_exclude_biases_and_layernorm_weights():
    model = Block()
    decay, no_decay = get_param_groups(model, weight_decay=0.1)
    assert names_of(model, decay["params"]) == ["fc.weight", "proj.weight", "wte.weight"]
    assert names_of(model, no_decay["params"]) == [
        "fc.bias", "ln_1.bias", "ln_1.weight", "ln_f.bias", "ln_f.weight",
    ]  # fmt: skip
    assert (decay["weight_decay"], decay["wd_mult"]) == (0.1, 1.0)
    assert (no_decay["weight_decay"], no_decay["wd_mult"]) == (0.0, 0.0)


def test_param_groups_custom_predicate_and_empty_groups():
    model = Block()
    groups = get_param_groups(model, 0.1, no_decay_predicate=lambda n, p: n.startswith("wte"))
    assert [names_of(model, g["params"]) for g in groups][1] == ["wte.weight"]
    only_matrices = torch.nn.Linear(3, 3, bias=False)
    groups = get_param_groups(only_matrices, 0.1)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1


def test_build_optimizer_kinds():
    p = [torch.nn.Parameter(torch.ones(2))]
    assert type(build_optimizer(p, "adam")) is torch.optim.AdamW  # Megatron's / DeepSpeed's adam
    assert type(build_optimizer(p, "AdamW")) is torch.optim.AdamW
    assert type(build_optimizer(p, "adam", adam_w_mode=False)) is torch.optim.Adam
    sgd = build_optimizer(p, "sgd", lr=0.5, momentum=0.9)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    opt = build_optimizer(p, lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.05)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-6
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["weight_decay"] == 0.05
    with pytest.raises(UnsupportedError, match="OneBitAdam.*not supported"):
        build_optimizer(p, "OneBitAdam")
    with pytest.raises(ConfigError, match="unknown optimizer .adamx"):
        build_optimizer(p, "adamx")


def test_build_optimizer_lion_takes_betas_and_weight_decay():
    p = [torch.nn.Parameter(torch.ones(2))]
    opt = build_optimizer(p, "Lion", lr=3e-4, betas=(0.95, 0.98), eps=1e-3, weight_decay=0.1)
    assert type(opt) is Lion
    assert opt.defaults == {"lr": 3e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}


def test_build_optimizer_adagrad_takes_eps_and_weight_decay():
    p = [torch.nn.Parameter(torch.ones(2))]
    opt = build_optimizer(p, "adagrad", lr=0.05, betas=(0.5, 0.5), eps=1e-6, weight_decay=0.1)
    assert type(opt) is Adagrad
    assert opt.defaults == {"lr": 0.05, "eps": 1e-6, "weight_decay": 0.1}
    assert opt.fused is None  # impl "auto": Adagrad picks per step
    assert build_optimizer(p, "adagrad", impl="fused").fused is True
    assert build_optimizer(p, "adagrad", impl="foreach").fused is False


def test_impl_choice_and_group_generators():
    model = Block()
    groups = [{**g, "params": iter(g["params"])} for g in get_param_groups(model, 0.1)]
    opt = build_optimizer(groups)  # generators inside groups are read once
    assert opt.defaults["fused"] is True  # fused AdamW exists on CPU in torch >= 2.4
    assert sum(len(g["params"]) for g in opt.param_groups) == 8
    assert build_optimizer(model.fc.parameters(), impl="foreach").defaults["foreach"] is True
    with pytest.raises(ConfigError, match="impl"):
        build_optimizer(model.fc.parameters(), impl="apex")


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adamw_update_matches_the_formula(impl):
    """One AdamW step, written out: decoupled decay, bias-corrected moments."""
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    g = torch.randn(5, 3)
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    build_optimizer([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, impl=impl).step()
    w = w0.double() * (1 - lr * wd)
    m_hat = (1 - b1) * g.double() / (1 - b1)
    v_hat = (1 - b2) * g.double() ** 2 / (1 - b2)
    want = w - lr * m_hat / (v_hat.sqrt() + eps)
    assert torch.allclose(p.double(), want, rtol=1e-6, atol=1e-7)
