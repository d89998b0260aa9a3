"""Worker for tests/distributed/test_faults_dist.py: rank --bad-rank misbehaves at step 2 while
the others go on to that step's all-reduce on the dp group (zerotron's comm, gloo).

--mode stop: the bad rank SIGSTOPs itself (stuck: only SIGKILL ends it); the others' all-reduce
times out after --timeout-s seconds with a DistributedError naming it.
--mode clean-error: the bad rank fails the way zerotron's CLI does (one error line, exit 2), and
takes a second to exit after closing its connections, so its peers' "a peer left" errors come
before its exit.
--mode exit0: the bad rank leaves the loop and exits 0 early.
"""

import argparse
import os
import signal
import sys
import time

import torch

from zerotron.distributed import comm, destroy, init_distributed
from zerotron.distributed.state import initialize_model_parallel

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--mode", choices=["stop", "clean-error", "exit0"], required=True)
parser.add_argument("--bad-rank", type=int, default=1)
parser.add_argument("--timeout-s", type=float, default=60.0)
args = parser.parse_args()

rank, _ = init_distributed(backend="gloo", timeout_minutes=args.timeout_s / 60, device="cpu")
st = initialize_model_parallel()
print(f"pid rank={rank} pid={os.getpid()}", flush=True)
for step in range(5):
    if step == 2 and rank == args.bad_rank:
        if args.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif args.mode == "clean-error":
            print(
                f"zerotron pretrain: error: rank {rank}: data: bad batch at step 2", file=sys.stderr
            )
            destroy()
            time.sleep(1.0)
            os._exit(2)  # no interpreter teardown: gloo's sometimes aborts it (SIGABRT)
        else:
            destroy()
            sys.stdout.flush()
            os._exit(0)
    comm.all_reduce(torch.ones(4), st.dp)
    print(f"step {step} done", flush=True)
