"""``zerotron generate``: text from a checkpoint, with the shape read from its metadata.

zerotron generate --load work/demo/ckpt --prompt "It is a truth universally" --greedy
zerotron generate --load CKPT --prompts-file prompts.txt --top-p 0.9 --temperature 0.8
zerotron generate --load CKPT                      # interactive: empty line or `stop` quits
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from zerotron.checkpoint.model import load_gpt
from zerotron.config.args import ArgumentParser
from zerotron.data.tokenizer import build_tokenizer
from zerotron.errors import ConfigError, DataError
from zerotron.inference.generate import generate


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="zerotron generate", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, metavar="CKPT", help="checkpoint directory")
    p.add_argument("--tag", help="checkpoint tag (default: the latest)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", metavar="F", help="one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="divide logits by this")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filtering")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus filtering")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (+i for prompt i)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the prefix each step")
    p.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    p.add_argument("--vocab-file", help="override the checkpoint's tokenizer vocab")
    p.add_argument("--merge-file", help="override the checkpoint's tokenizer merges")
    return p


def _prompts(args) -> list[str] | None:
    if args.prompt is not None:
        return [args.prompt]
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise DataError("file not found", where=str(path), fix="pass an existing text file")
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, meta = load_gpt(
        args.load, args.tag, device=device, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    tok_meta = meta.get("tokenizer", {})
    tokenizer = build_tokenizer(
        tok_meta.get("type") or "GPT2BPETokenizer",
        args.vocab_file or tok_meta.get("vocab_file"),
        args.merge_file or tok_meta.get("merge_file"),
    )
    if tokenizer.vocab_size != model.config.orig_vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} tokens, the checkpoint's model "
            f"{model.config.orig_vocab_size}",
            where=args.load,
            fix="pass the --vocab-file/--merge-file the model was trained with",
        )

    def run(prompt: str, seed: int) -> str:
        ids = tokenizer.tokenize(prompt)
        if not ids:
            ids = [tokenizer.eod]  # an empty prompt starts a new document
        new = generate(
            model,
            ids,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            greedy=args.greedy,
            eod=tokenizer.eod,
            seed=seed,
            use_kv_cache=not args.no_kv_cache,
        )
        if new and new[-1] == tokenizer.eod:
            new = new[:-1]
        return tokenizer.detokenize(new)

    prompts = _prompts(args)
    if prompts is not None:
        for i, prompt in enumerate(prompts):
            print(prompt + run(prompt, args.seed + i), flush=True)
            if len(prompts) > 1:
                print("-" * 40)
        return 0
    print("interactive generation: type a prompt; an empty line or `stop` quits", flush=True)
    for i in itertools.count():
        try:
            prompt = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        if not prompt.strip() or prompt.strip() == "stop":
            break
        print(prompt + run(prompt, args.seed + i), flush=True)
    return 0
