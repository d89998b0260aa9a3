"""``zerotron convert``: HuggingFace GPT-2 <-> zerotron checkpoints, and layout conversion.

zerotron convert --from-hf ./gpt2-hf --save ./ckpt       # import (tag "release")
zerotron convert --load ./ckpt --to-hf ./gpt2-export     # export (latest tag, or --tag)
zerotron convert --load ./ckpt --save ./ckpt-tp1 \
    --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2 \
    [--target-virtual-pipeline-parallel-size V --target-data-parallel-size D \
     --target-zero-stage S --target-sub-group-size N]    # another layout
zerotron convert --from-megatron ./megatron-save --save ./ckpt       # Megatron import
zerotron convert --load ./ckpt --to-megatron ./out --megatron-format mcore \
    --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2   # Megatron-LM export
    (--megatron-format legacy, torch_dist; megatron-deepspeed --megatron-deepspeed-qkv
     per-head|blocks: Megatron-DeepSpeed's files)

Export and conversion read a checkpoint of any layout. A converted checkpoint carries the
optimizer state (fp32 masters, Adam moments and steps, loss scaler), the LR scheduler, step
counters and consumed samples (:mod:`zerotron.checkpoint.convert_layout`): resume it on the
target layout as if it had been saved there. Target sizes not given keep the source's
(virtual stages: none).
"""

from __future__ import annotations

from typing import Any

from zerotron.checkpoint.canonical import Layout
from zerotron.checkpoint.convert_layout import convert_checkpoint, progress_steps
from zerotron.checkpoint.hf import from_hf_state_dict, load_hf_dir, save_hf_dir, to_hf_state_dict
from zerotron.checkpoint.model import load_gpt, save_gpt
from zerotron.checkpoint.save_load import read_metadata, resolve_tag
from zerotron.config.args import ArgumentParser
from zerotron.data.tokenizer import vocab_size_with_padding
from zerotron.errors import ConfigError
from zerotron.progress import Progress


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="zerotron convert", description=__doc__.split("\n")[0])
    p.add_argument("--from-hf", metavar="DIR", help="a transformers GPT2LMHeadModel directory")
    p.add_argument("--save", metavar="CKPT", help="where to write the zerotron checkpoint")
    p.add_argument("--load", metavar="CKPT", help="a zerotron checkpoint directory")
    p.add_argument("--tag", help="checkpoint tag (default: --load's latest; 'release' on import)")
    p.add_argument("--to-hf", metavar="DIR", help="where to write the transformers directory")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="vocab padding on import and resharding (times the tensor-parallel size)",
    )
    p.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        metavar="N",
        help="reshard --load into --save for this tensor-parallel size",
    )
    p.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        metavar="M",
        help="reshard --load into --save for this pipeline-parallel size",
    )
    p.add_argument(
        "--target-virtual-pipeline-parallel-size",
        type=int,
        metavar="V",
        help="virtual pipeline stages per pipeline rank of the target (default: none)",
    )
    p.add_argument(
        "--target-data-parallel-size",
        type=int,
        metavar="D",
        help="data-parallel size of the target (ZeRO partitions; default: the source's)",
    )
    p.add_argument(
        "--target-zero-stage",
        type=int,
        metavar="S",
        choices=(0, 1, 2, 3),
        help="ZeRO stage of the target, 0-3 (default: the source's)",
    )
    p.add_argument(
        "--target-sub-group-size",
        type=int,
        metavar="N",
        help="the target run's zero_optimization.sub_group_size (default: zerotron's for "
        "the stage)",
    )
    p.add_argument(
        "--from-megatron",
        metavar="DIR",
        help="a Megatron-LM (mcore, legacy or torch_dist) or Megatron-DeepSpeed checkpoint; "
        "the format is found by itself",
    )
    p.add_argument("--to-megatron", metavar="DIR", help="where to write a Megatron-LM checkpoint")
    p.add_argument(
        "--megatron-format",
        choices=("mcore", "legacy", "torch_dist", "megatron-deepspeed"),
        default="mcore",
        help="--to-megatron's layout (default mcore; megatron-deepspeed: Megatron-DeepSpeed's)",
    )
    p.add_argument(
        "--megatron-deepspeed-qkv",
        choices=("per-head", "blocks"),
        help="with --megatron-format megatron-deepspeed: the fused QKV order of the "
        "Megatron-DeepSpeed that will load it (per-head before its commit 676a482c, blocks from "
        "it on)",
    )
    return p


TARGET_FLAGS = (
    "target_tensor_parallel_size",
    "target_pipeline_parallel_size",
    "target_virtual_pipeline_parallel_size",
    "target_data_parallel_size",
    "target_zero_stage",
    "target_sub_group_size",
)


def target_layout(args: Any, load_dir: str, tag: str | None) -> Layout:
    """The target of ``--target-*``: sizes not given keep the source's (metadata.json)."""
    source = Layout.from_metadata(read_metadata(load_dir, resolve_tag(load_dir, tag)))

    def pick(flag: str, default: int) -> int:
        value = getattr(args, flag)
        return default if value is None else value

    return Layout(
        tensor_parallel=pick("target_tensor_parallel_size", source.tensor_parallel),
        pipeline_parallel=pick("target_pipeline_parallel_size", source.pipeline_parallel),
        virtual_stages=pick("target_virtual_pipeline_parallel_size", 1),
        data_parallel=pick("target_data_parallel_size", source.data_parallel),
        zero_stage=pick("target_zero_stage", source.zero_stage),
        sub_group_size=args.target_sub_group_size,
    )


def _progress(steps: int) -> Progress:
    """The command's steps (read, convert or split per target rank, write) on stderr."""
    return Progress("convert", steps, unit="steps")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.from_megatron or args.to_megatron:
        from zerotron.checkpoint.megatron_cli import megatron_main

        return megatron_main(args)
    if any(getattr(args, flag) is not None for flag in TARGET_FLAGS):
        if not (args.load and args.save) or args.from_hf or args.to_hf:
            raise ConfigError(
                "layout conversion takes --load CKPT --save OUT (and no --from-hf / --to-hf)",
                where="zerotron convert",
            )
        target = target_layout(args, args.load, args.tag)
        with _progress(progress_steps(target)) as bar:
            path = convert_checkpoint(
                args.load,
                args.save,
                target,
                tag=args.tag,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                progress=bar,
            )
        carried = read_metadata(path.parent, path.name).get("optimizer_states")
        what = (
            "weights and optimizer state"
            if carried
            else "weights only: the source holds no optimizer state"
        )
        print(f"converted {args.load} -> {path} ({target.describe()}; {what})")
        return 0
    if args.from_hf and args.save and not (args.load or args.to_hf):
        with _progress(3) as bar:
            hf_sd, hf_config = load_hf_dir(args.from_hf)
            bar.update(1, info=f"read {args.from_hf}")
            padded = vocab_size_with_padding(
                hf_config["vocab_size"], args.make_vocab_size_divisible_by
            )
            config, sd = from_hf_state_dict(hf_sd, hf_config, padded)
            bar.update(1, info="converted")
            path = save_gpt(args.save, config, sd, tag=args.tag or "release", source=args.from_hf)
            bar.update(1, info=f"wrote {path}")
        print(f"imported {args.from_hf} -> {path}")
        return 0
    if args.load and args.to_hf and not (args.from_hf or args.save):
        with _progress(3) as bar:
            model, _ = load_gpt(args.load, args.tag)
            bar.update(1, info=f"read {args.load}")
            hf_sd, hf_config = to_hf_state_dict(model.state_dict(), model.config)
            bar.update(1, info="converted")
            save_hf_dir(args.to_hf, hf_sd, hf_config)
            bar.update(1, info=f"wrote {args.to_hf}")
        print(f"exported {args.load} -> {args.to_hf}")
        return 0
    raise ConfigError(
        "give either --from-hf DIR --save CKPT (import), --load CKPT --to-hf DIR (export) or "
        "--load CKPT --save OUT --target-tensor-parallel-size N "
        "--target-pipeline-parallel-size M ... (another layout)",
        where="zerotron convert",
    )
