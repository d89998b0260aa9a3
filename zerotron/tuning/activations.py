"""Activation memory: what autograd keeps for backward, per layer and per pipeline stage.

Two accountings, side by side:

- :func:`paper_layer_bytes` is Korthikanti et al. 2022 ("Reducing Activation Recomputation in
  Large Transformer Models"), per transformer layer and micro-batch, 16-bit activations with
  1-byte dropout masks: ``sbh(34 + 5as/h)`` without parallelism, ``sbh(10 + 24/t + 5as/(ht))``
  with tensor parallelism t, ``sbh/t (34 + 5as/h)`` with sequence parallelism too, ``34 sbh/t``
  with selective recompute, ``2sbh`` (``2sbh/t`` with SP) with full recompute; the first
  pipeline stage holds p micro-batches of its L/p layers (L layers' worth) in 1F1B, times
  ``1 + (p-1)/(pv)`` in the interleaved schedule (:func:`paper_interleave_factor`).
- :func:`layer_bytes` is zerotron's GPT as it runs (measured with ``saved_tensors_hooks``, see
  tests/test_estimate_measured.py). Where it departs from the paper:

  * attention core: SDPA's flash kernel (CUDA; the CPU in fp32 without dropout) keeps q, k, v,
    its output and an fp32 log-sum-exp ``[b, a, s]``: no ``as²`` term. On the CPU, 16-bit
    attention without dropout runs the kernel the chooser picked (``ActivationCase.kernels``,
    :mod:`~zerotron.kernels.chooser`): ``math16``, the MATH kernel kept in 16 bits
    (:mod:`~zerotron.kernels.attention_cpu`), keeps the ``as²`` probabilities (``e`` bytes
    each); ``sdpa`` is the flash kernel; ``fp32``, flash on fp32 copies, keeps those copies of
    q, k, v and its output (4 bytes each) and the log-sum-exp. Attention dropout on the CPU
    makes SDPA run MATH in fp32, keeping scaled q and k, v, the probabilities, the dropout mask
    and the dropped probabilities, all fp32 (``12 sbh + 12 as²b`` bytes);
  * dropout masks: CUDA keeps a 1-byte mask, the CPU one of the activations' dtype; no mask at
    all with dropout 0 (the paper always counts them);
  * LayerNorm statistics (mean and rstd per token) are counted: fp32 on CUDA, the activations'
    dtype on the CPU;
  * sequence parallelism: zerotron's column-parallel linear keeps its all-gathered input
    (``e·sbh`` for the QKV and the first MLP projection) where Megatron keeps the shard and
    gathers again in backward;
  * selective recompute checkpoints SDPA itself: q, k, v and the output stay, the rest goes;
  * full recompute keeps each checkpointed unit's input (:func:`chunk_layers_bytes`:
    ``recompute_method`` uniform, a unit of ``recompute_num_layers`` layers, by default one;
    block, the first ``recompute_num_layers`` layers of each pipeline chunk on their own, the
    rest keeping everything); backward then rebuilds one unit's activations at a time
    (:func:`recompute_workspace`). DeepSpeed's options for it (:func:`kept_input_bytes`):
    ``partition_activations`` keeps a rank's 1/tp piece of each input (zero-padded to a
    multiple of tp, as DeepSpeed pads it; no effect under sequence parallelism, where the
    config turns it off), ``cpu_checkpointing`` keeps the inputs in host memory
    (:func:`host_bytes`; on a CPU run that memory is the rank's own, so nothing moves).

Pipeline: the activations a stage holds at once are counted by zerotron's own schedules
(:func:`~zerotron.pipeline.schedules.activations_in_flight`), not by the paper's factor: a
stage holds that many (micro-batch, model chunk) pairs of its chunks' layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from zerotron.kernels.policy import KernelChoices
from zerotron.pipeline.schedules import (
    Backward,
    Forward,
    activations_in_flight,
    build_schedule,
)

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class ActivationCase:
    """What one micro-batch's activations depend on (sizes per micro-batch, whole model)."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int  # the tokenizer's (the loss runs over the real vocabulary)
    padded_vocab_size: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # "none" | "selective" | "full"
    recompute_method: str = "uniform"  # full: "uniform" units of layers, or "block"
    recompute_num_layers: int | None = None  # full: None = 1 (uniform) / every layer (block)
    partition_activations: bool = False  # full: DeepSpeed's, each input split over TP
    cpu_checkpointing: bool = False  # full: DeepSpeed's, the inputs kept in host memory
    precision: str = "bf16"
    device: str = "cuda"  # "cuda" | "cpu": which kernels zerotron picks
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    kernels: KernelChoices = KernelChoices()  # the CPU kernel choices (zerotron.kernels.chooser)

    @property
    def e(self) -> int:
        """Bytes of one activation element."""
        return DTYPE_BYTES[self.precision]

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def inputs_on_host(self) -> bool:
        """Whether full recompute's kept inputs leave the device (cpu_checkpointing on one)."""
        return self.recompute == "full" and self.cpu_checkpointing and self.device != "cpu"


def attention_kernel(case: ActivationCase) -> str:
    """Which SDPA path zerotron's attention takes: ``"flash"``, ``"math16"``, ``"flash_fp32"``
    (flash on fp32 copies) or ``"math_fp32"`` (see the module docstring)."""
    if case.device != "cpu":
        return "flash"
    if case.attention_dropout > 0:
        return "math_fp32"
    if case.e != 2:
        return "flash"
    return {"math16": "math16", "sdpa": "flash", "fp32": "flash_fp32"}[case.kernels.attention]


def layer_bytes(case: ActivationCase, recompute: str | None = None) -> int:
    """Bytes one transformer layer keeps for backward for one micro-batch, on one TP rank."""
    recompute = case.recompute if recompute is None else recompute
    s, b, h = case.seq_length, case.micro_batch_size, case.hidden_size
    f, t, e = case.ffn_hidden_size, case.tp, case.e
    sbh, sb = s * b * h, s * b
    shard = t if case.sp else 1  # the residual stream's split under SP
    if recompute == "full":
        return 0 if case.inputs_on_host else kept_input_bytes(case)
    stats = 4 if case.device != "cpu" else e  # LayerNorm mean and rstd per token
    mask = 1 if case.device != "cpu" else e
    total = 2 * (e * sbh + 2 * stats * sb) // shard  # two LayerNorms: input and statistics
    total += 2 * e * sbh  # the QKV and MLP inputs (the LN outputs; all-gathered under SP)
    total += e * sb * 2 * f // t  # GELU's input and output (the second MLP matmul's input)
    if case.hidden_dropout > 0:
        total += 2 * mask * sbh // shard  # the two residual-branch dropout masks
    total += _attention_core(case, recompute)
    return total


def kept_input_bytes(case: ActivationCase) -> int:
    """Full recompute: what one checkpointed unit keeps, its input, on one TP rank (the
    residual stream: its shard under SP; with ``partition_activations`` the rank's 1/tp piece,
    zero-padded to a multiple of tp)."""
    sbh, t = case.seq_length * case.micro_batch_size * case.hidden_size, case.tp
    if case.sp:
        return case.e * sbh // t
    if case.partition_activations and t > 1:
        return case.e * -(-sbh // t)
    return case.e * sbh


def checkpointed_units(case: ActivationCase, layers: int) -> int:
    """How many checkpointed units (each keeping its input) ``layers`` consecutive layers
    make under full recompute; 0 without it."""
    if case.recompute != "full":
        return 0
    n = case.recompute_num_layers
    if case.recompute_method == "block":
        return min(layers, layers if n is None else n)
    return -(-layers // (n or 1))


def host_bytes(case: ActivationCase, layers: int) -> int:
    """What ``cpu_checkpointing`` keeps in host memory for one micro-batch of ``layers``
    consecutive layers: each checkpointed unit's input (0 unless :attr:`inputs_on_host`)."""
    if not case.inputs_on_host:
        return 0
    return checkpointed_units(case, layers) * kept_input_bytes(case)


def _attention_core(case: ActivationCase, recompute: str) -> int:
    """q, k, v, what the attention kernel keeps, and the output projection's input."""
    s, b, h, a = case.seq_length, case.micro_batch_size, case.hidden_size, case.num_attention_heads
    t, e = case.tp, case.e
    sbh_t, as2b_t = s * b * h // t, a * s * s * b // t
    qkv_out = 3 * e * sbh_t  # the QKV output: q, k, v are views of it
    context = e * sbh_t  # the output projection's input
    if recompute == "selective":
        return qkv_out + context  # the checkpoint keeps its inputs, the output is kept anew
    kind = attention_kernel(case)
    if kind == "flash":  # output shared with the projection's input; fp32 log-sum-exp
        return qkv_out + context + 4 * a * s * b // t
    if kind == "math16":  # probabilities in 16 bits; the output is copied for the projection
        return qkv_out + e * as2b_t + context
    if kind == "flash_fp32":  # fp32 q, k, v and output, the log-sum-exp; the 16-bit output
        return 4 * 4 * sbh_t + 4 * a * s * b // t + context
    # MATH in fp32 with dropout: scaled q, k, v, probabilities, mask, dropped probabilities.
    return 3 * 4 * sbh_t + 3 * 4 * as2b_t + context


def tp_comm_bytes(case: ActivationCase) -> int:
    """The largest tensor-parallel collective in flight: sequence parallelism's all-gather (a
    shard in, the whole ``[s, b, h]`` out); else tensor parallelism's all-reduce of an
    ``[s, b, h]`` in place, or ``partition_activations``' all-gather of a kept input's pieces
    before its recompute (the pieces padded to a multiple of tp), whichever is larger."""
    sbh, t = case.seq_length * case.micro_batch_size * case.hidden_size, case.tp
    if t == 1:
        return 0
    if case.sp:
        return case.e * (sbh + sbh // t)
    if case.recompute == "full" and case.partition_activations:
        piece = -(-sbh // t)
        return case.e * max(sbh, piece + piece * t)
    return case.e * sbh


def chunk_layers_bytes(case: ActivationCase, layers: int) -> int:
    """What ``layers`` consecutive transformer layers (one pipeline chunk's, or the model's)
    keep for one micro-batch. Full recompute counts per chunk, as zerotron's stages and
    Megatron's do: ``uniform`` keeps one input per unit of ``recompute_num_layers`` layers,
    ``block`` the inputs of the first ``recompute_num_layers`` layers and everything of the
    rest."""
    if case.recompute != "full":
        return layers * layer_bytes(case)
    units = checkpointed_units(case, layers)
    if case.recompute_method == "block":  # the first units layers alone, the rest whole
        return units * layer_bytes(case) + (layers - units) * layer_bytes(case, recompute="none")
    return units * layer_bytes(case)  # one input per unit


def recompute_workspace(case: ActivationCase, layers: int = 1) -> int:
    """Full recompute: what backward rebuilds at once, one checkpointed unit of a chunk of
    ``layers`` layers (``uniform``: up to ``recompute_num_layers`` layers; ``block``: one)."""
    if case.recompute != "full":
        return 0
    n = case.recompute_num_layers
    if case.recompute_method == "block":
        unit = 0 if n == 0 else 1
    else:
        unit = min(layers, n or 1)
    # the unit's input made whole on the device again: gathered from its pieces, or back from
    # the host (without either, the kept input itself is counted in the activations)
    sbh = case.seq_length * case.micro_batch_size * case.hidden_size
    split = case.partition_activations and case.tp > 1 and not case.sp
    restored = case.e * sbh // (case.tp if case.sp else 1) if split or case.inputs_on_host else 0
    return unit * layer_bytes(case, recompute="none") + (restored if unit else 0)


def embedding_bytes(case: ActivationCase) -> int:
    """The first stage's input per micro-batch: the token and position ids (int64; ``zerotron
    pretrain``'s batches carry position ids) and the embedding dropout's mask."""
    s, b, h = case.seq_length, case.micro_batch_size, case.hidden_size
    mask = 1 if case.device != "cpu" else case.e
    total = 2 * 8 * s * b
    if case.hidden_dropout > 0:
        total += mask * s * b * h // (case.tp if case.sp else 1)
    return total


def head_bytes(case: ActivationCase) -> int:
    """The last stage's final LayerNorm, output layer and loss per micro-batch (activations kept
    for backward; the fused loss's own buffers are :func:`loss_workspace`)."""
    s, b, h, t, e = case.seq_length, case.micro_batch_size, case.hidden_size, case.tp, case.e
    sb = s * b
    stats = 4 if case.device != "cpu" else e
    shard = t if case.sp else 1
    total = (e * sb * h + 2 * stats * sb) // shard  # the final LayerNorm's input, statistics
    total += e * sb * h  # the output layer's input (all-gathered under SP)
    total += 8 * sb + 4 * sb  # the labels; the loss mask (fp32) the mean is weighted by
    if t > 1:  # vocab-parallel loss: this rank's logits, made fp32, become the saved softmax
        total += 4 * sb * case.padded_vocab_size // t + sb  # and the "outside" mask
    elif case.device != "cpu":  # F.cross_entropy over fp32 logits keeps their log-softmax
        total += 4 * sb * case.vocab_size
    return total


def loss_workspace(case: ActivationCase, in_flight: int = 1) -> int:
    """The loss's own buffers on the last stage.

    CPU at TP=1 (the fused loss, :mod:`~zerotron.kernels.fused_cross_entropy`): the input's and
    the tied weight's gradients are computed in forward and held until backward (``in_flight``
    micro-batches' worth), plus the reused chunk buffers: fp32 logits of one chunk (rows padded
    to 64 elements in fp32), and as the kernel choices say (``case.kernels``): fp32 with
    ``linear=onednn``, one vocabulary slice of ``loss_chunk`` columns; 16-bit, the chunk's
    16-bit logits and, with ``matmul16=native``, a transposed ``[h, V]`` gradient sum, with
    ``matmul16=fp32``, the weight's fp32 copy and an fp32 ``[V, h]`` gradient sum.
    CUDA at TP=1: the 16-bit and fp32 logits of one micro-batch while the loss is formed.
    TP > 1: the vocab-parallel loss works in place in its logits (counted as activations).
    """
    from zerotron.kernels.fused_cross_entropy import default_chunk_size, padded_row_stride

    s, b, h, e = case.seq_length, case.micro_batch_size, case.hidden_size, case.e
    tokens, v, k = s * b, case.vocab_size, case.kernels
    if case.tp > 1:
        return 0
    if case.device != "cpu":
        return (e + 4) * tokens * v
    held = in_flight * e * (tokens * h + case.padded_vocab_size * h)
    rows = min(default_chunk_size(tokens, v), tokens)
    if e == 4:
        chunk = 4 * rows * padded_row_stride(v)
        if k.linear == "onednn":
            chunk += 4 * rows * min(k.loss_chunk, v)
        return held + chunk
    chunk = 4 * rows * v + e * rows * v
    chunk += 2 * 4 * v * h if k.matmul16 == "fp32" else e * h * v
    return held + chunk


def stage_in_flight(kind: str, p: int, m: int, v: int, stage: int) -> int:
    """(micro-batch, chunk) activations pipeline stage ``stage`` holds at most, by zerotron's
    schedule ``kind`` (``"1f1b"``, ``"interleaved"``, ``"gpipe"``); 1 without a pipeline."""
    if p == 1:
        return 1
    return _in_flight(kind, p, saturated(p, m, v), v)[stage]


def chunk_in_flight(kind: str, p: int, m: int, v: int, stage: int, chunk: int) -> int:
    """Micro-batches of model chunk ``chunk`` that stage ``stage`` holds at most: what the
    embedding (chunk 0 of the first stage) and the head (last chunk of the last stage) keep."""
    if p == 1:
        return 1
    return _chunk_in_flight(kind, p, saturated(p, m, v), v)[stage][chunk]


def saturated(p: int, m: int, v: int) -> int:
    """Micro-batches enough to reach every stage's peak: warm-up and the first steady cycles
    fit in ``p(2v + 1)`` (a multiple of p, as the interleaved schedule needs), so longer
    schedules are not built (tests/test_estimate.py checks the peaks do not move)."""
    return min(m, p * (2 * v + 1))


@lru_cache(maxsize=256)
def _in_flight(kind: str, p: int, m: int, v: int) -> tuple[int, ...]:
    return tuple(activations_in_flight(build_schedule(kind, p, m, v)))


@lru_cache(maxsize=256)
def _chunk_in_flight(kind: str, p: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    peaks = []
    for actions in build_schedule(kind, p, m, v):
        held, peak = [0] * v, [0] * v
        for a in actions:
            if isinstance(a, Forward):
                held[a.chunk] += 1
                peak[a.chunk] = max(peak[a.chunk], held[a.chunk])
            elif isinstance(a, Backward):
                held[a.chunk] -= 1
        peaks.append(tuple(peak))
    return tuple(peaks)


# ---- the paper's accounting --------------------------------------------------------------


def paper_layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Korthikanti et al. 2022's activation bytes of one layer and micro-batch (module
    docstring), 16-bit activations and 1-byte dropout masks."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attention)
    if recompute == "selective":
        return sbh * (10 + 24 / t)
    return sbh * (10 + 24 / t + attention / t)


def paper_interleave_factor(p: int, v: int) -> float:
    """The interleaved schedule's extra activations on the first stage: ``1 + (p-1)/(pv)``."""
    return 1 + (p - 1) / (p * v)


def paper_first_stage_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    num_layers: int,
    t: int = 1,
    p: int = 1,
    v: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """The first pipeline stage's transformer activations in the paper: p micro-batches of its
    L/p layers in flight (L layers' worth), times the interleaving factor when ``v > 1``."""
    per_layer = paper_layer_bytes(s, b, h, a, t, sequence_parallel, recompute)
    factor = paper_interleave_factor(p, v) if v > 1 else 1.0
    return per_layer * num_layers * factor
