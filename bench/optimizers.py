"""CPU optimizer step time: zerotron's DeepSpeedCPUAdam against torch's fused AdamW and, when it
builds, DeepSpeed's own DeepSpeedCPUAdam (its JIT-compiled AVX C++ op), side by side;
``--optimizer lion`` / ``adagrad`` compare DeepSpeedCPULion / DeepSpeedCPUAdagrad the same way
(torch has no peer with their math; Lion also runs on zerotron's foreach path, beside its
compiled kernel).

A GPT-2 124M parameter set (fp32 tensors of GPT-2 small's shapes, 124.4M elements) with one
fixed random gradient set shared by every side; each side has its own parameters and state,
all from the same start. Every round steps each side once, in turn (the first one rotating), so
that machine load and cache state hit all alike; after a warm-up the median over ``--rounds``
is printed per side with the ratios. Then the sides' parameters are compared (same start, same
gradients, same number of steps): the largest difference, also relative to the largest change
the steps made, says whether they computed the same math.

    python bench/optimizers.py [--optimizer adam|lion|adagrad] [--threads N] [--rounds 11]
                               [--clock wall|cpu] [--quick]

DeepSpeed's side needs a real ``deepspeed`` importable next to zerotron, e.g.
``PYTHONPATH=$PWD /work/benchvenv/bin/python bench/optimizers.py``; without one (or if its op
fails to build) that side is reported as missing and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time


def gpt2_shapes(layers: int, h: int, vocab: int, positions: int) -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (tied output layer: the embedding counted once)."""
    shapes: list[tuple[int, ...]] = [(vocab, h), (positions, h)]
    for _ in range(layers):
        shapes += [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,)]  # ln_1, attn c_attn, c_proj
        shapes += [(h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]  # ln_2, mlp c_fc, c_proj
    return [*shapes, (h,), (h,)]  # ln_f


class ForeachLion:
    """zerotron's Lion stepped on its foreach path (``ZEROTRON_COMPILED_LION=0`` while it steps)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        os.environ["ZEROTRON_COMPILED_LION"] = "0"
        try:
            self.optimizer.step()
        finally:
            del os.environ["ZEROTRON_COMPILED_LION"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", choices=("adam", "lion", "adagrad"), default="adam")
    p.add_argument("--threads", type=int, default=None, help="default: torch's default")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (all its threads), steadier on a shared machine",
    )
    p.add_argument("--quick", action="store_true", help="a 2-layer, hidden-64 model, 2 rounds")
    args = p.parse_args()
    if args.threads:  # before torch loads: DeepSpeed's op has its own OpenMP runtime
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from zerotron import ops

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        shapes, args.rounds, args.warmup = gpt2_shapes(2, 64, 512, 64), 2, 1
    else:
        shapes = gpt2_shapes(12, 768, 50257, 1024)
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    numel = sum(t.numel() for t in start)

    # per optimizer: DeepSpeed's module and class, hyper-parameters, torch's peer (if any)
    module, cls_name, hyper, peer = {
        "adam": (
            "adam",
            "DeepSpeedCPUAdam",
            dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
            ("torch AdamW(fused=True)", lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw)),
        ),
        "lion": (
            "lion",
            "DeepSpeedCPULion",
            dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01),
            None,
        ),
        "adagrad": ("adagrad", "DeepSpeedCPUAdagrad", dict(lr=1e-2, eps=1e-10), None),
    }[args.optimizer]
    ours_cls = getattr(getattr(ops, module), cls_name)
    ours = f"zerotron {cls_name}"
    sides = {ours: lambda ps: ours_cls(ps, **hyper)}
    if args.optimizer == "lion":  # its other CPU path, for the record of what compiling gains
        sides[f"{ours} (foreach)"] = lambda ps: ForeachLion(ours_cls(ps, **hyper))
    if peer is not None:
        sides[peer[0]] = lambda ps: peer[1](ps, **hyper)
    missing = ""
    try:
        real_cls = getattr(importlib.import_module(f"deepspeed.ops.{module}"), cls_name)
        if real_cls is ours_cls:  # `deepspeed` is zerotron here (--as-deepspeed)
            raise ImportError("deepspeed is zerotron in this interpreter")
        t0 = time.perf_counter()
        real_cls([torch.zeros(1, requires_grad=True)])  # JIT-builds the op on first use
        print(f"DeepSpeed's cpu_{module} op ready in {time.perf_counter() - t0:.1f} s")
        sides[f"DeepSpeed {cls_name}"] = lambda ps: real_cls(ps, **hyper)
    except Exception as e:  # noqa: BLE001 (any failure to build or load: report, go on)
        missing = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    params, optims = {}, {}
    for name, make in sides.items():
        params[name] = [t.clone().requires_grad_() for t in start]
        for q, gr in zip(params[name], grads):
            q.grad = gr
        optims[name] = make(params[name])

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(optims)
    for r in range(args.warmup + args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            opt = optims[name]
            t0 = clock()
            opt.step()
            if r >= args.warmup:
                times[name].append(clock() - t0)

    print(
        f"{numel / 1e6:.1f}M fp32 parameters in {len(shapes)} tensors, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"median of {args.rounds} steps after {args.warmup} warm-up, {args.clock} clock"
    )
    base = statistics.median(times[ours])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:28s} {med * 1e3:9.1f} ms/step  {numel / med / 1e9:6.2f} Gparam/s  "
            f"time / zerotron's = {med / base:5.2f}x"
        )
    if missing:
        print(f"  DeepSpeed {cls_name} missing ({missing})")
    p0 = torch.cat([t.reshape(-1) for t in start])
    ref = torch.cat([q.detach().reshape(-1) for q in params[ours]])
    moved = (ref - p0).abs().max().item()
    for name in sides:
        if name != ours:
            other = torch.cat([q.detach().reshape(-1) for q in params[name]])
            worst = (other - ref).abs().max().item()
            print(
                f"  after {args.warmup + args.rounds} steps, max |{name} - zerotron| = {worst:.2e}"
                f" ({worst / moved:.1e} of the largest change the steps made)"
            )


if __name__ == "__main__":
    main()
