"""Checkpoints: one on-disk layout for every entry point, saved atomically, loaded safely.

``layout`` names the files, ``save_load`` writes them (trackers, metadata.json with a checksum
per file; ``begin_tag``/``commit_tag`` for any writer), ``load`` reads them, ``verify`` checks a
tag's checksums and completeness (``zerotron checkpoint verify|info``: ``checkpoint_cli``),
``retention`` and ``async_save`` serve ``--save-keep-last`` and ``--async-save``,
``state`` fits a loaded state dict to a model (``fit``: the Engine's hook for it, exact or
re-padding a vocabulary), ``rng`` captures the random generators,
``zero_to_fp32`` consolidates the fp32 weights of a ZeRO checkpoint offline.
"""

from zerotron.checkpoint.checksums import file_checksum, record_checksum
from zerotron.checkpoint.layout import (
    METADATA_FILE,
    RELEASE_TAG,
    iteration_from_tag,
    model_file,
    model_files,
    tag_for_iteration,
    zero_file,
    zero_files,
)
from zerotron.checkpoint.rng import get_rng_state, set_rng_state
from zerotron.checkpoint.save_load import (
    begin_tag,
    build_metadata,
    check_safe,
    commit_tag,
    load_file,
    read_latest_tag,
    read_metadata,
    resolve_tag,
    save_checkpoint,
    to_safe,
)
from zerotron.checkpoint.state import load_model_state, repad_vocab
from zerotron.checkpoint.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    zero_to_fp32,
)

__all__ = [
    "METADATA_FILE",
    "RELEASE_TAG",
    "begin_tag",
    "build_metadata",
    "check_safe",
    "commit_tag",
    "file_checksum",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_rng_state",
    "iteration_from_tag",
    "load_file",
    "load_model_state",
    "model_file",
    "model_files",
    "read_latest_tag",
    "read_metadata",
    "record_checksum",
    "repad_vocab",
    "resolve_tag",
    "save_checkpoint",
    "set_rng_state",
    "tag_for_iteration",
    "to_safe",
    "zero_file",
    "zero_files",
    "zero_to_fp32",
]
