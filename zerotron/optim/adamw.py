"""Build the optimizer: AdamW (what Megatron's and DeepSpeed's "adam" mean), Adam, SGD, Lamb,
Lion or Adagrad.

AdamW, Adam and SGD are torch's own implementations; Lamb, Lion and Adagrad are zerotron's,
with DeepSpeed's math (:mod:`zerotron.optim.lamb`, :mod:`~zerotron.optim.lion`,
:mod:`~zerotron.optim.adagrad`). For AdamW, Adam and SGD, ``impl="auto"`` takes the fused
kernel wherever torch has one for the parameters' device (CUDA and, since torch 2.4, CPU), else
the foreach one: on CPU the fused kernel is several times faster and as accurate (both differ
from an fp64 AdamW by the same amount, and from each other by at most 1 ulp; measurements in
bench/README.md, ``optimizers.py`` section).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from zerotron.errors import ConfigError, UnsupportedError
from zerotron.optim.adagrad import Adagrad
from zerotron.optim.lamb import Lamb
from zerotron.optim.lion import Lion

Impl = Literal["auto", "fused", "foreach", "for"]

# Optimizers DeepSpeed or Megatron configs may name that zerotron does not (yet) provide.
_KNOWN_UNSUPPORTED = {"onebitadam", "onebitlamb", "zerooneadam", "muadam"}
KINDS = ("adamw", "adam", "sgd", "lamb", "lion", "adagrad")
"""The names :func:`build_optimizer` takes (lower case; ``adam`` is AdamW by default)."""
_USE = "use adam, adamw, sgd, lamb, lion or adagrad"


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    name: str = "adamw",
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
    nesterov: bool = False,
    adam_w_mode: bool = True,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    impl: Impl = "auto",
) -> torch.optim.Optimizer:
    """A torch optimizer over ``params`` (tensors or groups from ``get_param_groups``).

    Args:
        name: ``"adamw"``; ``"adam"`` (AdamW unless ``adam_w_mode=False``, which gives Adam
            with L2-coupled decay, DeepSpeed's switch); ``"sgd"``. Case-insensitive.
        lr, weight_decay: defaults for groups that do not set their own.
        betas, eps: Adam's (Megatron: ``--adam-beta1/2``, ``--adam-eps``); Lamb's too; Lion
            takes ``betas``, Adagrad ``eps``.
        momentum, nesterov: SGD's (Megatron: ``--sgd-momentum``).
        max_coeff, min_coeff: Lamb's trust-ratio bounds (``"lamb"``, DeepSpeed's).
        impl: ``"auto"`` (fused where available), ``"fused"``, ``"foreach"`` or ``"for"``. Lamb
            and Lion have one implementation each; Adagrad is fused or foreach (``"for"``: foreach).
    """
    params = [_materialize(p) for p in params]
    kind = name.lower()
    if kind == "adam":
        kind = "adamw" if adam_w_mode else "adam"
    if kind not in KINDS:
        if kind in _KNOWN_UNSUPPORTED:
            raise UnsupportedError(
                f"optimizer {name!r} (a DeepSpeed optimizer) is not supported by zerotron",
                where="optimizer.type",
                fix=_USE,
            )
        raise ConfigError(f"unknown optimizer {name!r}", where="optimizer.type", fix=_USE)
    if kind == "lamb":
        return Lamb(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
    kw = _impl_kwargs(impl, params)
    if kind == "lion":
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "adagrad":
        # "auto" lets Adagrad pick per step (fused on the CPU, where torch has it).
        fused = None if impl == "auto" else impl == "fused"
        return Adagrad(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=fused)
    if kind == "sgd":
        if nesterov and momentum <= 0:
            raise ConfigError(
                "nesterov momentum needs momentum > 0", where="optimizer.params.nesterov"
            )
        return torch.optim.SGD(
            params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, **kw
        )
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)


def _materialize(p: torch.Tensor | dict[str, Any]) -> torch.Tensor | dict[str, Any]:
    # A group's "params" may be a generator; read it once, here.
    if not isinstance(p, dict):
        return p
    ps = p["params"]
    return {**p, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)}


def _impl_kwargs(impl: Impl, params: list) -> dict[str, bool]:
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for":
        return {"foreach": False}
    if impl != "auto":
        raise ConfigError(
            f"impl={impl!r} is not one of auto, fused, foreach, for", where="optimizer.impl"
        )
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    devices = set(_get_fused_kernels_supported_devices())
    fusable = all(t.device.type in devices and t.is_floating_point() for t in tensors)
    return {"fused": True} if fusable and tensors else {"foreach": True}
