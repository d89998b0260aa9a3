"""``zerotron convert``: HuggingFace GPT-2 <-> zerotron checkpoints, and resharding.

zerotron convert --from-hf ./gpt2-hf --save ./ckpt       # import (tag "release")
zerotron convert --load ./ckpt --to-hf ./gpt2-export     # export (latest tag, or --tag)
zerotron convert --load ./ckpt --save ./ckpt-tp1 \
    --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2   # reshard the weights
zerotron convert --from-megatron ./megatron-save --save ./ckpt       # Megatron-LM import
zerotron convert --load ./ckpt --to-megatron ./out --megatron-format mcore \
    --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2   # Megatron-LM export

Export and resharding read a checkpoint of any tensor/pipeline layout. A resharded checkpoint
holds model weights, step counters and metadata, not optimizer states: resume it with
``--finetune`` or ``--no-load-optim``.
"""

from __future__ import annotations

from zerotron.checkpoint.hf import from_hf_state_dict, load_hf_dir, save_hf_dir, to_hf_state_dict
from zerotron.checkpoint.model import load_gpt, save_gpt
from zerotron.checkpoint.reshard import reshard_checkpoint
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
        "--from-megatron",
        metavar="DIR",
        help="a Megatron-LM checkpoint (mcore, legacy or torch_dist; found by itself)",
    )
    p.add_argument("--to-megatron", metavar="DIR", help="where to write a Megatron-LM checkpoint")
    p.add_argument(
        "--megatron-format",
        choices=("mcore", "legacy", "torch_dist"),
        default="mcore",
        help="--to-megatron's layout (default mcore)",
    )
    return p


def _progress(steps: int) -> Progress:
    """The command's steps (read, convert or split per target rank, write) on stderr."""
    return Progress("convert", steps, unit="steps")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.from_megatron or args.to_megatron:
        from zerotron.checkpoint.megatron_cli import megatron_main

        return megatron_main(args)
    targets = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    if targets != (None, None):
        if not (args.load and args.save) or args.from_hf or args.to_hf:
            raise ConfigError(
                "resharding takes --load CKPT --save OUT (and no --from-hf / --to-hf)",
                where="zerotron convert",
            )
        tp, pp = targets[0] or 1, targets[1] or 1
        with _progress(2 + tp * pp) as bar:
            path = reshard_checkpoint(
                args.load,
                args.save,
                tp,
                pp,
                tag=args.tag,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                progress=bar,
            )
        print(
            f"resharded {args.load} -> {path} (tensor parallel {targets[0] or 1}, pipeline "
            f"parallel {targets[1] or 1}; model weights only: resume with --finetune or "
            "--no-load-optim)"
        )
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
        "--target-pipeline-parallel-size M (reshard)",
        where="zerotron convert",
    )
