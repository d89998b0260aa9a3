"""Submodules of a compat package as its attributes, imported on first use.

``import deepspeed`` imports nearly all of DeepSpeed, so scripts and libraries reach modules
by attribute (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` after only ``import
deepspeed``, as accelerate does). zerotron keeps ``import zerotron`` cheap instead: each compat
package sets ``__getattr__ = submodule_getattr(__name__)``, so the same attribute chain imports
what it names when it is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` on demand."""

    def __getattr__(name: str) -> ModuleType:
        from zerotron.config.deepspeed_refused import deepspeed_name, missing_attribute

        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise  # the submodule exists and failed to import something itself
        message = f"module {package!r} has no attribute {name!r}"
        raise missing_attribute(deepspeed_name(package), name, message)

    return __getattr__
