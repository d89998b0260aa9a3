"""zerotron: train GPT-style language models from one CPU process to thousands of GPUs.

DeepSpeed's API is here too, so ``import zerotron as deepspeed`` runs a DeepSpeed script:
its top-level names (:func:`initialize`, :func:`init_distributed`, :func:`get_accelerator`,
``DeepSpeedEngine``...: see ``_API``), ``zerotron.zero``, and DeepSpeed's modules in
:mod:`zerotron.compat` under their DeepSpeed names (``zerotron.comm``, ``zerotron.utils``,
``zerotron.ops``, ``zerotron.pipe``, ``zerotron.profiling``...: see :data:`COMPAT_MODULES`).
Everything is imported on first use, so ``import zerotron`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

# DeepSpeed module names served from zerotron/compat/: `zerotron.<name>` (and any
# `zerotron.<name>.<sub>`) is the module object `zerotron.compat.<name>[.<sub>]`. To add one,
# put the module in compat/ and its name here.
COMPAT_MODULES = (
    "pipe",
    "checkpointing",
    "comm",
    "accelerator",
    "runtime",
    "utils",
    "compression",
    "moe",
    "ops",
    "profiling",
)

# DeepSpeed's top-level names: name -> the zerotron module that holds it.
_API = {
    "initialize": "zerotron.compat.api",
    "add_config_arguments": "zerotron.compat.api",
    "init_distributed": "zerotron.compat.comm",
    "get_accelerator": "zerotron.compat.accelerator",
    "DeepSpeedEngine": "zerotron.compat.runtime.engine",
    "PipelineModule": "zerotron.compat.pipe",
    "log_dist": "zerotron.compat.utils",
    "logger": "zerotron.compat.utils",
}
_MODULES = ("zero", "config", "distributed", "engine", "compat", *COMPAT_MODULES)

__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"zerotron.{name}")
    from zerotron.config.deepspeed_refused import missing_attribute

    raise missing_attribute("deepspeed", name, f"module 'zerotron' has no attribute {name!r}")


def compat_target(fullname: str) -> str | None:
    """The ``zerotron.compat`` module that the import name ``fullname`` is, or None."""
    if not fullname.startswith("zerotron."):  # every import in the process passes here: be quick
        return None
    parts = fullname.split(".")
    if parts[1] not in COMPAT_MODULES:
        return None
    return ".".join(["zerotron", "compat", *parts[1:]])


class AliasLoader(importlib.abc.Loader):
    """Loads an alias as the already imported target module itself (no second copy); also
    ``deepspeed.X`` under ``--as-deepspeed`` (:mod:`zerotron.compat.as_deepspeed`)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__  # the import system is about to overwrite it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_spec  # the module keeps its own name (reload, pickling)

    def get_code(self, fullname: str) -> Any:
        """The target's code, so ``python -m zerotron.<name>.<sub>`` runs it as ``__main__``."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _CompatAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``zerotron.<name>[.<sub>]`` for the names in :data:`COMPAT_MODULES`."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = compat_target(fullname)
        if real is None:
            return None  # not ours
        if importlib.util.find_spec(real) is None:
            from zerotron.config.deepspeed_refused import deepspeed_name, missing_module

            error = missing_module(deepspeed_name(fullname))
            if error is not None:  # a DeepSpeed module zerotron refuses: say why
                raise error
            return None  # missing: the usual "No module named ..." follows
        return importlib.util.spec_from_loader(fullname, AliasLoader(real))


# Once per interpreter, ahead of the path finders (a reload of this module must not add another).
if not any(type(f).__name__ == _CompatAliasFinder.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _CompatAliasFinder())
