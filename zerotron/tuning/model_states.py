"""Model states of one zerotron rank: parameters, gradients, fp32 masters, optimizer states, and
the buffers that move gradients and parameters (buckets, ZeRO's gathers), from the parameter
sizes alone.

The per-element byte counts are :mod:`~zerotron.tuning.zero_memory`'s (the ones that reproduce
DeepSpeed's tables); what each stage keeps is zerotron's (``e``: bytes of the parameters'
dtype, Ψ: this rank's parameters, N: data-parallel size, S: optimizer bytes per element):

- ZeRO-0 (:mod:`~zerotron.precision.mixed`, :mod:`~zerotron.parallel.data_parallel`): ``eΨ``
  parameters; gradients accumulate in fp32 (``main_grad``, the data-parallel buckets): ``4Ψ``;
  16-bit parameters have fp32 masters ``4Ψ``; ``SΨ`` states. Buckets all-reduce 16-bit
  gradients in 16 bits: a wire copy of every bucket may be in flight (``eΨ``).
- ZeRO-1: full gradients in the parameters' dtype through the accumulation (``eΨ``, reduced on
  the last micro-batch), at the step the rank's partition (``G`` below): the larger counts;
  masters and states ``(4 + S)Ψ/N`` (fp32 masters even for fp32 parameters: the partitions are
  flat fp32 tensors).
- ZeRO-2: gradients reduce-scattered every micro-batch into the partition ``G``: ``eΨ/N`` in the
  parameters' dtype, plus the fp32 copy of one piece (2M elements) the step works on; ``4Ψ/N``
  where it must be fp32 (fp16's unscaling, offload, ZeRO-3 with more than one micro-batch);
  masters and states as stage 1.
- ZeRO-3: a partitioned parameter's shard *is* its fp32 master's chunk (no 16-bit copy) unless
  something is offloaded; parameters of at most ``param_persistence_threshold`` elements stay
  whole (``e`` each), and so do, while gathered, two modules at once (backward fetches the next
  before it lets the last go) and the tied embedding for the whole pass; with a
  ``max_reuse_distance``, also every module kept from its forward to its backward (its next
  use: the modules after it twice, forward and backward, plus the tied embedding's backward
  fetch, fewer elements than the distance); gradients, masters, states as stage 2.
- ZeRO-1/2 buffers: each reduce bucket is packed rank-major in the wire dtype and its row comes
  back (``e(1 + 1/N)`` per element), and buckets launch while backward goes on, so at the end of
  backward all of them may be in flight (``eΨ(1 + 1/N)``); the all-gather of updated chunks
  after the step uses the same amount. ZeRO-3: the same for its (smaller) reduce buckets.
- Offload: ``offload_optimizer`` moves masters and states to the host (``cpu``; ``nvme``: to
  files, nothing counted), where the step also takes a copy of the fp32 gradient partition (the
  device keeps its fp32 partition); ``offload_param`` (stage 3) the shards. Not checked against
  a measurement (on CPU ranks host and device are one memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.parallel.data_parallel import default_bucket_size
from zerotron.tuning.zero_memory import FP32, OPTIMIZER_STATES
from zerotron.zero.masters import STEP_PIECE
from zerotron.zero.options import default_sizes


def reuse_split(
    modules: list[list[int]], external: int, threshold: int, max_reuse_distance: int
) -> tuple[list[int], list[int], int]:
    """ZeRO-3's gathered elements per module (those of more than ``threshold`` elements; in
    forward order) split into ``(kept, released, tied)``: the modules kept gathered from their
    forward to their backward under ``max_reuse_distance``, the modules released after each
    use, and the tied weight read outside its module (``external``), gathered for the whole
    pass. A module's next use comes after the modules that follow it, fetched twice (forward
    and backward), and the tied weight's backward fetch."""
    sizes = [sum(x for x in m if x > threshold) for m in modules]
    tied = external if external > threshold else 0
    if external:
        sizes.remove(tied)
    kept: list[int] = []
    released: list[int] = []
    after = 0
    for size in reversed(sizes):
        if max_reuse_distance and 2 * after + tied < max_reuse_distance:
            kept.append(size)
        else:
            released.append(size)
        after += size
    return kept, released, tied


@dataclass(frozen=True)
class StateBytes:
    """One rank's model states and their buffers, in bytes."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    comm_buffers: int
    host: int


def model_state_bytes(
    modules: list[list[int]],
    *,
    precision: str,
    zero_stage: int,
    dp: int,
    optimizer: str = "adam",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    ddp_bucket_size: int | None = None,
    reduce_bucket_size: int | None = None,
    allgather_bucket_size: int = 500_000_000,
    param_persistence_threshold: int = 100_000,
    reduce_in_fp32: bool = False,
    num_microbatches: int = 1,
    external: int = 0,
    max_reuse_distance: int = 0,
) -> StateBytes:
    """Model-state bytes of a rank whose parameters are ``modules`` (per module, the element
    counts of its own parameters, as ZeRO-3 gathers them; ``external``: the elements of a module
    read outside it, the tied embedding, gathered for the whole pass); see the module
    docstring."""
    e = 4 if precision == "fp32" else 2
    s = OPTIMIZER_STATES[optimizer]
    numels = [n for module in modules for n in module]
    psi = sum(numels)
    n = dp
    if zero_stage == 0:
        bucket = ddp_bucket_size or default_bucket_size(n)
        wire = 0
        if n > 1 and e == 2 and not reduce_in_fp32:
            wire = e * psi  # every bucket's 16-bit copy, launched while backward goes on
        del bucket  # buckets split Ψ; all may be in flight, so their size does not matter
        masters = FP32 * psi if e == 2 else 0
        return StateBytes(e * psi, FP32 * psi, masters, s * psi, wire, 0)

    part = sum(-(-x // n) for x in numels)  # this rank's chunks (padded)
    reduce_bucket, _ = default_sizes(zero_stage, reduce_bucket_size, None)
    # The partition holds the parameters' dtype, fp32 where it must: fp16 unscales an fp32
    # copy, offload steps fp32 on the host, and stage 3 sums a second micro-batch in fp32.
    wide = precision == "fp16" or offload_optimizer != "none"
    wide = wide or (zero_stage == 3 and num_microbatches > 1)
    if wide:
        grads_step = FP32 * part
    else:  # the step takes a piece at a time to fp32 (zero.masters.step_in_pieces)
        grads_step = e * part + (FP32 * min(part, STEP_PIECE) if e < FP32 else 0)
    grads = max(e * psi, grads_step) if zero_stage == 1 else grads_step
    masters, states = FP32 * part, s * part
    host = 0
    if offload_optimizer == "cpu":
        host += masters + states + grads_step
    if offload_optimizer != "none":  # the fp32 partition stays too: the host steps a copy
        masters = states = 0

    if zero_stage < 3:
        comm = max(e * psi, e * min(psi, allgather_bucket_size)) * (n + 1) // n
        return StateBytes(e * psi, grads, masters, states, comm, host)

    big = param_persistence_threshold
    persistent = sum(x for x in numels if x <= big)
    shard_part = sum(-(-x // n) for x in numels if x > big)
    # Gathered whole: a module's parameters around its forward and backward, and the next
    # module's before the last is released (two at once); a tied weight the model reads
    # outside its module (``external``) for the whole pass.
    kept, released, tied = reuse_split(modules, external, big, max_reuse_distance)
    gathered = sum(kept) + 2 * max(released, default=0) + tied
    params = e * (persistent + gathered)
    if offload_param == "cpu":
        host += e * shard_part
    elif offload_param == "none" and offload_optimizer != "none":
        params += e * shard_part  # shards apart from the (moved) masters
    comm = e * psi * (n + 1) // n  # every reduce bucket may be in flight (as stages 1-2)
    del reduce_bucket
    return StateBytes(params, grads, masters, states, comm, host)
