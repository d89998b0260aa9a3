"""What one training step really holds on this rank, per term of ``zerotron estimate``.

    from zerotron.engine.memory_breakdown import StepMemory
    with StepMemory(engine) as step:
        engine.train_batch(data_iter)
    step.terms  # {"parameters": bytes, "gradients": ..., "activations": ..., ...}

The parts (each installed only inside a :class:`StepMemory` block, so a run that measures no
step pays nothing):

- :class:`SavedActivations`: bytes autograd keeps for backward, by
  ``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's *storage* counted once while
  any saved reference to it lives (parameters excluded), so :attr:`SavedActivations.peak` is the
  most held at once: one micro-batch's forward, or a pipeline schedule's micro-batches in
  flight.
- :func:`model_states`: bytes of the tensors an Engine's optimizer holds, by kind (parameters,
  gradients, fp32 masters, optimizer states), each storage counted once, the first kind to reach
  it winning (views into one flat buffer cost the buffer once).
- :class:`ModelStatePeaks`: :func:`model_states` taken at the optimizer's step (a pre-hook on
  the torch optimizer: gradients reduced, masters and states allocated) and whenever
  :meth:`ModelStatePeaks.sample` is called (after each micro-batch's backward, after the step),
  keeping each term's largest value.
- :class:`LossWorkspace`: the fused output-layer loss's buffers, live;
- :class:`CommBuffers`: the collectives' buffers in flight, the most at once.

Only what tensors hold is counted: allocator slack, temporaries and the C++ side of autograd are
not (on CUDA, :attr:`StepMemory.cuda_max_allocated` is the allocator's peak of the step, to put
beside the sum). :mod:`zerotron.tuning.measure` builds runs on these to check the estimator;
``zerotron pretrain --memory-breakdown-step N`` measures its step N with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.parallel import recompute

KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")
TERMS = (*KINDS, "activations", "comm_buffers", "loss_workspace")
"""The terms a :class:`StepMemory` measures (named as :class:`~zerotron.tuning.estimate.
MemoryBreakdown`'s; its ``recompute_workspace`` is not measured apart: torch's non-reentrant
checkpoint reruns a layer out of reach of the saved-tensor hooks, and what DeepSpeed's
CheckpointFunction saves while it reruns one is left out too)."""


def _key(t: Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class _Held:
    """A saved tensor's slot: alive as long as autograd keeps the saved reference."""

    __slots__ = ("owner", "key", "tensor", "__weakref__")

    def __init__(self, owner: SavedActivations, key: Any, tensor: Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        if self.key is not None:
            self.owner._release(self.key)


class SavedActivations:
    """Live and peak bytes of the tensors autograd saves inside the ``with`` block (storages
    counted once; parameters of ``exclude`` not counted)."""

    def __init__(self, exclude: nn.Module | None = None) -> None:
        self._model = exclude
        self._refs: dict[tuple[str, int], int] = {}
        self._bytes: dict[tuple[str, int], int] = {}
        self.live = 0
        self.peak = 0
        self._param_keys: set[tuple[str, int]] | None = None
        self._gathering = False  # ZeRO-3: parameters move between storages
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        self._patch_stage3(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patch_stage3(False)
        self._hooks.__exit__(*exc)

    def _patch_stage3(self, on: bool) -> None:
        """ZeRO-3 packs saved tensors itself during a forward (its hooks hide ours): count what
        it keeps as a tensor, leave what it turns into a parameter reference to it."""
        from zerotron.zero.stage3 import coordinator_of

        coordinator = coordinator_of(self._model) if self._model is not None else None
        if coordinator is None:
            return
        self._gathering = on
        if not on:
            for name in ("_pack", "_unpack"):
                coordinator.__dict__.pop(name, None)
            return
        pack, unpack = coordinator._pack, coordinator._unpack

        def counted_pack(t: Tensor) -> Any:
            out = pack(t)
            return self._pack(t) if out is t else out

        def counted_unpack(saved: Any) -> Tensor:
            return saved.tensor if isinstance(saved, _Held) else unpack(saved)

        coordinator._pack, coordinator._unpack = counted_pack, counted_unpack

    def _pack(self, t: Tensor) -> Any:
        if t.numel() == 0 or t.device.type == "meta" or recompute.recomputing():
            return _Held(self, None, t)  # (a rerun layer's saves: the recompute's workspace)
        key = _key(t)
        if key in self._parameter_keys():  # parameters are model states
            return _Held(self, None, t)
        if key not in self._refs:
            self._refs[key] = 0
            self._bytes[key] = t.untyped_storage().nbytes()
            self.live += self._bytes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        return _Held(self, key, t)

    def _parameter_keys(self) -> set[tuple[str, int]]:
        """The parameters' storages: taken once, or at each call under ZeRO-3 (it gathers
        parameters into new storage)."""
        if self._model is None:
            return set()
        if self._param_keys is None or self._gathering:
            keys = {_key(p) for p in self._model.parameters() if p.numel()}
            if self._gathering:
                return keys
            self._param_keys = keys
        return self._param_keys

    @staticmethod
    def _unpack(held: _Held) -> Tensor:
        return held.tensor

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)


def _tensors(obj: Any) -> Iterable[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def model_states(optimizer: Any, model: nn.Module) -> dict[str, int]:
    """Bytes per kind held by an Engine's wrapped ``optimizer`` (a ZeroOptimizer or a
    MixedPrecisionOptimizer) for ``model``'s parameters (see the module docstring)."""
    seen: set[tuple[str, int]] = set()

    def count(tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, Tensor) or t.numel() == 0:
                continue
            key = _key(t)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    out = dict.fromkeys(KINDS, 0)
    sub_groups = getattr(optimizer, "sub_groups", None)
    if sub_groups is not None:  # ZeRO: flat fp32 partitions
        offloaded = getattr(optimizer, "_offloaded", None)
        if offloaded is None:
            out["master_weights"] = count(s.master for s in sub_groups)
            out["optimizer_states"] = count(_tensors(optimizer.optimizer.state))
        out["parameters"] = count(
            [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params]
        )
        out["gradients"] = count(
            [p.grad for p in params]
            + [s.grad for s in sub_groups]
            + [getattr(s.master, "grad", None) for s in sub_groups]
            # the fp32 piece being stepped (zero.masters.step_in_pieces)
            + [q.grad for g in optimizer.optimizer.param_groups for q in g["params"]]
        )
        return out
    masters = [m for m, p in zip(optimizer.master_params, optimizer.model_params) if m is not p]
    out["master_weights"] = count(masters)
    out["optimizer_states"] = count(_tensors(optimizer.optimizer.state))
    out["parameters"] = count(p.data for p in params)
    out["gradients"] = count(
        [p.grad for p in params]
        + [getattr(p, "main_grad", None) for p in params]
        + [m.grad for m in masters]
    )
    return out


class ModelStatePeaks:
    """Each kind's largest :func:`model_states` seen at the optimizer's steps and at
    :meth:`sample` calls."""

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        self.optimizer, self.model = optimizer, model
        self.peaks = dict.fromkeys(KINDS, 0)
        inner: torch.optim.Optimizer = optimizer.optimizer
        self._handle = inner.register_step_pre_hook(lambda *_: self._on_step())

    def _on_step(self) -> None:
        self.sample()

    def sample(self) -> dict[str, int]:
        now = model_states(self.optimizer, self.model)
        for k, v in now.items():
            self.peaks[k] = max(self.peaks[k], v)
        return now

    def remove(self) -> None:
        self._handle.remove()


class LossWorkspace:
    """The fused loss's buffers, live: the reused chunk buffers of the model's modules'
    ``_workspace`` (a :class:`~zerotron.kernels.ChunkWorkspace`, the LM head's; under a pipeline
    its chunks'), plus the input and weight gradients that each loss call's
    autograd node holds from its forward until its backward (several under a pipeline)."""

    def __init__(self, model: nn.Module) -> None:
        # A pipeline's StageModel registers its chunks' parameters, not their heads.
        roots = [model, *getattr(model, "chunks", [])]
        self._modules = [m for root in roots for m in root.modules()]
        self._nodes: list[Any] = []
        self.peak = 0

    def add(self, loss: Tensor) -> None:
        """A loss call's output: find its node (walking the graph), update the peak."""
        stack, visited = [loss.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in visited:
                continue
            visited.add(id(node))
            if hasattr(node, "grads"):
                self._nodes.append(node)
                break
            stack.extend(n for n, _ in node.next_functions)
        self.peak = max(self.peak, self.live())

    def live(self) -> int:
        seen: set[tuple[str, int]] = set()
        total = 0
        buffers = [
            t
            for m in self._modules
            for t in getattr(getattr(m, "_workspace", None), "_buffers", {}).values()
        ]
        self._nodes = [n for n in self._nodes if n.grads is not None]  # backward clears them
        held = [t for n in self._nodes for t in n.grads if isinstance(t, Tensor)]
        for t in buffers + held:
            if _key(t) not in seen:
                seen.add(_key(t))
                total += t.untyped_storage().nbytes()
        return total


class CommBuffers:
    """Bytes of the buffers collectives work in, the most at once: each asynchronous all-reduce,
    reduce-scatter or all-gather counts its input and output from its launch until it is waited
    for (an in-place all-reduce once; a gradient buffer reduced in place is a gradient, not
    counted). ZeRO-3's gathered parameters are reported apart (:attr:`gathered_peak`)."""

    NAMES = ("all_reduce_async", "reduce_scatter_async", "all_gather_async")

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.live = 0
        self.peak = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CommBuffers:
        from zerotron.distributed import comm

        for name in self.NAMES:
            self._saved[name] = getattr(comm, name)
            setattr(comm, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        from zerotron.distributed import comm

        for name, fn in self._saved.items():
            setattr(comm, name, fn)

    def _wrap(self, name: str, fn: Any) -> Any:
        def launched(t: Tensor, group: Any, *args: Any, **kwargs: Any) -> Any:
            pending = fn(t, group, *args, **kwargs)
            grads = {
                _key(g)
                for p in self._model.parameters()
                for g in (getattr(p, "main_grad", None), p.grad)
                if g is not None
            }
            if _key(t) in grads:
                return pending
            n, size = group.size, t.untyped_storage().nbytes()
            extra = {"all_reduce_async": 0, "reduce_scatter_async": size // n}
            nbytes = size + extra.get(name, size * n)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            wait = pending.wait
            done = False

            def waited() -> Tensor:
                nonlocal done
                out = wait()
                if not done:
                    done = True
                    self.live -= nbytes
                return out

            pending.wait = waited
            return pending

        return launched


class StepMemory:
    """Measures what ``engine`` holds through the steps run inside the ``with`` block, per
    term (:data:`TERMS`); :attr:`terms` is set when the block ends without an error.

    ``activations`` is the peak of what autograd saved; ZeRO-3's parameters count whole while
    gathered (the most elements gathered at once). On CUDA the allocator's peak statistic is
    reset when the block starts, and :attr:`cuda_max_allocated` is its value when it ends.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model: nn.Module = engine.module
        self.terms: dict[str, int] | None = None
        self.cuda_max_allocated: int | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StepMemory:
        from zerotron.zero.stage3 import coordinator_of

        model = self.model
        with contextlib.ExitStack() as setup:  # undone at once if any part fails to install
            self._states = ModelStatePeaks(self.engine.optimizer, model)
            setup.callback(self._states.remove)
            self._loss = LossWorkspace(model)
            setup.enter_context(self._watch_loss())
            setup.enter_context(self._sample_after_backward())
            self._coordinator = coordinator_of(model)
            if self._coordinator is not None:  # this step's peak, the run's restored after
                before = self._coordinator.peak_live_numel
                self._coordinator.peak_live_numel = self._coordinator.live_numel
                setup.callback(self._restore_zero3_peak, before)
            self._comm = setup.enter_context(CommBuffers(model))
            self._saved = setup.enter_context(SavedActivations(model))
            self._device = getattr(self.engine, "device", torch.device("cpu"))
            if self._device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self._device)
            self._stack = setup.pop_all()
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        states, saved, comm = self._states, self._saved, self._comm
        coordinator = self._coordinator
        zero3 = coordinator.peak_live_numel if coordinator is not None else 0
        self._stack.close()
        if kind is not None:
            return
        states.sample()  # optimizer states are made by the first step
        terms = dict(states.peaks)
        if zero3:
            itemsize = next(p.dtype for p in self.model.parameters()).itemsize
            terms["parameters"] += itemsize * zero3
        terms.update(
            activations=saved.peak,
            loss_workspace=self._loss.peak,
            comm_buffers=comm.peak,
        )
        self.terms = {t: int(terms[t]) for t in TERMS}
        if self._device.type == "cuda":
            self.cuda_max_allocated = int(torch.cuda.max_memory_allocated(self._device))

    def _restore_zero3_peak(self, before: int) -> None:
        c = self._coordinator
        c.peak_live_numel = max(before, c.peak_live_numel)

    @contextlib.contextmanager
    def _watch_loss(self) -> Any:
        """Every fused-loss call's output goes to the loss workspace: the kernel looks its
        autograd function up at each call, so it is swapped for one that reports."""
        from types import SimpleNamespace

        import zerotron.kernels.fused_cross_entropy as kernel

        function = kernel._FusedLinearCrossEntropy

        def apply(*args: Any) -> Tensor:
            out = function.apply(*args)
            self._loss.add(out)
            return out

        kernel._FusedLinearCrossEntropy = SimpleNamespace(apply=apply)
        try:
            yield
        finally:
            kernel._FusedLinearCrossEntropy = function

    @contextlib.contextmanager
    def _sample_after_backward(self) -> Any:
        """Model states after each micro-batch's backward (its gradients, before the step)."""
        engine = self.engine
        if not hasattr(engine, "_end_micro_batch"):
            yield
            return
        end = engine._end_micro_batch

        def ended() -> None:
            end()
            self._states.sample()

        engine.__dict__["_end_micro_batch"] = ended  # this instance only, while measuring
        try:
            yield
        finally:
            engine.__dict__.pop("_end_micro_batch", None)
