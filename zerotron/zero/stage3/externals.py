"""ZeRO stage 3, external parameters: those a module's forward uses although another owns them.

Stage 3 gathers a module's own parameters around its forward and backward; a parameter read
elsewhere (a tied output layer, ``child.weight`` used directly) must be registered with the
module that reads it, or that module would find it empty. DeepSpeed's API of the same names.
"""

from __future__ import annotations

from torch import nn


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` for the whole forward and backward of ``module``.

    For a parameter that ``module``'s forward uses although another module owns it (a tied
    output layer, ``child.weight`` read directly). DeepSpeed's API of the same name.
    """
    ext = module.__dict__.setdefault("_zero_external_params", {})
    ext[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    module.__dict__.get("_zero_external_params", {}).pop(id(parameter), None)


def _register_known_externals(root: nn.Module) -> None:
    """zerotron's GPT reads two parameters outside their modules: register them."""
    from zerotron.models.gpt import GPT, Embedding  # models sit below zero/

    for m in root.modules():
        if isinstance(m, GPT):  # the tied output layer in GPT.forward / _parallel_output
            register_external_parameter(m, m.embedding.word_embeddings.weight)
        elif isinstance(m, Embedding):  # position_embeddings.weight[offset:offset + s]
            register_external_parameter(m, m.position_embeddings.weight)
