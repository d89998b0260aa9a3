"""Run a function on N gloo ranks from a test: ``run_ranks(fn, 4, arg) -> [result of rank 0, ...]``.

Each rank is a fresh process (forkserver start: the server imports torch once, every rank is a
cheap fork of it, and no rank inherits pytest's threads). A rank gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one torch thread, and
``init_distributed(backend="gloo")``; then it calls ``fn(rank, *args, **kwargs)`` and sends the
result (anything picklable, tensors included) back to the test.

The rendezvous store lives in the test process, as torchrun's agent hosts it, so no port has to
be guessed and a rank that dies takes no store down with it.

Failures never hang the test: the first rank to raise (or die) fails the call with a
:class:`RankError` carrying its rank and traceback, and every other rank is killed; ranks still
running after ``timeout`` seconds are killed and reported as a :class:`RankTimeout`. Collectives
inside the ranks time out a little earlier, so a hang usually surfaces as the rank's own error.

``fn`` must be a module-level function of an importable module (a test module is fine), since
ranks import it by name. Use ``from tests.distributed.spawn import run_ranks`` (``python -m
pytest`` from the repository root puts it on ``sys.path``) or, inside ``tests/distributed``,
``from .spawn import run_ranks``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

# What the fork server imports once, so that each rank starts in milliseconds.
_PRELOAD = ["torch", "torch.distributed", "zerotron.distributed", "zerotron.training.build"]
_GRACE_S = 1.0  # after the first failure, how long to collect other ranks' reports


class RankError(RuntimeError):
    """A rank raised or died; ``rank`` is the first one that did, ``details`` its traceback."""

    def __init__(self, rank: int, details: str, others: dict[int, str] | None = None):
        self.rank = rank
        self.details = details
        self.others = others or {}
        msg = f"rank {rank} failed:\n{details}"
        if self.others:
            summary = "; ".join(f"rank {r}: {s}" for r, s in sorted(self.others.items()))
            msg += f"\n(also failed after it: {summary})"
        super().__init__(msg)


class RankTimeout(RankError, TimeoutError):
    """Ranks were still running when the timeout expired (all were killed)."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    collective_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    ``collective_timeout`` (seconds, default 0.8 × ``timeout``) bounds each collective's wait.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # The store every rank rendezvouses through, hosted here (port 0: the OS picks a free one).
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, True, timedelta(seconds=timeout), wait_for_workers=False
    )
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # connect to our store, as under torchrun
        "OMP_NUM_THREADS": "1",
    }
    if collective_timeout is None:
        collective_timeout = max(timeout * 0.8, 1.0)
    collective_timeout_min = collective_timeout / 60
    procs, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(rank, env, collective_timeout_min, writer, fn, args, kwargs),
                name=f"rank{rank}",
                daemon=True,
            )
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        return _collect(procs, readers, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        for r in readers:
            r.close()
        del store


def _collect(procs: list, readers: list[Connection], timeout: float) -> list[Any]:
    """Wait for one report per rank; raise on the first failure or at the deadline."""
    n = len(procs)
    results: dict[int, Any] = {}
    # rank -> (died without a report, monotonic time, traceback or note)
    failures: dict[int, tuple[bool, float, str]] = {}
    pending = {readers[r]: r for r in range(n)}
    sentinels = {procs[r].sentinel: r for r in range(n)}
    deadline = time.monotonic() + timeout
    while pending:
        now = time.monotonic()
        if failures:
            deadline = min(deadline, min(t for _, t, _ in failures.values()) + _GRACE_S)
        if now >= deadline:
            break
        ready = wait([*pending, *sentinels], timeout=deadline - now)
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                sentinels.pop(procs[rank].sentinel, None)
                try:
                    status, payload, stamp = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    procs[rank].join(timeout=1)
                    status, payload, stamp = "died", _death_note(procs[rank]), time.monotonic()
                if status == "ok":
                    results[rank] = payload
                else:
                    failures[rank] = (status == "died", stamp, payload)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                # Exited: its report, if any, is in the pipe (read next round); none means death.
                reader = readers[rank]
                if reader in pending and not reader.poll():
                    pending.pop(reader)
                    procs[rank].join(timeout=1)
                    failures[rank] = (True, time.monotonic(), _death_note(procs[rank]))
    if failures:
        # A rank that died without a word (crash, os._exit, OOM kill) is the likely cause of
        # its peers' connection errors; otherwise the earliest exception is.
        first = min(failures, key=lambda r: (not failures[r][0], failures[r][1]))
        others = {r: _last_line(f[2]) for r, f in failures.items() if r != first}
        raise RankError(first, failures[first][2], others)
    if pending:
        missing = sorted(pending.values())
        raise RankTimeout(
            missing[0],
            f"ranks {missing} did not finish within {timeout:g} s (all ranks were killed); "
            f"ranks {sorted(results)} finished",
        )
    return [results[r] for r in range(n)]


def _rank_main(
    rank: int,
    env: dict[str, str],
    timeout_minutes: float,
    conn: Connection,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from zerotron.distributed import destroy, init_distributed

    try:
        init_distributed(backend="gloo", timeout_minutes=timeout_minutes, device="cpu")
        result = fn(rank, *args, **kwargs)
        message = ("ok", result, time.monotonic())
        data = pickle.dumps(message)  # plain pickle: tensors travel as bytes, not shared memory
        if dist.is_initialized():
            dist.barrier()  # nobody tears down while a peer may still talk to it
        destroy()
    except BaseException:
        data = pickle.dumps(("error", traceback.format_exc(), time.monotonic()))
    conn.send_bytes(data)
    conn.close()


def _death_note(p: Any) -> str:
    return f"process exited with code {p.exitcode} without reporting (killed or crashed)"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
