"""DeepSpeed's ``deepspeed.pipe`` (importable as ``zerotron.pipe``): models as lists of layers,
trained on zerotron's pipeline runtime (:mod:`zerotron.pipeline`).

- :mod:`~zerotron.compat.pipe.module`: :class:`LayerSpec`, :class:`TiedLayerSpec`,
  :class:`PipelineModule` (builds this stage's layers; partitioning; tied weights).
- :mod:`~zerotron.compat.pipe.stage`: :class:`PipelineModuleRuntime`, the pipeline runtime over
  a PipelineModule with DeepSpeed's ``(inputs, labels)`` micro-batches.
- :mod:`~zerotron.compat.pipe.engine`: :func:`pipeline_engine`, the Engine for a PipelineModule
  (``engine.train_batch(data_iter)``).

See ``docs/pipeline-module.md``.
"""

from zerotron.compat.pipe.engine import pipeline_engine
from zerotron.compat.pipe.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    layer_name,
    layer_parameters,
    partition_layers,
)
from zerotron.compat.pipe.stage import PipelineModuleRuntime, PipeStage
from zerotron.compat.submodules import submodule_getattr

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

__getattr__ = submodule_getattr(__name__)
