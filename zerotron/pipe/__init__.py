"""DeepSpeed's ``deepspeed.pipe``: models as lists of layers, trained on the pipeline runtime.

- :mod:`~zerotron.pipe.module`: :class:`LayerSpec`, :class:`TiedLayerSpec`,
  :class:`PipelineModule` (builds this stage's layers; partitioning; tied weights).
- :mod:`~zerotron.pipe.stage`: :class:`PipelineModuleRuntime`, the pipeline runtime over a
  PipelineModule with DeepSpeed's ``(inputs, labels)`` micro-batches.
- :mod:`~zerotron.pipe.engine`: :func:`pipeline_engine`, the Engine for a PipelineModule
  (``engine.train_batch(data_iter)``).

See ``docs/pipeline-module.md``.
"""

from zerotron.pipe.engine import pipeline_engine
from zerotron.pipe.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    layer_name,
    layer_parameters,
    partition_layers,
)
from zerotron.pipe.stage import PipelineModuleRuntime, PipeStage

__all__ = [
    "LayerSpec",
    "PipeStage",
    "PipelineModule",
    "PipelineModuleRuntime",
    "TiedLayerSpec",
    "layer_name",
    "layer_parameters",
    "partition_layers",
    "pipeline_engine",
]
