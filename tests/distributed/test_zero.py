"""ZeRO stages 1-3 on gloo ranks (zerotron.zero.ZeroOptimizer) against one process.

Every configuration trains a few steps of data parallelism × gradient accumulation and is
compared with a plain single-process run in this test process: the same model and initial
weights, the same micro-batches (all ranks' data, in order), torch's AdamW with two weight
decay groups and ``clip_grad_norm_``. Checked within 1e-5 relative: the loss of every step (the
DP mean on every rank) and every final weight (per tensor).

Models: a plain ``nn.Sequential`` MLP with odd sizes (so chunks are padded) and zerotron's GPT
(2 layers, hidden 64, vocab 128, sequence 16, dropout off).

Adam's ``eps`` is 1e-4: an element whose gradient is mathematically zero but holds rounding
noise (the attention key bias: softmax ignores a per-query constant) would otherwise take an
update of ``lr × noise / |noise|`` whose sign depends on the summation order; with a larger eps
the update stays proportional to the noise (see tests/distributed/test_equivalence_matrix.py).

Cost: one spawn of 2 ranks for all dp2 configurations, fp16/bf16, memory and the ledger; one of
4 ranks for dp2 × tp2 and the 4-rank memory figures.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel, state
from zerotron.models import GPT, GPTConfig
from zerotron.parallel.data_parallel import DataParallel
from zerotron.precision.mixed import MixedPrecisionOptimizer
from zerotron.zero import OffloadOptions, ZeroOptimizer

from .spawn import run_ranks

STEPS, GAS, TOL = 3, 2, 1e-5
LR, EPS, WD, CLIP = 1e-2, 1e-4, 0.1, 0.05  # CLIP below the norm: clipping acts every step
VOCAB, SEQ, MB = 128, 16, 2


# ------------------------------------------------------------------------------------------
# Models, data, the reference


def make_model(kind: str, tp_group: Group | None = None, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        model = nn.Sequential(
            nn.Linear(7, 33), nn.GELU(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 5)
        )
    else:
        cfg = GPTConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ,
            vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        model = GPT(cfg, tp_group=tp_group or Group.single("tp"))
    return model.to(dtype)


def batch(kind: str, step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``slot`` (= dp_rank * GAS + micro) of ``step``: the same on every layout."""
    g = torch.Generator().manual_seed(1000 * step + slot)
    if kind == "mlp":
        return torch.randn(MB, 7, generator=g), torch.randn(MB, 5, generator=g)
    tokens = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, kind: str, data) -> torch.Tensor:
    x, y = data
    if kind == "mlp":
        return (model(x.to(next(model.parameters()).dtype)).float() - y).pow(2).mean()
    return model(x, labels=y).mean()


def param_groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=LR, eps=EPS)


def reference(kind: str, dp: int) -> dict:
    """One process: every rank's micro-batches accumulated, torch's AdamW and clipping."""
    model = make_model(kind)
    opt = adamw(model)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for slot in range(dp * GAS):
            loss = loss_of(model, kind, batch(kind, step, slot))
            (loss / (dp * GAS)).backward()
            total += loss.item() / (dp * GAS)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {
        "losses": losses,
        "norms": norms,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# ------------------------------------------------------------------------------------------
# What each rank runs


def train(model, opt, kind: str, dp: Group, steps: int = STEPS, engine_like=None) -> dict:
    """Engine-style loop: loss / GAS, ``sync`` on the last micro-batch, finish, step."""
    losses, norms = [], []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(GAS):
            engine_like.sync = micro == GAS - 1
            loss = loss_of(model, kind, batch(kind, step, dp.rank * GAS + micro))
            opt.scale_loss(loss / GAS).backward()
            total += loss.detach() / GAS
        engine_like.finish_grad_sync()
        norms.append(opt.step().grad_norm)
        losses.append(comm.all_reduce(total, dp, op="avg").item())
    return {"losses": losses, "norms": norms}


def run_zero(kind: str, stage: int, tmp: str, offload: str = "none", tp: Group | None = None):
    dp = state().dp
    model = make_model(kind, tp)
    if tp is not None and tp.size > 1:
        _shard_from_full(model, make_model(kind), tp)
    options = OffloadOptions(device=offload, nvme_path=tmp if offload == "nvme" else None)
    reduce_fn, is_counted = _grad_norm_hooks()
    if stage == 0:  # plain data parallelism, for comparison
        dpar = DataParallel(model.parameters(), dp)
        opt = MixedPrecisionOptimizer(
            adamw(model), clip_grad=CLIP, reduce_fn=reduce_fn, is_counted=is_counted
        )
        result = train(model, opt, kind, dp, engine_like=dpar)
    else:
        opt = ZeroOptimizer(
            model, adamw(model), stage=stage, group=dp, clip_grad=CLIP,
            reduce_fn=reduce_fn, is_counted=is_counted, offload_optimizer=options,
            reduce_bucket_size=500, allgather_bucket_size=700, sub_group_size=400,
        )  # fmt: skip  # small buckets and sub-groups: several of each
        result = train(model, opt, kind, dp, engine_like=opt)
        opt.close()
    return {**result, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _grad_norm_hooks():
    from zerotron.engine import grad_norm_hooks

    return grad_norm_hooks()


@torch.no_grad()
def _shard_from_full(model: nn.Module, full: nn.Module, tp: Group) -> None:
    for (_name, p), q in zip(model.named_parameters(), full.parameters()):
        value = q
        if getattr(p, "tensor_model_parallel", False):
            value = q.chunk(tp.size, dim=p.partition_dim)[tp.rank]
        p.copy_(value)


def _dp2_rank(rank: int, tmp: str) -> dict:
    initialize_model_parallel(1)
    out: dict = {}
    for kind in ("mlp", "gpt"):
        for stage in (0, 1, 2):
            for offload in ("none", "cpu", "nvme") if stage else ("none",):
                out[kind, stage, offload] = run_zero(kind, stage, tmp, offload)
    return out


def _dp2_tp2_rank(rank: int, tmp: str) -> dict:
    initialize_model_parallel(2)
    out = {}
    for stage in (1, 2):
        result = run_zero("gpt", stage, tmp, tp=state().tp)
        result["tp_rank"] = state().tp_rank
        out["gpt", stage] = result
    destroy_model_parallel()
    return out


# ------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind, dp=2) for kind in ("mlp", "gpt")}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_ranks(_dp2_rank, 2, str(tmp_path_factory.mktemp("nvme")), timeout=240)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)).item()


def check_equal(result: dict, ref: dict, what: str) -> None:
    """Losses, gradient norms (Adam and clipping hide a gradient's scale from the weights:
    the norm does not) and final weights, within TOL relative."""
    for key in ("losses", "norms"):
        for got, want in zip(result[key], ref[key], strict=True):
            assert abs(got - want) <= TOL * abs(want), f"{what}: {key} {result[key]} vs {ref[key]}"
    for name, want in ref["weights"].items():
        err = rel_err(result["weights"][name], want)
        assert err <= TOL, f"{what}: {name} differs by {err:.2e} relative"


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_dp2_stages_equal_one_process(dp2, references, kind):
    ref = references[kind]
    # the weights moved: a tolerance cannot pass just because nothing changed
    start = dict(make_model(kind).named_parameters())
    moved = max(rel_err(start[n].detach(), w) for n, w in ref["weights"].items())
    assert moved > 100 * TOL
    configs = [k for k in dp2[0] if k[0] == kind]
    assert len(configs) == 7
    for key in configs:
        for rank in range(2):
            check_equal(dp2[rank][key], ref, f"{key} rank {rank}")
