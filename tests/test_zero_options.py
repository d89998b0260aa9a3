"""ZeroOptions (zerotron/zero/options.py): built once from a validated config, frozen, without
the DeepSpeed keys zerotron accepts but does not use."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zerotron.config import load_deepspeed_config
from zerotron.zero.options import OffloadOptions, ZeroOptions


def test_from_config_maps_the_zero_section(tmp_path):
    cfg, _ = load_deepspeed_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 123,
                "allgather_bucket_size": 456,
                "overlap_comm": False,
                "sub_group_size": 789,
                "stage3_param_persistence_threshold": 10,
                "stage3_prefetch_bucket_size": 11,
                "stage3_max_live_parameters": 12,
                "stage3_max_reuse_distance": 13,
                "stage3_gather_16bit_weights_on_model_save": True,
                "contiguous_gradients": False,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            },
        }
    )
    o = ZeroOptions.from_config(cfg.zero)
    assert (o.stage, o.reduce_bucket_size, o.allgather_bucket_size) == (3, 123, 456)
    assert (o.overlap_comm, o.sub_group_size, o.communication_data_type) == (
        False,
        789,
        torch.bfloat16,
    )
    assert (
        o.param_persistence_threshold,
        o.prefetch_bucket_size,
        o.max_live_parameters,
        o.max_reuse_distance,
    ) == (10, 11, 12, 13)
    assert o.gather_16bit_weights_on_model_save is True
    assert o.offload_optimizer == OffloadOptions(device="cpu", pin_memory=True)
    assert o.offload_param == OffloadOptions(
        device="nvme", nvme_path=str(tmp_path), buffer_count=cfg.zero.offload_param_buffer_count
    )
    fields = {f.name for f in dataclasses.fields(ZeroOptions)}
    assert not fields & {"contiguous_gradients", "round_robin_gradients"}


def test_options_are_frozen():
    o = ZeroOptions(stage=1)
    assert o.offload_optimizer is None and o.offload_param is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.stage = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        OffloadOptions().device = "cpu"  # type: ignore[misc]
