"""Pipeline schedules side by side with torch.distributed.pipelining: tokens/s and peak memory.

Both systems run the same model split: zerotron's GPT (default 8 layers, hidden 256, 8 heads,
seq 256, vocabulary 8192, no dropout) cut by :func:`~zerotron.models.gpt_stage.build_gpt_stages`
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
tied-embedding gradient sum and the optimizer step are left out on both sides. Each system runs
in a fresh set of processes (peak memory is its own); ``--repeat`` rounds run every system in
turn (the machine is shared) and each keeps its median round. Measured per rank: step time (the
slowest rank's, median over ``--steps``), tokens/s = m·b·s / step, peak RSS and the peak malloc
heap (glibc ``mallinfo2``, sampled) and its growth during the timed steps over the heap after
the model is built and warmed up ("step heap": activations, gradients and buffers, what the
schedules differ in).

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

from bench.tp import _cpu_model, _mb  # noqa: E402
from bench.zero import HeapPeak  # noqa: E402
from tests.distributed.spawn import RankError, run_ranks  # noqa: E402

SYSTEMS = ("zerotron-1f1b", "torch-1f1b", "zerotron-interleaved", "torch-interleaved")


@dataclass(frozen=True)
class Setup:
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    seq: int = 256
    vocab: int = 8192
    micro_batch: int = 2
    microbatches: int = 8
    virtual: int = 2
    steps: int = 4
    warmup: int = 1


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


def _rank(rank: int, system: str, setup: Setup) -> dict:
    import warnings

    from zerotron.distributed import comm
    from zerotron.distributed.state import initialize_model_parallel
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.models.gpt_stage import build_gpt_stages
    from zerotron.pipeline import PipelineRuntime

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    pp = int(os.environ["WORLD_SIZE"])
    kind = system.split("-", 1)[1]
    v = setup.virtual if kind == "interleaved" else 1
    st = initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=v if v > 1 else None)
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
    m, b = setup.microbatches, setup.micro_batch
    if system.startswith("zerotron"):
        runtime = PipelineRuntime(chunks, kind, m)

        def step(tokens, labels):
            data = [
                {"tokens": t, "labels": y}
                for t, y in zip(tokens.split(b), labels.split(b), strict=True)
            ]
            runtime.train_step(iter(data))

    else:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        stages = [
            PipelineStage(_TorchStage(c), c_index * pp + st.pp_rank, pp * v, torch.device("cpu"))
            for c_index, c in enumerate(chunks)
        ]
        if v == 1:
            schedule = Schedule1F1B(stages[0], m, loss_fn=_cross_entropy)
        else:
            schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=_cross_entropy)
        first, last = st.pp_rank == 0, st.pp_rank == pp - 1

        def step(tokens, labels):
            args = (tokens,) if first else ()
            schedule.step(*args, target=labels if last else None, return_outputs=False)

    for c in chunks:  # as a training loop would between steps
        c.zero_grad(set_to_none=True)
    for k in range(setup.warmup):
        step(*_batch(setup, k))
        for c in chunks:
            c.zero_grad(set_to_none=True)
    gc.collect()
    heap = HeapPeak()
    heap._sample()  # the heap the built model and the warm-up left: the base of "growth"
    base = heap.peak or 0
    times = []
    for k in range(setup.warmup, setup.warmup + setup.steps):
        tokens, labels = _batch(setup, k)
        comm.barrier()
        t0 = time.perf_counter()
        step(tokens, labels)
        times.append(time.perf_counter() - t0)
        for c in chunks:
            c.zero_grad(set_to_none=True)
    comm.barrier()
    return {
        "times": times,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "heap_peak": heap.stop(),
        "heap_growth": (heap.peak or 0) - base,
    }


def run_system(system: str, pp: int, setup: Setup, timeout: float) -> dict:
    name = f"{system}-pp{pp}"
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(_rank, pp, system, setup, timeout=timeout)
    except RankError as e:
        last = [ln for ln in e.details.strip().splitlines() if ln.strip()]
        return {"name": name, "system": system, "error": last[-1] if last else str(e)}
    step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(setup.steps))
    return {
        "name": name,
        "system": system,
        "pp": pp,
        "step_s": step_s,
        "tokens_per_s": setup.microbatches * setup.micro_batch * setup.seq / step_s,
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "heap_peak": max(r["heap_peak"] or 0 for r in ranks) or None,
        "heap_growth": max(r["heap_growth"] for r in ranks),
        "seconds": time.perf_counter() - t0,
    }


def _best(rounds: list[dict]) -> dict:
    ok = sorted((r for r in rounds if "error" not in r), key=lambda r: r["tokens_per_s"])
    if not ok:
        return rounds[-1]
    best = dict(ok[len(ok) // 2])
    best["rounds"] = [round(r["tokens_per_s"]) for r in ok]
    best["peak_rss"] = max(r["peak_rss"] for r in ok)
    heaps = [r["heap_peak"] for r in ok if r.get("heap_peak")]
    best["heap_peak"] = max(heaps) if heaps else None
    best["heap_growth"] = max(r["heap_growth"] for r in ok)
    return best


def print_report(results: list[dict], setup: Setup) -> None:
    print(f"\nCPU: {_cpu_model()}; load average {os.getloadavg()[0]:.1f}; setup {asdict(setup)}")
    print(
        f"{'system':<26}{'tokens/s':>10}{'step ms':>9}{'peak RSS MB':>13}{'heap MB':>9}"
        f"{'step heap MB':>14}  rounds"
    )
    for r in results:
        if "error" in r:
            print(f"{r['name']:<26}  error: {r['error']}")
            continue
        print(
            f"{r['name']:<26}{r['tokens_per_s']:>10,.0f}{1000 * r['step_s']:>9.0f}"
            f"{_mb(r['peak_rss']):>13}{_mb(r['heap_peak']):>9}{_mb(r['heap_growth']):>14}"
            f"  {r['rounds']}"
        )
    by_name = {r["name"]: r for r in results if "error" not in r}
    print("\nzerotron / torch.distributed.pipelining (tokens/s: higher is better; memory: lower)")
    for name, ours in by_name.items():
        if not name.startswith("zerotron"):
            continue
        other = by_name.get("torch" + name[len("zerotron") :])
        if other is None:
            continue
        speed = ours["tokens_per_s"] / other["tokens_per_s"]
        rss = ours["peak_rss"] / other["peak_rss"]
        heap = ours["heap_peak"] / other["heap_peak"]
        growth = ours["heap_growth"] / max(other["heap_growth"], 1)
        goal = "goal met" if speed >= 1 and heap <= 1 else "goal NOT met"
        print(
            f"  {name:<26} tokens/s {speed:5.2f}x   peak RSS {rss:5.2f}x   heap {heap:5.2f}x"
            f"   step heap {growth:5.2f}x   {goal}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    p.add_argument("--pp", default="2,4", help="pipeline sizes, comma-separated")
    for field in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "microbatches"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(Setup, field))
    p.add_argument("--virtual", type=int, default=Setup.virtual, help="chunks per rank")
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--warmup", type=int, default=Setup.warmup)
    p.add_argument("--repeat", type=int, default=3, help="rounds over all systems")
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
        args.vocab,
        args.micro_batch,
        args.microbatches,
        args.virtual,
        args.steps,
        args.warmup,
    )
    if args.quick:
        setup = Setup(8, 64, 4, 32, 512, 1, 4, 2, 1, 1)
        args.repeat = 1
    runs = [(system, int(pp)) for pp in args.pp.split(",") for system in systems]
    rounds: dict[tuple, list[dict]] = {run: [] for run in runs}
    for k in range(args.repeat):
        print(f"round {k + 1}/{args.repeat} (load average {os.getloadavg()[0]:.1f})", flush=True)
        for system, pp in runs:
            if rounds[system, pp] and "error" in rounds[system, pp][-1]:
                continue
            r = run_system(system, pp, setup, args.timeout)
            note = r.get("error") or f"{r['tokens_per_s']:,.0f} tokens/s"
            print(f"  {r['name']}: {note} ({r.get('seconds', 0):.0f} s)", flush=True)
            rounds[system, pp].append(r)
    results = [_best(rs) for rs in rounds.values()]
    print_report(results, setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": asdict(setup), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
