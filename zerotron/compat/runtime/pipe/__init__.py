"""DeepSpeed's ``deepspeed.runtime.pipe``: the same names as ``deepspeed.pipe``
(:mod:`zerotron.compat.pipe`), where DeepSpeed defines them."""

from zerotron.compat.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerotron.compat.submodules import submodule_getattr

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

__getattr__ = submodule_getattr(__name__)
