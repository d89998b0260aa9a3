"""Pipeline schedules side by side with torch.distributed.pipelining: tokens/s and peak memory.

Both systems run the same model split: zerotron's GPT (default 8 layers, hidden 256, 8 heads,
seq 128, vocabulary 8192, no dropout) cut by :func:`~zerotron.models.gpt_stage.build_gpt_stages`
into p stages (v = 2 chunks per rank for the interleaved schedule), the same stage modules on
both sides, trained on the same ``m`` micro-batches (default 8 of 2 sequences) on p gloo CPU
ranks with one torch thread each:

==========================  ====================================================================
zerotron-1f1b               :class:`~zerotron.pipeline.PipelineRuntime` ``"1f1b"``: the last
                            stage computes the per-token loss in the LM head
zerotron-interleaved        the same, ``"interleaved"``, v chunks per rank
torch-1f1b                  ``PipelineStage`` + ``Schedule1F1B``: the last stage returns the
                            logits, ``loss_fn`` is ``F.cross_entropy`` over them (torch's API)
torch-interleaved           ``ScheduleInterleaved1F1B`` over the rank's v stages
==========================  ====================================================================

torch's schedules run with ``return_outputs=False`` (the merged logits of every micro-batch
are not needed) and their default ``scale_grads=True``; the stage shapes are inferred at the
first (warm-up) step. Timed is one training step (every micro-batch's forward and backward); the
tied-embedding gradient sum and the optimizer step are left out on both sides.

Timing: per schedule one set of ranks builds the chunks once and both systems run over them,
taking turns step by step (the order alternates), so the shared machine's load hits both
alike; per step the slowest rank's time, tokens/s = m·b·s / median step, and the ratio is the
median over steps of the paired ratio. Memory: each system alone in fresh ranks: peak RSS, peak
malloc heap (glibc ``mallinfo2``, sampled), and the heap's growth over two steps beyond what the
built model and one warm-up step left ("step heap": activations, gradients and buffers, what
the schedules differ in); the largest rank's.

Run: ``PYTHONPATH=. /work/benchvenv/bin/python bench/pipeline_peer.py [--quick] [--pp 2,4]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import job_kernels, machine, measure_kernels  # noqa: E402
from bench.tp import _last_line, _mb, _paired_ratio  # noqa: E402
from bench.zero import HeapPeak  # noqa: E402
from tests.distributed.spawn import RankError, run_ranks  # noqa: E402
from zerotron.kernels import KernelShape  # noqa: E402


@dataclass(frozen=True)
class Setup:
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    seq: int = 128
    vocab: int = 8192
    micro_batch: int = 2
    microbatches: int = 8
    virtual: int = 2
    steps: int = 6
    warmup: int = 1

    def kernel_shape(self) -> KernelShape:
        """What the kernel chooser measures: one micro-batch, one thread, fp32."""
        return KernelShape(
            self.hidden, self.heads, self.seq, self.micro_batch, self.vocab, "fp32", threads=1
        )


def _batch(setup: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All micro-batches of one step, ``[m·b, s]`` tokens and labels (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (setup.microbatches * setup.micro_batch, setup.seq)
    return torch.randint(0, setup.vocab, shape, generator=g), torch.randint(
        0, setup.vocab, shape, generator=g
    )


class _TorchStage(nn.Module):
    """A zerotron GPT chunk under torch's stage protocol: tensors in, one tensor out."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(None, {"tokens": x})
        return self.chunk(x, {})  # the last chunk returns the logits (no labels)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _chunks(setup: Setup, kind: str):
    """This rank's model chunks (v for the interleaved schedule), and the parallel state."""
    from zerotron.distributed.state import initialize_model_parallel
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.models.gpt_stage import build_gpt_stages

    pp = int(os.environ["WORLD_SIZE"])
    v = setup.virtual if kind == "interleaved" else 1
    # No virtual size in the state: 1- and v-chunk runtimes share the groups.
    st = initialize_model_parallel(1, pp)
    torch.manual_seed(1234)
    cfg = GPTConfig(
        num_layers=setup.layers,
        hidden_size=setup.hidden,
        num_attention_heads=setup.heads,
        seq_length=setup.seq,
        vocab_size=setup.vocab,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPT(cfg)
    chunks = build_gpt_stages(model, st.pp_rank, pp, v)
    del model
    gc.collect()
    return chunks, st


def _build(system: str, setup: Setup, chunks, st):
    """step(tokens, labels) of one system over the given chunks."""
    from zerotron.pipeline import PipelineRuntime

    pp = st.pp_size
    kind = system.split("-", 1)[1]
    m, b = setup.microbatches, setup.micro_batch
    if system.startswith("zerotron"):
        runtime = PipelineRuntime(chunks, kind, m)

        def step(tokens, labels):
            data = [
                {"tokens": t, "labels": y}
                for t, y in zip(tokens.split(b), labels.split(b), strict=True)
            ]
            runtime.train_step(iter(data))

        return step
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    v = len(chunks)
    stages = [
        PipelineStage(_TorchStage(c), i * pp + st.pp_rank, pp * v, torch.device("cpu"))
        for i, c in enumerate(chunks)
    ]
    if v == 1:
        schedule = Schedule1F1B(stages[0], m, loss_fn=_cross_entropy)
    else:
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=_cross_entropy)
    first, last = st.pp_rank == 0, st.pp_rank == pp - 1

    def step(tokens, labels):
        args = (tokens,) if first else ()
        schedule.step(*args, target=labels if last else None, return_outputs=False)

    return step


def _timing_rank(rank: int, kind: str, setup: Setup) -> dict:
    """zerotron and torch over the same chunks, taking turns step by step (order rotating)."""
    import warnings

    from zerotron.distributed import comm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    job_kernels(setup.kernel_shape())
    chunks, st = _chunks(setup, kind)
    systems = [f"zerotron-{kind}", f"torch-{kind}"]
    steps = {s: _build(s, setup, chunks, st) for s in systems}
    times: dict[str, list[float]] = {s: [] for s in systems}
    for k in range(setup.warmup + setup.steps):
        tokens, labels = _batch(setup, k)
        for system in systems[k % 2 :] + systems[: k % 2]:
            for c in chunks:
                c.zero_grad(set_to_none=True)
            comm.barrier()
            t0 = time.perf_counter()
            steps[system](tokens, labels)
            if k >= setup.warmup:
                times[system].append(time.perf_counter() - t0)
    comm.barrier()
    return times


def _memory_rank(rank: int, system: str, setup: Setup) -> dict:
    """One system alone in fresh ranks: peak RSS, peak heap, and the heap's growth over 2
    steps beyond what the built model and one warm-up step left."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    job_kernels(setup.kernel_shape())
    heap = HeapPeak()
    chunks, st = _chunks(setup, system.split("-", 1)[1])
    step = _build(system, setup, chunks, st)
    step(*_batch(setup, 0))
    for c in chunks:
        c.zero_grad(set_to_none=True)
    gc.collect()
    base = heap.in_use()  # the base of "growth": what the model and the warm-up left
    heap.peak = 0
    for k in (1, 2):
        step(*_batch(setup, k))
        for c in chunks:
            c.zero_grad(set_to_none=True)
    peak = heap.stop()
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "heap_peak": peak,
        "heap_growth": (peak or 0) - base,
    }


def run_config(kind: str, pp: int, setup: Setup, timeout: float) -> dict[str, dict]:
    systems = [f"zerotron-{kind}", f"torch-{kind}"]
    results = {s: {"name": f"{s}-pp{pp}", "system": s} for s in systems}
    for system in systems:
        try:
            ranks = run_ranks(_memory_rank, pp, system, setup, timeout=timeout)
        except RankError as e:
            results[system]["error"] = _last_line(e)
            continue
        for key in ("peak_rss", "heap_peak", "heap_growth"):
            results[system][key] = max(r[key] or 0 for r in ranks)
    if any("error" in r for r in results.values()):
        return results
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_timing_rank, pp, kind, setup, timeout=timeout)
    except RankError as e:
        for system in systems:
            results[system]["error"] = _last_line(e)
        return results
    for system in systems:
        per_step = [max(r[system][i] for r in ranks) for i in range(setup.steps)]
        step_s = statistics.median(per_step)
        results[system].update(
            per_step=per_step,
            step_s=step_s,
            tokens_per_s=setup.microbatches * setup.micro_batch * setup.seq / step_s,
            best_tokens_per_s=setup.microbatches * setup.micro_batch * setup.seq / min(per_step),
        )
    print(f"  {kind} pp{pp}: {time.perf_counter() - t0:.0f} s", flush=True)
    return results


def print_report(configs: list[dict[str, dict]], setup: Setup) -> None:
    print(f"\n{machine()}; setup {asdict(setup)}")
    print(
        f"{'system':<26}{'tokens/s':>10}{'best':>8}{'step ms':>9}{'peak RSS MB':>13}"
        f"{'heap MB':>9}{'step heap MB':>14}"
    )
    for results in configs:
        for r in results.values():
            if "error" in r:
                print(f"{r['name']:<26}  error: {r['error']}")
                continue
            print(
                f"{r['name']:<26}{r['tokens_per_s']:>10,.0f}{r['best_tokens_per_s']:>8,.0f}"
                f"{1000 * r['step_s']:>9.0f}{_mb(r['peak_rss']):>13}{_mb(r['heap_peak']):>9}"
                f"{_mb(r['heap_growth']):>14}"
            )
    print(
        "\nzerotron / torch.distributed.pipelining (tokens/s: median paired ratio over steps, "
        "higher is better; memory: lower)"
    )
    for results in configs:
        ours, other = results.values()
        if "error" in ours or "error" in other:
            continue
        speed = _paired_ratio(ours["per_step"], other["per_step"])
        best = min(other["per_step"]) / min(ours["per_step"])
        rss = ours["peak_rss"] / other["peak_rss"]
        heap = ours["heap_peak"] / other["heap_peak"]
        growth = ours["heap_growth"] / max(other["heap_growth"], 1)
        goal = "goal met" if speed >= 1 and heap <= 1 else "goal NOT met"
        print(
            f"  {ours['name']:<26} tokens/s {speed:5.2f}x (best steps {best:4.2f}x)   "
            f"peak RSS {rss:5.2f}x   "
            f"heap {heap:5.2f}x   step heap {growth:5.2f}x   {goal}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="1f1b,interleaved", help="schedules, comma-separated")
    p.add_argument("--pp", default="2,4", help="pipeline sizes, comma-separated")
    for field in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "microbatches"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(Setup, field))
    p.add_argument("--virtual", type=int, default=Setup.virtual, help="chunks per rank")
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--warmup", type=int, default=Setup.warmup)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round: checks it runs")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    setup = Setup(
        args.layers,
        args.hidden,
        args.heads,
        args.seq,
        args.vocab,
        args.micro_batch,
        args.microbatches,
        args.virtual,
        args.steps,
        args.warmup,
    )
    if args.quick:
        setup = Setup(8, 64, 4, 32, 512, 1, 4, 2, 1, 1)
    print(f"zerotron {measure_kernels(setup.kernel_shape())}", flush=True)
    configs = []
    for pp in args.pp.split(","):
        for kind in args.kinds.split(","):
            print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
            configs.append(run_config(kind, int(pp), setup, args.timeout))
    print_report(configs, setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": asdict(setup), "configs": configs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
