"""Models written against the parallel layers and the kernels (GPT-2 so far).

- :mod:`~zerotron.models.gpt`: :class:`GPT`, its config and KV cache.
- :mod:`~zerotron.models.lm_head`: :class:`LMHead`, the tied output layer and the loss.
- :mod:`~zerotron.models.gpt_stage`: a GPT cut into pipeline-stage chunks.

Each model declares its tied and external weights (:mod:`zerotron.parallel.declarations`), so
ZeRO-3, the Engine and the pipeline need not know it.
"""

from zerotron.models.gpt import GPT, VOCAB_PADDED_KEYS, GPTConfig, KVCache, print_num_parameters
from zerotron.models.gpt_stage import GPTStage, build_gpt_stages, layer_boundaries
from zerotron.models.lm_head import LMHead

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTStage",
    "KVCache",
    "LMHead",
    "VOCAB_PADDED_KEYS",
    "build_gpt_stages",
    "layer_boundaries",
    "print_num_parameters",
]
