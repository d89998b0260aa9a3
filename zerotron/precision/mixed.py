"""Master weights: a torch optimizer stepping fp32 copies of 16-bit model parameters.

:class:`MixedPrecisionOptimizer` wraps any ``torch.optim.Optimizer`` built over the model's
parameters (Megatron's ``Float16OptimizerWithFloat16Params`` pattern). At construction, every
bf16/fp16 parameter in the optimizer's groups is replaced by an fp32 master copy, so optimizer
states are fp32 too; fp32 parameters are stepped directly (no copy). The Engine calls the same
object whatever the precision.

Gradients. Micro-batch gradients of a 16-bit parameter are accumulated in an fp32 ``main_grad``
buffer (Megatron's name) by a post-accumulate-grad hook: as soon as autograd has the parameter's
16-bit gradient for one backward, the hook adds it to ``main_grad`` and drops ``.grad``. This is
the cheapest correct way: one fused add per parameter per micro-batch, no 16-bit rounding of the
running sum (summing in bf16 loses bits with every micro-batch), and at most one 16-bit gradient
alive per parameter. ``main_grad`` then *is* the master gradient: no copy at step time. A
parameter that already has a ``main_grad`` (a view into a data-parallel gradient buffer) keeps it;
whoever made it fills it. fp32 parameters accumulate in ``.grad`` as usual.

One step (:meth:`MixedPrecisionOptimizer.step`; steps 2-3 are
:class:`~zerotron.precision.step.StepSequence`'s, shared with ZeRO):

1. point each master's ``.grad`` at its fp32 gradient;
2. fp16: unscale by the loss scale and check for inf/nan in one fused pass (on every rank,
   through ``reduce_fn``); an overflow skips the step: no weight or optimizer state (not even
   Adam's step count) changes, gradients are zeroed, the scaler lowers the scale, and the step is
   counted in ``num_skipped_steps``;
3. compute the global gradient norm (``is_counted`` parameters) and clip to ``clip_grad``;
4. ``optimizer.step()`` on the masters, copy masters into the 16-bit parameters (round to
   nearest even, exactly ``master.to(dtype)``), zero gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zerotron.errors import CheckpointError, ConfigError
from zerotron.precision.grads import (
    IsCounted,
    ReduceFn,
    accumulate_grad_,
    count_zeros,
    weak_hook,
)
from zerotron.precision.loss_scaler import LossScaler
from zerotron.precision.owners import set_owner
from zerotron.precision.step import SKIPPED, StepResult, StepSequence, checks_overflow

LOW_PRECISION = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizer(StepSequence):
    """An optimizer over fp32 master weights, with loss scaling, overflow skipping and clipping.

    Args:
        optimizer: a fresh torch optimizer built over the model's parameters (possibly in
            groups); its 16-bit parameters are swapped for fp32 masters here.
        loss_scaler: for fp16 (see ``make_loss_scaler``); None for bf16 and fp32.
        clip_grad: clip the global gradient norm to this value; 0 disables clipping (the norm
            is still computed and returned).
        norm_type: the p of the p-norm used for clipping (2 or ``inf``, ...).
        accumulate_in_fp32: accumulate 16-bit gradients in an fp32 ``main_grad`` (see the
            module docstring); if False, a 16-bit ``.grad`` is converted once at step time.
        check_overflow: skip steps whose gradients hold inf/nan; default: on when there is a
            loss scaler or an fp16 parameter.
        log_num_zeros_in_grad: count zero gradient elements at each step (one extra pass).
        reduce_fn: combines the norm, overflow flag and zero count across ranks (see
            ``zerotron.precision.grads``); None for one process.
        is_counted: which model parameters this rank counts in the norm; default all.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        accumulate_in_fp32: bool = True,
        check_overflow: bool | None = None,
        log_num_zeros_in_grad: bool = False,
        reduce_fn: ReduceFn | None = None,
        is_counted: IsCounted | None = None,
    ):
        if len(optimizer.state) > 0:
            raise ConfigError(
                "MixedPrecisionOptimizer needs a fresh optimizer, but this one has already "
                "stepped (it has state)",
                where=type(optimizer).__name__,
                fix="wrap the optimizer right after building it, before any step",
            )
        if clip_grad < 0:
            raise ConfigError(
                f"clip_grad={clip_grad} is negative", where="clip_grad", fix="use 0 to disable"
            )
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.clip_grad = float(clip_grad)
        self.norm_type = float(norm_type)
        self.accumulate_in_fp32 = accumulate_in_fp32
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.reduce_fn = reduce_fn
        self.num_skipped_steps = 0

        # Flat, aligned lists over all groups, in optimizer order.
        self.model_params: list[Tensor] = []
        self.master_params: list[Tensor] = []
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = _master_copy(p) if p.dtype in LOW_PRECISION else p
                self.model_params.append(p)
                self.master_params.append(master)
                masters.append(master)
            group["params"] = masters
        self._is_16bit = [p.dtype in LOW_PRECISION for p in self.model_params]
        self._master_of = {id(p): m for p, m in zip(self.model_params, self.master_params)}
        set_owner(self.model_params, self)
        self._counted = [is_counted is None or is_counted(p) for p in self.model_params]
        if check_overflow is None:
            check_overflow = checks_overflow(loss_scaler, self.model_params)
        self.check_overflow = check_overflow

        # fp32 accumulation buffers and the hooks that fill them.
        self._hooks: list[Any] = []
        self._owns_main_grad = [False] * len(self.model_params)
        self._got_grad = [False] * len(self.model_params)
        if accumulate_in_fp32:
            for i, p in enumerate(self.model_params):
                if self._is_16bit[i] and getattr(p, "main_grad", None) is None:
                    p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                    self._owns_main_grad[i] = True
                    # Weakly held (grads.weak_hook): once this wrapper is dropped without
                    # remove_hooks, the hook leaves .grad to whoever is next.
                    hook = weak_hook(self._accumulate, i)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _accumulate(self, i: int, param: Tensor) -> None:
        accumulate_grad_(param.main_grad, param.grad)
        param.grad = None
        self._got_grad[i] = True

    # ---- what the Engine uses -------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (over master params): LR schedulers set lr here."""
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> StepResult:
        """Unscale, check, clip, step, copy back, zero gradients (see the module docstring)."""
        grads = self._bind_master_grads()
        if self._skip_on_overflow(grads, self.reduce_fn):
            return SKIPPED

        counted = [
            m.grad for m, c in zip(self.master_params, self._counted) if c and m.grad is not None
        ]
        grad_norm = self._grad_norm(counted, self.reduce_fn)
        self._clip(grads, grad_norm)
        num_zeros = (
            count_zeros(counted, reduce_fn=self.reduce_fn) if self.log_num_zeros_in_grad else None
        )
        self.optimizer.step()
        self._copy_masters_to_model()
        self.zero_grad()
        return StepResult(True, float(grad_norm), num_zeros)

    def zero_grad(self) -> None:
        """Drop all gradients: ``.grad`` to None, ``main_grad`` buffers to zero (kept)."""
        main_grads = []
        for p, m in zip(self.model_params, self.master_params):
            p.grad = None
            m.grad = None
            if getattr(p, "main_grad", None) is not None:
                main_grads.append(p.main_grad)
        if main_grads:
            torch._foreach_zero_(main_grads)
        self._got_grad = [False] * len(self.model_params)

    def master_of(self, param: Tensor) -> Tensor | None:
        """The fp32 tensor the optimizer steps for model parameter ``param`` (its master, or
        ``param`` itself when it is fp32); None for a parameter it does not hold."""
        return self._master_of.get(id(param))

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the masters from the model (after loading model weights without optimizer
        state, e.g. ``--finetune`` or ``--no-load-optim``)."""
        for p, m, low in zip(self.model_params, self.master_params, self._is_16bit):
            if low:
                m.copy_(p)

    def remove_hooks(self) -> None:
        """Detach the gradient-accumulation hooks from the model's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- checkpoints ----------------------------------------------------------------------

    def _16bit_masters_by_group(self) -> list[list[Tensor]]:
        index = {id(m): i for i, m in enumerate(self.master_params)}
        return [
            [m for m in group["params"] if self._is_16bit[index[id(m)]]]
            for group in self.optimizer.param_groups
        ]

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, the fp32 masters of 16-bit params (Megatron's
        ``fp32_from_fp16_params``: one list per group), the loss scaler and the skip count.

        Tensors are the live ones, not copies (as torch's optimizers do): serialize them
        before the next step.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "fp32_from_fp16_params": self._16bit_masters_by_group(),
            "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "num_skipped_steps": self.num_skipped_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the model's 16-bit params are set from the
        loaded masters, so the model equals the run that saved. A checkpoint without masters
        (saved in fp32) leaves the masters to be taken from the model's current weights."""
        self._check_state_shapes(state.get("optimizer", {}))
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(
                f"optimizer state does not fit this model's parameter groups: {e}",
                where="optimizer",
                fix="resume with the same model and weight-decay grouping, or skip the optimizer "
                "state (--no-load-optim)",
            ) from None
        saved = state.get("fp32_from_fp16_params") or []
        if any(len(g) for g in saved):
            self._load_masters(saved)
        else:
            self.reload_model_params()
        if self.loss_scaler is not None and state.get("grad_scaler") is not None:
            self.loss_scaler.load_state_dict(state["grad_scaler"])
        self.num_skipped_steps = int(state.get("num_skipped_steps", 0))

    def _check_state_shapes(self, saved: dict[str, Any]) -> None:
        # torch's load_state_dict does not compare per-parameter state shapes; a mismatch would
        # surface as memory corruption inside a fused step, so refuse it here by name.
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for idx, entry in saved.get("state", {}).items():
            param = params[idx] if isinstance(idx, int) and idx < len(params) else None
            for key, value in entry.items():
                if param is None or not isinstance(value, Tensor) or value.dim() == 0:
                    continue
                if value.shape != param.shape:
                    raise CheckpointError(
                        f"optimizer state {key!r} of parameter {idx} has shape "
                        f"{list(value.shape)}, the parameter {list(param.shape)}",
                        where="optimizer.state",
                        fix="resume with the same model shape, or skip the optimizer state "
                        "(--no-load-optim)",
                    )

    def _load_masters(self, saved: list[list[Tensor]]) -> None:
        ours = self._16bit_masters_by_group()
        shapes = [[tuple(t.shape) for t in g] for g in ours]
        saved_shapes = [[tuple(t.shape) for t in g] for g in saved]
        if shapes != saved_shapes:
            raise CheckpointError(
                "fp32 master weights in the checkpoint do not fit this model: "
                f"{sum(map(len, saved_shapes))} tensors saved, {sum(map(len, shapes))} expected, "
                "or their shapes differ",
                where="optimizer.fp32_from_fp16_params",
                fix="resume with the same model, precision and parameter grouping, or skip the "
                "optimizer state (--no-load-optim)",
            )
        for ours_g, saved_g in zip(ours, saved):
            for m, s in zip(ours_g, saved_g):
                m.copy_(s)
        self._copy_masters_to_model()

    # ---- internals ------------------------------------------------------------------------

    def _bind_master_grads(self) -> list[Tensor]:
        """Point each master's ``.grad`` at its fp32 gradient; return those gradients."""
        grads = []
        for i, (p, m) in enumerate(zip(self.model_params, self.master_params)):
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                # Our own buffer only counts once a backward has reached the parameter, so an
                # unused parameter is not stepped, as in the fp32 path; a buffer owned by
                # data-parallel code always counts.
                g = main_grad if (self._got_grad[i] or not self._owns_main_grad[i]) else None
            elif p.grad is not None:
                g = p.grad.float() if self._is_16bit[i] else p.grad
            else:
                g = None
            m.grad = g
            if g is not None:
                grads.append(g)
        return grads

    def _copy_masters_to_model(self) -> None:
        pairs = [
            (p, m)
            for p, m, low in zip(self.model_params, self.master_params, self._is_16bit)
            if low
        ]
        if pairs:
            torch._foreach_copy_([p.data for p, _ in pairs], [m for _, m in pairs])


def _master_copy(param: Tensor) -> Tensor:
    master = param.detach().to(torch.float32, copy=True)
    # Parallel layers tag parameters (tensor_model_parallel, partition_dim, shared, ...);
    # the master keeps the tags so code that inspects optimizer params sees them.
    # Private entries (hook registries) and the gradient buffer stay with the model param.
    tags = {k: v for k, v in param.__dict__.items() if not k.startswith("_") and k != "main_grad"}
    master.__dict__.update(tags)
    return master
