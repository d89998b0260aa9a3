"""The column-parallel backward with its collective overlapped gives the plain path's exact bits.

One 2-rank run computes, for each case, the gradients of a ColumnParallelLinear (and of a tiny
TP=2 GPT) twice: overlap on (the default) and off (``ZEROTRON_TP_OVERLAP=0``), with the comm
ledger of each. Cases: fp32 on oneDNN (the CPU default), fp32 and bf16 on ``F.linear``
(``ZEROTRON_ONEDNN=0``), bf16 on the fp32 GEMM (the kernel choice ``matmul16=fp32``), each with
and without sequence parallelism.
"""

from __future__ import annotations

import os

import pytest
import torch

from zerotron.distributed import ledger
from zerotron.distributed.state import initialize_model_parallel
from zerotron.kernels.policy import KernelChoices, set_choices
from zerotron.models.gpt import GPT, GPTConfig
from zerotron.parallel.tensor import ColumnParallelLinear, allreduce_sequence_parallel_grads
from zerotron.parallel.tensor.overlap import ENV_SWITCH

from .spawn import run_ranks

TP = 2
PATHS = (
    ("onednn", torch.float32),
    ("mm", torch.float32),
    ("mm", torch.bfloat16),
    ("upcast", torch.bfloat16),
)
CASES = [(path, dtype, sp) for path, dtype in PATHS for sp in (False, True)]


def _set(env: str, value: str) -> None:
    os.environ[env] = value


def _use(path: str) -> None:
    """The linear layers' matmuls: oneDNN (fp32), torch's, or the fp32 GEMM for bf16."""
    _set("ZEROTRON_ONEDNN", "1" if path == "onednn" else "0")
    set_choices(KernelChoices(matmul16="fp32" if path == "upcast" else "native"))


def _column(rank, dtype, sp):
    torch.manual_seed(3)
    layer = ColumnParallelLinear(16, 24, gather_output=False, sequence_parallel=sp).to(dtype)
    g = torch.Generator().manual_seed(10 + rank)
    s = 4 if sp else 8  # under SP each rank holds half of the 8 positions
    x = torch.randn(2, s, 16, generator=g).to(dtype).requires_grad_()
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=g).to(dtype))
    fn = type(y.grad_fn).__name__
    return fn, (x.grad, layer.weight.grad, layer.bias.grad)


def _gpt(sp):
    torch.manual_seed(5)
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=sp,
    )
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 8), generator=g)
    model(tokens, labels=tokens).sum().backward()
    allreduce_sequence_parallel_grads(model)
    return {n: p.grad for n, p in model.named_parameters()}


def _rank(rank):
    initialize_model_parallel(tensor_model_parallel_size=TP)
    out = {}
    for overlap in ("1", "0"):
        _set(ENV_SWITCH, overlap)
        for path, dtype, sp in CASES:
            _use(path)
            with ledger.capture() as cap:
                out[overlap, path, dtype, sp] = (*_column(rank, dtype, sp), cap.entries)
        _use("onednn")
        for sp in (False, True):
            out[overlap, "gpt", sp] = _gpt(sp)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, TP, timeout=120)


OVERLAP_RUN = pytest.mark.xdist_group("tp_overlap")


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{p}-{str(d)[6:]}-{'sp' if s else 'tp'}" for p, d, s in CASES]
)
@OVERLAP_RUN
def test_column_grads_bit_identical(results, case):
    for r in range(TP):
        fn_on, grads_on, calls_on = results[r][("1", *case)]
        fn_off, grads_off, calls_off = results[r][("0", *case)]
        assert fn_on == "_LinearWithAsyncGradCommBackward", fn_on  # the overlapped path ran
        assert fn_off != fn_on
        for got, want in zip(grads_on, grads_off, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert calls_on == calls_off  # the same collectives, bytes and groups


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@OVERLAP_RUN
def test_gpt_grads_bit_identical(results, sp):
    for r in range(TP):
        on, off = results[r]["1", "gpt", sp], results[r]["0", "gpt", sp]
        assert on.keys() == off.keys()
        for name in on:
            assert torch.equal(on[name], off[name]), name
