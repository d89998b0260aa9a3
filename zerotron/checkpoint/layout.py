"""Names and paths of a checkpoint on disk: the one layout every entry point shares.

```
<save>/
  latest_checkpointed_iteration.txt    Megatron's tracker: "600" (or "release")
  latest                               DeepSpeed's tracker: "iter_0000600" (any tag)
  iter_0000600/                        a tag: Megatron's iter_{iteration:07d}, or the caller's
    metadata.json                      layout, model config, vocab, tokenizer, versions, files
    mp_rank_00/model_optim_rng.pt      one per model-parallel rank (pipeline size 1)
    mp_rank_00_001/model_optim_rng.pt  ... or this, when the pipeline size is > 1
    zero_dp_rank_0_mp_rank_00_000_optim_states.pt   one per rank under ZeRO
  .iter_0000700.tmp/                   a save in progress (renamed to iter_0000700/ when complete)
```

Only names live here; writing and reading are in :mod:`zerotron.checkpoint.save_load`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zerotron.errors import CheckpointError

MODEL_FILE = "model_optim_rng.pt"
METADATA_FILE = "metadata.json"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"
RELEASE_TAG = "release"  # Megatron's tag for converted weights that carry no iteration
# Megatron-LM's model_optim_rng.pt format version, stored in every model file.
CHECKPOINT_VERSION = 3.0
# Entries of a model file besides Megatron's (model, optimizer, opt_param_scheduler, rng_state)
RNG_TRACKER_KEY = "rng_tracker_states"  # the tensor-parallel RNG streams, beside torch's
ZERO_STAGE_KEY = "zero_stage"  # in the model file of a ZeRO checkpoint
DP_SIZE_KEY = "dp_world_size"  # the data-parallel size its partitions were cut for
GATHERED_16BIT_FILE = "pytorch_model.bin"
"""Consolidated 16-bit weights in a tag directory (stage3_gather_16bit_weights_on_model_save)."""

_ITER_TAG = re.compile(r"iter_(\d{7,})")


def tag_for_iteration(iteration: int) -> str:
    """Megatron's tag for an iteration: 600 -> ``"iter_0000600"``."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def iteration_from_tag(tag: str) -> int | None:
    """The iteration of a Megatron tag (``"iter_0000600"`` -> 600); None for any other tag."""
    m = _ITER_TAG.fullmatch(tag)
    return int(m.group(1)) if m else None


def model_dir(tp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """Megatron's directory for one model-parallel rank: ``mp_rank_00`` or ``mp_rank_00_001``."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def model_file(tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> str:
    """Path, relative to the tag directory, of one model-parallel rank's model/optim/RNG file."""
    return f"{model_dir(tp_rank, pp_rank, pp_size)}/{MODEL_FILE}"


def zero_file(dp_rank: int, tp_rank: int = 0, pp_rank: int = 0) -> str:
    """Path, relative to the tag directory, of one rank's ZeRO partition of optimizer states."""
    return f"zero_dp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_{pp_rank:03d}_optim_states.pt"


def model_files(tp_size: int, pp_size: int = 1) -> list[str]:
    """Every model-parallel rank's file of a (tp_size, pp_size) layout, pipeline stage major."""
    return [model_file(t, p, pp_size) for p in range(pp_size) for t in range(tp_size)]


def zero_files(dp_size: int, tp_size: int = 1, pp_size: int = 1) -> list[str]:
    """Every rank's ZeRO partition file of a (dp_size, tp_size, pp_size) layout."""
    return [
        zero_file(d, t, p) for p in range(pp_size) for d in range(dp_size) for t in range(tp_size)
    ]


def validate_tag(tag: str) -> str:
    """A tag names one directory under the save directory: no separators, no leading dot."""
    if (
        not isinstance(tag, str)
        or not tag
        or tag.startswith(".")
        or "/" in tag
        or os.sep in tag
        or "\0" in tag
        or tag != tag.strip()
        or len(tag.encode("utf-8", "surrogateescape")) > 255  # NAME_MAX: not a directory name
    ):
        raise CheckpointError(
            f"invalid checkpoint tag {tag!r}",
            fix="a tag is one directory name (at most 255 bytes): no '/', no leading '.', no "
            "surrounding spaces "
            "(e.g. 'iter_0000600' or 'global_step100')",
        )
    return tag


def tag_dir(root: str | os.PathLike, tag: str) -> Path:
    """``<root>/<tag>``, the directory of one checkpoint."""
    return Path(root) / validate_tag(tag)


def temp_tag_dir(root: str | os.PathLike, tag: str) -> Path:
    """Where a save of ``tag`` is assembled before it is renamed into place.

    Deterministic so that every rank of a job writes its files into the same directory.
    """
    return Path(root) / f".{validate_tag(tag)}.tmp"


def megatron_tracker(root: str | os.PathLike) -> Path:
    """``<root>/latest_checkpointed_iteration.txt``."""
    return Path(root) / MEGATRON_TRACKER


def deepspeed_tracker(root: str | os.PathLike) -> Path:
    """``<root>/latest``."""
    return Path(root) / DEEPSPEED_TRACKER
