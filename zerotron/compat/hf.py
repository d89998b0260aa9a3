"""Hugging Face accelerate on hosts without an accelerator device, under ``--as-deepspeed``.

accelerate (up to at least 1.15) picks its process-group backend from the devices it knows
(CUDA, XPU, NPU, ...). On a CPU-only host with DeepSpeed enabled it finds none, so it sets up
DeepSpeed's communication yet records "no distributed training": one process, whatever the
world size, and Trainer's "auto" batch sizes come out wrong (DeepSpeed would refuse them too).
With ``use_cpu`` it keeps the processes but turns DeepSpeed off. zerotron runs ZeRO on CPU, so
under the alias :func:`install` teaches accelerate the CPU case: when no device is found and the
launcher started several ranks with DeepSpeed requested, the backend is gloo on the CPU, as
accelerate already does for its own multi-CPU runs. Nothing changes where a device exists or
outside ``python -m zerotron.compat.as_deepspeed`` / ``zerotron launch --as-deepspeed``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

PATCHED_MODULE = "accelerate.state"


def _cpu_backend(original: Any) -> Any:
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        wants_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
        if found is None and not cpu and wants_deepspeed and launched:
            return "gloo", type(kind).MULTI_CPU  # kind is accelerate's DistributedType
        return found, kind

    _prepare_backend.__wrapped__ = original  # type: ignore[attr-defined]
    return _prepare_backend


def patch_accelerate_state(module: ModuleType) -> None:
    """Give ``accelerate.state.PartialState`` the CPU backend for DeepSpeed runs (once)."""
    state = module.PartialState
    if not hasattr(state._prepare_backend, "__wrapped__"):
        state._prepare_backend = _cpu_backend(state._prepare_backend)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        patch_accelerate_state(module)


class _AccelerateStateFinder(importlib.abc.MetaPathFinder):
    """Patches ``accelerate.state`` right after it is first executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != PATCHED_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Patch accelerate now if it is imported, else when it is (idempotent)."""
    if PATCHED_MODULE in sys.modules:
        patch_accelerate_state(sys.modules[PATCHED_MODULE])
    elif not any(isinstance(f, _AccelerateStateFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AccelerateStateFinder())
