"""Tensor parallelism side by side with its peers: tokens/s and peak memory per rank.

Every system trains the same stack of GPT transformer layers (pre-LN, fused QKV with whole heads
per rank, causal SDPA-shaped attention, GELU MLP of 4h; default 4 layers, hidden 256, 8 heads,
seq 256, micro-batch 4, fp32, no dropout) on the same hidden-state batches, loss = mean of the
squared output, plain SGD, on n gloo CPU ranks (one torch thread each) forming one
tensor-parallel group, with (``+sp``) and without sequence parallelism:

===================  ===========================================================================
zerotron             ``zerotron.models.gpt.TransformerLayer`` (Column/RowParallelLinear); the
                     column-parallel backward overlaps its collective (the default)
zerotron-nooverlap   the same with ``ZEROTRON_TP_OVERLAP=0`` (what the overlap gains)
dtensor              the same layers in plain torch, ``parallelize_module`` with torch's TP
                     recipe (``ColwiseParallel`` QKV / fc1, ``RowwiseParallel`` proj / fc2; with
                     sp ``SequenceParallel`` LayerNorms, ``Shard(1)`` in and out) -- eager
megatron             megatron-core's ``TransformerBlock`` with its local (non-TE) layer spec,
                     ``[s, b, h]``, its own async dgrad all-reduce; the sequence-parallel
                     LayerNorm gradients all-reduced as its ``finalize_model_grads`` does
===================  ===========================================================================

megatron-core is written for CUDA: on the CPU its buffers are pointed at the CPU
(``torch.cuda.current_device`` answers ``"cpu"`` in its rank), its CUDA RNG tracker forks
nothing (dropout is 0) and it is given the causal mask it would build on ``"cuda"``.

Timing: one set of ranks builds every system and they take turns step by step (the order
rotates each step), so the load of the shared machine hits all alike; per system the step time
is the slowest rank's, tokens/s = b·s / median step (a TP group trains one batch), and the
ratio zerotron/peer is the median over steps of the paired ratio (same step, same load).
``--profile`` adds, for zerotron, the share of the step spent in the blocking waits of
:mod:`zerotron.distributed.comm` (communication, and waiting for the other rank). Memory: each
system alone in fresh ranks for 3 steps: peak RSS (``ru_maxrss``) and peak malloc heap (glibc
``mallinfo2``, sampled; what is allocated, not what the allocator keeps), the larger rank's.

Run: ``PYTHONPATH=. /work/benchvenv/bin/python bench/tp.py [--quick] [--tp 2,4] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import job_kernels, machine, measure_kernels  # noqa: E402
from bench.zero import HeapPeak  # noqa: E402
from tests.distributed.spawn import RankError, run_ranks  # noqa: E402
from zerotron.kernels import KernelShape  # noqa: E402

SYSTEMS = ("zerotron", "zerotron-nooverlap", "dtensor", "megatron")
LR = 1e-3


@dataclass(frozen=True)
class Setup:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    seq: int = 256
    micro_batch: int = 4
    steps: int = 12
    warmup: int = 2
    dtype: str = "fp32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    def kernel_shape(self, tp: int) -> KernelShape:
        """What the kernel chooser measures: one of ``tp`` ranks' shards of the layers, one
        thread (no output layer: ``main`` turns the fused loss off, so there is no
        ``loss_chunk`` to choose)."""
        return KernelShape(
            self.hidden, self.heads, self.seq, self.micro_batch, 1, self.dtype, threads=1, tp=tp
        )


def _batches(setup: Setup, count: int) -> list[torch.Tensor]:
    """The same ``[b, s, h]`` hidden states on every rank (a TP group shares its data)."""
    g = torch.Generator().manual_seed(11)
    shape = (setup.micro_batch, setup.seq, setup.hidden)
    return [torch.randn(shape, generator=g).to(setup.torch_dtype) for _ in range(count)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


# ------------------------------------------------------------------------------------------
# The systems: each returns step(x) -> loss, x being the full [b, s, h] batch


def _zerotron(setup: Setup, sp: bool):
    from zerotron.distributed.state import initialize_model_parallel, state
    from zerotron.models.gpt import GPTConfig, TransformerLayer
    from zerotron.parallel.tensor import allreduce_sequence_parallel_grads

    initialize_model_parallel(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]))
    g = state().tp
    cfg = GPTConfig(
        num_layers=setup.layers,
        hidden_size=setup.hidden,
        num_attention_heads=setup.heads,
        seq_length=setup.seq,
        vocab_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=sp,
    )
    torch.manual_seed(1)
    model = nn.Sequential(
        *[TransformerLayer(cfg, i, g) for i in range(setup.layers)], nn.LayerNorm(setup.hidden)
    ).to(setup.torch_dtype)
    if sp:
        from zerotron.parallel.tensor import mark_sequence_parallel

        mark_sequence_parallel(model[-1].parameters())
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x):
        if sp:
            x = x.chunk(g.size, dim=1)[g.rank]
        loss = _loss(model(x))
        loss.backward()
        if sp:
            allreduce_sequence_parallel_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


class _Block(nn.Module):
    """The same transformer layer in plain torch (for DTensor): fused QKV rows laid out
    ``[heads, (q, k, v), head_dim]``, so a contiguous row split keeps whole heads."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # heads on this rank: inferred
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(ctx.transpose(1, 2).reshape(b, s, -1))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _dtensor(setup: Setup, sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    n = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(1)
    model = nn.Sequential(
        *[_Block(setup.hidden, setup.heads) for _ in range(setup.layers)],
        nn.LayerNorm(setup.hidden),
    ).to(setup.torch_dtype)
    for block in model[:-1]:
        if sp:  # torch's recipe: sequence shards all-gathered into the column-wise linears
            plan = {
                "ln1": SequenceParallel(),
                "qkv": ColwiseParallel(input_layouts=Shard(1)),
                "proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln2": SequenceParallel(),
                "fc1": ColwiseParallel(input_layouts=Shard(1)),
                "fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
            parallelize_module(block, mesh, plan)
        else:
            plan = {
                "qkv": ColwiseParallel(),
                "proj": RowwiseParallel(),
                "fc1": ColwiseParallel(),
                "fc2": RowwiseParallel(),
            }
            parallelize_module(block, mesh, plan)
    if sp:
        parallelize_module(model[-1], mesh, SequenceParallel())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rank = mesh.get_local_rank()

    def step(x):
        if sp:
            x = x.chunk(n, dim=1)[rank]  # the residual stream stays a local shard
        out = model(x)
        if isinstance(out, DTensor):
            out = out.to_local()
        loss = _loss(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


class _MegatronLayerNorm:
    """torch's LayerNorm for megatron-core's specs, its parameters marked ``sequence_parallel``
    under sequence parallelism as apex's FusedLayerNorm (megatron's default) marks them; the
    local spec's WrappedTorchNorm refuses sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = nn.LayerNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _megatron(setup: Setup, sp: bool):
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    # CUDA-only calls in megatron-core, pointed at the CPU (see the module docstring).
    torch.cuda.current_device = lambda: "cpu"

    class _NoFork:
        def fork(self, *a, **k):
            return nullcontext()

        def is_initialized(self):
            return True

    mrandom.get_cuda_rng_tracker = lambda *a, **k: _NoFork()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron") and hasattr(
            mod, "get_cuda_rng_tracker"
        ):
            mod.get_cuda_rng_tracker = mrandom.get_cuda_rng_tracker
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    n = int(os.environ["WORLD_SIZE"])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=n)
    cfg = TransformerConfig(
        num_layers=setup.layers,
        hidden_size=setup.hidden,
        num_attention_heads=setup.heads,
        ffn_hidden_size=4 * setup.hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=n,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        params_dtype=setup.torch_dtype,
        bf16=setup.dtype == "bf16",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        activation_func=lambda t: F.gelu(t, approximate="tanh"),
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = _MegatronLayerNorm
    spec.submodules.pre_mlp_layernorm = _MegatronLayerNorm
    blocks = TransformerBlockSubmodules([spec] * setup.layers, layer_norm=_MegatronLayerNorm)
    torch.manual_seed(1)
    model = TransformerBlock(cfg, blocks).to(setup.torch_dtype)
    sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # megatron builds its default causal mask on "cuda": give it the same mask (True = masked)
    causal = (
        torch.ones(setup.seq, setup.seq, dtype=torch.bool).triu(1).view(1, 1, *(setup.seq,) * 2)
    )

    def step(x):
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if sp:
            x = x.chunk(n, dim=0)[rank].contiguous()
        loss = _loss(model(x, attention_mask=causal))
        loss.backward()
        if sp:  # megatron's _allreduce_non_tensor_model_parallel_grads: one flat all-reduce
            grads = [p.grad for p in sp_params]
            flat = torch._utils._flatten_dense_tensors(grads)
            torch.distributed.all_reduce(flat, group=group)
            for buf, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                buf.copy_(synced)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


# ------------------------------------------------------------------------------------------
# Runs: one set of ranks times every system step by step; one fresh set per system for memory


def _build(system: str, setup: Setup, sp: bool):
    if system.startswith("zerotron"):
        step = _zerotron(setup, sp)
        overlap = "0" if system == "zerotron-nooverlap" else "1"

        def switched(x):  # the switch is read at every forward
            os.environ["ZEROTRON_TP_OVERLAP"] = overlap
            return step(x)

        return switched
    return _dtensor(setup, sp) if system == "dtensor" else _megatron(setup, sp)


def _timing_rank(rank: int, systems: list[str], sp: bool, setup: Setup, profile: bool) -> dict:
    """Every system in one set of ranks, taking turns step by step (the order rotates), so
    that the machine's load hits all alike; per system the step times and, for zerotron with
    ``profile``, the time spent waiting in collectives."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    job_kernels(setup.kernel_shape(dist.get_world_size()))  # every rank is one TP shard
    steps = {system: _build(system, setup, sp) for system in systems}
    waits = _time_comm_waits() if profile else None
    batches = _batches(setup, setup.warmup + setup.steps)
    times: dict[str, list[float]] = {system: [] for system in systems}
    comm_wait: dict[str, float] = dict.fromkeys(systems, 0.0)
    for k, x in enumerate(batches):
        order = systems[k % len(systems) :] + systems[: k % len(systems)]
        for system in order:
            dist.barrier()
            if waits is not None:
                waits.clear()
            t0 = time.perf_counter()
            float(steps[system](x))
            if k >= setup.warmup:
                times[system].append(time.perf_counter() - t0)
                if waits is not None:
                    comm_wait[system] += sum(waits)
    dist.barrier()
    return {"times": times, "comm_wait": comm_wait}


def _memory_rank(rank: int, system: str, sp: bool, setup: Setup) -> dict:
    """One system alone in fresh ranks: its peak RSS and peak malloc heap over 3 steps."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    job_kernels(setup.kernel_shape(dist.get_world_size()))
    heap = HeapPeak()
    step = _build(system, setup, sp)
    for x in _batches(setup, 3):
        float(step(x))
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "heap_peak": heap.stop(),
    }


def _time_comm_waits() -> list[float]:
    """Time every blocking wait of zerotron's collectives (what the rank spends not computing)."""
    from zerotron.distributed import comm

    waits: list[float] = []
    original = comm.Pending.wait

    def timed(self):
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            waits.append(time.perf_counter() - t0)

    comm.Pending.wait = timed
    return waits


def _last_line(e: RankError) -> str:
    lines = [ln for ln in e.details.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else str(e)


def run_config(systems, tp: int, sp: bool, setup: Setup, profile: bool, timeout: float):
    """Timing (one run, systems alternating) and memory (one run per system) of one layout."""
    tag = f"tp{tp}{'+sp' if sp else ''}"
    results = {s: {"name": f"{s}-{tag}", "system": s, "tag": tag} for s in systems}
    for system in systems:
        try:
            ranks = run_ranks(_memory_rank, tp, system, sp, setup, timeout=timeout)
        except RankError as e:
            results[system]["error"] = _last_line(e)
            continue
        results[system]["peak_rss"] = max(r["peak_rss"] for r in ranks)
        results[system]["heap_peak"] = max(r["heap_peak"] or 0 for r in ranks) or None
    ok = [s for s in systems if "error" not in results[s]]
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_timing_rank, tp, ok, sp, setup, profile, timeout=timeout)
    except RankError as e:
        for system in ok:
            results[system]["error"] = _last_line(e)
        return results
    n = setup.steps
    for system in ok:
        # per step, the slowest rank's time (the ranks wait for each other in the collectives)
        per_step = [max(r["times"][system][i] for r in ranks) for i in range(n)]
        step_s = statistics.median(per_step)
        wait = statistics.mean(r["comm_wait"][system] for r in ranks) / n
        results[system].update(
            per_step=per_step,
            step_s=step_s,
            tokens_per_s=setup.micro_batch * setup.seq / step_s,
            best_tokens_per_s=setup.micro_batch * setup.seq / min(per_step),
            comm_share=wait / statistics.mean(per_step) if profile and wait else None,
        )
    print(f"  {tag}: {time.perf_counter() - t0:.0f} s", flush=True)
    return results


def _paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over steps of b's step time / a's (same step index: the same load)."""
    return statistics.median(y / x for x, y in zip(a, b, strict=True))


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def print_report(configs: list[dict[str, dict]], setup: Setup) -> None:
    print(f"\n{machine()}; setup {asdict(setup)}")
    print(
        f"{'system':<28}{'tokens/s':>10}{'best':>8}{'step ms':>9}{'peak RSS MB':>13}"
        f"{'heap MB':>9}{'comm wait':>11}"
    )
    for results in configs:
        for r in results.values():
            if "error" in r:
                print(f"{r['name']:<28}  error: {r['error']}")
                continue
            share = "-" if r.get("comm_share") is None else f"{100 * r['comm_share']:.0f}%"
            print(
                f"{r['name']:<28}{r['tokens_per_s']:>10,.0f}{r['best_tokens_per_s']:>8,.0f}"
                f"{1000 * r['step_s']:>9.0f}{_mb(r['peak_rss']):>13}{_mb(r['heap_peak']):>9}"
                f"{share:>11}"
            )
    print(
        "\nzerotron / peer (tokens/s: median over steps of the paired ratio, higher is better; "
        "peak memory: lower is better)"
    )
    for results in configs:
        ours = results.get("zerotron")
        if ours is None or "error" in ours:
            continue
        for peer in ("zerotron-nooverlap", "dtensor", "megatron"):
            other = results.get(peer)
            if other is None or "error" in other:
                continue
            speed = _paired_ratio(ours["per_step"], other["per_step"])
            best = min(other["per_step"]) / min(ours["per_step"])
            rss = ours["peak_rss"] / other["peak_rss"]
            heap = ours["heap_peak"] / other["heap_peak"]
            goal = ""
            if peer != "zerotron-nooverlap":
                goal = "  goal met" if speed >= 1 and heap <= 1 else "  goal NOT met"
            print(
                f"  {ours['name']:<16} / {other['name']:<26} tokens/s {speed:5.2f}x "
                f"(best steps {best:4.2f}x)   peak RSS {rss:5.2f}x   heap {heap:5.2f}x{goal}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    p.add_argument("--tp", default="2", help="tensor-parallel sizes, comma-separated (2,4)")
    p.add_argument("--sp", default="off,on", help="sequence parallelism: off, on or off,on")
    p.add_argument("--layers", type=int, default=Setup.layers)
    p.add_argument("--hidden", type=int, default=Setup.hidden)
    p.add_argument("--heads", type=int, default=Setup.heads)
    p.add_argument("--seq", type=int, default=Setup.seq)
    p.add_argument("--micro-batch", type=int, default=Setup.micro_batch)
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--warmup", type=int, default=Setup.warmup)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=Setup.dtype)
    p.add_argument("--profile", action="store_true", help="zerotron's time waiting in comm")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round: checks it runs")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    setup = Setup(
        args.layers,
        args.hidden,
        args.heads,
        args.seq,
        args.micro_batch,
        args.steps,
        args.warmup,
        args.dtype,
    )
    if args.quick:
        setup = Setup(2, 64, 4, 32, 2, 2, 1, args.dtype)
    if "megatron" in systems:
        try:
            import megatron.core  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure: no megatron rows
            print(f"megatron-core not importable ({type(e).__name__}: {e}); its rows are skipped")
            systems.remove("megatron")
    os.environ["ZEROTRON_FUSED_LOSS"] = "0"  # no output layer here (the ranks inherit it)
    configs = []
    for tp in args.tp.split(","):
        print(f"zerotron tp{tp} {measure_kernels(setup.kernel_shape(int(tp)))}", flush=True)
        for sp in args.sp.split(","):
            print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
            configs.append(
                run_config(systems, int(tp), sp == "on", setup, args.profile, args.timeout)
            )
    print_report(configs, setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": asdict(setup), "configs": configs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
