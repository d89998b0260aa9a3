"""``zerotron convert``: HuggingFace GPT-2 <-> zerotron checkpoints.

zerotron convert --from-hf ./gpt2-hf --save ./ckpt       # import (tag "release")
zerotron convert --load ./ckpt --to-hf ./gpt2-export     # export (latest tag, or --tag)
"""

from __future__ import annotations

from zerotron.checkpoint.hf import from_hf_state_dict, load_hf_dir, save_hf_dir, to_hf_state_dict
from zerotron.checkpoint.model import load_gpt, save_gpt
from zerotron.config.args import ArgumentParser
from zerotron.data.tokenizer import vocab_size_with_padding
from zerotron.errors import ConfigError


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="zerotron convert", description=__doc__.split("\n")[0])
    p.add_argument("--from-hf", metavar="DIR", help="a transformers GPT2LMHeadModel directory")
    p.add_argument("--save", metavar="CKPT", help="where to write the zerotron checkpoint")
    p.add_argument("--load", metavar="CKPT", help="a zerotron checkpoint directory")
    p.add_argument("--tag", help="checkpoint tag (default: --load's latest; 'release' on import)")
    p.add_argument("--to-hf", metavar="DIR", help="where to write the transformers directory")
    p.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128, help="vocab padding on import"
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.from_hf and args.save and not (args.load or args.to_hf):
        hf_sd, hf_config = load_hf_dir(args.from_hf)
        padded = vocab_size_with_padding(hf_config["vocab_size"], args.make_vocab_size_divisible_by)
        config, sd = from_hf_state_dict(hf_sd, hf_config, padded)
        path = save_gpt(args.save, config, sd, tag=args.tag or "release", source=args.from_hf)
        print(f"imported {args.from_hf} -> {path}")
        return 0
    if args.load and args.to_hf and not (args.from_hf or args.save):
        model, _ = load_gpt(args.load, args.tag)
        hf_sd, hf_config = to_hf_state_dict(model.state_dict(), model.config)
        save_hf_dir(args.to_hf, hf_sd, hf_config)
        print(f"exported {args.load} -> {args.to_hf}")
        return 0
    raise ConfigError(
        "give either --from-hf DIR --save CKPT (import) or --load CKPT --to-hf DIR (export)",
        where="zerotron convert",
    )
