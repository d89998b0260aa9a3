"""Worker for tests/distributed/test_watchdog_launch.py: rank 1 stops coming, the others wait.

--mode collective: every rank all-reduces on the dp group twice; rank 1 sleeps before the
second one (in ``never_arrives``), so the others wait in all-reduce call 2 on the group.
--mode pipeline: a two-stage 1F1B pipeline (zerotron's PipelineRuntime, a linear layer per
stage); stage 1 sleeps in its forward of micro-batch 1 and never sends its gradient back, so
stage 0 waits in point-to-point messages with rank 1.

The process-group timeout is --timeout-s (default 120 s): the watchdog must end the job long
before it. Each rank prints its pid, so a test that times out can kill what is left.
"""

import argparse
import os
import time

import torch
from torch import nn

from zerotron.distributed import comm, init_distributed
from zerotron.distributed.state import initialize_model_parallel

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--mode", choices=["collective", "pipeline"], required=True)
parser.add_argument("--timeout-s", type=float, default=120.0)
args = parser.parse_args()


def never_arrives() -> None:
    time.sleep(args.timeout_s)


class Stage(nn.Module):
    """A pipeline chunk: a linear layer; rank 1 stops in micro-batch 1."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.lin = nn.Linear(4, 4)

    def forward(self, hidden, batch):
        if self.rank == 1 and batch["mb"] == 1:
            never_arrives()
        return self.lin(batch["x"] if hidden is None else hidden)


rank, _ = init_distributed(backend="gloo", timeout_minutes=args.timeout_s / 60, device="cpu")
print(f"pid rank={rank} pid={os.getpid()}", flush=True)
if args.mode == "collective":
    st = initialize_model_parallel()
    comm.all_reduce(torch.ones(4), st.dp)
    if rank == 1:
        never_arrives()
    comm.all_reduce(torch.ones(4), st.dp)
else:
    from zerotron.pipeline import PipelineRuntime

    initialize_model_parallel(pipeline_model_parallel_size=2)
    runtime = PipelineRuntime([Stage(rank)], "1f1b", 2, loss_fn=lambda out, batch: out.mean())
    batches = [{"x": torch.ones(2, 4), "mb": i} for i in range(2)]
    runtime.train_step(iter(batches))
print("done", flush=True)
