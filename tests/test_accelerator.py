"""deepspeed.accelerator (``zerotron.accelerator``): choosing the accelerator as DeepSpeed does,
and the CPU accelerator's answers (memory from the process's RSS, as DeepSpeed's). The CUDA
accelerator's device-free answers are checked here too; its device calls need a GPU."""

from __future__ import annotations

import ctypes
import os

import psutil
import pytest
import torch

import zerotron
from zerotron.accelerator import DeepSpeedAccelerator, get_accelerator, set_accelerator
from zerotron.accelerator.cpu_accelerator import CPU_Accelerator
from zerotron.accelerator.cuda_accelerator import CUDA_Accelerator
from zerotron.errors import ConfigError

CPU_ONLY = not torch.cuda.is_available()


@pytest.fixture
def fresh(monkeypatch):
    """get_accelerator() chooses again (and the process's choice comes back afterwards)."""
    saved = get_accelerator()
    set_accelerator(None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    yield
    set_accelerator(saved)


@pytest.fixture
def cpu() -> CPU_Accelerator:
    return CPU_Accelerator()


def test_one_accelerator_per_process_also_at_the_top_level():
    assert get_accelerator() is get_accelerator() is zerotron.get_accelerator()
    assert isinstance(get_accelerator(), DeepSpeedAccelerator)
    assert zerotron.accelerator is zerotron.compat.accelerator


@pytest.mark.skipif(not CPU_ONLY, reason="the choice on a machine without a GPU")
def test_chosen_as_deepspeed_chooses_without_a_gpu(fresh):
    assert type(get_accelerator()) is CPU_Accelerator


def test_ds_accelerator_overrides(fresh, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert type(get_accelerator()) is CPU_Accelerator


@pytest.mark.parametrize(
    "value,message",
    [
        ("xpu", "zerotron runs on CUDA and CPU only"),
        ("tpu", "DS_ACCELERATOR='tpu' is not an accelerator"),
        *([("cuda", "CUDA is not available")] if CPU_ONLY else []),
    ],
)
def test_ds_accelerator_refusals_are_named(fresh, monkeypatch, value, message):
    monkeypatch.setenv("DS_ACCELERATOR", value)
    with pytest.raises(ConfigError, match=message):
        get_accelerator()


def test_set_accelerator(fresh):
    mine = CPU_Accelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    with pytest.raises(ConfigError, match="str is not a DeepSpeedAccelerator"):
        set_accelerator("cpu")


def test_the_interface_is_abstract():
    with pytest.raises(TypeError):
        DeepSpeedAccelerator()


def test_cpu_device(cpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert (cpu._name, cpu.device_name(), cpu.device_name(2)) == ("cpu", "cpu", "cpu")
    assert cpu.device() == torch.device("cpu") and cpu.current_device_name() == "cpu"
    assert cpu.current_device() == 3 and cpu.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    assert cpu.is_available() and cpu.communication_backend_name() == "gloo"
    assert cpu.is_synchronized_device() and cpu.use_host_timers()
    assert (cpu.set_device(0), cpu.synchronize(), cpu.empty_cache()) == (None, None, None)
    assert cpu.is_bf16_supported() and not cpu.is_triton_supported()
    assert cpu.is_fp16_supported() == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    fp16 = [torch.float16] if cpu.is_fp16_supported() else []
    assert cpu.supported_dtypes() == [torch.float32, torch.bfloat16, *fp16]


def test_cpu_rng(cpu):
    cpu.manual_seed(5)
    a = torch.rand(3)
    state = cpu.get_rng_state()
    b = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), b)
    cpu.manual_seed_all(5)
    assert torch.equal(torch.rand(3), a) and cpu.initial_seed() == 5
    assert cpu.random() is torch.random and cpu.default_generator(0) is torch.default_generator


def test_cpu_memory_is_the_process_rss(cpu):
    assert abs(cpu.memory_allocated() - psutil.Process().memory_info().rss) < 16 << 20
    assert cpu.memory_reserved() > 0 and cpu.memory_cached() > 0
    # Freed heap kept resident (kernels/malloc.py keeps it once an Engine ran in this worker)
    # would serve the allocation below without a new page: hand it back to the OS first.
    ctypes.CDLL(None).malloc_trim(0)
    cpu.reset_max_memory_allocated()
    peak0 = cpu.max_memory_allocated()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert cpu.max_memory_allocated() >= peak0 + (48 << 20)
    del big
    assert cpu.max_memory_reserved() == cpu.max_memory_allocated()
    stats = cpu.memory_stats()
    assert set(stats) == {"allocated_bytes.all.current", "allocated_bytes.all.peak"}
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    assert cpu.total_memory() == psutil.virtual_memory().total
    assert 0 < cpu.available_memory() <= cpu.total_memory()


def test_cpu_tensors_streams_and_ranges(cpu):
    t = torch.ones(3)
    assert cpu.pin_memory(t) is t and not cpu.is_pinned(t) and cpu.unpin_memory(t) is None
    assert cpu.on_accelerator(t) and not cpu.on_accelerator(torch.ones(1, device="meta"))
    assert (cpu.Stream, cpu.Event, cpu.current_stream(), cpu.default_stream()) == (None,) * 4
    with cpu.stream(None):
        pass
    assert cpu.range_push("step") is None and cpu.range_pop() is None
    assert cpu.amp() is torch.cpu.amp and cpu.lazy_call(lambda: 7) == 7
    legacy = cpu.FloatTensor(2)  # DeepSpeed's CPU types are torch's legacy ones (sizes)
    assert legacy.shape == (2,) and legacy.dtype == torch.float32
    assert cpu.LongTensor is torch.LongTensor and cpu.BFloat16Tensor is torch.BFloat16Tensor
    assert cpu.get_compile_backend() == "inductor"
    env = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert cpu.create_op_builder("CPUAdamBuilder") is None


def test_cpu_compile_backend_refusal(cpu):
    with pytest.raises(ConfigError, match="backend 'nope' is not available"):
        cpu.set_compile_backend("nope")


def test_cuda_names_need_no_device():
    cuda = CUDA_Accelerator()
    assert (cuda._name, cuda.device_name(), cuda.device_name(1)) == ("cuda", "cuda", "cuda:1")
    # transformers passes the LOCAL_RANK string
    assert cuda.device_name(os.environ.get("LOCAL_RANK", "0")).startswith("cuda:")
    assert cuda.communication_backend_name() == "nccl" and not cuda.is_synchronized_device()
    assert not cuda.on_accelerator(torch.ones(1)) and cuda.export_envs() == ["NCCL"]
    assert cuda.device(1) == torch.device("cuda", 1)
