"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``), importable as
``zerotron.checkpointing``::

    import zerotron.checkpointing as checkpointing

    checkpointing.configure(mpu, deepspeed_config="ds.json")   # optional
    checkpointing.model_parallel_cuda_manual_seed(1234)
    y = checkpointing.checkpoint(block, x, mask)                # instead of y = block(x, mask)

The recompute itself (:func:`checkpoint`, what is kept of the inputs, the random state replayed)
is :mod:`zerotron.parallel.recompute`; this module adds DeepSpeed's ways to configure it:

- :func:`configure` reads the ``"activation_checkpointing"`` section of a DeepSpeed JSON (keys
  :data:`JSON_KEYS`), validates it with errors naming the key, and takes the tensor-parallel
  group from an mpu object (zerotron's, or a Megatron/DeepSpeed-style one);
- :func:`partition_activations_in_checkpoint`, :func:`set_num_layers`: DeepSpeed's setters;
- :func:`get_cuda_rng_tracker`, :func:`model_parallel_cuda_manual_seed`: Megatron's seeding.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerotron.distributed import mpu as zerotron_mpu
from zerotron.distributed.comm import Group
from zerotron.distributed.rng import (
    MODEL_PARALLEL_RNG,
    MODEL_PARALLEL_SEED_OFFSET,
    RNGStatesTracker,
    get_rng_tracker,
)
from zerotron.errors import ConfigError
from zerotron.parallel import recompute
from zerotron.parallel.recompute import (
    SECTION,
    CheckpointFunction,
    CheckpointingConfig,
    TensorParallelSource,
    active_partitioned_buffers,
    checkpoint,
    config,
    is_configured,
    reset,
    saved_bytes,
    timings,
)

# DeepSpeed JSON key -> configure() argument.
JSON_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


def configure(
    mpu_: Any,
    deepspeed_config: str | Path | Mapping[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> CheckpointingConfig:
    """Set how :func:`checkpoint` keeps its inputs (DeepSpeed's ``checkpointing.configure``).

    ``mpu_``: where the tensor-parallel group comes from: None or :mod:`zerotron.distributed.mpu`
    for zerotron's parallel state, or a Megatron/DeepSpeed-style mpu object
    (``get_tensor_model_parallel_group``, else ``get_model_parallel_group``).
    ``deepspeed_config``: a JSON file path or a dict; its ``"activation_checkpointing"``
    section gives the settings. Explicit arguments override it. Each call replaces the whole
    configuration. Returns it.
    """
    where_file = None
    values: dict[str, Any] = {}
    if deepspeed_config is not None:
        section, where_file = _read_section(deepspeed_config)
        for key, value in section.items():
            if key not in JSON_KEYS:
                warnings.warn(
                    f"{_where(where_file, key)}: unknown activation checkpointing key {key!r} "
                    f"ignored (known: {', '.join(JSON_KEYS)})",
                    stacklevel=2,
                )
                continue
            values[JSON_KEYS[key]] = _checked(JSON_KEYS[key], value, _where(where_file, key))
    explicit = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    for name, value in explicit.items():
        if value is not None:
            values[name] = _checked(name, value, f"configure({name}=...)")
    cfg = replace(CheckpointingConfig(), **values)
    if cfg.contiguous_checkpointing and not cfg.partition_activations:
        raise ConfigError(
            "contiguous memory optimization needs partitioned activations",
            where=f"{SECTION}.contiguous_memory_optimization",
            fix="set partition_activations to true, or contiguous_memory_optimization to false",
        )
    if cfg.contiguous_checkpointing and cfg.num_checkpoints is None:
        raise ConfigError(
            "contiguous memory optimization needs the number of checkpoints",
            where=f"{SECTION}.number_checkpoints",
            fix="set number_checkpoints to the checkpointed layers of one forward",
        )
    recompute.set_config(cfg, _tensor_parallel_of(mpu_))
    return cfg


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn ``partition_activations`` on or off, keeping the rest (DeepSpeed's helper)."""
    value = _checked("partition_activations", partition_activation, "partition_activations")
    recompute.update_config(partition_activations=value)


def set_num_layers(nlayers: int) -> None:
    """Set ``num_checkpoints``, the bound on live contiguous buffers (DeepSpeed's helper)."""
    recompute.update_config(num_checkpoints=_checked("num_checkpoints", nlayers, "nlayers"))


def _read_section(cfg: str | Path | Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    if isinstance(cfg, (str, Path)):
        from zerotron.config.files import read_config_file

        data, _ = read_config_file(cfg)
        source: str | None = str(cfg)
    elif isinstance(cfg, Mapping):
        data, source = cfg, None
    else:
        raise ConfigError(
            f"deepspeed_config must be a path or a dict, got {type(cfg).__name__}",
            where="checkpointing.configure",
        )
    section = data.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"must be an object, got {type(section).__name__} {section!r}",
            where=_where(source, None),
            fix='write "activation_checkpointing": {"partition_activations": true, ...}',
        )
    return section, source


def _where(source: str | None, key: str | None) -> str:
    path = SECTION if key is None else f"{SECTION}.{key}"
    return f"{source}: {path}" if source else path


def _checked(name: str, value: Any, where: str) -> Any:
    if name == "num_checkpoints":
        if value is None:
            return None
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (ok and float(value).is_integer() and value >= 1):
            raise ConfigError(
                f"must be a positive integer, got {value!r}",
                where=where,
                fix="give the number of checkpointed layers in one forward",
            )
        return int(value)
    if not isinstance(value, bool):
        raise ConfigError(
            f"must be true or false, got {type(value).__name__} {value!r}", where=where
        )
    return value


# ---- RNG ----------------------------------------------------------------------------------------


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The tensor-parallel RNG tracker (:func:`zerotron.distributed.rng.get_rng_tracker`)."""
    return get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default stream gets ``seed`` (equal on all TP ranks), the
    tracker's model-parallel stream ``seed + 2718 + tp_rank``. Works without CUDA (the streams
    are then the CPU generator's)."""
    torch.manual_seed(seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + recompute.tp_rank())


# ---- the tensor-parallel group of an mpu object -----------------------------------------------


def _tensor_parallel_of(mpu: Any) -> TensorParallelSource | None:
    """None (zerotron's parallel state) for None or zerotron's mpu, else ``mpu``'s TP group."""
    if mpu is None or mpu is zerotron_mpu:
        return None
    return TensorParallelSource(group=lambda: _mpu_group(mpu), rank=lambda: _mpu_rank(mpu))


def _mpu_group(mpu: Any) -> Group:
    getter = _first_attr(
        mpu,
        "get_tensor_model_parallel_group",
        "get_slice_parallel_group",
        "get_model_parallel_group",
    )
    pg = getter()
    if not (dist.is_available() and dist.is_initialized()):
        return Group.single("tp", 0)
    ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else ()
    if not ranks:
        ranks = tuple(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    return Group("tp", ranks, me, pg) if len(ranks) > 1 else Group.single("tp", ranks[0])


def _mpu_rank(mpu: Any) -> int:
    return int(
        _first_attr(
            mpu,
            "get_tensor_model_parallel_rank",
            "get_slice_parallel_rank",
            "get_model_parallel_rank",
        )()
    )


def _first_attr(obj: Any, *names: str) -> Callable[[], Any]:
    for name in names:
        fn = getattr(obj, name, None)
        if fn is not None:
            return fn
    raise ConfigError(
        f"the mpu passed to checkpointing.configure has none of {', '.join(names)}",
        where="checkpointing.configure(mpu_)",
        fix="pass zerotron.distributed.mpu, a Megatron mpu, or None",
    )


__all__ = [
    "CheckpointFunction",
    "CheckpointingConfig",
    "active_partitioned_buffers",
    "checkpoint",
    "config",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "partition_activations_in_checkpoint",
    "reset",
    "saved_bytes",
    "set_num_layers",
    "timings",
]
