"""``zerotron convert --from-megatron`` / ``--to-megatron``: the Megatron-LM branch of convert."""

from __future__ import annotations

import argparse

from zerotron.checkpoint.canonical import Layout
from zerotron.checkpoint.convert import TARGET_FLAGS
from zerotron.checkpoint.megatron_export import export_megatron
from zerotron.checkpoint.megatron_import import describe_import, import_megatron
from zerotron.errors import ConfigError
from zerotron.progress import Progress


def megatron_main(args: argparse.Namespace) -> int:
    """Run the import (``--from-megatron DIR --save CKPT [--target-*]``: one process at ZeRO
    stage 0 unless the target flags say otherwise) or the export (``--load CKPT --to-megatron
    DIR --megatron-format F [--target-*-parallel-size]``)."""
    if args.from_megatron and args.save and not (args.load or args.to_megatron or args.from_hf):
        target = None
        if any(getattr(args, flag) is not None for flag in TARGET_FLAGS):
            target = Layout(
                tensor_parallel=args.target_tensor_parallel_size or 1,
                pipeline_parallel=args.target_pipeline_parallel_size or 1,
                virtual_stages=args.target_virtual_pipeline_parallel_size or 1,
                data_parallel=args.target_data_parallel_size or 1,
                zero_stage=args.target_zero_stage or 0,
                sub_group_size=args.target_sub_group_size,
            )
        with Progress("convert", 1, unit="steps") as bar:
            path, info = import_megatron(
                args.from_megatron,
                args.save,
                args.tag,
                target,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            )
            bar.update(1, info=f"wrote {path}")
        print(
            f"found a {info['writer']} {info['format']} checkpoint (tensor parallel "
            f"{info['tensor_parallel']}, pipeline parallel {info['pipeline_parallel']}, "
            f"iteration {info['iteration']}, checkpoint version {info['checkpoint_version']})"
        )
        laid_out = f"; {target.describe()}" if target is not None else ""
        print(f"imported {args.from_megatron} -> {path} ({describe_import(info)}{laid_out})")
        return 0
    if args.load and args.to_megatron and not (args.save or args.from_hf or args.to_hf):
        tp = args.target_tensor_parallel_size or 1
        pp = args.target_pipeline_parallel_size or 1
        if args.megatron_deepspeed_qkv and args.megatron_format != "megatron-deepspeed":
            raise ConfigError(
                "--megatron-deepspeed-qkv is for --megatron-format megatron-deepspeed",
                where="zerotron convert",
                fix="drop it, or write Megatron-DeepSpeed's files",
            )
        ignored = [
            f"--{flag.replace('_', '-')}"
            for flag in ("target_virtual_pipeline_parallel_size", "target_sub_group_size")
            if getattr(args, flag) is not None
        ]
        if args.target_data_parallel_size is not None and args.target_zero_stage is None:
            ignored.append("--target-data-parallel-size (without --target-zero-stage)")
        if ignored:
            raise ConfigError(
                f"{', '.join(ignored)} does not apply to --to-megatron",
                where="zerotron convert",
                fix="drop it; an export takes --target-tensor-parallel-size, "
                "--target-pipeline-parallel-size and, for megatron-deepspeed with the training "
                "state, --target-zero-stage 1|2 with --target-data-parallel-size",
            )
        with Progress("convert", 1, unit="steps") as bar:
            path = export_megatron(
                args.load,
                args.to_megatron,
                args.megatron_format,
                tp,
                pp,
                tag=args.tag,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                qkv_order=args.megatron_deepspeed_qkv,
                zero_stage=args.target_zero_stage,
                data_parallel=args.target_data_parallel_size or 1,
            )
            bar.update(1, info=f"wrote {path}")
        deepspeed = args.megatron_format == "megatron-deepspeed"
        what = "Megatron-DeepSpeed's files" if deepspeed else f"Megatron-LM {args.megatron_format}"
        if args.target_zero_stage is not None:
            dp = args.target_data_parallel_size or 1
            held = (
                f"with the training state for ZeRO stage {args.target_zero_stage} at data "
                f"parallel {dp}: load with --no-load-rng"
            )
        else:
            how = "--finetune" if deepspeed else "--finetune, or --no-load-optim --no-load-rng"
            held = f"weights only: load with {how}"
        print(
            f"exported {args.load} -> {path} ({what}, tensor parallel {tp}, pipeline parallel "
            f"{pp}; {held})"
        )
        return 0
    raise ConfigError(
        "give --from-megatron DIR --save CKPT (import) or --load CKPT --to-megatron DIR "
        "[--megatron-format mcore|legacy|torch_dist|megatron-deepspeed] (export)",
        where="zerotron convert",
    )
