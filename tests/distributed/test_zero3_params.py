"""ZeRO stage 3 parameters on 2 gloo ranks (fp32 unless said): partitioned modules compute
exactly what the whole module computes, gather every parameter exactly twice per step, and hold
only their shards between steps; zero.Init builds the eager model with bounded memory;
GatheredParameters broadcasts a modifier rank's changes; offloaded shards work the same.

Each rank feeds its own batch to a partitioned copy of a reference model and compares with the
reference in the same process (bitwise: the gathered weights are the reference's values). Models:
zerotron's 2-layer, 64-wide GPT (vocab 101, seq 16, dropout on; with and without full
recompute), an ``nn.Sequential`` MLP, and a module whose forward takes one of two branches (the
recorded fetch order goes stale), and one with ``nn.MultiheadAttention`` (which reads a child's
weight directly). Persistence threshold 100: LayerNorm parameters (64
elements) stay whole, everything else is partitioned (with padding: 100 * 64 rows, odd sizes).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zerotron.distributed.comm import Group, ledger
from zerotron.distributed.state import state
from zerotron.errors import ConfigError
from zerotron.models import GPT, GPTConfig
from zerotron.zero.init import Init
from zerotron.zero.partition import chunk_size, shard
from zerotron.zero.stage3 import (
    GatheredParameters,
    coordinator_of,
    gathered_state_dict,
    is_partitioned,
    load_full_state_dict,
    modified_parameters,
    partition_parameters,
    read_shard,
)

from .spawn import run_ranks

DP = 2
THRESHOLD = 100
STEPS = 2
# The tests reading one spawn share an xdist group (--dist loadgroup): each spawn runs once.
LIFECYCLE = pytest.mark.xdist_group("zero3_lifecycle")
INIT = pytest.mark.xdist_group("zero3_init")


def gpt(recompute: str | None = None, dtype: torch.dtype = torch.float32) -> GPT:
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=101,  # odd: every embedding chunk padded
        recompute_granularity=recompute,
    )
    return GPT(cfg, tp_group=Group.single("tp")).to(dtype)


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 5)
    )


class Branchy(nn.Module):
    """Takes layer ``a`` or ``b`` as told: the fetch order changes between passes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.b(h) if self.use_b else self.a(h)))


class UsesOther(nn.Module):
    """Reads ``other.weight`` without calling ``other``, inside GatheredParameters(fwd_module)."""

    def __init__(self) -> None:
        super().__init__()
        self.own, self.other = nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with GatheredParameters(self.other.weight, fwd_module=self):
            h = nn.functional.linear(x, self.other.weight)
        return self.out(torch.tanh(self.own(torch.tanh(h))))


class WithMHA(nn.Module):
    """``nn.MultiheadAttention``, whose forward reads ``self.out_proj.weight`` without calling
    ``out_proj``: stage 3 gathers it on that first read and registers it with the attention."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def loss_of(model: nn.Module, kind: str, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    torch.manual_seed(7)  # dropout masks: the same draw for the reference and the copy
    if kind in ("mlp", "branchy", "uses_other", "mha"):
        return nn.functional.mse_loss(model(x), y)
    return model(x, labels=y).float().mean()


def batch_for(kind: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "mlp":
        return torch.randn(6, 24, generator=g), torch.randn(6, 5, generator=g)
    if kind == "branchy":
        return torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
    if kind == "mha":
        return torch.randn(6, 5, 16, generator=g), torch.randn(6, 5, 4, generator=g)
    ids = torch.randint(0, 101, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def build(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return mlp().to(dtype)
    if kind == "branchy":
        return Branchy().to(dtype)
    if kind == "mha":
        return WithMHA().to(dtype)
    return gpt("full" if kind == "gpt-recompute" else None, dtype)


# --------------------------------------------------------------------------------------------
# Spawn 1: the training-step lifecycle


CONFIGS = [
    # kind, dtype, prefetch_bucket_size, max_live_parameters, max_reuse_distance
    ("gpt", torch.float32, int(5e7), int(1e9), 0),
    ("gpt", torch.float32, None, int(1e9), 0),  # zerotron's default: the next module only
    ("gpt-recompute", torch.float32, 3000, int(1e9), 0),
    ("gpt", torch.float32, 0, int(1e9), 0),
    ("gpt", torch.float32, int(5e7), 30000, 0),
    ("mlp", torch.float32, 4000, int(1e9), 0),
    ("gpt", torch.bfloat16, int(5e7), int(1e9), 0),
    ("branchy", torch.float32, int(5e7), int(1e9), 0),
    ("mha", torch.float32, int(5e7), int(1e9), 0),
    # DeepSpeed's default reuse distance: kept from the forward to the backward
    ("gpt", torch.float32, None, int(1e9), int(1e9)),
    ("gpt-recompute", torch.float32, 3000, int(1e9), int(1e9)),
    # 1: only what is used again at once (the tied word embedding, output layer's forward to
    # its backward)
    ("gpt", torch.float32, int(5e7), int(1e9), 1),
]
PATHS = {"branchy": "aabbb"}  # per step: the branch taken (others: STEPS steps)


def _lifecycle(rank: int) -> list[dict]:
    dp = state().dp
    out = []
    for kind, dtype, prefetch, max_live, reuse in CONFIGS:
        ref = build(kind, dtype)
        model = copy.deepcopy(ref)
        coord = partition_parameters(
            model,
            dp,
            persistence_threshold=THRESHOLD,
            prefetch_bucket_size=prefetch,
            max_live_parameters=max_live,
            max_reuse_distance=reuse,
        )
        names = {id(p): n for n, p in model.named_parameters()}
        ref_params = dict(ref.named_parameters())
        grads: dict[str, torch.Tensor] = {}

        def take_grad(p: torch.Tensor, grads=grads, names=names) -> None:
            # Runs after stage 3's own hook, as the optimizer's does: the full grad is there.
            grads[names[id(p)]] = p.grad.clone()
            p.grad = None

        for p in coord.params:
            p.register_post_accumulate_grad_hook(take_grad)
        gathered_storages: list[StorageWeakRef] = []

        def see_gathered(module, args, store=gathered_storages, coord=coord):
            for p in coord._fetch_list(module):  # its own and its external parameters
                if p.numel():
                    store.append(StorageWeakRef(p.data.untyped_storage()))

        for m in model.modules():
            m.register_forward_pre_hook(see_gathered)

        steps = []
        paths = PATHS.get(kind, "a" * STEPS)
        for step, path in enumerate(paths):
            model.use_b = ref.use_b = path == "b"
            batch = batch_for(kind, rank, step)
            prefetches = coord.prefetches
            with ledger.capture() as cap:
                loss = loss_of(model, kind, batch)
                # The graph is alive, yet released weights are freed: saved views of them are
                # kept as references to the parameter, not to the gathered memory.
                freed_after_forward = all_freed(gathered_storages)
                gathered_storages.clear()
                loss.backward()
            ref_loss = loss_of(ref, kind, batch)
            ref_loss.backward()
            bad_grads = []
            used_chunks = 0  # of the partitioned parameters this path uses
            for name, rp in ref_params.items():
                p = dict(model.named_parameters())[name]
                g = grads.pop(name, None) if is_partitioned(p) else p.grad
                if rp.grad is None:
                    if g is not None:
                        bad_grads.append(name)
                elif g is None or not torch.equal(g, rp.grad):
                    bad_grads.append(name)
                elif is_partitioned(p):
                    used_chunks += chunk_size(p.ds_numel, DP)
            # Between steps: only shards, nothing gathered, every gathered storage freed.
            held = sum(
                read_shard(p).nbytes if is_partitioned(p) else p.data.nbytes
                for p in model.parameters()
            )
            loss = loss.detach()
            steps.append(
                {
                    "loss": float(ref_loss.detach()),
                    "loss_equal": bool(torch.equal(loss.detach(), ref_loss.detach())),
                    "bad_grads": bad_grads,
                    "ag_bytes": cap.total("dp", "all_gather"),
                    "ag_calls": cap.count("dp", "all_gather"),
                    "other_ops": {k: v for k, v in cap.summary().items() if k[1] != "all_gather"},
                    "empty_at_rest": all(p.numel() == 0 for p in coord.params),
                    "live_at_rest": coord.live_numel,
                    "freed_after_forward": freed_after_forward,
                    "freed": all_freed(gathered_storages),
                    "held_bytes": held,
                    "prefetches": coord.prefetches - prefetches,
                    "used_chunks": used_chunks,
                    # The first pass records the order. A pass that departs from it drops it
                    # (after prefetching along it up to there) and the next pass of its kind
                    # records anew (no-grad forwards, as the check's, keep their own order).
                    "records": step == 0,
                    "after_change": step > 1 and paths[step - 1] != paths[step - 2],
                    "path_changed": step > 0 and path != paths[step - 1],
                }
            )
            steps[-1]["no_grad_loss_equal"] = _equal_loss(model, ref, kind, batch)
            gathered_storages.clear()
            _update(model, ref, dp)
        partitioned = [p for p in model.parameters() if is_partitioned(p)]
        persistent = [p for p in model.parameters() if not is_partitioned(p)]
        out.append(
            {
                "config": (kind, str(dtype), prefetch, max_live, reuse),
                "steps": steps,
                "elt": torch.tensor([], dtype=dtype).element_size(),
                "chunks": sum(chunk_size(p.ds_numel, DP) for p in partitioned),
                "partitioned_numel": sum(p.ds_numel for p in partitioned),
                "n_partitioned": len(partitioned),
                "persistent_numel": sum(p.numel() for p in persistent),
                "peak_live": coord.peak_live_numel,
                "largest_fetch": max(
                    sum(p.ds_numel for p in coord._fetch_list(m)) for m in model.modules()
                ),
                "word_chunk": chunk_size(model.embedding.word_embeddings.weight.ds_numel, DP)
                if kind.startswith("gpt")
                else None,
                "externals": sorted(
                    (m_name, names[pid])
                    for m_name, m in model.named_modules()
                    for pid in m.__dict__.get("_zero_external_params", {})
                ),
            }
        )
    return out


def all_freed(storages: list[StorageWeakRef], patience: float = 2.0) -> bool:
    """Every storage freed: nothing of ours holds it. (A gathered buffer that *is* a parameter
    may outlive its release by a moment while gloo's worker thread drops the finished work.)"""
    deadline = time.monotonic() + patience
    while not all(s.expired() for s in storages):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _equal_loss(model, ref, kind, batch) -> bool:
    """The partitioned model's loss (no grad: a second forward) equals the reference's."""
    with torch.no_grad():
        return bool(torch.equal(loss_of(model, kind, batch), loss_of(ref, kind, batch)))


@torch.no_grad()
def _update(model: nn.Module, ref: nn.Module, dp: Group) -> None:
    """Change the weights between steps, alike on every rank (each writes its own shard), so
    the second step gathers new values."""
    for p, rp in zip(model.parameters(), ref.parameters()):
        rp.mul_(0.9).add_(0.01)
        if is_partitioned(p):
            p.ds_tensor.copy_(shard(rp.detach(), dp.size, dp.rank))
        else:
            p.copy_(rp)
        rp.grad = None
        p.grad = None


@pytest.fixture(scope="module")
def lifecycle() -> list:
    """One spawn for all configurations (the tests below read its results)."""
    return run_ranks(_lifecycle, DP, timeout=120)


@LIFECYCLE
def test_forward_and_grads_equal_whole_model(lifecycle):
    for rank_results in lifecycle:
        for res in rank_results:
            for step in res["steps"]:
                assert step["loss_equal"] and step["no_grad_loss_equal"], res["config"]
                assert step["bad_grads"] == [], (res["config"], step["bad_grads"])
    # The ranks fed different batches: their losses differ (each gathered the same weights).
    assert lifecycle[0][0]["steps"][0]["loss"] != lifecycle[1][0]["steps"][0]["loss"]


@LIFECYCLE
def test_parameter_read_outside_its_module_is_registered_on_first_use(lifecycle):
    for rank_results in lifecycle:
        (res,) = [r for r in rank_results if r["config"][0] == "mha"]
        # nn.MultiheadAttention reads out_proj.weight itself: registered with it in the first
        # forward (the equality and gather counts are checked with every config above/below).
        assert res["externals"] == [("attn", "attn.out_proj.weight")]
        assert all(s["loss_equal"] and s["bad_grads"] == [] for s in res["steps"])


@LIFECYCLE
def test_each_parameter_gathered_twice_per_step(lifecycle):
    for rank_results in lifecycle:
        for res in rank_results:
            if res["config"][4]:  # reuse: test_reuse_distance_gathers_once_what_it_keeps
                continue
            padding = DP * res["chunks"] - res["partitioned_numel"]
            assert 0 <= padding < DP * res["n_partitioned"]
            for step in res["steps"]:
                # Rows are this rank's chunks: twice (forward, backward) per partitioned
                # parameter the pass uses (all of them, except on one branch of Branchy).
                want = 2 * step["used_chunks"] * res["elt"]
                if step["path_changed"]:  # gathers prefetched for the old path are wasted
                    assert step["ag_bytes"] >= want, res["config"]
                else:
                    assert step["ag_bytes"] == want, res["config"]
                assert step["other_ops"] == {}, res["config"]  # no other traffic in stage 3
            if res["config"][0] != "branchy":
                assert all(step["used_chunks"] == res["chunks"] for step in res["steps"])


@LIFECYCLE
def test_only_shards_held_between_steps(lifecycle):
    for rank_results in lifecycle:
        for res in rank_results:
            want = (res["chunks"] + res["persistent_numel"]) * res["elt"]
            for step in res["steps"]:
                assert step["empty_at_rest"] and step["live_at_rest"] == 0, res["config"]
                assert step["freed"], res["config"]
                # after the forward too, unless kept for reuse (from the second step on)
                kept = res["config"][4] and not step["records"]
                assert step["freed_after_forward"] != kept, res["config"]
                assert step["held_bytes"] == want, res["config"]
            # ~ Psi * elt / N: the padding is under one element per rank per parameter.
            psi = res["partitioned_numel"]
            assert abs(res["chunks"] - psi / DP) < res["n_partitioned"]


@LIFECYCLE
def test_prefetch_follows_recorded_order_within_budgets(lifecycle):
    for res in lifecycle[0]:
        kind, _, prefetch, max_live, _ = res["config"]
        for step in res["steps"]:
            if step["records"] or prefetch == 0:
                assert step["prefetches"] == 0, res["config"]
            elif not (step["path_changed"] or step["after_change"]):  # the recorded order
                assert step["prefetches"] > 0, res["config"]
        if max_live < int(1e9):
            assert res["peak_live"] <= max(max_live, res["largest_fetch"])
    # Gathering only the next module ahead holds fewer elements at once than the whole model.
    peak = {
        res["config"][2]: res["peak_live"]
        for res in lifecycle[0]
        if res["config"][0] == "gpt" and res["config"][4] == 0
    }
    assert 0 < peak[None] < peak[int(5e7)], peak


@LIFECYCLE
def test_reuse_distance_gathers_once_what_it_keeps(lifecycle):
    seen = set()
    for rank_results in lifecycle:
        for res in rank_results:
            reuse = res["config"][4]
            if not reuse:
                continue
            seen.add(res["config"])
            once = res["chunks"] * res["elt"]
            first, *later = res["steps"]
            assert first["ag_bytes"] == 2 * once, res["config"]  # the first step records
            # 1e9: every parameter kept from its forward to its backward: gathered once per
            # step, and the whole model gathered at the turn. 1: only the tied word embedding,
            # whose next use (the output layer's backward) follows its forward at once.
            want = once if reuse > 1 else 2 * once - res["word_chunk"] * res["elt"]
            assert [s["ag_bytes"] for s in later] == [want] * len(later), res["config"]
            if reuse > 1:
                assert res["peak_live"] == res["partitioned_numel"], res["config"]
    assert len(seen) == 3


# --------------------------------------------------------------------------------------------
# Spawn 2: zero.Init, GatheredParameters, state dicts, offload


class PeakMemory(TorchDispatchMode):
    """Bytes of tensor storages created inside the block that are alive at once (peak), and the
    largest single one; storages are followed by weak reference, so frees are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ptr = s.data_ptr()
                if ptr and (ptr not in self.live or self.live[ptr][0].expired()):
                    self.live[ptr] = (StorageWeakRef(s), s.nbytes())
                    self.largest = max(self.largest, s.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def wide_mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])


def _init_and_gathered(rank: int, nvme_dir: str) -> dict:
    from zerotron.zero.offload import ParamOffloadStore
    from zerotron.zero.options import OffloadOptions

    dp = state().dp
    res: dict = {}

    # zero.Init builds the eager model, partitioned.
    torch.manual_seed(5)
    eager = gpt()
    torch.manual_seed(5)
    with Init(data_parallel_group=dp, persistence_threshold=THRESHOLD):
        built = gpt()
    res["init_shards_equal"] = all(
        torch.equal(p.ds_tensor, shard(e.detach(), DP, rank))
        if is_partitioned(p)
        else torch.equal(p, e)
        for p, e in zip(built.parameters(), eager.parameters())
    )
    full = gathered_state_dict(built)
    if rank == 0:
        want = eager.state_dict()
        res["init_state_dict_equal"] = full.keys() == want.keys() and all(
            torch.equal(full[k], want[k]) for k in want
        )
    else:
        res["init_state_dict_equal"] = full is None
    partition_parameters(built, dp, persistence_threshold=THRESHOLD)
    batch = batch_for("gpt", rank, 0)
    res["init_forward_equal"] = _equal_loss(built, eager, "gpt", batch)

    # Memory while building: Init holds ~ 1/N plus one layer; eager holds everything.
    peaks = {}
    for name in ("eager", "init"):
        torch.manual_seed(6)
        with PeakMemory() as mem:
            if name == "init":
                with Init(data_parallel_group=dp, persistence_threshold=THRESHOLD):
                    m = wide_mlp()
            else:
                m = wide_mlp()
        peaks[name] = (mem.peak, mem.largest)
        if name == "init":
            res["init_held_bytes"] = sum(
                p.ds_tensor.nbytes if is_partitioned(p) else p.nbytes for p in m.parameters()
            )
    res["peaks"] = peaks
    res["wide_total_bytes"] = sum(p.nbytes for p in wide_mlp().parameters())
    res["layer_bytes"] = sum(p.nbytes for p in nn.Linear(128, 128).parameters())

    # Init(dtype=bf16): 16-bit shards, ~2 Psi / N bytes.
    with Init(data_parallel_group=dp, dtype=torch.bfloat16, persistence_threshold=0):
        half = mlp()
    res["bf16_bytes"] = sum(p.ds_tensor.nbytes for p in half.parameters())
    res["bf16_psi"] = sum(p.ds_numel for p in half.parameters())
    res["bf16_dtypes"] = {str(p.ds_tensor.dtype) for p in half.parameters()}

    # GatheredParameters: rank 0's modification reaches every rank's shard.
    torch.manual_seed(8)
    ref = mlp()
    model = copy.deepcopy(ref)
    partition_parameters(model, dp, persistence_threshold=THRESHOLD)
    w, b_small = model[2].weight, model[4].bias  # partitioned; persistent (5 elements)
    with GatheredParameters([w, b_small]):
        res["gathered_shape"] = tuple(w.shape)
        res["gathered_value_ok"] = torch.equal(w.detach(), ref[2].weight.detach())
        w.data.add_(100.0)  # discarded: no modifier_rank
    res["unmodified_kept"] = torch.equal(w.ds_tensor, shard(ref[2].weight.detach(), DP, rank))
    res["released_after_block"] = w.numel() == 0
    with GatheredParameters([w, b_small], modifier_rank=0), torch.no_grad():
        w.fill_(float(rank + 1))  # only rank 0's ones count
        b_small.fill_(float(rank + 3))
    res["modified_shard_ok"] = torch.equal(w.ds_tensor, shard(torch.ones(48, 64), DP, rank))
    res["persistent_broadcast_ok"] = torch.equal(b_small.detach(), torch.full((5,), 3.0))
    res["modified_flags"] = [
        p is w or p is b_small for p in modified_parameters(model.parameters())
    ]
    with torch.no_grad():
        ref[2].weight.fill_(1.0)
        ref[4].bias.fill_(3.0)
    res["modified_forward_equal"] = _equal_loss(model, ref, "mlp", batch_for("mlp", rank, 0))
    # Inside a block a forward keeps the parameters (reference counts nest).
    with GatheredParameters(model[0].weight):
        _equal_loss(model, ref, "mlp", batch_for("mlp", rank, 1))
        res["still_gathered_after_forward"] = model[0].weight.numel() == 24 * 64
    res["nothing_live"] = coordinator_of(model).live_numel == 0

    # fwd_module: a forward that uses another module's weight inside a block.
    torch.manual_seed(11)
    uo_ref = UsesOther()
    uo = copy.deepcopy(uo_ref)
    partition_parameters(uo, dp, persistence_threshold=THRESHOLD)
    chunks = 2 * chunk_size(16 * 16, DP)  # own.weight, other.weight
    res["fwd_module"] = []
    for step in range(2):
        batch = batch_for("branchy", rank, step)
        with ledger.capture() as cap:
            loss = loss_of(uo, "uses_other", batch)
            loss.backward()
        ref_loss = loss_of(uo_ref, "uses_other", batch)
        ref_loss.backward()
        grads_equal = all(  # other.bias is never used: no gradient on either side
            (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
            for p, q in zip(uo.parameters(), uo_ref.parameters())
        )
        res["fwd_module"].append(
            (
                bool(torch.equal(loss, ref_loss)),
                grads_equal,
                cap.total("dp", "all_gather") == 2 * chunks * 4,
                uo.other.weight.numel() == 0,
            )
        )
        uo.zero_grad(set_to_none=True)
        uo_ref.zero_grad(set_to_none=True)

    # load_full_state_dict: every rank takes its chunks of whole tensors.
    torch.manual_seed(9)
    other = mlp()
    load_full_state_dict(model, other.state_dict())
    res["loaded_forward_equal"] = _equal_loss(model, other, "mlp", batch_for("mlp", rank, 2))
    coordinator_of(model).unpartition()  # whole again on every rank, hooks gone
    res["unpartitioned"] = (
        all(
            torch.equal(p, q) and not hasattr(p, "ds_tensor")
            for p, q in zip(model.parameters(), other.parameters())
        )
        and coordinator_of(model) is None
    )

    # offload_param: shards rest in host memory or NVMe files; the math is unchanged.
    for device in ("cpu", "nvme"):
        store = ParamOffloadStore(OffloadOptions(device=device, nvme_path=nvme_dir), f"rank{rank}")
        torch.manual_seed(10)
        ref = gpt()
        model = copy.deepcopy(ref)
        coord = partition_parameters(model, dp, persistence_threshold=THRESHOLD, param_store=store)
        losses_equal = []
        for step in range(2):
            batch = batch_for("gpt", rank, step)
            loss = loss_of(model, "gpt", batch)
            loss.backward()
            losses_equal.append(bool(torch.equal(loss, loss_of(ref, "gpt", batch))))
        res[f"offload_{device}_equal"] = losses_equal
        res[f"offload_{device}_placeholder"] = all(
            (p.ds_tensor.numel() == 0) == (device == "nvme") for p in coord.params
        )
        res[f"offload_{device}_disk"] = store.bytes_on_disk()
        res[f"offload_{device}_chunks"] = sum(read_shard(p).nbytes for p in coord.params)
    return res


@pytest.fixture(scope="module")
def init_and_gathered(tmp_path_factory) -> list:
    """One spawn for zero.Init, GatheredParameters, state dicts and offload_param."""
    return run_ranks(_init_and_gathered, DP, str(tmp_path_factory.mktemp("zero3")), timeout=120)


@INIT
def test_init_builds_the_eager_model_partitioned(init_and_gathered):
    for res in init_and_gathered:
        assert res["init_shards_equal"]
        assert res["init_state_dict_equal"]  # rank 0: every tensor; rank 1: None
        assert res["init_forward_equal"]


@INIT
def test_init_memory_is_bounded_while_building(init_and_gathered):
    for res in init_and_gathered:
        total, layer = res["wide_total_bytes"], res["layer_bytes"]
        eager_peak, eager_largest = res["peaks"]["eager"]
        init_peak, init_largest = res["peaks"]["init"]
        assert eager_peak >= total
        # 1/N of everything, plus the layer being built and the one just finished.
        assert init_peak <= total / DP + 2 * layer, (init_peak, total)
        assert init_largest <= eager_largest  # no allocation beyond one weight
        assert res["init_held_bytes"] == total / DP  # 128 * 128 and 128 split evenly
        assert res["bf16_dtypes"] == {"torch.bfloat16"}
        psi = res["bf16_psi"]
        assert 2 * psi / DP <= res["bf16_bytes"] < 2 * psi / DP + 2 * 6  # 6 tensors' padding


@INIT
def test_gathered_parameters_and_modifier_rank(init_and_gathered):
    for res in init_and_gathered:
        assert res["gathered_shape"] == (48, 64)
        assert res["gathered_value_ok"]
        assert res["unmodified_kept"] and res["released_after_block"]
        assert res["modified_shard_ok"]  # rank 1 filled 2.0, everyone holds rank 0's 1.0
        assert res["persistent_broadcast_ok"]
        assert res["modified_flags"] == [True, True]
        assert res["modified_forward_equal"]
        assert res["still_gathered_after_forward"] and res["nothing_live"]
        assert res["loaded_forward_equal"] and res["unpartitioned"]
        # Exact; the borrowed weight is gathered once forward and once backward, then freed.
        assert res["fwd_module"] == [(True, True, True, True)] * 2


@INIT
def test_offload_param_cpu_and_nvme(init_and_gathered):
    for res in init_and_gathered:
        for device in ("cpu", "nvme"):
            assert res[f"offload_{device}_equal"] == [True, True]
            assert res[f"offload_{device}_placeholder"]
        assert res["offload_cpu_disk"] == 0
        assert res["offload_nvme_disk"] >= res["offload_nvme_chunks"] > 0


# --------------------------------------------------------------------------------------------
# One process (no spawn): a one-rank group, and misuse


def test_one_rank_group_and_misuse():
    ref = build("gpt-recompute", torch.float32)
    model = copy.deepcopy(ref)
    coord = partition_parameters(model, Group.single("dp"), persistence_threshold=THRESHOLD)
    batch = batch_for("gpt", 0, 0)
    loss, ref_loss = loss_of(model, "gpt", batch), loss_of(ref, "gpt", batch)
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for p, rp in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, rp.grad)
        assert p.numel() == 0 if is_partitioned(p) else p.numel() == rp.numel()
    assert coord.live_numel == 0
    with pytest.raises(ConfigError, match="already stage-3"):
        partition_parameters(model, Group.single("dp"))
    with pytest.raises(ConfigError, match="deep-copied"):
        copy.deepcopy(model)
    with pytest.raises(ConfigError, match=">= 0"):
        partition_parameters(mlp(), Group.single("dp"), prefetch_bucket_size=-1)
