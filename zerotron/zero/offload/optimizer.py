"""The offloaded optimizer: a torch optimizer stepping fp32 master sub-groups kept on the host
or on NVMe, bitwise as it would step them in place.

``cpu`` keeps masters and states in host memory and steps there; ``nvme`` keeps them in files
(:mod:`~zerotron.zero.offload.swap`) and streams them through ``buffer_count`` pool slots
(:mod:`~zerotron.zero.offload.pinned_pool`), one sub-group per slot, reading the next sub-groups
and writing the previous ones on a background thread while the current one steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from zerotron.errors import CheckpointError
from zerotron.zero.offload.pinned_pool import PoolSlot
from zerotron.zero.offload.swap import NVMeSwapper, TensorSpec, default_rank_name
from zerotron.zero.options import OffloadOptions

_SAME_LAYOUT = "load with the data-parallel size and sub_group_size the checkpoint was saved with"


class MasterView(NamedTuple):
    """One sub-group's fp32 master as :meth:`OffloadedOptimizer.masters` yields it.

    ``resident`` is False when ``tensor`` is a pool buffer (``nvme``): valid until the
    iteration moves on, and writing into it changes nothing.
    """

    index: int
    tensor: torch.Tensor
    resident: bool


class _Record(NamedTuple):
    """What a swapped-out sub-group keeps in memory."""

    order: list[str]  # the state dict's keys in torch's order
    swapped: list[str]  # keys whose tensors live in the state file (shaped like the master)
    small: dict[str, Any]  # the rest (Adam's "step" tensor, flags), kept here


Grads = Sequence[torch.Tensor | None] | Mapping[int, torch.Tensor]


class OffloadedOptimizer:
    """Steps ``optimizer`` with its masters and states where ``options.device`` says.

    ``optimizer`` is a torch optimizer (Adam, AdamW, SGD) whose ``param_groups`` hold the
    rank's fp32 master sub-groups, built by the caller. Index ``i`` below is a master's
    position in ``[p for g in optimizer.param_groups for p in g["params"]]`` (the order of
    torch's state dict). The optimizer keeps its identity and hyper-parameters: LR schedulers
    keep writing ``param_groups[k]["lr"]``.

    - ``none``: nothing moves; :meth:`step` is ``optimizer.step()``.
    - ``cpu``: masters (and any existing state) move to host memory, pinned with
      ``pin_memory``; gradients are copied to the host and cast to the master dtype before
      the step; torch's CPU kernels step there.
    - ``nvme``: masters and states go to files; each master tensor object stays in
      ``param_groups`` as an empty placeholder (``numel() == 0``) and gets its storage back only
      while resident. :meth:`step` streams the sub-groups that have gradients through
      ``buffer_count`` slots: read master + state (background thread), step that one sub-group
      (the other groups' ``params`` lists are emptied for the call, so nothing else is
      touched), write back (background thread). Scalar state (Adam's per-tensor ``step``)
      stays in memory. Use :meth:`state_dict`, not ``optimizer.state_dict()``.

    Do not keep other references to the masters' storage: with ``nvme`` that is what would
    keep them in memory. Call :meth:`close` when done (deletes the swap files).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        options: OffloadOptions,
        *,
        rank_name: str | None = None,
        where: str = "zero_optimization.offload_optimizer",
    ):
        options.validate(where)
        rank_name = rank_name or default_rank_name()
        self.optimizer = optimizer
        self.options = options
        self.device = options.device
        self._params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self._group_of = [k for k, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self._specs = [TensorSpec(p.dtype, p.shape) for p in self._params]
        self._pin = options.pin_memory and torch.cuda.is_available()
        self._swapper: NVMeSwapper | None = None
        self._records: dict[int, _Record] = {}
        self._inflight: dict[int, list[torch.Tensor]] = {}  # tensors handed to pending writes
        self._io: ThreadPoolExecutor | None = None
        self._slots: list[PoolSlot] = []
        self._placeholders: list[torch.Tensor] = []
        if self.device == "cpu":
            for p in self._params:
                p.data = self._to_host(p.data)
                for k, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        optimizer.state[p][k] = v.to("cpu")
        elif self.device == "nvme":
            self._swapper = NVMeSwapper(
                options.nvme_path, f"{rank_name}.optimizer", where=f"{where}.nvme_path"
            )
            self._slots = [PoolSlot(self._pin) for _ in range(options.buffer_count)]
            self._placeholders = [torch.empty(0, dtype=p.dtype) for p in self._params]
            for i, p in enumerate(self._params):
                state = optimizer.state.pop(p, None)
                self._write(i, p.data.detach(), state)
                p.data = self._placeholders[i]

    # ---- public API ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._params)

    def shape(self, index: int) -> torch.Size:
        """The shape of master ``index`` (with ``nvme`` the tensor itself is a placeholder)."""
        return self._specs[index].shape

    def step(
        self,
        grads: Grads | None = None,
        on_updated: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """One optimizer step.

        Args:
            grads: master ``i``'s gradient as ``grads[i]`` (a list in index order, or a dict;
                None or missing = no gradient, and, as in torch, no update for that
                sub-group). Any device and float dtype: cast to the master's. With
                ``none``/``cpu`` it may be omitted to use the ``.grad`` already set on the
                masters. The ``.grad`` fields this method sets are cleared again.
            on_updated: called as ``on_updated(i, master)`` for each stepped sub-group right
                after its update while it is resident (with ``nvme`` the only moment it is),
                so the caller can copy it into its 16-bit parameters without reading it back.
        """
        if grads is None and self.device == "nvme":
            raise ValueError("OffloadedOptimizer.step: nvme offload needs grads passed in")
        if grads is not None:
            grads = self._grad_list(grads)
        if self.device == "nvme":
            self._step_nvme(grads, on_updated)
            return
        if grads is not None:
            for p, g in zip(self._params, grads):
                p.grad = None if g is None else self._grad_for(p, g)
        stepped = [i for i, p in enumerate(self._params) if p.grad is not None]
        try:
            self.optimizer.step()
        finally:
            if grads is not None:
                for p in self._params:
                    p.grad = None
        if on_updated is not None:
            for i in stepped:
                on_updated(i, self._params[i].data)

    def masters(self) -> Iterator[MasterView]:
        """Every master in index order. With ``nvme`` each is read into a pool slot (the next
        ones are read ahead) and is valid only until the iteration advances."""
        if self.device != "nvme":
            for i, p in enumerate(self._params):
                yield MasterView(i, p.data, True)
            return
        for i, tensors in self._stream(range(len(self._params)), with_state=False):
            yield MasterView(i, tensors[0], False)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": torch's Optimizer.state_dict() format, "fp32_partitions": [master
        per index]}``, all tensors on the CPU, the same whatever the device: a checkpoint
        written with one device loads with any other. Only tensors, numbers, strings, lists,
        tuples and dicts (``torch.load(weights_only=True)`` reads it). With ``none``/``cpu``
        the tensors are the live ones (save or clone them before the next step); with
        ``nvme`` they are fresh copies (the whole state in memory at once, as a save needs).
        """
        sd = self.optimizer.state_dict()
        if self.device != "nvme":
            sd["state"] = {i: {k: _cpu(v) for k, v in s.items()} for i, s in sd["state"].items()}
            return {"optimizer": sd, "fp32_partitions": [p.detach().cpu() for p in self._params]}
        state: dict[int, dict[str, Any]] = {}
        masters = []
        for i in range(len(self._params)):
            masters.append(self._swapper.swap_in(self._master_key(i)))
            rec = self._records.get(i)
            if rec is None:
                continue
            tensors = {k: v.clone() if torch.is_tensor(v) else v for k, v in rec.small.items()}
            if rec.swapped:
                tensors.update(zip(rec.swapped, self._swapper.swap_in(self._state_key(i))))
            state[i] = {k: tensors[k] for k in rec.order}
        sd["state"] = state
        return {"optimizer": sd, "fp32_partitions": masters}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (from any device). Tensors are copied: the
        caller's dict is not aliased."""
        masters = sd["fp32_partitions"]
        self._check_masters(masters)
        osd = sd["optimizer"]
        state = {
            int(i): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in osd["state"].items()
        }
        if self.device != "nvme":
            for p, m in zip(self._params, masters):
                p.data.copy_(m)
            self.optimizer.load_state_dict({**osd, "state": state})
            return
        self.optimizer.load_state_dict({**osd, "state": {}})  # hyper-parameters, group sizes
        self._records.clear()
        for i, p in enumerate(self._params):
            s = state.get(i)
            if s is not None:
                s = {k: _cast_like_torch(k, v, p.dtype) for k, v in s.items()}
            self._write(i, masters[i].to(p.dtype), s)
            self.optimizer.state.pop(p, None)

    def load_masters(self, masters: Sequence[torch.Tensor]) -> None:
        """Replace the master values only (optimizer state untouched), e.g. after the model's
        weights were loaded; ``masters[i]`` any device and float dtype, cast to the master's."""
        self._check_masters(masters)
        for i, (p, m) in enumerate(zip(self._params, masters)):
            if self.device == "nvme":
                self._swapper.swap_out(self._master_key(i), m.to("cpu", p.dtype))
            else:
                p.data.copy_(m)

    def _check_masters(self, masters: Sequence[torch.Tensor]) -> None:
        if len(masters) != len(self._params):
            raise CheckpointError(
                f"checkpoint has {len(masters)} fp32 partitions, this rank has "
                f"{len(self._params)} sub-groups",
                fix=_SAME_LAYOUT,
            )
        for i, (m, s) in enumerate(zip(masters, self._specs)):
            if m.shape != s.shape:
                raise CheckpointError(
                    f"fp32 partition {i} has shape {tuple(m.shape)}, expected {tuple(s.shape)}",
                    fix=_SAME_LAYOUT,
                )

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor of masters and optimizer states in memory now: the masters and state
        with ``none``/``cpu``; with ``nvme`` the pool slots (which hold the resident
        sub-groups), scalar state and tensors waiting to be written. Safe to call from
        ``on_updated``."""
        out = [slot.buf for slot in self._slots if slot.buf is not None]
        for p in self._params:
            out.append(p.data)
            out += [v for v in self.optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
        for rec in list(self._records.values()):
            out += [v for v in rec.small.values() if torch.is_tensor(v)]
        for ts in list(self._inflight.values()):
            out += ts
        return out

    def resident_state_bytes(self) -> int:
        """Bytes of :meth:`resident_tensors`, each storage counted once."""
        seen: dict[int, int] = {}
        for t in self.resident_tensors():
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        seen.pop(0, None)  # empty tensors
        return sum(seen.values())

    def total_state_bytes(self) -> int:
        """Bytes of all masters and optimizer states, wherever they are."""
        if self.device != "nvme":
            return self.resident_state_bytes()
        total = sum(s.nbytes for s in self._specs)
        for i, rec in list(self._records.items()):
            total += self._swapper.nbytes(self._state_key(i)) if rec.swapped else 0
            total += sum(
                v.untyped_storage().nbytes()
                for v in rec.small.values()
                if isinstance(v, torch.Tensor)
            )
        return total

    def bytes_on_disk(self) -> int:
        return 0 if self._swapper is None else self._swapper.bytes_on_disk()

    def close(self) -> None:
        """Stop the I/O thread and delete the swap files (the optimizer is unusable after)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._swapper is not None:
            self._swapper.cleanup()

    # ---- cpu -------------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and (not self._pin or t.is_pinned()):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        host.copy_(t)
        return host

    def _grad_for(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if g.device != p.device and p.device.type == "cpu":
            # Copy the (maybe 16-bit) gradient as it is, through pinned memory; cast on the host.
            host = torch.empty(g.shape, dtype=g.dtype, pin_memory=self._pin)
            host.copy_(g)
            g = host
        return g.to(device=p.device, dtype=p.dtype).view(p.shape)

    def _grad_list(self, grads: Grads) -> list[torch.Tensor | None]:
        n = len(self._params)
        if isinstance(grads, Mapping):
            bad = [i for i in grads if not 0 <= i < n]
            if bad:
                raise IndexError(f"grads for sub-groups {bad}: there are {n}")
            return [grads.get(i) for i in range(n)]
        grads = list(grads)
        if len(grads) != n:
            raise ValueError(f"{len(grads)} grads for {n} sub-groups")
        return grads

    # ---- nvme ------------------------------------------------------------------------------

    @staticmethod
    def _master_key(i: int) -> str:
        return f"master{i}"

    @staticmethod
    def _state_key(i: int) -> str:
        return f"state{i}"

    def _write(self, i: int, master: torch.Tensor, state: Mapping[str, Any] | None) -> None:
        """Swap out sub-group ``i``: master to its file, full-size state tensors to another."""
        self._swapper.swap_out(self._master_key(i), master)
        if not state:
            self._records.pop(i, None)
            self._swapper.release(self._state_key(i))
            return
        shape = self._specs[i].shape
        order = list(state)
        swapped = [
            k for k in order if isinstance(state[k], torch.Tensor) and state[k].shape == shape
        ]
        small = {k: state[k] for k in order if k not in swapped}
        if swapped:
            self._swapper.swap_out(self._state_key(i), [state[k] for k in swapped])
        else:
            self._swapper.release(self._state_key(i))
        self._records[i] = _Record(order, swapped, small)

    def _executor(self) -> ThreadPoolExecutor:
        if self._io is None:  # one thread: tasks run in submission order, which the slots rely on
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotron-swap")
        return self._io

    def _carve(self, i: int, slot: PoolSlot, with_state: bool) -> list[torch.Tensor]:
        # On the main thread, so slots come from the same malloc arena as torch's own
        # allocations (the first step's fresh state): freed memory gets reused, RSS stays flat.
        specs = [self._specs[i]]
        rec = self._records.get(i)
        if with_state and rec is not None and rec.swapped:
            specs += self._swapper.specs(self._state_key(i))
        return slot.carve(specs)

    def _read(self, i: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self._swapper.swap_in(self._master_key(i), tensors[0])
        if len(tensors) > 1:
            self._swapper.swap_in(self._state_key(i), tensors[1:])
        return tensors

    def _stream(
        self, indices: Sequence[int], with_state: bool
    ) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Yield ``(i, [master, *swapped state])`` for each index, reading up to
        ``buffer_count - 1`` ahead. The consumer may submit writes for ``i`` before advancing:
        the next read into the same slot is queued behind them on the one I/O thread."""
        io, nslots = self._executor(), len(self._slots)
        indices = list(indices)
        reads: dict[int, Future] = {}

        def submit(k: int) -> None:
            if k < len(indices):
                tensors = self._carve(indices[k], self._slots[k % nslots], with_state)
                reads[k] = io.submit(self._read, indices[k], tensors)

        for k in range(nslots - 1):
            submit(k)
        try:
            for k, i in enumerate(indices):
                submit(k + nslots - 1)  # into the slot of k-1, after k-1's writes
                tensors = reads.pop(k).result()
                yield i, tensors
                del tensors
        finally:
            for f in reads.values():  # stop cleanly on error or an abandoned generator
                f.cancel()
            for f in reads.values():
                with contextlib.suppress(Exception):
                    if not f.cancelled():
                        f.result()

    def _step_nvme(
        self,
        grads: list[torch.Tensor | None],
        on_updated: Callable[[int, torch.Tensor], None] | None,
    ) -> None:
        io = self._executor()
        writes: list[Future] = []
        groups = self.optimizer.param_groups
        saved_params = [g["params"] for g in groups]
        todo = [i for i, g in enumerate(grads) if g is not None]
        try:
            for g in groups:
                g["params"] = []
            with contextlib.closing(self._stream(todo, with_state=True)) as stream:
                for i, tensors in stream:
                    master, state = self._step_one(i, tensors, grads[i], on_updated)
                    self._inflight[i] = [master, *(v for v in state.values() if torch.is_tensor(v))]
                    writes.append(io.submit(self._write_inflight, i, master, state))
                    del tensors, master, state  # the write task holds them until written
        finally:
            for g, ps in zip(groups, saved_params):
                g["params"] = ps
            errors = []
            for f in writes:
                try:
                    f.result()
                except Exception as e:  # report the first; the rest are usually the same disk
                    errors.append(e)
            if errors:
                raise errors[0]

    def _step_one(
        self,
        i: int,
        tensors: list[torch.Tensor],
        grad: torch.Tensor,
        on_updated: Callable[[int, torch.Tensor], None] | None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Step resident sub-group ``i`` alone; return its master and state to write back."""
        p, rec, group = self._params[i], self._records.get(i), self._group_of[i]
        p.data = tensors[0]
        try:
            if rec is not None:
                swapped = dict(zip(rec.swapped, tensors[1:]))
                self.optimizer.state[p] = {
                    k: swapped[k] if k in swapped else rec.small[k] for k in rec.order
                }
            p.grad = self._grad_for(p, grad)
            self.optimizer.param_groups[group]["params"] = [p]
            self.optimizer.step()
            if on_updated is not None:
                on_updated(i, p.data)
            return p.data, self.optimizer.state.pop(p, {})
        finally:
            self.optimizer.param_groups[group]["params"] = []
            self.optimizer.state.pop(p, None)
            p.grad = None
            p.data = self._placeholders[i]

    def _write_inflight(self, i: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        try:
            self._write(i, master, state)
        finally:
            self._inflight.pop(i, None)


def _cpu(v: Any) -> Any:
    return v.cpu() if isinstance(v, torch.Tensor) else v


def _cast_like_torch(key: str, v: Any, dtype: torch.dtype) -> Any:
    # torch's Optimizer.load_state_dict casts floating state to the param's dtype, except "step".
    if isinstance(v, torch.Tensor) and key != "step" and v.is_floating_point():
        return v.to(device="cpu", dtype=dtype)
    return v.cpu() if isinstance(v, torch.Tensor) else v
