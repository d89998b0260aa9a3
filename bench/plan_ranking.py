"""The planner's ranking against measured step times of zerotron on CPU gloo ranks.

A tiny GPT-2-vocabulary model is pretrained with ``zerotron pretrain`` (the real loop: Engine,
data, DP/ZeRO, TP, pipeline schedules) on 2 gloo ranks, one torch thread each, for several
layouts of the same global batch. Each run times ``--iters`` iterations (Megatron's "elapsed
time per iteration" lines, the first ``--warmup`` dropped, the median kept); ``--rounds`` rounds
run every layout once each, in a rotated order, so load from other processes hits all alike, and
a layout's time is its median over rounds.

The planner predicts the same layouts on a CPU "cluster" calibrated in this run:

- peak FLOP/s: the best single-thread fp32 ``torch.mm`` rate over the model's GEMM shapes
  (efficiency 1, so the cost model's compute is FLOPs at that rate);
- memory bandwidth: a large tensor copy (bytes read + written per second);
- link bandwidth: a timed gloo all-reduce between the 2 ranks (ring wire bytes per second),
  used for the "intra-node" links (both ranks are on this machine).

Printed: the CPU model, the calibration, each layout's measured and predicted step time, and
the rank correlation (Spearman) of the two orders. Timings never enter the test suite.

Run: ``python bench/plan_ranking.py [--iters 8 --rounds 2]`` (``--quick``: 3 layouts, a
sanity check).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_model  # noqa: E402
from tests.distributed.spawn import run_ranks  # noqa: E402
from zerotron.config import parse_megatron_args  # noqa: E402
from zerotron.tuning.cost import Cluster, predict  # noqa: E402
from zerotron.tuning.estimate import GPT2_VOCAB, Layout, ModelShape  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, HEADS, SEQ, GBS = 4, 256, 8, 128, 8

# name: (extra pretrain flags, planner layout)
LAYOUTS = {
    "dp2 mbs4": (["--micro-batch-size", "4"], Layout(dp=2, micro_batch_size=4)),
    "dp2 mbs1": (["--micro-batch-size", "1"], Layout(dp=2, num_microbatches=4)),
    "dp2 zero3": (
        ["--micro-batch-size", "4", "--zero-stage", "3"],
        Layout(dp=2, micro_batch_size=4, zero_stage=3),
    ),
    "dp2 recompute": (
        ["--micro-batch-size", "4", "--recompute-granularity", "full"],
        Layout(dp=2, micro_batch_size=4, recompute="full"),
    ),
    "tp2 mbs8": (
        ["--micro-batch-size", "8", "--tensor-model-parallel-size", "2"],
        Layout(tp=2, micro_batch_size=8),
    ),
    "pp2 mbs1": (
        ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"],
        Layout(pp=2, num_microbatches=8),
    ),
    "pp2 mbs4": (
        ["--micro-batch-size", "4", "--pipeline-model-parallel-size", "2"],
        Layout(pp=2, micro_batch_size=4, num_microbatches=2),
    ),
}


def _argv(data: str, iters: int, extra: list[str]) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
        "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--global-batch-size", str(GBS),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
        "--split", "100,0,0", "--log-interval", "1", "--eval-iters", "0",
        "--train-iters", str(iters), "--num-workers", "0", "--seed", "1234",
        "--data-path", data, *extra,
    ]  # fmt: skip


def _pretrain_rank(rank: int, argv: list[str]) -> list[float]:
    from zerotron.training.pretrain import pretrain

    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = pretrain(parse_megatron_args(argv, world_size=2))
    text = "\n".join(summary.interval_lines) + out.getvalue()
    return [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]


def _allreduce_rank(rank: int, nbytes: int, reps: int) -> float:
    from zerotron.distributed import comm
    from zerotron.distributed.state import initialize_model_parallel

    st = initialize_model_parallel(1, 1)
    t = torch.ones(nbytes // 4)
    comm.all_reduce(t, st.dp)
    start = time.perf_counter()
    for _ in range(reps):
        comm.all_reduce(t, st.dp)
    return (time.perf_counter() - start) / reps


def calibrate_cpu(shape: ModelShape, data: str) -> Cluster:
    """Peak matmul rate, memory bandwidth and gloo link bandwidth of this machine."""
    torch.set_num_threads(1)
    rates = []
    m = 4 * SEQ
    for k, n in ((HIDDEN, 3 * HIDDEN), (HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 8192)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        rates.append(2 * m * k * n * 5 / (time.perf_counter() - start))
    x = torch.empty(16 * 2**20)
    y = torch.empty_like(x)
    y.copy_(x)
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    hbm = 2 * x.numel() * 4 * 5 / (time.perf_counter() - start)
    nbytes = 8 * 2**20
    secs = statistics.median(run_ranks(_allreduce_rank, 2, nbytes, 10, timeout=120))
    link = 2 * (2 - 1) / 2 * nbytes / secs
    return Cluster(
        nodes=1,
        gpus_per_node=2,
        gpu_memory=2**40,
        peak_flops=max(rates),
        intra_node_bandwidth=link,
        inter_node_bandwidth=link,
        hbm_bandwidth=hbm,
        efficiency=1.0,
        name="cpu",
    )


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two lists (no ties expected)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0] * len(v)
        for i, j in enumerate(order):
            r[j] = i
        return r

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def _dataset(root: Path) -> str:
    from zerotron.data.preprocess import main as preprocess

    lines = (REPO / "data" / "austen.jsonl").read_text(encoding="utf-8").splitlines(True)
    (root / "docs.jsonl").write_text("".join(lines[:200]), encoding="utf-8")
    with contextlib.redirect_stdout(io.StringIO()):
        preprocess(
            ["--input", str(root / "docs.jsonl"), "--output-prefix", str(root / "docs")]
            + ["--append-eod", "--workers", "1"]
        )
    return str(root / "docs_text_document")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=8, help="iterations per run")
    p.add_argument("--warmup", type=int, default=3, help="first iterations not counted")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--quick", action="store_true", help="3 layouts, 3 iterations, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.warmup, args.rounds = 3, 1, 1
        args.layouts = "dp2 mbs4,tp2 mbs8,pp2 mbs1"
    names = args.layouts.split(",")
    shape = ModelShape(LAYERS, HIDDEN, HEADS, SEQ, GPT2_VOCAB)
    with tempfile.TemporaryDirectory() as tmp:
        data = _dataset(Path(tmp))
        c = calibrate_cpu(shape, data)
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; 2 gloo ranks, 1 thread each")
        print(
            f"calibrated: matmul {c.peak_flops / 1e9:.1f} GFLOP/s per rank (fp32), memory "
            f"{c.hbm_bandwidth / 1e9:.1f} GB/s, gloo all-reduce {c.intra_node_bandwidth / 1e9:.2f}"
            " GB/s (ring wire bytes)"
        )
        print(
            f"model: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, vocabulary "
            f"{GPT2_VOCAB}, fp32, global batch {GBS}; {args.iters} iterations per run, "
            f"{args.warmup} warm-up, {args.rounds} rounds\n"
        )
        measured: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                extra, _ = LAYOUTS[name]
                ms = run_ranks(_pretrain_rank, 2, _argv(data, args.iters, extra), timeout=600)[0]
                measured[name].append(statistics.median(ms[args.warmup :]) / 1e3)
                print(f"  round {r + 1}: {name} {measured[name][-1]:.3f} s", file=sys.stderr)
    rows = []
    for name in names:
        lay = LAYOUTS[name][1]
        lay = Layout(**{**lay.__dict__, "precision": "fp32", "device": "cpu"})
        pred = predict(shape, lay, c).step_time
        rows.append((name, statistics.median(measured[name]), pred))
    print(f"{'layout':<16}{'measured s':>12}{'predicted s':>13}{'pred/meas':>11}")
    for name, meas, pred in sorted(rows, key=lambda r: r[1]):
        print(f"{name:<16}{meas:>12.3f}{pred:>13.3f}{pred / meas:>11.2f}")
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    print(f"\nSpearman rank correlation, measured vs predicted order: {rho:.2f}")
    best_meas = min(rows, key=lambda r: r[1])[0]
    best_pred = min(rows, key=lambda r: r[2])[0]
    print(f"fastest measured: {best_meas}; fastest predicted: {best_pred}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
