"""DeepSpeed's ZeRO-3 leaf modules (``deepspeed.utils.z3_leaf_module``).

A *leaf* module gathers the parameters of its whole subtree when its forward starts (and holds
them for its backward), instead of each sub-module gathering its own: for sub-modules that run
in a varying order or not at all, as the experts of a mixture-of-experts layer, whose
module-by-module gathers would stall or prefetch the wrong thing. The flag is the module
attribute ``_z3_leaf`` (DeepSpeed's), read by zerotron's stage-3 coordinator
(:data:`zerotron.zero.stage3.coordinator.LEAF_FLAG`); set it before or after the engine is
built. Outside ZeRO-3 it changes nothing.
"""

from __future__ import annotations

from torch import nn

from zerotron.zero.stage3.coordinator import LEAF_FLAG


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module."""
    return bool(getattr(model, LEAF_FLAG, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module (DeepSpeed's ``ds_z3_leaf_module``)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Flag (or unflag) one module."""
    setattr(model, LEAF_FLAG, flag)


def _matches(module: nn.Module, spec: type | str) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(
    model: nn.Module, classes: list[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise ValueError(f"leaf_module_classes must be a list of types or names, got {classes}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in found:
        set_z3_leaf_module(m, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or class names, plain or fully qualified); return them. ValueError when none
    matches and ``raise_if_not_found``."""
    return _set_by_class(model, list(leaf_module_classes), True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the flag of the modules :func:`set_z3_leaf_modules` would flag; return them."""
    return _set_by_class(model, list(leaf_module_classes), False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: list[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as in ``named_modules()``); return them and the names not
    found (ValueError if any is missing and ``raise_if_not_found``)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    for m in found:
        set_z3_leaf_module(m, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module,
    module_name_suffixes: list[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes; return
    them and the suffixes that matched nothing."""
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in model.named_modules() if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            set_z3_leaf_module(m, flag)
            found.setdefault(id(m), m)
    if missing and raise_if_not_found:
        raise ValueError(
            f"No modules matching suffixes {missing} found in model {type(model).__name__}"
        )
    return list(found.values()), missing
