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
    if _missing("zerotron.compat.runtime.zero.partition_parameters"):
        # transformers' prevent_arange_dtype_change (integrations/deepspeed.py) swaps this
        # wrapper around zero.Init; zerotron's Init wraps no tensor constructor, so it is inert.
        def zero_wrapper_for_fp_tensor_constructor(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return fn

        if _missing("zerotron.compat.runtime.zero"):
            _module("zerotron.compat.runtime.zero")
        _module(
            "zerotron.compat.runtime.zero.partition_parameters",
            zero_wrapper_for_fp_tensor_constructor=zero_wrapper_for_fp_tensor_constructor,
            _orig_torch_arange=torch.arange,
        )
    zerotron.COMPAT_MODULES = tuple(dict.fromkeys(names))
    zerotron._MODULES = tuple(dict.fromkeys([*zerotron._MODULES, *names]))
    TOP_LEVEL.setdefault("DeepSpeedEngine", Engine)
    _engine_surface()


class _ConfigView(dict):
    """DeepSpeed's ``engine.config`` (the resolved dict) that still answers zerotron's schema
    attributes (``engine.config.training``...) as ``engine.config`` does today."""

    def __init__(self, resolved: dict, schema: Any):
        super().__init__(resolved)
        self._schema = schema

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_schema"], name)


def _engine_surface() -> None:
    """Engine methods transformers/accelerate call, where the Engine lacks them."""
    import inspect

    from zerotron.compat import api
    from zerotron.engine import Engine

    if not getattr(api.initialize, "_stopgap", False):
        original_initialize = api.initialize

        def initialize(*args: Any, **kwargs: Any) -> Any:
            engine, optimizer, loader, scheduler = original_initialize(*args, **kwargs)
            engine.config = _ConfigView(engine.resolved_config, engine.config)
            return engine, optimizer, loader, scheduler

        initialize._stopgap = True  # type: ignore[attr-defined]
        api.initialize = initialize

    def fallthrough(self: Any, name: str) -> Any:
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(module, name)

    if "__getattr__" not in vars(Engine):
        Engine.__getattr__ = fallthrough
    if "scale_wrt_gas" not in inspect.signature(Engine.backward).parameters:
        original_backward = Engine.backward

        def backward(self: Any, loss: Any, retain_graph: bool = False, scale_wrt_gas=True):
            if not scale_wrt_gas and self._gas > 1:
                loss = loss * self._gas  # the Engine divides by the accumulation steps
            original_backward(self, loss)

        Engine.backward = backward
    if not hasattr(Engine, "set_gradient_accumulation_boundary"):

        def set_gradient_accumulation_boundary(self: Any, is_boundary: bool) -> None:
            self._stopgap_boundary = is_boundary

        Engine.set_gradient_accumulation_boundary = set_gradient_accumulation_boundary
    if not hasattr(Engine, "get_global_grad_norm"):

        def get_global_grad_norm(self: Any) -> float | None:
            return None if self.last_step is None else self.last_step.grad_norm

        Engine.get_global_grad_norm = get_global_grad_norm
    if not hasattr(Engine, "zero_gather_16bit_weights_on_model_save"):

        def zero_gather_16bit_weights_on_model_save(self: Any) -> bool:
            zero = self.config.get("zero_optimization", {})
            return bool(zero.get("stage3_gather_16bit_weights_on_model_save", False))

        Engine.zero_gather_16bit_weights_on_model_save = zero_gather_16bit_weights_on_model_save
    if not hasattr(Engine, "_zero3_consolidated_16bit_state_dict"):

        def _zero3_consolidated_16bit_state_dict(
            self: Any, exclude_frozen_parameters: bool = False
        ) -> dict[str, Any]:
            state = self.module_state_dict(rank0_only=True)
            if state is None:
                return {}  # DeepSpeed: only rank 0 holds the consolidated weights
            if exclude_frozen_parameters:
                frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            return state

        Engine._zero3_consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict
    if "load_module_strict" not in inspect.signature(Engine.load_checkpoint).parameters:
        original_load = Engine.load_checkpoint

        def load_checkpoint(
            self: Any,
            load_dir: Any,
            tag: Any = None,
            load_module_strict: bool = True,
            load_optimizer_states: bool = True,
            load_lr_scheduler_states: bool = True,
            load_module_only: bool = False,
            custom_load_fn: Any = None,
        ) -> Any:
            return original_load(
                self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                load_module_only,
            )  # fmt: skip

        Engine.load_checkpoint = load_checkpoint
