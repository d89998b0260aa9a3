"""The optimizer parts of an Engine: one class per kind of optimizer wrapper, one interface.

:func:`optimizer_part` picks the part for a wrapped optimizer:

- :class:`MixedPrecisionPart` for a :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer`
  (fp32 or 16-bit parameters, whole optimizer state): gradients are reduced by a separate
  DataParallel part, and the optimizer state is saved inside the model file;
- :class:`ZeroPart` for a :class:`~zerotron.zero.ZeroOptimizer` of stage 1 or 2: it is its own
  data-parallel part, reduction leaves gradient partitions, and each rank saves its partition
  of the optimizer state in a file of its own;
- :class:`Zero3Part` for stage 3, whose parameters are partitioned too: the module's weights are
  gathered to be saved and scattered when loaded;
- :class:`ForwardOnlyPart` for :class:`NoOptimizer`, an Engine built without an optimizer
  (DeepSpeed allows one: forward passes only, the weights partitioned at stage 3).

Each method answers one question the Engine asks (see :class:`~zerotron.engine.protocols.
OptimizerPart`); the Engine itself never asks which stage it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.checkpoint.layout import DP_SIZE_KEY, ZERO_STAGE_KEY, zero_file
from zerotron.checkpoint.relayout import CheckpointFiles
from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.state import ParallelState
from zerotron.engine.checkpoint_io import (
    gathered_16bit_file,
    read_zero_partition,
    saved_zero_stage,
)
from zerotron.engine.protocols import DataParallelPart, OptimizerPart, PipelinePart
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.precision.grads import grad_of
from zerotron.precision.step import StepResult


def optimizer_part(optimizer: Any) -> OptimizerPart:
    """The part for ``optimizer``: a ZeroOptimizer has a ``stage``, anything else is whole;
    :class:`NoOptimizer` gives an Engine that runs forward passes only."""
    if isinstance(optimizer, NoOptimizer):
        return ForwardOnlyPart(optimizer)
    stage = int(getattr(optimizer, "stage", 0) or 0)
    if stage == 0:
        return MixedPrecisionPart(optimizer)
    return Zero3Part(optimizer) if stage == 3 else ZeroPart(optimizer)


class MixedPrecisionPart:
    """A whole optimizer state, gradients reduced by a separate DataParallel part."""

    zero_stage = 0
    grads_freed = False

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    # ---- the optimizer's interface --------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    @property
    def num_skipped_steps(self) -> int:
        return self.optimizer.num_skipped_steps

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def scale_loss(self, loss: Tensor) -> Tensor:
        return self.optimizer.scale_loss(loss)

    def step(self) -> StepResult:
        return self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def reload_model_params(self) -> None:
        self.optimizer.reload_model_params()

    # ---- how it fits with the other parts -------------------------------------------------

    def data_parallel(self, given: DataParallelPart | None) -> DataParallelPart | None:
        return given

    def check_pipeline(self, pipeline: PipelinePart | None) -> None:
        pass

    def allreduce_grads(self, params: Sequence[Tensor], group: Group) -> None:
        """Sum the gradients of ``params`` over ``group``: their ``main_grad`` (data parallel,
        16-bit params) or ``.grad``, all of one dtype in one flat all-reduce."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            g = grad_of(p)
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(parts, grads)])

    # ---- checkpoints ----------------------------------------------------------------------

    def module_state_dict(self, module: nn.Module, rank0_only: bool) -> dict[str, Any] | None:
        return module.state_dict()

    def load_module_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        fit: Callable[[], list[str]],
        where: str,
    ) -> list[str]:
        return fit()

    def checkpoint_entries(self) -> dict[str, Any]:
        return {}

    def save_optimizer_state(
        self, model_state: dict[str, Any], files: dict[str, Any], ps: ParallelState
    ) -> None:
        model_state["optimizer"] = self.optimizer.state_dict()

    def extra_files(self, module_state: Any, ps: ParallelState) -> dict[str, Any]:
        return {}

    def read_optimizer_state(
        self,
        files: CheckpointFiles,
        model_state: Mapping[str, Any],
        meta: Mapping[str, Any],
        where: str,
        repartition: bool,
    ) -> dict[str, Any] | None:
        saved_stage = saved_zero_stage(model_state, meta)
        if saved_stage:
            raise CheckpointError(
                f"the optimizer state is partitioned over data-parallel ranks (ZeRO stage "
                f"{saved_stage}); this engine runs without ZeRO",
                where=where,
                fix=f"resume with ZeRO stage {saved_stage}, or load weights only "
                "(load_optimizer_states=False; `zerotron zero-to-fp32` gives the fp32 weights)",
            )
        return model_state.get("optimizer")

    def load_optimizer_state(
        self,
        opt_state: dict[str, Any],
        module: nn.Module,
        refitted: Sequence[str],
        refit: Callable[[dict[str, Any]], None],
        where: str,
    ) -> None:
        if refitted:
            refit(opt_state)
        self.optimizer.load_state_dict(opt_state)


class ZeroPart(MixedPrecisionPart):
    """A ZeroOptimizer of stage 1 or 2: its own data-parallel part, one partition file per rank."""

    grads_freed = True

    def __init__(self, optimizer: Any):
        super().__init__(optimizer)
        self.zero_stage = int(optimizer.stage)

    def data_parallel(self, given: DataParallelPart | None) -> DataParallelPart | None:
        if given is None:
            return self.optimizer  # a ZeroOptimizer reduces the gradients itself
        if given is not self.optimizer:
            raise ConfigError(
                "ZeRO reduces gradients in its optimizer, but another data-parallel part "
                f"({type(given).__name__}) was given as well",
                where="Engine",
                fix="pass the ZeroOptimizer as data_parallel (or leave it None)",
            )
        return given

    def check_pipeline(self, pipeline: PipelinePart | None) -> None:
        if pipeline is not None and self.zero_stage > 1:
            raise UnsupportedError(
                f"ZeRO stage {self.zero_stage} with pipeline parallelism (as in DeepSpeed)",
                where="zero_optimization.stage",
                fix="use ZeRO stage 1 with pipeline parallelism",
            )

    def allreduce_grads(self, params: Sequence[Tensor], group: Group) -> None:
        # ZeRO has freed the full gradients: sum its partitions instead
        self.optimizer.allreduce_grads(params, group)

    def checkpoint_entries(self) -> dict[str, Any]:
        return {ZERO_STAGE_KEY: self.zero_stage, DP_SIZE_KEY: self.optimizer.group.size}

    def save_optimizer_state(
        self, model_state: dict[str, Any], files: dict[str, Any], ps: ParallelState
    ) -> None:
        files[zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank)] = self.optimizer.state_dict()

    def read_optimizer_state(
        self,
        files: CheckpointFiles,
        model_state: Mapping[str, Any],
        meta: Mapping[str, Any],
        where: str,
        repartition: bool,
    ) -> dict[str, Any] | None:
        return read_zero_partition(
            files,
            model_state,
            meta,
            where,
            stage=self.zero_stage,
            dp_size=self.optimizer.group.size,
            current_state=self.optimizer.state_dict,
            repartition=repartition,
        )

    def load_optimizer_state(
        self,
        opt_state: dict[str, Any],
        module: nn.Module,
        refitted: Sequence[str],
        refit: Callable[[dict[str, Any]], None],
        where: str,
    ) -> None:
        if refitted:
            raise CheckpointError(
                f"the vocabulary padding differs ({', '.join(refitted)}); partitioned "
                "optimizer state cannot be re-padded",
                where=where,
                fix="resume with the tensor-parallel size that saved, or load weights only "
                "(load_optimizer_states=False)",
            )
        self.optimizer.load_state_dict(opt_state)


class Zero3Part(ZeroPart):
    """Stage 3: the module's parameters are partitioned too."""

    def module_state_dict(self, module: nn.Module, rank0_only: bool) -> dict[str, Any] | None:
        """Partitioned parameters gathered one at a time into host copies (a collective:
        every data-parallel rank calls it); with ``rank0_only`` only data-parallel rank 0
        keeps them (others get None)."""
        from zerotron.zero.stage3 import gathered_state_dict

        return gathered_state_dict(module, rank0_only, group=self.optimizer.group)

    def load_module_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        fit: Callable[[], list[str]],
        where: str,
    ) -> list[str]:
        return _load_partitioned(module, weights, where)

    def extra_files(self, module_state: Any, ps: ParallelState) -> dict[str, Any]:
        if not getattr(self.optimizer, "gather_16bit_weights_on_model_save", False):
            return {}
        return {gathered_16bit_file(ps): module_state}


def _load_partitioned(module: nn.Module, weights: Mapping[str, Tensor], where: str) -> list[str]:
    """Load full ``weights`` into a stage-3 ``module`` (each rank keeps its chunks); nothing is
    refitted."""
    from zerotron.zero.stage3 import load_full_state_dict

    try:
        load_full_state_dict(module, weights)
    except ConfigError as e:
        raise CheckpointError(f"{e.what}", where=where, fix=e.fix) from e
    return []


class NoOptimizer:
    """In place of an optimizer: the Engine runs forward passes only, as DeepSpeed's engine
    built without one (an RLHF reference or reward model, evaluation, generation).

    Attributes:
        stage: the config's ZeRO stage; at 3 the module's parameters are partitioned over
            ``group`` (ZeRO-3 inference), below it the module stays whole.
        group: the data-parallel group (stage 3's).
    """

    def __init__(self, stage: int = 0, group: Group | None = None):
        self.stage = stage
        self.group = group


_FORWARD_ONLY = (
    "this engine has no optimizer: it was built without one (no optimizer passed, no "
    "'optimizer' section in the config) and runs forward passes only"
)
_FORWARD_ONLY_FIX = (
    "to train, pass optimizer= to initialize() or add an 'optimizer' section to the config"
)


class ForwardOnlyPart(MixedPrecisionPart):
    """The part of an Engine without an optimizer (:class:`NoOptimizer`): backward and step
    are refused with what to do; state dicts and checkpoints hold the weights alone (gathered
    over the group at stage 3)."""

    def __init__(self, none: NoOptimizer):
        super().__init__(None)
        self.zero_stage = none.stage
        self.group = none.group

    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(_FORWARD_ONLY, where=f"engine.{what}", fix=_FORWARD_ONLY_FIX)

    @property
    def loss_scale(self) -> float:
        return 1.0

    @property
    def num_skipped_steps(self) -> int:
        return 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return []

    def scale_loss(self, loss: Tensor) -> Tensor:
        raise self._refuse("backward")

    def step(self) -> StepResult:
        raise self._refuse("step")

    def zero_grad(self) -> None:
        pass  # no gradients are ever made here

    def reload_model_params(self) -> None:
        pass  # no masters to reload

    def allreduce_grads(self, params: Sequence[Tensor], group: Group) -> None:
        raise self._refuse("backward")

    def module_state_dict(self, module: nn.Module, rank0_only: bool) -> dict[str, Any] | None:
        if self.zero_stage != 3:
            return module.state_dict()
        from zerotron.zero.stage3 import gathered_state_dict

        return gathered_state_dict(module, rank0_only, group=self.group)

    def load_module_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        fit: Callable[[], list[str]],
        where: str,
    ) -> list[str]:
        if self.zero_stage != 3:
            return fit()
        return _load_partitioned(module, weights, where)

    def save_optimizer_state(
        self, model_state: dict[str, Any], files: dict[str, Any], ps: ParallelState
    ) -> None:
        pass  # weights alone

    def read_optimizer_state(
        self,
        files: CheckpointFiles,
        model_state: Mapping[str, Any],
        meta: Mapping[str, Any],
        where: str,
        repartition: bool,
    ) -> dict[str, Any] | None:
        return None  # nothing to load it into

    def load_optimizer_state(
        self,
        opt_state: dict[str, Any],
        module: nn.Module,
        refitted: Sequence[str],
        refit: Callable[[dict[str, Any]], None],
        where: str,
    ) -> None:
        pass
