"""A DeepSpeed-style script that uses torch.distributed itself after ``deepspeed.initialize``
(or ``deepspeed.init_distributed`` with ``--entry init``): rank, barrier, a DistributedSampler.
Run with one process, plainly or under ``zerotron launch --nproc_per_node 1``; prints one JSON
line of what it saw."""

import argparse
import json

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import zerotron as deepspeed
from zerotron.distributed.comm import ledger

parser = argparse.ArgumentParser()
parser.add_argument("--entry", choices=["initialize", "init"], default="initialize")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

if args.entry == "init":
    deepspeed.init_distributed()
else:
    model = torch.nn.Linear(4, 2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

dist.barrier()
t = torch.ones(3)
dist.all_reduce(t)
deepspeed.comm.all_reduce(t)
deepspeed.comm.barrier()
print(
    json.dumps(
        {
            "initialized": dist.is_initialized(),
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "backend": dist.get_backend(),
            "sampler": list(DistributedSampler(range(5), shuffle=False)),
            "sum": t.tolist(),
            "ds_rank": deepspeed.comm.get_rank(),
            "ledger": ledger.count(),
        }
    ),
    flush=True,
)
