"""zerotron.pipe.PipelineModule (DeepSpeed's) on the pipeline runtime, against one process.

Processes: an 8-layer MLP written as LayerSpecs, cut into pp=2 stages (partition by parameters,
uniform, with activation checkpointing every 2 layers), trained 3 steps with SGD and with
AdamW through ``Engine.train_batch`` on (inputs, labels) micro-batches, then one
``Engine.eval_batch``; a tied embedding (TiedLayerSpec on the first and last stage); the same
on pp=2 × dp=2. Each must give the losses, eval loss and final weights of ``nn.Sequential``
of the same layers (same seeds) trained in this process on the same micro-batches, within 1e-6
relative. Without processes: partition methods, layer building, errors.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerotron
import zerotron.checkpointing as ck
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel
from zerotron.errors import ConfigError, DataError, UnsupportedError
from zerotron.pipe import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    layer_name,
    layer_parameters,
    partition_layers,
    pipeline_engine,
)
from zerotron.pipe.stage import _sendable

from .spawn import run_ranks

H, B, M, STEPS, BASE_SEED = 16, 2, 4, 3, 1234
VOCAB, SEQ = 24, 5
LR = {"sgd": 0.05, "adamw": 1e-2}


class Scale(nn.Module):
    """A layer with one vector of weights (a different parameter count from Linear)."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x):
        return x * self.weight


def mlp_specs():
    # 8 layers; stage boundaries end on Tanh (whose backward needs its own output).
    return [
        LayerSpec(nn.Linear, H, H),
        LayerSpec(nn.Tanh),
        LayerSpec(Scale, H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, H, H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, H, H),
        LayerSpec(Scale, H),
    ]


def tied_specs():
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, H, H),
        LayerSpec(Scale, H),  # stage 0 of 2 ends here
        LayerSpec(nn.Linear, H, H),
        LayerSpec(nn.Tanh),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, H, forward_fn=logits),
    ]


def logits(embedding, x):
    return x @ embedding.weight.t()


def token_loss(out, labels):
    return F.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))


def reference_model(specs):
    """The same layers in one process; a tied key is one module used at each place."""
    layers, tied = [], {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                torch.manual_seed(BASE_SEED + i)
                tied[spec.key] = spec.build()
                layers.append(tied[spec.key])
            else:
                layers.append(_Call(spec.forward_fn, tied[spec.key]))
        else:
            torch.manual_seed(BASE_SEED + i)
            layers.append(spec.build())
    return nn.Sequential(*layers)


class _Call(nn.Module):
    def __init__(self, fn, module):
        super().__init__()
        self.fn, self.target = fn, [module]  # a list: not registered twice

    def forward(self, x):
        return self.fn(self.target[0], x)


def microbatches(step, count, tied=False):
    g = torch.Generator().manual_seed(500 + step)
    if tied:
        return [
            (
                torch.randint(0, VOCAB, (B, SEQ), generator=g),
                torch.randint(0, VOCAB, (B, SEQ), generator=g),
            )
            for _ in range(count)
        ]
    return [(torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)) for _ in range(count)]


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR["adamw"], weight_decay=0.01)


def reference(specs, opt_kind, dp, loss_fn, tied=False):
    model = reference_model(specs)
    opt = make_optimizer(opt_kind, model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        mbs = microbatches(step, dp * M, tied)
        loss = torch.stack([loss_fn(model(x), y) for x, y in mbs]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        evals = torch.stack([loss_fn(model(x), y) for x, y in microbatches(99, dp * M, tied)])
    names = {id(p): n for n, p in model.named_parameters()}
    weights = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    return losses + [evals.mean().item()], weights


CASES = {
    # name: (specs, optimizer, partition, checkpoint interval, tied)
    "sgd-parameters": ("mlp", "sgd", "parameters", 0),
    "adamw-uniform": ("mlp", "adamw", "uniform", 0),
    "adamw-type-checkpointed": ("mlp", "adamw", "type:linear|scale", 2),
    "tied-embedding": ("tied", "adamw", "uniform", 0),
    "adamw-initialize": ("mlp", "adamw", "uniform", 0),  # built by zerotron.initialize
}


def _train_rank(rank, pp, cases):
    st = initialize_model_parallel(pipeline_model_parallel_size=pp)
    out = {}
    for name in cases:
        kind, opt_kind, partition, interval = CASES[name]
        tied = kind == "tied"
        ck.reset(configuration=True)
        module = PipelineModule(
            tied_specs() if tied else mlp_specs(),
            num_stages=pp,
            loss_fn=token_loss if tied else F.mse_loss,
            seed_layers=True,
            base_seed=BASE_SEED,
            partition_method=partition,
            activation_checkpoint_interval=interval,
        )
        if name == "adamw-initialize":  # DeepSpeed's way: initialize(model=PipelineModule)
            engine, *_ = zerotron.initialize(
                model=module,
                optimizer=make_optimizer(opt_kind, module.parameters()),
                config={"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": M},
            )
        else:
            engine = pipeline_engine(
                module,
                make_optimizer(opt_kind, module.parameters()),
                num_microbatches=M,
                micro_batch_size=B,
            )
        losses = []
        for step in range(STEPS):
            mine = microbatches(step, st.dp_size * M, tied)[st.dp_rank * M : (st.dp_rank + 1) * M]
            losses.append(engine.train_batch(iter(mine)).item())
        mine = microbatches(99, st.dp_size * M, tied)[st.dp_rank * M : (st.dp_rank + 1) * M]
        losses.append(engine.eval_batch(iter(mine)).item())  # last: forward-only, after training
        out[name] = {
            "losses": losses,
            "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
            "parts": module.parts,
            "freed": engine.pipeline.freed_bytes,
            "shared": sorted(n for n, p in module.named_parameters() if getattr(p, "shared", 0)),
        }
    return out


def _check(results, cases, dp):
    specs = {"mlp": mlp_specs(), "tied": tied_specs()}
    for name in cases:
        kind, opt_kind, _, _ = CASES[name]
        tied = kind == "tied"
        loss_fn = token_loss if tied else F.mse_loss
        ref_losses, ref_weights = reference(specs[kind], opt_kind, dp, loss_fn, tied)
        seen = set()
        for rank, r in enumerate(results):
            got = r[name]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-6), (name, rank)
            for pname, w in got["weights"].items():
                ref_name = "0.weight" if pname == "tied_modules.embed.weight" else pname
                ref = ref_weights[ref_name]
                err = ((w - ref).norm() / ref.norm()).item()
                assert err <= 1e-6, f"{name} rank {rank} {pname}: relative error {err:.3g}"
                seen.add(ref_name)
        assert seen == set(ref_weights), name  # every weight lives on some stage
    return results


def test_pipeline_module_pp2_matches_sequential():
    cases = list(CASES)
    results = run_ranks(_train_rank, 2, 2, cases, timeout=90)
    _check(results, cases, dp=1)
    r0, r1 = results
    # parameters: Linear 272, Scale 16, Tanh 0. The heaviest stage holds two Linears at best
    # (560); of the splits reaching it the later boundary wins: [L T S T L T | L S].
    assert r0["sgd-parameters"]["parts"] == [0, 6, 8]
    assert r0["adamw-uniform"]["parts"] == [0, 4, 8]
    assert r0["adamw-initialize"]["parts"] == [0, 4, 8]
    # type:linear|scale: matching layers 0, 2, 4, 6, 7 -> 3 | 2.
    assert r0["adamw-type-checkpointed"]["parts"] == [0, 6, 8]
    assert r0["tied-embedding"]["parts"] == [0, 4, 7]
    # Each rank built only its own stage's layers.
    for stage, r in enumerate(results):
        for name in cases:
            lo, hi = r[name]["parts"][stage : stage + 2]
            held = {int(n.split(".")[0]) for n in r[name]["weights"] if n[0].isdigit()}
            assert held and held <= set(range(lo, hi)), (name, stage, held)
    # The tied embedding lives on both stages; the last stage's copy is not counted twice.
    assert "tied_modules.embed.weight" in r0["tied-embedding"]["weights"]
    assert "tied_modules.embed.weight" in r1["tied-embedding"]["weights"]
    assert r0["tied-embedding"]["shared"] == [] and r1["tied-embedding"]["shared"] == [
        "tied_modules.embed.weight"
    ]
    # Stage 0 ends on Tanh, whose backward needs its output: sent as a view, never freed.
    assert r0["sgd-parameters"]["freed"] == 0
    # The tied case's stage 0 ends on Scale (x * w keeps x and w, not its output): each sent
    # output was freed, M micro-batches a step.
    assert r0["tied-embedding"]["freed"] == STEPS * M * B * SEQ * H * 4


def test_pipeline_module_pp2_dp2_matches_sequential():
    cases = ["adamw-uniform", "tied-embedding"]
    results = run_ranks(_train_rank, 4, 2, cases, timeout=90)
    _check(results, cases, dp=2)


# ---- without processes --------------------------------------------------------------------------


def test_partition_methods():
    specs = mlp_specs()
    assert [layer_parameters(s) for s in specs] == [272, 0, 16, 0, 272, 0, 272, 16]
    assert partition_layers(specs, 2, "uniform") == [0, 4, 8]
    assert partition_layers(specs, 3, "uniform") == [0, 3, 6, 8]
    # Balanced by parameters: the heaviest stage as light as possible (one Linear + one Scale,
    # 288), then the most even: [L T S T | L T | L S] and [L T S T | L T | L | S].
    assert partition_layers(specs, 3, "parameters") == [0, 4, 6, 8]
    assert partition_layers(specs, 4, "parameters") == [0, 4, 6, 7, 8]
    # type:regex counts matching class names (case-insensitive): Linear layers 0, 4, 6.
    assert partition_layers(specs, 3, "type:LINEAR") == [0, 4, 6, 8]
    # Tanh at 1, 3, 5: every cut from 2 to 5 splits them 1 | 2 or 2 | 1; the latest wins.
    assert partition_layers(specs, 2, "type:tanh") == [0, 5, 8]
    # Modules and plain callables count too (callables have no parameters).
    mixed = [nn.Linear(4, 4), torch.relu, nn.Linear(4, 8), LayerSpec(nn.Linear, 8, 8)]
    assert partition_layers(mixed, 2, "parameters") == [0, 3, 4]  # 20 + 0 + 40 | 72
    assert layer_name(mixed[1]) == "relu" and layer_name(mixed[3]) == "Linear"
    assert partition_layers(mixed, 3, "type:relu") == [0, 2, 3, 4]
    with pytest.raises(ConfigError, match="no layer's class name matches"):
        partition_layers(specs, 2, "type:Conv")
    with pytest.raises(ConfigError, match="bad regular expression"):
        partition_layers(specs, 2, "type:(")
    with pytest.raises(ConfigError, match="unknown partition method"):
        partition_layers(specs, 2, "size")
    with pytest.raises(UnsupportedError):
        partition_layers(specs, 2, "profile")
    with pytest.raises(ConfigError, match="cannot fill"):
        partition_layers(specs[:1], 2, "uniform")


def test_counting_parameters_builds_on_meta_without_drawing():
    torch.manual_seed(9)
    before = torch.get_rng_state()
    assert layer_parameters(LayerSpec(nn.Linear, 1000, 1000)) == 1_001_000
    assert torch.equal(torch.get_rng_state(), before)


def test_one_stage_module_equals_sequential_and_names_follow_deepspeed():
    specs = mlp_specs()
    module = PipelineModule(specs, seed_layers=True, base_seed=BASE_SEED, loss_fn=F.mse_loss)
    ref = reference_model(specs)
    assert module.num_stages == 1 and module.stage_id == 0 and module.parts == [0, 8]
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randn(3, H)
    assert torch.equal(module(x), ref(x))
    # Checkpointed every 3 layers: the same values and gradients.
    ckpt = PipelineModule(specs, seed_layers=True, activation_checkpoint_interval=3)
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    module(xa).sum().backward()
    ckpt(xb).sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for (n, p), (_, q) in zip(module.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    # Token ids into a tied embedding: the first run of layers needs no input gradient, so it is
    # not checkpointed (it would lose the embedding's gradient); the rest is.
    runs = []

    def counting_checkpoint(fn, *args):
        runs.append(len(args))
        return ck.checkpoint(fn, *args)

    plain, ckpt = (
        PipelineModule(
            tied_specs(),
            seed_layers=True,
            activation_checkpoint_interval=k,
            activation_checkpoint_func=counting_checkpoint,
        )
        for k in (0, 3)
    )
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    plain(tokens).sum().backward()
    ckpt(tokens).sum().backward()
    assert runs == [1]  # layers 3..5 only (6, a forward_fn call, holds no module)
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_modules_callables_and_tied_layers_on_one_stage():
    lin = nn.Linear(H, H)
    first, last = tied_specs()[0], tied_specs()[-1]  # key "embed" twice: one module
    module = PipelineModule([first, lin, torch.tanh, last], partition_method="uniform")
    assert module.forward_funcs[1] is lin and module.forward_funcs[2] is torch.tanh
    assert set(dict(module.named_parameters())) == {
        "tied_modules.embed.weight",
        "1.weight",
        "1.bias",
    }
    emb = module.tied_modules["embed"]
    assert module.forward_funcs[0] is emb and module.forward_funcs[3].module is emb
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(module(tokens), torch.tanh(lin(emb(tokens))) @ emb.weight.t())
    # One stage: nothing to reduce, and no copy is marked shared.
    module.allreduce_tied_weight_gradients()
    assert not getattr(emb.weight, "shared", False)


def test_errors():
    # No layout yet: num_stages lays one out, which 1 process cannot hold.
    with pytest.raises(ConfigError, match="2 pipeline stages .* do not divide the 1 ranks"):
        PipelineModule(mlp_specs(), num_stages=2)
    with pytest.raises(ConfigError, match="nn.Module subclass"):
        LayerSpec(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="layers\\[1\\]"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2), 3])
    with pytest.raises(ConfigError, match="activation_checkpoint_interval"):
        PipelineModule(mlp_specs(), activation_checkpoint_interval=-1)


def test_num_stages_other_than_the_existing_layout_is_refused():
    initialize_model_parallel(pipeline_model_parallel_size=1)
    try:
        with pytest.raises(ConfigError, match="2 stages but the pipeline-parallel size is 1"):
            PipelineModule(mlp_specs(), num_stages=2)
    finally:
        destroy_model_parallel()


def test_sendable_keeps_outputs_their_backward_needs():
    x = torch.randn(3, requires_grad=True)
    for out, needs_view in [
        (torch.tanh(x), True),
        (torch.relu(x), True),
        (x * 2, False),
        (nn.functional.linear(x, torch.eye(3)), False),
    ]:
        sent = _sendable(out)
        assert (sent._base is out) == needs_view and torch.equal(sent, out)


def test_single_stage_runtime_rejects_bad_batches():
    from zerotron.pipe.stage import PipelineModuleRuntime

    module = PipelineModule(mlp_specs(), loss_fn=F.mse_loss)
    runtime = PipelineModuleRuntime(module, "1f1b", 1)
    with pytest.raises(DataError, match="inputs, labels"):
        runtime.train_step(iter([{"tokens": torch.zeros(1)}]))
    loss = runtime.train_step(iter([(torch.ones(2, H), torch.zeros(2, H))]))
    assert torch.equal(loss, F.mse_loss(module(torch.ones(2, H)), torch.zeros(2, H)).detach())
    assert runtime.variable_seq_lengths is False
    dynamic = PipelineModule(mlp_specs(), loss_fn=F.mse_loss, dynamic_shape=True)
    assert PipelineModuleRuntime(dynamic, "1f1b", 1).variable_seq_lengths is True


# ---- DeepSpeed's behaviours: own topology, initialize's training data, progress lines ---------

AUTO_ORDER = [0, 1, 0]  # two steps of data, a third step starts it over


def _auto_topology_rank(rank):
    import contextlib
    import io

    from torch.utils.data import TensorDataset

    from zerotron.distributed.state import is_model_parallel_initialized, state

    assert not is_model_parallel_initialized()
    module = PipelineModule(
        mlp_specs(), num_stages=2, loss_fn=F.mse_loss, seed_layers=True,
        base_seed=BASE_SEED, partition_method="uniform",
    )  # fmt: skip
    st = state()
    pairs = [mb for step in range(2) for mb in microbatches(step, M)]
    data = TensorDataset(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine, *_ = zerotron.initialize(
            model=module,
            optimizer=make_optimizer("adamw", module.parameters()),
            training_data=data,
            config={
                "train_micro_batch_size_per_gpu": B,
                "gradient_accumulation_steps": M,
                "steps_per_print": 1,
            },
        )
        losses = [engine.train_batch().item() for _ in AUTO_ORDER]
    return {
        "sizes": (st.pp_size, st.dp_size, st.pp_rank),
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in module.named_parameters()},
        "printed": printed.getvalue(),
    }


@pytest.fixture(scope="module")
def auto_topology():
    results = run_ranks(_auto_topology_rank, 2, timeout=90)
    model = reference_model(mlp_specs())
    opt = make_optimizer("adamw", model.parameters())
    losses = []
    for step in AUTO_ORDER:
        opt.zero_grad()
        loss = torch.stack([F.mse_loss(model(x), y) for x, y in microbatches(step, M)]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return results, losses, dict(model.named_parameters())


AUTO = pytest.mark.xdist_group("pipe_auto_topology")


@AUTO
def test_pipeline_module_num_stages_builds_deepspeeds_pipe_data_topology(auto_topology):
    results, _, _ = auto_topology
    assert [r["sizes"] for r in results] == [(2, 1, 0), (2, 1, 1)]


@AUTO
def test_train_batch_without_data_iter_repeats_initializes_training_data(auto_topology):
    results, ref_losses, ref_weights = auto_topology
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6), rank
        for name, w in r["weights"].items():
            ref = ref_weights[name]
            assert ((w - ref).norm() / ref.norm()).item() <= 1e-6, (rank, name)


@AUTO
def test_pipeline_engine_prints_deepspeeds_progress_line_on_rank_0(auto_topology):
    import re

    results, _, _ = auto_topology
    pattern = r"steps: (\d+) loss: (\d+\.\d{4}) iter time \(s\): \d+\.\d{3} samples/sec: \d+\.\d{3}"
    lines = re.findall(pattern, results[0]["printed"])
    expected = [(str(i + 1), f"{loss:0.4f}") for i, loss in enumerate(results[0]["losses"])]
    assert lines == expected, results[0]["printed"]
    assert "steps: " not in results[1]["printed"]
