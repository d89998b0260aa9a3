"""zerotron: train GPT-style language models from one CPU process to thousands of GPUs.

DeepSpeed's API is here too, so ``import zerotron as deepspeed`` runs a DeepSpeed script:
:func:`initialize`, :func:`add_config_arguments`, :func:`init_distributed` (from
:mod:`zerotron.api`) and the modules ``zerotron.zero``, ``zerotron.checkpointing``,
``zerotron.pipe``. Everything is imported on first use, so ``import zerotron`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = ("initialize", "add_config_arguments", "init_distributed")
_MODULES = ("zero", "checkpointing", "pipe", "config", "distributed", "engine", "api")

__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("zerotron.api"), name)
    if name in _MODULES:
        return importlib.import_module(f"zerotron.{name}")
    raise AttributeError(f"module 'zerotron' has no attribute {name!r}")
