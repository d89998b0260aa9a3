"""Which transformer layers each pipeline stage (or virtual stage) holds.

Pure functions returning *boundaries* ``[0, b1, ..., num_layers]``: part ``k`` holds layers
``boundaries[k]:boundaries[k + 1]``. With virtual stages there are p·v parts, indexed by
virtual stage (model chunk c of stage s is part ``c * p + s``, see
:func:`~zerotron.pipeline.schedules.virtual_stage`). Every part holds at least one
layer. Where the embedding and the LM head go (first and last stage) is the model's business.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from zerotron.errors import ConfigError


def partition_uniform(num_layers: int, num_stages: int, virtual_stages: int = 1) -> list[int]:
    """Equal layer counts; when they do not divide, the earlier parts get one layer more."""
    parts = _num_parts(num_layers, num_stages, virtual_stages)
    size, extra = divmod(num_layers, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + size + (1 if k < extra else 0))
    return bounds


def partition_balanced(
    weights: Sequence[float], num_stages: int, virtual_stages: int = 1
) -> list[int]:
    """Contiguous parts minimizing the heaviest part's total weight (e.g. parameter count).

    Among partitions reaching that minimum, the most even one is returned: the smallest sum of
    squared part weights, then the lexicographically largest boundaries (earlier parts take the
    spare layer, as in :func:`partition_uniform`, which equal weights reproduce).
    """
    parts = _num_parts(len(weights), num_stages, virtual_stages)
    for i, w in enumerate(weights):
        if not (isinstance(w, numbers.Real) and math.isfinite(w) and w >= 0):
            raise ConfigError(
                f"layer weight must be a finite number >= 0, got {w!r}", where=f"weights[{i}]"
            )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    bottleneck = _smallest_bottleneck(prefix, parts)
    return _most_even(prefix, parts, bottleneck)


def stage_layers(boundaries: Sequence[int], stage: int, num_stages: int, chunk: int = 0) -> range:
    """The layers of model chunk ``chunk`` on pipeline stage ``stage``."""
    part = chunk * num_stages + stage
    return range(boundaries[part], boundaries[part + 1])


def virtual_stages_from_layers(
    num_layers: int, num_stages: int, layers_per_virtual_stage: int
) -> int:
    """v for Megatron's ``--num-layers-per-virtual-pipeline-stage``: layers / (p × that)."""
    per_stage, rest = divmod(num_layers, num_stages)
    if rest or layers_per_virtual_stage < 1 or per_stage % layers_per_virtual_stage:
        raise ConfigError(
            f"{num_layers} layers do not split into {num_stages} pipeline stages of chunks of "
            f"{layers_per_virtual_stage} layers",
            where="--num-layers-per-virtual-pipeline-stage",
            fix="choose a value dividing num_layers / pipeline-model-parallel-size"
            + (f" = {per_stage}" if not rest else ""),
        )
    return per_stage // layers_per_virtual_stage


def _num_parts(num_layers: int, num_stages: int, virtual_stages: int) -> int:
    if num_stages < 1 or virtual_stages < 1:
        raise ConfigError(
            f"need at least one stage and one virtual stage, got {num_stages} and {virtual_stages}"
        )
    parts = num_stages * virtual_stages
    if num_layers < parts:
        what = f"{num_stages} pipeline stages" + (
            f" × {virtual_stages} virtual stages = {parts} parts" if virtual_stages > 1 else ""
        )
        raise ConfigError(
            f"{num_layers} layers cannot fill {what}: some stage would hold no layer",
            fix=f"use at most {num_layers} pipeline stages (× virtual stages), or more layers",
        )
    return parts


def _parts_needed(prefix: list[float], limit: float) -> int:
    """Fewest contiguous parts with total weight <= ``limit`` each (greedy is optimal)."""
    count, start = 1, 0
    for end in range(1, len(prefix)):
        if prefix[end] - prefix[end - 1] > limit:
            return len(prefix)  # one layer alone is over the limit: infeasible
        if prefix[end] - prefix[start] > limit:
            count, start = count + 1, end - 1
    return count


def _smallest_bottleneck(prefix: list[float], parts: int) -> float:
    # The optimum is the weight of some contiguous run; binary search those values.
    n = len(prefix) - 1
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(prefix, sums[mid]) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return sums[lo]


def _most_even(prefix: list[float], parts: int, limit: float) -> list[int]:
    """Boundaries with every part <= ``limit`` minimizing the sum of squared part weights."""
    n = len(prefix) - 1
    # best[k][i]: (cost, first cut) of splitting layers i..n into k parts, or None.
    best: list[list[tuple[float, int] | None]] = [[None] * (n + 1) for _ in range(parts + 1)]
    best[0][n] = (0, n)
    for k in range(1, parts + 1):
        for i in range(n - k, -1, -1):
            choice = None
            for j in range(n - k + 1, i, -1):  # largest cut first: it wins ties
                part = prefix[j] - prefix[i]
                if part > limit:
                    continue
                rest = best[k - 1][j]
                if rest is not None and (choice is None or part * part + rest[0] < choice[0]):
                    choice = (part * part + rest[0], j)
            best[k][i] = choice
    bounds, i = [0], 0
    for k in range(parts, 0, -1):
        i = best[k][i][1]
        bounds.append(i)
    return bounds
