"""Elastic restarts and preemption (issue 15), on real hosts and a real launcher.

- A node lost mid-run: two hosts (network namespaces on one bridge, tests/multihost.py), one
  ``zerotron launch --nnodes 1:2 --max_restarts 2`` on each, training the tiny GPT-2 with a
  checkpoint every 3 iterations. Node 1's launcher and its rank are SIGKILLed after iteration 4;
  node 0's launcher names the node, rejoins torch's c10d rendezvous alone and its rank resumes
  from the newest complete checkpoint (iteration K) with data-parallel size 1. The reference is
  that very history computed apart: 2 ranks up to K, then one process resuming from their
  checkpoint. Every iteration's loss must match it (1e-5; the log prints 7 digits).
- ``--save-on-signal``: SIGTERM to a 2-rank launcher mid-run; the launcher passes it on, both
  ranks finish the same iteration, save there and exit with code 75, and so does the launcher.
  Resumed from that checkpoint, the losses equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.multihost import REPO, hosts
from zerotron.checkpoint import tag_for_iteration
from zerotron.config import parse_megatron_args
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

ITERS = 12
SAVE_EVERY = 3
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-3", "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "1", "--seed", "1234", "--train-iters", str(ITERS), "--num-workers", "0",
]  # fmt: skip
# ZeRO-1: the resumed run re-partitions the optimizer state of 2 ranks for 1.
ZERO = ["--use-distributed-optimizer"]
LOSS = re.compile(r"\[rank0\]:  iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")
# Quick rounds for a test: the last call after the fewest nodes are there, and a node is dropped
# after 3 missed heartbeats 1 s apart.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


class Launcher:
    """One ``zerotron launch`` whose output is collected line by line as it comes."""

    def __init__(self, argv: list[str]):
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            assert self.proc.poll() is None or self._pump.is_alive(), self.text
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text}"
            time.sleep(0.05)

    def finish(self, timeout: float = 120) -> int:
        """The launcher's exit code; one still running after ``timeout`` fails the test with
        everything it printed (where it stopped is the diagnosis)."""
        try:
            self.proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            self.proc.kill()
        self._pump.join(10)
        if timed_out:
            raise AssertionError(f"still running after {timeout} s:\n{self.text}")
        return self.proc.returncode

    def kill_tree(self) -> None:
        """SIGKILL the launcher and every process under it (its ranks lead their own sessions)."""
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return  # ended, and its ranks with it (the agent waited for them)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def _launch_args(*flags: str) -> list[str]:
    return [sys.executable, "-m", "zerotron.launcher.launch", "--nproc_per_node", *flags]


def losses_of(text: str) -> dict[int, float]:
    """Iteration -> lm loss of rank 0's log; a repeated iteration (after a restart) keeps its
    last value, the one the finished run went on from."""
    return {int(it): float(loss) for it, loss in LOSS.findall(text)}


def _pretrain(world_size: int, *flags: object):
    argv = [*TINY, *map(str, flags)]
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(parse_megatron_args(argv, world_size=world_size))


def _first_part(rank: int, data: str, save: str, until: int) -> dict[int, float]:
    """The reference's 2-rank part: iterations 1 .. until, saving as the elastic run did."""
    summary = _pretrain(2, "--data-path", data, "--save", save, "--save-interval", SAVE_EVERY,
                        "--exit-interval", until, *ZERO)  # fmt: skip
    return summary.losses


@pytest.mark.xdist_group("elastic")
def test_a_lost_node_restarts_the_job_on_the_rest_from_the_last_checkpoint(data_prefix, tmp_path):
    save = str(tmp_path / "elastic")
    job = [*TINY, "--data-path", data_prefix, "--save", save, "--load", save]
    job += ["--save-interval", str(SAVE_EVERY), *ZERO]
    with hosts(2) as (h0, h1):
        flags = ["1", "--nnodes", "1:2", "--max_restarts", "2", "--master_addr", h0.addr]
        flags += ["--master_port", "29519", "--rdzv_timeout", "60", "--rdzv_conf", RDZV_CONF]

        def node(host, rank: int) -> Launcher:
            argv = _launch_args(*flags, "--node_rank", str(rank), "-m", "zerotron", "pretrain")
            return Launcher(host.argv(*argv, *job))

        n1 = node(h1, 1)  # first: it waits for node 0's store, so both join the first round
        n0 = node(h0, 0)
        try:
            n0.wait_for(r"iteration\s+4/")
            n1.kill_tree()
            code = n0.finish()
        finally:
            n1.kill_tree()
            n0.kill_tree()
    out = n0.text
    assert code == 0, out
    # The first round had both nodes (one model replica per node), the second node 0 alone.
    assert "model parallel rank (0, 0): " in out, out
    assert "node 1 (10.213.8.2) left the job" in out, out
    assert "restart 1: going on with 1 node(s) of 1..2 nodes" in out, out
    assert "the job finished on the nodes left: node 1 (10.213.8.2) was lost (restart 1)" in out
    # It resumed from the newest checkpoint saved before the loss.
    before, after = out.split("node 1 (10.213.8.2) left the job")
    saved = [int(i) for i in re.findall(r"saved checkpoint at iteration (\d+)", before)]
    (resumed,) = map(int, re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)",
                                      after))  # fmt: skip
    # (a save finished as the peer vanished may be complete without its line printed)
    assert saved and resumed >= max(saved) and resumed % SAVE_EVERY == 0, out

    for tag, dp in ((resumed, 2), (ITERS, 1)):  # saved by 2 nodes, then by node 0 alone
        meta = json.loads((Path(save) / tag_for_iteration(tag) / "metadata.json").read_text())
        assert meta["layout"]["data_parallel_size"] == dp, tag

    ref_save = str(tmp_path / "reference")
    first = run_ranks(_first_part, 2, data_prefix, ref_save, resumed, timeout=240)[0]
    rest = _pretrain(1, "--data-path", data_prefix, "--load", ref_save, *ZERO).losses
    reference = {**first, **rest}
    got = losses_of(out)
    assert sorted(got) == sorted(reference) == list(range(1, ITERS + 1)), out
    for it in reference:
        assert got[it] == pytest.approx(reference[it], rel=1e-5), it


@pytest.mark.xdist_group("elastic")
def test_sigterm_saves_at_one_iteration_on_every_rank_and_resumes_exactly(data_prefix, tmp_path):
    save = str(tmp_path / "preempted")
    argv = _launch_args("2", "-m", "zerotron", "pretrain", *TINY, "--data-path", data_prefix,
                        "--save", save, "--save-interval", "1000", "--save-on-signal")  # fmt: skip
    job = Launcher(argv)
    try:
        job.wait_for(r"iteration\s+3/")
        job.proc.send_signal(signal.SIGTERM)  # to the launcher: it passes SIGTERM to the ranks
        code = job.finish()
    finally:
        job.kill_tree()
    out = job.text
    assert code == 75, out
    stop = re.search(r"exiting program after receiving SIGTERM: saved checkpoint at iteration "
                     r"(\d+)", out)  # fmt: skip
    assert stop, out
    at = int(stop.group(1))
    assert 3 <= at < ITERS, out
    assert f"stopped on SIGTERM at iteration {at} with a checkpoint in {save}" in out
    assert "every local rank saved a checkpoint and exited" in out, out
    first = losses_of(out)
    assert sorted(first) == list(range(1, at + 1)), out

    rest = _pretrain(1, "--data-path", data_prefix, "--load", save).losses
    whole = _pretrain(1, "--data-path", data_prefix).losses
    assert sorted({**first, **rest}) == sorted(whole)
    for it, loss in {**first, **rest}.items():
        assert loss == pytest.approx(whole[it], rel=1e-5), it
