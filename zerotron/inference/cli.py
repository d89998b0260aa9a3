"""``zerotron generate``: text from a checkpoint, with the shape read from its metadata.

zerotron generate --load work/demo/ckpt --prompt "It is a truth universally" --greedy
zerotron generate --load CKPT --prompts-file prompts.txt --top-p 0.9 --temperature 0.8
zerotron generate --load CKPT                      # interactive: empty line or `stop` quits
zerotron launch --nproc_per_node 2 -m zerotron generate --load CKPT --prompt "..."  # TP 2

A checkpoint of any tensor/pipeline layout loads (merged, see ``checkpoint.reshard``). Under
``zerotron launch`` (or torchrun) the processes split the model tensor-parallel
(``--tensor-model-parallel-size``, default: all of them): every rank runs the same decoding
loop with the same seed on the same gathered logits, so they choose the same tokens as one
process would with the same weights; only rank 0 prints, and in interactive mode reads the
prompts and hands them to the others.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import torch

from zerotron.checkpoint.model import load_gpt
from zerotron.config.args import ArgumentParser
from zerotron.data.tokenizer import build_tokenizer
from zerotron.distributed import comm
from zerotron.distributed.init import (
    destroy,
    get_rank,
    init_distributed,
    is_initialized,
    local_rank,
)
from zerotron.distributed.state import initialize_model_parallel
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
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        metavar="N",
        help="under zerotron launch: ranks that split the model (default: all of them)",
    )
    p.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="under zerotron launch: how long a collective may wait",
    )
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


def _init_parallel(args) -> tuple[torch.device, bool]:
    """Join the launcher's processes and build the tensor-parallel groups.

    Returns the device to use and whether this call created the process group (then
    :func:`main` tears it down again).
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    tp = args.tensor_model_parallel_size or world
    if tp < 1 or world % tp:
        raise ConfigError(
            f"tensor-parallel size {tp} does not divide the {world} process(es)",
            where="--tensor-model-parallel-size",
            fix=f"use a divisor of {world} (default: {world}, all processes)",
        )
    created = False
    if world > 1:
        created = not is_initialized()
        init_distributed(timeout_minutes=args.distributed_timeout_minutes)
        initialize_model_parallel(tp, 1)
    cuda = torch.cuda.is_available()
    return torch.device("cuda", local_rank()) if cuda else torch.device("cpu"), created


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    device, created = _init_parallel(args)
    try:
        return _generate(args, device)
    finally:
        if created:
            destroy()


def _generate(args, device: torch.device) -> int:
    is_printer = get_rank() == 0
    model, meta = load_gpt(
        args.load, args.tag, device=device, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    tok_meta = meta.get("tokenizer", {})
    tokenizer = build_tokenizer(
        tok_meta.get("type") or "GPT2BPETokenizer",
        args.vocab_file or tok_meta.get("vocab_file"),
        args.merge_file or tok_meta.get("merge_file"),
        vocab_size=tok_meta.get("vocab_size"),  # NullTokenizer's
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
        # The continuation as the whole text decodes it: NullTokenizer's ids need the space
        # between the prompt's last id and the first new one, which decoding `new` alone drops.
        head, whole = tokenizer.detokenize(ids), tokenizer.detokenize(ids + new)
        return whole[len(head) :] if whole.startswith(head) else tokenizer.detokenize(new)

    prompts = _prompts(args)
    if prompts is not None:
        for i, prompt in enumerate(prompts):
            text = prompt + run(prompt, args.seed + i)  # every rank decodes: TP needs them all
            if is_printer:
                print(text, flush=True)
                if len(prompts) > 1:
                    print("-" * 40)
        return 0
    if is_printer:
        print("interactive generation: type a prompt; an empty line or `stop` quits", flush=True)
    for i in itertools.count():
        prompt = _read_prompt() if is_printer else None
        prompt = comm.broadcast_text(prompt, comm.world_group(), device)
        if prompt is None:
            break
        text = prompt + run(prompt, args.seed + i)
        if is_printer:
            print(text, flush=True)
    return 0


def _read_prompt() -> str | None:
    """The next interactive prompt; None at end of input, an empty line or ``stop``."""
    try:
        prompt = input("> " if sys.stdin.isatty() else "")
    except EOFError:
        return None
    return None if not prompt.strip() or prompt.strip() == "stop" else prompt
