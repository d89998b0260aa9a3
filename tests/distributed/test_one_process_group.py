"""A process group always exists once deepspeed.initialize() / init_distributed() ran, also with
one process: a script that then uses torch.distributed itself (rank, barrier, all_reduce,
DistributedSampler) runs as plain ``python script.py`` and under ``zerotron launch
--nproc_per_node 1``, and exits cleanly (the group is destroyed at exit)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "distributed", "launch_scripts", "one_process_group.py")
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# A plain process's init_distributed is also in tests/test_compat_comm.py (in-process).
@pytest.mark.parametrize(
    "how,entry", [("plain", "initialize"), ("launch", "initialize"), ("launch", "init")]
)
def test_a_script_uses_torch_distributed_with_one_process(how, entry):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    launcher = (
        ["-m", "zerotron.launcher.launch", "--nproc_per_node", "1"] if how == "launch" else []
    )
    r = subprocess.run(
        [sys.executable, *launcher, SCRIPT, "--entry", entry],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    seen = json.loads(re.findall(r"^(?:\[rank0\]: )?(\{.*\})$", r.stdout, re.M)[-1])
    assert seen == {
        "initialized": True,
        "rank": 0,
        "world": 1,
        "backend": "gloo",
        "sampler": [0, 1, 2, 3, 4],
        "sum": [1.0, 1.0, 1.0],
        "ds_rank": 0,
        "ledger": 0,
    }
