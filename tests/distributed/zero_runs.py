"""What the ranks of tests/distributed/test_zero.py run, and the one-process reference.

``_dp2_rank`` and ``_dp4_rank`` are the two spawns (every configuration of the module docstring
of test_zero.py); each returns plain data (losses, norms, weights, ledgers, memory reports)
that the tests compare in the test process. A module of its own so that the tests read in a
sitting; ranks import these functions by name.
"""

from __future__ import annotations

import dataclasses
import io
import math
from functools import partial

import torch
from torch import nn

from zerotron import checkpointing
from zerotron.distributed import comm, ledger
from zerotron.distributed.comm import Group
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel, state
from zerotron.errors import UnsupportedError
from zerotron.models import GPT, GPTConfig
from zerotron.models.gpt_stage import TIED_COPY, build_gpt_stages
from zerotron.parallel.data_parallel import DataParallel
from zerotron.parallel.declarations import allreduce_tied_grads
from zerotron.parallel.tensor.sequence_parallel import sequence_parallel_params
from zerotron.pipeline.runtime import PipelineRuntime
from zerotron.precision.loss_scaler import make_loss_scaler
from zerotron.precision.mixed import MixedPrecisionOptimizer
from zerotron.zero import GatheredParameters, OffloadOptions, ZeroOptimizer, ZeroOptions
from zerotron.zero.stage3 import coordinator_of, gathered_state_dict

STEPS, GAS, TOL = 3, 2, 1e-5
LR, EPS, WD, CLIP = 1e-2, 1e-4, 0.1, 0.05  # CLIP below the norm: clipping acts every step
VOCAB, SEQ, MB = 128, 16, 2


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


def zero_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int, group: Group, **kw
) -> ZeroOptimizer:
    """A ZeroOptimizer with the :class:`ZeroOptions` fields among ``kw`` as its options and the
    rest (clipping, loss scaler, reduce hooks) as its arguments."""
    fields = {f.name for f in dataclasses.fields(ZeroOptions)}
    options = ZeroOptions(stage=stage, **{k: v for k, v in kw.items() if k in fields})
    rest = {k: v for k, v in kw.items() if k not in fields}
    return ZeroOptimizer(model, optimizer, options, group=group, **rest)


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
        opt = zero_optimizer(model, adamw(model), stage=stage, group=dp, **kw)
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
    # Stage 3 keeping parameters gathered from forward to backward (DeepSpeed's default reuse
    # distance), with shards at rest in memory and on NVMe: the same training.
    for offload in ("none", "nvme"):
        out["gpt", "reuse", 3, offload] = run_zero("gpt", 3, tmp, offload, max_reuse_distance=10**9)
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
# fp16 overflow, bf16, ledger, memory (run inside the same spawns)


def _zero_mlp(stage: int, dtype: torch.dtype, **kw) -> tuple[nn.Module, ZeroOptimizer]:
    model = make_model("mlp", dtype=dtype)
    opt = zero_optimizer(
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
    opt = zero_optimizer(model, adamw(model), stage=stage, group=state().dp, reduce_bucket_size=40)
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
    opt = zero_optimizer(model, adamw(model), stage=2, group=state().dp, reduce_bucket_size=40)
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
            dpar = opt = zero_optimizer(
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
    opt = zero_optimizer(
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
            zero_optimizer(model, adamw(model), stage=stage, group=state().dp)
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
    opt = zero_optimizer(
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
        allreduce_tied_grads(stages)  # on the full gradients, before they are reduced
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
