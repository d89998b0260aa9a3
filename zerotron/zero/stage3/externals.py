"""ZeRO stage 3, external parameters: those a module's forward uses although another owns them.

Stage 3 gathers a module's own parameters around its forward and backward; a parameter read
elsewhere (a tied output layer, ``child.weight`` used directly) must be registered with the
module that reads it, or that module would find it empty. DeepSpeed's API of the same names;
models declare theirs (:mod:`zerotron.parallel.declarations`), so ZeRO never imports a model.
"""

from __future__ import annotations

from torch import nn

from zerotron.parallel.declarations import external_parameters


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
