"""A stand-in for SLURM's ``srun`` (slurmd cannot run here), for tests/distributed/
test_multinode.py: it records its arguments and environment, then does what ``srun --nodes N
--ntasks-per-node 1 --label --nodelist H0,H1 --chdir DIR ... COMMAND`` does in an allocation:
runs COMMAND once per node, in that node's network namespace (``$FAKE_SRUN_NETNS``: a JSON
object host -> namespace) with SLURM_NODEID / SLURM_PROCID set, each output line labelled
``I: ``, and passes SIGTERM and SIGINT on. Its exit code is the highest of the tasks'.
"""

import json
import os
import signal
import subprocess
import sys
import threading

VALUED = {"--nodes", "--ntasks-per-node", "--nodelist", "--chdir", "--export"}

argv = sys.argv[1:]
exported = ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")
with open(os.environ["FAKE_SRUN_RECORD"], "w", encoding="utf-8") as f:
    json.dump({"argv": argv, "env": {k: os.environ.get(k) for k in exported}}, f)
opts, i = {}, 0
while argv[i].startswith("-"):
    if argv[i] in VALUED:
        opts[argv[i]], i = argv[i + 1], i + 2
    else:
        opts[argv[i]], i = True, i + 1
command, hosts = argv[i:], opts["--nodelist"].split(",")
netns = json.loads(os.environ["FAKE_SRUN_NETNS"])
tasks = [
    subprocess.Popen(
        ["ip", "netns", "exec", netns[host], *command],
        cwd=opts["--chdir"],
        env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for n, host in enumerate(hosts)
]


def forward(signum, frame):
    for task in tasks:
        task.send_signal(signum)


signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)


def label(n, pipe, out):
    for line in pipe:
        out.buffer.write(f"{n}: ".encode() + line)
        out.flush()


threads = [
    threading.Thread(target=label, args=(n, pipe, out))
    for n, task in enumerate(tasks)
    for pipe, out in ((task.stdout, sys.stdout), (task.stderr, sys.stderr))
]
for t in threads:
    t.start()
codes = [task.wait() for task in tasks]
for t in threads:
    t.join()
sys.exit(max(128 - c if c < 0 else c for c in codes))
