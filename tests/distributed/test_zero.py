"""ZeRO stages 1-3 on gloo ranks (zerotron.zero.ZeroOptimizer) against one process.

Every configuration trains a few steps of data parallelism × gradient accumulation and is
compared with a plain single-process run in this test process: the same model and initial
weights, the same micro-batches (all ranks' data, in order), torch's AdamW with two weight
decay groups and ``clip_grad_norm_``. Checked within 1e-5 relative: the loss of every step (the
DP mean on every rank), the gradient norm of every step (Adam and clipping hide a gradient's
scale from the weights; the norm does not) and every final weight (per tensor).

Models: a plain ``nn.Sequential`` MLP with odd sizes (so chunks are padded) and zerotron's GPT
(2 layers, hidden 64, vocab 128, sequence 16, dropout off). Layouts: dp2 (stages 0-3, each
with offload none/cpu/nvme), dp2 × tp2 (stages 1-3; 2-3 with sequence parallelism), dp2 × pp2
(stage 1 under the 1F1B pipeline runtime, tied embedding summed before the reduction).

Also: resume from a saved ZeRO state (stages 1-3, with offload) equals the uninterrupted run;
DeepSpeed's gradient_predivide_factor, prescale_gradients, reduce_scatter=False and
overlap_comm=False change nothing; the inf-norm (a max across ranks) clips as torch's; an fp16
overflow skips the step in every stage (no weight or state changes, scale halved, skip counted);
bf16 trains; the comm ledger equals the closed form (stage 3 = 1.5× DP on the wire);
``memory_report`` equals the ZeRO paper's formulas at N=2 and N=4; stage 3 reloads the masters
of parameters rewritten under GatheredParameters(modifier_rank=0), and only those; a reentrant
activation checkpoint (nested backward) does not make buckets go twice.

Adam's ``eps`` is 1e-4: an element whose gradient is mathematically zero but holds rounding
noise (the attention key bias: softmax ignores a per-query constant) would otherwise take an
update of ``lr × noise / |noise|`` whose sign depends on the summation order; with a larger eps
the update stays proportional to the noise (see tests/distributed/test_equivalence_matrix.py).

Cost: two spawns (2 and 4 ranks), each a module-scoped fixture that one test per check reads.
"""

from __future__ import annotations

import io
import math
from functools import partial

import pytest
import torch
from torch import nn

from zerotron import checkpointing
from zerotron.distributed import comm, ledger
from zerotron.distributed.comm import Group
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel, state
from zerotron.errors import UnsupportedError
from zerotron.models import GPT, GPTConfig
from zerotron.parallel.data_parallel import DataParallel
from zerotron.parallel.pipeline.gpt_stage import (
    TIED_COPY,
    allreduce_embedding_grads,
    build_gpt_stages,
)
from zerotron.parallel.pipeline.runtime import PipelineRuntime
from zerotron.parallel.tensor.sequence_parallel import sequence_parallel_params
from zerotron.precision.loss_scaler import make_loss_scaler
from zerotron.precision.mixed import MixedPrecisionOptimizer
from zerotron.zero import GatheredParameters, OffloadOptions, ZeroOptimizer
from zerotron.zero.stage3 import coordinator_of, gathered_state_dict

from .spawn import run_ranks

STEPS, GAS, TOL = 3, 2, 1e-5
LR, EPS, WD, CLIP = 1e-2, 1e-4, 0.1, 0.05  # CLIP below the norm: clipping acts every step
VOCAB, SEQ, MB = 128, 16, 2
# The tests reading one spawn share an xdist group (--dist loadgroup, in pyproject's addopts):
# one worker runs them all, so each spawn runs once.
DP2 = pytest.mark.xdist_group("zero_dp2")
DP4 = pytest.mark.xdist_group("zero_dp4")


# ------------------------------------------------------------------------------------------
# Models, data, the reference


def make_model(
    kind: str, tp_group: Group | None = None, dtype=torch.float32, sp: bool = False
) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        model = nn.Sequential(
            nn.Linear(7, 33), nn.GELU(), nn.Linear(33, 17), nn.Tanh(), nn.Linear(17, 5)
        )
    else:
        cfg = GPTConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ,
            vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sp,
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


def reference(kind: str, dp: int, norm_type: float = 2.0) -> dict:
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
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, norm_type)
        norms.append(norm.item())
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


def train(
    model, opt, kind: str, dp: Group, steps: int = STEPS, engine_like=None, after_sync=None,
    first_step: int = 0,
) -> dict:  # fmt: skip
    """Engine-style loop: loss / GAS, ``sync`` on the last micro-batch, finish, step."""
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        total = torch.zeros(())
        for micro in range(GAS):
            engine_like.sync = micro == GAS - 1
            loss = loss_of(model, kind, batch(kind, step, dp.rank * GAS + micro))
            opt.scale_loss(loss / GAS).backward()
            total += loss.detach() / GAS
        engine_like.finish_grad_sync()
        if after_sync is not None:
            after_sync()
        norms.append(opt.step().grad_norm)
        losses.append(comm.all_reduce(total, dp, op="avg").item())
    return {"losses": losses, "norms": norms}


def run_zero(
    kind: str, stage: int, tmp: str, offload: str = "none", tp: Group | None = None,
    sp: bool = False, resume_after: int | None = None, **options,
) -> dict:  # fmt: skip
    """Train STEPS steps; with ``resume_after`` k, save the ZeRO state after k steps (through
    torch.save / torch.load(weights_only=True)), build a fresh model and optimizer from the
    initial weights, load it, and train the rest. ``options`` go to ZeroOptimizer."""
    dp = state().dp
    reduce_fn, is_counted = _grad_norm_hooks()
    if stage == 0:  # plain data parallelism, for comparison
        model = make_model(kind, tp, sp=sp)
        dpar = DataParallel(model.parameters(), dp)
        opt = MixedPrecisionOptimizer(
            adamw(model), clip_grad=CLIP, reduce_fn=reduce_fn, is_counted=is_counted
        )
        return {**train(model, opt, kind, dp, engine_like=dpar), "weights": full_weights(model)}

    offload_opts = OffloadOptions(device=offload, nvme_path=tmp if offload == "nvme" else None)
    kw = dict(
        clip_grad=CLIP, reduce_fn=reduce_fn, is_counted=is_counted,
        offload_optimizer=offload_opts, offload_param=offload_opts if stage == 3 else None,
        reduce_bucket_size=500, allgather_bucket_size=700, sub_group_size=400,  # several each
        param_persistence_threshold=40,  # biases stay whole, the rest is partitioned
    )  # fmt: skip
    kw.update(options)

    def build() -> tuple[nn.Module, ZeroOptimizer, dict]:
        model = make_model(kind, tp, sp=sp)
        if tp is not None and tp.size > 1:
            _shard_from_full(model, make_model(kind), tp)
        opt = ZeroOptimizer(model, adamw(model), stage=stage, group=dp, **kw)
        # Sequence-parallel parameters' gradients are summed over TP after the DP reduction,
        # on the partitions (as the Engine does).
        sp_sum = partial(opt.allreduce_grads, sequence_parallel_params(model), tp) if sp else None
        return model, opt, {"engine_like": opt, "after_sync": sp_sum}

    model, opt, loop = build()
    first = resume_after or STEPS
    result = train(model, opt, kind, dp, steps=first, **loop)
    if resume_after:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        opt.close()
        model, opt, loop = build()
        buf.seek(0)
        opt.load_state_dict(torch.load(buf, weights_only=True))
        rest = train(model, opt, kind, dp, steps=STEPS - first, first_step=first, **loop)
        result = {k: result[k] + rest[k] for k in result}
    result["weights"] = full_weights(model)
    opt.close()
    return result


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (stage 3 gathers them: a collective)."""
    names = [n for n, _ in model.named_parameters()]
    if coordinator_of(model) is not None:
        sd = gathered_state_dict(model, rank0_only=False)
        return {n: sd[n].clone() for n in names}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


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
        for stage in (0, 1, 2, 3):
            for offload in ("none", "cpu", "nvme") if stage else ("none",):
                out[kind, stage, offload] = run_zero(kind, stage, tmp, offload)
    # Resume from a saved ZeRO state: the same run as without the interruption.
    for kind, stage, offload in [("mlp", 1, "none"), ("mlp", 2, "nvme"), ("mlp", 3, "cpu"),
                                 ("gpt", 3, "none")]:  # fmt: skip
        out[kind, "resume", stage, offload] = run_zero(kind, stage, tmp, offload, resume_after=1)
    # DeepSpeed's averaging and wire options change nothing in fp32 (powers of two).
    out["mlp", "predivide"] = run_zero("mlp", 2, tmp, gradient_predivide_factor=2.0)
    out["mlp", "prescale"] = run_zero("mlp", 1, tmp, prescale_gradients=True)
    out["mlp", "allreduce"] = run_zero("mlp", 2, tmp, reduce_scatter=False, overlap_comm=False)
    out["mlp inf-norm", 2] = run_zero("mlp", 2, tmp, norm_type=math.inf)  # a max across ranks
    for stage in (1, 2, 3):
        out["fp16", stage] = fp16_overflow(stage)
        out["bf16", stage] = bf16_trains(stage)
        out["ledger", stage] = ledger_one_step(stage)
        out["memory", stage] = memory(stage)
    out["ledger", 0] = ledger_one_step(0)
    out["modified"] = stage3_modified()
    out["bf16 partitions"] = {gas: bf16_stage3_grad_partitions(gas) for gas in (1, 2)}
    out["memory", "fp32 accum"] = memory(2, grad_accum_dtype=torch.float32)
    out["overlap"] = {stage: overlap(stage) for stage in (1, 2)}
    out["reentrant"] = {ck: reentrant_checkpoint(ck) for ck in (False, True)}
    out["ledger", "bf16 wire"] = ledger_one_step(2, communication_data_type=torch.bfloat16)
    return out


# ------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def references():
    refs = {kind: reference(kind, dp=2) for kind in ("mlp", "gpt")}
    refs["mlp inf-norm"] = reference("mlp", dp=2, norm_type=math.inf)
    return refs


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> list[dict]:
    """One spawn, every dp2 configuration (see the module docstring and each test)."""
    return run_ranks(_dp2_rank, 2, str(tmp_path_factory.mktemp("zero_dp2")), timeout=240)


@pytest.fixture(scope="module")
def dp4() -> list[dict]:
    """One spawn: dp2 x tp2 (stages 1-3, and 2-3 with sequence parallelism), dp2 x pp2 stage 1,
    memory at N=4, pipelines refuse stages 2/3."""
    return run_ranks(_dp4_rank, 4, timeout=240)


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


@DP2
@pytest.mark.parametrize("kind", ["mlp", "gpt", "mlp inf-norm"])
def test_dp2_stages_equal_one_process(dp2, references, kind):
    ref = references[kind]
    # the weights moved: a tolerance cannot pass just because nothing changed
    start = dict(make_model(kind.split()[0]).named_parameters())
    moved = max(rel_err(start[n].detach(), w) for n, w in ref["weights"].items())
    assert moved > 100 * TOL
    configs = [k for k in dp2[0] if k[0] == kind]
    assert len(configs) == {"mlp": 10 + 3 + 3, "gpt": 10 + 1, "mlp inf-norm": 1}[kind]
    for key in configs:
        for rank in range(2):
            check_equal(dp2[rank][key], ref, f"{key} rank {rank}")


# ------------------------------------------------------------------------------------------
# fp16 overflow, bf16, ledger, memory (run inside the same spawns)


def _zero_mlp(stage: int, dtype: torch.dtype, **kw) -> tuple[nn.Module, ZeroOptimizer]:
    model = make_model("mlp", dtype=dtype)
    opt = ZeroOptimizer(
        model, adamw(model), stage=stage, group=state().dp, param_persistence_threshold=40, **kw
    )
    return model, opt


def _snapshot(model: nn.Module, opt: ZeroOptimizer) -> list[torch.Tensor]:
    sd = opt.state_dict()
    tensors = [t.clone() for t in sd["fp32_partitions"]]
    for entry in sd["optimizer"]["state"].values():
        tensors += [v.clone() for v in entry.values() if isinstance(v, torch.Tensor)]
    return tensors + list(full_weights(model).values())


def fp16_overflow(stage: int) -> dict:
    """Step 1 normal; step 2 has an inf in one rank's gradient: skipped everywhere."""
    scaler = make_loss_scaler(torch.float16, initial_scale_power=8, hysteresis=1)
    model, opt = _zero_mlp(stage, torch.float16, loss_scaler=scaler, clip_grad=CLIP)
    dp = state().dp
    train(model, opt, "mlp", dp, steps=1, engine_like=opt)
    before, scale = _snapshot(model, opt), opt.loss_scale
    victim = list(model.parameters())[2]
    hook = victim.register_hook(lambda g: g * math.inf if dp.rank == 0 else g)
    for micro in range(GAS):
        opt.sync = micro == GAS - 1
        loss = loss_of(model, "mlp", batch("mlp", 1, dp.rank * GAS + micro))
        opt.scale_loss(loss / GAS).backward()
    opt.finish_grad_sync()
    result = opt.step()
    hook.remove()
    after = _snapshot(model, opt)
    out = {
        "skipped": not result.update_successful,
        "unchanged": len(before) == len(after)
        and all(torch.equal(a, b) for a, b in zip(before, after)),
        "num_skipped": opt.num_skipped_steps,
        "scale": (scale, opt.loss_scale),
        "state_entries": len(after),
    }
    train(model, opt, "mlp", dp, steps=1, engine_like=opt)  # and it trains on afterwards
    out["next_ok"] = opt.num_skipped_steps == 1
    opt.close()
    return out


def overlap(stage: int) -> list[tuple[int, int]]:
    """Per micro-batch: (reduce-scatters launched before backward reaches the first layer,
    reduce-scatters launched by the end of the backward)."""
    model = _ledger_mlp()
    opt = ZeroOptimizer(model, adamw(model), stage=stage, group=state().dp, reduce_bucket_size=40)
    seen = []
    with ledger.capture() as cap:
        model[0].register_full_backward_pre_hook(
            lambda *_: seen.append(cap.count(op="reduce_scatter"))
        )
        out = []
        for micro in range(GAS):
            opt.sync = micro == GAS - 1
            x = torch.randn(4, LEDGER_SIZES[0], generator=torch.Generator().manual_seed(micro))
            model(x.requires_grad_()).pow(2).mean().backward()  # (full hooks want an input grad)
            out.append((seen[-1], cap.count(op="reduce_scatter")))
    opt.close()
    return out


class _Checkpointed(nn.Module):
    """A layer run under DeepSpeed-style (reentrant) activation checkpointing."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpointing.checkpoint(self.inner, x)


def reentrant_checkpoint(checkpointed: bool) -> tuple[dict, list[torch.Tensor]]:
    """Stage 2 with the last two layers recomputed in nested backward passes: the ledger of
    two micro-batches and a step, and the weights after it."""
    torch.manual_seed(0)
    model = _ledger_mlp()
    if checkpointed:
        model[1], model[2] = _Checkpointed(model[1]), _Checkpointed(model[2])
    opt = ZeroOptimizer(model, adamw(model), stage=2, group=state().dp, reduce_bucket_size=40)
    with ledger.capture() as cap:
        for micro in range(GAS):
            seed = micro + 10 * state().dp.rank
            x = torch.randn(4, LEDGER_SIZES[0], generator=torch.Generator().manual_seed(seed))
            opt.scale_loss(model(x).pow(2).mean()).backward()
        opt.step()
    opt.close()
    return cap.summary(), [p.detach().clone() for p in model.parameters()]


def stage3_modified() -> dict:
    """Stage 3, bf16: a parameter rewritten in a ``GatheredParameters(modifier_rank=0)`` block
    reloads its fp32 master at the next step; the other masters keep their fp32 bits."""
    model, opt = _zero_mlp(3, torch.bfloat16)
    dp = state().dp
    train(model, opt, "mlp", dp, steps=1, engine_like=opt)  # masters now finer than bf16
    before = opt.state_dict()
    before = {"layout": before["layout"], "parts": [t.clone() for t in before["fp32_partitions"]]}
    for group in opt.param_groups:
        group["lr"] = 0.0  # the next step changes nothing by itself
    target = model[0].weight
    with GatheredParameters([target], modifier_rank=0):
        if dp.rank == 0:
            target.data.fill_(0.5)
    train(model, opt, "mlp", dp, steps=1, engine_like=opt)
    after = [t.clone() for t in opt.state_dict()["fp32_partitions"]]
    weight = full_weights(model)["0.weight"]
    opt.close()
    return {**before, "after": after, "weight": weight}


def bf16_trains(stage: int) -> list[float]:
    """bf16 parameters, the same batch every step: the loss falls."""
    model, opt = _zero_mlp(stage, torch.bfloat16)
    dp = state().dp
    losses = []
    for _ in range(6):
        total = torch.zeros(())
        for micro in range(GAS):
            opt.sync = micro == GAS - 1
            loss = loss_of(model, "mlp", batch("mlp", 0, dp.rank * GAS + micro))
            opt.scale_loss(loss / GAS).backward()
            total += loss.detach() / GAS
        opt.step()
        losses.append(comm.all_reduce(total, dp, op="avg").item())
    opt.close()
    return losses


def bf16_stage3_grad_partitions(gas: int) -> dict:
    """Stage 3, bf16: the default gradient partitions (bf16 for one micro-batch, fp32 from the
    second) against fp32 ones throughout; returns each run's final states and weights."""
    dp = state().dp
    out = {}
    for name, kw in (("default", {}), ("fp32", {"grad_accum_dtype": torch.float32})):
        model, opt = _zero_mlp(3, torch.bfloat16, clip_grad=CLIP, **kw)
        for step in range(3):
            for micro in range(gas):
                loss = loss_of(model, "mlp", batch("mlp", step, dp.rank * gas + micro))
                (loss / gas).backward()
            opt.step()
        out[name] = _snapshot(model, opt)
        opt.close()
    return out


LEDGER_SIZES = (8, 32, 32, 4)  # no padding at N=2 or 4: closed forms are exact


def _ledger_mlp() -> nn.Module:
    torch.manual_seed(0)
    dims = LEDGER_SIZES
    layers = [nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    return nn.Sequential(*layers)


def ledger_one_step(stage: int, **options) -> dict:
    """One step with one micro-batch (and one with GAS=2 for stages 1-2): the ledger."""
    dp = state().dp
    out = {}
    for gas in (1, 2) if stage in (1, 2) else (1,):
        model = _ledger_mlp()
        if stage == 0:
            dpar = DataParallel(model.parameters(), dp)
            opt = MixedPrecisionOptimizer(adamw(model))
        else:
            dpar = opt = ZeroOptimizer(
                model, adamw(model), stage=stage, group=dp, param_persistence_threshold=0,
                reduce_bucket_size=300, allgather_bucket_size=600, **options,
            )  # fmt: skip
        with ledger.capture() as cap:
            for micro in range(gas):
                dpar.sync = micro == gas - 1
                x = torch.randn(4, LEDGER_SIZES[0], generator=torch.Generator().manual_seed(micro))
                (model(x).pow(2).mean() / gas).backward()
            dpar.finish_grad_sync()
            opt.step()
        out[gas] = cap.summary()
        if stage:
            opt.close()
    return out


def memory(stage: int, **options) -> dict:
    """bf16 parameters, Adam: bytes held after the first micro-batch of the second step
    (``report``) and after its second, before the step (``accumulated``)."""
    torch.manual_seed(0)
    width, depth = 512, 4
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
    model = model.to(torch.bfloat16)
    psi = sum(p.numel() for p in model.parameters())
    opt = ZeroOptimizer(
        model, torch.optim.Adam(model.parameters()), stage=stage, group=state().dp, **options
    )
    x = torch.randn(2, width, dtype=torch.bfloat16)
    for step in range(2):
        opt.sync = False
        model(x).float().pow(2).mean().backward()
        if step == 1:
            report = opt.memory_report()
        opt.sync = True
        model(x).float().pow(2).mean().backward()
        if step == 1:
            opt.finish_grad_sync()
            accumulated = opt.memory_report()
        opt.step()
    opt.close()
    return {"psi": psi, "report": report, "accumulated": accumulated}


def _dp4_rank(rank: int) -> dict:
    initialize_model_parallel(1)
    out = {("memory", s): memory(s) for s in (1, 2, 3)}
    destroy_model_parallel()
    initialize_model_parallel(1, 2)  # dp2 x pp2: stages 2/3 refuse pipelines
    refused = []
    for stage in (2, 3):
        model = make_model("mlp")
        try:
            ZeroOptimizer(model, adamw(model), stage=stage, group=state().dp)
        except UnsupportedError as e:
            refused.append(str(e))
    out["pp_refused"] = refused
    out["pp2"] = pipeline_stage1()
    destroy_model_parallel()
    initialize_model_parallel(2)  # dp2 x tp2: ZeRO partitions each TP rank's shards
    for stage in (1, 2, 3):
        out["tp2", stage] = run_zero("gpt", stage, "", tp=state().tp)
    for stage in (2, 3):
        out["tp2_sp", stage] = run_zero("gpt", stage, "", tp=state().tp, sp=True)
    model = make_model("gpt", state().tp)
    out["tp_dims"] = {
        n: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        for n, p in model.named_parameters()
    }
    destroy_model_parallel()
    return out


# ------------------------------------------------------------------------------------------
# Tests of the above


@DP2
def test_fp16_overflow_skips_the_step_in_every_stage(dp2):
    for rank in range(2):
        for stage in (1, 2, 3):
            r = dp2[rank]["fp16", stage]
            assert r["skipped"] and r["unchanged"] and r["state_entries"] > 2, (stage, r)
            assert r["num_skipped"] == 1 and r["next_ok"], (stage, r)
            assert r["scale"] == (256.0, 128.0), (stage, r)


@DP2
def test_stage3_modified_parameters_reload_their_masters(dp2):
    for rank in range(2):
        r = dp2[rank]["modified"]
        assert r["weight"].eq(0.5).all()
        for e in r["layout"]:
            span = slice(e["offset"], e["offset"] + e["length"])
            got, was = r["after"][e["partition"]][span], r["parts"][e["partition"]][span]
            if e["name"] == "0.weight":
                assert got.eq(0.5).all()
            else:
                assert torch.equal(got, was), e["name"]
                assert e["length"] == 0 or not torch.equal(was, was.bfloat16().float()), e["name"]


@DP2
def test_buckets_overlap_with_backward(dp2):
    """Later layers' buckets are on the wire before backward reaches the first layer; stage 1
    communicates only on the micro-batch that ends the accumulation, stage 2 on every one."""
    buckets = 3  # reduce_bucket_size=40: one per layer (bias 4 or 32 elements, then weight)
    for rank in range(2):
        (s1_before0, s1_after0), (s1_before1, s1_after1) = dp2[rank]["overlap"][1]
        assert (s1_before0, s1_after0) == (0, 0)
        assert 0 < s1_before1 < s1_after1 == buckets
        (s2_before0, s2_after0), (s2_before1, s2_after1) = dp2[rank]["overlap"][2]
        assert 0 < s2_before0 < s2_after0 == buckets
        assert buckets < s2_before1 < s2_after1 == 2 * buckets


@DP2
def test_reentrant_checkpointing_sends_each_bucket_once(dp2):
    """A nested backward (reentrant recompute) does not end the reduction early: each bucket is
    reduce-scattered once per micro-batch, and the result equals the plain run's."""
    plain, ckpt = dp2[0]["reentrant"][False], dp2[0]["reentrant"][True]
    assert plain[0][("dp", "reduce_scatter")][1] == GAS * 3
    assert ckpt[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(ckpt[1], plain[1]))


@DP2
def test_bf16_trains(dp2):
    for stage in (1, 2, 3):
        losses = dp2[0]["bf16", stage]
        assert losses == dp2[1]["bf16", stage]
        assert losses[-1] < 0.8 * losses[0], (stage, losses)


@DP2
def test_bf16_grad_partitions_give_the_fp32_bits(dp2):
    """Storing one micro-batch's bf16 rows in bf16 and promoting before a second is added
    changes no bit of the step (stage 3, with and without accumulation, clipping on)."""
    for rank in range(2):
        for gas, runs in dp2[rank]["bf16 partitions"].items():
            assert len(runs["default"]) == len(runs["fp32"])
            for a, b in zip(runs["default"], runs["fp32"]):
                assert torch.equal(a, b), (rank, gas)


def _ledger_closed_form(world: int, stage: int, gas: int) -> dict:
    """Bytes per step on the dp group (fp32): what each op records (see comm's docstring)."""
    dims = LEDGER_SIZES
    numels = [n for a, b in zip(dims, dims[1:]) for n in (a * b, b)]
    chunks = [-(-n // world) for n in numels]
    rs = world * sum(chunks) * 4  # every rank sends its whole padded gradient
    ag = sum(chunks) * 4  # every rank contributes its chunks
    if stage == 0:
        return {"all_reduce": sum(numels) * 4}
    if stage == 1:
        return {"reduce_scatter": rs, "all_gather": ag}
    if stage == 2:
        return {"reduce_scatter": gas * rs, "all_gather": ag}
    return {"reduce_scatter": gas * rs, "all_gather": 2 * gas * ag}  # stage 3: fwd + bwd gathers


def _by_op(summary: dict, group: str = "dp") -> dict:
    out = {}
    for (g, op), (nbytes, _calls) in summary.items():
        if g == group and not (op == "all_reduce" and nbytes <= 8):  # norm/overflow scalars
            out[op] = out.get(op, 0) + nbytes
    return out


@DP2
def test_comm_ledger_matches_closed_form(dp2):
    for stage in (0, 1, 2, 3):
        for gas, summary in dp2[0]["ledger", stage].items():
            assert _by_op(summary) == _ledger_closed_form(2, stage, gas), (stage, gas, summary)
    # Stage 3 moves 1.5x the bytes of plain data parallelism (on the wire of a ring: all-reduce
    # 2(n-1)/n x, reduce-scatter (n-1)/n x, all-gather (n-1) x the recorded bytes).
    n = 2
    dp_wire = _by_op(dp2[0]["ledger", 0][1])["all_reduce"] * 2 * (n - 1) / n
    s3 = _by_op(dp2[0]["ledger", 3][1])
    s3_wire = s3["reduce_scatter"] * (n - 1) / n + s3["all_gather"] * (n - 1)
    assert s3_wire == 1.5 * dp_wire
    # communication_data_type=bf16 halves the gradients' bytes (fp32 parameters still gather
    # in fp32).
    for gas, summary in dp2[0]["ledger", "bf16 wire"].items():
        expected = _ledger_closed_form(2, 2, gas)
        expected["reduce_scatter"] //= 2
        assert _by_op(summary) == expected, (gas, summary)


ZERO_FORMULA = {1: lambda n: 2 + 2 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n}


def pipeline_stage1() -> dict:
    """dp2 x pp2, ZeRO stage 1 under the pipeline runtime (1F1B over GAS micro-batches):
    gradients accumulate under ``no_sync``, the tied embedding's are summed over the first and
    last stage, then the partitions are reduced."""
    st = state()
    stages = build_gpt_stages(make_model("gpt"), st.pp_rank, st.pp_size)
    for stage in stages:  # the last stage's tied copy is counted in the norm on the first only
        if hasattr(stage, "output_layer"):
            stage.output_layer.weight.shared = True  # as zerotron.training.build marks it
    runtime = PipelineRuntime(stages, "1f1b", GAS)
    holder = nn.ModuleList(stages)
    reduce_fn, is_counted = _grad_norm_hooks()
    opt = ZeroOptimizer(
        holder, adamw(holder), stage=1, group=st.dp, clip_grad=CLIP,
        reduce_fn=reduce_fn, is_counted=is_counted, reduce_bucket_size=2000,
    )  # fmt: skip
    losses, norms = [], []
    for step in range(STEPS):
        micro = []
        for k in range(GAS):
            x, y = batch("gpt", step, st.dp_rank * GAS + k)
            micro.append({"tokens": x, "labels": y})
        with opt.no_sync():
            loss = runtime.train_step(iter(micro))
        allreduce_embedding_grads(stages)  # on the full gradients, before they are reduced
        opt.finish_grad_sync()
        norms.append(opt.step().grad_norm)
        if loss is not None:
            losses.append(comm.all_reduce(loss, st.dp, op="avg").item())
    weights = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            if name != TIED_COPY:
                weights[name] = p.detach().clone()
    return {"losses": losses, "norms": norms, "weights": weights}


@DP4
def test_dp2_pp2_stage1_equals_one_process(dp4, references):
    """Global ranks 0, 1: stage 0 of DP ranks 0, 1; ranks 2, 3: stage 1 (it has the loss)."""
    ref = references["gpt"]
    for dp_rank in range(2):
        first, last = dp4[dp_rank]["pp2"], dp4[2 + dp_rank]["pp2"]
        assert first["norms"] == last["norms"] and not first["losses"]
        weights = {**first["weights"], **last["weights"]}
        assert sorted(weights) == sorted(ref["weights"])
        result = {"losses": last["losses"], "norms": last["norms"], "weights": weights}
        check_equal(result, ref, f"pp2 stage 1 dp rank {dp_rank}")


@DP4
def test_dp2_tp2_stages_equal_one_process(dp4, references):
    """Global ranks 0, 1 are TP ranks 0, 1 of DP rank 0; 2, 3 those of DP rank 1. With
    sequence parallelism (stages 2, 3) the gradients of replicated parameters are summed over
    TP on the partitions (``ZeroOptimizer.allreduce_grads``)."""
    dims = dp4[0]["tp_dims"]
    for key in [("tp2", 1), ("tp2", 2), ("tp2", 3), ("tp2_sp", 2), ("tp2_sp", 3)]:
        for dp_rank in range(2):
            shards = [dp4[2 * dp_rank + t][key] for t in range(2)]
            weights = {
                n: torch.cat([s["weights"][n] for s in shards], dim=d)
                if d is not None
                else shards[0]["weights"][n]
                for n, d in dims.items()
            }
            for s in shards:  # replicated parameters agree across TP ranks
                assert all(
                    torch.equal(s["weights"][n], weights[n]) for n, d in dims.items() if d is None
                )
            result = {
                "losses": shards[0]["losses"],
                "norms": shards[0]["norms"],
                "weights": weights,
            }
            check_equal(result, references["gpt"], f"{key} dp rank {dp_rank}")


def check_memory_matches_zero_formulas(results, world):
    """The most a rank holds between micro-batches (stage 1: full gradients after the first;
    stage 3: fp32 partitions after the second) against the paper's formula."""
    for stage in (1, 2, 3):
        for rank in range(world):
            r = results[rank]["memory", stage]
            expected = ZERO_FORMULA[stage](world) * r["psi"]
            ratio = max(r["report"]["total"], r["accumulated"]["total"]) / expected
            assert abs(ratio - 1) <= 0.10, (world, stage, rank, ratio, r)


def check_stage3_keeps_one_copy_of_the_partition(results, world):
    """Stage 3 without offload: the shards are views of the fp32 masters (no 16-bit copy,
    ``params`` 0 bytes: every weight here is partitioned); one micro-batch's gradient partition
    stays in bf16, the wire dtype (2 bytes per element), and turns fp32 when a second one is
    added (4 bytes)."""
    for rank in range(world):
        r = results[rank]["memory", 3]
        assert r["report"]["params"] == 0, r
        assert r["report"]["grads"] == 2 * r["psi"] // world, r
        assert r["accumulated"]["params"] == 0, r
        assert r["accumulated"]["grads"] == 4 * r["psi"] // world, r


@DP2
def test_grad_accum_dtype(dp2):
    """fp32 gradient partitions under bf16 parameters: 4 bytes per element of the partition."""
    r = dp2[0]["memory", "fp32 accum"]
    assert r["report"]["grads"] == 4 * r["psi"] // 2


@DP4
def test_pipeline_refuses_stage_2_and_3(dp4):
    assert len(dp4[0]["pp_refused"]) == 2
    assert all("pipeline" in msg for msg in dp4[0]["pp_refused"])


@DP2
def test_memory_matches_zero_formulas_on_2_ranks(dp2):
    check_memory_matches_zero_formulas(dp2, 2)


@DP4
def test_memory_matches_zero_formulas_on_4_ranks(dp4):
    check_memory_matches_zero_formulas(dp4, 4)


@DP2
def test_stage3_keeps_one_copy_of_the_partition_on_2_ranks(dp2):
    check_stage3_keeps_one_copy_of_the_partition(dp2, 2)


@DP4
def test_stage3_keeps_one_copy_of_the_partition_on_4_ranks(dp4):
    check_stage3_keeps_one_copy_of_the_partition(dp4, 4)


class _Lamb(torch.optim.Optimizer):
    """Stands for any optimizer with a per-tensor (not elementwise) update."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


def test_non_elementwise_optimizer_is_refused():
    model = make_model("mlp")
    with pytest.raises(UnsupportedError, match="elementwise"):
        ZeroOptimizer(model, _Lamb(model.parameters()), stage=1, group=Group.single("dp"))


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (2, "nvme")])
def test_layout_and_reload_model_params(tmp_path, stage, offload):
    """No processes: rank 1 of a 2-rank group (construction and reload do not communicate).
    Every layout entry points at the chunk of its parameter in the fp32 partitions — before
    and after the model's weights are replaced and ``reload_model_params`` is called."""
    model = make_model("mlp")
    options = OffloadOptions(device=offload, nvme_path=str(tmp_path) if offload == "nvme" else None)
    opt = ZeroOptimizer(
        model, adamw(model), stage=stage, group=Group("dp", (0, 1), 1, None),
        offload_optimizer=options, sub_group_size=300,
    )  # fmt: skip
    params = dict(model.named_parameters())

    def check() -> None:
        sd = opt.state_dict()
        assert sd["dp_rank"] == 1 and sd["dp_size"] == 2 and len(sd["fp32_partitions"]) > 1
        for e in sd["layout"]:
            flat = params[e["name"]].detach().reshape(-1)
            assert e["start"] == e["chunk"] and e["length"] == min(
                e["chunk"], e["numel"] - e["start"]
            )
            part = sd["fp32_partitions"][e["partition"]]
            got = part[e["offset"] : e["offset"] + e["length"]]
            assert torch.equal(got, flat[e["start"] : e["start"] + e["length"]]), e["name"]
            assert part[e["offset"] + e["length"] : e["offset"] + e["chunk"]].eq(0).all()

    check()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    opt.reload_model_params()
    check()
    opt.close()
