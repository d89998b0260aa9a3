"""Pipeline bubble of the real runtime: measured idle time against (p − 1)/(v·m) and the simulator.

For each pipeline size p (default 2 and 4) the benchmark starts p gloo CPU ranks (one torch
thread each) and trains a GPT with :class:`~zerotron.pipeline.PipelineRuntime` under
GPipe, 1F1B and interleaved 1F1B (v virtual stages), the schedules taking turns step by step so
that load from other processes hits all alike. In every timed step each rank records the time
it spends inside its ``Forward`` and ``Backward`` actions (the chunk's compute, loss included;
not communication and not waiting) and when the step starts and ends.

Definitions (those of :mod:`zerotron.pipeline.timeline`). All ranks leave a barrier,
then run one step; the step's makespan T runs from the first rank's start to the last rank's
end (one monotonic clock: the ranks share the machine). Stage s is busy for B_s (its compute)
and idle for T − B_s (waiting for peers, and communication), and

- bubble = Σ idle / Σ busy: Megatron-LM's bubble time fraction; theory (p − 1)/(v·m);
- idle fraction = Σ idle / (p·T): the share of the ranks' time wasted; theory
  (p − 1)/(v·m + p − 1).

Next to theory, the simulator's prediction: :func:`~zerotron.pipeline.timeline.measure`
of the same schedule with the forward and backward cost of one model chunk set to the means
measured in this run (the simulator takes one cost for every stage and free communication; the
real first and last stages also run the embedding and the LM head). Reported numbers are medians
over ``--repeat`` steps.

Cores matter: p ranks with one thread each need p free cores. On fewer cores the ranks share
them, a compute slows down when other ranks compute at the same time, and the busy times of the
steady phase (everyone computing) inflate more than those of the ramp-up and ramp-down, which
shrinks the measured bubble below theory. The benchmark prints the cores it could use and flags
the rows where p exceeds them.

Run: ``.venv/bin/python bench/pipeline_bubble.py [--quick] [--pp 2,4] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.distributed.spawn import run_ranks  # noqa: E402
from zerotron.distributed import comm  # noqa: E402
from zerotron.distributed.state import initialize_model_parallel  # noqa: E402
from zerotron.models.gpt import GPT, GPTConfig  # noqa: E402
from zerotron.models.gpt_stage import build_gpt_stages  # noqa: E402
from zerotron.parallel.declarations import allreduce_tied_grads  # noqa: E402
from zerotron.pipeline import (  # noqa: E402
    Backward,
    Forward,
    PipelineRuntime,
    build_schedule,
    measure,
    theoretical_bubble,
)

KINDS = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Setup:
    """Model and schedule sizes shared by every rank."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    microbatches: int
    virtual: int
    vocab: int
    warmup: int
    repeat: int


class TimedRuntime(PipelineRuntime):
    """The runtime, with the wall time of every Forward and Backward action recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute: list[tuple[str, int, float]] = []  # ("F" | "B", chunk, seconds)
        self.comm_seconds = 0.0  # inside communication actions (transfer and waiting)

    def _forward(self, step, a):
        t0 = time.perf_counter()
        super()._forward(step, a)
        self.compute.append(("F", a.chunk, time.perf_counter() - t0))

    def _backward(self, step, a):
        t0 = time.perf_counter()
        super()._backward(step, a)
        self.compute.append(("B", a.chunk, time.perf_counter() - t0))

    def _communicate(self, step, ops):
        t0 = time.perf_counter()
        super()._communicate(step, ops)
        self.comm_seconds += time.perf_counter() - t0


def _batches(setup: Setup, step: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    b, s = setup.micro_batch, setup.seq
    return [
        {
            "tokens": torch.randint(0, setup.vocab, (b, s), generator=g),
            "labels": torch.randint(0, setup.vocab, (b, s), generator=g),
            "position_ids": torch.arange(s).repeat(b, 1),
        }
        for _ in range(setup.microbatches)
    ]


def _ping_pong(rank: int, setup: Setup, rounds: int = 20) -> float | None:
    """Median one-way time of one activation between ranks 0 and 1 (None on other ranks)."""
    buf = torch.randn(setup.micro_batch, setup.seq, setup.hidden)
    times = []
    for i in range(rounds + 3):
        comm.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            comm.send(buf, 1)
            comm.recv(buf, 1)
        elif rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times) if rank == 0 else None


def _rank(rank: int, pp: int, setup: Setup) -> dict:
    # No virtual size in the state: the 1- and 2-chunk runtimes share these groups.
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
    runtimes = {}
    for kind in KINDS:
        v = setup.virtual if kind == "interleaved" else 1
        stages = build_gpt_stages(model, st.pp_rank, pp, v)  # chunks share the model's modules
        runtimes[kind] = (TimedRuntime(stages, kind, setup.microbatches), stages)
    out: dict[str, Any] = {kind: [] for kind in KINDS}
    out["p2p"] = _ping_pong(rank, setup)
    for step in range(setup.warmup + setup.repeat):
        for kind in KINDS:
            runtime, stages = runtimes[kind]
            model.zero_grad(set_to_none=True)
            for s in stages:
                s.zero_grad(set_to_none=True)
            data = _batches(setup, step)
            runtime.compute.clear()
            runtime.comm_seconds = 0.0
            comm.barrier()
            start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for all local ranks
            runtime.train_step(iter(data))
            end = time.perf_counter()
            allreduce_tied_grads(stages)  # as in training; outside the timed step
            if step >= setup.warmup:
                out[kind].append(
                    {
                        "start": start,
                        "end": end,
                        "compute": list(runtime.compute),
                        "comm": runtime.comm_seconds,
                    }
                )
    return out


# ------------------------------------------------------------------------------------------
# Analysis


def analyze(results: list[dict], pp: int, setup: Setup) -> dict[str, Any]:
    """Per schedule: medians over repeats of the measured bubble and idle fraction, theory,
    and the simulator's prediction with the measured chunk costs."""
    out = {}
    for kind in KINDS:
        v = setup.virtual if kind == "interleaved" else 1
        m = setup.microbatches
        theory = theoretical_bubble(pp, m, v)
        schedule = build_schedule(kind, pp, m, v)
        # p2p actions on the busiest stage: what the measured step pays beyond the simulator
        actions = max(sum(not isinstance(a, (Forward, Backward)) for a in s) for s in schedule)
        reps: dict[str, list[float]] = {}
        for rep in range(setup.repeat):
            steps = [results[r][kind][rep] for r in range(pp)]
            span = max(s["end"] for s in steps) - min(s["start"] for s in steps)
            busy = sum(t for s in steps for _, _, t in s["compute"])
            idle = pp * span - busy
            fwd = statistics.fmean(t for s in steps for k, _, t in s["compute"] if k == "F")
            bwd = statistics.fmean(t for s in steps for k, _, t in s["compute"] if k == "B")
            sim = measure(schedule, fwd, bwd)  # this step's mean chunk costs, free comm
            for key, value in (
                ("bubble", idle / busy),
                ("idle", idle / (pp * span)),
                ("span", span),
                ("fwd", fwd),
                ("bwd", bwd),
                ("comm", sum(s["comm"] for s in steps) / busy),
                ("sim_bubble", sim.bubble),
                ("sim_idle", sim.idle_fraction),
                ("sim_span", sim.makespan),
                ("excess", (span - sim.makespan) / actions),
            ):
                reps.setdefault(key, []).append(value)
        row = {key: statistics.median(values) for key, values in reps.items()}
        row.update(
            v=v,
            bubble_range=(min(reps["bubble"]), max(reps["bubble"])),
            theory=theory,
            theory_idle=(pp - 1) / (v * m + pp - 1),
        )
        out[kind] = row
    out["p2p"] = results[0]["p2p"]
    return out


def print_table(rows: list[tuple[int, dict]], setup: Setup, cores: int) -> None:
    print(
        f"GPT: {setup.layers} layers, hidden {setup.hidden}, {setup.heads} heads, seq "
        f"{setup.seq}, micro-batch {setup.micro_batch}, vocab {setup.vocab}, fp32; "
        f"m = {setup.microbatches} micro-batches, interleaved v = {setup.virtual}; "
        f"1 thread per rank, {cores} cores usable; medians of {setup.repeat} steps "
        f"(after {setup.warmup} warmup)"
    )
    print(
        "bubble = idle/busy (theory (p-1)/(v·m)); idle = idle/(p·T) (theory "
        "(p-1)/(v·m+p-1)); sim = simulator with the step's mean F/B chunk costs;\n"
        "F/B ms = one chunk's forward/backward; comm = time inside p2p actions / busy "
        "(part of idle);\nΔ/p2p ms = (step − sim step) / p2p actions per stage: the real cost of "
        "one p2p action the simulator leaves out\n"
    )
    head = (
        f"{'p':>2} {'schedule':<12}{'v':>2}  {'bubble':>7} {'[min..max]':>15} {'theory':>7} "
        f"{'sim':>7}   {'idle':>6} {'theory':>7} {'sim':>6}   {'step s':>7} {'sim s':>6}  "
        f"{'F ms':>6} {'B ms':>6} {'comm':>6} {'Δ/p2p ms':>8}"
    )
    print(head)
    print("-" * len(head))
    for pp, res in rows:
        for kind in KINDS:
            r = res[kind]
            lo, hi = r["bubble_range"]
            note = "  (p > cores: ranks share cores)" if pp > cores else ""
            print(
                f"{pp:>2} {kind:<12}{r['v']:>2}  {r['bubble']:>7.3f} "
                f"{f'[{lo:.3f}..{hi:.3f}]':>15} {r['theory']:>7.3f} {r['sim_bubble']:>7.3f}   "
                f"{r['idle']:>6.3f} {r['theory_idle']:>7.3f} {r['sim_idle']:>6.3f}   "
                f"{r['span']:>7.3f} {r['sim_span']:>6.3f}  {1e3 * r['fwd']:>6.1f} "
                f"{1e3 * r['bwd']:>6.1f} {r['comm']:>6.3f} {1e3 * r['excess']:>8.2f}{note}"
            )


def _kb(setup: Setup) -> str:
    return f"{setup.micro_batch * setup.seq * setup.hidden * 4 / 1e3:g}"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", default="2,4", help="pipeline sizes, comma-separated")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (m)")
    p.add_argument("--virtual", type=int, default=2, help="chunks per stage, interleaved (v)")
    p.add_argument("--layers", type=int, default=8, help="divisible by p·v for every p")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512, help="small, so the layers dominate")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per schedule")
    p.add_argument("--repeat", type=int, default=3, help="timed steps per schedule (median)")
    p.add_argument("--quick", action="store_true", help="tiny model, p = 2, 2 steps")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pipeline size")
    args = p.parse_args(argv)
    if args.quick:
        args.pp, args.layers, args.hidden, args.seq, args.repeat = "2", 4, 64, 32, 2
    sizes = [int(x) for x in args.pp.split(",")]
    for pp in sizes:
        if pp < 2 or args.layers % (pp * args.virtual) or args.microbatches % pp:
            p.error(
                f"p={pp}: need p >= 2, layers ({args.layers}) divisible by p·v "
                f"({pp * args.virtual}) and micro-batches ({args.microbatches}) by p"
            )
    setup = Setup(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        micro_batch=args.micro_batch,
        microbatches=args.microbatches,
        virtual=args.virtual,
        vocab=args.vocab,
        warmup=args.warmup,
        repeat=args.repeat,
    )
    cores = usable_cores()
    rows = []
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    for pp in sizes:
        results = run_ranks(_rank, pp, pp, setup, timeout=args.timeout)
        rows.append((pp, analyze(results, pp, setup)))
    print_table(rows, setup, cores)
    print()
    for pp, res in rows:
        print(
            f"p={pp}: one activation ({_kb(setup)} kB) rank 0 -> 1 takes "
            f"{1e3 * res['p2p']:.2f} ms one way (ping-pong median, same run)"
        )
    print(
        f"{time.perf_counter() - t0:.1f} s in all; 1-minute load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (other processes on the machine)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
