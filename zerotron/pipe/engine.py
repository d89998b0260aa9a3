"""Build the :class:`~zerotron.engine.Engine` that trains a :class:`PipelineModule`.

``engine.train_batch(data_iter)`` then runs one global batch through the pipeline schedule,
DeepSpeed's ``PipelineEngine.train_batch``: ``data_iter`` yields ``(inputs, labels)``
micro-batches (every stage draws them; only the first uses the inputs and the last the labels).
The pieces are the ones ``zerotron pretrain`` composes: data-parallel gradient buckets
(:class:`~zerotron.parallel.data_parallel.DataParallel`) when the data-parallel size is above
one, built before the optimizer; a :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer`
over the given torch optimizer with the gradient norm spanning the model-parallel ranks; and
:class:`~zerotron.pipe.stage.PipelineModuleRuntime`.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotron.compat.pipe.module import PipelineModule
from zerotron.compat.pipe.stage import PipelineModuleRuntime
from zerotron.distributed.state import state
from zerotron.engine import Engine, grad_norm_hooks
from zerotron.errors import ConfigError
from zerotron.parallel.data_parallel import DataParallel
from zerotron.precision.loss_scaler import LossScaler
from zerotron.precision.mixed import MixedPrecisionOptimizer


def pipeline_engine(
    module: PipelineModule,
    optimizer: torch.optim.Optimizer,
    *,
    num_microbatches: int,
    micro_batch_size: int = 1,
    schedule: str = "1f1b",
    lr_scheduler: Any = None,
    clip_grad: float = 0.0,
    loss_scaler: LossScaler | None = None,
    bucket_size: int | None = None,
) -> Engine:
    """An Engine training ``module`` with ``optimizer`` (a fresh torch optimizer over
    ``module.parameters()``) on the pipeline schedule ``schedule``, ``num_microbatches``
    micro-batches of ``micro_batch_size`` samples per step (the gradient accumulation steps)."""
    if len(optimizer.state) > 0:
        raise ConfigError(
            "the optimizer has already stepped",
            where="pipeline_engine",
            fix="pass a fresh optimizer built over module.parameters()",
        )
    ps = state()
    data_parallel = None
    if ps.dp_size > 1:  # its main_grad buffers must exist before the optimizer wraps the params
        data_parallel = DataParallel(module.parameters(), ps.dp, bucket_size=bucket_size)
    reduce_fn, is_counted = grad_norm_hooks(ps)
    wrapped = MixedPrecisionOptimizer(
        optimizer,
        loss_scaler=loss_scaler,
        clip_grad=clip_grad,
        reduce_fn=reduce_fn,
        is_counted=is_counted,
    )
    runtime = PipelineModuleRuntime(module, schedule, num_microbatches)
    return Engine(
        module,
        wrapped,
        lr_scheduler,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=num_microbatches,
        data_parallel=data_parallel,
        pipeline=runtime,
    )
