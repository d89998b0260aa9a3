"""Megatron's RNG tracker: named random streams that a ``with fork():`` block switches to.

Tensor-parallel ranks must draw the *same* numbers where they hold the same data (dropout on
the replicated residual stream) and *different* numbers where they hold different shards
(dropout on a column-parallel activation: each rank's shard is a different slice of the full
tensor). So there are two streams:

- the default stream (torch's global generators), seeded identically on every TP rank;
- the model-parallel stream ``"model-parallel-rng"``, seeded ``seed + 2718 + tp_rank`` and
  used inside ``with get_rng_tracker().fork():`` around dropout in TP regions.

:func:`model_parallel_seed` sets both up (Megatron's ``model_parallel_cuda_manual_seed``).
A stream is the state of torch's CPU generator and, when CUDA is in use, of the current CUDA
device's generator; ``fork`` swaps both in and out, so the same code draws reproducibly on CPU
and GPU. :meth:`RNGStatesTracker.get_states` returns plain uint8 tensors: checkpoints store
them and load them back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from zerotron.distributed.state import state
from zerotron.errors import DistributedError

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718

StreamState = dict[str, torch.Tensor]  # {"cpu": ...[, "cuda": ...]}


def _cuda_in_use() -> bool:
    # A CPU run on a GPU machine must not initialize CUDA just to track its generator.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _current_state() -> StreamState:
    s = {"cpu": torch.get_rng_state()}
    if _cuda_in_use():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def _set_current_state(s: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(s["cpu"])
    if "cuda" in s and _cuda_in_use():
        torch.cuda.set_rng_state(s["cuda"])


def _seeded_state(seed: int) -> StreamState:
    """The state the generators would have after ``torch.manual_seed(seed)``, without touching
    them."""
    s = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if _cuda_in_use():
        s["cuda"] = _seeded_cuda_state(seed)
    return s


def _seeded_cuda_state(seed: int) -> torch.Tensor:
    return torch.Generator(device="cuda").manual_seed(seed).get_state()


class RNGStatesTracker:
    """Named random streams, each with its own seed; :meth:`fork` draws from one."""

    def __init__(self) -> None:
        self._states: dict[str, StreamState] = {}
        self._seeds: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; the current generators are untouched."""
        if name in self._states:
            raise DistributedError(
                f"RNG stream {name!r} already exists", fix="call reset() first, or pick a new name"
            )
        if seed in self._seeds.values():
            raise DistributedError(
                f"seed {seed} is already used by another RNG stream",
                fix="give each stream its own seed (equal seeds would draw equal numbers)",
            )
        self._states[name] = _seeded_state(seed)
        self._seeds[name] = seed

    def get_states(self) -> dict[str, StreamState]:
        """A copy of every stream's state (tensors only: weights_only-loadable)."""
        return {name: {k: t.clone() for k, t in s.items()} for name, s in self._states.items()}

    def set_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the streams with ``states`` from :meth:`get_states`."""
        for name, s in states.items():
            if not isinstance(s, Mapping) or "cpu" not in s:
                raise DistributedError(
                    f"RNG stream {name!r} has no 'cpu' state",
                    where="RNG tracker state",
                    fix="pass what get_states() returned",
                )
        self._states = {name: {k: t.clone() for k, t in s.items()} for name, s in states.items()}

    def names(self) -> list[str]:
        return list(self._states)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream resumes after it.

        The stream advances by what the block drew, so the next fork continues where this one
        stopped.
        """
        if name not in self._states:
            raise DistributedError(
                f"RNG stream {name!r} is not set up",
                where="RNGStatesTracker.fork",
                fix="call model_parallel_seed(seed) (or add(name, seed)) first",
            )
        stream = self._states[name]
        if "cuda" not in stream and _cuda_in_use():
            # Created before CUDA was used: start its CUDA generator from the stream's seed.
            if name not in self._seeds:
                raise DistributedError(
                    f"RNG stream {name!r} has no CUDA state (it was saved by a CPU run)",
                    where="RNGStatesTracker.fork",
                    fix="seed the stream again with model_parallel_seed(seed)",
                )
            stream["cuda"] = _seeded_cuda_state(self._seeds[name])
        outside = _current_state()
        _set_current_state(stream)
        try:
            yield
        finally:
            self._states[name] = _current_state()
            _set_current_state(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` (equal on all TP ranks) and the model-parallel
    stream with ``seed + 2718 + tp_rank`` (different on each TP rank).

    Call it after :func:`~zerotron.distributed.state.initialize_model_parallel`. Callers that
    want different streams per pipeline stage (Megatron adds ``100 * pp_rank``) pass that in
    ``seed``.
    """
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + state().tp_rank)


model_parallel_cuda_manual_seed = model_parallel_seed
