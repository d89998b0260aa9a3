"""Worker for tests/distributed/test_rank0_broadcast.py: a DeepSpeed-style script that seeds
torch with its rank before building the model (DeepSpeed broadcasts rank 0's weights at
initialize, so every rank trains rank 0's model), trains a few steps on its share of fixed data,
and saves the weights it started and ended with to ``--out/rank{rank}.pt``."""

import argparse
import os

import torch
from torch import nn

import zerotron as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=0)
parser.add_argument("--out", required=True)
parser.add_argument("--backward", choices=["engine", "torch"], default="engine")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

torch.set_num_threads(1)
deepspeed.init_distributed()
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
torch.manual_seed(rank)  # a different model on every rank, until initialize
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
GLOBAL_MICRO, GAS = 8, 2
config = {
    "train_micro_batch_size_per_gpu": GLOBAL_MICRO // world,
    "gradient_accumulation_steps": GAS,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": args.stage},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
initial = {k: v.clone() for k, v in engine.module_state_dict().items()}
g = torch.Generator().manual_seed(1234)  # the same data on every rank; each takes its share
share = GLOBAL_MICRO // world
for _ in range(3 * GAS):
    x, y = torch.randn(GLOBAL_MICRO, 8, generator=g), torch.randn(GLOBAL_MICRO, 1, generator=g)
    mine = slice(rank * share, (rank + 1) * share)
    loss = nn.functional.mse_loss(engine(x[mine]), y[mine])
    if args.backward == "torch":
        loss.backward()
    else:
        engine.backward(loss)
    engine.step()
final = engine.module_state_dict()
ranks = [engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size]
torch.save(
    {"initial": initial, "final": final, "ranks": ranks + [engine.mp_world_size]},
    os.path.join(args.out, f"rank{rank}.pt"),
)
