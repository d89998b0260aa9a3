"""DeepSpeed's ``deepspeed.runtime.pipe.module``: ``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec`` (:mod:`zerotron.compat.pipe.module`)."""

from zerotron.compat.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
