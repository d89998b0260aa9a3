"""ProcessTopology: the rank grid, checked against DESIGN.md's examples and a loop reference."""

import itertools

import pytest

from zerotron.distributed import Coords, ProcessTopology
from zerotron.errors import ConfigError, DistributedError

SHAPES = [(tp, dp, pp) for tp, dp, pp in itertools.product([1, 2, 3, 4], repeat=3)]


def reference_rank(tp, dp, pp, t, d, p):
    return (p * dp + d) * tp + t


def test_design_examples():
    topo = ProcessTopology(tp=4, dp=2)
    assert topo.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]

    topo = ProcessTopology(tp=2, dp=2, pp=2)
    assert [r for r in range(8) if topo.coords(r).pp == 0] == [0, 1, 2, 3]
    assert [r for r in range(8) if topo.coords(r).pp == 1] == [4, 5, 6, 7]
    stage0 = set(topo.stage_ranks(0))
    assert [g for g in topo.groups("dp") if set(g) <= stage0] == [[0, 2], [1, 3]]
    assert [g for g in topo.groups("tp") if set(g) <= stage0] == [[0, 1], [2, 3]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert topo.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_coords_and_rank_follow_the_formula(tp, dp, pp):
    topo = ProcessTopology(tp=tp, dp=dp, pp=pp)
    assert topo.world_size == tp * dp * pp
    seen = set()
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        r = reference_rank(tp, dp, pp, t, d, p)
        assert topo.rank(tp=t, dp=d, pp=p) == r
        c = topo.coords(r)
        assert c == Coords(pp=p, dp=d, tp=t) and (c.pp, c.dp, c.tp) == (p, d, t)
        seen.add(r)
    assert seen == set(range(topo.world_size))


def reference_groups(topo, same):
    """Ranks grouped by the coordinates in ``same`` (a loop, independent of the class)."""
    groups = {}
    for p, d, t in itertools.product(range(topo.pp), range(topo.dp), range(topo.tp)):
        key = tuple({"pp": p, "dp": d, "tp": t}[a] for a in same)
        groups.setdefault(key, []).append(reference_rank(topo.tp, topo.dp, topo.pp, t, d, p))
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.parametrize("tp,dp,pp", SHAPES)
def test_groups_match_reference(tp, dp, pp):
    topo = ProcessTopology(tp=tp, dp=dp, pp=pp)
    assert topo.groups("tp") == reference_groups(topo, ("pp", "dp"))
    assert topo.groups("dp") == reference_groups(topo, ("pp", "tp"))
    assert topo.groups("pp") == reference_groups(topo, ("dp", "tp"))
    assert topo.groups("mp") == reference_groups(topo, ("dp",))
    assert [len(g) for g in topo.groups("tp")] == [tp] * (dp * pp)
    # Embedding: first and last stage of each (dp, tp) pipeline.
    expected = sorted(sorted({g[0], g[-1]}) for g in reference_groups(topo, ("dp", "tp")))
    assert topo.groups("embedding") == expected
    for r in range(topo.world_size):
        assert r in topo.group_of(r, "dp")


def test_embedding_group_is_one_stage_without_pipeline():
    assert ProcessTopology(tp=2, dp=1, pp=1).groups("embedding") == [[0], [1]]
    topo = ProcessTopology(tp=1, dp=1, pp=4)
    assert topo.groups("embedding") == [[0, 3]]
    assert topo.group_of(1, "embedding") == []


def test_from_world():
    assert ProcessTopology.from_world(16, tp=2, pp=4) == ProcessTopology(tp=2, dp=2, pp=4)
    assert ProcessTopology.from_world(3) == ProcessTopology(dp=3)
    with pytest.raises(ConfigError) as e:
        ProcessTopology.from_world(12, tp=4, pp=2)
    msg = str(e.value)
    assert "12" in msg and "4" in msg and "2" in msg and "= 8" in msg


def test_bad_input():
    with pytest.raises(ConfigError, match="tp size"):
        ProcessTopology(tp=0)
    with pytest.raises(ConfigError, match="positive integer"):
        ProcessTopology(dp=2.0)
    topo = ProcessTopology(tp=2, dp=2)
    with pytest.raises(ConfigError, match="unknown parallel axis 'cp'"):
        topo.groups("cp")
    with pytest.raises(ConfigError, match="unknown parallel axis"):
        topo.rank(ep=0)
    with pytest.raises(DistributedError, match="rank 4 is outside 0..3"):
        topo.coords(4)
    with pytest.raises(DistributedError, match="tp index 2"):
        topo.rank(tp=2)
