"""ZeRO-3 as DeepSpeed client code sees it, on 2 gloo ranks (fp32, tiny MLP): parameters carry
DeepSpeed's attributes with their meaning (``ds_id``, ``ds_status`` live, ``ds_shape``,
``ds_numel``, ``ds_tensor`` = this rank's shard, ``ds_persist``); client code that finds them with
``hasattr(p, "ds_id")`` gathers the whole values; a stage-3 parameter and a state dict of them
``torch.save`` and load with ``weights_only=True``; ``zero.Init`` takes DeepSpeed's signature,
honours ``enabled``, ``module``, ``dtype``, ``remote_device``, ``config_dict_or_path`` (dict or
file) and refuses what zerotron lacks. Through ``initialize``: an engine without an optimizer
runs forward on partitioned weights, and a model with ``nn.MultiheadAttention`` (which reads a
child's weight itself) trains at stage 3 with stage 0's losses.

Model: Linear(8, 32) -> Linear(32, 4) with the persistence threshold at 40: the weights (256 and
128 elements) are partitioned, the biases (32 and 4) stay whole.
"""

from __future__ import annotations

import inspect
import io
import json

import pytest
import torch
from torch import nn

import zerotron
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.zero import GatheredParameters, Init
from zerotron.zero.partition import chunk_size, shard
from zerotron.zero.stage3 import ZeroParamStatus, partition_parameters, read_shard
from zerotron.zero.stage3.gather import free, start_fetches

from .spawn import run_ranks

DP = 2
THRESHOLD = 40
ATTRS = pytest.mark.xdist_group("zero3_ds_attrs")


def mlp(seed: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _mha_losses(stage: int, rank: int) -> list[float]:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), _MHA(), nn.Linear(32, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": THRESHOLD},
    }
    engine, *_ = zerotron.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 4, generator=g)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class _MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn(h, h, h, need_weights=False)[0]


def _save_load(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _attrs_and_saving(rank: int, tmp: str) -> dict:
    res: dict = {}
    ref = mlp()
    with Init(persistence_threshold=THRESHOLD):
        model = mlp()
    params = list(model.parameters())
    ref_params = list(ref.parameters())

    # 1. DeepSpeed's attributes, with their meaning.
    res["ds_id"] = [p.ds_id for p in params]
    res["ds_shape"] = [tuple(p.ds_shape) for p in params]
    res["ds_numel"] = [p.ds_numel for p in params]
    res["ds_persist"] = [p.ds_persist for p in params]
    res["status_at_rest"] = [p.ds_status for p in params]
    res["has_ds_tensor"] = [hasattr(p, "ds_tensor") for p in params]
    res["ds_tensor_is_shard"] = [
        torch.equal(p.ds_tensor, shard(r.detach(), DP, rank))
        and p.ds_tensor.dim() == 1
        and p.ds_tensor.numel() == chunk_size(r.numel(), DP)
        for p, r in zip(params, ref_params)
        if not p.ds_persist
    ]
    w = model[0].weight
    fetch = start_fetches([w])[0]
    res["status_inflight"] = w.ds_status
    fetch.finish()
    res["status_after_fetch"] = w.ds_status
    free(w)
    res["status_after_free"] = w.ds_status
    # A client's pattern: find stage-3 parameters by ds_id, gather them, read whole values.
    zero_params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    with GatheredParameters(zero_params):
        res["status_gathered"] = [p.ds_status for p in params]
        res["gathered_equal"] = [
            torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref_params)
        ]
        saved_whole = _save_load(w)
    res["status_released"] = [p.ds_status for p in params]

    # 2. torch.save: a parameter pickles as a plain one of its data (empty at rest).
    loaded = _save_load(w)
    res["saved_param"] = (type(loaded).__name__, tuple(loaded.shape), loaded.requires_grad)
    res["saved_param_no_attrs"] = not hasattr(loaded, "ds_id")
    res["saved_whole_equal"] = torch.equal(saved_whole, ref[0].weight.detach())
    res["still_stage3"] = hasattr(w, "ds_id") and hasattr(w, "_zero")
    sd = _save_load(model.state_dict(keep_vars=True))
    res["saved_keep_vars"] = {k: tuple(v.shape) for k, v in sd.items()}
    res["saved_state_dict"] = {k: tuple(v.shape) for k, v in _save_load(model.state_dict()).items()}
    path = f"{tmp}/rank{rank}.pt"
    torch.save(model.state_dict(keep_vars=True), path)
    res["saved_file_loads"] = sorted(torch.load(path, weights_only=True))

    # ds_tensor under a stage-3 engine is still this rank's shard (a view of the fp32 master).
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD},
    }
    engine, *_ = zerotron.initialize(model=model, config=cfg)
    x, y = torch.ones(2, 8), torch.zeros(2, 4)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    ok = []
    for p in engine.module.parameters():
        if p.ds_persist:
            continue
        with GatheredParameters(p):
            whole = p.detach().clone()
        ok.append(torch.equal(p.ds_tensor.to(p.dtype), shard(whole, DP, rank)))
    res["engine_ds_tensor_is_shard"] = ok
    res["engine_status_at_rest"] = {
        p.ds_status for p in engine.module.parameters() if not p.ds_persist
    }

    # An engine without an optimizer (an RLHF reference model, evaluation): ZeRO-3 inference.
    ref_model = mlp()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD},
    }
    frozen, opt, _, sched = zerotron.initialize(model=ref_model, config=cfg)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out = frozen(x)
    res["no_optimizer"] = {
        "returned": (opt, sched, frozen.optimizer),
        "forward_equal": torch.equal(out, ref(x).detach()),
        "partitioned": [not p.ds_persist and p.numel() == 0 for p in frozen.module.parameters()],
        "state_dict_equal": all(
            torch.equal(v, ref.state_dict()[k])
            for k, v in frozen.module_state_dict(rank0_only=False).items()
        ),
    }
    try:
        frozen.backward(frozen(x).sum())
    except ConfigError as e:
        res["no_optimizer"]["backward"] = str(e)

    # nn.MultiheadAttention (its forward reads out_proj.weight directly) trained by the engine
    # at stage 3 and at stage 0: the same losses.
    res["mha_losses"] = {stage: _mha_losses(stage, rank) for stage in (0, 3)}

    # 3. zero.Init's arguments.
    with Init(enabled=False):
        plain = mlp()
    res["disabled"] = not any(hasattr(p, "ds_id") for p in plain.parameters())
    built = mlp()
    Init(module=built, persistence_threshold=THRESHOLD)
    res["module_arg"] = [
        (p.ds_persist, p.numel() == (r.numel() if p.ds_persist else 0))
        for p, r in zip(built.parameters(), ref_params)
    ]
    with Init(dtype=torch.bfloat16, persistence_threshold=THRESHOLD):
        half = mlp()
    res["dtype_arg"] = {str(p.dtype) for p in half.parameters()}
    with Init(config_dict_or_path={"bf16": {"enabled": True}}, persistence_threshold=THRESHOLD):
        half = mlp()
    res["config_dtype"] = {str(p.dtype) for p in half.parameters()}
    config_file = f"{tmp}/ds{rank}.json"
    with open(config_file, "w") as f:
        json.dump(
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_param_persistence_threshold": 200,
                    "offload_param": {"device": "cpu"},
                }
            },
            f,
        )
    with Init(config_dict_or_path=config_file):
        offloaded = mlp()
    # 200: the 128-element weight stays whole now; the shard of the other rests in the store.
    res["config_file_persist"] = [p.ds_persist for p in offloaded.parameters()]
    res["config_file_offloaded"] = [
        p.ds_tensor.device.type == "cpu" and read_shard(p) is p.ds_tensor
        for p in offloaded.parameters()
        if not p.ds_persist
    ]
    nvme = {"device": "nvme", "nvme_path": tmp}
    zero = {"offload_param": nvme, "stage3_param_persistence_threshold": THRESHOLD}
    with Init(config_dict_or_path={"zero_optimization": zero}):
        on_disk = mlp()
    w = on_disk[0].weight
    res["nvme_placeholder"] = (
        w.ds_tensor.numel(),
        torch.equal(read_shard(w), shard(ref[0].weight.detach(), DP, rank)),
    )
    with Init(remote_device="cpu", persistence_threshold=THRESHOLD):
        host = mlp()
    res["remote_cpu"] = read_shard(host[0].weight) is host[0].weight.ds_tensor
    coord = partition_parameters(host, persistence_threshold=THRESHOLD)
    res["remote_cpu_forward_equal"] = torch.equal(host(torch.ones(3, 8)), ref(torch.ones(3, 8)))
    coord.unpartition()
    res["unpartitioned_plain"] = not any(hasattr(p, "ds_id") for p in host.parameters())
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_attrs_and_saving, DP, str(tmp_path_factory.mktemp("ds_attrs")), timeout=120)


@ATTRS
def test_ds_attributes_have_deepspeeds_meaning(results):
    for res in results:
        ids = res["ds_id"]
        assert len(set(ids)) == 4 and all(isinstance(i, int) for i in ids)
        assert ids == results[0]["ds_id"]  # the same on every rank
        assert res["ds_shape"] == [(32, 8), (32,), (4, 32), (4,)]
        assert res["ds_numel"] == [256, 32, 128, 4]
        assert res["ds_persist"] == [False, True, False, True]
        assert res["has_ds_tensor"] == [True, False, True, False]
        assert res["ds_tensor_is_shard"] == [True, True]


@ATTRS
def test_ds_status_is_live(results):
    A, N, F = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT
    for res in results:
        assert res["status_at_rest"] == [N, A, N, A]
        assert (res["status_inflight"], res["status_after_fetch"]) == (F, A)
        assert res["status_after_free"] == N
        assert res["status_gathered"] == [A, A, A, A]
        assert res["status_released"] == [N, A, N, A]
        assert res["engine_status_at_rest"] == {N}


@ATTRS
def test_hasattr_ds_id_then_gathered_parameters_gives_whole_values(results):
    for res in results:
        assert res["gathered_equal"] == [True] * 4


@ATTRS
def test_an_engine_without_an_optimizer_runs_forward_on_partitioned_weights(results):
    for res in results:
        r = res["no_optimizer"]
        assert r["returned"] == (None, None, None)
        assert r["forward_equal"] and r["state_dict_equal"]
        assert r["partitioned"] == [True, False, True, False]  # weights at rest, biases whole
        assert "this engine has no optimizer" in r["backward"]


@ATTRS
def test_multihead_attention_trains_at_stage_3_as_at_stage_0(results):
    for res in results:
        assert res["mha_losses"][3] == res["mha_losses"][0]
    assert results[0]["mha_losses"][0] != results[1]["mha_losses"][0]  # own batches per rank


@ATTRS
def test_ds_tensor_is_the_shard_under_the_engine(results):
    for res in results:
        assert res["engine_ds_tensor_is_shard"] == [True, True]


@ATTRS
def test_torch_save_of_a_stage3_parameter_loads_weights_only(results):
    for res in results:
        assert res["saved_param"] == ("Parameter", (0,), True)  # its (empty) data at rest
        assert res["saved_param_no_attrs"] and res["still_stage3"]
        assert res["saved_whole_equal"]  # saved while gathered: the whole value


@ATTRS
def test_torch_save_of_a_stage3_state_dict_loads_weights_only(results):
    want = {"0.weight": (0,), "0.bias": (32,), "2.weight": (0,), "2.bias": (4,)}
    for res in results:
        assert res["saved_keep_vars"] == want
        assert res["saved_state_dict"] == want
        assert res["saved_file_loads"] == sorted(want)


@ATTRS
def test_init_enabled_module_dtype(results):
    for res in results:
        assert res["disabled"]
        assert res["module_arg"] == [(False, True), (True, True), (False, True), (True, True)]
        assert res["dtype_arg"] == {"torch.bfloat16"}
        assert res["config_dtype"] == {"torch.bfloat16"}  # DeepSpeed: the config's precision


@ATTRS
def test_init_config_file_and_remote_device(results):
    for res in results:
        assert res["config_file_persist"] == [False, True, True, True]
        assert res["config_file_offloaded"] == [True]
        assert res["nvme_placeholder"] == (0, True)
        assert res["remote_cpu"] and res["remote_cpu_forward_equal"]
        assert res["unpartitioned_plain"]


# --------------------------------------------------------------------------------------------
# One process: the signature and the refusals (raised before any group is needed)

DEEPSPEED_INIT = [  # deepspeed 0.19.8, runtime/zero/partition_parameters.py, with defaults
    ("module", None),
    ("data_parallel_group", None),
    ("mem_efficient_linear", True),
    ("remote_device", None),
    ("pin_memory", False),
    ("config_dict_or_path", None),
    ("config", None),
    ("enabled", True),
    ("dtype", None),
    ("mpu", None),
    ("zero_param_parallel_group", None),
    ("zero_quantized_weights", False),
    ("zero_quantized_nontrainable_weights", False),
    ("sequence_data_parallel_group", None),
    ("param_swapper", None),
]


def test_init_signature_is_deepspeeds():
    params = list(inspect.signature(Init).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional[: len(DEEPSPEED_INIT)] == DEEPSPEED_INIT
    assert positional[len(DEEPSPEED_INIT)][0] == "tensor_overrides"  # accepted, see Init


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"zero_quantized_weights": True}, UnsupportedError, "quantized weights"),
        ({"zero_quantized_nontrainable_weights": True}, UnsupportedError, "quantized weights"),
        (
            {"config_dict_or_path": {"zero_optimization": {"zero_quantized_weights": True}}},
            UnsupportedError,
            "quantized weights",
        ),
        ({"zero_param_parallel_group": object()}, UnsupportedError, "hpZ"),
        (
            {"config_dict_or_path": {"zero_optimization": {"zero_hpz_partition_size": 2}}},
            UnsupportedError,
            "hpZ",
        ),
        ({"param_swapper": object()}, UnsupportedError, "ParamOffloadStore"),
        ({"config": {}, "config_dict_or_path": {}}, ConfigError, "both config"),
        (
            {"data_parallel_group": object(), "sequence_data_parallel_group": object()},
            ConfigError,
            "both data_parallel_group",
        ),
        ({"dtype": torch.int8}, ConfigError, "not a training dtype"),
        ({"config_dict_or_path": "/nonexistent/ds.json"}, ConfigError, "cannot read"),
        (
            {
                "config_dict_or_path": {
                    "zero_optimization": {"stage3_param_persistence_threshold": "x"}
                }
            },
            ConfigError,
            "count of elements",
        ),
    ],
)
def test_init_refuses_what_zerotron_lacks(kwargs, error, match):
    with pytest.raises(error, match=match):
        Init(**kwargs)


def test_init_remote_device_must_agree_with_the_config():
    cfg = {"zero_optimization": {"offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="remote_device='nvme'"):
        Init(config_dict_or_path=cfg, remote_device="nvme")
    with pytest.raises(ConfigError, match="remote_device must be"):
        Init(remote_device="cuda:1")


def test_init_config_is_the_deprecated_name_of_config_dict_or_path():
    with pytest.warns(UserWarning, match="deprecated"):
        init = Init(config={"zero_optimization": {"stage3_param_persistence_threshold": 7}})
    assert init.persistence_threshold == 7
    auto = Init(
        config_dict_or_path={"zero_optimization": {"stage3_param_persistence_threshold": "auto"}}
    )
    assert auto.persistence_threshold == int(1e5)  # "auto" counts as unset
