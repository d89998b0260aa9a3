"""Worker for tests/distributed/test_launch.py: rank --fail-rank breaks at step 2 while the
others wait.

--mode raise: the failing rank raises (Python exits with 1) and its peers are blocked in a gloo
all-reduce that it never joins. --mode exit3: the failing rank dies with os._exit(3) and its
peers sleep with SIGTERM ignored, so only the launcher's SIGKILL can end them. --mode kill9 /
--mode segv: the failing rank is killed by SIGKILL / dies of a segmentation fault (a read of
address 0) while its peers wait in the all-reduce.
--fail-attempts N: fail only in the first N attempts (TORCHELASTIC_RESTART_COUNT < N).
--step-seconds S: sleep S seconds in each step.
"""

import argparse
import atexit
import ctypes
import faulthandler
import os
import signal
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--mode", choices=["raise", "exit3", "kill9", "segv"], default="raise")
parser.add_argument("--fail-rank", type=int, default=1)
parser.add_argument("--fail-attempts", type=int, default=1 << 30)
parser.add_argument("--step-seconds", type=float, default=0.0)
args = parser.parse_args()

dist.init_process_group("gloo")
# Without this, gloo's threads can abort the interpreter's exit after the traceback (SIGABRT).
atexit.register(dist.destroy_process_group)
rank = dist.get_rank()
print(f"pid rank={rank} pid={os.getpid()}", flush=True)
if args.mode == "exit3" and rank != args.fail_rank:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
fails = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < args.fail_attempts
for step in range(5):
    if step == 2 and rank == args.fail_rank and fails:
        if args.mode == "exit3":
            os._exit(3)
        if args.mode == "kill9":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.mode == "segv":
            faulthandler.disable()  # the test wants the bare signal, not Python's dump
            ctypes.string_at(0)
        raise RuntimeError(f"rank {rank} gives up at step {step}")
    if step == 2 and args.mode == "exit3" and fails:
        time.sleep(600)
    time.sleep(args.step_seconds)
    x = torch.ones(4)
    dist.all_reduce(x)
    print(f"step {step} done", flush=True)
