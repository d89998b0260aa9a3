"""Process groups on real gloo ranks: membership, coordinates and the mpu names versus the grid.

The reference for every rank is DESIGN.md's formula ``rank = (pp * dp + dp_rank) * tp + tp_rank``
(a loop here) and :class:`ProcessTopology`; the groups are checked as torch sees them
(``get_process_group_ranks``) and by what an all-reduce over them sums.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from zerotron.distributed import comm, init_distributed, mpu
from zerotron.distributed.state import (
    destroy_model_parallel,
    initialize_model_parallel,
    is_model_parallel_initialized,
    state,
)
from zerotron.distributed.topology import ProcessTopology
from zerotron.errors import ConfigError, DistributedError

from .spawn import RankError, RankTimeout, run_ranks

NAMES = ("tp", "dp", "pp", "mp", "embedding", "world")


def reference_groups(tp, dp, pp):
    """{name: {rank: sorted group}} by brute force over DESIGN.md's rank formula."""
    coords = {
        (p * dp + d) * tp + t: (p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)
    }

    def same(*axes):
        idx = {"pp": 0, "dp": 1, "tp": 2}
        key = {r: tuple(c[idx[a]] for a in axes) for r, c in coords.items()}
        return {r: sorted(q for q in coords if key[q] == key[r]) for r in coords}

    ends = {0, pp - 1}
    embedding = {
        r: sorted(q for q in coords if coords[q][1:] == c[1:] and coords[q][0] in ends)
        for r, c in coords.items()
        if c[0] in ends
    }
    return coords, {
        "tp": same("pp", "dp"),
        "dp": same("pp", "tp"),
        "pp": same("dp", "tp"),
        "mp": same("dp"),
        "embedding": embedding,
        "world": {r: sorted(coords) for r in coords},
    }


# ------------------------------------------------------------------------------------------
# 8 ranks, tp2 dp2 pp2


def _grid_rank(rank, tp, pp):
    s = initialize_model_parallel(tp, pp)
    out = {"coords": (s.pp_rank, s.dp_rank, s.tp_rank), "groups": {}, "torch": {}, "sums": {}}
    for name in NAMES:
        g = s.group(name)
        out["groups"][name] = (list(g.ranks), g.rank)
        out["torch"][name] = dist.get_process_group_ranks(g.pg) if g.pg is not None else None
        t = torch.tensor([float(rank)])
        with comm.ledger.capture() as cap:
            comm.all_reduce(t, g)
        out["sums"][name] = (t.item(), cap.entries)
    mp_pg = mpu.get_model_parallel_group()
    out["mpu"] = {
        "tp": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
        "slice": (mpu.get_slice_parallel_rank(), mpu.get_slice_parallel_world_size()),
        "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        "pp": (
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_world_size(),
        ),
        "pipe": (mpu.get_pipe_parallel_rank(), mpu.get_pipe_parallel_world_size()),
        "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
        "mp_torch": (dist.get_rank(mp_pg), dist.get_world_size(mp_pg)),
        "stages": (mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()),
        "src": (mpu.get_tensor_model_parallel_src_rank(), mpu.get_data_parallel_src_rank()),
        "next_prev": (
            mpu.get_pipeline_model_parallel_next_rank(),
            mpu.get_pipeline_model_parallel_prev_rank(),
        ),
        "same_pg": [
            mpu.get_tensor_model_parallel_group() is s.tp.pg,
            mpu.get_slice_parallel_group() is s.tp.pg,
            mpu.get_data_parallel_group() is s.dp.pg,
            mpu.get_pipeline_model_parallel_group() is s.pp.pg,
            mpu.get_pipe_parallel_group() is s.pp.pg,
            mp_pg is s.mp.pg,
            mpu.get_embedding_group() is s.embedding.pg,
        ],
    }
    return out


GRID = pytest.mark.xdist_group("state_grid")  # one spawn for the tests that read it
TP, DP, PP = 2, 2, 2


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return run_ranks(_grid_rank, 8, TP, PP)


@GRID
def test_groups_on_8_ranks_match_the_grid(grid):
    coords, ref = reference_groups(TP, DP, PP)
    topo = ProcessTopology(tp=TP, dp=DP, pp=PP)
    for rank, out in enumerate(grid):
        p, d, t = coords[rank]
        assert out["coords"] == (p, d, t) == tuple(topo.coords(rank))
        for name in NAMES:
            ranks, index = out["groups"][name]
            assert ranks == ref[name][rank], (rank, name)
            if name != "world":
                assert ranks == topo.group_of(rank, name)
            assert index == ranks.index(rank)
            assert out["torch"][name] == ranks  # the torch group has exactly these members
            total, entries = out["sums"][name]
            assert total == sum(ranks)
            assert entries == [(name, "all_reduce", 4)]


@GRID
def test_mpu_on_8_ranks_matches_the_grid(grid):
    coords, ref = reference_groups(TP, DP, PP)
    for rank, out in enumerate(grid):
        p, d, t = coords[rank]
        m = out["mpu"]
        mp_index = ref["mp"][rank].index(rank)
        assert m["tp"] == m["slice"] == (t, TP)
        assert m["dp"] == (d, DP)
        assert m["pp"] == m["pipe"] == (p, PP)
        assert m["mp"] == m["mp_torch"] == (mp_index, TP * PP)
        assert mp_index == p * TP + t  # DeepSpeed's ds_model_rank order
        assert m["stages"] == (p == 0, p == PP - 1)
        assert m["src"] == (ref["tp"][rank][0], ref["dp"][rank][0])
        other_stage = ref["pp"][rank][1 - p]
        assert m["next_prev"] == (other_stage, other_stage)
        assert all(m["same_pg"])


@GRID
def test_design_worked_example(grid):
    """DESIGN.md's worked example."""
    by_rank = {r: out["groups"] for r, out in enumerate(grid)}
    assert sorted({tuple(by_rank[r]["dp"][0]) for r in range(4)}) == [(0, 2), (1, 3)]
    assert sorted({tuple(by_rank[r]["tp"][0]) for r in range(4)}) == [(0, 1), (2, 3)]


# ------------------------------------------------------------------------------------------
# 4 ranks: defaults, one-rank groups, middle pipeline stages, re-initialization


def _layouts_rank(rank):
    out = {}
    s = state()  # nothing initialized: plain data parallelism over the world
    out["default"] = (
        is_model_parallel_initialized(),
        s.dp.size,
        s.dp.rank,
        s.dp.pg is dist.group.WORLD,
        s.tp.size,
        s.pp.size,
        s.tp.pg,
    )
    try:
        initialize_model_parallel(3)
    except ConfigError as e:
        out["indivisible"] = str(e)

    s = initialize_model_parallel(1, 4)
    out["pp4"] = {
        "stage": (s.pp_rank, s.is_first_stage(), s.is_last_stage()),
        "next_prev": (s.next_stage_rank, s.prev_stage_rank),
        "embedding": (
            s.in_embedding_group,
            list(s.embedding.ranks),
            mpu.is_rank_in_embedding_group(),
        ),
    }
    t = torch.tensor([float(rank)])
    try:
        comm.all_reduce(t, s.embedding)
        out["pp4"]["embedding_sum"] = t.item()
    except DistributedError as e:
        out["pp4"]["embedding_sum"] = f"refused: {e.what}"
    try:
        mpu.get_embedding_group()
    except DistributedError:
        out["pp4"]["mpu_embedding"] = "refused"
    # tp and dp have one rank here: mpu hands out a real one-rank group, never None (= WORLD).
    t = torch.tensor([float(rank)])
    for get in (mpu.get_tensor_model_parallel_group, mpu.get_data_parallel_group):
        pg = get()
        assert pg is s.self_pg and dist.get_world_size(pg) == 1
        dist.all_reduce(t, group=pg)
    out["pp4"]["self_reduce"] = t.item()
    out["same_again"] = initialize_model_parallel(1, 4) is s
    try:
        initialize_model_parallel(2, 2)
    except DistributedError as e:
        out["reinit"] = e.what
    destroy_model_parallel()
    out["after_destroy"] = (is_model_parallel_initialized(), state().dp.size)

    try:
        initialize_model_parallel(4, 1, 2)
    except ConfigError as e:
        out["virtual_without_pp"] = e.what
    s = initialize_model_parallel(2, 2, 2)
    out["virtual"] = (
        s.virtual_pipeline_size,
        mpu.get_virtual_pipeline_model_parallel_world_size(),
        [s.is_first_stage(v) for v in (0, 1)],
        [s.is_last_stage(v) for v in (0, 1)],
        [mpu.is_pipeline_last_stage(ignore_virtual=False, virtual_stage=v) for v in (0, 1)],
        [mpu.is_pipeline_last_stage(ignore_virtual=True, virtual_stage=v) for v in (0, 1)],
    )
    return out


LAYOUTS = pytest.mark.xdist_group("state_layouts")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def layouts() -> list[dict]:
    return run_ranks(_layouts_rank, 4)


@LAYOUTS
def test_default_layout_on_4_ranks(layouts):
    for rank, out in enumerate(layouts):
        assert out["default"] == (False, 4, rank, True, 1, 1, None)


@LAYOUTS
def test_indivisible_layout_is_refused(layouts):
    for out in layouts:
        assert "world size 4" in out["indivisible"] and "size 3" in out["indivisible"]


@LAYOUTS
def test_pp4_stages_neighbours_and_embedding_group(layouts):
    for rank, out in enumerate(layouts):
        pp4 = out["pp4"]
        end = rank in (0, 3)
        assert pp4["stage"] == (rank, rank == 0, rank == 3)
        assert pp4["next_prev"] == ((rank + 1) % 4, (rank - 1) % 4)
        assert pp4["embedding"] == (end, [0, 3] if end else [], end)
        if end:
            assert pp4["embedding_sum"] == 3.0 and "mpu_embedding" not in pp4
        else:
            assert pp4["embedding_sum"].startswith("refused: all_reduce on the embedding group")
            assert pp4["mpu_embedding"] == "refused"
        assert pp4["self_reduce"] == rank  # a one-rank reduction, not a sum over the world


@LAYOUTS
def test_reinitialize_same_other_and_after_destroy(layouts):
    for out in layouts:
        assert out["same_again"] is True
        assert "already exist" in out["reinit"]
        assert out["after_destroy"] == (False, 4)


@LAYOUTS
def test_virtual_pipeline_stages(layouts):
    for rank, out in enumerate(layouts):
        assert "needs pipeline-parallel size > 1" in out["virtual_without_pp"]
        last = rank >= 2  # tp2 pp2: ranks 2, 3 are stage 1
        assert out["virtual"] == (
            2,
            2,
            [not last, False],
            [False, last],
            [False, last],
            [last, last],
        )


# ------------------------------------------------------------------------------------------
# One process: no process group, and clear errors for a broken environment


def test_single_process_needs_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(device="cpu") == (0, 1)
    assert not dist.is_initialized()
    s = state()
    assert (s.world_size, s.tp_size, s.dp_size, s.pp_size) == (1, 1, 1, 1)
    assert mpu.get_data_parallel_group() is None and mpu.get_model_parallel_world_size() == 1
    with pytest.raises(
        ConfigError, match="world size 1 is not divisible by tensor-parallel size 2"
    ):
        initialize_model_parallel(2)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 is outside 0..1"),
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ],
)
def test_bad_environment_is_named(monkeypatch, env, message):
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedError, match=message):
        init_distributed(device="cpu")
    assert not dist.is_initialized()


def test_bad_backend_and_timeout():
    with pytest.raises(DistributedError, match="unknown backend 'mpi'"):
        init_distributed(backend="mpi", device="cpu")
    with pytest.raises(DistributedError, match="nccl backend needs CUDA"):
        init_distributed(backend="nccl", device="cpu")
    with pytest.raises(DistributedError, match="timeout must be positive"):
        init_distributed(timeout_minutes=0)


# ------------------------------------------------------------------------------------------
# The harness: failures and hangs end the test, naming the rank


def _raise_at_step_2(rank):
    if rank == 1:
        raise ValueError("boom at step 2")
    comm.all_reduce(torch.ones(1), state().world)  # waits for rank 1, which never comes


def _die(rank):
    if rank == 1:
        os._exit(3)
    comm.all_reduce(torch.ones(1), state().world)


def _sleep(rank, seconds):
    time.sleep(seconds)


def _one_rank_stalls(rank):
    if rank == 0:
        time.sleep(60)
    comm.all_reduce(torch.ones(1), state().world)


@pytest.mark.timing  # bounds the wall-clock time to the failure
def test_a_raising_rank_fails_the_run_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_raise_at_step_2, 2)
    assert info.value.rank == 1
    assert "ValueError: boom at step 2" in str(info.value)
    assert "_raise_at_step_2" in str(info.value)  # the traceback, not just the message
    assert time.monotonic() - start < 20


def test_a_dying_rank_is_named():
    with pytest.raises(RankError) as info:
        run_ranks(_die, 2)
    assert info.value.rank == 1 and "exited with code 3" in str(info.value)


@pytest.mark.timing  # bounds the wall-clock time to the kill
def test_hung_ranks_are_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] did not finish within 2 s"):
        run_ranks(_sleep, 2, 600, timeout=2)
    assert time.monotonic() - start < 10


def test_collective_timeout_bounds_a_wait_for_a_stalled_peer():
    # Rank 1 waits in an all-reduce for rank 0; the 3 s collective timeout ends it (the run's
    # own limit is generous so a loaded machine's slow start cannot turn this into RankTimeout).
    with pytest.raises(RankError) as info:
        run_ranks(_one_rank_stalls, 2, timeout=60, collective_timeout=3)
    assert not isinstance(info.value, RankTimeout)
    assert info.value.rank == 1
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()
