"""Worker for tests/distributed/test_launch_process.py: write what this rank is (PID, CPU
affinity, OMP_NUM_THREADS) to DIR/rank{RANK}.json, then wait to be killed (no torch: quick)."""

import json
import os
import sys
import time

out_dir = sys.argv[-1]
rank = os.environ["RANK"]
report = {
    "pid": os.getpid(),
    "cpus": sorted(os.sched_getaffinity(0)),
    "omp": os.environ.get("OMP_NUM_THREADS"),
}
tmp = os.path.join(out_dir, f".rank{rank}.json")
with open(tmp, "w") as f:
    json.dump(report, f)
os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))  # whole, or not there
time.sleep(120)  # the test kills the launcher; the kernel must take this rank with it
