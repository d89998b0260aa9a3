"""init_distributed registers one atexit teardown of the process group it created."""

from __future__ import annotations

import atexit

from zerotron.distributed import init

from .spawn import run_ranks


def _rank(rank: int) -> dict:
    # run_ranks already called init_distributed: the teardown is registered, and a second call
    # (the group exists) registers nothing more.
    registered = init._teardown_registered
    calls = []
    real = atexit.register
    atexit.register = lambda fn, *a, **k: calls.append(fn)
    try:
        init.init_distributed(backend="gloo")
    finally:
        atexit.register = real
    before = init.is_initialized()
    init._destroy_at_exit()
    init._destroy_at_exit()  # idempotent: nothing left to destroy
    return {"registered": registered, "calls": calls, "before": before,
            "after": init.is_initialized()}  # fmt: skip


def test_teardown_registered_once_and_destroys_the_group():
    for r in run_ranks(_rank, 2):
        assert r == {"registered": True, "calls": [], "before": True, "after": False}


def test_single_process_registers_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(init, "_teardown_registered", False)
    assert init.init_distributed(backend="gloo") == (0, 1)
    assert init._teardown_registered is False
