"""Global gradient norm: zerotron's fp32-rows-in-fp64 norm against torch's fp32 one, side by side.

A GPT-2 shaped gradient set (default: 6 layers, hidden 384, vocabulary 50304: 30.4M parameters,
the embedding 19.3M of them), random N(0, 1e-3) values. For each method: the median time of
``--rounds`` calls (interleaved, after a warm-up) and the relative error against the exact
norm (fp64 throughout); the ratio of times is printed last.

    python bench/grad_norm.py [--layers 6 --hidden 384 --vocab 50304 --threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zerotron.precision.grads import clip_grad_norm_, get_grad_norm  # noqa: E402


def gpt2_grads(layers: int, h: int, vocab: int, positions: int = 1024) -> list[torch.Tensor]:
    """One random gradient per GPT-2 parameter (Megatron's shapes)."""
    shapes = [(vocab, h), (positions, h)]
    for _ in range(layers):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,)]  # ln, qkv, dense
        shapes += [(h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]  # ln, mlp
    shapes += [(h,), (h,)]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) * 1e-3 for s in shapes]


def torch_fp32_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """What torch.nn.utils.clip_grad_norm_ computes (and zerotron did before): fp32 throughout."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true", help="tiny model, one round: checks it runs")
    args = p.parse_args()
    if args.quick:
        args.layers, args.hidden, args.vocab, args.rounds = 1, 64, 1000, 1
    torch.set_num_threads(args.threads)
    grads = gpt2_grads(args.layers, args.hidden, args.vocab)
    exact = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
    methods = {
        "torch fp32 (_foreach_norm)": lambda: torch_fp32_norm(grads),
        "zerotron (fp32 rows, fp64 sum)": lambda: get_grad_norm(grads),
        "zerotron norm + clip": lambda: clip_grad_norm_(grads, 1e9),  # norm, no scaling
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    values = {name: float(fn()) for name, fn in methods.items()}  # warm-up
    for _ in range(args.rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    n = sum(g.numel() for g in grads)
    print(f"{n / 1e6:.1f}M parameters in {len(grads)} tensors, {args.threads} thread(s)")
    median = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    for name in methods:
        err = abs(values[name] - exact) / exact
        print(f"  {name:32s} {median[name]:7.2f} ms   relative error {err:.1e}")
    names = list(methods)
    print(f"time ratio zerotron / torch fp32: {median[names[1]] / median[names[0]]:.2f}")


if __name__ == "__main__":
    main()
