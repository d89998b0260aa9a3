"""``zerotron kernels``: the CPU kernel choices ``zerotron pretrain`` would make for a model shape.

Prints the one line pretrain prints (each choice, and whether it was measured, cached or forced:
:mod:`zerotron.kernels.chooser`), measuring on this machine if nothing is cached yet. With
``--pick-precision`` it prints only ``bf16`` or ``fp32``, the faster training precision for the
shape here (timed once and cached): ``examples/demo.sh`` trains in what it prints.

    zerotron kernels --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --micro-batch-size 4 --bf16
    zerotron kernels --hidden-size 256 --num-attention-heads 4 --seq-length 128 \\
        --micro-batch-size 16 --pick-precision
    zerotron kernels --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \\
        --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse

import torch

from zerotron.engine.builder import default_device
from zerotron.kernels import KernelShape, choose_kernels
from zerotron.kernels.chooser import choose_precision

GPT2_VOCAB = 50257


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerotron kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, help="default GPT-2's")
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="measure one tensor-parallel rank's shards, as pretrain with this size does",
    )
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    p.add_argument(
        "--kernels", help="force choices, e.g. linear=torch,attention=sdpa,loss_chunk=4096"
    )
    p.add_argument(
        "--pick-precision",
        action="store_true",
        help="print only the faster precision here, bf16 or fp32 (measured once, cached)",
    )
    p.add_argument("--threads", type=int, help="torch threads while measuring (default: torch's)")
    args = p.parse_args(argv)
    for name in (
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden_size % args.num_attention_heads:
        p.error("--hidden-size must be a multiple of --num-attention-heads")
    if args.num_attention_heads % args.tensor_model_parallel_size:
        p.error("--num-attention-heads must be a multiple of --tensor-model-parallel-size")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    shape = KernelShape(
        hidden=args.hidden_size,
        heads=args.num_attention_heads,
        seq=args.seq_length,
        micro_batch=args.micro_batch_size,
        vocab=args.vocab_size,
        dtype=dtype,
        tp=args.tensor_model_parallel_size,
    )
    device = default_device()
    if args.pick_precision:
        print(choose_precision(shape, device)[0])
        return 0
    print(choose_kernels(shape, device, args.kernels, apply=False).line())
    return 0
