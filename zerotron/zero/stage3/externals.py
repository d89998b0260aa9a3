"""ZeRO stage 3, external parameters: those a module's forward uses although another owns them.

Stage 3 gathers a module's own parameters around its forward and backward; a parameter read
elsewhere (a tied output layer, ``child.weight`` used directly) must be registered with the
module that reads it, or that module would find it empty. Three ways it is:

- models declare theirs (:mod:`zerotron.parallel.declarations`), so ZeRO never imports a model;
- scripts call :func:`register_external_parameter` (DeepSpeed's API of the same names);
- on first use: every module holding partitioned parameters gets a :class:`WatchedParameters`
  as its ``_parameters``, so reading one that is at rest while a forward runs (``module.weight``
  goes through ``_parameters[name]``) gathers it and registers it with the module whose forward
  is running. That is how ``nn.MultiheadAttention``, whose forward reads
  ``self.out_proj.weight`` without calling ``out_proj``, trains under stage 3 (DeepSpeed's
  ``ZeROOrderedDict`` does the same). From the next forward on the registration gathers it
  with the module's own parameters, in one collective.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from zerotron.parallel.declarations import external_parameters
from zerotron.zero.stage3.shards import AVAILABLE, state_of


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` for the whole forward and backward of ``module``.

    For a parameter that ``module``'s forward uses although another module owns it (a tied
    output layer, ``child.weight`` read directly). DeepSpeed's API of the same name.
    """
    ext = module.__dict__.setdefault("_zero_external_params", {})
    ext[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    module.__dict__.get("_zero_external_params", {}).pop(id(parameter), None)


def register_declared_externals(root: nn.Module) -> None:
    """Register the parameters each module under ``root`` declares it reads outside their owners
    (``external_parameters()``, :mod:`zerotron.parallel.declarations`)."""
    for m in root.modules():
        for p in external_parameters(m):
            register_external_parameter(m, p)


class WatchedParameters(dict):
    """A module's ``_parameters`` under stage 3: reading a partitioned parameter that is not
    gathered calls its coordinator's ``external_use`` (which acts only while a forward runs)."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Tensor | None:
        p = dict.__getitem__(self, key)
        status = getattr(p, "ds_status", AVAILABLE)
        if status is not AVAILABLE:
            coordinator = state_of(p).coordinator
            if coordinator is not None:
                coordinator.external_use(p)
        return p


def watch_parameters(root: nn.Module, owns: Callable[[nn.Module], bool]) -> None:
    """Give every module under ``root`` for which ``owns(module)`` a :class:`WatchedParameters`."""
    for m in root.modules():
        if owns(m) and type(m._parameters) is dict:
            m._parameters = WatchedParameters(m._parameters)


def unwatch_parameters(root: nn.Module) -> None:
    """Undo :func:`watch_parameters`."""
    for m in root.modules():
        if isinstance(m._parameters, WatchedParameters):
            m._parameters = dict(m._parameters)
