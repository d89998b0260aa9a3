"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one compiled pass
on the CPU, foreach elsewhere.

DeepSpeed's CPU and CUDA Lion, per element (``lr``, ``wd``, ``b1``, ``b2`` the group's)::

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = b2 * m + (1 - b2) * g

torch has no Lion kernel. On the CPU each tensor is stepped by one compiled kernel
(:func:`torch.compile` of :func:`_fused`: one pass that reads ``p``, ``g`` and ``m`` and writes
``p`` and ``m``, as DeepSpeed's C++ op does; tensors under :data:`SMALL` elements are joined
into one flat tensor per call), compiled at the first step (seconds; inductor caches it on disk
for later processes). Elsewhere, where compiling fails (no C++ compiler, say;
a warning says so once), for a strided tensor, or with ``ZEROTRON_COMPILED_LION=0``, torch's
foreach ops do it (one kernel per operation over a list of tensors), run over batches of about
:data:`BLOCK` elements so that their five passes find their operands in cache. The two paths
round ``b1 * m + (1 - b1) * g`` and the momentum update differently (foreach: as ``lerp``), so
they agree to fp32 rounding, and the compiled kernel gives every element the same bits however
a tensor is cut (what ZeRO's partitions rely on).

One difference from DeepSpeed's kernels, where ``c`` is exactly 0: ``sign(0) = 0`` here (the
paper's ``sign``), so an element with zero gradient and zero momentum does not move;
DeepSpeed's kernels step it by ``lr`` (CPU: ``-copysign(lr, c)``; CUDA: ``+lr``).
ZeRO's zero padding relies on such elements staying zero.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from zerotron.optim.elementwise import ElementwiseOptimizer, GroupTensors, check_hyper


class Lion(ElementwiseOptimizer):
    """Lion (see the module docstring), a drop-in torch optimizer.

    Args:
        params: tensors or param groups; a group may set ``lr``, ``betas``, ``weight_decay``.
        lr, betas, weight_decay: Lion's (decoupled weight decay).
        fp32_states: keep ``exp_avg`` in fp32 for 16-bit parameters (the step is computed in
            fp32 and rounded into the parameter); False keeps it in the parameter's dtype.
    """

    STATE_NAMES = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        fp32_states: bool = True,
    ):
        check_hyper(lr=lr, weight_decay=weight_decay, betas=betas)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.fp32_states = fp32_states

    def _step_group(self, group: dict[str, Any], t: GroupTensors) -> None:
        lion_step(
            t.params, t.grads, t.states["exp_avg"], group["lr"], *group["betas"],
            group["weight_decay"],
        )  # fmt: skip
        torch._foreach_add_(t.steps, 1)


BLOCK = 1 << 17
"""Elements per batch of the foreach path: its five passes run over one batch while it is in
cache, then the next (measurements: bench/README.md, ``optimizers.py``)."""


def lion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion's update of ``params`` and ``exp_avgs`` in place (the module docstring's math)."""
    rest = list(zip(params, grads, exp_avgs))
    if _compiled_on(params):
        hyper = [torch.tensor(x, dtype=torch.float64) for x in (lr, beta1, beta2, weight_decay)]
        strided = [t for t in rest if not all(x.is_contiguous() for x in t)]
        flat = [tuple(x.view(-1) for x in t) for t in rest if all(x.is_contiguous() for x in t)]
        calls = _calls(flat)
        for i, call in enumerate(calls):
            try:
                _run_call(call, hyper)
            except torch._dynamo.exc.TorchDynamoException as e:  # compiling failed (inductor's
                _compile_failed(e)  # errors derive from it): the rest, not yet stepped, by foreach
                strided += [t for later in calls[i:] for t in later]
                break
        rest = strided
    if rest:
        params, grads, exp_avgs = (list(x) for x in zip(*rest))
        _foreach_step(params, grads, exp_avgs, lr, beta1, beta2, weight_decay)


SMALL = 1 << 16
"""Tensors under this many elements are stepped together, joined into one flat tensor per
kernel call (each call costs tens of microseconds; a GPT has hundreds of biases and norms)."""


def _calls(flat: list[tuple[torch.Tensor, ...]]) -> list[list[tuple[torch.Tensor, ...]]]:
    """The kernel calls for contiguous flat (p, g, m) triples: each large one alone, the
    small ones (same dtypes) joined up to :data:`BLOCK` elements per call."""
    calls: list[list[tuple[torch.Tensor, ...]]] = []
    joined: dict[tuple[torch.dtype, ...], tuple[list[tuple[torch.Tensor, ...]], list[int]]] = {}
    for t in flat:
        if t[0].numel() >= SMALL:
            calls.append([t])
            continue
        dtypes = tuple(x.dtype for x in t)
        batch, size = joined.setdefault(dtypes, ([], [0]))
        batch.append(t)
        size[0] += t[0].numel()
        if size[0] >= BLOCK:
            calls.append(batch)
            del joined[dtypes]
    return calls + [batch for batch, _ in joined.values()]


def _run_call(call: list[tuple[torch.Tensor, ...]], hyper: list[torch.Tensor]) -> None:
    """One kernel call over ``call``'s triples: one alone in place, several joined (the kernel
    works element by element, so the joined elements get the bits they get alone)."""
    if len(call) == 1:
        _kernel()(*call[0], *hyper)
        return
    p, g, m = (torch.cat(x) for x in zip(*call))
    _kernel()(p, g, m, *hyper)
    sizes = [t[0].numel() for t in call]
    torch._foreach_copy_([t[0] for t in call], list(p.split(sizes)))
    torch._foreach_copy_([t[2] for t in call], list(m.split(sizes)))


def _fused(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    lr: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    weight_decay: torch.Tensor,
) -> None:
    """Lion on one flat tensor, written for :func:`torch.compile` to fuse into one pass (the
    hyperparameters are 0-d tensors, so a new learning rate needs no new compile)."""
    c = m * beta1 + g * (1 - beta1)
    p.copy_(p * (1 - lr * weight_decay) - lr * torch.sign(c))
    m.copy_(m * beta2 + g * (1 - beta2))


_compiled: Any = None
_failed = False


def _compiled_on(params: list[torch.Tensor]) -> bool:
    """Whether the compiled kernel steps these tensors: CPU tensors, not switched off, not
    failed to compile before."""
    return (
        not _failed
        and os.environ.get("ZEROTRON_COMPILED_LION", "1") != "0"
        and bool(params)
        and all(p.device.type == "cpu" for p in params)
    )


def _kernel() -> Any:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_fused, dynamic=True, fullgraph=True)
    return _compiled


def _compile_failed(e: Exception) -> None:
    global _failed
    _failed = True
    warnings.warn(
        f"Lion's compiled CPU kernel is unavailable ({type(e).__name__}: {e}); this process "
        "steps with torch's foreach ops from now on (slower, and rounded a little differently "
        "from ranks that compiled; ZEROTRON_COMPILED_LION=0 on every rank skips the attempt)",
        stacklevel=3,
    )


def _foreach_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """:func:`lion_step` with torch's foreach ops, in cache-sized batches."""
    for ps, gs, ms in _batches((params, grads, exp_avgs), BLOCK):
        c = torch._foreach_lerp(ms, gs, 1 - beta1)  # b1 * m + (1 - b1) * g
        torch._foreach_sign_(c)
        if weight_decay != 0:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        torch._foreach_add_(ps, c, alpha=-lr)
        torch._foreach_lerp_(ms, gs, 1 - beta2)


def _batches(
    lists: tuple[list[torch.Tensor], ...], block: int
) -> Iterator[tuple[list[torch.Tensor], ...]]:
    """The tensors of ``lists`` (same shapes position by position) as batches of about
    ``block`` elements: small tensors together, large ones cut into flat slices (views)."""
    batch: list[tuple[torch.Tensor, ...]] = []
    size = 0
    for ts in zip(*lists):
        n = ts[0].numel()
        if all(t.is_contiguous() for t in ts):
            flat = [t.view(-1) for t in ts]
            pieces = [tuple(f[a : a + block] for f in flat) for a in range(0, n, block)]
        else:  # rare (a strided view): the whole tensor as one piece
            pieces = [ts]
        for piece in pieces:
            batch.append(piece)
            size += piece[0].numel()
            if size >= block:
                yield tuple(list(x) for x in zip(*batch))
                batch, size = [], 0
    if batch:
        yield tuple(list(x) for x in zip(*batch))
