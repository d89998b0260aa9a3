"""``zerotron.runtime`` (DeepSpeed's ``deepspeed.runtime``): seeds, names, the engine class,
and the ZeRO memory estimators, whose printed tables equal real DeepSpeed's (the reference is
tests/fixtures/deepspeed/estimators.json, written by make_estimator_fixtures.py next to it)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
REFERENCE = json.loads((FIXTURES / "estimators.json").read_text())


def _fixture_script():
    spec = importlib.util.spec_from_file_location(
        "make_estimator_fixtures", FIXTURES / "make_estimator_fixtures.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case_id(case) -> str:
    return f"{case['total_params']}-{case['num_gpus_per_node']}x{case['num_nodes']}"


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=_case_id)
def test_zero2_all_cold_prints_deepspeeds_table(case, capsys):
    from zerotron.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    estimate_zero2_model_states_mem_needs_all_cold(
        case["total_params"],
        num_gpus_per_node=case["num_gpus_per_node"],
        num_nodes=case["num_nodes"],
        additional_buffer_factor=case["additional_buffer_factor"],
    )
    assert capsys.readouterr().out == case["zero2"]


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=_case_id)
def test_zero3_all_cold_prints_deepspeeds_table(case, capsys):
    from zerotron.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    estimate_zero3_model_states_mem_needs_all_cold(
        case["total_params"],
        case["largest_layer_params"],
        num_gpus_per_node=case["num_gpus_per_node"],
        num_nodes=case["num_nodes"],
        additional_buffer_factor=case["additional_buffer_factor"],
    )
    assert capsys.readouterr().out == case["zero3"]


@pytest.mark.parametrize("case", REFERENCE["live"], ids=lambda c: f"{c['num_nodes']}nodes")
def test_zero2_all_live_prints_deepspeeds_table(case, capsys):
    from zerotron.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    model = _fixture_script().live_model()
    estimate_zero2_model_states_mem_needs_all_live(
        model, case["num_gpus_per_node"], case["num_nodes"]
    )
    assert capsys.readouterr().out == case["zero2"]


@pytest.mark.parametrize("case", REFERENCE["live"], ids=lambda c: f"{c['num_nodes']}nodes")
def test_zero3_all_live_prints_deepspeeds_table(case, capsys):
    from zerotron.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live

    model = _fixture_script().live_model()
    estimate_zero3_model_states_mem_needs_all_live(
        model, case["num_gpus_per_node"], case["num_nodes"]
    )
    assert capsys.readouterr().out == case["zero3"]


def test_model_params_counts_tied_weights_once_and_the_largest_module():
    from zerotron.tuning.zero_memory import model_params

    model = _fixture_script().live_model()
    embed = 50_304 * 768
    assert model_params(model) == (embed + 768 * 3072 + 3072 + 3072 * 768 + 768, embed)


def test_zero2_estimate_is_deepspeeds_formula():
    from zerotron.tuning.zero_memory import MemoryEstimate, zero2_model_states_mem

    # 2 bytes of 16-bit params per GPU plus 18 partitioned bytes over 16 GPUs; host: 4 bytes
    # per GPU of the node, times the buffer factor.
    got = zero2_model_states_mem(10**9, 8, 2, cpu_offload=False, additional_buffer_factor=1.0)
    assert got == MemoryEstimate(cpu_bytes=4 * 8 * 10**9, gpu_bytes=2 * 10**9 + 18 * 10**9 // 16)


def test_set_random_seed_seeds_python_numpy_and_torch():
    from zerotron.runtime.utils import set_random_seed

    set_random_seed(2**40 + 7)  # larger than numpy accepts: taken modulo 2**32
    first = (random.random(), np.random.rand(), torch.rand(()).item())
    set_random_seed(2**40 + 7)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == first


def test_zero_param_status_is_the_stage3_enum():
    from zerotron.runtime.zero.partition_parameters import ZeroParamStatus
    from zerotron.zero.stage3.shards import ZeroParamStatus as own

    assert ZeroParamStatus is own
    assert (ZeroParamStatus.AVAILABLE.value, ZeroParamStatus.NOT_AVAILABLE.value) == (1, 2)


def test_partition_parameters_exports_gathered_parameters_and_init():
    from zerotron.runtime.zero import partition_parameters as pp
    from zerotron.zero import GatheredParameters, Init

    assert (pp.GatheredParameters, pp.Init) == (GatheredParameters, Init)


def test_valid_lr_schedules_are_deepspeeds_names_in_its_order():
    from zerotron.optim import WarmupLR as own
    from zerotron.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR

    assert VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    assert WarmupLR is own


def test_deepspeed_engine_is_the_engine_class():
    import zerotron.engine
    from zerotron.runtime.engine import DeepSpeedEngine

    assert DeepSpeedEngine is zerotron.engine.Engine


def test_runtime_pipe_module_is_deepspeed_pipe():
    import zerotron.pipe as pipe
    from zerotron.runtime.pipe import module

    assert (module.PipelineModule, module.LayerSpec, module.TiedLayerSpec) == (
        pipe.PipelineModule,
        pipe.LayerSpec,
        pipe.TiedLayerSpec,
    )


def test_repeating_loader_restarts_its_loader():
    from zerotron.runtime.dataloader import RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_see_memory_usage_prints_only_when_forced(capsys):
    from zerotron.runtime.utils import see_memory_usage

    see_memory_usage("before the step")
    assert capsys.readouterr().out == ""
    see_memory_usage("after the step", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "after the step"
    assert lines[1].startswith("MA ") and " Max_MA " in lines[1] and lines[1].endswith(" GB")
    assert lines[2].startswith("CPU Virtual Memory:  used = ") and len(lines) == 3


def test_runtime_zero_names_are_deepspeed_zeros():
    import zerotron.runtime.zero
    import zerotron.zero

    for name in ("Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter"):
        assert getattr(zerotron.runtime.zero, name) is getattr(zerotron.zero, name), name
    with pytest.raises(AttributeError, match="no attribute 'MiCS_Init'"):
        zerotron.runtime.zero.MiCS_Init  # noqa: B018
