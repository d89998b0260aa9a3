"""The layout planner: every valid layout of a model on a cluster, what fits, ranked by speed.

    from zerotron.tuning.plan import SearchSpace, plan
    from zerotron.tuning.cost import cluster
    from zerotron.tuning.estimate import ModelShape
    result = plan(ModelShape.gpt2("1.5B"), cluster("a100-80gb"), global_batch=512)
    result.best.layout, result.best.cost.step_time, result.ranked[1].why

:func:`layouts` enumerates dp × tp × pp × virtual stages × sequence parallelism × ZeRO stage ×
micro-batch × recompute, keeping only what zerotron would run: tp divides the heads (and the
MLP width), pp·vpp divides the layers, the global batch splits into whole micro-batches per
data-parallel rank, interleaving needs a multiple of pp micro-batches, ZeRO 2 and 3 are not
combined with pipelining (as in DeepSpeed and zerotron's engine), sequence parallelism needs
tp > 1 and a sequence divisible by tp. Recompute is none, selective or full, and full also in
Megatron's ``block`` method, which recomputes only the first N layers of each chunk and keeps
everything of the rest: where a layout does not fit without recompute, the planner keeps the
block layout with the fewest N that fit (N = 1 first, then a bisection over N), the fastest of
that family.

:func:`plan` asks the estimator (:func:`~zerotron.tuning.estimate.estimate`) whether each fits
the GPU's memory, predicts every layout's step (:func:`~zerotron.tuning.cost.predict`), ranks
those that fit by step time (ties: less memory first), and says why each runner-up lost to the
best: the part of its step that grew the most, or "does not fit".
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

from zerotron.errors import ConfigError
from zerotron.tuning.cost import Cluster, StepCost, predict, simulable
from zerotron.tuning.estimate import Layout, MemoryBreakdown, ModelShape, estimate

GB = 2**30


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose from (each a tuple of allowed values)."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_micro_batch_size: int = 64
    max_virtual_stages: int = 8
    tp: tuple[int, ...] | None = None  # None: every divisor that is valid
    pp: tuple[int, ...] | None = None
    precision: str = "bf16"
    tp_within_node: bool = False  # True: never let a TP group span nodes
    flash_attention: bool = True  # False: attention materializes its scores (Megatron 2021)
    recompute_blocks: bool = True  # with "full": also block recompute of as few layers as fit


@dataclass
class Candidate:
    """One layout: its memory, its predicted step, and (after ranking) why it lost."""

    layout: Layout
    memory: MemoryBreakdown
    cost: StepCost
    fits: bool
    why: str = ""
    ties: int = 0  # layouts as fast as this one that use more memory (see Plan.distinct)

    def as_dict(self) -> dict:
        """JSON-ready: layout, memory terms, predicted times, the reason it lost."""
        return {
            "layout": asdict(self.layout) | {"world_size": self.layout.world_size},
            "fits": self.fits,
            "memory": self.memory.as_dict(),
            "step_time_s": self.cost.step_time,
            "tflops_per_gpu": self.cost.tflops_per_gpu,
            "model_tflops_per_gpu": self.cost.model_tflops_per_gpu,
            "bubble_fraction": self.cost.bubble_fraction,
            "breakdown_s": self.cost.breakdown(),
            "crosses_nodes": self.cost.crosses,
            "why": self.why,
            "as_fast_with_more_memory": self.ties,
        }


@dataclass
class Plan:
    """What :func:`plan` found: fitting layouts fastest first, and those that do not fit."""

    shape: ModelShape
    cluster: Cluster
    global_batch: int
    ranked: list[Candidate] = field(default_factory=list)
    rejected: list[Candidate] = field(default_factory=list)
    skipped: int = 0  # layouts whose lower bound could not enter the top: not evaluated

    @property
    def best(self) -> Candidate:
        """The fastest layout that fits; raises :class:`ConfigError` when none does."""
        if not self.ranked:
            raise self.no_fit_error()
        return self.ranked[0]

    def no_fit_error(self) -> ConfigError:
        """What to say when no layout fits."""
        return ConfigError(
            f"no layout of this model fits in {self.cluster.gpu_memory / GB:.0f} GB per GPU "
            f"on {self.cluster.world_size} GPUs",
            where="zerotron plan",
            fix="more GPUs or nodes, more memory per GPU, a smaller model, or allow "
            "recompute / ZeRO stages",
        )

    def faster_but_too_big(self) -> list[Candidate]:
        """Layouts predicted faster than the best that do not fit, fastest first."""
        limit = self.best.cost.step_time if self.ranked else float("inf")
        return [
            c
            for c in self.rejected
            if c.cost.step_time < limit and not _same(c.cost.step_time, limit)
        ]

    def distinct(self) -> list[Candidate]:
        """The fitting layouts with one per predicted step time: of layouts as fast as each
        other (within a millionth), the one using the least memory (its ``ties`` counts the
        others)."""
        out = []
        for group in _tie_groups(self.ranked):
            group[0].ties = len(group) - 1
            out.append(group[0])
        return out


def _tie_groups(ranked: list[Candidate]) -> list[list[Candidate]]:
    """``ranked`` (sorted by step time) cut into runs as fast as their first, each run sorted
    by memory."""
    groups: list[list[Candidate]] = []
    for cand in ranked:
        if groups and _same(cand.cost.step_time, groups[-1][0].cost.step_time):
            groups[-1].append(cand)
        else:
            groups.append([cand])
    return [sorted(g, key=lambda k: k.memory.total) for g in groups]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    shape: ModelShape, world_size: int, global_batch: int, space: SearchSpace, gpus_per_node: int
) -> Iterator[Layout]:
    """Every valid layout of ``shape`` on ``world_size`` ranks for ``global_batch`` sequences."""
    for tp in _divisors(world_size):
        if space.tp is not None and tp not in space.tp:
            continue
        if shape.num_attention_heads % tp or shape.ffn % tp:
            continue
        if space.tp_within_node and (tp > gpus_per_node or gpus_per_node % tp):
            continue
        for pp in _divisors(world_size // tp):
            if space.pp is not None and pp not in space.pp:
                continue
            if shape.num_layers % pp:
                continue
            dp = world_size // (tp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            b = 1
            while b <= min(per_rank, space.max_micro_batch_size):
                if per_rank % b == 0:
                    yield from _variants(shape, tp, pp, dp, b, per_rank // b, space)
                b *= 2


def _variants(
    shape: ModelShape, tp: int, pp: int, dp: int, b: int, m: int, space: SearchSpace
) -> Iterator[Layout]:
    per_stage = shape.num_layers // pp
    vpps = [1]
    if pp > 1 and m % pp == 0:
        vpps += [
            v
            for v in _divisors(per_stage)
            if 1 < v <= space.max_virtual_stages and simulable(pp, v)
        ]
    sps = [sp for sp in space.sequence_parallel if not sp or shape.seq_length % tp == 0]
    if tp == 1:
        sps = [False]
    stages = [z for z in space.zero_stages if (z == 0 or dp > 1) and (z < 2 or pp == 1)]
    for vpp in vpps:
        for sp in dict.fromkeys(sps):
            for zero in stages:
                for rc in space.recompute:
                    layout = Layout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        vpp=vpp,
                        sequence_parallel=sp,
                        zero_stage=zero,
                        micro_batch_size=b,
                        num_microbatches=m,
                        recompute=rc,
                        precision=space.precision,
                    )
                    yield layout
                    if rc == "full" and space.recompute_blocks and per_stage // vpp > 1:
                        # the fastest of its family; plan() moves on to more layers if needed
                        yield replace(layout, recompute_method="block", recompute_num_layers=1)


def _block_that_fits(
    shape: ModelShape,
    layout: Layout,
    device_bytes: int,
    memory: Callable[[Layout], MemoryBreakdown],
) -> Layout | None:
    """The block-recompute layout of ``layout``'s family with the fewest recomputed layers per
    chunk that fits (memory falls and time grows with their number), more than ``layout``'s and
    fewer than the chunk's (recomputing all of them is the ``uniform`` layout); None if none."""
    chunk = shape.num_layers // (layout.pp * layout.vpp)
    lo, hi = (layout.recompute_num_layers or 1) + 1, chunk - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = replace(layout, recompute_num_layers=mid)
        if memory(trial).fits(device_bytes):
            found, hi = trial, mid - 1
        else:
            lo = mid + 1
    return found


MemoryFn = Callable[[ModelShape, Layout], MemoryBreakdown]


def plan(
    shape: ModelShape,
    c: Cluster,
    global_batch: int,
    space: SearchSpace | None = None,
    memory: MemoryFn = estimate,
    top: int = 5,
) -> Plan:
    """Enumerate, estimate, predict and rank (see the module docstring).

    Layouts are predicted first (interleaved ones by a lower bound without pipeline idle,
    simulated only when they could matter) and their memory estimated fastest first, until
    ``top`` layouts that fit are known and the next is slower than all of them: what remains
    cannot enter the top (counted in :attr:`Plan.skipped`). ``top=0`` evaluates every
    layout."""
    space = space or SearchSpace()
    if global_batch < 1:
        raise ConfigError(
            f"global batch size must be positive, got {global_batch}",
            where="--global-batch-size",
        )
    flash = space.flash_attention
    result = Plan(shape, c, global_batch)
    # A heap of (time, index, exact, cost, layout): 1F1B layouts are simulated at once (a few
    # micro-batches suffice); interleaved ones enter with their lower bound and are simulated
    # when they reach the top of the heap.
    heap = []
    for i, layout in enumerate(layouts(shape, c.world_size, global_batch, space, c.gpus_per_node)):
        exact = layout.vpp == 1
        cost = predict(shape, layout, c, flash_attention=flash, bubble=exact)
        heap.append((cost.step_time, i, exact, cost, layout))
    heapq.heapify(heap)
    serial = itertools.count(len(heap))  # unique second keys for layouts pushed later
    memo: dict[Layout, MemoryBreakdown] = {}

    def memory_of(layout: Layout) -> MemoryBreakdown:
        key = memory_key(layout)
        if key not in memo:
            memo[key] = memory(shape, key)
        return memo[key]

    fitting: list[float] = []  # step times of the fitting layouts found, sorted
    while heap:
        time, i, exact, cost, layout = heapq.heappop(heap)
        if top and len(fitting) >= top and time > fitting[top - 1] * (1 + 1e-6):
            result.skipped = len(heap) + 1
            break
        if not exact:
            cost = predict(shape, layout, c, flash_attention=flash)
            heapq.heappush(heap, (cost.step_time, i, True, cost, layout))
            continue
        if layout.recompute_method == "block" and layout.recompute_num_layers == 1:
            plain = replace(
                layout, recompute="none", recompute_method="uniform", recompute_num_layers=None
            )
            if memory_of(plain).fits(c.gpu_memory):
                continue  # it fits without recompute, which is faster: no block is needed
        cand = Candidate(layout, memory_of(layout), cost, memory_of(layout).fits(c.gpu_memory))
        if cand.fits:
            result.ranked.append(cand)
            if not any(_same(cost.step_time, t) for t in fitting):
                bisect.insort(fitting, cost.step_time)  # the top counts distinct times
        else:
            result.rejected.append(cand)
            if layout.recompute_method == "block":
                block = _block_that_fits(shape, layout, c.gpu_memory, memory_of)
                if block is not None:  # slower than this one: it keeps the heap's order
                    more = predict(shape, block, c, flash_attention=flash)
                    heapq.heappush(heap, (more.step_time, next(serial), True, more, block))
    result.ranked.sort(key=lambda k: (k.cost.step_time, k.memory.total))
    result.ranked = [k for group in _tie_groups(result.ranked) for k in group]
    result.rejected.sort(key=lambda k: k.cost.step_time)
    for cand in result.rejected:
        cand.why = f"does not fit: {_gb(cand.memory.total)} > {_gb(c.gpu_memory)}"
    if result.ranked:
        best = result.ranked[0]
        best.why = "fastest"
        for cand in result.ranked[1:]:
            cand.why = why_slower(cand, best)
    return result


def recompute_label(layout: Layout) -> str:
    """``none``, ``selective``, ``full`` (every layer), or ``full (block N)``: the first N
    layers of each chunk (``--recompute-method block --recompute-num-layers N``)."""
    if layout.recompute == "full" and layout.recompute_method == "block":
        return f"full (block {layout.recompute_num_layers})"
    return layout.recompute


def memory_key(layout: Layout) -> Layout:
    """The layout with as few micro-batches as give the same memory: what a pipeline stage
    holds in flight stops growing at m = p (1F1B: min(p - s, m); interleaved: the same for
    every multiple of p), and without a pipeline one micro-batch is in flight. Estimating at
    m = p spares the estimator from building a schedule of thousands of micro-batches."""
    return replace(layout, num_microbatches=min(layout.num_microbatches, layout.pp))


def _same(a: float, b: float) -> bool:
    """As fast: within a millionth (the model's own precision is far coarser)."""
    return abs(a - b) <= 1e-6 * max(a, b)


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def why_slower(cand: Candidate, best: Candidate) -> str:
    """The part of ``cand``'s step that grew the most against ``best``, in words."""
    a, b = cand.cost, best.cost
    if _same(a.step_time, b.step_time):
        return f"as fast; uses more memory ({_gb(cand.memory.total)})"
    parts_a, parts_b = a.breakdown(), b.breakdown()
    part = max(parts_a, key=lambda k: parts_a[k] - parts_b.get(k, 0.0))
    share = parts_a[part] / a.step_time
    lay = cand.layout
    if part == "bubble":
        return (
            f"bubble {share:.1%} (pp {lay.pp}, {lay.num_microbatches} micro-batches, v {lay.vpp})"
        )
    if part == "compute":
        more = a.compute / b.compute - 1
        label = recompute_label(lay)
        if lay.recompute != "none" and label != recompute_label(best.layout):
            return f"{label} recompute: {more:+.1%} compute"
        return f"slowest stage computes {more:+.1%} more"
    crossing = a.crosses.get(part, False)
    names = {
        "tp": "TP all-reduce",
        "pp": "pipeline sends",
        "dp": {0: "DP gradient all-reduce", 1: "ZeRO-1 reduce-scatter/all-gather"}.get(
            lay.zero_stage,
            "ZeRO-2 reduce-scatter every micro-batch"
            if lay.zero_stage == 2
            else "ZeRO-3 parameter all-gathers",
        ),
        "embedding": "tied-embedding all-reduce",
    }
    where = " crosses nodes" if crossing else ""
    return f"{names[part]}{where} ({share:.1%} of step)"
