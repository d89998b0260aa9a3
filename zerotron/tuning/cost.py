"""The planner's cost model: predicted time of one training step for a model, layout and cluster.

    from zerotron.tuning.cost import cluster, predict
    from zerotron.tuning.estimate import Layout, ModelShape
    c = cluster("a100-80gb", nodes=1)
    cost = predict(ModelShape.gpt2("1.5B"), Layout(tp=2, dp=4, micro_batch_size=4,
                                                   num_microbatches=16), c)
    cost.step_time, cost.tflops_per_gpu, cost.breakdown()

What a step costs, on the slowest pipeline stage (the last: it holds the LM head):

- **Compute** at a calibrated fraction of peak (:data:`EFFICIENCY`): each micro-batch's forward
  FLOPs on the rank (its layers' matmuls and attention, the LM head on the last stage), backward
  twice that, full recompute one more forward of the layers it recomputes (all of them with
  ``uniform`` units, the first ``recompute_num_layers`` of each chunk with ``block``), selective
  recompute one more attention core. Summed over a step these are Narayanan et al. 2021's
  (arXiv 2104.04473, eq. 3) ``F = 96·B·s·l·h²·(1 + s/6h + V/16lh)`` with full recompute of
  every layer and ``72·B·s·l·h²·(1 + s/6h + V/12lh)`` without (:func:`step_flops`; tests check
  both). Plus the memory-bound work at the
  GPU's memory bandwidth: each layer's activations as Korthikanti et al. 2022 count them
  (:func:`activation_bytes`: written once forward, read and their gradients written backward;
  the attention scores only where attention materializes them) and the loss's fp32 logits
  (:func:`loss_bytes`).
- **Communication**: the closed-form bytes of :mod:`~zerotron.tuning.volume` (the ones the comm
  ledger is checked against), turned into wire bytes by the ring factors and divided by the
  bandwidth of the link the group uses: intra-node when every member of every group of that
  kind sits on one node (rank order tp fastest, then dp, then pp), inter-node otherwise. TP and
  pipeline sends, and ZeRO-2/3's per-micro-batch traffic, are added to the forward or backward
  of each micro-batch (Megatron runs them on the critical path); the data-parallel gradient
  reduction, the sequence-parallel and tied-embedding gradient all-reduces are paid once per
  step after the pipeline drains (no overlap assumed).
- **Pipeline bubble**: not a formula. The schedule zerotron would run (1F1B, or interleaved 1F1B
  with virtual stages) is built as data and run by :func:`zerotron.pipeline.simulate` with the
  per-micro-batch forward and backward times above; the makespan is the pipeline's time, so
  (p - 1)/(v·m) emerges from it (and, where a schedule does worse with these costs, so does
  that). Large ``m`` is simulated at two small ``m`` and extrapolated, and a backward/forward
  ratio between whole numbers is interpolated between them: the idle time is affine in both
  (``tests/test_cost.py`` checks against full simulations). Interleaved schedules are
  simulated only up to :data:`SIMULATION_LIMIT`.

Not modelled: the optimizer step, data loading, kernel launch gaps, overlap of gradient
reduction with backward, and any micro-batch dependence of GEMM efficiency (micro-batch sizes
tie unless memory or per-micro-batch traffic separates them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from zerotron.errors import ConfigError
from zerotron.pipeline import build_schedule, simulate
from zerotron.tuning.activations import paper_layer_bytes
from zerotron.tuning.estimate import Layout, ModelShape
from zerotron.tuning.volume import Term, chunk_layers, step_terms, wire_bytes

GiB = 2**30

EFFICIENCY = 0.608
"""Achieved fraction of peak FLOP/s on the model's matmuls. Calibrated on ONE row of Narayanan
et al. 2021 Table 1, the 145.6B model (1536 A100s, TP 8, PP 8, batch 2304: 148 TFLOP/s per
GPU), with the a100-80gb preset, 1F1B, micro-batch 1, full recompute and attention that
materializes its scores (Megatron-LM in 2021). The other nine rows are predictions:
``tests/test_cost_narayanan.py`` recomputes this constant and prints every row's error."""


@dataclass(frozen=True)
class Cluster:
    """GPUs the planner lays a run out on. Bandwidths are bytes/s per GPU, one direction."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    hbm_bandwidth: float = 2.0e12
    efficiency: float = EFFICIENCY
    name: str = "custom"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


GPUS: dict[str, dict] = {
    # 16-bit dense tensor-core peak; NVLink per GPU per direction; one HDR (200 Gb/s) or NDR
    # (400 Gb/s) NIC per GPU, as in DGX A100 / DGX H100 nodes.
    "a100-40gb": dict(
        gpu_memory=40 * GiB, peak_flops=312e12, hbm=1.555e12, intra=300e9, inter=25e9
    ),
    "a100-80gb": dict(
        gpu_memory=80 * GiB, peak_flops=312e12, hbm=2.039e12, intra=300e9, inter=25e9
    ),
    "h100-80gb": dict(gpu_memory=80 * GiB, peak_flops=989e12, hbm=3.35e12, intra=450e9, inter=50e9),
    "h200": dict(gpu_memory=141 * GiB, peak_flops=989e12, hbm=4.8e12, intra=450e9, inter=50e9),
}


def cluster(gpu: str, nodes: int = 1, gpus_per_node: int = 8, **overrides) -> Cluster:
    """A cluster of ``nodes`` × ``gpus_per_node`` GPUs of a preset (:data:`GPUS`); keyword
    ``overrides`` replace any :class:`Cluster` field (e.g. ``inter_node_bandwidth``)."""
    if gpu not in GPUS:
        raise ConfigError(f"unknown GPU preset {gpu!r}", fix=f"use one of {', '.join(GPUS)}")
    g = GPUS[gpu]
    base = dict(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu_memory=g["gpu_memory"],
        peak_flops=g["peak_flops"],
        intra_node_bandwidth=g["intra"],
        inter_node_bandwidth=g["inter"],
        hbm_bandwidth=g["hbm"],
        name=gpu,
    )
    base.update({k: v for k, v in overrides.items() if v is not None})
    return Cluster(**base)


# --------------------------------------------------------------------------------------------
# FLOPs


def layer_forward_flops(shape: ModelShape, b: int) -> float:
    """Forward FLOPs of one transformer layer for ``b`` sequences (whole layer, before TP):
    QKV, projection and MLP matmuls ``2bs(4h² + 2hf)`` plus attention ``4bs²h``."""
    s, h, f = shape.seq_length, shape.hidden_size, shape.ffn
    return 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h


def attention_core_flops(shape: ModelShape, b: int) -> float:
    """Forward FLOPs of the attention core (QKᵀ and the weighted sum): what selective
    recompute runs again (Korthikanti et al. 2022)."""
    return 4 * b * shape.seq_length**2 * shape.hidden_size


def head_forward_flops(shape: ModelShape, b: int, tp: int = 1) -> float:
    """Forward FLOPs of the LM head (logits over the padded vocabulary) for ``b`` sequences."""
    return 2 * b * shape.seq_length * shape.hidden_size * shape.padded_vocab(tp)


def recompute_flops(shape: ModelShape, b: int, recompute: str) -> float:
    """Extra forward FLOPs per layer that ``recompute`` runs during backward."""
    if recompute == "full":
        return layer_forward_flops(shape, b)
    if recompute == "selective":
        return attention_core_flops(shape, b)
    return 0.0


def recomputed_layers(layout: Layout, layers: int) -> int:
    """How many of a chunk's ``layers`` run their forward again in backward: every one under
    selective recompute (its attention core) and under full recompute with ``uniform`` units
    (whatever their size), the first ``recompute_num_layers`` with ``block``; none without."""
    if layout.recompute == "none":
        return 0
    n = layout.recompute_num_layers
    if layout.recompute == "full" and layout.recompute_method == "block" and n is not None:
        return min(layers, n)
    return layers


def step_flops(
    shape: ModelShape,
    global_batch: int,
    recompute: str = "none",
    tp: int = 1,
    recomputed: int | None = None,
) -> float:
    """FLOPs of one step over all ranks: forward, backward (2×) and what ``recompute`` adds
    to ``recomputed`` of the layers (default all of them). With ``"full"`` on every layer this
    is Narayanan et al.'s 96·B·s·l·h²(1 + s/6h + V/16lh), with ``"none"`` 72·B·s·l·h²(1 + s/6h +
    V/12lh) (ffn = 4h, V the padded vocabulary)."""
    redo = shape.num_layers if recomputed is None else recomputed
    layers = shape.num_layers * 3 * layer_forward_flops(shape, 1)
    layers += redo * recompute_flops(shape, 1, recompute)
    return global_batch * (layers + 3 * head_forward_flops(shape, 1, tp))


# --------------------------------------------------------------------------------------------
# Where groups sit


def crosses_nodes(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """For each group kind, whether some group of it spans two nodes (rank = (pp·dp + dp)·tp +
    tp: TP groups are tp consecutive ranks, DP groups span tp·dp, the pipeline the world)."""

    def spans(block: int) -> bool:
        return block > gpus_per_node or gpus_per_node % block != 0

    world = layout.world_size
    return {
        "tp": layout.tp > 1 and spans(layout.tp),
        "dp": layout.dp > 1 and spans(layout.tp * layout.dp),
        "pp": layout.pp > 1 and spans(world),
        "embedding": layout.pp > 1 and spans(world),
    }


# --------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one step (seconds) and where it goes, on the slowest stage."""

    layout: Layout
    step_time: float
    compute: float  # busy time of the stage's forward/backward math over the step
    bubble: float  # pipeline idle time of the stage (makespan - busy)
    comm: dict[str, float]  # exposed seconds per group kind: tp, pp, dp, embedding
    flops: float  # executed per step, all ranks (recompute counted, as Narayanan et al.)
    model_flops: float  # without recompute (MFU convention)
    crosses: dict[str, bool] = field(default_factory=dict)

    @property
    def tflops_per_gpu(self) -> float:
        """Executed TFLOP/s per GPU (recompute counted: Narayanan et al.'s Table 1 measure)."""
        return self.flops / self.step_time / self.layout.world_size / 1e12

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (recompute not counted)."""
        return self.model_flops / self.step_time / self.layout.world_size / 1e12

    @property
    def bubble_fraction(self) -> float:
        """Pipeline idle over the step time."""
        return self.bubble / self.step_time

    def breakdown(self) -> dict[str, float]:
        """Seconds per part: compute, bubble, and each communication kind."""
        return {"compute": self.compute, "bubble": self.bubble, **self.comm}


def activation_bytes(shape: ModelShape, layout: Layout, flash_attention: bool = True) -> dict:
    """Bytes one layer's forward writes for one micro-batch on one TP rank, in Korthikanti et
    al. 2022's terms (:func:`~zerotron.tuning.activations.paper_layer_bytes`): ``linear``, the
    matmul inputs, LayerNorms, GeLU and dropout masks (``s·b·h·(10 + 24/t)``, ``34/t`` under
    sequence parallelism); ``scores``, the attention scores, softmax and its dropout
    (``5·a·s²·b/t``; none when flash attention keeps them on chip)."""
    args = (
        shape.seq_length,
        layout.micro_batch_size,
        shape.hidden_size,
        shape.num_attention_heads,
        layout.tp,
        layout.sequence_parallel and layout.tp > 1,
    )
    linear = paper_layer_bytes(*args, recompute="selective")
    scores = 0.0 if flash_attention else paper_layer_bytes(*args) - linear
    return {"linear": linear, "scores": scores}


def loss_bytes(shape: ModelShape, layout: Layout) -> float:
    """Memory traffic of the cross entropy over the vocabulary, one pass each way: the fp32
    logits of one micro-batch on one TP rank written and read for the softmax in forward, the
    softmax read and its gradient written in backward (``2 · 4 · b·s·V/t`` bytes per pass)."""
    b, s = layout.micro_batch_size, shape.seq_length
    return 2 * 4 * b * s * shape.padded_vocab(layout.tp) / layout.tp


def predict(
    shape: ModelShape,
    layout: Layout,
    c: Cluster,
    *,
    flash_attention: bool = True,
    bubble: bool = True,
) -> StepCost:
    """The predicted step time of ``layout`` on cluster ``c`` (see the module docstring).

    ``flash_attention=False`` models attention that materializes its scores (Megatron-LM in
    2021). ``bubble=False`` skips the pipeline simulation and counts no idle time: a lower
    bound of the step time, which the planner uses to skip layouts that cannot win."""
    crosses = crosses_nodes(layout, c.gpus_per_node)
    group_size = {"tp": layout.tp, "dp": layout.dp, "pp": 2, "embedding": 2}

    def seconds(t: Term) -> float:
        if t.group == "pp" and t.op == "recv":
            return 0.0  # the sender's side carries the time; links are full duplex
        bw = c.inter_node_bandwidth if crosses[t.group] else c.intra_node_bandwidth
        return wire_bytes(t.op, t.nbytes, group_size[t.group]) / bw

    m, v, b, tp = layout.num_microbatches, layout.vpp, layout.micro_batch_size, layout.tp
    rate = c.efficiency * c.peak_flops
    act = activation_bytes(shape, layout, flash_attention)
    # Memory-bound work of a layer (LayerNorm, GeLU, softmax, dropout, residuals): forward
    # writes its activations once, backward reads them and writes their gradients.
    act_fwd = (act["linear"] + act["scores"]) / c.hbm_bandwidth
    act_extra = {"full": act_fwd, "selective": act["scores"] / c.hbm_bandwidth}.get(
        layout.recompute, 0.0
    )
    worst = None
    parts = layout.pp * layout.vpp
    redo_all = parts * recomputed_layers(layout, shape.num_layers // parts)
    for pp_rank in sorted({0, layout.pp - 1}):
        flops = extra = 0.0
        layers = redo = 0
        head_time = 0.0
        for n, _, post in chunk_layers(shape, layout, pp_rank):
            r = recomputed_layers(layout, n)
            layers, redo = layers + n, redo + r
            flops += n * layer_forward_flops(shape, b) / tp
            extra += r * recompute_flops(shape, b, layout.recompute) / tp
            if post:
                flops += head_forward_flops(shape, b, tp) / tp
                head_time = loss_bytes(shape, layout) / c.hbm_bandwidth
        per = {"forward": 0.0, "backward": 0.0}
        step: dict[str, float] = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "embedding": 0.0}
        inline: dict[str, float] = dict(step)
        for t in step_terms(shape, layout, pp_rank):
            sec = seconds(t)
            if t.phase == "step":
                step[t.group] += sec
            else:
                per[t.phase] += sec / m
                inline[t.group] += sec
        fwd_math = flops / rate + layers * act_fwd + head_time
        bwd_math = (2 * flops + extra) / rate + layers * 2 * act_fwd + redo * act_extra + head_time
        # one micro-batch through one model chunk (the stage's chunks averaged)
        tf = (fwd_math + per["forward"]) / v
        tb = (bwd_math + per["backward"]) / v
        busy = m * v * (tf + tb)
        makespan = _pipeline_time(layout.pp, m, v, tf, tb) if bubble else busy
        cost = StepCost(
            layout=layout,
            step_time=makespan + sum(step.values()),
            compute=m * (fwd_math + bwd_math),
            bubble=makespan - busy,
            comm={k: inline[k] + step[k] for k in step},
            flops=step_flops(shape, _global_batch(layout), layout.recompute, tp, redo_all),
            model_flops=step_flops(shape, _global_batch(layout), "none", tp),
            crosses=crosses,
        )
        if worst is None or cost.step_time > worst.step_time:
            worst = cost
    assert worst is not None
    return worst


def _global_batch(layout: Layout) -> int:
    return layout.micro_batch_size * layout.num_microbatches * layout.dp


def _pipeline_time(p: int, m: int, v: int, tf: float, tb: float) -> float:
    """Makespan of zerotron's schedule for (p, m, v) with per-chunk forward ``tf`` and
    backward ``tb`` seconds, from the simulated timeline (which scales with ``tf``)."""
    if p == 1:
        return m * v * (tf + tb)
    ratio = tb / tf
    # The idle time is linear in the backward/forward ratio between whole ratios (checked in
    # tests/test_cost.py): simulate at the two whole ratios around it and interpolate.
    lo = max(1, min(int(ratio), 7))
    w = ratio - lo
    idle = (1 - w) * pipeline_idle(p, m, v, lo) + w * pipeline_idle(p, m, v, lo + 1)
    return tf * (m * v * (1 + ratio) + idle)


SIMULATION_LIMIT = 4096
"""Interleaved schedules are simulated at m = p and 2p micro-batches: the planner considers
virtual stages only where p·p·v ≤ this many chunk computes (building and simulating larger
schedules takes seconds each)."""


def simulable(p: int, v: int) -> bool:
    """Whether :func:`pipeline_idle` simulates (p, ·, v) within :data:`SIMULATION_LIMIT`."""
    return v == 1 or p * p * v <= SIMULATION_LIMIT


@functools.lru_cache(maxsize=4096)
def pipeline_idle(p: int, m: int, v: int, ratio: int) -> float:
    """Idle time (makespan - busy) of zerotron's schedule for (p, m, v), in units of one chunk's
    forward, when a backward costs ``ratio`` forwards. Simulated at m itself when m is small
    (m ≤ 8 for 1F1B, m ≤ 2p for interleaved, which needs m a multiple of p); beyond that
    extrapolated from two simulated m, the idle time being affine in m (tests check it)."""
    kind = "interleaved" if v > 1 else "1f1b"
    unit = p if v > 1 else 4
    if m <= 2 * unit:
        return _idle(kind, p, m, v, ratio)
    i1, i2 = _idle(kind, p, unit, v, ratio), _idle(kind, p, 2 * unit, v, ratio)
    return i1 + (i2 - i1) * (m - unit) / unit


@functools.lru_cache(maxsize=256)
def _schedule(kind: str, p: int, m: int, v: int):
    return build_schedule(kind, p, m, v)


@functools.lru_cache(maxsize=4096)
def _idle(kind: str, p: int, m: int, v: int, ratio: int) -> float:
    timeline = simulate(_schedule(kind, p, m, v), 1.0, float(ratio))
    return timeline.makespan - m * v * (1 + ratio)


def calibrate(
    shape: ModelShape,
    layout: Layout,
    c: Cluster,
    achieved_tflops: float,
    flash_attention: bool = True,
) -> float:
    """The efficiency at which :func:`predict` gives ``achieved_tflops`` per GPU for ``layout``
    (bisection: predicted throughput rises with efficiency)."""
    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        cost = predict(shape, layout, _with(c, mid), flash_attention=flash_attention)
        if cost.tflops_per_gpu < achieved_tflops:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _with(c: Cluster, efficiency: float) -> Cluster:
    return Cluster(**{**c.__dict__, "efficiency": efficiency})
