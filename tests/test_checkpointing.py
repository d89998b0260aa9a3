"""zerotron.checkpointing (DeepSpeed's activation checkpointing API).

Every check compares with the same computation run without checkpointing, exactly (``equal``):
the recompute must draw the same dropout masks from the CPU generator and the RNG tracker's
streams and leave the random state where an ordinary run leaves it. partition_activations on
two gloo ranks is in tests/distributed/test_checkpointing_ranks.py.
Megatron's selective recompute in models/gpt.py must rerun the attention core and nothing else.
"""

import json
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerotron.checkpointing as ck
from zerotron.distributed import mpu
from zerotron.distributed.rng import MODEL_PARALLEL_RNG, get_rng_tracker
from zerotron.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh():
    ck.reset(configuration=True)
    get_rng_tracker().reset()
    yield
    ck.reset(configuration=True)
    get_rng_tracker().reset()


class Block(nn.Module):
    """Linear -> GELU -> dropout (default stream) -> dropout (tracker stream) -> Linear."""

    def __init__(self, h=16, tracker=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.tracker = tracker

    def forward(self, x, scale, note):
        assert note == "pass-through"
        y = F.dropout(F.gelu(self.fc1(x)), 0.3, training=True)
        if self.tracker:
            with get_rng_tracker().fork():
                y = F.dropout(y, 0.2, training=True)
        return self.fc2(y) * scale + x, (y > 0).sum(-1)  # a float and an integer output


def run_blocks(blocks, x, scale, use_ckpt, seed=7):
    """Chain of blocks; returns outputs, every gradient, and the random state after backward."""
    for p in blocks.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    if any(b.tracker for b in blocks):
        ck.model_parallel_cuda_manual_seed(seed)
    h, counts = x, []
    for b in blocks:
        h, c = (
            ck.checkpoint(b, h, scale, "pass-through") if use_ckpt else b(h, scale, "pass-through")
        )
        counts.append(c)
    kept = ck.saved_bytes(h)
    (h.pow(2).sum()).backward()
    grads = [x.grad] + [p.grad for p in blocks.parameters()]
    tracker = get_rng_tracker().get_states()
    return h.detach(), counts, grads, torch.get_rng_state(), tracker, kept


def _blocks(tracker=False, n=3, h=16):
    torch.manual_seed(0)
    return nn.ModuleList(Block(h, tracker) for _ in range(n))


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("tracker", [False, True], ids=["default-stream", "tracker-stream"])
@pytest.mark.parametrize("cpu", [False, True], ids=["on-device", "cpu-checkpointing"])
def test_recompute_equals_plain_run_exactly_with_dropout(tracker, cpu):
    ck.configure(None, checkpoint_in_cpu=cpu)
    blocks = _blocks(tracker)
    x = torch.randn(4, 16)
    scale = torch.tensor(1.5)  # a tensor without grad passes through
    ref = run_blocks(blocks, x, scale, False)
    got = run_blocks(blocks, x, scale, True)
    for i, what in enumerate(["output", "counts", "grads", "cpu rng after", "tracker after"]):
        assert _same(got[i], ref[i]), what
    assert all(g is not None for g in got[2])
    # Kept for backward: the last call's input x (4x16 fp32) and the scale scalar.
    assert got[5] == 4 * 16 * 4 + 4


def test_cpu_checkpointing_keeps_host_copies_and_restores_the_device():
    ck.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    seen = {}

    def f(x, w):
        seen.setdefault("devices", []).append((x.device, w.device))
        return (x * w).sum(-1)

    x = torch.randn(3, 5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    out = ck.checkpoint(f, x, w)
    kept = out.grad_fn.saved_tensors
    assert [t.device.type for t in kept] == ["cpu", "cpu"]
    # Copies, not the inputs themselves: their own storage.
    assert {t.data_ptr() for t in kept}.isdisjoint({x.data_ptr(), w.data_ptr()})
    assert [torch.equal(k, v) for k, v in zip(kept, (x, w))] == [True, True]
    out.sum().backward()
    assert seen["devices"] == [(x.device, w.device)] * 2  # recompute ran on the input's device
    assert torch.equal(x.grad, w.detach().expand(3, 5)) and torch.equal(w.grad, x.detach().sum(0))


def test_inputs_without_grad_non_tensor_args_and_single_output():
    calls = []

    def f(x, table, mode):
        calls.append(mode)
        return x[table] * 2 if mode == "take" else x

    x = torch.randn(6, 2, requires_grad=True)
    table = torch.tensor([0, 2, 2])  # integer tensor: kept, gets no gradient
    out = ck.checkpoint(f, x, table, "take")
    assert out.requires_grad and calls == ["take"]
    out.sum().backward()
    assert calls == ["take", "take"]
    expected = torch.zeros(6, 2)
    expected[0], expected[2] = 2, 4
    assert torch.equal(x.grad, expected)


def test_no_input_requires_grad_gives_an_output_without_graph():
    with pytest.warns(UserWarning, match="no tensor input requires grad"):
        out = ck.checkpoint(lambda x: x * 3, torch.ones(2))
    assert not out.requires_grad and torch.equal(out, torch.full((2,), 3.0))


def test_model_parallel_cuda_manual_seed_megatron_semantics_on_cpu():
    ck.model_parallel_cuda_manual_seed(42)
    assert ck.get_cuda_rng_tracker() is get_rng_tracker()
    default = torch.rand(4)
    with ck.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    assert torch.equal(default, torch.rand(4, generator=torch.Generator().manual_seed(42)))
    g = torch.Generator().manual_seed(42 + 2718 + 0)  # tp rank 0
    assert torch.equal(forked, torch.rand(4, generator=g))
    assert get_rng_tracker().names() == [MODEL_PARALLEL_RNG]


def test_configure_reads_the_deepspeed_section_and_explicit_args_override(tmp_path):
    path = tmp_path / "ds.json"
    section = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4e0,  # numbers like 5e8 are accepted when integral
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    assert not ck.is_configured()
    cfg = ck.configure(mpu, deepspeed_config=str(path), checkpoint_in_cpu=False)
    assert ck.is_configured() and ck.config() == cfg
    assert cfg == ck.CheckpointingConfig(
        partition_activations=True,
        contiguous_checkpointing=True,
        num_checkpoints=4,
        checkpoint_in_cpu=False,  # the explicit argument wins
        synchronize=True,
        profile=True,
    )
    # DeepSpeed's helpers change one setting.
    ck.partition_activations_in_checkpoint(False)
    ck.set_num_layers(6)
    assert ck.config() == replace(cfg, partition_activations=False, num_checkpoints=6)
    # Each call replaces the whole configuration; no section means the defaults.
    assert ck.configure(None, deepspeed_config={}) == ck.CheckpointingConfig()
    ck.reset(configuration=True)
    assert not ck.is_configured()


@pytest.mark.parametrize(
    "section, args, where",
    [
        ({"partition_activations": "yes"}, {}, "activation_checkpointing.partition_activations"),
        ({"number_checkpoints": 2.5}, {}, "activation_checkpointing.number_checkpoints"),
        ({"number_checkpoints": True}, {}, "activation_checkpointing.number_checkpoints"),
        ({"profile": 1}, {}, "activation_checkpointing.profile"),
        ({}, {"synchronize": "no"}, "configure(synchronize=...)"),
        ({}, {"num_checkpoints": 0}, "configure(num_checkpoints=...)"),
        (
            {"contiguous_memory_optimization": True, "number_checkpoints": 2},
            {},
            "activation_checkpointing.contiguous_memory_optimization",
        ),
        (
            {"contiguous_memory_optimization": True, "partition_activations": True},
            {},
            "activation_checkpointing.number_checkpoints",
        ),
    ],
)
def test_configure_errors_name_the_key_path(section, args, where):
    with pytest.raises(ConfigError) as err:
        ck.configure(None, deepspeed_config={"activation_checkpointing": section}, **args)
    assert err.value.where.endswith(where), err.value.where
    assert not ck.is_configured()


def test_configure_error_names_the_file_and_warns_on_unknown_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": "true"}}))
    with pytest.raises(ConfigError, match="ds.json: activation_checkpointing.cpu_checkpointing"):
        ck.configure(None, deepspeed_config=path)
    with pytest.warns(UserWarning, match="activation_checkpointing.partition_activation"):
        ck.configure(
            None, deepspeed_config={"activation_checkpointing": {"partition_activation": 1}}
        )
    with pytest.raises(ConfigError, match="must be an object"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": [True]})


def test_profile_and_synchronize():
    ck.configure(None, profile=True, synchronize=True)
    blocks = _blocks(n=2)
    run_blocks(blocks, torch.randn(4, 16), 1.0, True)
    t = ck.timings()
    assert {k: v[0] for k, v in t.items()} == {"forward": 2, "backward": 2, "recompute": 2}
    assert all(v[1] >= 0 for v in t.values()) and t["backward"][1] >= t["recompute"][1]
    ck.reset()
    assert ck.timings() == {} and ck.is_configured()


def test_contiguous_buffers_are_bounded_by_number_checkpoints():
    # One process: the tensor-parallel group has one rank, each "piece" is the whole input.
    ck.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(2, 8, requires_grad=True)
    y1 = ck.checkpoint(lambda a, b: a * w + b, x, x + 1)  # two float inputs, one buffer
    assert len(y1.grad_fn.saved_tensors) == 1 and y1.grad_fn.saved_tensors[0].numel() == 32
    y2 = ck.checkpoint(lambda a: a * w, y1)
    assert ck.active_partitioned_buffers() == 2
    with pytest.raises(ConfigError, match="more than 2 checkpointed calls"):
        ck.checkpoint(lambda a: a * w, y2)
    y2.sum().backward()
    assert ck.active_partitioned_buffers() == 0  # backward released both
    got = (w.grad, x.grad)
    w.grad = x.grad = None
    ((x * w + (x + 1)) * w).sum().backward()
    assert _same(got, (w.grad, x.grad))


def test_torch_autograd_grad_is_refused():
    x = torch.randn(3, requires_grad=True)
    y = ck.checkpoint(lambda a: a.sin(), x)
    with pytest.raises(ConfigError, match="backward"):
        torch.autograd.grad(y.sum(), x)


# ---- selective recompute in models/gpt.py -----------------------------------------------------


def test_gpt_selective_recompute_reruns_only_the_attention_core(monkeypatch):
    import zerotron.models.gpt as gpt_module
    from zerotron.models.gpt import GPT, GPTConfig

    def build(granularity):
        torch.manual_seed(3)
        cfg = GPTConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=8,
            vocab_size=64,
            attention_dropout=0.2,
            hidden_dropout=0.1,
            recompute_granularity=granularity,
        )
        return GPT(cfg)

    core_calls = []
    real_core = gpt_module._core_attention
    monkeypatch.setattr(
        gpt_module, "_core_attention", lambda *a: core_calls.append(1) or real_core(*a)
    )
    tokens = torch.randint(0, 64, (2, 8))
    labels = torch.randint(0, 64, (2, 8))
    results = {}
    for granularity in (None, "selective"):
        model = build(granularity)
        module_calls = []
        hook = _recorder(module_calls)
        for name, m in model.named_modules():
            if name and not list(m.children()):  # leaf modules: linears, norms, embeddings
                m.register_forward_hook(hook)
        torch.manual_seed(11)
        core_calls.clear()
        loss = model(tokens, None, None, labels).mean()
        forward = (len(core_calls), len(module_calls))
        loss.backward()
        backward = (len(core_calls) - forward[0], len(module_calls) - forward[1])
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[granularity] = (loss.detach(), forward, backward, grads)
    ref, sel = results[None], results["selective"]
    assert ref[2] == (0, 0)
    assert sel[1] == ref[1]  # the same forward
    assert sel[2] == (2, 0)  # backward reran the 2 attention cores and no module
    assert torch.equal(sel[0], ref[0]) and _same(sel[3], ref[3])  # same dropout masks


def _recorder(calls):
    return lambda module, *_: calls.append(module)


def test_no_warnings_from_plain_use():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.checkpoint(lambda a: a * 2, torch.ones(2, requires_grad=True)).sum().backward()
