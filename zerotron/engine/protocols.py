"""The parts an :class:`~zerotron.engine.Engine` composes, as the protocols it calls them by.

The Engine core knows no ZeRO stage, no vocabulary and no model: each question whose answer
depends on one of those is a method of the part that knows.

- :class:`OptimizerPart`: the optimizer as the Engine sees it. Plain mixed precision
  (:class:`~zerotron.engine.optimizers.MixedPrecisionPart`) and ZeRO
  (:class:`~zerotron.engine.optimizers.ZeroPart`) present the same step / zero_grad / state
  interface, and each answers for itself what differs: which data-parallel part reduces the
  gradients, whether full gradients survive that reduction, how replicated gradients are summed
  over a group, how the module's weights and the optimizer's state are saved and loaded.
- :class:`DataParallelPart`: averages gradients over the data-parallel group
  (:class:`~zerotron.parallel.data_parallel.DataParallel`, or a ZeroOptimizer).
- :class:`PipelinePart`: runs a batch's micro-batches on the pipeline schedule
  (:class:`~zerotron.pipeline.PipelineRuntime`).
- :class:`Fitter`: fits a loaded checkpoint to the model
  (:class:`~zerotron.checkpoint.fit.StateFitter`, or ``VocabPadding`` for a GPT).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import Tensor, nn

from zerotron.checkpoint.relayout import CheckpointFiles
from zerotron.distributed.comm import Group
from zerotron.distributed.state import ParallelState
from zerotron.precision.step import StepResult


class DataParallelPart(Protocol):
    group: Group
    sync: bool
    """Whether the next backward reduces (set by the Engine for the last micro-batch)."""

    def finish_grad_sync(self) -> None:
        """Return once every bucket of gradients is reduced."""

    def no_sync(self) -> AbstractContextManager[Any]:
        """Hold every reduction back (the pipeline runs all micro-batches under it)."""


class PipelinePart(Protocol):
    num_microbatches: int
    modules: Sequence[nn.Module]

    def train_step(self, data_iterator: Iterator[Any] | None, grad_scale: float = 1.0) -> Any:
        """Forward and backward of every micro-batch; the loss on the last stage, else None."""

    def eval_step(self, data_iterator: Iterator[Any] | None) -> Any:
        """Forward of every micro-batch; the loss on the last stage, else None."""

    def set_num_microbatches(self, num_microbatches: int, shapes_change: bool = False) -> None:
        """Run that many micro-batches a step from the next step on (``shapes_change``: their
        activations change shape too)."""


class Fitter(Protocol):
    def load_model_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        *,
        meta: Mapping[str, Any],
        model_config: Mapping[str, Any] | None,
        where: str,
    ) -> list[str]:
        """Load ``weights`` into ``module``; return the keys that had to be refitted."""

    def load_resharded(
        self, load_dir: str | os.PathLike, tag: str, ps: ParallelState
    ) -> dict[str, Tensor]:
        """This rank's weights from a checkpoint of another tensor/pipeline layout."""

    def fit_optimizer_state(
        self,
        optimizer: Any,
        module: nn.Module,
        opt_state: dict[str, Any],
        refitted: Sequence[str],
        meta: Mapping[str, Any],
    ) -> None:
        """Fit a whole optimizer state to the refitted weights, in place."""


class OptimizerPart(Protocol):
    optimizer: Any
    """The wrapped optimizer users see (``engine.optimizer``)."""
    zero_stage: int
    grads_freed: bool
    """The data-parallel reduction leaves gradient partitions, not full gradients: sums of full
    gradients over other groups (tied weights) must come before it."""

    # ---- the optimizer's interface ------------------------------------------------------

    @property
    def loss_scale(self) -> float: ...

    @property
    def num_skipped_steps(self) -> int: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def scale_loss(self, loss: Tensor) -> Tensor: ...

    def step(self) -> StepResult: ...

    def zero_grad(self) -> None: ...

    def reload_model_params(self) -> None:
        """Masters from the model's (just loaded) weights."""

    # ---- how it fits with the other parts -------------------------------------------------

    def data_parallel(self, given: DataParallelPart | None) -> DataParallelPart | None:
        """The part that reduces gradients over data-parallel ranks, given the one passed."""

    def check_pipeline(self, pipeline: PipelinePart | None) -> None:
        """Refuse a pipeline it cannot run under."""

    def allreduce_grads(self, params: Sequence[Tensor], group: Group) -> None:
        """Sum over ``group`` the (reduced) gradients of ``params``."""

    # ---- checkpoints ----------------------------------------------------------------------

    def module_state_dict(self, module: nn.Module, rank0_only: bool) -> dict[str, Any] | None:
        """``module``'s full state dict (a collective when the parameters are partitioned)."""

    def load_module_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        fit: Callable[[], list[str]],
        where: str,
    ) -> list[str]:
        """Load full ``weights`` into ``module`` (``fit()`` loads unpartitioned parameters);
        return the refitted keys."""

    def checkpoint_entries(self) -> dict[str, Any]:
        """Model-file entries that describe how the optimizer state was saved."""

    def save_optimizer_state(
        self, model_state: dict[str, Any], files: dict[str, Any], ps: ParallelState
    ) -> None:
        """Put the optimizer state into the model file's ``model_state`` or ``files`` of its own."""

    def extra_files(self, module_state: Any, ps: ParallelState) -> dict[str, Any]:
        """Further files data-parallel rank 0 writes (e.g. gathered 16-bit weights)."""

    def read_optimizer_state(
        self,
        files: CheckpointFiles,
        model_state: Mapping[str, Any],
        meta: Mapping[str, Any],
        where: str,
        repartition: bool,
    ) -> dict[str, Any] | None:
        """The optimizer state this rank loads (its files read through ``files``), checked
        against how it was saved (None: the checkpoint holds none)."""

    def load_optimizer_state(
        self,
        opt_state: dict[str, Any],
        module: nn.Module,
        refitted: Sequence[str],
        refit: Callable[[dict[str, Any]], None],
        where: str,
    ) -> None:
        """Load ``opt_state``; ``refit(opt_state)`` fits a whole one to refitted weights."""
