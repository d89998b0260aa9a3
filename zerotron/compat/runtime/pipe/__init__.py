"""DeepSpeed's ``deepspeed.runtime.pipe``: the same names as ``deepspeed.pipe``
(:mod:`zerotron.compat.pipe`), where DeepSpeed defines them."""

from zerotron.compat.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
