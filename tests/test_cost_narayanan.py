"""The cost model and the planner against Narayanan et al. 2021, Table 1.

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: weak-scaling throughput of GPT models
on Selene (DGX A100 80 GB nodes: 8 GPUs on NVSwitch, 8 × 200 Gb/s HDR InfiniBand), vocabulary
51,200, sequence 2048, 16-bit, FLOPs counted with activation recomputation (their eq. 3, the
96·B·s·l·h² form).

What the table does not say, and what we take: micro-batch 1, the non-interleaved 1F1B
schedule, full recompute, no ZeRO, no sequence parallelism, attention that materializes its
scores (Megatron-LM in 2021; ``flash_attention=False``). The cost model's one calibrated
constant, :data:`~zerotron.tuning.cost.EFFICIENCY`, comes from ONE row (145.6B); the other nine
are predictions. Each row's error is printed (``pytest -s``).
"""

from __future__ import annotations

import pytest

from zerotron.tuning.cost import EFFICIENCY, calibrate, cluster, predict
from zerotron.tuning.estimate import Layout, ModelShape
from zerotron.tuning.plan import SearchSpace, plan

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, achieved TFLOP/s per GPU
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
CALIBRATION_ROW = 6  # 145.6B
IDS = [f"{row[0]}B" for row in TABLE_1]

# What Megatron-LM offered in 2021: TP inside a node, PP, full recompute of every layer; no
# ZeRO, no SP, no block recompute.
SPACE_2021 = SearchSpace(
    zero_stages=(0,),
    recompute=("full",),
    recompute_blocks=False,
    sequence_parallel=(False,),
    max_virtual_stages=1,
    tp_within_node=True,
    flash_attention=False,
)


def _case(row):
    _, heads, hidden, layers, tp, pp, gpus, batch, achieved = row
    shape = ModelShape(layers, hidden, heads, 2048, 51200)
    dp = gpus // (tp * pp)
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch_size=1,
        num_microbatches=batch // dp,
        recompute="full",
    )
    return shape, layout, cluster("a100-80gb", nodes=gpus // 8), achieved


def test_parameter_counts_are_the_papers_eq_2():
    # P = 12lh²(1 + 13/12h + (V + s)/12lh), plus the final LayerNorm (2h) eq. 2 leaves out
    for row in TABLE_1:
        shape, _, _, _ = _case(row)
        l, h = shape.num_layers, shape.hidden_size
        eq2 = 12 * l * h * h + 13 * l * h + (51200 + 2048) * h
        assert shape.num_parameters() == eq2 + 2 * h, row
        assert shape.num_parameters() / 1e9 == pytest.approx(row[0], rel=0.03), row


def test_efficiency_is_calibrated_on_one_row():
    shape, layout, c, achieved = _case(TABLE_1[CALIBRATION_ROW])
    assert calibrate(shape, layout, c, achieved, flash_attention=False) == pytest.approx(
        EFFICIENCY, abs=5e-4
    )


@pytest.mark.parametrize("row", TABLE_1, ids=IDS)
def test_predicted_tflops_within_15_percent(row):
    shape, layout, c, achieved = _case(row)
    got = predict(shape, layout, c, flash_attention=False).tflops_per_gpu
    err = got / achieved - 1
    print(f"\n{row[0]}B: predicted {got:.1f} TFLOP/s per GPU, paper {achieved}: {err:+.1%}")
    assert abs(err) <= 0.15


@pytest.mark.parametrize("row", TABLE_1, ids=IDS)
def test_planner_chooses_the_papers_tp_pp_or_within_5_percent(row):
    shape, paper, c, _ = _case(row)
    best = plan(shape, c, row[7], SPACE_2021, top=1).best
    ours = predict(shape, paper, c, flash_attention=False)
    # throughput of the paper's layout against the planner's choice
    ratio = best.cost.step_time / ours.step_time
    lay = best.layout
    print(
        f"\n{row[0]}B: planner tp {lay.tp} pp {lay.pp} mbs {lay.micro_batch_size}, "
        f"paper tp {paper.tp} pp {paper.pp}: paper's layout at {ratio:.1%} of its throughput"
    )
    assert (lay.tp, lay.pp) == (paper.tp, paper.pp) or ratio >= 0.95
