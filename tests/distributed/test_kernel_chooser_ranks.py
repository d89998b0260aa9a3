"""The kernel chooser in a job of several processes (zerotron.kernels.chooser, ``group=``): rank
0 decides, from its cache or by measuring alone, and every rank takes its choice; the others
neither measure nor read or write their own caches. Fake candidates and clocks as in
tests/test_kernel_chooser.py, one private cache directory per rank."""

import dataclasses
import json
import os

import pytest

from zerotron.distributed import comm
from zerotron.errors import ConfigError
from zerotron.kernels import chooser
from zerotron.kernels.chooser import KernelShape, choose_kernels
from zerotron.kernels.policy import current_choices

from .spawn import run_ranks

SHAPE = KernelShape(hidden=64, heads=4, seq=32, micro_batch=2, vocab=100, dtype="fp32", threads=1)
# per rank, the seconds each linear candidate takes on its fake clock: the ranks disagree
COSTS = [{"onednn": 3, "torch": 2}, {"onednn": 1, "torch": 5}]


def _choose(rank, cache_root, cached=None, forced=None):
    """Rank ``rank`` with its own cache (pre-filled with the choices ``cached[rank]``),
    choosing for the job; returns what it chose, how, its fake calls and its cache file."""
    for env in (chooser.ENV, "ZEROTRON_ONEDNN", "ZEROTRON_MATH_ATTENTION", "ZEROTRON_FUSED_LOSS"):
        os.environ.pop(env, None)
    os.environ[chooser.CACHE_ENV] = os.path.join(cache_root, f"rank{rank}")
    if cached is not None:
        key = chooser._entry_key(SHAPE)
        timed = {n: {str(c): 1.0 for c in chooser.CANDIDATES[n]} for n in cached[rank]}
        entry = {"choices": cached[rank], "timings_ms": timed}
        chooser._write_cache(chooser.cache_path(), key, entry)
    calls = []
    now = [0.0]

    def runners(name, shape):
        def run(candidate):
            def call():
                calls.append(candidate)
                now[0] += COSTS[rank][candidate]

            return call

        return {c: run(c) for c in chooser.CANDIDATES[name]}

    chosen = choose_kernels(
        SHAPE, "cpu", forced, group=comm.world_group(), runners=runners, clock=lambda: now[0]
    )
    path = chooser.cache_path()
    return {
        "choices": dataclasses.asdict(current_choices()),
        "how": chosen.how,
        "line": chosen.line(),
        "calls": calls,
        "cache": json.loads(path.read_text()) if path.exists() else None,
    }


def test_rank_0_measures_alone_and_every_rank_takes_its_choice(tmp_path):
    first, second = run_ranks(_choose, 2, str(tmp_path))
    assert first["choices"]["linear"] == "torch"  # rank 0's winner, not rank 1's
    assert second["choices"] == first["choices"]
    assert first["how"]["linear"] == second["how"]["linear"] == "measured"
    assert first["line"] == second["line"]
    assert set(first["calls"]) == {"onednn", "torch"}
    assert second["calls"] == []
    (entry,) = first["cache"]["entries"].values()
    assert entry["choices"] == {"linear": "torch"}
    assert second["cache"] is None


def test_a_cached_rank_0_decides_for_ranks_with_other_caches(tmp_path):
    cached = [{"linear": "onednn", "loss_chunk": 4096}, {"linear": "torch"}]
    first, second = run_ranks(_choose, 2, str(tmp_path), cached=cached)
    assert first["choices"]["linear"] == "onednn"
    assert first["choices"]["loss_chunk"] == 4096
    assert second["choices"] == first["choices"]
    expected = {"linear": "cached", "matmul16": "n/a", "attention": "n/a", "loss_chunk": "cached"}
    assert first["how"] == second["how"] == expected
    assert first["calls"] == second["calls"] == []


def _bad_spec(rank, cache_root):
    with pytest.raises(ConfigError, match="unknown candidate"):
        _choose(rank, cache_root, forced="linear=mkl")
    return True


def test_a_bad_spec_stops_every_rank_without_a_collective(tmp_path):
    assert run_ranks(_bad_spec, 2, str(tmp_path), timeout=60) == [True, True]


def _pretrain_tp2(rank, data, cache_root):
    """``zerotron pretrain`` at tensor-parallel size 2, measuring (nothing forced), building
    only; returns the keys of this rank's cache (None: it wrote none)."""
    import contextlib
    import io

    from .test_pretrain_parallel import _pretrain

    os.environ.pop(chooser.ENV, None)
    os.environ[chooser.CACHE_ENV] = os.path.join(cache_root, f"rank{rank}")
    with contextlib.redirect_stdout(io.StringIO()):
        _pretrain(2, data, "--tensor-model-parallel-size", 2, "--train-iters", 0)
    path = chooser.cache_path()
    return sorted(json.loads(path.read_text())["entries"]) if path.exists() else None


def test_pretrain_measures_one_tensor_parallel_ranks_shards(data_prefix, tmp_path):
    first, second = run_ranks(_pretrain_tp2, 2, data_prefix, str(tmp_path), timeout=120)
    (key,) = first
    assert key.endswith(" fp32 h64 a4 s~16 t~32 v~32768 threads1 tp2")
    assert second is None
