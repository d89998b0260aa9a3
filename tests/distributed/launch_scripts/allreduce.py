"""Worker for tests/distributed/test_launch.py: one gloo all-reduce, then report what this rank
saw."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--tag", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "OMP_NUM_THREADS", "WORLD_SIZE")}
print(
    f"report rank={rank} world={world} sum={x.item():g} local_rank_arg={args.local_rank} "
    f"local_rank_env={env['LOCAL_RANK']} omp={env['OMP_NUM_THREADS']} tag={args.tag} "
    f"argv={sys.argv[1:]}"
)
print(f"to stderr from rank {rank}", file=sys.stderr)
dist.destroy_process_group()
