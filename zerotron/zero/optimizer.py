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
   this rank's gradient partition (stage 1 at the boundary, stages 2/3 every micro-batch), in
   the parameters' dtype (or ``grad_accum_dtype``), averaged over the group;
2. the partition is taken to fp32; fp16: unscale and check inf/nan; the flag is combined over
   the data-parallel group and the model-parallel ``reduce_fn``; an overflow skips the step
   leaving weights and optimizer states untouched (the scaler lowers the scale);
3. the global norm (each element counted once: chunks are disjoint across DP, ``is_counted``
   across TP/PP), clipping;
4. the torch optimizer steps the fp32 partitions (or, with offload, the
   :class:`~zerotron.zero.offload.OffloadedOptimizer` does, sub-group by sub-group);
5. parameters: stages 1/2 all-gather the updated chunks (cast to the parameters' dtype) in
   ``allgather_bucket_size`` buckets into every rank's full parameters; stage 3 writes the chunk
   into the parameter's shard (``p.zero_shard``), to be gathered at the next forward.

The object speaks both protocols the Engine uses: MixedPrecisionOptimizer's (``step``,
``scale_loss``, ``param_groups``, ``state_dict``...) and DataParallel's (``group``, ``sync``,
``finish_grad_sync``, ``no_sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.errors import CheckpointError, ConfigError
from zerotron.precision.grads import (
    IsCounted,
    ReduceFn,
    clip_grad_norm_,
    get_grad_norm,
    has_overflow,
    unscale_and_check_overflow_,
)
from zerotron.precision.loss_scaler import LossScaler, ScalesLoss
from zerotron.precision.mixed import StepResult
from zerotron.zero.grads import GradReducer
from zerotron.zero.masters import (
    ParamInfo,
    SubGroup,
    build_partitions,
    check_args,
    load_master_chunk,
    step_in_pieces,
)
from zerotron.zero.memory import memory_report
from zerotron.zero.offload import OffloadedOptimizer, OffloadOptions, ParamStore
from zerotron.zero.partition import BucketLayout, build_buckets
from zerotron.zero.stage3 import (
    ParamCoordinator,
    coordinator_of,
    modified_parameters,
    partition_parameters,
    write_shard,
)


class ZeroOptimizer(ScalesLoss):
    """ZeRO stages 1, 2 and 3 around a fresh torch optimizer (see the module docstring and
    ``notes/zero_api.md``).

    Args:
        model: the module whose parameters ``optimizer`` was built over (names for the
            checkpoint layout; stage 3 hooks).
        optimizer: a fresh elementwise torch optimizer, possibly with param groups.
        stage: 1, 2 or 3.
        group: the data-parallel group.
        loss_scaler: fp16 dynamic/static scaler; None for bf16/fp32.
        clip_grad, norm_type: global gradient-norm clipping (0 disables).
        reduce_fn, is_counted: as :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer`,
            for the model-parallel group (the data-parallel sum is added here).
        reduce_bucket_size, allgather_bucket_size: elements per bucket of the gradient
            reduce-scatter and of the parameter all-gather (reduce: None for
            :func:`default_sizes`).
        overlap_comm: launch gradient buckets asynchronously during backward.
        reduce_scatter: False all-reduces gradient buckets instead (DeepSpeed's option).
        sub_group_size: elements per flat fp32 master (per optimizer step piece; offload streams
            one at a time); None for :func:`default_sizes`.
        offload_optimizer, offload_param: :class:`~zerotron.zero.offload.OffloadOptions`.
        communication_data_type: the gradient wire dtype (default: the parameters').
        grad_accum_dtype: dtype of the gradient partitions that micro-batches accumulate into
            (DeepSpeed's ``data_types.grad_accum_dtype``; default: the parameters'; at stage 3
            without offload the wire dtype for one micro-batch and fp32 from the second on,
            see :meth:`_new_grad_partition`; fp32 keeps bf16 sums exact at 2 more bytes per
            element per rank).
        gradient_predivide_factor, prescale_gradients: DeepSpeed's averaging options.

    ``contiguous_gradients``, ``round_robin_gradients``, ``prefetch_bucket_size``,
    ``param_persistence_threshold``, ``max_live_parameters``, ``max_reuse_distance`` and
    ``gather_16bit_weights_on_model_save`` are accepted for DeepSpeed's config; the gradient
    partitions are contiguous by construction and the stage-3 ones belong to
    :mod:`zerotron.zero.stage3`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        group: Group,
        loss_scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        norm_type: float = 2.0,
        reduce_fn: ReduceFn | None = None,
        is_counted: IsCounted | None = None,
        reduce_bucket_size: int | None = None,
        allgather_bucket_size: int = int(5e8),
        overlap_comm: bool = True,
        reduce_scatter: bool = True,
        contiguous_gradients: bool = True,
        round_robin_gradients: bool = False,
        offload_optimizer: OffloadOptions | None = None,
        offload_param: OffloadOptions | None = None,
        sub_group_size: int | None = None,
        prefetch_bucket_size: int | None = None,
        param_persistence_threshold: int = int(1e5),
        max_live_parameters: int = int(1e9),
        max_reuse_distance: int = int(1e9),
        gather_16bit_weights_on_model_save: bool = False,
        communication_data_type: torch.dtype | None = None,
        gradient_predivide_factor: float = 1.0,
        prescale_gradients: bool = False,
        grad_accum_dtype: torch.dtype | None = None,
    ):
        reduce_bucket_size, sub_group_size = default_sizes(
            stage, reduce_bucket_size, sub_group_size
        )
        check_args(optimizer, stage, clip_grad, sub_group_size, gradient_predivide_factor)
        self.model = model
        self.optimizer = optimizer
        self.stage = stage
        self.group = group
        self.loss_scaler = loss_scaler
        self.clip_grad = float(clip_grad)
        self.norm_type = float(norm_type)
        self.reduce_fn = reduce_fn
        self.num_skipped_steps = 0
        self.gather_16bit_weights_on_model_save = gather_16bit_weights_on_model_save
        self.offload_optimizer = offload_optimizer
        self.offload_param = offload_param
        self.grad_accum_dtype = grad_accum_dtype
        self.coordinator: ParamCoordinator | None = None
        """Stage 3's :class:`~zerotron.zero.stage3.ParamCoordinator` (partitions and gathers)."""
        if stage == 3:
            self.coordinator = self._partition_model(
                param_persistence_threshold, prefetch_bucket_size, max_live_parameters
            )

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
        self.check_overflow = loss_scaler is not None or any(
            p.dtype == torch.float16 for p in self.model_params
        )
        self._rebuild_param_groups()
        self._offloaded = self._make_offload(offload_optimizer)
        self.shards_are_masters = self._alias_shards_to_masters()
        """Stage 3 without offload: each shard is a view of its fp32 master (no 16-bit copy)."""
        self._promote_grads = self.shards_are_masters and grad_accum_dtype is None
        """Gradient partitions start in the wire dtype and turn fp32 on a second micro-batch
        (see :meth:`_deliver`)."""

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
            overlap=overlap_comm,
            use_reduce_scatter=reduce_scatter,
            comm_dtype=communication_data_type,
            predivide_factor=gradient_predivide_factor,
            prescale=prescale_gradients,
        )
        self._output_hook = model.register_forward_hook(self._hook_outputs)
        # Whole parameters (all of stages 1/2; stage 3's persistent ones) are refreshed by an
        # all-gather of the updated chunks after each step.
        whole = [k for k, i in enumerate(self.infos) if not i.partitioned]
        self._gather_buckets: list[BucketLayout] = build_buckets(
            [self.infos[k].shape for k in range(len(self.infos))],
            group.size,
            allgather_bucket_size,
            order=whole,
            key=lambda k: (self.infos[k].param.dtype, self.infos[k].param.device),
        )

    @torch.no_grad()
    def _load_master_chunk(self, info: ParamInfo, masters: list[Tensor] | None = None) -> None:
        """Copy this rank's chunk of the parameter's current value into its master."""
        load_master_chunk(info, (masters or [s.master for s in self.sub_groups])[info.sub_group])

    def _rebuild_param_groups(self) -> None:
        """Point the torch optimizer at the flat masters, keeping each group's settings."""
        old = self.optimizer.param_groups
        new = []
        for s in self.sub_groups:
            settings = {k: v for k, v in old[s.group_index].items() if k != "params"}
            new.append({**settings, "params": [s.master]})
        self.optimizer.param_groups.clear()
        self.optimizer.param_groups.extend(new)

    def _partition_model(
        self, threshold: int, prefetch: int | None, max_live: int
    ) -> ParamCoordinator:
        """Stage 3: partition the model's parameters over the group (unless built under
        ``zero.Init`` or partitioned already), shards in a ParamStore with ``offload_param``."""
        existing = coordinator_of(self.model)
        if existing is not None:
            if existing.group.ranks != self.group.ranks:
                raise ConfigError(
                    f"the model's parameters are partitioned over ranks "
                    f"{list(existing.group.ranks)}, ZeRO runs over {list(self.group.ranks)}",
                    where="ZeroOptimizer(stage=3)",
                    fix="build the model under zero.Init with the data-parallel group",
                )
            return existing
        store = None
        if self.offload_param is not None and self.offload_param.enabled:
            store = ParamStore(self.offload_param, rank_name=_rank_name())
        return partition_parameters(
            self.model,
            self.group,
            persistence_threshold=threshold,
            prefetch_bucket_size=prefetch,
            max_live_parameters=max_live,
            param_store=store,
        )

    def _alias_shards_to_masters(self) -> bool:
        """Stage 3 with resident masters: make each parameter's shard (``p.zero_shard``) a view
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
                info.param.zero_shard = master[info.offset : info.offset + info.chunk]
        return True

    def _make_offload(self, options: OffloadOptions | None) -> OffloadedOptimizer | None:
        """The OffloadedOptimizer that keeps masters and states on the host or in files."""
        if options is None or not options.enabled:
            return None
        return OffloadedOptimizer(self.optimizer, options, rank_name=_rank_name())

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
        out = []
        for p in params:
            info = self._info_of[id(p)]
            sub = self.sub_groups[info.sub_group]
            if sub.grad is None:
                sub.grad = self._new_grad_partition(sub)
            else:
                self._promote_grad(sub)  # sums over another group stay exact
            out.append(sub.grad[info.offset : info.offset + info.chunk])
        return out

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
        scaled = self.loss_scaler is not None and self.loss_scaler.loss_scale != 1.0
        # Unscaling needs fp32 copies; otherwise the partitions are read as they are.
        grads = self._fp32_grads() if scaled or self._offloaded is not None else self._grads()
        overflow = False
        if scaled:
            inv = 1.0 / self.loss_scaler.loss_scale
            overflow = unscale_and_check_overflow_(grads, inv, reduce_fn=self._reduce)
        elif self.check_overflow:
            overflow = has_overflow(grads, reduce_fn=self._reduce)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if overflow:
            self.num_skipped_steps += 1
            self.zero_grad()
            return StepResult(False, None, None)

        grad_norm = get_grad_norm(
            self._counted_grads(grads), self.norm_type, reduce_fn=self._reduce
        )
        clip = self.clip_grad > 0 and self.clip_grad / (float(grad_norm) + 1e-6) < 1.0
        if clip and self._offloaded is not None:
            clip_grad_norm_(grads, self.clip_grad, total_norm=grad_norm)
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
                step_in_pieces(self.optimizer, k, s.master, self._piece_grad(s, clip_norm))
                s.grad = None  # this sub-group's gradient is spent
            return [s.master for s in self.sub_groups]
        updated: list[Tensor] = [s.master for s in self.sub_groups]

        def keep(i: int, master: Tensor) -> None:
            if self._on_nvme:  # the master is a pool buffer: valid only now
                updated[i] = master.to(self.sub_groups[i].dtype, copy=True)

        self._offloaded.step(self._fp32_grads(), on_updated=keep)
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
                clip_grad_norm_([g], self.clip_grad, total_norm=clip_norm)
            return g

        return grad_of

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: full ones, partitions, masters' (partitions are reallocated at
        the next reduction, so between steps a rank holds no gradient memory)."""
        for p in self.model_params:
            p.grad = None
        for s in self.sub_groups:
            s.grad = None
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

    @torch.no_grad()
    def _deliver(self, layout: BucketLayout, row: Tensor) -> None:
        """Add a bucket's reduced row into the gradient partitions."""
        dsts, srcs = [], []
        later_microbatch = self.reducer.reduced_since_step
        for slot, view in zip(layout.slots, layout.row_views(row)):
            info = self._grad_order[slot.index]
            sub = self.sub_groups[info.sub_group]
            if sub.grad is None:
                sub.grad = self._new_grad_partition(sub, row.dtype)
            elif later_microbatch:
                self._promote_grad(sub)  # a second micro-batch is summed in fp32
            dsts.append(sub.grad[info.offset : info.offset + info.chunk])
            srcs.append(view)  # foreach add casts to the partition's dtype
        torch._foreach_add_(dsts, srcs)

    def _new_grad_partition(self, sub: SubGroup, wire: torch.dtype | None = None) -> Tensor:
        """Zeros for ``sub``'s gradient: ``grad_accum_dtype``, else the parameters' dtype.

        Stage 3 with one copy of the partition (:attr:`shards_are_masters`) and no
        ``grad_accum_dtype`` keeps the first micro-batch's reduced rows in their ``wire``
        dtype: bf16 rows stored as bf16 are the very values an fp32 partition would hold
        (0 + x is exact), at half the bytes. A second micro-batch's rows are summed in fp32
        (:meth:`_deliver` promotes the partition first), so accumulation stays exact: without
        accumulation the rank holds 14 bytes per element of its partition, with it the ZeRO
        paper's 16 (4 master + 4 gradient + 8 Adam); the step's results are the same bits.
        """
        if self._promote_grads:
            dtype = wire if wire is not None else torch.float32
        else:
            dtype = self.grad_accum_dtype or sub.dtype
        return torch.zeros(sub.numel, dtype=dtype, device=sub.device)

    def _promote_grad(self, sub: SubGroup) -> None:
        """Turn a wire-dtype partition (see :meth:`_new_grad_partition`) fp32, exactly."""
        if self._promote_grads and sub.grad is not None and sub.grad.dtype != torch.float32:
            sub.grad = sub.grad.float()

    def _grads(self) -> list[Tensor]:
        """Every sub-group's gradient partition as it is (zeros where nothing was reduced)."""
        for s in self.sub_groups:
            if s.grad is None:
                s.grad = self._new_grad_partition(s)
        return [s.grad for s in self.sub_groups]

    def _fp32_grads(self) -> list[Tensor]:
        """Every sub-group's gradient in fp32, kept as the partition (so an in-place unscale
        reaches the step; zeros where nothing was reduced)."""
        grads = []
        for s in self.sub_groups:
            g = s.grad if s.grad is not None else torch.zeros(s.numel, device=s.device)
            s.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(s.grad)
        return grads

    def _counted_grads(self, grads: list[Tensor]) -> list[Tensor]:
        """The gradient elements this rank counts in the norm (its chunks of counted params)."""
        out = []
        for s, g in zip(self.sub_groups, grads):
            infos = [self.infos[k] for k in s.params]
            if all(i.counted for i in infos):
                out.append(g)
            else:
                out.extend(g[i.offset : i.offset + i.chunk] for i in infos if i.counted)
        return out

    @torch.no_grad()
    def _publish_params(self, updated: list[Tensor]) -> None:
        """Write the updated values (one flat tensor per sub-group) into the model: shards
        (stage 3) and, for whole parameters, all-gathers of the chunks."""
        if self.coordinator is not None:
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
        """This rank's ZeRO file (``docs/zero-optimizer.md``): optimizer state over the flat
        masters, the masters themselves and the layout that maps them to parameters.

        Without offload the tensors are the live ones (as torch optimizers do): serialize
        them before the next step."""
        if self._offloaded is not None:
            sd = self._offloaded.state_dict()
            optimizer_state, masters = sd["optimizer"], sd["fp32_partitions"]
        else:
            optimizer_state = self.optimizer.state_dict()
            masters = [s.master for s in self.sub_groups]
        return {
            "zero_stage": self.stage,
            "dp_rank": self.group.rank,
            "dp_size": self.group.size,
            "optimizer": optimizer_state,
            "fp32_partitions": masters,
            "layout": [
                {
                    "name": i.name,
                    "shape": list(i.shape),
                    "numel": i.numel,
                    "chunk": i.chunk,
                    "start": i.start,
                    "length": i.length,
                    "partition": i.sub_group,
                    "offset": i.offset,
                }
                for i in self.infos
            ],
            "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "num_skipped_steps": self.num_skipped_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's file of the same layout; parameters are then rebuilt from the
        loaded masters (a collective: every rank of the group loads)."""
        mine = [(i.name, i.numel, i.chunk, i.sub_group, i.offset) for i in self.infos]
        saved = [
            (e["name"], e["numel"], e["chunk"], e["partition"], e["offset"])
            for e in state.get("layout", [])
        ]
        if state.get("dp_size") != self.group.size or saved != mine:
            raise CheckpointError(
                f"the ZeRO partition file (dp_size {state.get('dp_size')}, "
                f"{len(saved)} parameters) does not fit this run (dp_size {self.group.size}, "
                f"{len(mine)} parameters) or its layout differs",
                where=f"zero dp rank {self.group.rank}",
                fix="resume with the same data-parallel size, model and parameter grouping, "
                "or consolidate with zero-to-fp32 and load the weights only",
            )
        masters = state["fp32_partitions"]
        if self._offloaded is not None:
            self._offloaded.load_state_dict(
                {"optimizer": state["optimizer"], "fp32_partitions": masters}
            )
        else:
            for s, t in zip(self.sub_groups, masters, strict=True):
                s.master.copy_(t)
            self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state.get("grad_scaler") is not None:
            self.loss_scaler.load_state_dict(state["grad_scaler"])
        self.num_skipped_steps = int(state.get("num_skipped_steps", 0))
        self._publish_params(list(masters))

    # ---- introspection --------------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: ``params``, ``grads``, ``optimizer_states`` (fp32
        masters and the optimizer's state), and ``total``; see :mod:`zerotron.zero.memory`."""
        return memory_report(self)

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        self._output_hook.remove()


STAGE3_REDUCE_BUCKET_SIZE = int(4e6)
STAGE3_SUB_GROUP_SIZE = int(2e6)


def default_sizes(
    stage: int, reduce_bucket_size: int | None, sub_group_size: int | None
) -> tuple[int, int]:
    """``(reduce_bucket_size, sub_group_size)``, zerotron's defaults where None.

    Stages 1-2 take DeepSpeed's (5e8, 1e9). Stage 3, the stage chosen for memory, takes pieces
    of a few MB (4e6 gradient elements per reduce-scatter, 2e6 per sub-group): gradients are
    reduced and their fp32 partitions allocated a bucket at a time during backward, into the
    memory the freed activations leave, rather than all at once at its end in fresh pages
    (``bench/zero.py``: peak RSS 0.93-0.96x of FSDP2's against 1.07x with DeepSpeed's sizes).
    A DeepSpeed config always gets DeepSpeed's defaults.
    """
    if reduce_bucket_size is None:
        reduce_bucket_size = STAGE3_REDUCE_BUCKET_SIZE if stage == 3 else int(5e8)
    if sub_group_size is None:
        sub_group_size = STAGE3_SUB_GROUP_SIZE if stage == 3 else int(1e9)
    return reduce_bucket_size, sub_group_size


def _tensors(output: Any) -> list[Tensor]:
    """The tensors in a module's output (a tensor, or nested tuples, lists and dicts)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def _rank_name() -> str:
    """This process's name for offload files (one directory per process)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank{rank}"
