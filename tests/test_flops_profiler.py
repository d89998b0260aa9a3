"""The FLOPs profiler against the closed form, and DeepSpeed's ``flops_profiler`` config block.

A tiny GPT (2 layers, hidden 64, 4 heads, 16 positions, 100-token vocabulary, batch 2), one
process. The closed form is the planner's (:mod:`zerotron.tuning.cost`): per layer
``2·b·s·(4h² + 2hf) + 4·b·s²·h`` (QKV, projection and MLP products; QKᵀ and the weighted sum
over every query-key pair), the output layer ``2·b·s·h·V`` over the real vocabulary (TP 1: the
logits leave out padding rows); with ``f = 4h`` the forward is
``24·b·s·l·h²·(1 + s/6h + V/12lh)``. The profiler's forward FLOPs equal it exactly, module by
module, and so do real DeepSpeed's MACs (a committed fixture; its FLOPs add its estimates of the
layer norms and GeLU). The backward counts twice the forward plus one ``QKᵀ`` per layer
(``2·b·s²·h``) that SDPA's CPU flash backward recomputes (torch's formula counts it). With
labels on the CPU the fused loss computes the output layer's gradient products during the
forward: the forward then holds the output layer's three products, the backward the layers'.

The Engine with the config block prints DeepSpeed's profile at ``profile_step`` (its rows
checked), or writes it to ``output_file``; ``module_depth``, ``top_modules`` and ``detailed``
shape the printout.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import zerotron
from zerotron.config import load_deepspeed_config
from zerotron.engine.flops_profiler import FlopsProfiler, flop_counter
from zerotron.errors import ConfigError
from zerotron.models import GPT, GPTConfig
from zerotron.profiling.flops_profiler import get_model_profile, number_to_string
from zerotron.tuning.cost import head_forward_flops, layer_forward_flops
from zerotron.tuning.estimate import ModelShape

L, H, HEADS, S, V, B = 2, 64, 4, 16, 100, 2

# DeepSpeed's defaults (deepspeed/profiling/constants.py)
DEEPSPEED_DEFAULTS = {
    "enabled": False,
    "recompute_fwd_factor": 0.0,
    "profile_step": 1,
    "module_depth": -1,
    "top_modules": 1,
    "detailed": True,
    "output_file": None,
}

SHAPE = ModelShape(
    num_layers=L,
    hidden_size=H,
    num_attention_heads=HEADS,
    seq_length=S,
    vocab_size=V,
    make_vocab_size_divisible_by=1,  # the logits cover the real vocabulary only (TP 1)
)
LAYER = layer_forward_flops(SHAPE, B)
HEAD = head_forward_flops(SHAPE, B)
FORWARD = L * LAYER + HEAD
# SDPA's CPU flash backward recomputes the scores QKᵀ before the four gradient products
RECOMPUTED_SCORES = L * 2 * B * S * S * H


def _gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=HEADS,
        seq_length=S,
        vocab_size=128,  # padded rows, as zerotron pads for TP
        orig_vocab_size=V,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPT(cfg)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def profiled():
    """One profiled forward of the tiny GPT (no labels: the logits)."""
    model = _gpt()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(_tokens())
    prof.stop_profile()
    return model, prof


# ---- the closed form


def test_the_closed_form_is_narayanans_forward():
    h, s, v = H, S, V
    closed = 24 * B * S * L * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * L * h))
    assert closed == FORWARD


def test_forward_flops_equal_the_closed_form(profiled):
    _, prof = profiled
    assert prof.get_total_flops() == FORWARD
    assert prof.get_total_macs() == FORWARD // 2


def test_each_layer_and_the_output_layer_equal_their_terms(profiled):
    model, prof = profiled
    assert [prof.module_flops(layer) for layer in model.layers] == [LAYER] * L
    assert prof.module_flops(model.layers) == L * LAYER  # a ModuleList: its children's sum
    assert prof.module_flops(model.lm_head) == HEAD
    assert prof.module_flops(model.embedding) == 0  # a lookup
    attention = 4 * B * S * S * H + 2 * B * S * 4 * H * H  # core + QKV and projection
    assert prof.module_flops(model.layers[0].self_attention) == attention


def test_parameters_are_the_models(profiled):
    model, prof = profiled
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())


def test_backward_counts_twice_the_forward_and_the_recomputed_scores():
    model = _gpt()
    logits = model(_tokens())
    with flop_counter() as counter:
        logits.float().square().mean().backward()
    assert counter.get_total_flops() == 2 * FORWARD + RECOMPUTED_SCORES


def test_the_fused_loss_moves_the_output_layers_gradient_into_the_forward():
    model = _gpt()
    tokens, labels = _tokens(1), _tokens(2)
    with flop_counter() as forward:
        loss = model(tokens, labels=labels).mean()
    with flop_counter() as backward:
        loss.backward()
    assert forward.get_total_flops() == L * LAYER + 3 * HEAD
    assert backward.get_total_flops() == 2 * L * LAYER + RECOMPUTED_SCORES
    assert forward.get_total_flops() + backward.get_total_flops() == (
        3 * FORWARD + RECOMPUTED_SCORES
    )


# ---- real DeepSpeed's profiler on the same model (tests/fixtures/deepspeed/flops_profiler.json)

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed" / "flops_profiler.json"


@pytest.fixture(scope="module")
def deepspeed():
    data = json.loads(FIXTURE.read_text())
    shape = {"num_layers": L, "hidden_size": H, "num_attention_heads": HEADS, "seq_length": S}
    assert data["shape"] == shape | {"vocab": V, "padded_vocab": 128, "batch": B}
    return data


def test_deepspeed_counts_the_same_macs_module_by_module(profiled, deepspeed):
    model, prof = profiled
    ours = {name or "<model>": prof.module_flops(m) // 2 for name, m in model.named_modules()}
    assert ours == {name: row["macs"] for name, row in deepspeed["modules"].items()}


def test_deepspeed_counts_the_same_parameters_module_by_module(profiled, deepspeed):
    model, prof = profiled
    ours = {name or "<model>": prof.module_params(m) for name, m in model.named_modules()}
    assert ours == {name: row["params"] for name, row in deepspeed["modules"].items()}


def test_deepspeeds_flops_add_only_its_element_wise_terms(deepspeed):
    layer_norms = (2 * L + 1) * 5 * B * S * H  # 5 per element (with the affine weight)
    gelu = L * B * S * 4 * H  # 1 per element
    assert deepspeed["flops"] - FORWARD == layer_norms + gelu


def test_the_summary_has_deepspeeds_rows(deepspeed):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        get_model_profile(_gpt(), args=[_tokens()], detailed=False)
    labels = [label.strip() for label in re.findall(r"^(.+?:)  +\S", out.getvalue(), re.M)]
    assert labels == deepspeed["summary_labels"]


# ---- get_model_profile


def test_get_model_profile_returns_the_closed_form(capsys):
    flops, macs, params = get_model_profile(
        _gpt(), args=[_tokens()], print_profile=False, as_string=False
    )
    assert (flops, macs) == (FORWARD, FORWARD // 2)
    assert params == sum(p.numel() for p in _gpt().parameters())
    assert capsys.readouterr().out == ""


def test_get_model_profile_as_strings():
    got = get_model_profile(_gpt(), args=[_tokens()], print_profile=False)
    assert got[0] == number_to_string(FORWARD)
    assert got[1] == number_to_string(FORWARD // 2) + "MACs"


def test_numbers_are_written_as_deepspeed_writes_them():
    assert number_to_string(336_230_000) == "336.23 M"
    assert number_to_string(6_279_860_000_000) == "6.28 T"
    assert number_to_string(0) == "0 "
    assert number_to_string(34.09e-6) == "34.09 u"


# ---- the printout: module_depth, top_modules, detailed


def _printout(prof: FlopsProfiler, capsys, **options) -> str:
    prof.print_model_profile(**options)
    return capsys.readouterr().out


def test_module_depth_limits_the_aggregated_depths(profiled, capsys):
    _, prof = profiled
    out = _printout(prof, capsys, module_depth=2, detailed=False)
    assert re.findall(r"^depth (\d+):", out, re.M) == ["0", "1"]
    every = _printout(prof, capsys, module_depth=-1, detailed=False)
    # GPT > layers > TransformerLayer > SelfAttention > ColumnParallelLinear: 5 depths
    assert re.findall(r"^depth (\d+):", every, re.M) == ["0", "1", "2", "3", "4"]


def test_top_modules_lists_that_many_types_per_depth(profiled, capsys):
    _, prof = profiled
    one = _printout(prof, capsys, module_depth=2, top_modules=1, detailed=False)
    assert "    params      - {'GPT': " in one
    depth1 = re.search(r"depth 1:\n    params      - (\{.*\})", one)[1]
    assert len(ast.literal_eval(depth1)) == 1
    three = _printout(prof, capsys, module_depth=2, top_modules=3, detailed=False)
    depth1 = re.search(r"depth 1:\n    params      - (\{.*\})", three)[1]
    assert list(ast.literal_eval(depth1)) == [
        "ModuleList",
        "Embedding",
        "LayerNorm",
    ]  # by parameters


def test_detailed_prints_every_module_with_its_share(profiled, capsys):
    model, prof = profiled
    out = _printout(prof, capsys, detailed=True)
    assert "Detailed Profile per GPU" in out
    head = f"{number_to_string(HEAD // 2)}MACs = {round(100 * HEAD / FORWARD, 2):g}% MACs"
    assert re.search(r"^  \(lm_head\): LMHead\(0 = 0% Params, " + re.escape(head), out, re.M)
    assert out.count("): TransformerLayer(") == L
    terse = _printout(prof, capsys, detailed=False)
    assert "Detailed Profile per GPU" not in terse and "TransformerLayer(" not in terse


# ---- the config block and the Engine


def test_the_flops_profiler_block_is_accepted_with_deepspeeds_defaults():
    cfg, _ = load_deepspeed_config({"train_batch_size": 1, "flops_profiler": {}})
    got = {k: getattr(cfg.flops_profiler, f"flops_profiler_{k}") for k in DEEPSPEED_DEFAULTS}
    assert got == DEEPSPEED_DEFAULTS


def test_an_unknown_flops_profiler_key_is_an_error():
    with pytest.raises(ConfigError, match="flops_profiler"):
        load_deepspeed_config({"train_batch_size": 1, "flops_profiler": {"profile_steps": 2}})


def test_a_bad_flops_profiler_value_names_the_key():
    with pytest.raises(ConfigError, match="flops_profiler.top_modules"):
        load_deepspeed_config({"train_batch_size": 1, "flops_profiler": {"top_modules": 0}})


def _train(config_extra: dict, steps: int = 3, gas: int = 1) -> None:
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **config_extra,
    }
    engine, _, _, _ = zerotron.initialize(model=_gpt(), config=config)
    for step in range(steps * gas):
        loss = engine(_tokens(step), labels=_tokens(step + 10)).mean()
        engine.backward(loss)
        engine.step()


def test_the_engine_prints_the_profile_of_profile_step(capsys):
    profiler = {"enabled": True, "profile_step": 1, "top_modules": 2}
    _train({"flops_profiler": profiler, "wall_clock_breakdown": True, "steps_per_print": 100})
    out = capsys.readouterr().out
    # global_steps counts finished steps: step 1 is the second, printed as it ends (DeepSpeed)
    assert re.findall(r"Profile Summary at step (\d+):", out) == ["2"]
    rows = dict(re.findall(r"^(.+?:) +(\S.*?)\s*$", out, re.M))
    assert rows["world size:"] == "1" and rows["batch size per GPU:"] == str(B)
    # with labels the fused loss runs the output layer's gradient products in the forward
    assert rows["fwd flops per GPU:"] == number_to_string(L * LAYER + 3 * HEAD)
    assert (
        rows["params per GPU:"]
        == number_to_string(sum(p.numel() for p in _gpt().parameters())).strip()
    )
    for row in ("fwd latency:", "bwd latency:", "step latency:", "iter latency:"):
        assert re.fullmatch(r"[\d.]+ [mu]?s", rows[row]), rows[row]
    assert "bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency:" in rows
    assert "Detailed Profile per GPU" in out


def test_output_file_takes_the_profile(tmp_path, capsys):
    path = tmp_path / "profiles" / "flops.txt"
    profiler = {"enabled": True, "profile_step": 0, "output_file": str(path), "detailed": False}
    _train({"flops_profiler": profiler}, steps=2)
    assert "DeepSpeed Flops Profiler" not in capsys.readouterr().out
    text = path.read_text()
    assert re.findall(r"Profile Summary at step (\d+):", text) == ["1"]
    assert "bwd latency:" not in text  # without wall_clock_breakdown, as DeepSpeed


def test_with_accumulation_the_profile_is_one_micro_batchs(capsys):
    profiler = {"enabled": True, "profile_step": 0, "detailed": False}
    _train({"flops_profiler": profiler}, steps=2, gas=2)
    out = capsys.readouterr().out
    assert re.findall(r"Profile Summary at step (\d+):", out) == ["1"]
    rows = dict(re.findall(r"^(.+?:) +(\S.*?)\s*$", out, re.M))
    assert rows["fwd flops per GPU:"] == number_to_string(L * LAYER + 3 * HEAD)


def test_the_pipeline_engine_profiles_its_stage(capsys):
    from torch import nn

    from zerotron.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Linear(16, 4)]
    module = PipelineModule(layers=layers, num_stages=1, loss_fn=nn.MSELoss())
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 0, "detailed": False},
    }
    engine, _, _, _ = zerotron.initialize(model=module, config=config)
    g = torch.Generator().manual_seed(0)
    batches = iter([(torch.randn(B, 8, generator=g), torch.randn(B, 4, generator=g))] * 4)
    engine.train_batch(batches)
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(.+?:) +(\S.*?)\s*$", out, re.M))
    assert rows["fwd MACs per GPU:"] == f"{B * (8 * 16 + 16 * 4)} MACs"  # one micro-batch
