"""Modules declare their external and tied weights; parallelism reads the declarations."""

import torch
from torch import nn

from zerotron.distributed.comm import Group
from zerotron.models import GPT, GPTConfig, build_gpt_stages
from zerotron.parallel.declarations import (
    TiedWeight,
    allreduce_tied_grads,
    external_parameters,
    tied_weights,
)
from zerotron.pipe import PipelineModule, TiedLayerSpec
from zerotron.pipe.stage import PipeStage


def gpt() -> GPT:
    cfg = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64
    )
    return GPT(cfg)


def test_gpt_declares_what_its_forward_reads_outside_its_owners():
    model = gpt()
    assert external_parameters(model) == [model.embedding.word_embeddings.weight]
    assert external_parameters(model.embedding) == [model.embedding.position_embeddings.weight]
    assert external_parameters(model.layers[0]) == [] and tied_weights(model) == []


def test_one_stage_declares_the_embedding_tied_over_a_group_of_one():
    model = gpt()
    (stage,) = build_gpt_stages(model, 0, 1)
    (tied,) = tied_weights(stage)
    assert tied.weight is model.embedding.word_embeddings.weight and tied.group.size == 1
    assert external_parameters(stage) == [tied.weight]
    stage.zero_grad()
    allreduce_tied_grads([stage])  # a group of one: nothing to sum, no gradient made
    assert tied.weight.grad is None


def test_undeclared_modules_and_groups_of_one_are_left_alone():
    lin = nn.Linear(2, 2)
    assert external_parameters(lin) == [] and tied_weights(lin) == []

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def tied_weights(self):
            return [TiedWeight(self.w, Group.single("tied"))]

    holder = Holder()
    allreduce_tied_grads([nn.Sequential(holder)])  # found in a submodule; alone: no-op
    assert holder.w.grad is None


def test_pipe_stage_declares_the_module_tied_layers_and_is_no_gpt_stage():
    module = PipelineModule([TiedLayerSpec("e", nn.Embedding, 10, 4), nn.Linear(4, 4)])
    stage = PipeStage(module)
    (tied,) = tied_weights(stage)
    assert tied.weight is module.tied_modules["e"].weight and tied.group.size == 1
    assert [c.__name__ for c in type(stage).__mro__[:2]] == ["PipeStage", "Module"]
