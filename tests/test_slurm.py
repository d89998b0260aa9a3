"""zerotron launch inside a SLURM allocation, without starting anything: compressed node lists,
hosts and slots from SLURM's variables (each bad value named), the node rank under srun, and the
exact commands ``--dry-run`` prints under a fake allocation (``--launcher slurm`` and
``--no_ssh``).
"""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from zerotron.errors import ConfigError
from zerotron.launcher import launch, multinode, slurm

HEAD = [sys.executable, "-u", "-m", "zerotron.launcher.launch"]
DEFAULTS = ["--max_restarts", "0", "--shutdown_timeout", "15", "--rdzv_timeout", "900"]

# -- node lists ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("x[1-2]-ib", ["x1-ib", "x2-ib"]),
        ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
        ("solo", ["solo"]),
        ("a[1],b", ["a1", "b"]),
    ],
)
def test_compressed_node_lists_expand_in_order(text, hosts):
    assert slurm.expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text, what",
    [
        ("gpu[01-03", "brackets do not pair up"),
        ("gpu01]", "brackets do not pair up"),
        ("gpu[[1]]", "brackets do not pair up"),
        ("gpu[3-1]", "range '3-1' runs backwards"),
        ("gpu[a]", "'a' is not a number or a range N-M"),
        ("a,,b", "an empty node name"),
        ("gpu[]", "empty brackets"),
        ("gpu[0-99999]", "expands to more than 65536 nodes"),
        ("a,a", "names 'a' twice"),
        ("-oProxy", "'-oProxy' is not a host name"),
    ],
)
def test_a_bad_node_list_is_named_with_its_variable(text, what):
    with pytest.raises(ConfigError, match=re.escape(f"SLURM_NODELIST={text!r}: ")) as e:
        slurm.expand_nodelist(text, "SLURM_NODELIST")
    assert what in str(e.value)


# -- hosts and slots ----------------------------------------------------------------------------

JOB = {"SLURM_JOB_ID": "1234567", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2"}


@pytest.mark.parametrize(
    "extra, slots",
    [
        ({"SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"}, [8, 8]),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, [4, 4]),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, [3, 3]),
        ({"SLURM_GPUS_ON_NODE": "2", "SLURM_NTASKS_PER_NODE": "1"}, [2, 2]),
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)"}, [4, 4]),
        ({"SLURM_TASKS_PER_NODE": "3,1"}, [3, 1]),
        ({}, [1, 1]),
    ],
)
def test_slots_are_the_gpus_else_the_tasks_of_each_node(extra, slots):
    assert slurm.allocation({**JOB, **extra}) == dict(zip(["gpu01", "gpu02"], slots))


def test_srun_steps_node_list_comes_first():
    env = {**JOB, "SLURM_STEP_NODELIST": "gpu02", "SLURM_STEP_NUM_NODES": "1"}
    assert slurm.allocation(env) == {"gpu02": 1}
    assert slurm.allocation({"SLURM_NODELIST": "c[1-2]"}) == {"c1": 1, "c2": 1}


@pytest.mark.parametrize(
    "env, where, what",
    [
        ({}, "--launcher slurm", "not inside a SLURM allocation: SLURM_JOB_NODELIST is not set"),
        ({**JOB, "SLURM_NNODES": "3"}, "SLURM_JOB_NODELIST", "names 2 node(s) but SLURM_NNODES=3"),
        ({**JOB, "SLURM_NNODES": "two"}, "SLURM_NNODES", "SLURM_NNODES='two' is not a whole"),
        ({**JOB, "SLURM_GPUS_PER_NODE": "a100:x"}, "SLURM_GPUS_PER_NODE", "'a100:x' is not COUNT"),
        ({**JOB, "SLURM_GPUS_ON_NODE": "0"}, "SLURM_GPUS_ON_NODE", "0 is not in 1 .. 65536"),
        ({**JOB, "SLURM_TASKS_PER_NODE": "2(x3)"}, "SLURM_TASKS_PER_NODE", "gives 3 node(s)"),
        ({**JOB, "SLURM_TASKS_PER_NODE": "2(3)"}, "SLURM_TASKS_PER_NODE", "'2(3)' is not N or"),
    ],
)
def test_a_bad_allocation_variable_is_named(env, where, what):
    with pytest.raises(ConfigError) as e:
        slurm.allocation(env)
    assert e.value.where == where and what in str(e.value)


def test_node_rank_under_srun_and_one_launcher_per_node():
    assert slurm.node_rank({"SLURM_NODEID": "1", "SLURM_LOCALID": "0"}) == 1
    assert slurm.node_rank({}) is None
    with pytest.raises(ConfigError, match=r"task 1 of its node \(SLURM_LOCALID\)"):
        slurm.node_rank({"SLURM_NODEID": "0", "SLURM_LOCALID": "1"})


def test_default_port_comes_from_the_job_id():
    assert slurm.default_port({"SLURM_JOB_ID": "1234567"}) == 20000 + 4567
    assert slurm.default_port({}) is None


def _args(*argv: str):
    return launch._parse([*argv, "train.py"])


def test_fill_in_takes_only_what_the_flags_leave_open():
    args = _args("--launcher", "slurm")
    slurm.fill_in(args, JOB)
    assert (args.allocation, args.master_port) == ({"gpu01": 1, "gpu02": 1}, 24567)
    args = _args("--no_ssh", "--master_port", "2000")
    slurm.fill_in(args, {**JOB, "SLURM_NODEID": "1"})
    assert (args.node_rank, args.master_port) == (1, 2000)
    for argv in (["--launcher", "slurm", "--hostfile", "h"], ["--nproc_per_node", "2"]):
        args = _args(*argv)  # a hostfile wins; a one-node launch ignores the allocation
        slurm.fill_in(args, JOB)
        assert args.allocation is None and args.master_port is None


# -- --dry-run in a fake allocation -------------------------------------------------------------


@pytest.fixture
def allocation(tmp_path, monkeypatch):
    """Inside a fake 2-node allocation with 2 GPUs per node; only PATH otherwise."""
    for key in list(os.environ):
        if key.startswith((*multinode.EXPORT_PREFIXES, "SLURM_")):
            monkeypatch.delenv(key)
    env = {**JOB, "SLURM_GPUS_PER_NODE": "2", "SLURM_NTASKS_PER_NODE": "1", "HOME": str(tmp_path)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    return tmp_path


def test_dry_run_with_launcher_slurm_prints_the_srun_command(allocation, capsys):
    assert launch.main(["--launcher", "slurm", "--dry-run", "train.py", "--lr", "1"]) == 0
    out, err = capsys.readouterr()
    run = HEAD + ["--nnodes", "2", "--node_rank_env", "SLURM_NODEID", "--nproc_per_node", "2"]
    run += ["--master_addr", "gpu01", "--master_port", "24567", *DEFAULTS, "--lifeline", "parent"]
    run += ["train.py", "--lr", "1"]
    srun = ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--label"]
    srun += ["--nodelist", "gpu01,gpu02"]
    srun += ["--chdir", str(allocation), "--export", "ALL"]
    env = ["env", f"PYTHONPATH={allocation}", "CUDA_VISIBLE_DEVICES=0,1"]
    assert out.splitlines() == [shlex.join(env + srun + run)]
    assert err == (
        "zerotron launch: 2 node(s), 4 rank(s): gpu01 slots 0,1, gpu02 slots 0,1; "
        "rendezvous at gpu01:24567\n"
    )


def test_dry_run_with_no_ssh_under_srun_runs_node_slurm_nodeid(allocation, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert launch.main(["--no_ssh", "--dry-run", "train.py"]) == 0
    run = HEAD + ["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "2"]
    run += ["--master_addr", "gpu01", "--master_port", "24567", *DEFAULTS, "train.py"]
    assert capsys.readouterr().out.splitlines() == [
        shlex.join(["env", "CUDA_VISIBLE_DEVICES=0,1", *run])
    ]


def test_launcher_slurm_outside_an_allocation_says_so(allocation, monkeypatch):
    for key in JOB:
        monkeypatch.delenv(key)
    with pytest.raises(ConfigError, match="not inside a SLURM allocation"):
        launch.main(["--launcher", "slurm", "--dry-run", "train.py"])
