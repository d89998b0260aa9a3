"""The kernel chooser (zerotron.kernels.chooser): the fastest candidate wins (a fake clock and fake
candidates, no real timing), the cache is written, read, keyed by machine / torch / shape class
and never measured again; forcing each candidate runs exactly that path."""

import dataclasses
import json
import shlex

import pytest
import torch
import torch.nn.functional as F

import zerotron.cli
import zerotron.training.kernels_cli
from tests.test_kernel_policy import config, loss_and_grads
from zerotron.config import parse_megatron_args
from zerotron.errors import ConfigError
from zerotron.kernels import chooser, measure, onednn, upcast
from zerotron.kernels.attention_cpu import sdpa_math_16bit
from zerotron.kernels.chooser import KernelShape, choose_kernels, time_candidates
from zerotron.kernels.fused_cross_entropy import fused_linear_cross_entropy
from zerotron.kernels.policy import KernelChoices, current_choices, kernel_policy, set_choices
from zerotron.models import GPT
from zerotron.models.gpt import _core_attention

FP32 = KernelShape(hidden=64, heads=4, seq=32, micro_batch=2, vocab=100, dtype="fp32", threads=1)
BF16 = KernelShape(hidden=64, heads=4, seq=32, micro_batch=2, vocab=100, dtype="bf16", threads=1)
USE_FLASH_ATTN = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 1 --bf16 --use-flash-attn"
)
# seconds each candidate takes on the fake clock: torch and 4096 columns are the fastest
COSTS = {"onednn": 3, "torch": 2, "math16": 1, "sdpa": 4, 1024: 5, 2048: 4, 4096: 1, 8192: 2}
COSTS |= {"native": 6, "fp32": 1}  # matmul16: fp32 wins; attention: fp32 ties math16 (first)


class FakeMachine:
    """A clock that only candidates advance, by their cost in ``COSTS``; counts the calls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def runners(self, name, shape):
        def run(candidate):
            def call():
                self.calls += 1
                self.now += COSTS[candidate]

            return call

        return {c: run(c) for c in chooser.CANDIDATES.get(name, chooser.PRECISIONS)}

    def choose(self, shape=FP32, **kw):
        return choose_kernels(shape, "cpu", runners=self.runners, clock=self.clock, **kw)


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    """No forcing from the suite's conftest, a private cache (conftest restores the choices)."""
    for env in (chooser.ENV, "ZEROTRON_ONEDNN", "ZEROTRON_MATH_ATTENTION", "ZEROTRON_FUSED_LOSS"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(chooser.CACHE_ENV, str(tmp_path))


def test_time_candidates_returns_the_fastest():
    fake = FakeMachine()
    winner, times = time_candidates(fake.runners("loss_chunk", FP32), clock=fake.clock)
    assert winner == 4096
    assert times == {1024: 5, 2048: 4, 4096: 1, 8192: 2}


def test_a_tie_keeps_the_first_candidate():
    fake = FakeMachine()
    same = fake.runners("linear", FP32)["torch"]
    runners = {"onednn": same, "torch": same}
    assert time_candidates(runners, clock=fake.clock)[0] == "onednn"


def test_first_use_measures_applies_and_writes_the_cache(tmp_path):
    chosen = FakeMachine().choose()
    assert chosen.how == {
        "linear": "measured",
        "matmul16": "n/a",
        "attention": "n/a",
        "loss_chunk": "n/a",
    }
    assert current_choices().linear == "torch"  # loss_chunk only runs with oneDNN linears
    data = json.loads((tmp_path / "kernels.json").read_text())
    (entry,) = data["entries"].values()
    assert entry["choices"] == {"linear": "torch"}
    assert "measured in" in chosen.line() and "linear=torch (measured)" in chosen.line()


def test_loss_chunk_is_measured_when_onednn_wins(monkeypatch):
    monkeypatch.setitem(COSTS, "onednn", 0)
    chosen = FakeMachine().choose()
    assert chosen.choices == KernelChoices(linear="onednn", loss_chunk=4096)
    assert chosen.how["loss_chunk"] == "measured"


def test_a_cached_machine_never_measures():
    FakeMachine().choose()
    again = FakeMachine()
    chosen = again.choose()
    assert again.calls == 0
    assert chosen.how["linear"] == "cached" and chosen.choices.linear == "torch"
    assert "; from " in chosen.line() and "measured" not in chosen.line()


def test_another_torch_version_misses_the_cache(monkeypatch):
    FakeMachine().choose()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    again = FakeMachine()
    assert again.choose().how["linear"] == "measured" and again.calls > 0


def test_another_cpu_misses_the_cache(monkeypatch):
    FakeMachine().choose()
    monkeypatch.setattr(chooser, "machine_key", lambda: "Some Other CPU [flags 0]")
    again = FakeMachine()
    assert again.choose().how["linear"] == "measured" and again.calls > 0


def test_another_shape_class_misses_the_cache():
    FakeMachine().choose()
    again = FakeMachine()
    wider = KernelShape(128, 4, 32, 2, 100, "fp32", 1)
    assert again.choose(wider).how["linear"] == "measured" and again.calls > 0


def test_the_same_shape_class_hits_the_cache():
    FakeMachine().choose(KernelShape(64, 4, 300, 2, 100, "fp32", 1))
    again = FakeMachine()
    assert again.choose(KernelShape(64, 4, 400, 2, 100, "fp32", 1)).how["linear"] == "cached"
    assert again.calls == 0


def test_a_choice_cached_before_a_candidate_was_added_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setitem(chooser.CANDIDATES, "attention", ("math16", "sdpa"))  # an older release
    FakeMachine().choose(BF16)
    monkeypatch.setitem(chooser.CANDIDATES, "attention", ("math16", "sdpa", "fp32"))
    monkeypatch.setitem(COSTS, "fp32", 0)  # the new candidate is the fastest
    again = FakeMachine()
    chosen = again.choose(BF16)
    assert chosen.how == {
        "linear": "n/a",
        "matmul16": "cached",
        "attention": "measured",
        "loss_chunk": "n/a",
    }
    assert chosen.choices.attention == "fp32"
    (entry,) = json.loads((tmp_path / "kernels.json").read_text())["entries"].values()
    assert set(entry["timings_ms"]["attention"]) == {"math16", "sdpa", "fp32"}
    assert FakeMachine().choose(BF16).how["attention"] == "cached"


def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    (tmp_path / "kernels.json").write_text("{ not json")
    with pytest.warns(UserWarning, match="unreadable"):
        chosen = FakeMachine().choose()
    assert chosen.how["linear"] == "measured"
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert [e["choices"] for e in data["entries"].values()] == [{"linear": "torch"}]


def test_forced_by_the_environment_measures_nothing(monkeypatch):
    monkeypatch.setenv(chooser.ENV, "linear=onednn,loss_chunk=8192")
    fake = FakeMachine()
    chosen = fake.choose()
    assert fake.calls == 0
    assert chosen.choices == KernelChoices(linear="onednn", loss_chunk=8192)
    assert chosen.how == {
        "linear": "forced",
        "loss_chunk": "forced",
        "matmul16": "n/a",
        "attention": "n/a",
    }
    assert current_choices() == chosen.choices


def test_the_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(chooser.ENV, "attention=math16")
    chosen = FakeMachine().choose(BF16, forced="attention=sdpa")
    assert chosen.choices.attention == "sdpa" and chosen.how["attention"] == "forced"


def test_megatrons_use_flash_attn_reaches_the_chooser_as_forced_sdpa():
    """``zerotron pretrain --use-flash-attn``: the run's attention is SDPA's, not measured."""
    cfg = parse_megatron_args(shlex.split(USE_FLASH_ATTN))
    fake = FakeMachine()
    chosen = fake.choose(BF16, forced=cfg.model.kernels)
    assert chosen.choices.attention == "sdpa" and chosen.how["attention"] == "forced"
    assert not kernel_policy("cpu").attention_16bit and not kernel_policy("cpu").attention_fp32


def test_an_off_switch_forces_the_plain_twin(monkeypatch):
    monkeypatch.setenv("ZEROTRON_MATH_ATTENTION", "0")
    monkeypatch.setenv("ZEROTRON_UPCAST_16BIT", "0")
    fake = FakeMachine()
    chosen = fake.choose(BF16)
    assert chosen.choices.attention == "sdpa" and chosen.choices.matmul16 == "native"
    assert fake.calls == 0


def test_16bit_measures_its_matmuls_and_attention():
    chosen = FakeMachine().choose(BF16)
    assert chosen.how == {
        "linear": "n/a",
        "matmul16": "measured",
        "attention": "measured",
        "loss_chunk": "n/a",
    }
    assert chosen.choices.matmul16 == "fp32" and chosen.choices.attention == "math16"
    assert kernel_policy("cpu").upcast_16bit


@pytest.mark.parametrize("spec", ["linear", "linear=mkl", "loss_chunk=wide", "speed=max"])
def test_a_bad_spec_says_what_is_allowed(spec):
    with pytest.raises(ConfigError, match="--kernels"):
        chooser.parse_forced(spec, "--kernels")


def test_without_measuring_the_defaults_hold_unmeasured(tmp_path):
    fake = FakeMachine()
    chosen = fake.choose(measure=False)
    assert chosen.how["linear"] == "default" and fake.calls == 0
    assert chosen.choices == KernelChoices()
    assert not (tmp_path / "kernels.json").exists()


def test_cuda_has_nothing_to_choose():
    fake = FakeMachine()
    chosen = choose_kernels(FP32, "cuda", runners=fake.runners, clock=fake.clock, apply=False)
    assert set(chosen.how.values()) == {"n/a"} and fake.calls == 0


def test_the_real_candidates_run_on_the_models_shapes():
    cases = (("linear", FP32), ("matmul16", BF16), ("attention", BF16), ("loss_chunk", FP32))
    for name, shape in cases:
        runners = measure.RUNNERS[name](shape)
        assert list(runners) == list(chooser.CANDIDATES[name])
        for call in runners.values():
            call()


def test_a_tensor_parallel_rank_is_its_own_shape_class(tmp_path):
    FakeMachine().choose()
    again = FakeMachine()
    assert again.choose(dataclasses.replace(FP32, tp=2)).how["linear"] == "measured"
    keys = sorted(json.loads((tmp_path / "kernels.json").read_text())["entries"])
    assert [k.endswith(" tp2") for k in keys] == [False, True]


def _shapes_passed(monkeypatch, owner, name: str, position: int) -> list:
    """Wrap ``owner.name``: each call records the shape of its argument at ``position``."""
    real, shapes = getattr(owner, name), []

    def recording(*args, **kwargs):
        shapes.append(tuple(args[position].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return shapes


TP2 = dataclasses.replace(FP32, tp=2)  # hidden 64, 4 heads, vocabulary 100, on 2 ranks


def test_a_tensor_parallel_ranks_linear_layers_are_its_shards(monkeypatch):
    weights = _shapes_passed(monkeypatch, F, "linear", 1)
    measure.linear_runners(TP2)["torch"]()
    assert weights == [(96, 64), (64, 32), (128, 64), (64, 128)]  # 3h/2, h/2 in, 4h/2, 4h/2 in


def test_a_tensor_parallel_rank_attends_with_its_heads(monkeypatch):
    queries = _shapes_passed(monkeypatch, F, "scaled_dot_product_attention", 0)
    measure.attention_runners(dataclasses.replace(TP2, dtype="bf16"))["sdpa"]()
    assert queries == [(2, 2, 32, 16)]  # 2 of the 4 heads


def test_a_tensor_parallel_ranks_loss_has_its_vocabulary_columns(monkeypatch):
    weights = _shapes_passed(monkeypatch, measure, "fused_linear_cross_entropy", 1)
    measure.loss_chunk_runners(TP2)[1024]()
    assert weights == [(50, 64)]  # half the vocabulary


def test_kernels_command_measures_a_tensor_parallel_rank(monkeypatch, capsys):
    shapes = []
    real = zerotron.training.kernels_cli.choose_kernels

    def recording(shape, *args, **kwargs):
        shapes.append(shape)
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(zerotron.training.kernels_cli, "choose_kernels", recording)
    argv = ["kernels", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
    assert zerotron.cli.main([*argv, "--tensor-model-parallel-size", "2"]) == 0
    assert [s.tp for s in shapes] == [2]
    with pytest.raises(SystemExit):
        zerotron.cli.main([*argv, "--tensor-model-parallel-size", "4"])
    assert "multiple of --tensor-model-parallel-size" in capsys.readouterr().err


# ---- forcing each candidate runs exactly its path ---------------------------------------------


def test_forced_linear_torch_is_f_linear_and_onednn_is_onednn():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40)
    set_choices(KernelChoices(linear="torch"))
    assert torch.equal(onednn.linear(x, w, b), F.linear(x, w, b))
    set_choices(KernelChoices(linear="onednn"))
    assert torch.equal(onednn.linear(x, w, b), onednn._OneDNNLinear.apply(x, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forced_matmul16_runs_that_matmul(dtype):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 24), (40, 24), (40,)))
    choose_kernels(BF16, forced="matmul16=native")
    assert torch.equal(onednn.linear(x, w, b), F.linear(x, w, b))
    choose_kernels(BF16, forced="matmul16=fp32")
    assert torch.equal(onednn.linear(x, w, b), upcast.linear_product(x, w, b))


def test_forced_linear_torch_trains_as_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    model = GPT(config())
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    choose_kernels(FP32, forced="linear=torch")
    forced = loss_and_grads(model, tokens, tokens)
    monkeypatch.setenv("ZEROTRON_ONEDNN", "0")
    set_choices(KernelChoices())
    plain = loss_and_grads(model, tokens, tokens)
    assert torch.equal(forced[0], plain[0])
    assert all(torch.equal(forced[1][n], plain[1][n]) for n in plain[1])


@pytest.mark.parametrize("candidate", chooser.CANDIDATES["attention"])
def test_forced_attention_runs_that_kernel(candidate):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(2, 4, 16, 8, generator=g).bfloat16()
    choose_kernels(BF16, forced=f"attention={candidate}")
    out = _core_attention(q, k, v, None, True, 0.0)
    if candidate == "sdpa":
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif candidate == "math16":
        expected = sdpa_math_16bit(q, k, v, None, True)
    else:  # SDPA on fp32 copies, rounded once: forward and backward
        fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*fp32, is_causal=True)
        expected.backward(grad.float())
        out.backward(grad)
        for t, t32 in zip((q, k, v), fp32, strict=True):
            assert torch.equal(t.grad, t32.grad.bfloat16())
        expected = expected.bfloat16()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("columns", chooser.CANDIDATES["loss_chunk"])
def test_forced_loss_chunk_equals_the_plain_loss(columns):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.randn(10000, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 10000, (64,), generator=g)
    choose_kernels(FP32, forced=f"linear=onednn,loss_chunk={columns}")
    fused = fused_linear_cross_entropy(x, w, t)
    fused.mean().backward()
    grads = x.grad, w.grad
    x.grad = w.grad = None
    plain = F.cross_entropy(F.linear(x, w), t, reduction="none")
    plain.mean().backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, (x.grad, w.grad), rtol=1e-5, atol=1e-6)


# ---- the training precision (make demo) -------------------------------------------------------


def test_precision_is_the_faster_and_cached(monkeypatch, tmp_path):
    monkeypatch.setitem(COSTS, "bf16", 6)
    monkeypatch.setitem(COSTS, "fp32", 1)
    fake = FakeMachine()
    assert chooser.choose_precision(BF16, runners=fake.runners, clock=fake.clock) == (
        "fp32",
        "measured",
    )
    again = FakeMachine()
    assert chooser.choose_precision(FP32, runners=again.runners, clock=again.clock) == (
        "fp32",
        "cached",
    )
    assert again.calls == 0


def test_precision_on_cuda_is_bf16_unmeasured():
    fake = FakeMachine()
    got = chooser.choose_precision(FP32, "cuda", runners=fake.runners, clock=fake.clock)
    assert got == ("bf16", "n/a") and fake.calls == 0


def test_kernels_command_prints_the_choices(capsys):
    argv = ["kernels", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
    forced = "matmul16=native,attention=sdpa"
    assert zerotron.cli.main([*argv, "--bf16", "--kernels", forced]) == 0
    assert capsys.readouterr().out == (
        "kernels: linear=- (n/a), matmul16=native (forced), attention=sdpa (forced), "
        "loss_chunk=- (n/a)\n"
    )
