"""What zerotron's elementwise optimizers (:class:`~zerotron.optim.adam.Adam`,
:class:`~zerotron.optim.lion.Lion`, :class:`~zerotron.optim.adagrad.Adagrad`) share: their
``step`` (:class:`ElementwiseOptimizer`: each says only how one group's tensors are updated),
checking hyperparameters, refusing sparse gradients, and collecting a param group's tensors for
one multi-tensor kernel call.

A 16-bit parameter with fp32 states (``fp32_states=True``, DeepSpeed's default) is stepped as an
fp32 copy and rounded back after the kernel (:meth:`GroupTensors.copy_back`); the states are
created at the first step, never at construction, because ZeRO re-points the groups at its
flat partitions before any step and refuses an optimizer that already has state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotron.errors import ConfigError, UnsupportedError

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class GroupTensors:
    """One param group's tensors that have gradients, as a multi-tensor kernel takes them."""

    params: list[torch.Tensor] = field(default_factory=list)  # fp32 copies for 16-bit ones
    grads: list[torch.Tensor] = field(default_factory=list)
    states: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    steps: list[torch.Tensor] = field(default_factory=list)
    back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def copy_back(self) -> None:
        """Round the stepped fp32 copies into their 16-bit parameters."""
        for p, p32 in self.back:
            p.copy_(p32)


class ElementwiseOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step updates each group's gathered tensors in one kernel call.

    Subclasses set :attr:`STATE_NAMES` (the per-parameter state tensors, created as zeros at
    the first step) and implement :meth:`_step_group`; ``self.fp32_states`` says whether 16-bit
    parameters keep fp32 states.
    """

    zero_elementwise = True  # each element's update reads only that element: ZeRO may shard it
    STATE_NAMES: tuple[str, ...] = ()
    STEPS_ON_PARAM_DEVICE = False  # where the step counters live (torch's kernels differ)
    fp32_states: bool

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step over every parameter that has a gradient; returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            t = gather_group(
                self, group, self.STATE_NAMES, self.fp32_states, self.STEPS_ON_PARAM_DEVICE
            )
            if t.params:
                self._step_group(group, t)
                t.copy_back()
        return loss

    def _step_group(self, group: dict[str, Any], t: GroupTensors) -> None:
        """Update ``t``'s parameters, states and step counters in place."""
        raise NotImplementedError


def gather_group(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    state_names: Sequence[str],
    fp32_states: bool,
    steps_on_param_device: bool = False,
) -> GroupTensors:
    """``group``'s parameters with gradients, their gradients, states and step counters,
    creating the states (zeros) and the step (0) at a parameter's first step."""
    out = GroupTensors(states={name: [] for name in state_names})
    for p in group["params"]:
        if p.grad is None:
            continue
        g = dense_grad(p, optimizer)
        state = optimizer.state[p]
        if not state:
            dtype = torch.float32 if fp32_states and p.dtype in HALF_DTYPES else p.dtype
            device = p.device if steps_on_param_device else None
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=device)
            for name in state_names:
                state[name] = torch.zeros_like(p, dtype=dtype)
        if state[state_names[0]].dtype != p.dtype:  # fp32 states of a 16-bit parameter
            p32 = p.float()
            out.back.append((p, p32))
            out.params.append(p32)
            out.grads.append(g.float())
        else:
            out.params.append(p)
            out.grads.append(g if g.dtype == p.dtype else g.to(p.dtype))
        for name in state_names:
            out.states[name].append(state[name])
        out.steps.append(state["step"])
    return out


def dense_grad(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """``p.grad``, refused if sparse (these optimizers step whole tensors)."""
    if p.grad.is_sparse:
        raise UnsupportedError(
            "sparse gradients are not supported",
            where=type(optimizer).__name__,
            fix="use dense gradients (e.g. nn.Embedding(sparse=False))",
        )
    return p.grad


def check_hyper(**values: Any) -> None:
    """Reject what torch's optimizers reject, naming the argument."""
    for name in ("lr", "eps", "weight_decay"):
        v = values.get(name)
        if v is not None and not (isinstance(v, (int, float)) and v >= 0):
            raise ConfigError(f"{name}={v!r} must be a number >= 0", where="optimizer")
    betas = values.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        raise ConfigError(
            f"betas={tuple(betas)!r} must be two numbers in [0, 1)", where="optimizer"
        )
