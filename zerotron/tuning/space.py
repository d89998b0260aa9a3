"""The autotuner's search space: which experiments to run, pure arithmetic (no processes).

DeepSpeed's rules for a DeepSpeed script (``deepspeed/autotuning/autotuner.py``): the ZeRO
stages the config names (an int, a list, or ``"all"``); per stage the micro-batch sizes between
half the largest that fits and the largest (:func:`micro_batch_list`), each with
``gradient_accumulation_steps = max_train_batch_size_per_gpu // mbs``; the memory a stage needs
per GPU from the parameter count (:func:`instantiation_bytes`) plus the profiled activation
memory per sample times the micro-batch. For ``zerotron pretrain`` the global batch stays the
user's and the space is ZeRO stage × tensor-parallel × pipeline-parallel × recompute ×
micro-batch, each point's memory from the estimator (:mod:`zerotron.tuning.estimate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from zerotron.errors import ConfigError
from zerotron.tuning.experiments import Experiment

ZERO_STAGES = (0, 1, 2, 3)
# The pretrain tuner's recompute choices: Megatron's granularities, and "block": full recompute
# of the fewest layers per pipeline chunk that fit (--recompute-method block), as the planner
# proposes it.
RECOMPUTE = ("none", "selective", "full", "block")

# DeepSpeed's default tuning spaces for ZeRO's knobs (fast: false), per stage.
ZERO_KNOBS: dict[int, dict[str, list[Any]]] = {
    0: {},
    1: {"reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_bucket_size": [5e7, 5e8, 1e9]},
    2: {
        "overlap_comm": [True, False],
        "reduce_scatter": [False, True],
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
        "contiguous_gradients": [False, True],
    },
    3: {
        "overlap_comm": [True, False],
        "reduce_scatter": [False, True],
        "reduce_bucket_size": [5e7, 5e8, 1e9],
        "allgather_partitions": [True, False],
        "allgather_bucket_size": [5e7, 5e8, 1e9],
        "contiguous_gradients": [False, True],
    },
}


def zero_stages(value: Any, where: str = "zero_optimization.stage") -> list[int]:
    """The stages a config asks to tune: an int, a list of ints, or ``"all"`` (0, 1, 2, 3)."""
    if value is None:
        return [0]
    if value == "all":
        return list(ZERO_STAGES)
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or v not in ZERO_STAGES for v in values):
        raise ConfigError(
            f"{where}: {value!r} is not a ZeRO stage, a list of them or 'all'",
            fix="use 0, 1, 2, 3, a list such as [1, 2], or 'all'",
        )
    return sorted(set(values))


def instantiation_bytes(
    num_params: int, stage: int, world: int, mp_size: int = 1, fp16: bool = False
) -> float:
    """Bytes per GPU for parameters, gradients and Adam's states at ZeRO ``stage`` —
    DeepSpeed autotuner's own rule (2 or 4 bytes each for parameters and gradients, 16 or 8 for
    the optimizer; stage >= 1 divides the optimizer by the GPUs, >= 2 the gradients, 3 the
    parameters; all divided by the model-parallel size)."""
    params = num_params * (2 if fp16 else 4)
    grads = num_params * (2 if fp16 else 4)
    optim = num_params * (16 if fp16 else 8)
    if stage >= 1:
        optim /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        params /= world
    return (params + grads + optim) / mp_size


def max_micro_batch(
    device_bytes: float | None, model_bytes: float, activation_bytes: float, cap: int
) -> int:
    """The largest micro-batch whose memory fits: (device - model states) // activations per
    sample, at most ``cap``; 0 when even the model states do not fit."""
    if device_bytes is None or activation_bytes <= 0:
        return cap if device_bytes is None or device_bytes > model_bytes else 0
    return max(0, min(cap, int((device_bytes - model_bytes) // activation_bytes)))


def micro_batch_list(
    min_mbs: int, max_mbs: int, num: int, max_train_batch_size_per_gpu: int
) -> list[int]:
    """DeepSpeed's micro-batch sizes to try between ``min_mbs`` and ``max_mbs``: from half the
    largest (when the smallest is below that) up to the largest in ``num`` equal strides,
    leaving out those whose accumulation steps equal the largest's (the largest covers them)."""
    if min_mbs <= 0 or max_mbs <= 0:
        return []
    if min_mbs < max_mbs // 2:
        min_mbs = max_mbs // 2
    stride = max((max_mbs - min_mbs) // num, 1)
    min_gas = max_train_batch_size_per_gpu // max_mbs
    sizes = [
        mbs
        for mbs in range(min_mbs, max_mbs, stride)
        if max_train_batch_size_per_gpu // mbs != min_gas
    ]
    return [*sizes, max_mbs]


def ds_experiments(
    user_config: dict[str, Any],
    stage: int,
    micro_batches: Sequence[int],
    max_train_batch_size_per_gpu: int,
    *,
    world: int,
    mp_size: int = 1,
    knobs: dict[str, Any] | None = None,
    bytes_of: Callable[[int, int], float | None] | None = None,
) -> list[Experiment]:
    """One experiment per micro-batch size at ZeRO ``stage`` (and ``knobs``, ZeRO keys), each
    a copy of ``user_config`` with the batch keys and ``zero_optimization`` set as DeepSpeed
    does. ``bytes_of(stage, mbs)``: the estimated memory per rank."""
    exps = []
    for mbs in micro_batches:
        gas = max(max_train_batch_size_per_gpu // mbs, 1)
        config = {k: v for k, v in user_config.items() if k != "autotuning"}
        zero = {k: v for k, v in dict(user_config.get("zero_optimization") or {}).items()}
        zero["stage"] = stage
        zero.update(knobs or {})
        config["zero_optimization"] = zero
        config["train_micro_batch_size_per_gpu"] = mbs
        config["gradient_accumulation_steps"] = gas
        config["train_batch_size"] = mbs * gas * world // mp_size
        knob_name = "".join(f"_{_short(k)}{_value_name(v)}" for k, v in (knobs or {}).items())
        name = f"z{stage}{knob_name}_gas{gas}_tmbspg{mbs}"
        settings = {
            "zero_stage": stage,
            "micro_batch_size": mbs,
            "gradient_accumulation_steps": gas,
        }
        settings.update(knobs or {})
        estimated = bytes_of(stage, mbs) if bytes_of is not None else None
        exps.append(
            Experiment(
                name,
                f"z{stage}",
                settings,
                ds_config=config,
                estimated_bytes=None if estimated is None else int(estimated),
            )
        )
    return exps


def _short(key: str) -> str:
    return "".join(word[0] for word in key.split("_"))  # reduce_bucket_size -> rbs (DS's names)


def _value_name(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return f"{value:.0e}".replace("+0", "").replace("+", "")
    return str(value)


def knob_grid(stage: int) -> list[dict[str, Any]]:
    """Every combination of DeepSpeed's default ZeRO knobs for ``stage`` (fast: false)."""
    space = ZERO_KNOBS[stage]
    keys = list(space)
    return [dict(zip(keys, values)) for values in itertools.product(*space.values())]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_layouts(
    world: int,
    num_layers: int,
    num_heads: int,
    tp_sizes: Iterable[int] | None = None,
    pp_sizes: Iterable[int] | None = None,
) -> list[tuple[int, int]]:
    """(tp, pp) pairs that divide ``world`` and the model: heads by tp, layers by pp."""
    tps = list(tp_sizes) if tp_sizes else divisors(world)
    pps = list(pp_sizes) if pp_sizes else divisors(world)
    return [
        (tp, pp)
        for tp in tps
        for pp in pps
        if world % (tp * pp) == 0 and num_heads % tp == 0 and num_layers % pp == 0
    ]


def pretrain_micro_batches(
    global_batch: int, dp: int, lo: int, hi: int, num: int, given: Sequence[int] | None = None
) -> list[int]:
    """Micro-batch sizes for a fixed global batch: those dividing ``global_batch / dp`` in
    [lo, hi] (the largest ``num`` of them), or ``given`` where they divide it."""
    if global_batch % dp:
        return []
    per_rank = global_batch // dp
    if given:
        return [m for m in given if per_rank % m == 0]
    fitting = [m for m in divisors(per_rank) if lo <= m <= hi]
    return fitting[-num:]


def prune(
    exps: Iterable[Experiment], device_bytes: float | None
) -> tuple[list[Experiment], list[Experiment]]:
    """(kept, pruned): an experiment whose estimated memory exceeds ``device_bytes`` is not run.
    Without a device size or an estimate nothing is pruned."""
    kept, pruned = [], []
    for exp in exps:
        over = (
            device_bytes is not None
            and exp.estimated_bytes is not None
            and exp.estimated_bytes > device_bytes
        )
        (pruned if over else kept).append(exp)
    return kept, pruned


def order(exps: list[Experiment], tuner_type: str, seed: int = 1234) -> list[Experiment]:
    """The order a space's experiments run in: as generated (gridsearch), shuffled with a fixed
    seed (random), or — model_based — the largest estimated memory first (DeepSpeed fits an
    XGBoost cost model to the measured ones; zerotron ranks by the estimator, which says which
    use the device most)."""
    if tuner_type == "random":
        import random

        shuffled = list(exps)
        random.Random(seed).shuffle(shuffled)
        return shuffled
    if tuner_type == "model_based":
        return sorted(exps, key=lambda e: -(e.estimated_bytes or 0))
    return list(exps)
