"""zerotron launch --hostfile, real runs on this machine: a hostfile of this host alone runs here
with the selected slots, and a two-host hostfile run with --no_ssh (one launcher per "host", both
here: 127.0.0.1 and localhost) forms one job. (Without ranks: tests/test_hostfile.py.)
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLREDUCE = os.path.join(REPO, "tests", "distributed", "launch_scripts", "allreduce.py")
LAUNCH = [sys.executable, "-m", "zerotron.launcher.launch"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


def _reports(text: str) -> list[tuple[str, str, str]]:
    return sorted(re.findall(r"report rank=(\d) world=(\d) sum=(\S+)", text))


def test_a_hostfile_of_this_host_runs_here(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=3\n")
    r = subprocess.run(
        [*LAUNCH, "--hostfile", "hosts", "--exclude", "localhost:1", ALLREDUCE],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _reports(r.stdout) == [("0", "2", "3"), ("1", "2", "3")]
    assert "1 node(s), 2 rank(s): localhost slots 0,2" in r.stderr


def test_two_hosts_with_no_ssh_form_one_job(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\nlocalhost slots=2\n")
    nodes = [
        subprocess.Popen(
            [*LAUNCH, "--hostfile", "hosts", "--no_ssh", "--node_rank", str(i)]
            + ["--master_port", port, "--rdzv_timeout", "60", ALLREDUCE],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outs]
    assert _reports(outs[0][0] + outs[1][0]) == [("0", "3", "6"), ("1", "3", "6"), ("2", "3", "6")]
    # the nodes run 1 and 2 ranks: each banner says the ranks the agent gave it
    banners = [
        re.findall(r"zerotron launch: (node \d of 2: ranks? [-\d]+ of 3),", e) for _, e in outs
    ]
    assert banners == [["node 0 of 2: rank 0 of 3"], ["node 1 of 2: ranks 1-2 of 3"]]
