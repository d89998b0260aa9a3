"""deepspeed.comm (``zerotron.comm``) on 2 gloo ranks: every function gives what
torch.distributed gives for the same call, and the ledger records it with its exact bytes.

Each rank makes every call twice with the same inputs: through ``zerotron.comm`` (inside a
ledger capture) and through ``torch.distributed`` directly (the reference). Inputs are
integer-valued, so every reduction is exact and results compare with ``torch.equal``. The calls
run on the world (``group=None``), on a ``new_group`` of both ranks, on zerotron's own ``dp``
group (the ledger names it) and on one-rank groups (no-ops: nothing recorded). Where gloo lacks
a function (list reduce-scatter and all-to-all, AVG in reduce), the reference is the same
arithmetic through the forms gloo has.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .spawn import run_ranks

WORLD = 2
X_BYTES = 4 * 6 * 4  # data(rank): 4 x 6 float32
BIG_BYTES = 8 * 6 * 4  # data(rank, (8, 6))

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def data(rank: int, shape=(4, 6), dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(1, 9, shape, generator=g).to(dtype)


def _cases(ds, group, rank: int) -> dict:
    """{case: (zerotron.comm's result, torch.distributed's result, ledger entries)}."""
    from zerotron.distributed.comm import ledger

    n = dist.get_world_size(group)
    out = {}

    def case(name, ours, theirs):
        with ledger.capture() as cap:
            got = ours()
        out[name] = (got, theirs(), cap.entries)

    x, big = data(rank), data(rank, (8, 6))
    ints = data(rank, dtype=torch.int64)

    def reduced(t, op, **kw):
        t = t.clone()
        return t, lambda: (ds.all_reduce(t, op, group=group, **kw), t)[1]

    def torch_reduced(t, op):
        t = t.clone()
        dist.all_reduce(t, op, group=group)
        return t

    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        _, ours = reduced(x, getattr(ds.ReduceOp, name))
        case(
            f"all_reduce_{name}", ours, lambda op=name: torch_reduced(x, getattr(dist.ReduceOp, op))
        )
    for name in ("BAND", "BOR", "BXOR"):
        _, ours = reduced(ints, getattr(ds.ReduceOp, name))
        case(
            f"all_reduce_{name}",
            ours,
            lambda op=name: torch_reduced(ints, getattr(dist.ReduceOp, op)),
        )
    _, ours = reduced(x, dist.ReduceOp.MAX, log_name="mine", prof=False)  # torch's op, DS kwargs
    case("all_reduce_torch_op", ours, lambda: torch_reduced(x, dist.ReduceOp.MAX))

    def default_op():
        t = x.clone()
        ds.all_reduce(t, group=group)
        return t

    case("all_reduce_default", default_op, lambda: torch_reduced(x, dist.ReduceOp.SUM))

    def reduce_async():
        t = x.clone()
        work = ds.all_reduce(t, ds.ReduceOp.SUM, group=group, async_op=True)
        return t, work.wait(), work.is_completed()

    case(
        "all_reduce_async", reduce_async, lambda: (torch_reduced(x, dist.ReduceOp.SUM), True, True)
    )

    def gather_list(async_op=False):
        parts = [torch.zeros_like(x) for _ in range(n)]
        work = ds.all_gather(parts, x, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return parts

    def torch_gather_list():
        parts = [torch.zeros_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return parts

    case("all_gather", gather_list, torch_gather_list)
    case("all_gather_async", lambda: gather_list(True), torch_gather_list)

    def into_tensor(shape, fn):
        o = torch.zeros(shape)
        fn(o, x, group=group)
        return o

    for name, shape in (("concat", (n * 4, 6)), ("stacked", (n, 4, 6))):
        case(
            f"all_gather_into_tensor_{name}",
            lambda shape=shape: into_tensor(shape, ds.all_gather_into_tensor),
            # gloo takes the concatenated form only; the stacked one is the same memory
            lambda shape=shape: into_tensor((n * 4, 6), _GATHER).reshape(shape),
        )
    case(
        "allgather_fn",
        lambda: into_tensor((n * 4, 6), ds.allgather_fn),
        lambda: into_tensor((n * 4, 6), _GATHER),
    )

    def scatter(fn, op, async_op=False):
        o = torch.zeros(8 // n, 6)
        work = fn(o, big, op, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return o

    def torch_scatter(name):
        if name == "AVG":  # torch 2.8's gloo takes AVG for reduce_scatter but sums: mean by hand
            return scatter(_SCATTER, dist.ReduceOp.SUM).div_(n)
        return scatter(_SCATTER, getattr(dist.ReduceOp, name))

    for name in ("SUM", "AVG", "MAX"):
        case(
            f"reduce_scatter_tensor_{name}",
            lambda name=name: scatter(ds.reduce_scatter_tensor, getattr(ds.ReduceOp, name)),
            lambda name=name: torch_scatter(name),
        )
    case(
        "reduce_scatter_tensor_async",
        lambda: scatter(ds.reduce_scatter_tensor, ds.ReduceOp.SUM, True),
        lambda: scatter(_SCATTER, dist.ReduceOp.SUM),
    )
    case(
        "reduce_scatter_fn",
        lambda: scatter(ds.reduce_scatter_fn, dist.ReduceOp.SUM),
        lambda: scatter(_SCATTER, dist.ReduceOp.SUM),
    )

    last = dist.get_global_rank(group or dist.group.WORLD, n - 1)

    def bcast(fn, async_op=False):
        t = x.clone()
        work = fn(t, last, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return t

    case("broadcast", lambda: bcast(ds.broadcast), lambda: bcast(dist.broadcast))
    case("broadcast_async", lambda: bcast(ds.broadcast, True), lambda: bcast(dist.broadcast))

    def a2a(fn, splits=False, async_op=False):
        me = dist.get_rank(group)
        # uneven: member r sends r + 1 + j rows to member j
        ins = [me + 1 + j for j in range(n)] if splits else None
        outs = [r + 1 + me for r in range(n)] if splits else None
        t = data(rank, (sum(ins), 6)) if splits else big
        o = torch.zeros(sum(outs), 6) if splits else torch.zeros_like(big)
        work = fn(o, t, outs, ins, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return o

    case(
        "all_to_all_single", lambda: a2a(ds.all_to_all_single), lambda: a2a(dist.all_to_all_single)
    )
    case(
        "all_to_all_single_splits",
        lambda: a2a(ds.all_to_all_single, True),
        lambda: a2a(dist.all_to_all_single, True),
    )
    case(
        "all_to_all_single_async",
        lambda: a2a(ds.all_to_all_single, False, True),
        lambda: a2a(dist.all_to_all_single),
    )
    case("barrier", lambda: ds.barrier(group=group), lambda: dist.barrier(group=group))
    case(
        "barrier_async",
        lambda: ds.barrier(group=group, async_op=True).wait(),
        lambda: dist.barrier(group=group, async_op=True).wait(),
    )
    _rooted_cases(ds, group, rank, x, big, case)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    case(
        "queries",
        lambda: (
            ds.get_rank(group),
            ds.get_world_size(group),
            ds.get_global_rank(group, n - 1),
            ds.get_all_ranks_from_group(group),
        ),
        lambda: (dist.get_rank(group), dist.get_world_size(group), ranks[n - 1], ranks),
    )
    return out


def _rooted_cases(ds, group, rank: int, x, big, case) -> None:
    """reduce, gather, scatter (rooted at the group's last member), the list and coalesced
    forms, monitored_barrier, inference_all_reduce and TorchBackend's all-gather."""
    n = dist.get_world_size(group)
    last = dist.get_global_rank(group or dist.group.WORLD, n - 1)
    root = dist.get_rank() == last

    def reduce(fn, op, async_op=False):
        t = x.clone()
        work = fn(t, last, op, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return t if root else None  # elsewhere the contents are unspecified

    def torch_reduce(name):
        t = x.clone()  # torch's gloo has no AVG for reduce: a sum, divided on the root
        op = dist.ReduceOp.SUM if name == "AVG" else getattr(dist.ReduceOp, name)
        dist.reduce(t, last, op, group=group)
        return (t / n if name == "AVG" else t) if root else None

    for name in ("SUM", "AVG", "MAX"):
        case(
            f"rooted_reduce_{name}",
            lambda name=name: reduce(ds.reduce, getattr(ds.ReduceOp, name)),
            lambda name=name: torch_reduce(name),
        )
    case(
        "rooted_reduce_async",
        lambda: reduce(ds.reduce, ds.ReduceOp.SUM, True),
        lambda: torch_reduce("SUM"),
    )

    def gather(fn, async_op=False):
        parts = [torch.zeros_like(x) for _ in range(n)] if root else None
        work = fn(x, parts, dst=last, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return parts

    case("rooted_gather", lambda: gather(ds.gather), lambda: gather(dist.gather))
    case("rooted_gather_async", lambda: gather(ds.gather, True), lambda: gather(dist.gather))

    def scatter(fn, async_op=False):
        t = torch.zeros_like(x)
        parts = [x * (j + 1) for j in range(n)] if root else None
        work = fn(t, parts, src=last, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return t

    case("rooted_scatter", lambda: scatter(ds.scatter), lambda: scatter(dist.scatter))
    case("rooted_scatter_async", lambda: scatter(ds.scatter, True), lambda: scatter(dist.scatter))

    def reduce_scatter_list():
        o = torch.zeros(8 // n, 6)
        ds.reduce_scatter(o, list(big.chunk(n)), ds.ReduceOp.SUM, group=group)
        return o

    def torch_reduce_scatter():  # gloo has no list form: the tensor form of the same rows
        o = torch.zeros(8 // n, 6)
        _SCATTER(o, big, dist.ReduceOp.SUM, group=group)
        return o

    case("reduce_scatter_list", reduce_scatter_list, torch_reduce_scatter)

    def a2a_list():
        outs = [torch.zeros(8 // n, 6) for _ in range(n)]
        ds.all_to_all(outs, list(big.chunk(n)), group=group)
        return outs

    def torch_a2a():  # gloo has no list form: the single-tensor form of the same rows
        o = torch.zeros_like(big)
        dist.all_to_all_single(o, big, group=group)
        return list(o.chunk(n))

    case("all_to_all_list", a2a_list, torch_a2a)

    def coalesced_reduce(async_op=False):
        ts = [x.clone(), big.clone()]
        work = ds.all_reduce_coalesced(ts, ds.ReduceOp.SUM, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return ts

    def torch_each_reduced():
        ts = [x.clone(), big.clone()]
        for t in ts:
            dist.all_reduce(t, group=group)
        return ts

    case("coalesced_all_reduce", coalesced_reduce, torch_each_reduced)
    case("coalesced_all_reduce_async", lambda: coalesced_reduce(True), torch_each_reduced)

    def coalesced_gather(fn):
        outs = [torch.zeros(n * 4, 6), torch.zeros(n * 8, 6)]
        work = fn(outs, [x, big], group=group, async_op=True)
        if work is not None:
            work.wait()
        return outs

    def torch_each_gathered(outs, inputs, group=None, async_op=False):
        for o, t in zip(outs, inputs, strict=True):
            _GATHER(o, t, group=group)

    case(
        "coalesced_all_gather",
        lambda: coalesced_gather(ds.all_gather_coalesced),
        lambda: coalesced_gather(torch_each_gathered),
    )
    case(
        "barrier_monitored",
        lambda: ds.monitored_barrier(group=group),
        lambda: dist.barrier(group=group),
    )

    def inference():
        t = x.clone()
        ds.inference_all_reduce(t, group=group)
        return t

    def torch_summed():
        t = x.clone()
        dist.all_reduce(t, group=group)
        return t

    case("all_reduce_inference", inference, torch_summed)

    def torch_backend_gather(fn):
        o = torch.zeros(n * 4, 6)
        fn(o, x, group=group)
        return o

    case(
        "allgather_torch_backend",
        lambda: torch_backend_gather(ds.TorchBackend.get_all_gather_function()),
        lambda: torch_backend_gather(_GATHER),
    )


def _p2p(ds, rank: int) -> dict:
    """send/recv and isend/irecv between the two ranks, over the world and a new group."""
    from zerotron.distributed.comm import ledger

    peer = 1 - rank
    x = data(rank, (3, 5))
    out = {}
    with ledger.capture() as cap:
        got = torch.zeros(3, 5)
        if rank == 0:
            ds.send(x, peer, tag=3)
            src = ds.recv(got, peer, tag=3)
        else:
            src = ds.recv(got, peer, tag=3)
            ds.send(x, peer, tag=3)
    out["blocking"] = (got, src, cap.entries)
    pair = ds.new_group([0, 1])
    with ledger.capture() as cap:
        got = torch.zeros(3, 5)
        works = [ds.irecv(got, peer, group=pair), ds.isend(2 * x, peer, group=pair)]
        done = [w.wait() for w in works]
    out["async"] = (got, done, cap.entries)
    with ledger.capture() as cap:
        got, got_torch_op = torch.zeros(3, 5), torch.zeros(3, 5)
        works = ds.batch_isend_irecv(
            [
                ds.P2POp(ds.isend, 3 * x, peer),
                ds.P2POp(ds.irecv, got, peer),
                ds.P2POp(dist.isend, 4 * x, peer),  # torch's functions are accepted too
                ds.P2POp(dist.irecv, got_torch_op, peer),
            ]
        )
        done = [w.wait() for w in works]
    out["batch"] = (got, got_torch_op, done, cap.entries)
    return out


def _rank(rank: int) -> dict:
    import zerotron
    from zerotron import comm as ds
    from zerotron.distributed.state import initialize_model_parallel

    assert ds is zerotron.comm
    ds.init_distributed()  # the group spawn made is kept
    results = {"world": _cases(ds, None, rank)}
    results["new_group"] = _cases(ds, ds.new_group([0, 1]), rank)
    dp = initialize_model_parallel(1).dp  # its own torch group, which the ledger names "dp"
    results["dp"] = _cases(ds, dp.pg, rank)
    singles = [ds.new_group([r]) for r in range(WORLD)]  # every rank creates every group
    results["single"] = _cases(ds, singles[rank], rank)
    results["p2p"] = _p2p(ds, rank)
    results["info"] = (ds.is_initialized(), ds.get_local_rank(), ds.get_world_group() is not None)
    return results


def expected_entries(group: str, case: str) -> list[tuple[str, str, int]]:
    """What one call of ``case`` records on a group named ``group`` of 2 ranks."""
    if case == "queries":
        return []
    if case.startswith("barrier"):
        return [(group, "barrier", 0)]
    if case.startswith("rooted_"):  # rooted_reduce_SUM -> reduce; x's bytes on every rank
        return [(group, case.split("_")[1], X_BYTES)]
    if case.startswith("coalesced_all_reduce"):  # x and big in one all-reduce
        return [(group, "all_reduce", X_BYTES + BIG_BYTES)]
    if case == "coalesced_all_gather":  # one all-gather per pair
        return [(group, "all_gather", X_BYTES), (group, "all_gather", BIG_BYTES)]
    if case.startswith("all_reduce"):
        return [
            (group, "all_reduce", X_BYTES * (2 if case.endswith(("BAND", "BOR", "BXOR")) else 1))
        ]
    if case.startswith(("all_gather", "allgather")):
        return [(group, "all_gather", X_BYTES)]
    if case.startswith("reduce_scatter"):
        return [(group, "reduce_scatter", BIG_BYTES)]
    if case.startswith("broadcast"):
        return [(group, "broadcast", X_BYTES)]
    if case == "all_to_all_single_splits":
        return None  # per-rank size: checked in the test
    return [(group, "all_to_all", BIG_BYTES)]


COMPAT = pytest.mark.xdist_group("compat_comm")


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, WORLD)


def _equal(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize(
    "where,name", [("world", "world"), ("new_group", "group[0,1]"), ("dp", "dp")]
)
@COMPAT
def test_every_function_gives_torch_result_and_is_ledgered(results, where, name):
    for rank in range(WORLD):
        cases = results[rank][where]
        assert len(cases) == 45
        for case, (got, want, entries) in cases.items():
            assert _equal(got, want), (rank, case, got, want)
            expected = expected_entries(name, case)
            if expected is None:  # member r sends r+1+j rows of 6 float32 to member j
                expected = [(name, "all_to_all", (2 * rank + 3) * 6 * 4)]
            assert entries == expected, (rank, case)


@COMPAT
def test_one_rank_groups_are_no_ops_with_no_ledger_entry(results):
    for rank in range(WORLD):
        for case, (got, want, entries) in results[rank]["single"].items():
            assert _equal(got, want), (rank, case)
            assert entries == [], (rank, case)


@COMPAT
def test_point_to_point_blocking_and_async(results):
    for rank in range(WORLD):
        peer = 1 - rank
        got, src, entries = results[rank]["p2p"]["blocking"]
        assert torch.equal(got, data(peer, (3, 5))) and src == peer
        sent = 3 * 5 * 4
        ops = ["send", "recv"] if rank == 0 else ["recv", "send"]
        assert entries == [("world", op, sent) for op in ops]
        got, done, entries = results[rank]["p2p"]["async"]
        assert torch.equal(got, 2 * data(peer, (3, 5))) and done == [True, True]
        assert entries == [("group[0,1]", "recv", sent), ("group[0,1]", "send", sent)]


@COMPAT
def test_batch_isend_irecv_with_p2p_ops(results):
    for rank in range(WORLD):
        peer = 1 - rank
        got, got_torch_op, done, entries = results[rank]["p2p"]["batch"]
        assert torch.equal(got, 3 * data(peer, (3, 5)))
        assert torch.equal(got_torch_op, 4 * data(peer, (3, 5)))
        assert done == [True] * 4
        sent = 3 * 5 * 4
        assert entries == [("world", op, sent) for op in ("send", "recv", "send", "recv")]


@COMPAT
def test_queries_after_init(results):
    for rank in range(WORLD):
        assert results[rank]["info"] == (True, rank, True)
