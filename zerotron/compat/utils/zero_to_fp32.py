"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: the fp32 weights of a ZeRO checkpoint saved by
``engine.save_checkpoint`` (stages 1-3), without processes and without the model's code.

- :func:`get_fp32_state_dict_from_zero_checkpoint`: the state dict, in memory (or lazily);
- :func:`convert_zero_checkpoint_to_fp32_state_dict`: an output directory of
  ``pytorch_model.bin`` / ``model.safetensors``, sharded with Hugging Face's index file;
- :func:`load_state_dict_from_zero_checkpoint`: the weights loaded into a model;
- the command line::

    python -m zerotron.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization]
        [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]

The work is :mod:`zerotron.checkpoint.fp32_shards` (on :mod:`zerotron.checkpoint.zero_to_fp32`,
which ``zerotron zero-to-fp32`` uses too). ``checkpoint_dir`` is the directory holding the tag
directories (and ``latest``); errors are zerotron's CheckpointError (DeepSpeed raises
ValueError / FileNotFoundError).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch import nn

from zerotron.checkpoint.fp32_shards import LazyTensor, fp32_state_dict, write_fp32_model


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor | LazyTensor]:
    """The consolidated fp32 state dict of the checkpoint's tag ``tag`` (default: the one in
    ``latest``), on the CPU. ``exclude_frozen_parameters`` leaves out parameters that were not
    trained (buffers stay). ``lazy_mode``: trained parameters are read only when their
    ``.contiguous()`` is called."""
    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the fp32 weights into ``output_dir``: ``pytorch_model.bin`` (or
    ``model.safetensors`` with ``safe_serialization``), split into shards of at most
    ``max_shard_size`` with an index JSON when they do not fit in one (``None``: never split)."""
    write_fp32_model(
        checkpoint_dir,
        output_dir,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it
    (``strict=False``, as DeepSpeed); return it. The model is then a plain module: build a new
    engine to train it again."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's zero_to_fp32.py command line."""
    p = argparse.ArgumentParser(
        prog="python -m zerotron.utils.zero_to_fp32",
        description="write the fp32 weights of a ZeRO checkpoint (DeepSpeed's zero_to_fp32)",
    )
    p.add_argument("checkpoint_dir", help="the save directory, e.g. path/checkpoint-12")
    p.add_argument("output_dir", help="directory for the fp32 state dict files")
    p.add_argument(
        "--max_shard_size",
        default="5GB",
        help="largest shard before splitting, digits and a unit (default 5GB)",
    )
    p.add_argument(
        "--safe_serialization",
        action="store_true",
        help="write safetensors files instead of torch.save (pickle) files",
    )
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1")
    p.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters"
    )
    p.add_argument("-d", "--debug", action="store_true", help="accepted; prints nothing more")
    return p


def main(argv: list[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0


if __name__ == "__main__":
    import sys

    from zerotron.errors import ZerotronError

    try:
        sys.exit(main())
    except ZerotronError as e:  # the message says what to do; no traceback
        print(f"zero_to_fp32: error: {e.format()}", file=sys.stderr)
        sys.exit(2)
