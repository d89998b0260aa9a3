"""zerotron launch, one node's process-level pieces without starting ranks: core binding
(--bind_cores_to_rank / --bind_core_list), the worker bootstrap's options, the --save_pid file,
the banner (global ranks as the agent gave them, also with uneven nodes), and the flags every
node's launcher gets. (Real runs: tests/distributed/test_launch_process.py.)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from zerotron.errors import ConfigError
from zerotron.launcher import binding, bootstrap, launch, multinode, network, pidfile

# -- core binding -------------------------------------------------------------------------------


def test_cpu_lists_parse_and_print_as_ranges():
    assert binding.parse_cpu_list("7,1,3-5") == [1, 3, 4, 5, 7]
    assert binding.format_cpu_list([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"


@pytest.mark.parametrize(
    "text, what",
    [("1-", "'1-' is not a CPU or a range"), ("5-3", "range '5-3' runs backwards"),
     ("0-2,2", "CPU 2 is listed twice"), ("a", "'a' is not a CPU"), ("", "'' is not a CPU")],
)  # fmt: skip
def test_a_bad_cpu_list_is_named(text, what):
    with pytest.raises(ConfigError, match=re.escape(f"--bind_core_list {text!r}: ")) as e:
        binding.parse_cpu_list(text)
    assert what in str(e.value)


def test_hyperthread_siblings_are_one_core_given_to_one_rank():
    siblings = {c: frozenset({c % 4, c % 4 + 4}) for c in range(8)}  # 4 cores, 2 threads each
    cores = binding.physical_cores(range(8), siblings)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert binding.shares(cores, 2, "x") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_shares_are_even_and_the_cores_left_over_unused():
    assert binding.shares([[c] for c in range(5)], 2, "x") == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match=r"1 core\(s\) \(x\) cannot give each of 2 local ranks"):
        binding.shares([[0]], 2, "x")


def test_the_core_list_is_shared_cpu_by_cpu():
    a, *_ = sorted(os.sched_getaffinity(0))
    bound = binding.rank_cpus(1, str(a))
    assert (bound.cpus, bound.cores_per_rank) == ([[a]], 1)
    assert bound.describe() == f"cores per local rank: {a}"


def test_a_listed_cpu_the_launcher_may_not_use_is_refused():
    with pytest.raises(ConfigError, match="CPU 99999 is not one this launcher may use"):
        binding.rank_cpus(1, "99999")


def test_memory_is_bound_to_the_numa_node_holding_all_of_a_ranks_cpus():
    nodes = {0: frozenset({0, 1}), 1: frozenset({2, 3})}
    assert binding.memory_nodes([[0, 1], [2, 3], [1, 2]], nodes) == [0, 1, None]
    assert binding.memory_nodes([[0], [1]], {0: frozenset({0, 1})}) == [None, None]


# -- the worker bootstrap -----------------------------------------------------------------------


def test_bootstrap_options_pick_the_local_ranks_share():
    argv = ["--parent", "7", "--cpus", "0,4;1,5", "--membind", "0;", "--numactl", "/bin/numactl"]
    options, program = bootstrap.parse([*argv, "--", "-u", "t.py", "--x"])
    assert program == ["-u", "t.py", "--x"]
    assert [bootstrap.cpus_of(options, r) for r in (0, 1)] == [{0, 4}, {1, 5}]
    assert bootstrap.command(options, program, 0) == [
        "/bin/numactl", "--membind=0", "--", sys.executable, "-u", "t.py", "--x",
    ]  # fmt: skip
    assert bootstrap.command(options, program, 1) == [sys.executable, "-u", "t.py", "--x"]
    assert bootstrap.cpus_of({}, 0) is None


def test_a_worker_whose_launcher_is_already_gone_kills_itself():
    code = "from zerotron.launcher import bootstrap; bootstrap.die_with_parent(1); print('alive')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (-9, "")  # its parent is not PID 1


# -- --save_pid ---------------------------------------------------------------------------------


@pytest.fixture
def pid_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(pidfile, "PID_DIR", str(tmp_path))
    return tmp_path


def test_the_pid_file_holds_the_launchers_pid_and_goes_away(pid_dir):
    with pidfile.saved(1234) as path:
        assert path == str(pid_dir / "1234.zerotron")
        assert (pid_dir / "1234.zerotron").read_text() == str(os.getpid())
    assert list(pid_dir.iterdir()) == []
    with pytest.raises(RuntimeError), pidfile.saved(1234):
        raise RuntimeError("the job failed")
    assert list(pid_dir.iterdir()) == []
    with pidfile.saved(None) as path:
        assert path is None and list(pid_dir.iterdir()) == []


def test_a_pid_file_of_a_gone_launcher_is_replaced_of_a_live_one_refused(pid_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (pid_dir / "5.zerotron").write_text(str(dead.pid))
    with pidfile.saved(5):
        assert (pid_dir / "5.zerotron").read_text() == str(os.getpid())
    (pid_dir / "5.zerotron").write_text(str(os.getppid()))
    refused = pytest.raises(ConfigError, match=f"names launcher PID {os.getppid()}, which is")
    with refused, pidfile.saved(5):
        pass
    assert (pid_dir / "5.zerotron").read_text() == str(os.getppid())  # not ours: left alone


def test_save_pid_names_the_file_by_the_pid_of_the_process_started(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = os.path.abspath(__file__)
    assert launch.plan_from_args(["--save_pid", script]).pid_key == os.getpid()
    assert launch.plan_from_args(["--save_pid_as", "42", script]).pid_key == 42
    assert launch.plan_from_args([script]).pid_key is None


# -- the banner ---------------------------------------------------------------------------------


def _plan(**kw) -> launch.LaunchPlan:
    base = dict(
        nproc_per_node=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500,
        port_given=True, entrypoint="python", worker_args=[], log_dir=None, max_restarts=0,
        shutdown_timeout=1, rdzv_timeout=1, omp_num_threads=3,
    )  # fmt: skip
    return launch.LaunchPlan(**{**base, **kw})


def _envs(ranks: list[int], world: int, node: int = 1, nodes: int = 2, port: int = 29501):
    return {
        local: {"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(node),
                "GROUP_WORLD_SIZE": str(nodes), "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": str(port)}
        for local, rank in enumerate(ranks)
    }  # fmt: skip


def test_banner_of_uneven_nodes_says_the_ranks_the_agent_gave():
    # node 0 runs 1 rank, node 1 (this one) 2: ranks 1-2 of 3, not "ranks 2-3 of 4"
    assert launch._banner(_plan(), _envs([1, 2], 3)) == (
        "node 1 of 2: ranks 1-2 of 3, rendezvous at 10.0.0.1:29501, OMP_NUM_THREADS=3"
    )
    assert launch._banner(_plan(nproc_per_node=1), _envs([3], 4)) == (
        "node 1 of 2: rank 3 of 4, rendezvous at 10.0.0.1:29501, OMP_NUM_THREADS=3"
    )


def test_banner_before_the_rendezvous_counts_only_what_it_knows():
    assert launch._banner(_plan()) == (
        "node 1 of 2: 2 local rank(s), rendezvous at 10.0.0.1:29500, OMP_NUM_THREADS=3"
    )
    assert launch._banner(_plan(nnodes=1, node_rank=0)) == (
        "node 0 of 1: ranks 0-1 of 2, rendezvous at 10.0.0.1:29500, OMP_NUM_THREADS=3"
    )


def test_banner_names_each_local_ranks_cores(monkeypatch):
    for var in network.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    plan = _plan(bind=binding.Binding([[0, 1, 8, 9], [2, 3, 10, 11]], 2), socket_ifname="eth0")
    assert launch._banner(plan, _envs([2, 3], 4)) == (
        "node 1 of 2: ranks 2-3 of 4, rendezvous at 10.0.0.1:29501, OMP_NUM_THREADS=3, "
        "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0, cores per local rank: 0-1,8-9 | 2-3,10-11"
    )


def test_the_banner_names_the_interface_variables_the_user_left_unset(monkeypatch):
    said = []
    monkeypatch.setattr(launch, "_say", said.append)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    announce = launch._Announcer(_plan(socket_ifname="eth0"))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # as the launcher sets it for its workers
    announce(_envs([1, 2], 3))
    assert said == [
        "node 1 of 2: ranks 1-2 of 3, rendezvous at 10.0.0.1:29501, OMP_NUM_THREADS=3, "
        "GLOO_SOCKET_IFNAME=eth0"
    ]


def test_the_banner_is_said_again_only_when_it_changes(monkeypatch):
    said = []
    monkeypatch.setattr(launch, "_say", said.append)
    announce = launch._Announcer(_plan())
    for envs in (_envs([1, 2], 3), _envs([1, 2], 3), _envs([1, 2], 3, port=29502)):
        announce(envs)
    assert [s.split(", OMP")[0] for s in said] == [
        "node 1 of 2: ranks 1-2 of 3, rendezvous at 10.0.0.1:29501",
        "node 1 of 2: ranks 1-2 of 3, rendezvous at 10.0.0.1:29502",
    ]


# -- every node's launcher ----------------------------------------------------------------------


def test_a_bad_core_list_stops_a_multinode_job_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    (tmp_path / "t.py").write_text("")
    with pytest.raises(ConfigError, match="--bind_core_list '0-': '0-' is not a CPU"):
        launch.main(["--hostfile", "hosts", "--bind_core_list", "0-", "--dry-run", "t.py"])


def test_binding_and_save_pid_reach_every_nodes_launcher(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    argv = ["--hostfile", "hosts", "--bind_core_list", "0-7", "--save_pid", "t.py"]
    first, _ = multinode.plan(launch._parse(argv)).commands
    remote = shlex.split(first.argv[-1])
    run = remote[remote.index("exec") + 1 :]
    assert run[run.index("--rdzv_timeout") + 2 : -1] == [
        "--bind_core_list", "0-7", "--save_pid_as", str(os.getpid()), "--lifeline", "stdin",
    ]  # fmt: skip
