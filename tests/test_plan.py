"""The layout planner: valid layouts only, what does not fit dropped, ranking, ``zerotron plan``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zerotron.errors import ConfigError
from zerotron.tuning.cost import Cluster, cluster
from zerotron.tuning.estimate import Layout, ModelShape, check, estimate
from zerotron.tuning.plan import GB, SearchSpace, layouts, memory_key, plan
from zerotron.tuning.plan_cli import main

SHAPE = ModelShape(4, 64, 4, 32, 1000)


def _all(shape=SHAPE, world=8, batch=16, **space):
    return list(layouts(shape, world, batch, SearchSpace(**space), gpus_per_node=8))


def test_every_enumerated_layout_is_valid():
    found = _all()
    for lay in found:
        assert lay.tp * lay.pp * lay.dp == 8
        assert SHAPE.num_attention_heads % lay.tp == 0
        assert SHAPE.num_layers % (lay.pp * lay.vpp) == 0
        assert lay.micro_batch_size * lay.num_microbatches * lay.dp == 16
        assert lay.vpp == 1 or (lay.pp > 1 and lay.num_microbatches % lay.pp == 0)
        assert lay.zero_stage < 2 or lay.pp == 1
        assert lay.zero_stage == 0 or lay.dp > 1
        assert not lay.sequence_parallel or lay.tp > 1
        check(SHAPE, lay)  # the estimator accepts it too


def test_enumeration_is_complete_on_a_small_case():
    # 4 layers, 4 heads, 8 ranks, batch 16: (tp, pp) pairs that divide heads, layers, ranks
    pairs = {(lay.tp, lay.pp) for lay in _all()}
    assert pairs == {(t, p) for t in (1, 2, 4) for p in (1, 2, 4) if t * p <= 8}
    assert Layout(
        tp=2, pp=2, dp=2, vpp=2, sequence_parallel=True, micro_batch_size=2,
        num_microbatches=4, recompute="selective",
    ) in _all()  # fmt: skip
    assert len(_all()) == len(set(_all()))


def test_tp_within_node_keeps_tp_groups_on_one_node():
    found = list(layouts(SHAPE, 8, 16, SearchSpace(tp_within_node=True), gpus_per_node=2))
    assert {lay.tp for lay in found} == {1, 2}


def test_memory_at_fewer_microbatches_is_the_same():
    for lay in (
        Layout(pp=4, dp=2, num_microbatches=16),
        Layout(pp=2, vpp=2, dp=2, num_microbatches=8),
        Layout(dp=8, num_microbatches=6, recompute="full"),
    ):
        assert estimate(SHAPE, memory_key(lay)) == estimate(SHAPE, lay)


GPT2 = ModelShape.gpt2("124M", seq_length=256)


def _small_cluster(memory_gb: float) -> Cluster:
    return cluster("a100-80gb", nodes=1, gpus_per_node=4, gpu_memory=int(memory_gb * GB))


@pytest.fixture(scope="module")
def full_3gb():
    """Every layout of GPT-2 124M on 4 GPUs of 3 GB, batch 32, evaluated."""
    return plan(GPT2, _small_cluster(3), 32, top=0)


@pytest.fixture(scope="module")
def full_80gb():
    return plan(GPT2, _small_cluster(80), 32, top=0)


def test_layouts_that_do_not_fit_are_dropped(full_3gb):
    result = full_3gb
    assert result.ranked and result.rejected
    for cand in result.ranked:
        assert cand.memory.total <= 3 * GB
    for cand in result.rejected:
        assert cand.memory.total > 3 * GB
        assert cand.why.startswith("does not fit: ") and cand.why.endswith("> 3.0 GB")


def test_nothing_fits_says_what_to_do():
    with pytest.raises(ConfigError, match="no layout of this model fits"):
        _ = plan(GPT2, _small_cluster(0.01), 8).best


def test_ranking_is_by_predicted_step_time(full_80gb):
    result = full_80gb
    times = [c.cost.step_time for c in result.ranked]
    # ascending; layouts as fast as each other (within a millionth) by memory instead
    assert all(b >= a * (1 - 1e-6) for a, b in zip(times, times[1:]))
    assert times[-1] > times[0]
    assert result.ranked[0].why == "fastest"


def test_pruned_plan_has_the_same_top_as_the_full_one(full_3gb):
    full = full_3gb
    pruned = plan(GPT2, _small_cluster(3), 32, top=4)
    assert [c.layout for c in pruned.ranked[:4]] == [c.layout for c in full.ranked[:4]]
    assert pruned.skipped > 0


def test_tp_across_nodes_loses_and_says_so():
    c = cluster("a100-80gb", nodes=2, gpus_per_node=2)
    result = plan(GPT2, c, 16, SearchSpace(zero_stages=(0,), recompute=("none",)), top=0)
    tp4 = [k for k in result.ranked if k.layout.tp == 4]
    assert tp4 and all("TP all-reduce crosses nodes" in k.why for k in tp4)


def test_bubble_is_named_when_the_pipeline_loses():
    c = cluster("a100-80gb", nodes=1, gpus_per_node=4)
    space = SearchSpace(zero_stages=(0,), recompute=("none",), sequence_parallel=(False,))
    layers_heavy = ModelShape(8, 1024, 16, 256, 1000)  # a small head: stages balanced
    result = plan(layers_heavy, c, 8, space, top=0)
    (pp4,) = [
        k
        for k in result.ranked
        if k.layout.pp == 4 and k.layout.vpp == 1 and k.layout.micro_batch_size == 1
    ]
    # idle share of the step: (p - 1) / (m + p - 1) = 3/11, less the little communication adds
    assert pp4.why.startswith("bubble ") and pp4.why.endswith("% (pp 4, 8 micro-batches, v 1)")
    assert float(pp4.why.split()[1].rstrip("%")) == pytest.approx(100 * 3 / 11, abs=0.2)


ARGS = ["--model", "124M", "--seq-length", "256", "--gpus-per-node", "4", "--gpu-memory", "3GB"]


def test_cli_json(capsys):
    assert main([*ARGS, "--global-batch-size", "64", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    top = out["top"]
    assert len(top) == 3 and top[0]["why"] == "fastest"
    assert [t["step_time_s"] for t in top] == sorted(t["step_time_s"] for t in top)
    assert all(t["memory"]["total"] <= 3 * 2**30 for t in top)
    assert out["model"]["num_layers"] == 12 and out["cluster"]["gpus_per_node"] == 4


def test_cli_table(capsys):
    assert main([*ARGS, "--global-batch-size", "64", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "fastest layouts that fit" in out and "fastest" in out and "TFLOP/s/GPU" in out


def test_cli_without_a_model_names_the_flags():
    with pytest.raises(ConfigError, match="--num-layers, --hidden-size, --num-attention-heads"):
        main(["--global-batch-size", "8"])


def test_cli_reads_the_model_section_of_a_config(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model:\n  num_layers: 6\n  hidden_size: 128\n  num_attention_heads: 4\n"
        "  seq_length: 64\ntraining:\n  micro_batch_size: 2\n"
    )
    assert main(["--config", str(cfg), "--gpus-per-node", "2", "--global-batch-size", "8",
                 "--json"]) == 0  # fmt: skip
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["num_layers"], model["hidden_size"], model["seq_length"]) == (6, 128, 64)


def test_layouts_as_fast_collapse_to_the_one_with_least_memory(full_80gb):
    result = full_80gb
    distinct = result.distinct()
    assert result.distinct() == distinct  # asking twice counts the same ties
    assert sum(1 + k.ties for k in distinct) == len(result.ranked)
    for k in distinct:
        t = k.cost.step_time
        same = [o for o in result.ranked if abs(o.cost.step_time - t) <= 1e-6 * t]
        assert k.memory.total == min(o.memory.total for o in same)


def _block(layout: Layout, n: int) -> Layout:
    return replace(layout, recompute_method="block", recompute_num_layers=n)


def test_block_recompute_keeps_the_fewest_layers_that_fit():
    """Where recomputing one layer per chunk does not fit, the planner keeps the block layout
    with the fewest recomputed layers that does (every N's estimate checked), faster than
    recomputing every layer."""
    shape = ModelShape.gpt2("124M", seq_length=1024)
    c = _small_cluster(6.5)
    space = SearchSpace(
        zero_stages=(1,), recompute=("full",), tp=(1,), pp=(1,), sequence_parallel=(False,)
    )
    result = plan(shape, c, 32, space, top=0)
    base = Layout(dp=4, micro_batch_size=8, recompute="full", zero_stage=1)
    fits = [n for n in range(1, 12) if estimate(shape, _block(base, n)).fits(c.gpu_memory)]
    assert 1 < fits[0] < 11  # the bisection has work to do
    ranked = {k.layout: k.cost.step_time for k in result.ranked}
    kept = [lay for lay in ranked if replace(lay, recompute_num_layers=1) == _block(base, 1)]
    assert kept == [_block(base, fits[0])]
    assert _block(base, 1) in [k.layout for k in result.rejected]
    assert ranked[kept[0]] < ranked[base]


def test_block_recompute_can_be_left_out():
    assert any(lay.recompute_method == "block" for lay in _all())
    assert not any(lay.recompute_method == "block" for lay in _all(recompute_blocks=False))


BLOCK_ARGS = ["--model", "124M", "--gpus-per-node", "4", "--gpu-memory", "6.5GB"]
BLOCK_ARGS += ["--recompute", "full", "--zero-stages", "1", "--global-batch-size", "32"]


def test_cli_names_block_recompute(capsys):
    assert main(BLOCK_ARGS) == 0
    assert "full (block " in capsys.readouterr().out


def test_cli_leaves_block_recompute_out_when_asked(capsys):
    assert main([*BLOCK_ARGS, "--no-recompute-blocks"]) == 0
    out = capsys.readouterr().out
    assert "fastest layouts that fit" in out and "block" not in out


def test_cli_refuses_a_zero_bandwidth():
    with pytest.raises(ConfigError, match="--inter-node-bandwidth must be positive"):
        main([*ARGS, "--global-batch-size", "8", "--inter-node-bandwidth", "0"])
