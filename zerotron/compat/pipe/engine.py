"""Build the :class:`~zerotron.engine.Engine` that trains a :class:`PipelineModule`.

``engine.train_batch(data_iter)`` then runs one global batch through the pipeline schedule,
DeepSpeed's ``PipelineEngine.train_batch``: ``data_iter`` yields ``(inputs, labels)``
micro-batches (every stage draws them; only the first uses the inputs and the last the labels).
It is assembled by :func:`zerotron.engine.builder.build_engine`, as ``zerotron pretrain``'s
is: data-parallel gradient buckets when the data-parallel size is above one, a
:class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` over the given torch optimizer with
the gradient norm spanning the model-parallel ranks, and
:class:`~zerotron.pipe.stage.PipelineModuleRuntime` running the schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotron.compat.pipe.module import PipelineModule
from zerotron.compat.pipe.stage import PipelineModuleRuntime
from zerotron.engine import Engine
from zerotron.engine.builder import OptimizerSetup, build_engine
from zerotron.errors import ConfigError
from zerotron.precision.loss_scaler import LossScaler


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
    setup = OptimizerSetup(loss_scaler=loss_scaler, clip_grad=clip_grad, bucket_size=bucket_size)
    return build_engine(
        module,
        optimizer,
        setup,
        scheduler=lambda _: lr_scheduler,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=num_microbatches,
        pipeline=PipelineModuleRuntime(module, schedule, num_microbatches),
    )
