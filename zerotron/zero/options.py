"""ZeRO's options, typed and frozen: what a ZeroOptimizer is told, built once from the config.

:class:`ZeroOptions` holds every ZeRO setting the code uses (stage, bucket and sub-group sizes,
the wire and accumulation dtypes, DeepSpeed's averaging switches, stage 3's partitioning and
prefetch sizes) with the two offload sections nested as :class:`OffloadOptions`.
:meth:`ZeroOptions.from_config` reads them from the config's ``zero`` section, which has
already validated them; DeepSpeed keys that zerotron accepts but does not use
(``contiguous_gradients``, ``round_robin_gradients``, the async-I/O tuning keys) stay in the
config and never reach the optimizer.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from zerotron.config.deepspeed_table import read_offload
from zerotron.errors import ConfigError

if TYPE_CHECKING:
    from zerotron.config import ZeroConfig

Device = Literal["none", "cpu", "nvme"]

COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""``communication_data_type`` names in the config -> torch dtypes."""


@dataclass(frozen=True)
class OffloadOptions:
    """One offload section of a DeepSpeed config (``zero_optimization.offload_optimizer`` or
    ``zero_optimization.offload_param``).

    Attributes:
        device: ``"none"`` (no offload), ``"cpu"`` (host memory) or ``"nvme"`` (files).
        nvme_path: directory for the swap files (device ``"nvme"`` only); must exist and be
            writable. Each process uses ``<nvme_path>/zerotron_swap/<rank name>.<kind>/``.
        pin_memory: page-lock the host buffers that cross to and from an accelerator (no
            effect without CUDA).
        buffer_count: sub-groups (optimizer) or shards (parameters) resident at once with
            ``"nvme"``; at least 1, 2 or more lets reads and writes overlap the step.

    Built from a validated config by :meth:`ZeroOptions.from_config`; :meth:`validate` guards
    direct Python use (the offloaded optimizer and the parameter store call it: a path that
    existed when the config was read may not when the swap directory is made).
    """

    device: Device = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str) -> OffloadOptions:
        """Options from a DeepSpeed JSON section, validated; ``where`` is its key path, whose
        last key (``offload_param`` or else ``offload_optimizer``) picks the section's table.

        The values are read by the config's DeepSpeed table
        (:func:`~zerotron.config.deepspeed_table.read_offload`), as a DeepSpeed JSON's are;
        keys without an option here (``buffer_size``, ``max_in_cpu``) are checked, unused.
        """
        if d is None:
            return cls()
        if isinstance(d.get("nvme_path"), os.PathLike):  # a Python dict may hold a Path
            d = {**d, "nvme_path": os.fspath(d["nvme_path"])}
        values = read_offload(_kind(where), d, where)
        fields = ("device", "nvme_path", "pin_memory", "buffer_count")
        opts = cls(**{k: values[k] for k in fields if k in values})
        opts.validate(where)
        return opts

    def validate(self, where: str) -> None:
        """Raise :class:`ConfigError` naming ``<where>.<key>`` if a value cannot work.

        The values are checked by the config's definitions
        (:func:`~zerotron.config.deepspeed_table.read_offload`) and must already be in the
        form those give (``"cpu"``, not ``"CPU"``; 3, not 3.0): options are used as given.
        The one check of its own is whether the NVMe directory is usable now.
        """
        given = {
            "device": self.device,
            "pin_memory": self.pin_memory,
            "buffer_count": self.buffer_count,
        }
        parsed = read_offload(_kind(where), given, where)  # leaves out None (JSON's default)
        for key, value in given.items():
            if key not in parsed or type(parsed[key]) is not type(value) or parsed[key] != value:
                want = f"{parsed[key]!r}" if key in parsed else "set"
                raise ConfigError(f"must be {want}, not {value!r}", where=f"{where}.{key}")
        if self.device == "nvme":
            _check_nvme_path(self.nvme_path, f"{where}.nvme_path")


def _kind(where: str) -> str:
    """The offload section a key path names: ``param`` or, for anything else, ``optimizer``."""
    return "param" if where.rpartition(".")[2] == "offload_param" else "optimizer"


def _check_nvme_path(path: str | None, where: str) -> None:
    if not path:
        raise ConfigError(
            'device "nvme" needs nvme_path',
            where=where,
            fix='set "nvme_path" to a directory on a fast local disk, e.g. "/local_nvme"',
        )
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"nvme_path {str(p)!r} does not exist", where=where, fix=f"create it: mkdir -p {p}"
        )
    if not p.is_dir():
        raise ConfigError(f"nvme_path {str(p)!r} is not a directory", where=where)
    try:  # os.access says yes to root even on a read-only mount: try for real
        fd, probe = tempfile.mkstemp(dir=p, prefix=".zerotron-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"nvme_path {str(p)!r} is not writable ({e.strerror or e})",
            where=where,
            fix="point nvme_path at a directory this user can write",
        ) from e


def _offload_from_config(zero: ZeroConfig, kind: str) -> OffloadOptions | None:
    """``zero.offload_{kind}_*`` as :class:`OffloadOptions` (None: off)."""
    device = getattr(zero, f"offload_{kind}_device")
    if device == "none":
        return None
    return OffloadOptions(
        device=device,
        nvme_path=getattr(zero, f"offload_{kind}_nvme_path"),
        pin_memory=getattr(zero, f"offload_{kind}_pin_memory"),
        buffer_count=getattr(zero, f"offload_{kind}_buffer_count"),
    )


@dataclass(frozen=True)
class ZeroOptions:
    """What :class:`~zerotron.zero.optimizer.ZeroOptimizer` does beyond the step sequence.

    Attributes:
        stage: 1, 2 or 3.
        reduce_bucket_size, allgather_bucket_size: elements per bucket of the gradient
            reduce-scatter and of the parameter all-gather (reduce: None for
            :func:`default_sizes`).
        overlap_comm: launch gradient buckets asynchronously during backward.
        reduce_scatter: False all-reduces gradient buckets instead (DeepSpeed's option).
        sub_group_size: elements per flat fp32 master (per optimizer step piece; offload streams
            one at a time); None for :func:`default_sizes`.
        communication_data_type: the gradient wire dtype (default: the parameters').
        grad_accum_dtype: dtype of the gradient partitions that micro-batches accumulate into
            (DeepSpeed's ``data_types.grad_accum_dtype``; default: the parameters'; at stage 3
            without offload the wire dtype for one micro-batch and fp32 from the second on;
            fp32 keeps bf16 sums exact at 2 more bytes per element per rank).
        gradient_predivide_factor, prescale_gradients: DeepSpeed's averaging options.
        param_persistence_threshold, prefetch_bucket_size, max_live_parameters,
            max_reuse_distance: stage 3's partitioning, prefetch and reuse sizes, used when
            the optimizer partitions the model itself (see
            :func:`~zerotron.zero.stage3.partition_parameters`).
        gather_16bit_weights_on_model_save: stage 3: the Engine also saves the whole 16-bit
            model (``stage3_gather_16bit_weights_on_model_save``).
        offload_optimizer, offload_param: where masters and states, and stage 3's shards, rest
            (None: where they were made).
    """

    stage: int
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int = int(5e8)
    overlap_comm: bool = True
    reduce_scatter: bool = True
    sub_group_size: int | None = None
    communication_data_type: torch.dtype | None = None
    grad_accum_dtype: torch.dtype | None = None
    gradient_predivide_factor: float = 1.0
    prescale_gradients: bool = False
    param_persistence_threshold: int = int(1e5)
    prefetch_bucket_size: int | None = None
    max_live_parameters: int = int(1e9)
    max_reuse_distance: int = 0
    gather_16bit_weights_on_model_save: bool = False
    offload_optimizer: OffloadOptions | None = None
    offload_param: OffloadOptions | None = None

    @classmethod
    def from_config(cls, zero: ZeroConfig) -> ZeroOptions:
        """The options of a validated config's ``zero`` section (``cfg.zero``)."""
        return cls(
            stage=zero.zero_stage,
            reduce_bucket_size=zero.reduce_bucket_size,
            allgather_bucket_size=zero.allgather_bucket_size,
            overlap_comm=bool(zero.overlap_comm),
            reduce_scatter=zero.reduce_scatter,
            sub_group_size=zero.sub_group_size,
            communication_data_type=COMM_DTYPES.get(zero.communication_data_type or ""),
            gradient_predivide_factor=zero.gradient_predivide_factor,
            prescale_gradients=zero.prescale_gradients,
            param_persistence_threshold=zero.stage3_param_persistence_threshold,
            prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
            max_live_parameters=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            gather_16bit_weights_on_model_save=zero.stage3_gather_16bit_weights_on_model_save,
            offload_optimizer=_offload_from_config(zero, "optimizer"),
            offload_param=_offload_from_config(zero, "param"),
        )


STAGE3_REDUCE_BUCKET_SIZE = int(4e6)
STAGE3_SUB_GROUP_SIZE = int(2e6)


def default_sizes(
    stage: int, reduce_bucket_size: int | None, sub_group_size: int | None
) -> tuple[int, int]:
    """``(reduce_bucket_size, sub_group_size)``, zerotron's defaults where None.

    Stages 1-2 take DeepSpeed's (5e8, 1e9). Stage 3, the stage chosen for memory, takes pieces
    of a few MB (4e6 gradient elements per reduce-scatter, 2e6 per sub-group): gradients are
    reduced and their fp32 partitions allocated a bucket at a time during backward, into the
    memory the freed activations leave, rather than all at once at its end in fresh pages
    (bench/README.md, ``bench/zero.py``: peak RSS against FSDP2's). A DeepSpeed config always
    gets DeepSpeed's defaults.
    """
    if reduce_bucket_size is None:
        reduce_bucket_size = STAGE3_REDUCE_BUCKET_SIZE if stage == 3 else int(5e8)
    if sub_group_size is None:
        sub_group_size = STAGE3_SUB_GROUP_SIZE if stage == 3 else int(1e9)
    return reduce_bucket_size, sub_group_size
