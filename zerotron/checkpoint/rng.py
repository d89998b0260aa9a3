"""Capture and restore every random number generator a training run draws from.

Exact resume needs the same dropout masks and data shuffles after a restart, so a checkpoint
carries the state of Python's ``random``, NumPy's global generator, torch's CPU generator and
(when CUDA is in use) one CUDA generator per device. The captured state holds only tensors and
primitives, so it loads with ``torch.load(weights_only=True)``.

Other generators (the tensor-parallel RNG tracker of the 3D-parallelism issue) ride along as extra
entries: pass them to :func:`get_rng_state` and take them back from what :func:`set_rng_state`
returns.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from zerotron.errors import CheckpointError

KNOWN_KEYS = ("python", "numpy", "torch", "cuda")


def _numpy_state() -> dict[str, Any]:
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    # The key is a uint32 ndarray, which weights_only loading refuses: keep it as an int64 tensor.
    return {
        "bit_generator": str(name),
        "key": torch.from_numpy(key.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(s: Mapping[str, Any]) -> None:
    key = s["key"].numpy().astype(np.uint32)
    np.random.set_state(
        (s["bit_generator"], key, int(s["pos"]), int(s["has_gauss"]), float(s["cached_gaussian"]))
    )


def _cuda_in_use() -> bool:
    # A CPU run on a GPU machine never touched CUDA: do not initialize it just to save its state.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def get_rng_state(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The states of all generators: ``{python, numpy, torch[, cuda]}`` plus ``extra`` entries.

    ``cuda`` (a list with one state per device) is present only when this process uses CUDA.
    ``extra`` entries must be weights_only-safe too and must not reuse the names above.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state_all()
    for name, value in (extra or {}).items():
        if name in KNOWN_KEYS:
            raise ValueError(f"extra RNG state {name!r} would overwrite a built-in generator")
        state[name] = value
    return state


def set_rng_state(state: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """Restore the generators captured by :func:`get_rng_state`; return the extra entries.

    A generator absent from ``state`` keeps its current state. CUDA states are restored for as
    many devices as both the checkpoint and this machine have; on a machine without CUDA they
    are ignored (resuming a GPU run on a CPU cannot reproduce its GPU random streams anyway).
    """
    try:
        if "python" in state:
            version, internal, gauss_next = state["python"]
            random.setstate((version, tuple(internal), gauss_next))
        if "numpy" in state:
            _set_numpy_state(state["numpy"])
        if "torch" in state:
            torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.to("cpu", torch.uint8), device)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"the RNG states in the checkpoint are malformed ({type(e).__name__}: {e})",
            where=where or None,
            fix="resume without restoring RNG states (--no-load-rng); the run will not repeat "
            "the original random numbers exactly",
        ) from e
    return {k: v for k, v in state.items() if k not in KNOWN_KEYS}
