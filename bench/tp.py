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
(``torch.cuda.current_device`` answers ``"cpu"`` in its rank) and its CUDA RNG tracker forks
nothing (dropout is 0). Each system runs in a fresh set of processes (peak memory is its own);
``--repeat`` rounds run every system in turn (the machine is shared) and each keeps its median
round. Measured per rank: step time (the slowest rank's, median over ``--steps``), tokens/s =
b·s / step (a TP group trains one batch), peak RSS (``ru_maxrss``) and peak malloc heap (glibc
``mallinfo2``, sampled; what is allocated, not what the allocator keeps). ``--profile`` adds,
for zerotron, the share of the step spent waiting in collectives (the comm ledger's calls timed
by wrapping :mod:`zerotron.distributed.comm`'s waits).

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

from bench.zero import HeapPeak  # noqa: E402
from tests.distributed.spawn import RankError, run_ranks  # noqa: E402

SYSTEMS = ("zerotron", "zerotron-nooverlap", "dtensor", "megatron")
LR = 1e-3


@dataclass(frozen=True)
class Setup:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    seq: int = 256
    micro_batch: int = 4
    steps: int = 6
    warmup: int = 2
    dtype: str = "fp32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


def _batches(setup: Setup, count: int) -> list[torch.Tensor]:
    """The same ``[b, s, h]`` hidden states on every rank (a TP group shares its data)."""
    g = torch.Generator().manual_seed(11)
    shape = (setup.micro_batch, setup.seq, setup.hidden)
    return [torch.randn(shape, generator=g).to(setup.torch_dtype) for _ in range(count)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


# ------------------------------------------------------------------------------------------
# The systems: each returns step(x) -> loss, x being the full [b, s, h] batch


def _zerotron(setup: Setup, sp: bool, overlap: bool):
    from zerotron.distributed.state import initialize_model_parallel, state
    from zerotron.models.gpt import GPTConfig, TransformerLayer
    from zerotron.parallel.tensor import allreduce_sequence_parallel_grads

    os.environ["ZEROTRON_TP_OVERLAP"] = "1" if overlap else "0"
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
# One run: a fresh set of ranks for one system


def _rank(rank: int, system: str, sp: bool, setup: Setup, profile: bool) -> dict:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    heap = HeapPeak()
    if system == "zerotron":
        step = _zerotron(setup, sp, overlap=True)
    elif system == "zerotron-nooverlap":
        step = _zerotron(setup, sp, overlap=False)
    elif system == "dtensor":
        step = _dtensor(setup, sp)
    else:
        step = _megatron(setup, sp)
    waits = _time_comm_waits() if profile and system.startswith("zerotron") else None
    batches = _batches(setup, setup.warmup + setup.steps)
    losses, times = [], []
    for x in batches[: setup.warmup]:
        losses.append(float(step(x)))
    dist.barrier()
    if waits is not None:
        waits.clear()
    for x in batches[setup.warmup :]:
        t0 = time.perf_counter()
        losses.append(float(step(x)))
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return {
        "times": times,
        "losses": losses,
        "comm_wait": None if waits is None else sum(waits) / max(setup.steps, 1),
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


def run_system(system: str, tp: int, sp: bool, setup: Setup, profile: bool, timeout: float):
    name = f"{system}-tp{tp}{'+sp' if sp else ''}"
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_rank, tp, system, sp, setup, profile, timeout=timeout)
    except RankError as e:
        last = [ln for ln in e.details.strip().splitlines() if ln.strip()]
        return {"name": name, "system": system, "error": last[-1] if last else str(e)}
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(setup.steps))
    waits = [r["comm_wait"] for r in ranks if r["comm_wait"] is not None]
    return {
        "name": name,
        "system": system,
        "tp": tp,
        "sp": sp,
        "step_s": step_s,
        "tokens_per_s": setup.micro_batch * setup.seq / step_s,
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "heap_peak": max(r["heap_peak"] or 0 for r in ranks) or None,
        "comm_share": statistics.mean(waits) / step_s if waits else None,
        "losses": ranks[0]["losses"],
        "seconds": time.perf_counter() - t0,
    }


def _best(rounds: list[dict]) -> dict:
    """The median round by tokens/s (upper of an even count), with the largest peaks."""
    ok = sorted((r for r in rounds if "error" not in r), key=lambda r: r["tokens_per_s"])
    if not ok:
        return rounds[-1]
    best = dict(ok[len(ok) // 2])
    best["rounds"] = [round(r["tokens_per_s"]) for r in ok]
    best["peak_rss"] = max(r["peak_rss"] for r in ok)
    heaps = [r["heap_peak"] for r in ok if r.get("heap_peak")]
    best["heap_peak"] = max(heaps) if heaps else None
    return best


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def print_report(results: list[dict], setup: Setup) -> None:
    print(f"\nCPU: {_cpu_model()}; load average {os.getloadavg()[0]:.1f}; setup {asdict(setup)}")
    print(
        f"{'system':<28}{'tokens/s':>10}{'step ms':>9}{'peak RSS MB':>13}{'heap MB':>9}"
        f"{'comm wait':>11}  rounds"
    )
    for r in results:
        if "error" in r:
            print(f"{r['name']:<28}  error: {r['error']}")
            continue
        share = "-" if r.get("comm_share") is None else f"{100 * r['comm_share']:.0f}%"
        print(
            f"{r['name']:<28}{r['tokens_per_s']:>10,.0f}{1000 * r['step_s']:>9.0f}"
            f"{_mb(r['peak_rss']):>13}{_mb(r['heap_peak']):>9}{share:>11}  {r['rounds']}"
        )
    by_name = {r["name"]: r for r in results if "error" not in r}
    print("\nzerotron / peer (tokens/s: higher is better; peak memory: lower is better)")
    for name, ours in by_name.items():
        if ours["system"] != "zerotron":
            continue
        suffix = name[len("zerotron") :]
        for peer in ("zerotron-nooverlap", "dtensor", "megatron"):
            other = by_name.get(peer + suffix)
            if other is None:
                continue
            speed = ours["tokens_per_s"] / other["tokens_per_s"]
            rss = ours["peak_rss"] / other["peak_rss"]
            heap = (
                ours["heap_peak"] / other["heap_peak"]
                if ours.get("heap_peak") and other.get("heap_peak")
                else float("nan")
            )
            goal = (
                ""
                if peer.startswith("zerotron")
                else ("  goal met" if speed >= 1 and heap <= 1 else "  goal NOT met")
            )
            print(
                f"  {name:<16} / {peer + suffix:<26} tokens/s {speed:5.2f}x   "
                f"peak RSS {rss:5.2f}x   heap {heap:5.2f}x{goal}"
            )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores visible)"
    except OSError:
        pass
    return "unknown"


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
    p.add_argument("--repeat", type=int, default=3, help="rounds over all systems")
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
        args.repeat = 1
    if "megatron" in systems:
        try:
            import megatron.core  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure: no megatron rows
            print(f"megatron-core not importable ({type(e).__name__}: {e}); its rows are skipped")
            systems.remove("megatron")
    runs = [
        (system, int(tp), sp == "on")
        for tp in args.tp.split(",")
        for sp in args.sp.split(",")
        for system in systems
    ]
    rounds: dict[tuple, list[dict]] = {run: [] for run in runs}
    for k in range(args.repeat):
        print(f"round {k + 1}/{args.repeat} (load average {os.getloadavg()[0]:.1f})", flush=True)
        for run in runs:
            if rounds[run] and "error" in rounds[run][-1]:
                continue
            r = run_system(*run[:1], run[1], run[2], setup, args.profile, args.timeout)
            note = r.get("error") or f"{r['tokens_per_s']:,.0f} tokens/s"
            print(f"  {r['name']}: {note} ({r.get('seconds', 0):.0f} s)", flush=True)
            rounds[run].append(r)
    results = [_best(rs) for rs in rounds.values()]
    print_report(results, setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": asdict(setup), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
