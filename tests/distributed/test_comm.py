"""comm: every collective's result and ledger bytes on 4 gloo ranks, against local references.

Inputs are integer-valued floats, so sums are exact in any order and results are compared with
``torch.equal``. Each rank computes the collectives; the test recomputes them from the same
inputs (``data(rank)``) with plain torch ops.
"""

import pytest
import torch

from zerotron.distributed import comm
from zerotron.distributed.comm import Group, Ledger, ledger
from zerotron.distributed.state import initialize_model_parallel, state
from zerotron.errors import DistributedError

from .spawn import run_ranks

WORLD = 4


def data(rank, shape=(4, 6)):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, shape, generator=g).float()


def _captured(fn):
    with ledger.capture() as cap:
        out = fn()
    return out, cap.entries


def _collectives(g):
    """Every collective on group ``g``: {case: (result, ledger entries)}."""
    rank = state().rank
    last = g.size - 1
    x = data(rank)
    big = data(rank, (8, 12))
    out = {
        "sum": _captured(lambda: comm.all_reduce(x.clone(), g)),
        "avg": _captured(lambda: comm.all_reduce(x.clone(), g, op="avg")),
        "max": _captured(lambda: comm.all_reduce(x.clone(), g, op="max")),
        "min": _captured(lambda: comm.all_reduce(x.clone(), g, op="min")),
        "sum_t": _captured(lambda: comm.all_reduce(x.t().clone().t(), g)),  # non-contiguous
        "async": _captured(lambda: comm.all_reduce_async(x.clone(), g, op="avg").wait()),
        "gather0": _captured(lambda: comm.all_gather(x, g)),
        "gather1": _captured(lambda: comm.all_gather(x, g, dim=1)),
        "gather_last": _captured(lambda: comm.all_gather(x, g, dim=-1)),
        "gather_t": _captured(lambda: comm.all_gather(x.t(), g)),
        "gather_scalar": _captured(lambda: comm.all_gather(torch.tensor(float(rank)), g)),
        "scatter0": _captured(lambda: comm.reduce_scatter(big, g)),
        "scatter1": _captured(lambda: comm.reduce_scatter(big, g, dim=1)),
        "scatter_avg": _captured(lambda: comm.reduce_scatter(big, g, dim=-1, op="avg")),
        "scatter_async": _captured(lambda: comm.reduce_scatter_async(big, g).wait()),
        "broadcast": _captured(lambda: comm.broadcast(x.clone(), g, src_rank_in_group=last)),
        "barrier": _captured(lambda: comm.barrier(g)),
    }
    t = x.clone()
    out["in_place"] = comm.all_reduce(t, g) is t
    # Several in flight at once, waited for out of order (gloo: exchanges told apart by tag).
    first = comm.reduce_scatter_async(big, g)
    second = comm.all_gather_async(x, g)
    third = comm.reduce_scatter_async(2 * big, g)
    last = third.wait()
    out["in_flight"] = (last, second.wait(), first.wait())
    return out


def _refuse(*args, **kwargs):
    raise RuntimeError("ProcessGroupGloo does not support this collective")


def _fail(*args, **kwargs):
    raise RuntimeError("Connection closed by peer")


def _fallbacks(g):
    """all_gather / reduce_scatter when the backend lacks the fused ops."""
    x, big = data(state().rank), data(state().rank, (8, 12))
    out = {}
    saved = comm._ALL_GATHER_SINGLE, comm._REDUCE_SCATTER_SINGLE
    comm.pairwise_on_gloo = False  # the fused ops' path, not the exchanges
    for how, fused in (("missing", None), ("refused", _refuse)):
        comm._ALL_GATHER_SINGLE = comm._REDUCE_SCATTER_SINGLE = fused
        out[how] = {
            "gather1": _captured(lambda: comm.all_gather(x, g, dim=1)),
            "scatter1": _captured(lambda: comm.reduce_scatter(big, g, dim=1)),
        }
    comm._REDUCE_SCATTER_SINGLE = _fail  # a real failure is not mistaken for a refusal
    try:
        comm.reduce_scatter(big, g)
    except DistributedError as e:  # the torch error, named: op, group and that a peer left
        out["failure"] = str(e)
    comm._ALL_GATHER_SINGLE, comm._REDUCE_SCATTER_SINGLE = saved
    comm.pairwise_on_gloo = True
    return out


def _p2p():
    rank = state().rank
    nxt, prev = (rank + 1) % WORLD, (rank - 1) % WORLD
    x = data(rank, (3, 5))
    got = torch.empty(3, 5)
    with ledger.capture() as blocking:
        if rank % 2 == 0:
            comm.send(x, nxt)
            comm.recv(got, prev)
        else:
            comm.recv(got, prev)
            comm.send(x, nxt)
    from_prev, from_next = torch.empty(3, 5), torch.empty(3, 5)
    with ledger.capture() as batched:
        comm.batch_isend_irecv(
            [
                comm.P2P("send", x, nxt),
                ("send", x * 2, prev),
                comm.P2P("recv", from_prev, prev),
                ("recv", from_next, nxt),
            ],
            group_name="pp",
        )
        comm.batch_isend_irecv([])
    # Sends left in flight: the receive is done on return, each send waited for separately.
    first, second = torch.empty(3, 5), torch.empty(3, 5)
    sent = [x * 3, x * 4]
    in_flight = comm.batch_isend_irecv(
        [("send", sent[0], nxt), ("recv", first, prev), ("send", sent[1], nxt)],
        wait_sends=False,
    )
    first = first.clone()  # received before any send was waited for
    comm.batch_isend_irecv([("recv", second, prev)])  # the peer's second send, in order
    waited = [p.wait() is t for p, t in zip(in_flight, sent, strict=True)]
    lazy = (first, second, len(in_flight), waited)
    return got, from_prev, from_next, blocking.entries, batched.entries, lazy


def _comm_rank(rank):
    world = {"world": _collectives(state().world)}  # before any model-parallel groups
    world["fallbacks"] = _fallbacks(state().world)
    world["p2p"] = _p2p()
    s = initialize_model_parallel(2)  # tp [0,1] [2,3]; dp [0,2] [1,3]
    world["tp"] = _collectives(s.tp)
    world["dp"] = _collectives(s.dp)
    world["pp"] = _captured(lambda: comm.all_reduce(data(rank), s.pp))  # one rank: no-op
    return world


def reference(members, index):
    """What each case must return on the member at ``index`` of a group of ``members``."""
    xs = torch.stack([data(r) for r in members])
    bigs = torch.stack([data(r, (8, 12)) for r in members])
    n = len(members)
    total = bigs.sum(0)
    return {
        "sum": xs.sum(0),
        "avg": xs.sum(0) / n,
        "max": xs.amax(0),
        "min": xs.amin(0),
        "sum_t": xs.sum(0),
        "async": xs.sum(0) / n,
        "gather0": torch.cat(list(xs), 0),
        "gather1": torch.cat(list(xs), 1),
        "gather_last": torch.cat(list(xs), 1),
        "gather_t": torch.cat([x.t() for x in xs], 0),
        "gather_scalar": torch.tensor([float(r) for r in members]),
        "scatter0": total.chunk(n, 0)[index],
        "scatter1": total.chunk(n, 1)[index],
        "scatter_avg": total.chunk(n, 1)[index] / n,
        "scatter_async": total.chunk(n, 0)[index],
        "broadcast": data(members[-1]),
        "barrier": None,
    }


def expected_ledger(name, case):
    shard, full = 4 * 6 * 4, 8 * 12 * 4  # bytes of data(rank) and of data(rank, (8, 12))
    if case == "gather_scalar":
        return [(name, "all_gather", 4)]
    if case.startswith("gather"):
        return [(name, "all_gather", shard)]  # the input shard
    if case.startswith("scatter"):
        return [(name, "reduce_scatter", full)]  # the full input
    if case in ("broadcast", "barrier"):
        return [(name, case, 0 if case == "barrier" else shard)]
    return [(name, "all_reduce", shard)]


COMM = pytest.mark.xdist_group("comm")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def results():
    return run_ranks(_comm_rank, WORLD)


@pytest.mark.parametrize(
    "name,groups",
    [
        ("world", [[0, 1, 2, 3]]),
        ("tp", [[0, 1], [2, 3]]),
        ("dp", [[0, 2], [1, 3]]),
    ],
)
@COMM
def test_collectives_are_exact_and_ledgered(results, name, groups):
    for members in groups:
        for index, rank in enumerate(members):
            got = results[rank][name]
            ref = reference(members, index)
            for case, want in ref.items():
                value, entries = got[case]
                if want is None:
                    assert value is None
                else:
                    assert value.shape == want.shape and torch.equal(value, want), (rank, case)
                assert entries == expected_ledger(name, case), (rank, case)
            assert got["in_place"] is True
            third, second, first = got["in_flight"]
            assert torch.equal(first, ref["scatter0"]) and torch.equal(second, ref["gather0"])
            assert torch.equal(third, 2 * ref["scatter0"])


@COMM
def test_one_rank_group_is_a_no_op_on_every_rank(results):
    for rank in range(WORLD):
        value, entries = results[rank]["pp"]
        assert torch.equal(value, data(rank)) and entries == []


@COMM
def test_fallbacks_give_the_same_results_and_bytes(results):
    members = [0, 1, 2, 3]
    for rank in range(WORLD):
        ref = reference(members, rank)
        fb = results[rank]["fallbacks"]
        for how in ("missing", "refused"):
            for case in ("gather1", "scatter1"):
                value, entries = fb[how][case]
                assert torch.equal(value, ref[case]), (rank, how, case)
                assert entries == expected_ledger("world", case)
        assert (
            f"rank {rank}: comm.reduce_scatter: reduce_scatter on the world group [0, 1, 2, 3] "
            "failed: a peer left (Connection closed by peer)"
        ) in fb["failure"]


@COMM
def test_point_to_point(results):
    nbytes = 3 * 5 * 4
    for rank in range(WORLD):
        got, from_prev, from_next, blocking, batched, lazy = results[rank]["p2p"]
        prev, nxt = (rank - 1) % WORLD, (rank + 1) % WORLD
        assert torch.equal(got, data(prev, (3, 5)))
        assert torch.equal(from_prev, data(prev, (3, 5)))
        assert torch.equal(from_next, 2 * data(nxt, (3, 5)))
        order = ["send", "recv"] if rank % 2 == 0 else ["recv", "send"]
        assert blocking == [("pp", op, nbytes) for op in order]
        assert batched == [("pp", op, nbytes) for op in ("send", "send", "recv", "recv")]
        first, second, in_flight, waited = lazy
        assert torch.equal(first, 3 * data(prev, (3, 5)))
        assert torch.equal(second, 4 * data(prev, (3, 5)))
        assert (in_flight, waited) == (2, [True, True])  # one Pending per send, in order


# ------------------------------------------------------------------------------------------
# Without processes


def test_one_rank_groups_never_call_torch():
    g = Group.single("tp")
    x = torch.arange(6.0).view(2, 3)
    before = ledger.total(), ledger.count()
    with ledger.capture() as cap:
        assert comm.all_reduce(x, g, op="avg") is x and torch.equal(x, torch.arange(6.0).view(2, 3))
        assert comm.all_gather(x, g, dim=1) is x
        assert torch.equal(comm.all_gather(torch.tensor(3.0), g), torch.tensor([3.0]))
        assert comm.reduce_scatter(x, g, dim=1) is x
        assert comm.broadcast(x, g) is x
        assert comm.all_reduce_async(x, g).wait() is x
        comm.barrier(g)
        comm.barrier()
    assert cap.entries == [] and (ledger.total(), ledger.count()) == before


def test_misuse_is_refused():
    x = torch.ones(4)
    with pytest.raises(DistributedError, match="not in"):
        comm.all_reduce(x, Group("embedding", (0, 3), -1, None))
    with pytest.raises(DistributedError, match="has no process group"):
        comm.all_gather(x, Group("tp", (0, 1), 0, None))
    with pytest.raises(DistributedError, match="unknown reduce op 'prod'"):
        comm.all_reduce(x, Group.single("tp"), op="prod")
    with pytest.raises(DistributedError, match="send needs a process group"):
        comm.send(x, 1)
    with pytest.raises(DistributedError, match="unknown p2p op 'put'"):
        comm.batch_isend_irecv([("put", x, 1)])


def test_ledger_totals_filters_and_captures():
    book = Ledger()
    book.record("tp", "all_reduce", 100)
    with book.capture() as outer:
        book.record("dp", "all_reduce", 7)
        with book.capture() as inner:
            book.record("tp", "all_gather", 5)
        book.record("pp", "send", 3)
    book.record("tp", "all_reduce", 1)
    assert book.entries == [
        ("tp", "all_reduce", 100),
        ("dp", "all_reduce", 7),
        ("tp", "all_gather", 5),
        ("pp", "send", 3),
        ("tp", "all_reduce", 1),
    ]
    assert outer.entries == [("dp", "all_reduce", 7), ("tp", "all_gather", 5), ("pp", "send", 3)]
    assert inner.entries == [("tp", "all_gather", 5)]
    assert book.total() == 116 and book.count() == 5
    assert book.total(group="tp") == 106 and book.total(op="all_reduce") == 108
    assert book.total("tp", "all_reduce") == 101 and book.count("tp", "all_reduce") == 2
    assert book.total(group="ep") == 0
    assert book.summary()[("tp", "all_reduce")] == (101, 2)
    book.reset()
    assert book.entries == [] and book.total() == 0 and outer.total() == 15


def test_ledger_totals_stay_exact_when_old_entries_are_dropped():
    book = Ledger(max_entries=10)
    for i in range(25):
        book.record("dp", "all_reduce", i)
    assert book.total() == sum(range(25)) and book.count() == 25
    assert 5 <= len(book.entries) <= 10 and book.entries[-1] == ("dp", "all_reduce", 24)
