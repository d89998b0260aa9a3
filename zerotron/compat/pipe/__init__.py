"""DeepSpeed's ``deepspeed.pipe`` (importable as ``zerotron.pipe``): models as lists of layers,
trained on zerotron's pipeline runtime (:mod:`zerotron.pipeline`).

- :mod:`~zerotron.compat.pipe.module`: :class:`LayerSpec`, :class:`TiedLayerSpec`,
  :class:`PipelineModule` (builds this stage's layers; partitioning; tied weights).
- :mod:`~zerotron.compat.pipe.stage`: :class:`PipelineModuleRuntime`, the pipeline runtime over
  a PipelineModule with DeepSpeed's ``(inputs, labels)`` micro-batches.
- ``engine``: :func:`pipeline_engine`, the Engine for a PipelineModule
  (``engine.train_batch(data_iter)``).

See ``docs/pipeline-module.md``.
"""

from pathlib import Path

# TRANSITIONAL: engine.py still lives in zerotron/pipe/ (the engine helper's file) until the
# coordinator moves it here; until then this package also searches that folder, so that it is
# zerotron.compat.pipe.engine (and, through the alias, zerotron.pipe.engine). Drop with the move.
__path__.append(str(Path(__file__).resolve().parents[2] / "pipe"))  # noqa: F821

from zerotron.compat.pipe.engine import pipeline_engine  # noqa: E402
from zerotron.compat.pipe.module import (  # noqa: E402
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    layer_name,
    layer_parameters,
    partition_layers,
)
from zerotron.compat.pipe.stage import PipelineModuleRuntime, PipeStage  # noqa: E402

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
