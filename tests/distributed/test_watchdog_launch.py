"""Hangs under zerotron launch: a rank that stops coming is named within the watchdog's
threshold, and the job ends long before the process-group timeout.

Two gloo ranks of tests/distributed/launch_scripts/hang.py with a 120 s process-group timeout
and --watchdog-timeout 2: rank 1 sleeps before an all-reduce (the others wait in it), or, as
stage 1 of a two-stage pipeline, never sends its gradient back. The launcher's summary must name
rank 1 and what the others wait in, and the job must end with exit code 124 in well under 120 s.
"""

from __future__ import annotations

import os
import re

import pytest

from .test_faults_dist import REPO, _gone, _launch, _summary

HANG = os.path.join(REPO, "tests", "distributed", "launch_scripts", "hang.py")
PG_TIMEOUT_S = 120


def _hang(mode: str):
    r, seconds = _launch(
        ["--nproc_per_node", "2", "--shutdown_timeout", "1", "--watchdog-timeout", "2", HANG]
        + ["--mode", mode, "--timeout-s", str(PG_TIMEOUT_S)],
        timeout=PG_TIMEOUT_S,
    )
    pids = [int(p) for p in re.findall(r"pid rank=\d pid=(\d+)", r.stdout)]
    return r, seconds, _summary(r.stderr), pids


@pytest.mark.parametrize(
    "mode, waits",
    [
        ("collective", "in all_reduce on the dp group [0, 1] (call 2 on the group, 16 bytes)"),
        ("pipeline", "in batch_isend_irecv with rank 1 ("),
    ],
)
def test_the_watchdog_names_the_rank_that_never_arrived(mode, waits):
    r, seconds, summary, pids = _hang(mode)
    assert r.returncode == 124, r.stderr
    told = [line.removeprefix("watchdog: ") for line in summary if line.startswith("watchdog: ")]
    assert told[0].startswith("rank 0 has waited "), r.stderr
    assert told[0].endswith("; asking every rank where it is")
    assert told[1].startswith("rank 0 waited ") and waits in told[1]
    assert told[2] == "never arrived: rank 1"
    assert (
        told[3] == "rank 1 is not waiting in a collective (busy or sleeping elsewhere); its stack:"
    )
    assert "in never_arrives" in "\n".join(told[4:])  # where rank 1 is: its own stack
    assert told[-1].startswith("ending the job (exit code 124)")
    assert "[rank0]: zerotron watchdog: rank 0 has waited" in r.stderr  # the rank's own line
    assert seconds < PG_TIMEOUT_S / 3  # start-up + 2 s + the answers + 1 s to SIGKILL
    assert len(pids) == 2 and all(_gone(p) for p in pids)
