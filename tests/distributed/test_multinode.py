"""``zerotron launch --hostfile`` on real hosts (issue 15): two network namespaces on one bridge
(10.213.8.1 and .2, tests/multihost.py), each with a real OpenSSH server; the launching launcher
runs on the first host and starts both nodes through ssh (itself included), pdsh, Open MPI's
mpirun, MPICH's, or a recorded stand-in for SLURM's srun (slurmd cannot run here).

- a 2-node x 2-process ``zerotron pretrain`` through ssh, and through ``--no_ssh`` (one launcher
  per host, by hand), logs the losses of the same run in one process;
- pdsh's ``%n`` gives node ranks in the hostfile's order (hosts listed in reverse), and a rank
  that fails on node 1 is named, with its node, in the launcher's exit code and message;
- both MPIs' mpirun and srun run a job across both hosts;
- SIGTERM, and SIGKILL (with one node's ssh connection cut), of the launching launcher leave no
  process behind on either host.

Needs root, the ``ip`` tool, and Debian's openssh-server, pdsh, openmpi-bin and mpich
(``make multihost-deps``); skipped with the reason only where the kernel refuses namespaces.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.multihost import REPO, hosts, need, sshd

SCRIPTS = os.path.join(REPO, "tests", "distributed", "launch_scripts")
ALLREDUCE = os.path.join(SCRIPTS, "allreduce.py")
FAIL_AT_STEP = os.path.join(SCRIPTS, "fail_at_step.py")
ITERS = 3
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3", "--split", "80,10,10",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--seed", "1234",
    "--train-iters", str(ITERS), "--num-workers", "0",
]  # fmt: skip
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.* lm loss: (\S+) \|")
TIMEOUT = 240

pytestmark = pytest.mark.xdist_group("multinode")  # one pair of hosts for the module


class Cluster:
    """Two hosts with sshd, a hostfile, and how to run a launcher on the first."""

    def __init__(self, made, servers, tmp):
        self.hosts, self.servers, self.tmp = made, servers, tmp
        self.hostfile = os.path.join(tmp, "hostfile")
        with open(self.hostfile, "w") as f:
            f.write("# two namespaces\n10.213.8.1 slots=2\n10.213.8.2 slots=2\n")
        self.reversed = os.path.join(tmp, "hostfile.reversed")
        with open(self.reversed, "w") as f:
            f.write("10.213.8.2 slots=1\n10.213.8.1 slots=1\n")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
        return {**env, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **extra}

    def launch(self, *args: str, host: int = 0, env: dict | None = None) -> subprocess.Popen:
        """``zerotron launch ARGS`` on host ``host`` (its process is the launcher's own)."""
        return subprocess.Popen(
            self.hosts[host].python("-m", "zerotron", "launch", *args),
            cwd=REPO,
            env=env or self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ssh_args(self) -> list[str]:
        return ["--launcher_args", f"-F {self.servers.config}"]

    def leftovers(self, within: float = 30.0) -> dict[str, set[int]]:
        """Processes still in each host's namespace, its sshd server aside, once none are left
        or ``within`` seconds have passed (sessions take a moment to close)."""
        deadline = time.monotonic() + within
        while True:
            left = {h.addr: h.pids() - self.servers.pids for h in self.hosts}
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("cluster"))
    with hosts(2) as made, sshd(made, tmp) as servers:
        yield Cluster(made, servers, tmp)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def losses(text: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(text)}


@pytest.fixture(scope="module")
def one_process(data_prefix) -> dict[int, float]:
    """The losses of the same pretrain in one process (4 micro-batches accumulated)."""
    from zerotron.config import parse_megatron_args
    from zerotron.training.pretrain import pretrain

    result = pretrain(parse_megatron_args([*TINY, "--data-path", data_prefix], world_size=1))
    assert sorted(result.losses) == list(range(1, ITERS + 1))
    return result.losses


def assert_same_losses(text: str, expected: dict[int, float]) -> None:
    got = losses(text)
    assert sorted(got) == sorted(expected), text[-3000:]
    for i, loss in expected.items():
        assert abs(got[i] - loss) <= 1e-5, (i, got[i], loss)


def test_ssh_starts_a_2x2_pretrain_equal_to_one_process(cluster, data_prefix, one_process):
    p = cluster.launch(
        "--hostfile", cluster.hostfile, *cluster.ssh_args(), "--master_port", "29521",
        "-m", "zerotron", "pretrain", *TINY, "--data-path", data_prefix,
    )  # fmt: skip
    code, out, err = finish(p)
    assert code == 0, err[-5000:]
    assert_same_losses(out, one_process)
    # every node ran its share, each line with its host in front
    assert "10.213.8.1: zerotron launch: node 0 of 2: ranks 0-1 of 4" in err
    assert "10.213.8.2: zerotron launch: node 1 of 2: ranks 2-3 of 4" in err
    assert "10.213.8.2: zerotron launch: node 1 exits with code 0" in err
    assert cluster.leftovers() == {"10.213.8.1": set(), "10.213.8.2": set()}


def test_no_ssh_runs_the_same_pretrain_by_hand(cluster, data_prefix, one_process):
    nodes = [
        cluster.launch(
            "--hostfile",
            cluster.hostfile,
            "--no_ssh",
            "--node_rank",
            str(i),
            "--master_port",
            "29522",
            "-m",
            "zerotron",
            "pretrain",
            *TINY,
            "--data-path",
            data_prefix,
            host=i,
        )  # fmt: skip
        for i in range(2)
    ]
    results = [finish(p) for p in nodes]
    assert [code for code, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    assert_same_losses(results[0][1] + results[1][1], one_process)
    # each launcher gave its ranks this host's own interface (not the 127.x its name resolves
    # to: gloo's "connectFullMesh failed ... remote=[127.0.0.1]" before the launcher named it)
    for host, (_, _, err) in zip(cluster.hosts, results, strict=True):
        assert f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={host.link}" in err


def test_pdsh_numbers_nodes_in_hostfile_order_and_names_the_failed_node(cluster):
    need("pdsh")
    # Hosts listed in reverse: node 0 is 10.213.8.2, node 1 (rank 1) is 10.213.8.1.
    env = cluster.env(PDSH_SSH_ARGS_APPEND=f"-F {cluster.servers.config}")
    p = cluster.launch(
        "--hostfile", cluster.reversed, "--launcher", "pdsh", "--master_port", "29523",
        "--shutdown_timeout", "3", FAIL_AT_STEP, "--fail-rank", "1", env=env,
    )  # fmt: skip
    code, out, err = finish(p)
    assert code == 1, err[-5000:]
    assert "10.213.8.2: [rank0]: step 1 done" in out  # a job across both hosts ran
    assert "10.213.8.1: [rank1]: step 1 done" in out
    assert "zerotron launch: node 1 (10.213.8.1) failed first: rank 1, exit code 1\n" in err
    assert "zerotron launch: cause: RuntimeError: rank 1 gives up at step 2\n" in err
    assert "zerotron launch:   rank 1's traceback:\n" in err  # node 1's own account
    assert "then: node 0 (10.213.8.2): rank 0, exit code 1 (a peer left)\n" in err


def test_openmpi_runs_one_launcher_per_host(cluster):
    need("mpirun")
    mca = f"--allow-run-as-root --mca plm_rsh_args '-F {cluster.servers.config}'"
    p = cluster.launch(
        "--hostfile", cluster.hostfile, "--num_gpus", "1", "--launcher", "openmpi",
        "--launcher_args", mca, "--master_port", "29524", ALLREDUCE,
    )  # fmt: skip
    code, out, err = finish(p)
    assert code == 0, err[-5000:]
    for rank, host in enumerate(("10.213.8.1", "10.213.8.2")):
        assert f"{host}: [rank{rank}]: report rank={rank} world=2 sum=3" in out


def test_mpich_runs_one_launcher_per_host(cluster, tmp_path):
    need("mpirun.mpich")
    # Debian installs MPICH's mpirun as mpirun.mpich beside Open MPI's (the default `mpirun`);
    # on a cluster `module load mpich` puts it first on PATH, as this does.
    bin_dir = tmp_path / "mpich-bin"
    bin_dir.mkdir()
    mpirun = os.path.realpath(shutil.which("mpirun.mpich"))
    (bin_dir / "mpirun").symlink_to(mpirun)
    # Hydra runs the hydra_pmi_proxy beside the mpirun it was started as
    proxy = os.path.join(os.path.dirname(mpirun), "hydra_pmi_proxy")
    (bin_dir / "hydra_pmi_proxy").symlink_to(proxy)
    # Hydra starts its proxies with ssh; this one takes the test servers' client config.
    ssh = bin_dir / "ssh-test-hosts"
    ssh.write_text(f'#!/bin/sh\nexec ssh -F {cluster.servers.config} "$@"\n')
    ssh.chmod(0o755)
    hydra = f"-launcher ssh -launcher-exec {ssh}"
    p = cluster.launch(
        "--hostfile", cluster.hostfile, "--num_gpus", "1", "--launcher", "mpich",
        "--launcher_args", hydra, "--master_port", "29530", ALLREDUCE,
        env=cluster.env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
    )  # fmt: skip
    code, out, err = finish(p)
    assert code == 0, err[-5000:]
    for rank, host in enumerate(("10.213.8.1", "10.213.8.2")):
        assert f"{host}: [rank{rank}]: report rank={rank} world=2 sum=3" in out


def test_slurm_runs_srun_with_one_task_per_node(cluster, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = os.path.join(SCRIPTS, "fake_srun.py")
    (bin_dir / "srun").write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    record = tmp_path / "srun.json"
    netns = {h.addr: h.netns for h in cluster.hosts}
    env = cluster.env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SRUN_RECORD=str(record),
        FAKE_SRUN_NETNS=json.dumps(netns),
    )
    p = cluster.launch(
        "--hostfile", cluster.hostfile, "--num_gpus", "1", "--launcher", "slurm",
        "--master_port", "29525", ALLREDUCE, env=env,
    )  # fmt: skip
    code, out, err = finish(p)
    assert code == 0, err[-5000:]
    for rank, host in enumerate(("10.213.8.1", "10.213.8.2")):
        assert f"{host}: [rank{rank}]: report rank={rank} world=2 sum=3" in out
    called = json.loads(record.read_text())
    argv = called["argv"]
    assert argv[:10] == [
        "--nodes", "2", "--ntasks-per-node", "1", "--label", "--nodelist",
        "10.213.8.1,10.213.8.2", "--chdir", REPO, "--export",
    ]  # fmt: skip
    assert argv[argv.index("--node_rank_env") + 1] == "SLURM_NODEID"
    assert argv[argv.index("--lifeline") + 1] == "parent"
    assert called["env"] == {"PYTHONPATH": f"{REPO}:{REPO}", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_the_launching_launcher_leaves_no_process_on_any_host(cluster, sig):
    p = cluster.launch(
        "--hostfile", cluster.hostfile, "--num_gpus", "1", *cluster.ssh_args(),
        "--master_port", str(29526 + sig), "--shutdown_timeout", "3",
        FAIL_AT_STEP, "--fail-rank", "-1", "--step-seconds", "60",
    )  # fmt: skip
    seen = ""
    deadline = time.monotonic() + TIMEOUT
    while not ("[rank0]: pid rank=0" in seen and "[rank1]: pid rank=1" in seen):
        line = p.stdout.readline()
        assert line and time.monotonic() < deadline, seen + p.stderr.read()
        seen += line
    if sig == signal.SIGKILL:
        # ... and node 1's connection drops too: its ssh client dies with the launcher.
        (ssh,) = [c for c in psutil.Process(p.pid).children() if "10.213.8.2" in c.cmdline()]
        ssh.kill()
    p.send_signal(sig)
    code, _, err = finish(p, timeout=60)
    if sig == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM, err[-3000:]
        assert "zerotron launch: stopped by SIGTERM; every node was stopped" in err
        assert "10.213.8.2: zerotron launch: node 1 exits with code 143" in err
    else:
        assert code == -signal.SIGKILL
    # Both nodes' launchers saw their input close (node 0: its ssh client passed the end of the
    # dead launcher's pipe on; node 1: sshd lost the connection), stopped their ranks and ended.
    assert cluster.leftovers(within=60) == {"10.213.8.1": set(), "10.213.8.2": set()}
