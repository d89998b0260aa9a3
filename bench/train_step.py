"""Training-step throughput: zerotron's GPT against transformers' GPT2LMHeadModel, side by side.

Both sides train the same GPT-2 (same weights: transformers' random init, imported into zerotron
with ``checkpoint.hf.from_hf_state_dict``) on the same batches with the same optimizer, in one
process, and the benchmark prints tokens/s, MFU and the ratio zerotron / transformers for fp32 and
bf16, each with and without ``torch.compile``.

What each side runs for one step (one micro-batch of ``micro_batch × seq`` tokens):

* zerotron: its own training path. ``Engine(model, MixedPrecisionOptimizer(AdamW))`` with
  ``loss = lm_loss(engine, batch)``, ``engine.backward(loss)``, ``engine.step()``; the batch is the
  GPT dataset's (tokens, labels, loss_mask, position_ids). ``--compile`` compiles the module's
  forward, as ``Engine(compile=True)`` does (its word-embedding lookup and its fused output
  layer + loss run eagerly behind graph breaks).
* transformers: ``model(input_ids=tokens, labels=labels, shift_labels=labels).loss`` (SDPA
  attention, HF's own causal-LM loss; ``shift_labels`` makes it predict the same 2048 labels as
  zerotron instead of shifting them again), ``loss.backward()``, optimizer step. Compiled the same
  way: ``torch.compile(model)``.

Fairness. Both sides use the *same* optimizer object type: zerotron's ``build_optimizer`` (torch's
fused AdamW, the same hyperparameters and weight-decay groups from ``get_param_groups``) wrapped
in ``MixedPrecisionOptimizer`` with the same gradient clipping, so the optimizer costs the same
and the ratio measures the model code. In bf16 both sides keep bf16 parameters with fp32 master
weights and fp32 gradient accumulation (the wrapper's path) — the closest transformers equivalent
of zerotron's bf16 training. ``--hf-bf16 autocast`` instead gives transformers fp32 parameters
under ``torch.autocast(bfloat16)`` (what HF's Trainer does with ``bf16=True``). Dropout is 0 on
both sides, same threads (``--threads``).

MFU. Model FLOPs per token ``6·N + 12·L·h·s`` (``training.throughput.model_flops_per_token``),
with N the parameters without position embeddings, the tied embedding once, over the *real*
vocabulary (zerotron's padding rows are never multiplied: they are sliced off before the LM
head) — one number for both sides. The peak is measured in this run, per dtype, as the best
matmul rate this torch reaches: the best of ``torch.mm`` and, on CPU, oneDNN's GEMM
(``torch.ops.mkldnn._linear_pointwise``, which zerotron's fp32 linear layers and fused loss use:
on AMD CPUs torch.mm's fp32 GEMM is MKL running its AVX2 code, oneDNN's about twice as fast) and,
in 16 bits on CPU, the fp32 GEMM on upcast copies (``zerotron.kernels.upcast``: the same
products, the fastest way to them where 16-bit GEMMs are emulated), over the model's own matmul
shapes (both operand layouts) and a square 2048³.

Timing. Warmup steps (which include compilation) for both sides, then ``--repeat`` rounds of
``--steps`` steps per side. Within a round the steps alternate between the sides (and which side
goes first), so a burst of load from other processes hits both alike. tokens/s comes from the
median round; the ratio is the median over rounds of the ratio within each round. Before timing,
both models give the same fp32 loss on the same batch (checked, and printed), and the first step
of each column prints both sides' losses.

On a GPU (``--device cuda``; bf16 only unless ``--dtypes`` says otherwise) ``--model gpt2-124m``
and ``--model gpt2-1.5b`` train GPT-2 small and XL at their 1024-token context (micro-batches 8
and 4); MFU is against the device's dense peak in the dtype from NVIDIA's data sheets
(``zerotron.training.metrics.GPU_PEAKS``, the table ``zerotron pretrain`` uses: bf16 H100 SXM
and H200 989 TFLOP/s, A100 312, ...), the measured matmul rate printed beside it, or against
the measured rate on a GPU not in the table. Every CPU fast path is off there
(``zerotron.kernels.policy``): SDPA's flash kernel, the loss over the logits. GPT-2 XL's two
sides do not fit on an 80 GB GPU together (each holds bf16 parameters and gradients, fp32
gradients, masters and Adam moments: ~20 bytes per parameter, 31 GB, plus ~13 GB of
activations), so ``gpt2-1.5b`` runs them apart (``--sides apart``): one side on the device at a
time, built, warmed up and timed alone, then freed; the ratio is then of the median rounds.

Run: ``python bench/train_step.py`` (full, a few minutes on 2 cores), ``--quick`` (tiny model,
a sanity check), ``--dtypes bf16 --compile on`` for one column; on a GPU
``python bench/train_step.py --device cuda --model gpt2-124m`` (then ``gpt2-1.5b``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from bench.common import machine  # noqa: E402
from zerotron.checkpoint.hf import from_hf_state_dict  # noqa: E402
from zerotron.engine import Engine  # noqa: E402
from zerotron.fileio import atomic_write_text  # noqa: E402
from zerotron.kernels import KernelShape, choose_kernels, upcast  # noqa: E402
from zerotron.kernels.onednn import ONEDNN_AVAILABLE, onednn_mm_t  # noqa: E402
from zerotron.models.gpt import GPT  # noqa: E402
from zerotron.optim import build_optimizer, get_param_groups  # noqa: E402
from zerotron.precision import MixedPrecisionOptimizer  # noqa: E402
from zerotron.training.build import lm_loss  # noqa: E402
from zerotron.training.metrics import peak_flops  # noqa: E402
from zerotron.training.throughput import model_flops_per_token  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Goals of issue 18 (a CPU's train_step columns).
RATIO_GOAL = 1.2
MFU_GOALS = {"fp32": 0.65, "bf16": 0.35}


@dataclass(frozen=True)
class Shape:
    """The benchmarked model and batch."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int
    micro_batch: int
    vocab_size: int  # the tokenizer's
    padded_vocab_size: int  # zerotron's embedding rows

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_length


FULL = Shape(6, 384, 6, 256, 8, 50257, 50304)  # GPT-2 vocab padded to a multiple of 128
QUICK = Shape(2, 64, 4, 64, 4, 1000, 1024)
# --model: the CPU benchmark's model, or GPT-2 small / XL at their full context (for a GPU).
MODELS = {
    "bench": FULL,
    "gpt2-124m": Shape(12, 768, 12, 1024, 8, 50257, 50304),
    "gpt2-1.5b": Shape(48, 1600, 25, 1024, 4, 50257, 50304),
}


def datasheet_peak(device: torch.device, dtype: str) -> tuple[float, str] | None:
    """(FLOP/s, where from) of a CUDA device's dense ``dtype`` peak from NVIDIA's data sheets
    (zerotron's own table, ``training.metrics.GPU_PEAKS``, as ``zerotron pretrain`` reports
    MFU), None on the CPU or on a GPU not in the table."""
    if device.type != "cuda":
        return None
    peak, how = peak_flops(device, dtype)
    return None if peak is None else (peak, how)


@dataclass(frozen=True)
class Hyper:
    """The optimizer both sides use."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip_grad: float = 1.0


# ---- the two sides ---------------------------------------------------------------------------


@dataclass
class Side:
    """One model being trained: a step is ``forward`` -> ``backward`` -> ``step``."""

    name: str
    forward: Callable[[dict[str, torch.Tensor]], torch.Tensor]  # batch -> scalar loss
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], Any]
    keep: list[Any] = field(default_factory=list)  # owns the objects the closures use
    head: torch.nn.Module | None = None  # the output layer (+ loss): where "loss" begins
    marks: dict[str, float] = field(default_factory=dict)  # clock at the head, this step


def mark_loss_phase(side: Side, clock: Callable[[], float]) -> None:
    """Time the output layer and loss of ``side`` apart (eager only: a hook calling a clock
    inside a compiled graph would break it): the clock when the head's forward starts and when
    the gradient of its input is ready (its backward done)."""

    def at_head(module, args) -> None:
        side.marks["head"] = clock()
        if args[0].requires_grad:
            args[0].register_hook(lambda grad: side.marks.__setitem__("head_grad", clock()))

    side.keep.append(side.head.register_forward_pre_hook(at_head))


def hf_model(shape: Shape, seed: int) -> GPT2LMHeadModel:
    """transformers' GPT-2 with its own random init; dropout off, SDPA attention."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=shape.num_layers,
        n_embd=shape.hidden_size,
        n_head=shape.num_heads,
        n_positions=shape.seq_length,
        vocab_size=shape.vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def make_optimizer(model: torch.nn.Module, hp: Hyper) -> MixedPrecisionOptimizer:
    groups = get_param_groups(model, hp.weight_decay)
    opt = build_optimizer(
        groups, "adamw", lr=hp.lr, weight_decay=hp.weight_decay, betas=hp.betas, eps=hp.eps
    )
    return MixedPrecisionOptimizer(opt, clip_grad=hp.clip_grad)


def zerotron_side(
    hf_sd: dict,
    hf_config: dict,
    shape: Shape,
    dtype: torch.dtype,
    compile: bool,
    hp: Hyper,
    device: torch.device,
    kernels: str | None = None,
) -> Side:
    """zerotron's training path: GPT + MixedPrecisionOptimizer inside an Engine, with the kernel
    choices ``zerotron pretrain`` makes (measured once per machine and cached, or ``kernels``)."""
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    kshape = KernelShape(
        shape.hidden_size,
        shape.num_heads,
        shape.seq_length,
        shape.micro_batch,
        shape.vocab_size,
        dtype_name,
    )
    print(f"  zerotron {dtype_name}: {choose_kernels(kshape, device, kernels).line()}", flush=True)
    cfg, sd = from_hf_state_dict(hf_sd, hf_config, shape.padded_vocab_size)
    model = GPT(cfg)
    model.load_state_dict(sd, strict=True)
    model.to(device=device, dtype=dtype).train()
    engine = Engine(
        model, make_optimizer(model, hp), micro_batch_size=shape.micro_batch, compile=compile
    )
    return Side(
        "zerotron",
        forward=lambda batch: lm_loss(engine, batch),
        backward=engine.backward,
        step=engine.step,
        keep=[engine],
        head=model.lm_head,
    )


def hf_side(
    hf_sd: dict,
    shape: Shape,
    dtype: torch.dtype,
    compile: bool,
    hp: Hyper,
    device: torch.device,
    bf16_mode: str,
) -> Side:
    """transformers' GPT2LMHeadModel with the same optimizer (see the module docstring)."""
    model = hf_model(shape, seed=0)
    model.load_state_dict(hf_sd, strict=True)
    autocast = dtype == torch.bfloat16 and bf16_mode == "autocast"
    model.to(device=device, dtype=torch.float32 if autocast else dtype).train()
    optimizer = make_optimizer(model, hp)
    call = torch.compile(model) if compile else model

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            return call(input_ids=batch["tokens"], labels=labels, shift_labels=labels).loss

    return Side(
        "transformers",
        forward=forward,
        backward=lambda loss: loss.backward(),
        step=optimizer.step,
        keep=[model, optimizer],
        head=model.lm_head,
    )


# ---- measurements ----------------------------------------------------------------------------


def make_batches(shape: Shape, n: int, seed: int, device: torch.device) -> list[dict]:
    """Random-token micro-batches shaped as the GPT dataset's (labels already shifted)."""
    g = torch.Generator().manual_seed(seed)
    b, s = shape.micro_batch, shape.seq_length
    batches = []
    for _ in range(n):
        data = torch.randint(0, shape.vocab_size, (b, s + 1), generator=g)
        batch = {
            "tokens": data[:, :-1].contiguous(),
            "labels": data[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s).contiguous(),
        }
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --clock: wall time, or this process's CPU time (all its threads; meant for --threads 1, where
# it does not count the time other processes on a shared machine take from this one).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_step(
    side: Side, batch: dict, device: torch.device, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, list[float]]:
    """One training step; returns (loss, [forward, loss, backward, optimizer] seconds of
    ``clock``). "loss" is the output layer and the cross entropy, forward and backward, where
    :func:`mark_loss_phase` marks it (else 0, and forward includes it)."""
    side.marks.clear()
    t0 = clock()
    loss = side.forward(batch)
    sync(device)
    t1 = clock()
    side.backward(loss)
    sync(device)
    t2 = clock()
    side.step()
    sync(device)
    t3 = clock()
    head, head_grad = side.marks.get("head"), side.marks.get("head_grad")
    if head is None or head_grad is None:
        return loss.item(), [t1 - t0, 0.0, t2 - t1, t3 - t2]
    return loss.item(), [head - t0, (t1 - head) + (head_grad - t1), t2 - head_grad, t3 - t2]


def _onednn_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` by oneDNN's GEMM (what zerotron uses for fp32 matmuls on CPU)."""
    return onednn_mm_t(a, b.t())


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and ONEDNN_AVAILABLE


def best_matmul_peak(
    shape: Shape, dtype: torch.dtype, device: torch.device, clock: Callable[[], float]
) -> tuple[float, str]:
    """The best matmul rate this torch reaches on ``dtype``: torch.mm's and, on CPU, oneDNN's
    and, for 16 bits, the fp32 GEMM on upcast copies rounded back (zerotron.kernels.upcast: the
    same products, and where 16-bit GEMMs are emulated the fastest way to them)."""
    rate, where = matmul_peak(shape, dtype, device, clock=clock)
    best = (rate, f"torch.mm on {where}")
    if device.type == "cpu" and dtype != torch.float32:
        rate, where = matmul_peak(shape, dtype, device, clock=clock, mm=_upcast_mm)
        best = max(best, (rate, f"upcast fp32 GEMM on {where}"))
    if onednn_available(device):
        try:
            rate, where = matmul_peak(shape, dtype, device, clock=clock, mm=_onednn_mm)
        except RuntimeError as e:  # e.g. no bf16 inner product on a CPU without AVX-512/AMX
            print(f"  oneDNN {dtype} GEMM unavailable here ({str(e).splitlines()[0][:80]}...)")
        else:
            best = max(best, (rate, f"oneDNN on {where}"))
    return best


def _upcast_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return upcast.mm(a, b).to(a.dtype)


def matmul_peak(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    seconds: float = 0.25,
    clock: Callable[[], float] = time.perf_counter,
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.mm,
) -> tuple[float, str]:
    """Best FLOP/s of ``torch.mm`` (or ``mm``) over the model's matmul shapes and a square one.

    Each candidate ``[m, k] @ [k, n]`` runs with ``B`` stored ``[k, n]`` and as the transpose of
    an ``[n, k]`` matrix (``F.linear``'s layout); best of 3 rounds of ``seconds`` each.
    """
    t, h = shape.tokens_per_step, shape.hidden_size
    candidates = [(t, h, 3 * h), (t, h, h), (t, h, 4 * h), (t, 4 * h, h), (2048, 2048, 2048)]
    if device.type == "cuda":  # a GPU's tensor cores reach their rate on larger products
        candidates.append((8192, 8192, 8192))
    best, best_name = 0.0, ""
    for m, k, n in candidates:
        a = torch.randn(m, k, dtype=dtype, device=device)
        for layout, b in (
            ("kn", torch.randn(k, n, dtype=dtype, device=device)),
            ("nk^T", torch.randn(n, k, dtype=dtype, device=device).t()),
        ):
            flops = 2.0 * m * k * n
            mm(a, b)  # warm the kernel
            for _ in range(3):
                iters, t0 = 0, clock()
                while clock() - t0 < seconds:
                    mm(a, b)
                    sync(device)
                    iters += 1
                rate = flops * iters / (clock() - t0)
                if rate > best:
                    best, best_name = rate, f"[{m}x{k}]@[{k}x{n}] ({layout})"
    return best, best_name


def num_model_params(model: GPT2LMHeadModel) -> int:
    """N of the FLOPs formula: all parameters but the position embeddings, tied weight once."""
    n = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    return n - model.transformer.wpe.weight.numel()


def check_initial_loss(
    hf_sd: dict,
    hf_config: dict,
    shape: Shape,
    batch: dict,
    hp: Hyper,
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[float, float]:
    """fp32 loss of both models on one batch, before any step; they must agree."""
    zt = zerotron_side(hf_sd, hf_config, shape, torch.float32, False, hp, device, args.kernels)
    hf = hf_side(hf_sd, shape, torch.float32, False, hp, device, "master")
    with torch.no_grad():
        ours, theirs = zt.forward(batch).item(), hf.forward(batch).item()
    # GPU kernels (SDPA's, cuBLAS's split reductions) sum in other orders than the CPU's.
    if abs(ours - theirs) > (1e-5 if device.type == "cpu" else 1e-4) * abs(theirs):
        raise SystemExit(
            f"initial losses differ: zerotron {ours:.7f}, transformers {theirs:.7f}; the "
            "comparison would not be apples to apples (check checkpoint.hf and the model)"
        )
    return ours, theirs


@dataclass
class Column:
    """Results of one (dtype, compile) column."""

    dtype: str
    compiled: bool
    step_s: dict[str, float] = field(default_factory=dict)  # median seconds per step
    phases_ms: dict[str, list[float]] = field(default_factory=dict)  # fwd, loss, bwd, opt
    first_loss: dict[str, float] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)  # incl. compilation
    rounds_s: dict[str, list[float]] = field(default_factory=dict)  # mean step time per round
    ratio: float = 0.0  # median over rounds of transformers' / zerotron's step time

    @property
    def label(self) -> str:
        return f"{self.dtype} {'compiled' if self.compiled else 'eager'}"


def run_column(
    dtype_name: str,
    compiled: bool,
    hf_sd: dict,
    hf_config: dict,
    shape: Shape,
    batches: list,
    args: argparse.Namespace,
    hp: Hyper,
    device: torch.device,
) -> Column:
    col = Column(dtype_name, compiled)
    dtype = DTYPES[dtype_name]
    build = {
        "zerotron": lambda: zerotron_side(
            hf_sd, hf_config, shape, dtype, compiled, hp, device, args.kernels
        ),
        "transformers": lambda: hf_side(hf_sd, shape, dtype, compiled, hp, device, args.hf_bf16),
    }
    steps_done = {name: 0 for name in build}
    phases: dict[str, list[list[float]]] = {name: [] for name in build}

    def step(side: Side) -> float:
        batch = batches[steps_done[side.name] % len(batches)]
        steps_done[side.name] += 1
        loss, ph = timed_step(side, batch, device, CLOCKS[args.clock])
        if not math.isfinite(loss):
            raise SystemExit(f"{side.name} {col.label}: non-finite loss {loss}")
        phases[side.name].append(ph)
        return loss

    def warm_up(side: Side) -> None:  # compilation included
        if not compiled:  # eager: the output layer + loss timed apart from the rest
            mark_loss_phase(side, CLOCKS[args.clock])
        t0 = time.perf_counter()
        col.first_loss[side.name] = step(side)
        for _ in range(args.warmup - 1):
            step(side)
        col.warmup_s[side.name] = time.perf_counter() - t0
        phases[side.name].clear()

    def time_rounds(sides: list[Side]) -> None:
        # Steps alternate between the sides (and who goes first), so a burst of load from other
        # processes hits both alike; the ratio is taken per round, over the same stretch of time.
        for r in range(args.repeat):
            spent = {s.name: 0.0 for s in sides}
            for i in range(args.steps):
                for side in sides if (r * args.steps + i) % 2 == 0 else sides[::-1]:
                    step(side)
                    spent[side.name] += sum(phases[side.name][-1])
            for name, seconds in spent.items():
                col.rounds_s.setdefault(name, []).append(seconds / args.steps)

    if args.sides == "together":
        sides = [build[name]() for name in build]
        for side in sides:
            warm_up(side)
        time_rounds(sides)
    else:  # one side on the device at a time: both do not fit (GPT-2 XL on an 80 GB GPU)
        for name in build:
            side = build[name]()
            warm_up(side)
            time_rounds([side])
            del side
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for name, rounds in col.rounds_s.items():
        col.step_s[name] = statistics.median(rounds)
        col.phases_ms[name] = [
            1e3 * statistics.median(p[i] for p in phases[name]) for i in range(4)
        ]
    if args.sides == "together":
        col.ratio = statistics.median(
            hf / zt for zt, hf in zip(col.rounds_s["zerotron"], col.rounds_s["transformers"])
        )
    else:  # no common stretch of time: the ratio of the median rounds
        col.ratio = col.step_s["transformers"] / col.step_s["zerotron"]
    return col


# ---- report ----------------------------------------------------------------------------------


def report(
    columns: list[Column], shape: Shape, flops_per_token: float, peaks: dict, args
) -> tuple[str, dict]:
    tokens = shape.tokens_per_step
    lines = []
    width = 24
    head = f"{'':14}" + "".join(f"{c.label:>{width}}" for c in columns)
    sub = f"{'':14}" + "".join(f"{'tokens/s':>{width - 9}}{'MFU':>9}" for _ in columns)
    lines += [head, sub]
    results: dict[str, Any] = {}
    for name in ("zerotron", "transformers"):
        row = f"{name:14}"
        for c in columns:
            tps = tokens / c.step_s[name]
            mfu = tps * flops_per_token / peaks[c.dtype][0]
            results.setdefault(c.label, {})[name] = {"tokens_per_s": tps, "mfu": mfu}
            row += f"{tps:>{width - 9},.0f}{100 * mfu:>8.1f}%"
        lines.append(row)
    row = f"{'ratio':14}"
    for c in columns:
        results[c.label]["ratio"] = c.ratio
        row += f"{c.ratio:>{width - 9}.2f}x{'':>8}"
    lines.append(row)

    lines.append("")
    lines += phase_table(columns)
    lines.append("rounds, seconds per step (zerotron | transformers):")
    for c in columns:
        zt = " ".join(f"{x:.3f}" for x in c.rounds_s["zerotron"])
        hf = " ".join(f"{x:.3f}" for x in c.rounds_s["transformers"])
        warm = ", ".join(f"{n} {s:.1f}s" for n, s in c.warmup_s.items())
        lines.append(f"  {c.label:14} {zt} | {hf}   (warmup incl. compile: {warm})")
    lines.append("first-step loss, same weights and batch (zerotron / transformers):")
    for c in columns:
        lines.append(
            f"  {c.label:14} {c.first_loss['zerotron']:.5f} / {c.first_loss['transformers']:.5f}"
        )

    lines.append("")
    lines.append("goals (issue 18):")
    for c in columns:
        r = results[c.label]
        ok_ratio = r["ratio"] >= RATIO_GOAL
        goal = MFU_GOALS[c.dtype]
        ok_mfu = r["zerotron"]["mfu"] >= goal
        lines.append(
            f"  {c.label:14} ratio {r['ratio']:.2f}x >= {RATIO_GOAL}x: "
            f"{'met' if ok_ratio else 'NOT met'};  zerotron MFU {100 * r['zerotron']['mfu']:.1f}%"
            f" >= {100 * goal:.0f}%: {'met' if ok_mfu else 'NOT met'}"
        )
    if args.quick:
        lines.append("  (--quick: a tiny model; these numbers say nothing about the goals)")
    if args.clock == "cpu":
        lines.append(
            f"  (--clock cpu: tokens per CPU-second of this process, {torch.get_num_threads()} "
            "thread(s), and the peak in the same clock)"
        )
    return "\n".join(lines), results


PHASES = ("forward", "loss", "backward", "optimizer")


def phase_table(columns: list[Column]) -> list[str]:
    """Median ms per step phase, both sides and their ratio (transformers / zerotron)."""
    lines = [
        "per-step phases, median ms (loss: the output layer and cross entropy, forward and "
        "backward, timed apart in eager columns; compiled columns count it in forward):",
        f"  {'':16}{'':14}" + "".join(f"{p:>11}" for p in PHASES),
    ]
    for c in columns:
        zt, hf = c.phases_ms["zerotron"], c.phases_ms["transformers"]
        ratio = [f"{b / a:>10.2f}x" if a > 0 and b > 0 else f"{'-':>11}" for a, b in zip(zt, hf)]
        for label, name, values in ((c.label, "zerotron", zt), ("", "transformers", hf)):
            cells = "".join(f"{v:>11,.0f}" if v > 0 else f"{'-':>11}" for v in values)
            lines.append(f"  {label:16}{name:14}{cells}")
        lines.append(f"  {'':16}{'ratio':14}" + "".join(ratio))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dtypes", default=None, help="comma-separated: fp32,bf16 (default both; bf16 on cuda)"
    )
    p.add_argument(
        "--model", choices=tuple(MODELS), default="bench", help="the model and batch (Shape)"
    )
    p.add_argument("--compile", choices=("both", "on", "off"), default="both")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side and column (>= 1)")
    p.add_argument("--repeat", type=int, default=8, help="timed rounds; the median is reported")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 1 round")
    p.add_argument(
        "--hf-bf16",
        choices=("master", "autocast"),
        default="master",
        help="transformers' bf16: bf16 params + fp32 masters (as zerotron), or "
        "fp32 params under torch.autocast",
    )
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (with --threads 1: steady on a busy machine)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--sides",
        choices=("together", "apart"),
        default=None,
        help="together: both models resident, steps alternating (default); apart: one model "
        "on the device at a time, each timed alone (default for gpt2-1.5b, whose two sides "
        "need ~90 GB together)",
    )
    p.add_argument(
        "--kernels",
        help="force zerotron's CPU kernel choices, e.g. linear=torch,attention=sdpa "
        "(default: measured once per machine and cached, as zerotron pretrain does)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.dtypes is None:
        args.dtypes = "bf16" if torch.device(args.device).type == "cuda" else "fp32,bf16"
    if args.sides is None:
        args.sides = "apart" if args.model == "gpt2-1.5b" else "together"
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown or not args.dtypes:
        p.error(f"--dtypes: unknown {unknown}; use fp32 and/or bf16")
    if args.quick:
        args.steps, args.warmup, args.repeat = 2, 1, 1
    if min(args.steps, args.repeat, args.threads, args.warmup) < 1:
        p.error("--steps, --repeat, --warmup and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)
    shape = QUICK if args.quick else MODELS[args.model]
    hp = Hyper()
    compiles = {"both": [False, True], "on": [True], "off": [False]}[args.compile]

    reference = hf_model(shape, args.seed)
    hf_sd = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    hf_config = reference.config.to_dict()
    n = num_model_params(reference)
    flops_per_token = model_flops_per_token(
        n, shape.num_layers, shape.hidden_size, shape.seq_length
    )
    del reference
    batches = make_batches(shape, 4, args.seed, device)

    print(
        f"model: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads, "
        f"seq {shape.seq_length}, micro batch {shape.micro_batch} ({shape.tokens_per_step} tokens"
        f"/step), vocab {shape.vocab_size} (zerotron pads to {shape.padded_vocab_size}), dropout 0"
    )
    print(
        f"N = {n:,} parameters (no position embeddings, tied embedding once); model FLOPs per "
        f"token 6N + 12Lhs = {flops_per_token / 1e6:.1f} M"
    )
    print(
        f"optimizer (both): fused AdamW lr {hp.lr} wd {hp.weight_decay} (not on biases/norms) "
        f"betas {hp.betas} eps {hp.eps}, clip {hp.clip_grad}, in MixedPrecisionOptimizer"
    )
    hf_bf16 = (
        "bf16 params + fp32 masters, as zerotron"
        if args.hf_bf16 == "master"
        else "fp32 params under torch.autocast(bf16)"
    )
    print(f"bf16: zerotron bf16 params + fp32 masters; transformers {hf_bf16}")
    print(machine())
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, threads "
        f"{torch.get_num_threads()}, device {device}; steps {args.steps} x rounds {args.repeat} "
        f"after {args.warmup} warmup, median round; clock: {args.clock}"
    )

    ours, theirs = check_initial_loss(hf_sd, hf_config, shape, batches[0], hp, device, args)
    gc.collect()
    if device.type == "cuda":  # the two fp32 models' memory back before the columns
        torch.cuda.empty_cache()
    print(
        f"initial fp32 loss, same weights and batch: zerotron {ours:.6f}, transformers "
        f"{theirs:.6f} (|diff| {abs(ours - theirs):.1e})"
    )

    # The peak is measured next to each column (the same machine load) and the best of the run
    # is used: the most conservative MFU.
    measured: dict[str, list[tuple[float, str]]] = {d: [] for d in args.dtypes}
    columns = []
    for d in args.dtypes:
        for compiled in compiles:
            t0 = time.perf_counter()
            measured[d].append(best_matmul_peak(shape, DTYPES[d], device, CLOCKS[args.clock]))
            col = run_column(d, compiled, hf_sd, hf_config, shape, batches, args, hp, device)
            columns.append(col)
            print(f"  {col.label}: done in {time.perf_counter() - t0:.0f} s", flush=True)
            torch._dynamo.reset()
            gc.collect()

    peaks = {d: max(m) for d, m in measured.items()}
    print()
    for d, (rate, where) in peaks.items():
        each = ", ".join(f"{r / 1e9:,.0f}" for r, _ in measured[d])
        print(
            f"matmul peak {d}: {rate / 1e9:,.0f} GFLOP/s, {where} (the best of torch.mm and "
            f"oneDNN over the run; measured before each column: {each})"
        )
    for d in peaks:
        sheet = datasheet_peak(device, d)
        if sheet is not None:
            peaks[d] = sheet
            print(f"{d} MFU below is against the {sheet[1]}, not the measured rate")
    text, results = report(columns, shape, flops_per_token, peaks, args)
    print(text)
    if args.json:
        payload = {
            "shape": asdict(shape),
            "hyper": asdict(hp),
            "flops_per_token": flops_per_token,
            "peaks": {d: {"flops": f, "shape": s} for d, (f, s) in peaks.items()},
            "threads": torch.get_num_threads(),
            "clock": args.clock,
            "hf_bf16": args.hf_bf16,
            "columns": results,
            "initial_loss": {"zerotron": ours, "transformers": theirs},
        }
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
