"""TEMPORARY (issue 13, branch r13-hf): the DeepSpeed surface HF Trainer needs, until it lands.

Other issue-13 work owns these names (``deepspeed.comm``, ``deepspeed.accelerator``,
``deepspeed.utils``, ``deepspeed.runtime``, Engine methods). This module fills in only what is
*missing* when the ``deepspeed`` alias is imported, so the real modules win as soon as they
exist; the coordinator deletes this file and its one call in :mod:`zerotron.compat.as_deepspeed`
once they are merged. Nothing else imports it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any

import torch

# Top-level ``deepspeed.<name>`` that zerotron does not serve yet.
TOP_LEVEL: dict[str, Any] = {}


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True


def _module(name: str, **attrs: Any) -> ModuleType:
    module = ModuleType(name, "TEMPORARY stand-in from zerotron.compat.hf_stopgap")
    module.__path__ = []  # a package, so submodules can be registered below it
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    vars(module).update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _comm() -> ModuleType:
    from zerotron.compat.api import init_distributed
    from zerotron.distributed import init

    def barrier(group: Any = None, **_: Any) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier(group=group)

    return _module(
        "zerotron.compat.comm",
        init_distributed=init_distributed,
        is_initialized=init.is_initialized,
        get_rank=lambda group=None: init.get_rank(),
        get_world_size=lambda group=None: init.get_world_size(),
        get_local_rank=init.local_rank,
        barrier=barrier,
    )


class _Accelerator:
    def device_name(self, index: int | None = None) -> str:
        return "cpu" if not torch.cuda.is_available() else f"cuda:{index}" if index else "cuda"

    def current_device_name(self) -> str:
        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def communication_backend_name(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"


def fill_missing() -> None:
    """Register stand-ins for the modules and names HF Trainer uses that do not exist yet."""
    import zerotron
    from zerotron.engine import Engine

    names = list(zerotron.COMPAT_MODULES)
    if _missing("zerotron.compat.comm"):
        _comm()
        names.append("comm")
    if _missing("zerotron.compat.accelerator"):
        accelerator = _Accelerator()
        _module("zerotron.compat.accelerator", get_accelerator=lambda: accelerator)
        names.append("accelerator")
    if _missing("zerotron.compat.utils"):
        _module("zerotron.compat.utils", logger=logging.getLogger("zerotron.deepspeed"))
        names.append("utils")
    if _missing("zerotron.compat.runtime"):
        _module("zerotron.compat.runtime")
        _module(
            "zerotron.compat.runtime.lr_schedules",
            VALID_LR_SCHEDULES=[
                "LRRangeTest",
                "OneCycle",
                "WarmupLR",
                "WarmupDecayLR",
                "WarmupCosineLR",
            ],
        )
        names.append("runtime")
    zerotron.COMPAT_MODULES = tuple(dict.fromkeys(names))
    zerotron._MODULES = tuple(dict.fromkeys([*zerotron._MODULES, *names]))
    TOP_LEVEL.setdefault("DeepSpeedEngine", Engine)
