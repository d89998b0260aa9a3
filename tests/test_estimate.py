"""The memory estimator's formulas against published numbers, and ``zerotron estimate``.

- DeepSpeed's ZeRO-2/3 model-state estimates reproduced to the byte (every row of its
  ``_all_cold`` tables; the reference is tests/fixtures/deepspeed/estimators.json, made by real
  DeepSpeed with make_estimator_fixtures.py; the printed tables themselves, ``all_live``
  included, are tests/test_compat_runtime.py's);
- the ZeRO paper's Figure 1 (7.5B parameters, 64 GPUs, K = 12): 120, 31.4, 16.6, 1.9 GB, and
  where zerotron's own accounting lands on it;
- Korthikanti et al. 2022's activation formulas and their worked numbers;
- zerotron's layer against the paper's; the pipeline's in-flight micro-batches;
- the command: --json, the --gpu-memory verdict, --plot, a bad flag.

The measured comparison (estimates within 10% of what CPU runs hold) is
tests/test_estimate_measured.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from zerotron.cli import main as cli
from zerotron.tuning import activations as act
from zerotron.tuning.estimate import Layout, ModelShape, activation_case, estimate
from zerotron.tuning.model_states import model_state_bytes
from zerotron.tuning.zero_memory import (
    zero2_model_states_mem,
    zero3_model_states_mem,
    zero_paper_model_states,
)

REFERENCE = json.loads(
    (Path(__file__).parent / "fixtures" / "deepspeed" / "estimators.json").read_text()
)


def _case_id(case) -> str:
    return f"{case['total_params']}-{case['num_gpus_per_node']}x{case['num_nodes']}"


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=_case_id)
def test_zero2_bytes_equal_deepspeeds(case):
    args = (case["total_params"], case["num_gpus_per_node"], case["num_nodes"])
    for key, (cpu, gpu) in case["bytes"]["zero2"].items():
        offload = key.endswith("=1")
        got = zero2_model_states_mem(*args, offload, case["additional_buffer_factor"])
        assert (got.cpu_bytes, got.gpu_bytes) == (cpu, gpu), key


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=_case_id)
def test_zero3_bytes_equal_deepspeeds(case):
    for key, (cpu, gpu) in case["bytes"]["zero3"].items():
        flags = dict(item.split("=") for item in key.split(","))
        got = zero3_model_states_mem(
            case["total_params"],
            case["largest_layer_params"],
            case["num_gpus_per_node"],
            case["num_nodes"],
            cpu_offload=flags["offload_optimizer"] == "1",
            cpu_offload_params=flags["offload_param"] == "1",
            zero_init=flags["zero_init"] == "1",
            additional_buffer_factor=case["additional_buffer_factor"],
        )
        assert (got.cpu_bytes, got.gpu_bytes) == (cpu, gpu), key


ZERO_PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB, Figure 1: 7.5B parameters, N = 64


@pytest.mark.parametrize("stage", sorted(ZERO_PAPER))
def test_zero_paper_figure_1(stage):
    assert round(zero_paper_model_states(7.5e9, 64, stage) / 1e9, 1) == ZERO_PAPER[stage]


def _zerotron_states(stage: int, precision: str, microbatches: int = 1) -> float:
    # 7.5B parameters in 100 modules of 75M (ZeRO-3 gathers one module at a time)
    s = model_state_bytes(
        [[75_000_000]] * 100,
        precision=precision,
        zero_stage=stage,
        dp=64,
        num_microbatches=microbatches,
        param_persistence_threshold=0,
    )
    return (s.parameters + s.gradients + s.master_weights + s.optimizer_states) / 1e9


def test_zerotron_zero1_fp16_is_the_papers_p_os():
    assert round(_zerotron_states(1, "fp16"), 1) == ZERO_PAPER[1]


def test_zerotron_zero2_bf16_is_the_papers_p_os_g():
    # a 16-bit gradient partition, as the paper's; plus the 2M-element fp32 step piece (8 MB)
    assert round(_zerotron_states(2, "bf16"), 1) == ZERO_PAPER[2]


def test_zerotron_zero3_is_the_papers_p_os_g_p():
    # the shards are the fp32 masters' chunks; with accumulation the partition is fp32; on top,
    # what the paper leaves out: two 75M-parameter modules gathered whole in 16 bits
    gathered = 2 * 75_000_000 * 2 / 1e9
    assert round(_zerotron_states(3, "bf16", microbatches=2) - gathered, 1) == ZERO_PAPER[3]


def test_zerotron_zero0_accumulates_in_fp32():
    # fp32 gradient buffers (main_grad) instead of the paper's 16-bit ones: 2 bytes more each
    assert _zerotron_states(0, "bf16") == pytest.approx(ZERO_PAPER[0] + 2 * 7.5)


# ---- activations: Korthikanti et al. 2022 ----------------------------------------------------

GPT3 = dict(s=2048, b=1, h=12288, a=96)  # 175B
MT_NLG = dict(s=2048, b=1, h=20480, a=128)  # 530B


def test_paper_attention_term_of_gpt3_is_80():
    s, h, a = GPT3["s"], GPT3["h"], GPT3["a"]
    assert 5 * a * s / h == 80


@pytest.mark.parametrize("model,saved", [(GPT3, 0.70), (MT_NLG, 0.65)], ids=["gpt3", "mt-nlg"])
def test_selective_recompute_saves_the_papers_share(model, saved):
    full = act.paper_layer_bytes(**model, t=8, sequence_parallel=True)
    selective = act.paper_layer_bytes(**model, t=8, sequence_parallel=True, recompute="selective")
    assert round(1 - selective / full, 2) == saved


def test_sequence_parallel_and_selective_cut_activations_5x():
    # the abstract's "5x": tensor parallelism alone vs with sequence parallelism and selective
    tp_only = act.paper_layer_bytes(**GPT3, t=8)
    both = act.paper_layer_bytes(**GPT3, t=8, sequence_parallel=True, recompute="selective")
    assert 5 <= tp_only / both < 6


def test_paper_forms_agree():
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    assert act.paper_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert act.paper_layer_bytes(s, b, h, a, t=4, sequence_parallel=True) == pytest.approx(
        act.paper_layer_bytes(s, b, h, a) / 4
    )
    assert act.paper_layer_bytes(s, b, h, a, t=4, recompute="full") == 2 * sbh
    assert act.paper_layer_bytes(s, b, h, a, t=4, sequence_parallel=True, recompute="full") == (
        2 * sbh / 4
    )


def test_paper_interleaving_factor():
    assert act.paper_interleave_factor(4, 2) == 1 + 3 / 8
    per_layer = act.paper_layer_bytes(**GPT3, t=8, sequence_parallel=True, recompute="selective")
    first = act.paper_first_stage_bytes(**GPT3, num_layers=96, t=8, p=8, v=2,
                                        sequence_parallel=True, recompute="selective")  # fmt: skip
    assert first == pytest.approx(per_layer * 96 * (1 + 7 / 16))


def _case(**kw) -> act.ActivationCase:
    base = dict(seq_length=2048, micro_batch_size=1, hidden_size=12288, num_attention_heads=96,
                ffn_hidden_size=4 * 12288, vocab_size=50257, padded_vocab_size=50304)  # fmt: skip
    return act.ActivationCase(**{**base, **kw})


def test_zerotron_cuda_layer_is_the_papers_without_the_as2_terms():
    # flash attention keeps an fp32 log-sum-exp [b, a, s] instead of 5as²b; LayerNorms keep
    # fp32 mean and rstd per token (4 × 4sb), which the paper leaves out
    s, b, h, a = 2048, 1, 12288, 96
    got = act.layer_bytes(_case(device="cuda"))
    assert got == 34 * s * b * h + 16 * s * b + 4 * a * s * b


def test_zerotron_without_dropout_keeps_no_masks():
    s, b, h = 2048, 1, 12288
    with_masks = act.layer_bytes(_case())
    assert with_masks - act.layer_bytes(_case(hidden_dropout=0.0)) == 2 * s * b * h


def test_zerotron_selective_with_sp_is_the_papers_plus_gathered_inputs():
    # zerotron's column-parallel linears keep their all-gathered input: 2 × 2sbh more than 34sbh/t
    s, b, h, t = 2048, 1, 12288, 8
    got = act.layer_bytes(_case(tp=t, sequence_parallel=True, recompute="selective"))
    stats = 2 * 2 * 4 * s * b // t
    assert got == 34 * s * b * h // t + 4 * s * b * h * (1 - 1 / t) + stats


def test_first_stage_holds_p_microbatches_in_1f1b():
    shape = ModelShape(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
                       vocab_size=1000)  # fmt: skip
    layout = Layout(pp=4, num_microbatches=8)
    case = activation_case(shape, layout)
    first = estimate(shape, layout, pipeline_rank=0).activations
    assert first == 4 * (2 * act.layer_bytes(case) + act.embedding_bytes(case))
    last = estimate(shape, layout, pipeline_rank=3).activations
    assert last == 2 * act.layer_bytes(case) + act.head_bytes(case)


def test_estimate_defaults_to_the_fullest_stage():
    shape = ModelShape.gpt2("355M")
    layout = Layout(pp=4, num_microbatches=8, micro_batch_size=4)
    stages = [estimate(shape, layout, r).total for r in range(4)]
    assert estimate(shape, layout).total == max(stages)


def test_num_parameters_is_zerotrons_gpt():
    from zerotron.distributed.comm import Group
    from zerotron.models import GPT, GPTConfig

    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                       vocab_size=1000)  # fmt: skip
    model = GPT(GPTConfig(2, 64, 4, 32, shape.padded_vocab(), orig_vocab_size=1000),
                tp_group=Group.single("tp"))  # fmt: skip
    assert shape.num_parameters() == model.num_parameters()


# ---- zerotron estimate --------------------------------------------------------------------

GPT2_MEDIUM = (
    "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
    "--micro-batch-size 4 --global-batch-size 256 --bf16"
)
FLAGS = [*GPT2_MEDIUM.split(), "--num-gpus", "8"]


def test_cli_json(capsys):
    assert cli(["estimate", *FLAGS, "--zero-stage", "1", "--layout", "", "--layout", "tp=2",
                "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    first, second = out["layouts"]
    assert first["layout"]["dp"] == 8 and second["layout"]["dp"] == 4
    assert second["layout"]["num_microbatches"] == 256 // (4 * 4)
    mem = first["memory"]
    assert mem["total"] == sum(v for k, v in mem.items() if k not in ("total", "host"))
    shape = ModelShape.gpt2("355M")
    expected = estimate(shape, Layout(dp=8, zero_stage=1, micro_batch_size=4, num_microbatches=8))
    assert mem == expected.as_dict()


@pytest.mark.parametrize("memory,fits", [("80GB", True), ("4GB", False)])
def test_cli_gpu_memory_verdict(capsys, memory, fits):
    assert cli(["estimate", *FLAGS, "--gpu-memory", memory, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["layouts"][0]
    assert entry["fits"] is fits
    assert entry["headroom"] == int(memory[:-2]) * 2**30 - entry["memory"]["total"]
    assert cli(["estimate", *FLAGS, "--gpu-memory", memory]) == 0
    table = capsys.readouterr().out
    assert ("GiB free" if fits else "GiB over") in table


def test_cli_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "memory.png"
    assert cli(["estimate", *FLAGS, "--layout", "zero=1", "--layout", "zero=3,recompute=full",
                "--plot", str(out)]) == 0  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["--layout", "flag"])
def test_cli_names_the_flag_when_tp_does_not_divide_heads(capsys, how):
    # 24 GPUs and a global batch of 288: dp 24 and dp 8 both divide it
    args = [*GPT2_MEDIUM.split(), "--num-gpus", "24", "--global-batch-size", "288"]
    args += ["--layout", "tp=3"] if how == "--layout" else ["--tensor-model-parallel-size", "3"]
    assert cli(["estimate", *args]) == 2
    err = capsys.readouterr().err
    assert "--tensor-model-parallel-size" in err and "not divisible" in err


def test_cli_bad_layout_key(capsys):
    assert cli(["estimate", *FLAGS, "--layout", "tensor=2"]) == 2
    assert "--layout" in capsys.readouterr().err


def test_cli_reads_a_deepspeed_json(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 4,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            }
        )
    )
    shape = GPT2_MEDIUM.split()[:8]  # the model's shape flags only
    args = ["estimate", "--deepspeed_config", str(ds), *shape, "--nodes", "2"]
    assert cli([*args, "--gpus-per-node", "8", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["layouts"][0]
    layout, mem = entry["layout"], entry["memory"]
    assert (layout["dp"], layout["zero_stage"], layout["offload_optimizer"]) == (16, 2, "cpu")
    assert (layout["micro_batch_size"], layout["num_microbatches"]) == (4, 1)
    assert mem["master_weights"] == mem["optimizer_states"] == 0 and mem["host"] > 0


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (3, 2), (4, 3)])
def test_in_flight_peaks_saturate(p, v):
    kind = "interleaved" if v > 1 else "1f1b"
    cap = act.saturated(p, 10**6, v)
    assert act._in_flight(kind, p, cap, v) == act._in_flight(kind, p, 3 * cap, v)
    assert act._chunk_in_flight(kind, p, cap, v) == act._chunk_in_flight(kind, p, 3 * cap, v)


CPU_BF16 = [*GPT2_MEDIUM.split(), "--attention-dropout", "0", "--device", "cpu"]
CACHED = {"matmul16": "fp32", "attention": "fp32"}  # not the defaults: other buffers


@pytest.fixture
def cached_kernels(monkeypatch, tmp_path):
    """This machine's kernel cache holding ``CACHED`` for CPU_BF16's shape, nothing forced."""
    from zerotron.kernels import KernelShape, chooser
    from zerotron.tuning.estimate_cli import load

    monkeypatch.delenv(chooser.ENV, raising=False)  # the suite forces the defaults
    monkeypatch.setenv(chooser.CACHE_ENV, str(tmp_path))
    cfg = load([a for a in CPU_BF16 if a not in ("--device", "cpu")], 1)
    timed = {n: {str(c): 1.0 for c in chooser.CANDIDATES[n]} for n in CACHED}
    key = chooser._entry_key(KernelShape.from_config(cfg, 50257))
    chooser._write_cache(chooser.cache_path(), key, {"choices": CACHED, "timings_ms": timed})
    return cfg


def test_cli_on_cpu_estimates_the_kernels_cached_here(cached_kernels, capsys):
    from zerotron.kernels import KernelChoices

    assert cli(["estimate", *CPU_BF16, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["layouts"]
    kernels = KernelChoices(**CACHED)
    assert entry["layout"]["kernels"] == dataclasses.asdict(kernels)
    layout = Layout.from_config(cached_kernels, device="cpu", kernels=kernels)
    assert entry["memory"] == estimate(ModelShape.from_config(cached_kernels), layout).as_dict()


def test_cli_on_cpu_prints_the_kernels_it_assumed(cached_kernels, capsys):
    assert cli(["estimate", *CPU_BF16]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU kernels: linear=- (n/a), matmul16=fp32 (cached), attention=fp32 ")


def test_cli_on_cpu_takes_the_kernels_flag_over_the_cache(cached_kernels, capsys):
    assert cli(["estimate", *CPU_BF16, "--kernels", "attention=sdpa", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["layouts"]
    assert entry["layout"]["kernels"]["attention"] == "sdpa"
    assert entry["layout"]["kernels"]["matmul16"] == "fp32"  # not forced: still the cached one
