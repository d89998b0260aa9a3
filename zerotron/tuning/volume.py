"""Bytes every rank communicates in one training step, in closed form, per ``(group, op)``.

These are the sizes :mod:`zerotron.distributed.comm` records in its ledger (the logical
operation: an all-reduce of the tensor, an all-gather of this rank's shard, a reduce-scatter of
the full input, a send of the tensor), so ``bench/comm_volume.py`` checks them against measured
ledgers byte for byte, and the planner's cost model (:mod:`~zerotron.tuning.cost`) turns them
into seconds with :func:`wire_bytes` and a bandwidth.

Per micro-batch, with ``a = b·s·h`` activation elements (b micro-batch, s sequence, h hidden):

- TP: 4 all-reduces of a per layer (2 forward, 2 backward), the vocab-parallel embedding's
  forward all-reduce on the stage holding it, the LM head's input-gradient all-reduce and the
  vocab-parallel cross entropy's 3 all-reduces of b·s fp32 on the stage holding the head; full
  recompute repeats the 2 forward all-reduces of each layer. Under sequence parallelism each
  all-reduce of a becomes an all-gather of the b·(s/tp)·h shard and a reduce-scatter of a, and
  once per step the sequence-parallel parameters' gradients (LayerNorms, row-parallel biases,
  position table) are all-reduced over TP.
- PP: per boundary between consecutive virtual stages, the activation forward and its gradient
  backward (a, or a/tp under SP); once per step the tied word embedding's gradient all-reduced
  over the first and last stage. These are steady-state steps: a runtime's first training step
  (and every step with ``variable_seq_lengths``) also sends a shape header of
  :data:`~zerotron.pipeline.HEADER_BYTES` before each activation, m per boundary, which
  :func:`shape_header_terms` gives.
- DP, once per step: the rank's gradients all-reduced (ZeRO 0); reduce-scattered and the
  updated parameters all-gathered (ZeRO 1, and ZeRO 2 whose reduce-scatter runs every
  micro-batch); ZeRO 3 gathers the parameters before forward and again before backward (the
  recomputed forward's gather serves its backward; with ``max_reuse_distance``, what stays
  gathered from the forward is not gathered again) and reduce-scatters the gradients, every
  micro-batch (from the second step on: the first records the orders the reuse plan needs).

Not counted: the optimizer step's grad-norm scalars and the loss average (a few bytes), and
ZeRO-3's persistent small parameters (gathered once, a rounding error at planning scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.pipeline import HEADER_BYTES
from zerotron.tuning.estimate import Layout, ModelShape, stage_modules, tied_external
from zerotron.tuning.model_states import reuse_split

FP32 = 4
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Term:
    """Bytes and calls of one ``(group, op)`` contribution to one rank's step.

    ``nbytes`` and ``calls`` cover the whole step (all micro-batches). ``main`` marks the
    headline terms (TP's 4 all-reduces per layer, the pipeline's activations and gradients,
    DP's gradients). ``phase`` says where the time goes: ``"forward"`` or ``"backward"`` of each
    micro-batch, or ``"step"`` (once, after the pipeline drains).
    """

    group: str
    op: str
    nbytes: int
    calls: int
    what: str
    main: bool = False
    phase: str = "step"


def chunk_layers(shape: ModelShape, layout: Layout, pp_rank: int) -> list[tuple[int, bool, bool]]:
    """(layers, holds the embedding, holds the head) of each model chunk on ``pp_rank``
    (uniform split over ``pp * vpp`` virtual stages)."""
    parts = layout.pp * layout.vpp
    out = []
    for chunk in range(layout.vpp):
        vs = chunk * layout.pp + pp_rank
        out.append((shape.num_layers // parts, vs == 0, vs == parts - 1))
    return out


def rank_parameters(shape: ModelShape, layout: Layout, pp_rank: int) -> int:
    """Parameters held by the rank at ``pp_rank`` (its TP shard; the tied copy of the word
    embedding on the last stage included when the pipeline splits them)."""
    tp, h = layout.tp, shape.hidden_size
    words = shape.padded_vocab(tp) // tp * h
    count = 0
    for n, pre, post in chunk_layers(shape, layout, pp_rank):
        count += n * shape.layer_parameters(tp)
        if pre:
            count += shape.embedding_parameters(tp)
        if post:
            separate_head = not shape.tied_embeddings or layout.pp > 1
            count += 2 * h + (words if separate_head else 0)
    return count


def step_terms(shape: ModelShape, layout: Layout, pp_rank: int) -> list[Term]:
    """Every ``(group, op)`` term of one steady-state step on a rank at ``pp_rank`` (every TP
    and DP rank of a stage moves the same bytes; a pipeline's first step adds
    :func:`shape_header_terms`). Activations travel in ``layout.precision``; gradients too
    (zerotron casts its fp32 buckets to the parameters' 16-bit dtype for the wire)."""
    el = ELEMENT_BYTES[layout.precision]
    b, s, h = layout.micro_batch_size, shape.seq_length, shape.hidden_size
    m, tp = layout.num_microbatches, layout.tp
    a, bs = b * s * h * el, b * s * FP32
    chunks = chunk_layers(shape, layout, pp_rank)
    layers = sum(n for n, _, _ in chunks)
    emb = sum(pre for _, pre, _ in chunks)
    head = sum(post for _, _, post in chunks)
    refwd = layers if layout.recompute == "full" else 0  # forward all-reduces done again
    terms: list[Term] = []
    if tp > 1:
        if layout.sequence_parallel:
            shard = a // tp
            for n, what, main, phase in (
                (2 * layers, "2/layer forward", True, "forward"),
                (2 * layers, "2/layer backward", True, "backward"),
                (refwd * 2, "recompute forward", False, "backward"),
                (emb, "embedding fwd rs, bwd ag", False, "forward"),
                (head, "LM head fwd ag, bwd rs", False, "backward"),
            ):
                if n:
                    terms.append(Term("tp", "all_gather", n * m * shard, n * m, what, main, phase))
                    terms.append(Term("tp", "reduce_scatter", n * m * a, n * m, what, main, phase))
            sp_params = layers * 6 * h + head * 2 * h + emb * shape.positions * h
            terms.append(Term("tp", "all_reduce", sp_params * el, 1, "SP grads (LN, biases)"))
        else:
            for n, what, main, phase in (
                (2 * layers, "2/layer forward", True, "forward"),
                (2 * layers, "2/layer backward", True, "backward"),
                (2 * refwd, "recompute forward", False, "backward"),
                (emb, "embedding fwd", False, "forward"),
                (head, "LM head bwd", False, "backward"),
            ):
                if n:
                    terms.append(Term("tp", "all_reduce", n * m * a, n * m, what, main, phase))
        if head:
            terms.append(
                Term(
                    "tp",
                    "all_reduce",
                    3 * m * bs,
                    3 * m,
                    "vocab-parallel CE 3×b·s",
                    phase="forward",
                )
            )
    if layout.pp > 1:
        act = a // tp if layout.sequence_parallel else a
        last = layout.pp * layout.vpp - 1
        for chunk in range(layout.vpp):
            vs = chunk * layout.pp + pp_rank
            if vs < last:  # activation out, its gradient in
                terms.append(Term("pp", "send", m * act, m, "activation", True, "forward"))
                terms.append(Term("pp", "recv", m * act, m, "gradient", True, "backward"))
            if vs > 0:  # activation in, input gradient out
                terms.append(Term("pp", "recv", m * act, m, "activation", True, "forward"))
                terms.append(Term("pp", "send", m * act, m, "gradient", True, "backward"))
        if shape.tied_embeddings and pp_rank in (0, layout.pp - 1):
            words = shape.padded_vocab(tp) // tp * h * el
            terms.append(Term("embedding", "all_reduce", words, 1, "tied embedding grad"))
    if layout.dp > 1:
        kept = 0
        if layout.zero_stage == 3 and layout.max_reuse_distance:
            kept = _kept_from_forward(shape, layout, pp_rank)
        terms += _dp_terms(rank_parameters(shape, layout, pp_rank), layout, el, kept)
    return terms


def _kept_from_forward(shape: ModelShape, layout: Layout, pp_rank: int) -> int:
    """ZeRO-3 parameter elements the reuse distance keeps gathered from forward to backward
    (every parameter counted as gathered, as the terms below count them)."""
    modules = stage_modules(shape, layout.tp, layout.pp, pp_rank)
    kept, _, tied = reuse_split(modules, tied_external(shape, layout), 0, layout.max_reuse_distance)
    return sum(kept) + tied


def shape_header_terms(layout: Layout, pp_rank: int) -> list[Term]:
    """What a header-sending pipeline step adds to :func:`step_terms` on ``pp_rank``: one
    :data:`~zerotron.pipeline.HEADER_BYTES` shape header ahead of each activation, per boundary
    between consecutive virtual stages. The runtime sends them at its first training step (and
    first eval step), and at every step with ``variable_seq_lengths``; later steps keep the
    shapes they learned."""
    m, last = layout.num_microbatches, layout.pp * layout.vpp - 1
    terms: list[Term] = []
    if layout.pp == 1:
        return terms
    for chunk in range(layout.vpp):
        vs = chunk * layout.pp + pp_rank
        if vs < last:
            terms.append(Term("pp", "send", m * HEADER_BYTES, m, "shape header", False, "forward"))
        if vs > 0:
            terms.append(Term("pp", "recv", m * HEADER_BYTES, m, "shape header", False, "forward"))
    return terms


def _dp_terms(psi: int, layout: Layout, el: int, kept: int = 0) -> list[Term]:
    """Data-parallel traffic of ``psi`` parameters under ``layout.zero_stage`` (``kept``: ZeRO-3
    elements kept gathered from forward to backward, not gathered again)."""
    n, m, stage = layout.dp, layout.num_microbatches, layout.zero_stage
    grads, shard = psi * el, -(-psi // n) * el
    if stage == 0:
        return [Term("dp", "all_reduce", grads, 1, "gradients once per step", True)]
    if stage in (1, 2):
        rs_calls = m if stage == 2 else 1  # stage 2 reduce-scatters every micro-batch
        phase = "backward" if stage == 2 else "step"
        return [
            Term("dp", "reduce_scatter", rs_calls * grads, rs_calls, "gradients", True, phase),
            Term("dp", "all_gather", shard, 1, "updated parameters"),
        ]
    # Recompute does not add a gather: the recomputed forward holds the parameters for the
    # backward that follows at once (tests/distributed/test_zero3_params.py).
    again = -(-(psi - kept) // n) * el
    return [
        Term("dp", "all_gather", m * shard, m, "ZeRO-3 parameters before forward", True, "forward"),
        Term(
            "dp",
            "all_gather",
            m * again,
            m if again else 0,
            "ZeRO-3 parameters before backward (those not kept from the forward)",
            True,
            "backward",
        ),
        Term("dp", "reduce_scatter", m * grads, m, "gradients every micro-batch", True, "backward"),
    ]


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """What a ring puts on the wire per rank for a ledger entry of ``nbytes`` (the factors of
    :mod:`zerotron.distributed.comm`): all-reduce 2(n-1)/n, reduce-scatter (n-1)/n of the
    input, all-gather (n-1) shards; a send or receive moves its bytes once."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "reduce_scatter":
        return (n - 1) / n * nbytes
    if op == "all_gather":
        return (n - 1) * nbytes
    return float(nbytes)
