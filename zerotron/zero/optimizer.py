"""ZeroOptimizer: ZeRO stages 1-3 over any elementwise torch optimizer.

Each data-parallel rank owns chunk r of every parameter (:mod:`zerotron.zero.partition`) and
keeps, for those chunks only, the fp32 master weights and the optimizer states. The rank's
chunks are laid out in a few flat fp32 tensors, *sub-groups* of at most ``sub_group_size``
elements (one per run of parameters of one torch param group and dtype); the wrapped torch
optimizer steps those flat tensors. That is only correct for elementwise optimizers (Adam,
AdamW, SGD, ...): a flat tensor made of many parameters' pieces is stepped exactly like the
pieces would be. Others (LAMB's per-tensor trust ratio) are refused.

One step:

1. gradients: :class:`~zerotron.zero.grads.GradReducer` has reduce-scattered every bucket into
   this rank's gradient partitions (:class:`~zerotron.zero.grads.GradPartitions`; stage 1 at
   the boundary, stages 2/3 every micro-batch), in the parameters' dtype (or
   ``grad_accum_dtype``), averaged over the group;
2. the partition is taken to fp32; fp16: unscale and check inf/nan; the flag is combined over
   the data-parallel group and the model-parallel ``reduce_fn``; an overflow skips the step
   leaving weights and optimizer states untouched (the scaler lowers the scale);
3. the global norm (each element counted once: chunks are disjoint across DP, ``is_counted``
   across TP/PP), clipping (steps 2-3 are :class:`~zerotron.precision.step.StepSequence`'s,
   shared with the mixed-precision optimizer);
4. the torch optimizer steps the fp32 partitions (or, with offload, the
   :class:`~zerotron.zero.offload.OffloadedOptimizer` does, sub-group by sub-group);
5. parameters: stages 1/2 all-gather the updated chunks (cast to the parameters' dtype) in
   ``allgather_bucket_size`` buckets into every rank's full parameters; stage 3 writes the chunk
   into the parameter's shard (``p.ds_tensor``), to be gathered at the next forward.

The object speaks both protocols the Engine uses: MixedPrecisionOptimizer's (``step``,
``scale_loss``, ``param_groups``, ``state_dict``...) and DataParallel's (``group``, ``sync``,
``finish_grad_sync``, ``no_sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError
from zerotron.precision.grads import IsCounted, ReduceFn
from zerotron.precision.loss_scaler import LossScaler
from zerotron.precision.owners import set_owner
from zerotron.precision.step import SKIPPED, StepResult, StepSequence, checks_overflow
from zerotron.zero.grads import GradPartitions, GradReducer
from zerotron.zero.masters import (
    ParamInfo,
    SubGroup,
    build_partitions,
    check_args,
    load_master_chunk,
    step_in_pieces,
)
from zerotron.zero.memory import memory_report
from zerotron.zero.offload import OffloadedOptimizer, ParamOffloadStore
from zerotron.zero.offload.swap import default_rank_name
from zerotron.zero.options import OffloadOptions, ZeroOptions, default_sizes
from zerotron.zero.partition import BucketLayout, build_buckets
from zerotron.zero.stage3 import (
    ParamCoordinator,
    coordinator_of,
    modified_parameters,
    partition_parameters,
    write_shard,
)
from zerotron.zero.state_dict import load_zero_state_dict, zero_state_dict


class ZeroOptimizer(StepSequence):
    """ZeRO stages 1, 2 and 3 around a fresh torch optimizer (see the module docstring and
    ``notes/zero_api.md``).

    Args:
        model: the module whose parameters ``optimizer`` was built over (names for the
            checkpoint layout; stage 3 hooks).
        optimizer: a fresh elementwise torch optimizer, possibly with param groups.
        options: what ZeRO does: stage, sizes, dtypes, offload (:class:`ZeroOptions`, built
            from a config by :meth:`ZeroOptions.from_config`).
        group: the data-parallel group.
        loss_scaler: fp16 dynamic/static scaler; None for bf16/fp32.
        clip_grad, norm_type: global gradient-norm clipping (0 disables).
        reduce_fn, is_counted: as :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer`,
            for the model-parallel group (the data-parallel sum is added here).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: ZeroOptions,
        *,
        group: Group,
        loss_scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        reduce_fn: ReduceFn | None = None,
        is_counted: IsCounted | None = None,
    ):
        stage = options.stage
        reduce_bucket_size, sub_group_size = default_sizes(
            stage, options.reduce_bucket_size, options.sub_group_size
        )
        check_args(optimizer, stage, clip_grad, sub_group_size, options.gradient_predivide_factor)
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.stage = stage
        self.group = group
        self.loss_scaler = loss_scaler
        self.clip_grad = float(clip_grad)
        self.norm_type = float(norm_type)
        self.reduce_fn = reduce_fn
        self.num_skipped_steps = 0
        self.gather_16bit_weights_on_model_save = options.gather_16bit_weights_on_model_save
        """Stage 3: the Engine saves the whole 16-bit model beside the partitions."""
        self.coordinator: ParamCoordinator | None = None
        """Stage 3's :class:`~zerotron.zero.stage3.ParamCoordinator` (partitions and gathers)."""
        if stage == 3:
            self.coordinator = self._partition_model()

        self.infos, self.sub_groups = build_partitions(
            optimizer.param_groups,
            {id(p): n for n, p in model.named_parameters()},
            group,
            stage3=stage == 3,
            is_counted=is_counted,
            sub_group_size=sub_group_size,
        )
        self._info_of = {id(i.param): i for i in self.infos}
        self.model_params = [i.param for i in self.infos]
        set_owner(self.model_params, self)  # for safe_get_full_* (zerotron.zero.full_values)
        self.check_overflow = checks_overflow(loss_scaler, self.model_params)
        self._rebuild_param_groups()
        self._offloaded = self._make_offload(options.offload_optimizer)
        self.shards_are_masters = self._alias_shards_to_masters()
        """Stage 3 without offload: each shard is a view of its fp32 master (no 16-bit copy)."""
        self.grads = GradPartitions(
            self.sub_groups,
            self.infos,
            accum_dtype=options.grad_accum_dtype,
            promote=self.shards_are_masters and options.grad_accum_dtype is None,
        )
        """This rank's gradient partitions (stage 3: see :class:`GradPartitions` for the dtype)."""

        # Buckets follow the model's registration order (reversed: roughly the order backward
        # produces gradients), not the optimizer's, whose weight-decay groups would put the
        # first layer's bias in the first bucket and hold every launch back until the end.
        position = {id(p): k for k, (_, p) in enumerate(model.named_parameters())}
        self._grad_order = sorted(self.infos, key=lambda i: position.get(id(i.param), -1))
        self.reducer = GradReducer(
            [i.param for i in self._grad_order],
            group,
            self._deliver,
            every_microbatch=stage >= 2,
            bucket_size=reduce_bucket_size,
            overlap=options.overlap_comm,
            use_reduce_scatter=options.reduce_scatter,
            comm_dtype=options.communication_data_type,
            predivide_factor=options.gradient_predivide_factor,
            prescale=options.prescale_gradients,
        )
        self._output_hook = model.register_forward_hook(self._hook_outputs)
        # Whole parameters (all of stages 1/2; stage 3's persistent ones) are refreshed by an
        # all-gather of the updated chunks after each step.
        whole = [k for k, i in enumerate(self.infos) if not i.partitioned]
        self._gather_buckets: list[BucketLayout] = build_buckets(
            [self.infos[k].shape for k in range(len(self.infos))],
            group.size,
            options.allgather_bucket_size,
            order=whole,
            key=lambda k: (self.infos[k].param.dtype, self.infos[k].param.device),
        )

    @torch.no_grad()
    def _load_master_chunk(self, info: ParamInfo, masters: list[Tensor] | None = None) -> None:
        """Copy this rank's chunk of the parameter's current value into its master."""
        load_master_chunk(info, (masters or [s.master for s in self.sub_groups])[info.sub_group])

    def _rebuild_param_groups(self) -> None:
        """Point the torch optimizer at the flat masters, keeping each group's settings: one
        group per sub-group, in the groups' order. A group with no trainable parameter (HF's
        no-decay group under PEFT) stays, empty, where it was: a torch LR scheduler built over
        the optimizer before wrapping (as the HF Trainer builds one) still finds one group per
        group it knows (DeepSpeed 0.19.8 drops it, and torch's scheduler then fails at its first
        step). ``_group_slot[k]``: sub-group k's group index."""
        old = self.optimizer.param_groups
        new: list[dict[str, Any]] = []
        self._group_slot: list[int] = []
        for g, group in enumerate(old):
            settings = {k: v for k, v in group.items() if k != "params"}
            subs = [s for s in self.sub_groups if s.group_index == g]
            if not subs:
                new.append({**settings, "params": []})
            for s in subs:
                self._group_slot.append(len(new))
                new.append({**settings, "params": [s.master]})
        self.optimizer.param_groups.clear()
        self.optimizer.param_groups.extend(new)

    def _partition_model(self) -> ParamCoordinator:
        """Stage 3: :func:`partition_model` with this optimizer's options and group."""
        return partition_model(self.model, self.options, self.group, where="ZeroOptimizer(stage=3)")

    def _alias_shards_to_masters(self) -> bool:
        """Stage 3 with resident masters: make each parameter's shard (``p.ds_tensor``) a view
        of its chunk of the fp32 master, so the rank keeps one copy of its partition.

        A gather casts the chunk to the parameter's dtype on the way (as FSDP2 does with its
        fp32 shards) -- the same values a 16-bit shard written from the master would hold -- and
        the step updates the shard in place. With ``offload_param`` the shards live in the param
        store and with ``offload_optimizer`` the masters move: both keep separate shards.
        """
        if self.coordinator is None or self._offloaded is not None:
            return False
        if getattr(self.coordinator, "param_store", None) is not None:
            return False
        shards = [(i, self.sub_groups[i.sub_group].master) for i in self.infos if i.partitioned]
        if any(master.device != info.param.device for info, master in shards):
            return False
        with torch.no_grad():
            for info, master in shards:
                info.param.ds_tensor = master[info.offset : info.offset + info.chunk]
        return True

    def _make_offload(self, options: OffloadOptions | None) -> OffloadedOptimizer | None:
        """The OffloadedOptimizer that keeps masters and states on the host or in files."""
        if options is None or not options.enabled:
            return None
        return OffloadedOptimizer(self.optimizer, options, rank_name=default_rank_name())

    @property
    def _on_nvme(self) -> bool:
        return self._offloaded is not None and self._offloaded.device == "nvme"

    def _hook_outputs(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """The first gradient to reach the model's output starts a backward: queue the
        reduction's end there (see ``GradReducer.queue_end_of_backward``)."""
        if not torch.is_grad_enabled():
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self.reducer.queue_end_of_backward)

    def close(self) -> None:
        """Detach the hooks and release offload files (the optimizer is unusable after)."""
        self.remove_hooks()
        if self._offloaded is not None:
            self._offloaded.close()
        store = getattr(self.coordinator, "param_store", None)
        if store is not None and hasattr(store, "close"):
            store.close()

    # ---- the Engine's DataParallel protocol -----------------------------------------------

    @property
    def sync(self) -> bool:
        """Whether this backward reduces gradients (stage 1; stages 2/3 always reduce)."""
        return self.reducer.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.reducer.sync = value

    def finish_grad_sync(self) -> None:
        """Make sure every gradient is in the partitions (the Engine calls it at the boundary).

        Stage 1 reduces here if backward did not (gradients accumulated under ``no_sync``);
        otherwise it only waits for buckets still in flight.
        """
        if self.reducer.in_flight() or (self.stage == 1 and not self.reducer.reduced_since_step):
            self.reducer.reduce_all()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside the block only accumulates (stage 1)."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def grad_partitions(self, params: Iterable[Tensor]) -> list[Tensor]:
        """This rank's reduced gradient chunks of ``params`` (views into the partitions).

        After :meth:`finish_grad_sync` full gradients are gone; a sum the Engine still owes
        over another group (sequence-parallel parameters over TP, the tied embedding over
        the first and last pipeline stages) is done on these chunks: every rank of that group
        holds the same chunk of a parameter of the same shape, and summing chunks commutes
        with the data-parallel reduction.
        """
        return self.grads.chunks(self._info_of[id(p)] for p in params)

    @torch.no_grad()
    def allreduce_grads(self, params: Iterable[Tensor], group: Group) -> None:
        """Sum the reduced gradients of ``params`` over ``group`` (see :meth:`grad_partitions`);
        one flat all-reduce."""
        chunks = self.grad_partitions(params)
        if not chunks or group.size == 1:
            return
        flat = comm.all_reduce(torch.cat(chunks), group)
        torch._foreach_copy_(chunks, list(flat.split([c.numel() for c in chunks])))

    # ---- the Engine's optimizer protocol --------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch optimizer's groups (one per sub-group): LR schedulers set lr here."""
        return self.optimizer.param_groups

    def _reduce(self, t: Tensor, op: str) -> Tensor:
        """Combine a 1-element tensor over the data-parallel group and then ``reduce_fn``."""
        t = comm.all_reduce(t, self.group, op)
        return self.reduce_fn(t, op) if self.reduce_fn is not None else t

    @torch.no_grad()
    def step(self) -> StepResult:
        """Unscale, check, clip, step the partitions, publish the parameters, zero gradients.

        Without loss scaling the checks and the norm read the gradient partitions as they are
        (16-bit ones accumulate in fp32, bit for bit what an fp32 copy gives) and each piece of
        a partition is taken to fp32 only just before the optimizer steps it
        (:func:`~zerotron.zero.masters.step_in_pieces`), so the step's temporaries stay small.
        """
        self.finish_grad_sync()
        self._reload_modified()
        # Unscaling needs fp32 copies; otherwise the partitions are read as they are.
        fp32 = self._unscales or self._offloaded is not None
        grads = self.grads.fp32() if fp32 else self.grads.as_is()
        if self._skip_on_overflow(grads, self._reduce):
            return SKIPPED
        grad_norm = self._grad_norm(self.grads.counted(grads), self._reduce)
        clip = self._clips(grad_norm)
        if clip and self._offloaded is not None:
            self._clip(grads, grad_norm)
        del grads
        updated = self._step_partitions(grad_norm if clip else None)
        self.zero_grad()
        self._publish_params(updated)
        return StepResult(True, float(grad_norm), None)

    def _step_partitions(self, clip_norm: Tensor | None) -> list[Tensor]:
        """Step the masters; return each sub-group's updated values (the masters themselves,
        or with NVMe offload copies in the parameters' dtype taken while they were resident).

        ``clip_norm``: the global norm when the gradients still have to be clipped (resident
        masters: piece by piece, as each piece is taken to fp32)."""
        if self._offloaded is None:
            for s in self.sub_groups:
                s.master.grad = None
            for k, s in enumerate(self.sub_groups):
                slot = self._group_slot[k]
                step_in_pieces(self.optimizer, slot, s.master, self._piece_grad(s, clip_norm))
                s.grad = None  # this sub-group's gradient is spent
            return [s.master for s in self.sub_groups]
        updated: list[Tensor] = [s.master for s in self.sub_groups]

        def keep(i: int, master: Tensor) -> None:
            if self._on_nvme:  # the master is a pool buffer: valid only now
                updated[i] = master.to(self.sub_groups[i].dtype, copy=True)

        self._offloaded.step(self.grads.fp32(), on_updated=keep)
        return updated

    def _piece_grad(self, s: SubGroup, clip_norm: Tensor | None) -> Callable[[int, int], Tensor]:
        """``grad_of(a, b)`` for :func:`step_in_pieces`: the fp32 gradient of ``master[a:b]``,
        unscaled (if the step unscaled ``s.grad`` in place already) and clipped."""

        def grad_of(a: int, b: int) -> Tensor:
            if s.grad is None:
                return torch.zeros(b - a, device=s.device)
            g = s.grad[a:b]
            g = g if g.dtype == torch.float32 else g.float()
            if clip_norm is not None:
                self._clip([g], clip_norm)
            return g

        return grad_of

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: full ones, partitions, masters' (partitions are reallocated at
        the next reduction, so between steps a rank holds no gradient memory)."""
        for p in self.model_params:
            p.grad = None
        self.grads.clear()
        self.reducer.reduced_since_step = False

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the masters from the model's parameters (after loading model weights)."""
        self._reload_masters(self.infos)

    def _reload_masters(self, infos: list[ParamInfo]) -> None:
        if not self._on_nvme:
            for info in infos:
                self._load_master_chunk(info)
            return
        # The masters live in files: read them all, change these chunks, write them back.
        masters = [view.tensor.clone() for view in self._offloaded.masters()]
        for info in infos:
            self._load_master_chunk(info, masters)
        self._offloaded.load_masters(masters)

    # ---- internals ------------------------------------------------------------------------

    def _reload_modified(self) -> None:
        """Stage 3: parameters rewritten behind our back (``GatheredParameters`` with a
        modifier rank, a full state dict loaded) give their new values to the masters."""
        if self.coordinator is None:
            return
        changed = modified_parameters(self.model_params)
        if changed:  # only these: the others' fp32 masters are finer than their 16-bit shards
            self._reload_masters([self._info_of[id(p)] for p in changed])
            for p in changed:
                p.zero_modified = False

    def _deliver(self, layout: BucketLayout, row: Tensor) -> None:
        """Add a bucket's reduced row into the gradient partitions."""
        self.grads.deliver(layout, row, self._grad_order, self.reducer.reduced_since_step)

    @torch.no_grad()
    def _publish_params(self, updated: list[Tensor]) -> None:
        """Write the updated values (one flat tensor per sub-group) into the model: shards
        (stage 3) and, for whole parameters, all-gathers of the chunks."""
        if self.coordinator is not None:
            self.coordinator.release_kept()  # gathered copies of the old values
            for info in self.infos:
                if info.partitioned:
                    write_shard(
                        info.param, updated[info.sub_group][info.offset : info.offset + info.chunk]
                    )
        pending = []
        for layout in self._gather_buckets:
            infos = [self.infos[s.index] for s in layout.slots]
            row = torch.zeros(
                layout.row_len, dtype=infos[0].param.dtype, device=infos[0].param.device
            )
            torch._foreach_copy_(
                layout.row_views(row),
                [updated[i.sub_group][i.offset : i.offset + i.chunk] for i in infos],
            )
            pending.append((layout, infos, comm.all_gather_async(row, self.group)))
        for layout, infos, work in pending:
            layout.unpack_into(work.wait(), [i.param.data for i in infos])

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's ZeRO file (:func:`~zerotron.zero.state_dict.zero_state_dict`).

        Without offload the tensors are the live ones (as torch optimizers do): serialize
        them before the next step."""
        return zero_state_dict(self)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's file of the same layout; parameters are then rebuilt from the
        loaded masters (a collective: every rank of the group loads)."""
        load_zero_state_dict(self, state)
        self._publish_params(list(state["fp32_partitions"]))

    # ---- introspection --------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: ``params``, ``grads``, ``optimizer_states`` (fp32
        masters and the optimizer's state), and ``total``; see :mod:`zerotron.zero.memory`."""
        return memory_report(self)

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        self._output_hook.remove()


def partition_model(
    model: nn.Module, options: ZeroOptions, group: Group, where: str = "zero stage 3"
) -> ParamCoordinator:
    """Partition ``model``'s parameters over ``group`` for stage 3 as ``options`` say (unless
    built under ``zero.Init`` or partitioned already), the shards in a ParamOffloadStore with
    ``offload_param``. Used by :class:`ZeroOptimizer` and by an Engine that runs forward passes
    only (DeepSpeed's ZeRO-3 engine without an optimizer)."""
    existing = coordinator_of(model)
    if existing is not None:
        if existing.group.ranks != group.ranks:
            raise ConfigError(
                f"the model's parameters are partitioned over ranks "
                f"{list(existing.group.ranks)}, ZeRO runs over {list(group.ranks)}",
                where=where,
                fix="build the model under zero.Init with the data-parallel group",
            )
        return existing
    store = None
    offload = options.offload_param
    if offload is not None and offload.enabled:
        store = ParamOffloadStore(offload, rank_name=default_rank_name())
    return partition_parameters(
        model,
        group,
        persistence_threshold=options.param_persistence_threshold,
        prefetch_bucket_size=options.prefetch_bucket_size,
        max_live_parameters=options.max_live_parameters,
        max_reuse_distance=options.max_reuse_distance,
        param_store=store,
    )


def _tensors(output: Any) -> list[Tensor]:
    """The tensors in a module's output (a tensor, or nested tuples, lists and dicts)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []
