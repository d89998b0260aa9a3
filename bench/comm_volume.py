"""Communication volume of one training step, per parallel layout: the comm ledger against theory.

For each layout (tp2, tp2+sp, pp2, pp4, dp2 and their products) the benchmark measures one
steady-state training step (after a first one: see PP below) of a small GPT on gloo CPU ranks:
``m`` micro-batches forward and backward through :class:`~zerotron.pipeline.PipelineRuntime`
(one stage when pp = 1), then the gradient reductions in the engine's order: the data-parallel
average (:class:`~zerotron.parallel.data_parallel.DataParallel`, all buckets once per step), the
sequence-parallel sum over TP, the tied-embedding sum over the embedding group. Every byte goes
through :mod:`zerotron.distributed.comm`, whose ledger each rank captures for the step. The
parent process computes, from the model's dimensions alone, the closed-form bytes and calls of
every ``(group, op)`` on every rank and prints measured / theory: one row per layout, then
(``--detail``) one row per layout, group and op.

Closed form, fp32 (4 bytes), b = micro-batch, s = sequence, h = hidden, L = layers on the rank,
m = micro-batches, V = padded vocabulary, P = positions, a = b·s·h·4 bytes. Per micro-batch:

- TP (the issue's headline: 4 all-reduces of a per layer, 2 forward + 2 backward), plus the
  vocab-parallel embedding's forward all-reduce (a) on the stage holding the embedding, and on
  the stage holding the LM head its input-gradient all-reduce (a) and the vocab-parallel cross
  entropy's 3 all-reduces of b·s fp32 (max, target logit, sum of exponentials).
- SP: each of those all-reduces of a becomes an all-gather of the rank's b·(s/tp)·h shard and a
  reduce-scatter of a (the ledger records the logical op, see ``comm``); once per step, one
  all-reduce of the sequence-parallel parameters' gradients (per layer 2 LayerNorms and 2
  row-parallel biases = 6h, final LayerNorm 2h, position embeddings P·h).
- PP: per boundary between consecutive virtual stages, each way: the activation (a, or a/tp
  under SP) forward, its gradient backward (the issue's headline). Once per step: the tied word
  embedding's gradient (V/tp·h) all-reduced over first and last stage. The runtime's first step
  also sends a shape header (8 int64 = 64 bytes) before each activation and later steps keep
  those shapes, so the first step runs unmeasured and the second is the one compared.
- DP: once per step, the rank's gradient bytes (every parameter it holds, the tied copy
  included), in one all-reduce per bucket (one bucket at the default 40M-element size).

Not counted (they belong to the optimizer step, not measured here): the grad-norm all-reduce
of one scalar per model-parallel group and the 4-byte loss average over DP.

Run: ``.venv/bin/python bench/comm_volume.py [--quick] [--detail] [--layouts tp2,pp2,...]``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.distributed.spawn import run_ranks  # noqa: E402
from zerotron.data.tokenizer import vocab_size_with_padding  # noqa: E402
from zerotron.distributed import comm, ledger  # noqa: E402
from zerotron.distributed.state import initialize_model_parallel  # noqa: E402
from zerotron.distributed.topology import ProcessTopology  # noqa: E402
from zerotron.models.gpt import GPT, GPTConfig  # noqa: E402
from zerotron.models.gpt_stage import build_gpt_stages  # noqa: E402
from zerotron.parallel.tensor.sequence_parallel import sequence_parallel_params  # noqa: E402
from zerotron.pipeline import PipelineRuntime  # noqa: E402
from zerotron.tuning.estimate import Layout as PlanLayout  # noqa: E402
from zerotron.tuning.estimate import ModelShape  # noqa: E402
from zerotron.tuning.volume import Term, step_terms  # noqa: E402

try:  # data parallelism may be missing from an older checkout: fall back to one all-reduce
    from zerotron.parallel.data_parallel import DataParallel
except ImportError:  # pragma: no cover
    DataParallel = None

FP32 = 4


@dataclass(frozen=True)
class Layout:
    """One parallel layout: sizes, schedule, virtual stages, sequence parallelism."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    kind: str = "1f1b"
    v: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


LAYOUTS = {
    lay.name: lay
    for lay in (
        Layout("tp2", tp=2),
        Layout("tp2+sp", tp=2, sp=True),
        Layout("pp2", pp=2),
        Layout("pp2-interleaved", pp=2, kind="interleaved", v=2),
        Layout("pp4", pp=4),
        Layout("dp2", dp=2),
        Layout("dp2xtp2", dp=2, tp=2),
        Layout("tp2xpp2", tp=2, pp=2),
        Layout("tp2+spxpp2", tp=2, pp=2, sp=True),
        Layout("dp2xpp2", dp=2, pp=2),
        Layout("dp2xtp2xpp2", dp=2, tp=2, pp=2),
    )
}
QUICK = ("tp2", "tp2+sp", "pp2", "dp2")


@dataclass(frozen=True)
class Model:
    """The GPT's dimensions (what the closed form is written in)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    microbatches: int
    orig_vocab: int
    divisible_by: int

    def config(self, tp: int, sp: bool) -> GPTConfig:
        return GPTConfig(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            seq_length=self.seq,
            vocab_size=self.vocab(tp),
            orig_vocab_size=self.orig_vocab,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            sequence_parallel=sp,
        )

    def vocab(self, tp: int) -> int:
        return vocab_size_with_padding(self.orig_vocab, self.divisible_by, tp, log=False)


# ------------------------------------------------------------------------------------------
# What each rank runs


def _batches(model: Model, m: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    b, s = model.micro_batch, model.seq
    return [
        {
            "tokens": torch.randint(0, model.orig_vocab, (b, s), generator=g),
            "labels": torch.randint(0, model.orig_vocab, (b, s), generator=g),
            "position_ids": torch.arange(s).repeat(b, 1),
            "loss_mask": torch.ones(b, s),
        }
        for _ in range(m)
    ]


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    """Where a parameter's gradient is: DataParallel keeps it in ``main_grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _rank(rank: int, lay: Layout, model: Model) -> dict:
    st = initialize_model_parallel(lay.tp, lay.pp, lay.v if lay.v > 1 else None)
    torch.manual_seed(1234)  # the same full model on every rank; each keeps its part
    stages = build_gpt_stages(GPT(model.config(lay.tp, lay.sp)), st.pp_rank, lay.pp, lay.v)
    runtime = PipelineRuntime(stages, lay.kind, model.microbatches)
    params = [p for stage in stages for p in stage.parameters()]
    dp = None
    if st.dp_size > 1 and DataParallel is not None:
        dp = DataParallel(params, st.dp)
    batches = _batches(model, model.microbatches, seed=100 + st.dp_rank)
    # The first step exchanges the activations' shape headers; the steady state is measured.
    with dp.no_sync() if dp is not None else nullcontext():
        runtime.train_step(iter(batches))

    with ledger.capture() as cap:
        # Reduce once per step, after the last micro-batch (the pipeline runs them all inside
        # train_step, so accumulate first and launch every bucket at the end).
        with dp.no_sync() if dp is not None else nullcontext():
            runtime.train_step(iter(batches))
        if dp is not None:
            dp.finish_grad_sync()
        elif st.dp_size > 1:  # no DataParallel: one flat all-reduce of every gradient
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            comm.all_reduce(flat, st.dp, op="avg")
        # Sequence-parallel parameters: their gradients summed over TP, one flat all-reduce.
        sp_grads = [
            g
            for stage in stages
            for p in sequence_parallel_params(stage)
            if (g := _grad(p)) is not None
        ]
        if st.tp_size > 1 and sp_grads:
            comm.all_reduce(torch.cat([g.reshape(-1) for g in sp_grads]), st.tp)
        # Tied word embedding: first and last stage sum their copies' gradients.
        if st.embedding.is_member and st.embedding.size > 1:
            (holder,) = [s for s in stages if s.pre_process or s.post_process]
            comm.all_reduce(_grad(holder.word_embeddings_weight()), st.embedding)
    return {
        "coords": (st.tp_rank, st.dp_rank, st.pp_rank),
        "ledger": cap.summary(),
        "buckets": len(dp.buckets) if dp is not None else None,
    }


# ------------------------------------------------------------------------------------------
# Closed form


def theory(model: Model, lay: Layout, tp_rank: int, pp_rank: int) -> list[Term]:
    """Every ``(group, op)`` term of one step on the rank at (tp_rank, pp_rank): the closed form
    of :mod:`zerotron.tuning.volume` (the planner's cost model uses the same), fp32."""
    del tp_rank  # every TP rank moves the same bytes
    shape = ModelShape(
        num_layers=model.layers,
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        seq_length=model.seq,
        vocab_size=model.orig_vocab,
        make_vocab_size_divisible_by=model.divisible_by,
    )
    layout = PlanLayout(
        tp=lay.tp,
        pp=lay.pp,
        dp=lay.dp,
        vpp=lay.v,
        sequence_parallel=lay.sp,
        micro_batch_size=model.micro_batch,
        num_microbatches=model.microbatches,
        precision="fp32",
    )
    return step_terms(shape, layout, pp_rank)


def _sum(terms: list[Term]) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for t in terms:
        nbytes, calls = out.get((t.group, t.op), (0, 0))
        out[t.group, t.op] = (nbytes + t.nbytes, calls + t.calls)
    return out


# ------------------------------------------------------------------------------------------
# Report


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def run_layout(lay: Layout, model: Model, timeout: float) -> dict:
    """Run one step of ``lay``; measured and theoretical ledgers per rank."""
    t0 = time.perf_counter()
    results = run_ranks(_rank, lay.world, lay, model, timeout=timeout)
    elapsed = time.perf_counter() - t0
    per_rank = []
    for rank, r in enumerate(results):
        tp_rank, dp_rank, pp_rank = r["coords"]
        topo = ProcessTopology(tp=lay.tp, dp=lay.dp, pp=lay.pp)
        assert topo.rank(tp=tp_rank, dp=dp_rank, pp=pp_rank) == rank
        terms = theory(model, lay, tp_rank, pp_rank)
        if lay.dp > 1 and r["buckets"] is not None and r["buckets"] != 1:
            # more than one bucket: the same bytes in more calls
            terms = [
                Term(t.group, t.op, t.nbytes, r["buckets"], t.what, t.main)
                if t.group == "dp"
                else t
                for t in terms
            ]
        per_rank.append({"measured": r["ledger"], "theory": _sum(terms), "terms": terms})
    return {"layout": lay, "ranks": per_rank, "seconds": elapsed}


def summarize(res: dict) -> dict:
    ranks = res["ranks"]
    measured = sum(b for r in ranks for b, _ in r["measured"].values())
    want = sum(b for r in ranks for b, _ in r["theory"].values())
    main = sum(t.nbytes for r in ranks for t in r["terms"] if t.main)
    exact = sum(r["measured"] == r["theory"] for r in ranks)
    extras: dict[str, int] = {}
    for r in ranks:
        for t in r["terms"]:
            if not t.main:
                extras[t.what] = extras.get(t.what, 0) + t.nbytes
    return {
        "measured": measured,
        "theory": want,
        "main": main,
        "exact": exact,
        "extras": extras,
    }


def print_table(results: list[dict], model: Model) -> None:
    print(
        f"GPT: {model.layers} layers, hidden {model.hidden}, {model.heads} heads, seq "
        f"{model.seq}, micro-batch {model.micro_batch}, {model.microbatches} micro-batches, "
        f"vocab {model.orig_vocab} (padded per TP), fp32; a = b·s·h·4 = "
        f"{_fmt_bytes(model.micro_batch * model.seq * model.hidden * FP32)}"
    )
    print("bytes per training step, summed over ranks (ledger: logical op sizes, see comm.py)\n")
    head = (
        f"{'layout':<17}{'ranks':>5}  {'measured':>13}  {'theory':>13}  {'ratio':>6}  "
        f"{'exact ranks':>11}  {'headline':>13}  {'meas/headline':>13}  extra terms"
    )
    print(head)
    print("-" * (len(head) + 30))
    for res in results:
        lay, s = res["layout"], summarize(res)
        ratio = s["measured"] / s["theory"] if s["theory"] else float("nan")
        extra = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in s["extras"].items()) or "-"
        print(
            f"{lay.name:<17}{lay.world:>5}  {_fmt_bytes(s['measured']):>13}  "
            f"{_fmt_bytes(s['theory']):>13}  {ratio:>6.3f}  "
            f"{s['exact']:>5}/{lay.world:<5}  {_fmt_bytes(s['main']):>13}  "
            f"{s['measured'] / s['main'] if s['main'] else math.nan:>13.3f}  {extra}"
        )


def print_detail(results: list[dict]) -> None:
    print("\nper (group, op): bytes / calls on each rank, measured vs theory")
    head = f"{'layout':<17}{'group/op':<24}{'measured per rank (bytes/calls)':<58}{'ratio':>7}"
    print(head)
    print("-" * len(head))
    for res in results:
        ranks = res["ranks"]
        keys = sorted({k for r in ranks for k in (*r["measured"], *r["theory"])})
        for key in keys:
            got = [r["measured"].get(key, (0, 0)) for r in ranks]
            want = [r["theory"].get(key, (0, 0)) for r in ranks]
            cells = " ".join(f"{b}/{c}" for b, c in got)
            tot_got, tot_want = sum(b for b, _ in got), sum(b for b, _ in want)
            ratio = tot_got / tot_want if tot_want else math.inf
            flag = "" if got == want else "  theory " + " ".join(f"{b}/{c}" for b, c in want)
            print(f"{res['layout'].name:<17}{'/'.join(key):<24}{cells:<58}{ratio:>7.3f}{flag}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layouts",
        default=None,
        help=f"comma-separated, from {', '.join(LAYOUTS)} (default: all; --quick: "
        f"{', '.join(QUICK)})",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (m)")
    p.add_argument("--vocab", type=int, default=1000, help="tokenizer vocabulary (padded per TP)")
    p.add_argument("--divisible-by", type=int, default=128, help="vocabulary padding unit")
    p.add_argument("--quick", action="store_true", help="tiny model, four layouts")
    p.add_argument("--detail", action="store_true", help="also print every (group, op) per rank")
    p.add_argument("--timeout", type=float, default=120, help="seconds per layout")
    args = p.parse_args(argv)

    if args.quick:
        args.layers, args.hidden, args.seq, args.microbatches = 4, 64, 16, 2
    names = args.layouts.split(",") if args.layouts else list(QUICK if args.quick else LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    model = Model(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        micro_batch=args.micro_batch,
        microbatches=args.microbatches,
        orig_vocab=args.vocab,
        divisible_by=args.divisible_by,
    )
    for name in names:
        lay = LAYOUTS[name]
        if model.layers % (lay.pp * lay.v) or (lay.sp and model.seq % lay.tp):
            p.error(f"{name}: layers must divide by pp·v and seq by tp")
    if DataParallel is None:
        print("note: zerotron.parallel.data_parallel missing; DP is one flat all-reduce here")

    results = []
    t0 = time.perf_counter()
    for name in names:
        results.append(run_layout(LAYOUTS[name], model, args.timeout))
    print_table(results, model)
    if args.detail:
        print_detail(results)
    print(f"\n{len(names)} layouts in {time.perf_counter() - t0:.1f} s on {os.cpu_count()} cores")
    bad = [r["layout"].name for r in results if summarize(r)["exact"] != r["layout"].world]
    if bad:
        print(f"MISMATCH against the closed form: {', '.join(bad)} (run with --detail)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
