"""ZeRO stages side by side with their peers: tokens/s, peak RSS, bytes communicated per step.

Every system trains the same model (zerotron's GPT, GPT-2-shaped, default 6 layers, hidden 512,
8 heads, seq 256, vocabulary 8192, micro-batch 4; dropout 0) on the same batches, with AdamW
and gradient clipping at 1.0, on 2 and 4 gloo CPU ranks (``--ranks``) with one torch thread each;
each system in fresh processes, so peak RSS belongs to it alone:

==============  ==============================================================================
zerotron-0      Engine + DataParallel + MixedPrecisionOptimizer (ZeRO stage 0)
zerotron-1/2/3  Engine + ZeroOptimizer(stage)
zerotron-3+nvme stage 3 with offload_optimizer and offload_param on NVMe (files in --nvme-path)
zerotron-3+reuse stage 3 with DeepSpeed's default stage3_max_reuse_distance (1e9): parameters
                stay gathered from their forward to their backward (the DeepSpeed-3 comparison)
ddp             torch DistributedDataParallel (the stage-0 peer)
fsdp2           torch.distributed.fsdp.fully_shard on every transformer layer and the root
                (the stage-3 peer)
deepspeed-1/2/3 deepspeed.initialize with zero_optimization.stage (when deepspeed imports;
                ``DS_BUILD_OPS=0 pip install deepspeed``); otherwise the columns are skipped
==============  ==============================================================================

DeepSpeed on the CPU: its accelerator picks the ``ccl`` backend when oneCCL's torch bindings
import, else gloo, and its TorchBackend builds the ``deepspeed_shm_comm`` op at run time (a C++
compiler and ninja; cached under ``~/.cache/torch_extensions``). The op's shared-memory
all-reduce is switched on only when ``LOCAL_SIZE`` equals the world size (DeepSpeed's launcher
sets it; this benchmark sets it too), and DeepSpeed calls it from ``inference_all_reduce`` only:
its ZeRO training collectives go through ``torch.distributed``. Each DeepSpeed rank reports
which backend, whether the op loaded and whether its shared-memory path is on; the report
prints it.

Mixed precision (``--dtype bf16``, default): zerotron and DeepSpeed hold bf16 parameters with
fp32 master weights in the optimizer; FSDP2 holds fp32 sharded parameters and computes with
bf16 copies (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``), DDP holds fp32
parameters under ``torch.autocast(bfloat16)`` (torch's AMP recipe). ``--dtype fp32``: fp32
everywhere. Each library uses its default bucket sizes.

Measured per system, per rank: tokens/s (all ranks' tokens over the wall time of ``--steps``
steps after ``--warmup``), tokens per CPU-second (the same tokens over the CPU time all the
ranks' threads spent in those steps: on a machine other jobs load, wall time measures their
share as much as the system, CPU time much less), peak RSS (``ru_maxrss``: the whole process
life) and its growth over the RSS the rank started with (the fork of an interpreter that has
imported torch), and the bytes communicated per step: zerotron's comm ledger, and for the peers
every ``torch.distributed`` collective they call (wrapped in the rank; DDP through its python
all-reduce comm hook). Bytes are the logical sizes of :mod:`zerotron.distributed.comm` converted
to what a ring puts on the wire per rank: all-reduce 2(n-1)/n x tensor, reduce-scatter (n-1)/n x
input, all-gather (n-1) x shard, broadcast 1 x tensor.

Theory, per rank per step, n ranks, Ψ parameters, p/g = bytes per parameter / gradient element
on the wire: data parallelism (stage 0) 2(n-1)/n·Ψ·g; stages 1 and 2 a reduce-scatter of the
gradients and an all-gather of the updated parameters, (n-1)/n·Ψ·(g + p); stage 3 gathers the
parameters twice (forward and backward) and reduce-scatters the gradients, (n-1)/n·Ψ·(2p + g)
-- 1.5x data parallelism when p = g. For zerotron, the model-state bytes its optimizer holds
(``ZeroOptimizer.memory_report``) are printed beside the ZeRO paper's 2Ψ+2Ψ+12Ψ/n (stage 1),
2Ψ+14Ψ/n (stage 2), 16Ψ/n (stage 3) with 16-bit parameters.

The machine's load moves tokens/s a lot, so ``--repeat`` rounds (default 3) run every system
in turn; each system reports its median round (all rounds are printed) and its largest peak
RSS.
``--zero-bucket N`` and ``--sub-group-size N`` set zerotron's bucket and sub-group sizes
(default: zerotron's own, ``zerotron.zero.options.default_sizes``: DeepSpeed's 5e8 / 1e9 for
stages 1-2, 4e6 / 2e6 for stage 3).

Run: ``.venv/bin/python bench/zero.py [--quick] [--systems zerotron-2,deepspeed-2,...]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import job_kernels, machine, measure_kernels  # noqa: E402
from tests.distributed.spawn import RankError, run_ranks  # noqa: E402
from zerotron.kernels import KernelShape  # noqa: E402
from zerotron.models.gpt import GPT, GPTConfig  # noqa: E402
from zerotron.training.build import lm_loss  # noqa: E402

SYSTEMS = (
    "zerotron-0",
    "ddp",
    "zerotron-1",
    "deepspeed-1",
    "zerotron-2",
    "deepspeed-2",
    "zerotron-3",
    "fsdp2",
    "deepspeed-3",
    "zerotron-3+reuse",
    "zerotron-3+nvme",
)
STAGE = {
    "zerotron-0": 0,
    "ddp": 0,
    "zerotron-1": 1,
    "deepspeed-1": 1,
    "zerotron-2": 2,
    "deepspeed-2": 2,
    "zerotron-3": 3,
    "fsdp2": 3,
    "deepspeed-3": 3,
    "zerotron-3+nvme": 3,
    "zerotron-3+reuse": 3,
}
LR, CLIP = 1e-4, 1.0


@dataclass(frozen=True)
class Setup:
    layers: int = 6
    hidden: int = 512
    heads: int = 8
    seq: int = 256
    vocab: int = 8192
    micro_batch: int = 4
    steps: int = 10
    warmup: int = 2
    dtype: str = "bf16"
    nvme_path: str = ""
    zero_bucket: int = 0  # zerotron ZeRO reduce/allgather bucket size; 0 = zerotron's default
    sub_group_size: int = 0  # zerotron ZeRO sub_group_size; 0 = zerotron's (2e6 with NVMe)
    ranks: int = 2  # gloo processes

    def config(self) -> GPTConfig:
        return GPTConfig(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            seq_length=self.seq,
            vocab_size=self.vocab,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    def kernel_shape(self) -> KernelShape:
        """What the kernel chooser measures: one rank's micro-batch, one thread."""
        return KernelShape(
            self.hidden, self.heads, self.seq, self.micro_batch, self.vocab, self.dtype, threads=1
        )


# ------------------------------------------------------------------------------------------
# Byte counting for the peers: wrap torch.distributed's collectives in the rank


WIRE = {  # logical bytes -> ring bytes on the wire per rank, n = group size
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: 1.0,
}


class TorchCounter:
    """Counts the bytes of every torch.distributed collective called through the module."""

    def __init__(self) -> None:
        self.wire = 0.0
        self.on = False
        self.by_op: dict[str, float] = {}

    def add(self, op: str, nbytes: int, group: object) -> None:
        if not self.on:
            return
        import torch.distributed as dist

        n = dist.get_world_size(group)
        wire = WIRE[op](n) * nbytes
        self.wire += wire
        self.by_op[op] = self.by_op.get(op, 0.0) + wire

    def install(self) -> None:
        import torch.distributed as dist

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def wrap(name: str, op: str, size_of) -> None:
            original = getattr(dist, name, None)
            if original is None:
                return

            def counted(*args, **kwargs):
                self.add(op, size_of(*args, **kwargs), kwargs.get("group"))
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        def arg(i: int, key: str):
            return lambda *a, **k: k[key] if key in k else a[i]

        wrap("all_reduce", "all_reduce", lambda *a, **k: nbytes(arg(0, "tensor")(*a, **k)))
        wrap("broadcast", "broadcast", lambda *a, **k: nbytes(arg(0, "tensor")(*a, **k)))
        for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
            wrap(name, "all_gather", lambda *a, **k: nbytes(arg(1, "input_tensor")(*a, **k)))
        wrap("all_gather", "all_gather", lambda *a, **k: nbytes(arg(1, "tensor")(*a, **k)))
        for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
            wrap(name, "reduce_scatter", lambda *a, **k: nbytes(arg(1, "input")(*a, **k)))
        wrap(
            "reduce_scatter",
            "reduce_scatter",
            lambda *a, **k: sum(nbytes(t) for t in arg(1, "input_list")(*a, **k)),
        )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


class HeapPeak:
    """The most bytes malloc had handed out at once (glibc's ``mallinfo2``: ``uordblks``, in use
    in the heaps, plus ``hblkhd``, in mmapped blocks), sampled every ``interval`` seconds on a
    thread. Unlike RSS it does not count freed memory the allocator keeps (glibc's heap grows
    by tens of MB over steps in every system here), so it is the steady measure of what a system
    allocates; None where libc has no ``mallinfo2``."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak: int | None = None
        self._stop = threading.Event()
        try:
            self._info = ctypes.CDLL(None).mallinfo2
        except (OSError, AttributeError):
            self._info = None
            return
        self._info.restype = _MallInfo2
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def in_use(self) -> int:
        """The bytes malloc has handed out now (the sum the peak samples); 0 without
        ``mallinfo2``."""
        if self._info is None:
            return 0
        m = self._info()
        return m.uordblks + m.hblkhd

    def _sample(self) -> None:
        self.peak = max(self.peak, self.in_use())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> int | None:
        if self._info is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
        return self.peak


# ------------------------------------------------------------------------------------------
# The systems (each returns step(batch) -> loss and a memory report or None)


def _batches(setup: Setup, rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    b, s = setup.micro_batch, setup.seq
    out = []
    for _ in range(n):
        ids = torch.randint(0, setup.vocab, (b, s + 1), generator=g)
        out.append(
            {
                "tokens": ids[:, :-1],
                "labels": ids[:, 1:],
                "position_ids": torch.arange(s).expand(b, s),
                "loss_mask": torch.ones(b, s),
            }
        )
    return out


def _model(setup: Setup, dtype: torch.dtype) -> GPT:
    torch.manual_seed(1234)
    return GPT(setup.config()).to(dtype)


def _zerotron(setup: Setup, stage: int, nvme: bool, reuse: bool = False):
    from zerotron.distributed.state import state
    from zerotron.engine import Engine, grad_norm_hooks
    from zerotron.parallel.data_parallel import DataParallel
    from zerotron.precision import MixedPrecisionOptimizer, make_loss_scaler

    ps = state()
    dtype = setup.torch_dtype
    model = _model(setup, dtype)
    reduce_fn, is_counted = grad_norm_hooks(ps)
    scaler = make_loss_scaler(dtype)
    if stage == 0:
        dp = DataParallel(model.parameters(), ps.dp)
        adamw = torch.optim.AdamW(model.parameters(), lr=LR)
        opt = MixedPrecisionOptimizer(
            adamw, loss_scaler=scaler, clip_grad=CLIP, reduce_fn=reduce_fn, is_counted=is_counted
        )
    else:
        from zerotron.zero import OffloadOptions, ZeroOptimizer, ZeroOptions

        offload = None
        if nvme:
            offload = OffloadOptions(device="nvme", nvme_path=setup.nvme_path, buffer_count=2)
        adamw = torch.optim.AdamW(model.parameters(), lr=LR)
        options = ZeroOptions(
            stage=stage,
            offload_optimizer=offload,
            offload_param=offload if stage == 3 else None,
            **(
                {
                    "reduce_bucket_size": setup.zero_bucket,
                    "allgather_bucket_size": setup.zero_bucket,
                }
                if setup.zero_bucket
                else {}
            ),
            # NVMe streams the states through memory in pieces of this size (elements)
            sub_group_size=setup.sub_group_size or (2_000_000 if nvme else None),
            max_reuse_distance=int(1e9) if reuse else 0,
        )
        opt = dp = ZeroOptimizer(
            model,
            adamw,
            options,
            group=ps.dp,
            loss_scaler=scaler,
            clip_grad=CLIP,
            reduce_fn=reduce_fn,
            is_counted=is_counted,
        )
    engine = Engine(
        model, opt, loss_fn=lm_loss, micro_batch_size=setup.micro_batch, data_parallel=dp
    )

    def step(batch):
        return engine.train_batch(iter([batch]))

    def report():
        return opt.memory_report() if stage else None

    return step, report


def _ddp(setup: Setup):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    model = _model(setup, torch.float32)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # the python path: counted
    adamw = torch.optim.AdamW(model.parameters(), lr=LR)
    amp = setup.dtype == "bf16"

    def step(batch):
        with torch.autocast("cpu", torch.bfloat16) if amp else nullcontext():
            loss = lm_loss(ddp, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.detach()

    return step, lambda: None


def _fsdp2(setup: Setup):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(setup, torch.float32)
    mp = MixedPrecisionPolicy()
    if setup.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    adamw = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(batch):
        loss = lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.detach()

    return step, lambda: None


def _deepspeed(setup: Setup, stage: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's launcher sets LOCAL_SIZE; its shm op turns its shared-memory all-reduce on
    # only when LOCAL_SIZE equals the world size (all ranks on one host, as here).
    os.environ["LOCAL_SIZE"] = str(setup.ranks)
    import deepspeed

    dtype = setup.torch_dtype
    model = _model(setup, torch.float32)
    adamw = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=adamw, config=config, dist_init_required=False
    )

    def step(batch):
        loss = lm_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, _deepspeed_comm_path


def _deepspeed_comm_path() -> dict:
    """Which communication path DeepSpeed took in this rank: its backend object, the torch
    backend under it, whether the shm op loaded and whether its shared-memory path is on."""
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm

    cdb = ds_comm.cdb
    shm = getattr(cdb, "shm_comm_op", None)
    return {
        "comm_path": {
            "backend": f"{type(cdb).__name__}({dist.get_backend()})",
            "shm_op_loaded": shm is not None,
            "shm_all_reduce_on": shm is not None
            and os.environ.get("LOCAL_SIZE") == str(dist.get_world_size()),
            "inference_all_reduce_op": hasattr(torch.ops, "deepspeed")
            and hasattr(torch.ops.deepspeed, "inference_all_reduce_"),
        }
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, system: str, setup: Setup) -> dict:
    import warnings

    import torch.distributed as dist

    from zerotron.distributed import comm

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated names peers call
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    job_kernels(setup.kernel_shape())  # every system trains zerotron's GPT: the same kernels
    start_rss = _rss()
    heap = HeapPeak()
    counter = TorchCounter()
    counter.install()
    stage = STAGE[system]
    if system.startswith("zerotron"):
        step, report = _zerotron(
            setup, stage, system.endswith("+nvme"), reuse=system.endswith("+reuse")
        )
    elif system == "ddp":
        step, report = _ddp(setup)
    elif system == "fsdp2":
        step, report = _fsdp2(setup)
    else:
        step, report = _deepspeed(setup, stage)
    batches = _batches(setup, rank, setup.warmup + setup.steps)
    losses = []
    for b in batches[: setup.warmup]:
        losses.append(float(step(b)))
    dist.barrier()
    counter.on = True
    times = []
    cpu0 = time.process_time()
    with comm.ledger.capture() as cap:
        for b in batches[setup.warmup :]:
            t0 = time.perf_counter()
            losses.append(float(step(b)))
            times.append(time.perf_counter() - t0)
        cpu_s = time.process_time() - cpu0  # all of this process's threads (gloo's too)
        dist.barrier()
    counter.on = False
    wire = counter.wire
    by_op = dict(counter.by_op)
    if system.startswith("zerotron"):
        n = dist.get_world_size()
        wire = sum(WIRE[op](n) * b for (_, op), (b, _) in cap.summary().items() if op in WIRE)
        by_op = {}
        for (_, op), (b, _) in cap.summary().items():
            if op in WIRE:
                by_op[op] = by_op.get(op, 0.0) + WIRE[op](n) * b
    return {
        "times": times,
        "cpu_per_step": cpu_s / max(setup.steps, 1),
        "losses": losses,
        "wire_per_step": wire / max(setup.steps, 1),
        "by_op": {k: v / max(setup.steps, 1) for k, v in by_op.items()},
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "start_rss": start_rss,
        "heap_peak": heap.stop(),
        "memory_report": report(),
        "numels": [p.numel() for p in GPT(setup.config()).parameters()] if rank == 0 else [],
    }


# ------------------------------------------------------------------------------------------
# Theory and report


PERSISTENCE_THRESHOLD = int(1e5)  # zerotron's and DeepSpeed's stage-3 default


def comm_theory(system: str, stage: int, numels: list[int], n: int, setup: Setup) -> float:
    """Bytes on the wire per rank per step (see the module docstring). Under stage 3,
    zerotron and DeepSpeed keep parameters of <= 1e5 elements whole (persistent): those are
    all-gathered once after the step, as in stage 2; FSDP2 shards every parameter."""
    psi = sum(numels)
    bf16 = setup.dtype == "bf16"
    p = 2 if bf16 else 4
    g = p
    if system == "ddp":
        p = g = 4  # fp32 parameters under autocast: fp32 gradients are all-reduced
    if stage == 0:
        return 2 * (n - 1) / n * psi * g
    persistent = 0
    if stage == 3 and system != "fsdp2":
        persistent = sum(k for k in numels if k <= PERSISTENCE_THRESHOLD)
    if stage in (1, 2) or system == "zerotron-3+reuse":  # (+reuse: gathered once per step)
        return (n - 1) / n * psi * (g + p)
    return (n - 1) / n * ((psi - persistent) * (2 * p + g) + persistent * (p + g))


def memory_theory(stage: int, psi: int, n: int) -> float | None:
    """The ZeRO paper's model-state bytes per rank with 16-bit parameters (K = 12)."""
    return {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}.get(stage)


def run_system(system: str, setup: Setup, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_rank, setup.ranks, system, setup, timeout=timeout)
    except RankError as e:
        last = [ln for ln in e.details.strip().splitlines() if ln.strip()]
        return {"system": system, "error": last[-1] if last else str(e)}
    numels = ranks[0]["numels"]
    psi = sum(numels)
    n = len(ranks)
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(setup.steps))
    tokens = setup.micro_batch * setup.seq * n
    stage = STAGE[system]
    return {
        "system": system,
        "stage": stage,
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        # tokens per CPU-second of the ranks: what the step costs, whatever else the machine
        # runs (wall time on a loaded machine is mostly the others' share)
        "tokens_per_cpu_s": tokens / sum(r["cpu_per_step"] for r in ranks),
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "growth": max(r["peak_rss"] - r["start_rss"] for r in ranks),
        "heap_peak": None if ranks[0]["heap_peak"] is None else max(r["heap_peak"] for r in ranks),
        "wire": statistics.mean(r["wire_per_step"] for r in ranks),
        "by_op": ranks[0]["by_op"],
        "theory": comm_theory(system, stage, numels, n, setup),
        "model_states": (ranks[0]["memory_report"] or {}).get("total"),
        "comm_path": (ranks[0]["memory_report"] or {}).get("comm_path"),
        "memory_theory": memory_theory(stage, psi, n) if setup.dtype == "bf16" else None,
        "losses": ranks[0]["losses"],
        "psi": psi,
        "seconds": time.perf_counter() - t0,
    }


def _best(rounds: list[dict]) -> dict:
    """A system's result over the rounds: the median round by tokens/s (the upper one of an
    even count; single rounds slowed or sped up by other work on the machine do not decide),
    with the largest peak RSS of any round."""
    ok = sorted((r for r in rounds if "error" not in r), key=lambda r: r["tokens_per_s"])
    if not ok:
        return rounds[-1]
    best = dict(ok[len(ok) // 2])
    best["peak_rss"] = max(r["peak_rss"] for r in ok)
    best["growth"] = max(r["growth"] for r in ok)
    heaps = [r["heap_peak"] for r in ok if r.get("heap_peak") is not None]
    best["heap_peak"] = max(heaps) if heaps else None
    best["rounds"] = [r["tokens_per_s"] for r in rounds if "error" not in r]
    best["cpu_rounds"] = [r["tokens_per_cpu_s"] for r in rounds if "error" not in r]
    best["tokens_per_cpu_s"] = statistics.median(best["cpu_rounds"])
    return best


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def print_report(results: list[dict], setup: Setup) -> None:
    psi = next((r["psi"] for r in results if "psi" in r), 0)
    print(
        f"\nGPT {setup.layers}x{setup.hidden} (heads {setup.heads}), seq {setup.seq}, vocab "
        f"{setup.vocab}, micro-batch {setup.micro_batch}, Ψ = {psi / 1e6:.2f}M parameters, "
        f"{setup.dtype}, {setup.ranks} gloo ranks x 1 thread, {setup.steps} timed steps "
        f"(median), median of {max(len(r.get('rounds', [])) for r in results)} rounds\n"
    )
    head = (
        f"{'system':<16}{'stage':>5}{'tokens/s':>10}{'peak RSS MB':>13}{'growth MB':>11}"
        f"{'heap MB':>9}"
        f"{'states MB':>11}{'theory MB':>11}{'comm MB/step':>14}{'theory':>9}{'meas/th':>9}"
        f"{'vs DP':>7}  first/last loss"
    )
    print(head)
    print("-" * (len(head) + 8))
    dp_wire = next((r["wire"] for r in results if r.get("system") == "zerotron-0"), None)
    for r in results:
        if "error" in r:
            print(f"{r['system']:<16} skipped: {r['error'][:150]}")
            continue
        ratio = r["wire"] / r["theory"] if r["theory"] else math.nan
        vs_dp = r["wire"] / dp_wire if dp_wire else math.nan
        print(
            f"{r['system']:<16}{r['stage']:>5}{r['tokens_per_s']:>10,.0f}{_mb(r['peak_rss']):>13}"
            f"{_mb(r['growth']):>11}{_mb(r.get('heap_peak')):>9}"
            f"{_mb(r['model_states']):>11}{_mb(r['memory_theory']):>11}"
            f"{r['wire'] / 1e6:>14.2f}{r['theory'] / 1e6:>9.2f}{ratio:>9.3f}{vs_dp:>7.2f}  "
            f"{r['losses'][0]:.4f}/{r['losses'][-1]:.4f}"
        )
    print(
        "\ntokens/s per round: "
        + "; ".join(
            f"{r['system']} " + "/".join(f"{t:,.0f}" for t in r.get("rounds", []))
            for r in results
            if "error" not in r
        )
    )
    print(
        "tokens per CPU-second of the ranks, per round: "
        + "; ".join(
            f"{r['system']} " + "/".join(f"{t:,.0f}" for t in r.get("cpu_rounds", []))
            for r in results
            if "error" not in r
        )
    )
    print("\ncommunication per rank per step by op (MB on the wire)")
    for r in results:
        if "error" not in r:
            ops = ", ".join(f"{op} {b / 1e6:.2f}" for op, b in sorted(r["by_op"].items()))
            print(f"  {r['system']:<18}{ops}")
    by_name = {r["system"]: r for r in results if "error" not in r}
    print("\nzerotron / peer, same stage (tokens/s: higher is better; peak RSS growth: lower)")
    for ours, peer in (
        ("zerotron-0", "ddp"),
        ("zerotron-1", "deepspeed-1"),
        ("zerotron-2", "deepspeed-2"),
        ("zerotron-3", "fsdp2"),
        ("zerotron-3", "deepspeed-3"),
        ("zerotron-3+reuse", "deepspeed-3"),
    ):
        if ours in by_name and peer in by_name:
            a, b = by_name[ours], by_name[peer]
            speed = a["tokens_per_s"] / b["tokens_per_s"]
            cpu = a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"]
            mem = a["growth"] / b["growth"]
            peak = a["peak_rss"] / b["peak_rss"]
            goal = "met" if speed >= 1 and peak <= 1 else "NOT met"
            heap = (
                f"heap {a['heap_peak'] / b['heap_peak']:5.2f}x   "
                if a.get("heap_peak") and b.get("heap_peak")
                else ""
            )
            print(
                f"  {ours:<16} / {peer:<12} tokens/s {speed:5.2f}x   tokens/CPU-s {cpu:5.2f}x   "
                f"peak RSS {peak:5.2f}x   "
                f"growth {mem:5.2f}x   {heap}goal (>= 1x, <= 1x): {goal}"
            )
    paths = {r["system"]: r["comm_path"] for r in results if r.get("comm_path")}
    for system, path in paths.items():
        print(
            f"\n{system} communication: {path['backend']}, deepspeed_shm_comm op "
            f"{'loaded' if path['shm_op_loaded'] else 'NOT loaded'}, shared-memory all-reduce "
            f"{'on' if path['shm_all_reduce_on'] else 'off'} (DeepSpeed calls it from "
            "inference_all_reduce only; ZeRO's collectives are torch.distributed's)"
        )
    if "zerotron-3" in by_name and "zerotron-3+nvme" in by_name:
        a, b = by_name["zerotron-3+nvme"], by_name["zerotron-3"]
        print(
            f"\nNVMe offload (stage 3, optimizer + parameters): peak RSS growth "
            f"{_mb(a['growth'])} MB vs {_mb(b['growth'])} MB without "
            f"({a['growth'] / b['growth']:.2f}x), "
            f"tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    p.add_argument("--layers", type=int, default=Setup.layers)
    p.add_argument("--hidden", type=int, default=Setup.hidden)
    p.add_argument("--heads", type=int, default=Setup.heads)
    p.add_argument("--seq", type=int, default=Setup.seq)
    p.add_argument("--vocab", type=int, default=Setup.vocab)
    p.add_argument("--micro-batch", type=int, default=Setup.micro_batch)
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--warmup", type=int, default=Setup.warmup)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=Setup.dtype)
    p.add_argument("--nvme-path", default=None, help="directory for NVMe offload files")
    p.add_argument(
        "--sub-group-size",
        type=float,
        default=0,
        help="zerotron's ZeRO sub_group_size (default: zerotron's, 1e9 for stages 1-2 and 2e6 "
        "for stage 3 (zero.options.default_sizes); 2e6 with NVMe)",
    )
    p.add_argument(
        "--zero-bucket",
        type=float,
        default=0,
        help="zerotron's reduce/allgather bucket size in elements (default: zerotron's, 5e8; "
        "stage 3 reduces in 4e6)",
    )
    p.add_argument(
        "--ranks", default="2,4", help="comma-separated world sizes, each a run of its own"
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds over all systems (median kept)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 step: checks it runs")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in STAGE]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    with tempfile.TemporaryDirectory(prefix="zero-bench-nvme-") as tmp:
        setup = Setup(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            seq=args.seq,
            vocab=args.vocab,
            micro_batch=args.micro_batch,
            steps=args.steps,
            warmup=args.warmup,
            dtype=args.dtype,
            nvme_path=args.nvme_path or tmp,
            zero_bucket=int(args.zero_bucket),
            sub_group_size=int(args.sub_group_size),
        )
        if args.quick:
            setup = Setup(
                2,
                64,
                4,
                32,
                512,
                2,
                1,
                1,
                args.dtype,
                setup.nvme_path,
                setup.zero_bucket,
                setup.sub_group_size,
            )
            args.repeat = 1
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: no DeepSpeed columns
            print(f"deepspeed not importable ({type(e).__name__}: {e}); its columns are skipped")
            systems = [s for s in systems if not s.startswith("deepspeed")]
        world_sizes = [int(n) for n in args.ranks.split(",") if n.strip()]
        print(machine())
        print(f"zerotron {measure_kernels(setup.kernel_shape())}", flush=True)
        reports = []
        for n in world_sizes:
            setup = replace(setup, ranks=n)
            rounds: dict[str, list[dict]] = {s: [] for s in systems}
            for k in range(args.repeat):
                print(
                    f"{n} ranks, round {k + 1}/{args.repeat} "
                    f"(load average {os.getloadavg()[0]:.1f})"
                )
                for system in systems:
                    if rounds[system] and "error" in rounds[system][-1]:
                        continue
                    r = run_system(system, setup, args.timeout)
                    note = r.get("error") or f"{r['tokens_per_s']:,.0f} tokens/s"
                    print(f"  {system}: {note} ({r.get('seconds', 0):.0f} s)", flush=True)
                    rounds[system].append(r)
            reports.append((setup, [_best(rs) for rs in rounds.values()]))
    for setup, results in reports:
        print_report(results, setup)
    print("\n" + machine())
    if args.json:
        with open(args.json, "w") as f:
            runs = [{"setup": asdict(st), "results": rs} for st, rs in reports]
            json.dump({"machine": machine(), "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
