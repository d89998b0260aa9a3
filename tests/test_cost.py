"""The cost model: FLOP forms, the bubble from the schedules, where groups sit, and one small
step computed by hand from the closed forms."""

from __future__ import annotations

import dataclasses

import pytest

from zerotron.pipeline import build_schedule, simulate
from zerotron.tuning import cost
from zerotron.tuning.cost import Cluster, crosses_nodes, pipeline_idle, predict, step_flops
from zerotron.tuning.estimate import Layout, ModelShape

NARAYANAN_1T = ModelShape(128, 25600, 160, 2048, 51200)


def test_step_flops_with_full_recompute_is_narayanans_96_form():
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200  # noqa: E741
    want = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert step_flops(NARAYANAN_1T, B, "full") == pytest.approx(want, rel=1e-12)


def test_step_flops_without_recompute_is_the_72_form():
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200  # noqa: E741
    want = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert step_flops(NARAYANAN_1T, B, "none") == pytest.approx(want, rel=1e-12)


def _block(layout: Layout, n: int) -> Layout:
    return dataclasses.replace(layout, recompute_method="block", recompute_num_layers=n)


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (2, 2)])
def test_block_recompute_runs_one_more_forward_of_its_layers_per_chunk(pp, vpp):
    """Block recompute of N layers: N per pipeline chunk run forward again, the others not."""
    lay = Layout(pp=pp, vpp=vpp, dp=2, num_microbatches=4, recompute="full")
    got = predict(TINY, _block(lay, 1), _free_comm()).flops
    B, chunks = 2 * 4, pp * vpp
    assert got == step_flops(TINY, B) + B * chunks * cost.layer_forward_flops(TINY, 1)


def test_block_recompute_of_every_layer_costs_what_uniform_does():
    lay = Layout(pp=2, dp=2, num_microbatches=4, recompute="full")
    c = _free_comm()
    assert predict(TINY, _block(lay, 4), c) == dataclasses.replace(
        predict(TINY, lay, c), layout=_block(lay, 4)
    )
    assert predict(TINY, _block(lay, 3), c).step_time < predict(TINY, lay, c).step_time


def _free_comm(**kw) -> Cluster:
    """A cluster whose links and memory are so fast that only the matmuls cost time."""
    return Cluster(1, 64, 2**40, 1e12, 1e30, 1e30, hbm_bandwidth=1e30, efficiency=0.5, **kw)


TINY = ModelShape(8, 64, 4, 32, 1000)


@pytest.mark.parametrize("p,m,v", [(4, 16, 1), (4, 8, 2), (2, 12, 4)])
def test_bubble_emerges_from_the_schedule_as_megatrons(p, m, v):
    # backward = 2 x forward and free communication: idle / busy is (p - 1) / (v m)
    lay = Layout(pp=p, vpp=v, num_microbatches=m)
    c = predict(TINY, lay, _free_comm())
    assert c.bubble / c.compute == pytest.approx((p - 1) / (v * m), rel=1e-9)


@pytest.mark.parametrize("kind,p,m,v,ratio", [("1f1b", 4, 20, 1, 3), ("interleaved", 4, 20, 2, 3)])
def test_idle_extrapolated_in_m_equals_the_full_simulation(kind, p, m, v, ratio):
    full = simulate(build_schedule(kind, p, m, v), 1.0, float(ratio))
    assert pipeline_idle(p, m, v, ratio) == pytest.approx(
        full.makespan - m * v * (1 + ratio), rel=1e-12
    )


def test_idle_is_linear_in_the_backward_ratio_between_whole_ratios():
    p, m, v, tf, tb = 4, 8, 2, 1.0, 2.5
    full = simulate(build_schedule("interleaved", p, m, v), tf, tb).makespan
    assert cost._pipeline_time(p, m, v, tf, tb) == pytest.approx(full, rel=1e-12)


def test_groups_inside_a_node_use_its_links():
    assert crosses_nodes(Layout(tp=8, dp=2), 8) == {
        "tp": False,
        "dp": True,
        "pp": False,
        "embedding": False,
    }
    assert crosses_nodes(Layout(tp=2, dp=4), 8)["dp"] is False
    assert crosses_nodes(Layout(tp=16), 8)["tp"] is True
    assert crosses_nodes(Layout(tp=2, pp=4), 8)["pp"] is False
    assert crosses_nodes(Layout(tp=2, pp=8), 8)["pp"] is True


# One small step by hand: 2 layers, h 64, 4 heads, s 32, vocabulary 1000 (padded to 1024),
# micro-batch 1, 2 micro-batches, bf16, on 2 GPUs of one node.
SMALL = ModelShape(2, 64, 4, 32, 1000)
HAND = Cluster(
    1, 2, 2**34, peak_flops=1e12, intra_node_bandwidth=1e9, inter_node_bandwidth=1e8,
    hbm_bandwidth=1e11, efficiency=0.5,
)  # fmt: skip
RATE = 0.5e12


def test_hand_computed_step_data_parallel():
    # per micro-batch forward: 2 layers × (2·32·(4·64² + 2·64·256) + 4·32²·64) + head 2·32·64·1024
    fwd = 2 * (2 * 32 * (4 * 64**2 + 2 * 64 * 256) + 4 * 32**2 * 64) + 2 * 32 * 64 * 1024
    act = 2 * 32 * 64 * (10 + 24)  # 2 layers of Korthikanti's s·b·h·(10 + 24/t) bytes
    loss = 2 * 4 * 32 * 1024  # fp32 logits written and read, each way
    per_mb = 3 * fwd / RATE + (3 * act + 2 * loss) / 1e11  # backward = 2 x forward's matmuls
    params = 2 * (12 * 64**2 + 13 * 64) + (1024 + 32) * 64 + 2 * 64
    allreduce = 2 * (2 - 1) / 2 * params * 2 / 1e9  # bf16 gradients, ring, intra-node
    got = predict(SMALL, Layout(dp=2, num_microbatches=2), HAND)
    assert got.step_time == pytest.approx(2 * per_mb + allreduce, rel=1e-12)


def test_hand_computed_step_tensor_parallel():
    # each rank: half of every matmul and of the 1024-row head; activations s·b·h·(10 + 24/2)
    fwd = (2 * (2 * 32 * (4 * 64**2 + 2 * 64 * 256) + 4 * 32**2 * 64) + 2 * 32 * 64 * 1024) / 2
    act = 2 * 32 * 64 * (10 + 12)
    loss = 2 * 4 * 32 * 512  # half the vocabulary's logits on each rank
    a = 32 * 64 * 2  # b·s·h bf16 bytes, one all-reduce; ring factor 2(n-1)/n = 1 at n = 2
    comm = (4 * 2 + 1 + 1) * a + 3 * 32 * 4  # 4 per layer, embedding, head, CE's 3 × b·s fp32
    per_mb = 3 * fwd / RATE + (3 * act + 2 * loss) / 1e11 + comm / 1e9
    got = predict(SMALL, Layout(tp=2, num_microbatches=4), HAND)
    assert got.step_time == pytest.approx(4 * per_mb, rel=1e-12)


@pytest.mark.parametrize(
    "stage,factor,extra",
    [
        (0, 2 * 2, {}),
        (1, 2 + 2, {}),
        (2, 2 + 2, {}),
        (3, 2 * 2 + 2, {}),
        (3, 2 * 2 + 2, {"recompute": "full"}),
        (3, 2 + 2, {"max_reuse_distance": 10**9}),
    ],
)
def test_zero_wire_bytes_are_the_zero_papers(stage, factor, extra):
    # one micro-batch, bf16 (p = g = 2 bytes): ZeRO 0 all-reduces 2(n-1)/n·Ψ·g; 1 and 2
    # reduce-scatter gradients and all-gather parameters, (n-1)/n·Ψ·(g + p); 3 gathers twice,
    # (n-1)/n·Ψ·(2p + g), with or without recompute (the recomputed forward's gather serves
    # the backward); with DeepSpeed's reuse distance the parameters stay gathered from the
    # forward to the backward of a model this small: once, (n-1)/n·Ψ·(p + g), as stage 2
    from zerotron.tuning.volume import rank_parameters, step_terms, wire_bytes

    lay = Layout(dp=4, zero_stage=stage, **extra)
    psi = rank_parameters(TINY, lay, 0)
    got = sum(wire_bytes(t.op, t.nbytes, 4) for t in step_terms(TINY, lay, 0) if t.group == "dp")
    assert psi % 4 == 0
    assert got == pytest.approx(3 / 4 * psi * factor, rel=1e-12)
