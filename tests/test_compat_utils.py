"""``zerotron.utils`` (DeepSpeed's ``deepspeed.utils``) in one process: the logger and
log_dist, RepeatingLoader, the group getters, ZeRO-3 leaf modules (the whole subtree gathered
at the leaf's forward), the safe_get/set_full_* functions at every ZeRO stage (equal to the
values the optimizer holds), zero_to_fp32's functions and command line on a checkpoint saved by
zerotron, and ``zerotron.compression`` / ``zerotron.moe``.

:func:`train_and_read` is also what tests/distributed/test_compat_utils_ranks.py runs on two
ranks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from torch import nn

import zerotron
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError

# ---- a tiny run: every rank computes the same global batch's mean gradient -------------------

BATCH, MICRO = 4, 2  # global batch, micro-batch per rank: one process accumulates 2 micro-batches
KEYS = ("exp_avg", "exp_avg_sq")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.frozen = nn.Linear(4, 4)  # not trained: no master, no state
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 2.0, 4.0]))

    def forward(self, x):
        return self.frozen(self.out(torch.tanh(self.inp(x)))) * self.scale


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, BATCH, 8, generator=g), torch.randn(3, BATCH, 4, generator=g)


def ds_config(stage: int, bf16: bool = False, offload: dict | None = None) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload is not None:
        zero["offload_optimizer"] = offload
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
    }


def _micro_batches(x: torch.Tensor, y: torch.Tensor, rank: int, world: int):
    """This rank's micro-batches of one global batch (rank-major, as a DistributedSampler of
    consecutive samples would give)."""
    per_rank = BATCH // world
    xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    return list(zip(xs.split(MICRO), ys.split(MICRO)))


def train_and_read(
    rank: int,
    stage: int,
    save_dir: str | None = None,
    bf16: bool = False,
    offload: dict | None = None,
) -> dict:
    """Two optimizer steps, then one more accumulation's backward (no step); every safe_get
    value of every parameter, and what the setters leave (with NVMe offload: the error they
    raise). Rank 0 saves a checkpoint to ``save_dir`` (all ranks take part) before the extra
    backward when asked."""
    from zerotron.distributed.init import get_world_size
    from zerotron.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    world = get_world_size()
    model = Net()
    engine, *_ = zerotron.initialize(model=model, config=ds_config(stage, bf16, offload))
    xs, ys = _data()
    for step in range(3):
        micro_batches = _micro_batches(xs[step], ys[step], rank, world)
        for k, (x, y) in enumerate(micro_batches):
            out = engine(x.to(model.inp.weight.dtype))
            engine.backward(nn.functional.mse_loss(out.float(), y))
            if step < 2 or k < len(micro_batches) - 1:  # the last step is left out: gradients stay
                engine.step()
        if step == 1 and save_dir is not None:
            engine.save_checkpoint(save_dir, tag="two_steps")
    named = [(n, p) for n, p in model.named_parameters()]
    out: dict = {"fp32": {}, "grad": {}, **{k: {} for k in KEYS}}
    out["param"] = {n: p.detach().clone() for n, p in named} if stage < 3 else None
    for name, p in named:
        out["fp32"][name] = safe_get_full_fp32_param(p)
        grad = safe_get_full_grad(p)
        out["grad"][name] = None if grad is None else grad.float().clone()
        for key in KEYS:
            out[key][name] = safe_get_full_optimizer_state(p, key)
    p = model.inp.weight
    new = torch.arange(p.numel() if stage < 3 else 8 * 16, dtype=torch.float32).view(16, 8)
    try:
        safe_set_full_fp32_param(p, new)
        safe_set_full_optimizer_state(p, new * 2, "exp_avg")
    except UnsupportedError as e:
        out["after_set"] = e
        return out
    out["after_set"] = (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"))
    return out


@pytest.fixture(scope="module")
def one_process() -> dict[int, dict]:
    return {stage: train_and_read(0, stage) for stage in range(4)}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("what", ["fp32", "grad", *KEYS])
def test_safe_get_equals_stage_0(one_process, stage, what):
    assert_same(one_process[stage][what], one_process[0][what])


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            assert torch.equal(got[name], want[name]), name


def test_stage_0_values_are_the_optimizers(one_process):
    fp32 = one_process[0]
    assert fp32["grad"]["frozen.weight"] is None and fp32["fp32"]["frozen.weight"] is None
    for name in ("inp.weight", "inp.bias", "out.weight", "out.bias"):
        assert fp32["fp32"][name].dtype == torch.float32
        assert fp32["grad"][name] is not None and fp32["exp_avg"][name] is not None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_setters_write_the_whole_value(one_process, stage):
    fp32, exp_avg = one_process[stage]["after_set"]
    new = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    assert torch.equal(fp32, new) and torch.equal(exp_avg, new * 2)


@pytest.fixture(scope="module")
def bf16_runs() -> dict[int, dict]:
    return {stage: train_and_read(0, stage, bf16=True) for stage in (0, 3)}


@pytest.mark.parametrize("what", ["fp32", "grad", *KEYS])
def test_bf16_zero3_safe_get_equals_stage_0(bf16_runs, what):
    assert_same(bf16_runs[3][what], bf16_runs[0][what])


def test_bf16_full_fp32_param_is_the_fp32_master_of_the_bf16_weight(bf16_runs):
    run = bf16_runs[0]
    for name in ("inp.weight", "inp.bias", "out.weight", "out.bias"):
        master, param = run["fp32"][name], run["param"][name]
        assert (master.dtype, param.dtype) == (torch.float32, torch.bfloat16)
        assert torch.equal(master.bfloat16(), param) and not torch.equal(master, param.float())


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory) -> dict[tuple[str, int], dict]:
    runs = {}
    for device in ("cpu", "nvme"):
        for stage in (2, 3):
            path = str(tmp_path_factory.mktemp(f"nvme{stage}"))
            offload = {"device": device, "nvme_path": path}
            runs[device, stage] = train_and_read(0, stage, offload=offload)
    return runs


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("what", ["fp32", "grad", *KEYS])
def test_safe_get_with_offloaded_optimizer_equals_stage_0(
    offloaded, one_process, device, stage, what
):
    assert_same(offloaded[device, stage][what], one_process[0][what])


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_setters_write_the_whole_value(offloaded, stage):
    fp32, exp_avg = offloaded["cpu", stage]["after_set"]
    new = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    assert torch.equal(fp32, new) and torch.equal(exp_avg, new * 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_offload_setters_refuse(offloaded, stage):
    error = offloaded["nvme", stage]["after_set"]
    assert isinstance(error, UnsupportedError) and "NVMe" in str(error)


def test_set_full_fp32_param_refuses_a_wrong_shape():
    from zerotron.utils import safe_set_full_fp32_param

    model = Net()
    zerotron.initialize(model=model, config=ds_config(2))
    with pytest.raises(ConfigError, match="shape"):
        safe_set_full_fp32_param(model.inp.weight, torch.zeros(3))


def test_local_getters_are_for_zero3_only():
    from zerotron.utils import safe_get_local_fp32_param

    model = Net()
    zerotron.initialize(model=model, config=ds_config(2))
    with pytest.raises(ConfigError, match="stage 3"):
        safe_get_local_fp32_param(model.inp.weight)


def test_local_fp32_param_is_this_ranks_chunk_at_stage_3():
    from zerotron.utils import safe_get_full_fp32_param, safe_get_local_fp32_param

    model = Net()
    zerotron.initialize(model=model, config=ds_config(3))
    p = model.out.weight
    assert torch.equal(safe_get_local_fp32_param(p), safe_get_full_fp32_param(p).reshape(-1))


# ---- logging ----------------------------------------------------------------------------------


def test_logger_is_deepspeeds():
    from zerotron.utils import logger

    assert (logger.name, logger.level, logger.propagate) == ("DeepSpeed", logging.WARNING, False)


def test_log_dist_without_a_process_group_logs_as_rank_minus_one():
    import io

    from zerotron.utils import log_dist, logger

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        log_dist("hello", ranks=[0], level=logging.WARNING)
        log_dist("quiet", ranks=[0])  # INFO is below DeepSpeed's default level
    finally:
        logger.removeHandler(handler)
    assert out.getvalue() == "[Rank -1] hello\n"


def test_get_dist_msg_rules(monkeypatch):
    import zerotron.distributed.init as init
    from zerotron.compat.utils.logging import get_dist_msg

    monkeypatch.setattr(init, "is_initialized", lambda: True)
    monkeypatch.setattr(init, "get_rank", lambda: 1)
    assert get_dist_msg("m", [0]) is None
    assert get_dist_msg("m", None) is None  # DeepSpeed: no ranks, no message once distributed
    assert get_dist_msg("m", [-1]) == "[Rank 1] m"
    assert get_dist_msg("m", [0, 1]) == "[Rank 1] m"


def test_set_log_level_from_string():
    from zerotron.utils import logger, set_log_level_from_string

    set_log_level_from_string("info")
    try:
        assert logger.level == logging.INFO
    finally:
        set_log_level_from_string("warning")


# ---- loader, groups ------------------------------------------------------------------------


def test_repeating_loader_is_runtimes():
    from zerotron.runtime.dataloader import RepeatingLoader
    from zerotron.utils import RepeatingLoader as from_utils

    assert from_utils is RepeatingLoader


def test_groups_in_one_process():
    from zerotron.utils import groups

    sizes = (
        groups._get_data_parallel_world_size(),
        groups._get_data_parallel_rank(),
        groups.get_tensor_model_parallel_world_size(),
        groups._get_model_parallel_world_size(),
        groups._get_sequence_parallel_world_size(),
        groups._get_sequence_data_parallel_world_size(),
        groups._get_data_parallel_group_ranks(),
        groups._get_broadcast_src_rank(),
    )
    assert sizes == (1, 0, 1, 1, 1, 1, [0], 0)


def test_no_sequence_parallel_group_is_a_key_error_as_in_deepspeed():
    from zerotron.utils import groups

    with pytest.raises(KeyError):
        groups._get_sequence_parallel_group()


# ---- ZeRO-3 leaf modules ---------------------------------------------------------------------


class Experts(nn.Module):
    """Runs one of its two experts (the other's parameters must still be gathered by a leaf)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.seen: list = []

    def forward(self, x):
        # named_parameters() looks without gathering: reading `self.b.weight` in a forward
        # would gather it (stage 3 registers a parameter read outside its module on first use)
        status = {n: p.ds_status for n, p in self.named_parameters()}
        self.seen.append((status["a.weight"], status["b.weight"]))
        return self.a(x)


def _stage3_experts(leaf: bool) -> Experts:
    from zerotron.distributed.comm import Group
    from zerotron.utils import set_z3_leaf_modules
    from zerotron.zero.stage3 import partition_parameters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Experts())
    if leaf:
        assert set_z3_leaf_modules(model, [Experts]) == [model[1]]
    partition_parameters(model, Group.single("dp"), persistence_threshold=0)
    model(torch.randn(2, 4)).sum().backward()
    return model[1]


def test_a_leaf_module_gathers_its_whole_subtree_at_its_forward():
    from zerotron.zero.stage3.shards import AVAILABLE

    assert _stage3_experts(leaf=True).seen == [(AVAILABLE, AVAILABLE)]


def test_without_the_flag_each_module_gathers_its_own():
    from zerotron.zero.stage3.shards import RELEASED

    assert _stage3_experts(leaf=False).seen == [(RELEASED, RELEASED)]


def test_leaf_flags_by_class_name_get_and_unset():
    from zerotron.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules

    model = nn.Sequential(nn.Linear(2, 2), Experts())
    set_z3_leaf_modules(model, ["Experts"])
    assert get_z3_leaf_modules(model) == [model[1]]
    unset_z3_leaf_modules(model, [Experts])
    assert get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match="No modules"):
        set_z3_leaf_modules(model, [nn.Conv2d])


# ---- zero_to_fp32 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A stage-2 checkpoint saved by zerotron after two steps, and the model's state then."""
    save = tmp_path_factory.mktemp("ckpt")
    model = Net()
    engine, *_ = zerotron.initialize(model=model, config=ds_config(2))
    xs, ys = _data()
    for step in range(2):
        for x, y in _micro_batches(xs[step], ys[step], 0, 1):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
    engine.save_checkpoint(save, tag="global_step2")
    return save, {k: v.clone() for k, v in model.state_dict().items()}


def test_get_fp32_state_dict_equals_the_models(saved):
    from zerotron.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save, want = saved
    got = get_fp32_state_dict_from_zero_checkpoint(save)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_exclude_frozen_parameters_keeps_buffers(saved):
    from zerotron.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = get_fp32_state_dict_from_zero_checkpoint(saved[0], exclude_frozen_parameters=True)
    assert list(got) == ["scale", "inp.weight", "inp.bias", "out.weight", "out.bias"]


def test_lazy_mode_reads_on_contiguous(saved):
    from zerotron.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save, want = saved
    lazy = get_fp32_state_dict_from_zero_checkpoint(save, tag="global_step2", lazy_mode=True)
    assert lazy["out.weight"].shape == want["out.weight"].shape
    assert all(torch.equal(lazy[k].contiguous(), want[k]) for k in want)


def test_load_state_dict_from_zero_checkpoint(saved):
    from zerotron.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    save, want = saved
    model = load_state_dict_from_zero_checkpoint(Net(), save)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def _loaded(out: Path, safe: bool) -> dict[str, torch.Tensor]:
    index = out / ("model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors" if safe else "pytorch_model.bin"]
    )
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_safetensors(out / f) if safe else torch.load(out / f, weights_only=True)
        assert not set(part) & set(sd)
        sd.update(part)
    return sd


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_convert_in_one_file(saved, tmp_path, safe):
    from zerotron.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    save, want = saved
    convert_zero_checkpoint_to_fp32_state_dict(save, tmp_path, safe_serialization=safe)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors" if safe else "pytorch_model.bin"]
    got = _loaded(tmp_path, safe)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_convert_sharded_writes_huggingfaces_index(saved, tmp_path, safe):
    from zerotron.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    save, want = saved
    # 520 bytes: inp.weight (512) alone, then the rest in order, as Hugging Face splits
    convert_zero_checkpoint_to_fp32_state_dict(
        save, tmp_path, max_shard_size="0.52KB", safe_serialization=safe
    )
    name = "model" if safe else "pytorch_model"
    ext = "safetensors" if safe else "bin"
    index = json.loads((tmp_path / f"{name}.{ext}.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert index["metadata"] == {"total_size": total}
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert files == [f"{name}-{k:05d}-of-{n:05d}.{ext}" for k in range(1, n + 1)] and n > 2
    got = _loaded(tmp_path, safe)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for f in files:  # each shard within the limit unless it holds one tensor
        part = _loaded_file(tmp_path / f, safe)
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 520 or len(part) == 1


def _loaded_file(path: Path, safe: bool) -> dict[str, torch.Tensor]:
    return load_safetensors(path) if safe else torch.load(path, weights_only=True)


def test_split_into_shards_is_huggingfaces_rule():
    from zerotron.checkpoint.fp32_shards import split_into_shards

    gb = 10**9
    sizes = {"a": 6 * gb, "b": 6 * gb, "c": 2 * gb, "d": 6 * gb, "e": 2 * gb, "f": 2 * gb}
    split = split_into_shards(sizes, "10GB", "pytorch_model.bin")
    assert list(split.files.values()) == [["a"], ["b", "c"], ["d", "e", "f"]]
    assert split_into_shards(sizes, "100GB", "w.bin").files == {"w.bin": list(sizes)}


def test_a_bad_max_shard_size_is_refused(saved, tmp_path):
    from zerotron.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    with pytest.raises(ConfigError, match="max_shard_size"):
        convert_zero_checkpoint_to_fp32_state_dict(saved[0], tmp_path, max_shard_size="5 GiB!")


def test_a_missing_tag_is_a_checkpoint_error(saved):
    from zerotron.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(CheckpointError):
        get_fp32_state_dict_from_zero_checkpoint(saved[0], tag="nope")


def test_command_line(saved, tmp_path):
    save, want = saved
    env = {**os.environ, "PYTHONPATH": str(Path(zerotron.__file__).parent.parent)}
    cmd = [sys.executable, "-m", "zerotron.utils.zero_to_fp32", str(save), str(tmp_path / "out")]
    cmd += ["--safe_serialization", "--max_shard_size", "1KB", "-t", "global_step2"]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    got = _loaded(tmp_path / "out", True)
    assert all(torch.equal(got[k], want[k]) for k in want)


# ---- compression, moe ----------------------------------------------------------------------


def test_recursive_getattr_and_setattr():
    from zerotron.compression.helper import recursive_getattr, recursive_setattr

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert recursive_getattr(model, "0.1") is model[0][1]
    new = nn.GELU()
    recursive_setattr(model, "0.1", new)
    assert model[0][1] is new


def test_moe_imports_and_refuses_to_build():
    from zerotron.moe.layer import MoE

    with pytest.raises(UnsupportedError, match="mixture-of-experts"):
        MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2)


def test_moe_utils_leave_dense_groups_alone():
    from zerotron.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = {"params": [nn.Parameter(torch.zeros(2))], "name": "g"}
    assert split_params_into_different_moe_groups_for_optimizer(groups) == [groups]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


@pytest.fixture(scope="module")
def saved_tied(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    save = tmp_path_factory.mktemp("tied")
    model = Tied()
    engine, *_ = zerotron.initialize(model=model, config={**ds_config(3), "train_batch_size": 2})
    x = torch.randint(0, 10, (2, 3))
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(save, tag="t")
    return save, {k: v.clone() for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_convert_sharded_tied_weights(saved_tied, tmp_path, safe):
    from zerotron.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    save, want = saved_tied
    convert_zero_checkpoint_to_fp32_state_dict(
        save, tmp_path, max_shard_size="0.3KB", safe_serialization=safe
    )
    got = _loaded(tmp_path, safe)
    # a .bin holds both names of the tied weight (one storage); safetensors stores it once
    names = list(want) if not safe else [k for k in want if k != "head.weight"]
    assert sorted(got) == sorted(names)
    assert all(torch.equal(got[k], want[k]) for k in names)
    if not safe:
        assert got["head.weight"].data_ptr() == got["emb.weight"].data_ptr()


def test_command_line_error_says_what_to_do(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(zerotron.__file__).parent.parent)}
    cmd = [sys.executable, "-m", "zerotron.utils.zero_to_fp32", str(tmp_path), str(tmp_path / "o")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no checkpoint to load" in done.stderr
    assert "Traceback" not in done.stderr
