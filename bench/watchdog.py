"""What the collective watchdog costs a collective: zerotron's comm.all_reduce with the
watchdog's marks against the same calls with them switched off, side by side.

Two gloo ranks (one thread each) all-reduce a small tensor (``--numel`` fp32 elements, default
4: the cheapest collective, where a fixed cost per call shows most) ``--calls`` times per
round, alternating rounds with the marks on (:func:`zerotron.distributed.watchdog.enter` /
``leave`` around each wait, as comm does) and off (both replaced by no-ops). Rank 0 prints the
median time per call of each and the difference; it also times an ``enter``/``leave`` pair
alone in a tight loop.

    python bench/watchdog.py [--calls 2000 --rounds 7 --numel 4] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import cpu_model  # noqa: E402
from zerotron.distributed import comm, init_distributed, watchdog  # noqa: E402


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    init_distributed(backend="gloo", device="cpu")
    group = comm.world_group()
    x = torch.ones(args.numel)
    real = (watchdog.enter, watchdog.leave)
    off = (lambda call: None, lambda wait: None)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * args.rounds + 2):
        which = "on" if i % 2 == 0 else "off"
        watchdog.enter, watchdog.leave = real if which == "on" else off
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            comm.all_reduce(x, group)
        if i >= 2:  # the first two rounds warm up
            times[which].append((time.perf_counter() - start) / args.calls)
    watchdog.enter, watchdog.leave = real
    if rank == 0:
        on, off_ = statistics.median(times["on"]), statistics.median(times["off"])
        call = comm.Call(group, "all_reduce", 1, None, 16)
        n = 20000 if args.quick else 200000
        pair = timeit.timeit(lambda: watchdog.leave(watchdog.enter(call)), number=n) / n
        print(f"CPU: {cpu_model()}; all_reduce of {args.numel} fp32 on 2 gloo ranks, "
              f"{args.calls} calls x {args.rounds} rounds")  # fmt: skip
        print(f"  watchdog marks on : {on * 1e6:8.2f} us per call")
        print(f"  watchdog marks off: {off_ * 1e6:8.2f} us per call")
        print(f"  difference        : {(on - off_) * 1e6:8.2f} us ({(on / off_ - 1) * 100:+.1f}%)")
        print(f"  enter+leave alone : {pair * 1e6:8.3f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--numel", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.calls, args.rounds = 100, 1
    with __import__("socket").socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
