"""zerotron launch --hostfile without starting anything: hostfile parsing, DeepSpeed's resource
selection (compared with what real DeepSpeed selects: tests/fixtures/deepspeed/resources.json),
the environment every node gets, each back end's exact command, quoting of hostile text, and
``--dry-run`` through the CLI. (The fuzz test: tests/faults/test_fuzz_hostfile.py.)
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zerotron.errors import ConfigError, LaunchError
from zerotron.launcher import launch, multinode, remote
from zerotron.launcher.hostfile import parse_hostfile, read_hostfile, select_resources

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "resources.json"
PY = sys.executable
HEAD = [PY, "-u", "-m", "zerotron.launcher.launch"]
DEFAULTS = ["--max_restarts", "0", "--shutdown_timeout", "15", "--rdzv_timeout", "900"]
HOSTILE = ["a; rm -rf /", "$(x)", "`id`", "it's", 'say "hi"', "two  spaces", "-e", "%n", "\\"]


# -- parsing ------------------------------------------------------------------------------------


def test_hosts_in_file_order_with_comments_and_blank_lines():
    text = "# pool\n\nw1 slots=8   # the big one\n  w0\tslots=2\n#w9 slots=1\n"
    assert list(parse_hostfile(text).items()) == [("w1", 8), ("w0", 2)]


@pytest.mark.parametrize(
    "text, line, what",
    [
        ("w0 slots=2\nw1\n", 2, "no slots=N"),
        ("w0 slots=2\n\nw0 slots=4\n", 3, "host 'w0' is listed twice (first on line 1)"),
        ("w0 slots=0\n", 1, "slots=0 is not a whole number in 1 .. 65536"),
        ("w0 slots=-1\n", 1, "slots=-1 is not a whole number"),
        ("w0 slots=two\n", 1, "slots=two is not a whole number"),
        ("w0 slots=1.5\n", 1, "slots=1.5 is not a whole number"),
        ("w0 slots=\n", 1, "slots= is not a whole number"),
        ("w0 slots=2 max_slots=4\n", 1, "unknown key 'max_slots'"),
        ("w0 slots=2 gpu\n", 1, "unexpected 'gpu' (not KEY=VALUE)"),
        ("w0 slots=2 slots=3\n", 1, "slots= is given twice"),
        ("w0 slots 2\n", 1, "unexpected 'slots' (not KEY=VALUE)"),
        ("w0 slots=2\n-oProxyCommand=x slots=1\n", 2, "bad host name '-oProxyCommand=x'"),
        ("a;rm slots=1\n", 1, "bad host name 'a;rm'"),
    ],
)
def test_a_bad_line_is_named_with_its_number(text, line, what):
    with pytest.raises(ConfigError) as e:
        parse_hostfile(text, "hosts")
    assert e.value.where == f"hosts:{line}"
    assert e.value.what.startswith(what)
    assert e.value.fix


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_a_file_without_hosts_is_refused(text):
    with pytest.raises(ConfigError, match="the hostfile lists no hosts") as e:
        parse_hostfile(text, "hosts")
    assert e.value.where == "hosts"


def test_a_missing_or_unreadable_hostfile_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the hostfile: No such file") as e:
        read_hostfile(str(tmp_path / "nope"))
    assert e.value.where == str(tmp_path / "nope")
    with pytest.raises(ConfigError, match="cannot read the hostfile: Is a directory"):
        read_hostfile(str(tmp_path))
    binary = tmp_path / "bin"
    binary.write_bytes(b"w0 slots=1\n\xff\xfe\n")
    with pytest.raises(ConfigError, match="cannot read the hostfile: 'utf-8' codec"):
        read_hostfile(str(binary))


# -- selection ----------------------------------------------------------------------------------


def _ds_cases():
    doc = json.loads(FIXTURE.read_text())
    return [(doc["hostfile"], case) for case in doc["cases"]]


@pytest.mark.parametrize("hostfile, case", _ds_cases())
def test_selection_equals_deepspeeds(hostfile, case):
    def given(n):
        return None if n == -1 else n

    got = select_resources(
        parse_hostfile(hostfile),
        case["include"],
        case["exclude"],
        given(case["num_nodes"]),
        given(case["num_gpus"]),
    )
    assert [[h, s] for h, s in got.items()] == case["resources"]


POOL = {"w0": 4, "w1": 4, "w2": 2}


def test_include_keeps_the_hostfile_order_and_named_slots():
    assert select_resources(POOL, include="w2@w0@w1:2,0") == {
        "w0": [0, 1, 2, 3],
        "w1": [0, 2],
        "w2": [0, 1],
    }
    assert list(select_resources(POOL, include="w2@w0")) == ["w0", "w2"]


def test_a_host_named_bare_and_with_slots_gets_all_its_slots():
    assert select_resources(POOL, include="w1:1@w1") == {"w1": [0, 1, 2, 3]}


def test_exclude_removes_slots_and_hosts_left_without_any():
    assert select_resources(POOL, exclude="w0:0,3@w2") == {"w0": [1, 2], "w1": [0, 1, 2, 3]}


def test_num_nodes_and_num_gpus_take_the_first_ones():
    assert select_resources(POOL, num_nodes=2, num_gpus=3) == {"w0": [0, 1, 2], "w1": [0, 1, 2]}


@pytest.mark.parametrize(
    "kwargs, where, what",
    [
        ({"include": "w0", "exclude": "w1"}, None, "--include and --exclude cannot be used"),
        ({"include": "w0", "num_nodes": 1}, None, "--num_nodes/--num_gpus cannot be combined"),
        ({"exclude": "w0", "num_gpus": 1}, None, "--num_nodes/--num_gpus cannot be combined"),
        ({"include": "w0@w7"}, "--include", "host 'w7' is not in the hostfile"),
        ({"exclude": "w7:0"}, "--exclude", "host 'w7' is not in the hostfile"),
        ({"include": "w2:0,2"}, "--include", "host 'w2' has no slot 2 (it has slots=2)"),
        ({"include": "w1:x"}, "--include", "slot 'x' of host 'w1' is not a slot number"),
        ({"include": "w1:"}, "--include", "slot '' of host 'w1' is not a slot number"),
        ({"include": "w1:-1"}, "--include", "slot '-1' of host 'w1' is not a slot number"),
        ({"include": "w0@"}, "--include", "an empty host name in 'w0@'"),
        ({"include": "w0:1:2"}, "--include", "slot '1:2' of host 'w0' is not a slot number"),
        ({"exclude": "w0@w1@w2"}, None, "--exclude 'w0@w1@w2' leaves no host to run on"),
        ({"num_nodes": 4}, None, "--num_nodes 4: the hostfile has 3 host(s)"),
        ({"num_nodes": 0}, None, "--num_nodes 0: the hostfile has 3 host(s)"),
        ({"num_gpus": 3}, None, "--num_gpus 3: host 'w2' has 2 slot(s)"),
        ({"num_gpus": 0}, None, "--num_gpus 0: not >= 1"),
    ],
)
def test_bad_selections_say_what_is_wrong(kwargs, where, what):
    with pytest.raises(ConfigError) as e:
        select_resources(POOL, **kwargs)
    assert e.value.where == where
    assert e.value.what == what or e.value.what.startswith(what)
    assert e.value.fix


# -- environment --------------------------------------------------------------------------------


def test_propagated_env_prefixes_env_files_and_pythonpath(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (home / ".zerotron_env").write_text("# comment\n\nB=zt home\n")
    (cwd / ".deepspeed_env").write_text("C = $HOME/x; y\n")
    environ = {
        "NCCL_DEBUG": "INFO",
        "CUDA_HOME": "/cuda",
        "CUDA_VISIBLE_DEVICES": "3",
        "PYTHONPATH": "/lib",
        "ZEROTRON_TRACEBACK": "1",
        "HOME": str(home),
        "SECRET_TOKEN": "no",
        "OMP_NUM_THREADS": "4",
        "NCCL_X;rm": "not a name a shell exports",
    }
    assert multinode.propagated_env(environ, str(cwd)) == {
        "A": "home",
        "B": "zt home",
        "C": "$HOME/x; y",
        "CUDA_HOME": "/cuda",
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": f"{cwd}:/lib",
        "ZEROTRON_TRACEBACK": "1",
    }


def test_ds_env_file_renames_deepspeeds_env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "nohome"))
    (tmp_path / "my_env").write_text("A=1\n")
    (tmp_path / ".deepspeed_env").write_text("B=2\n")
    environ = {"DS_ENV_FILE": "my_env"}
    assert multinode.propagated_env(environ, str(tmp_path)) == {
        "A": "1",
        "PYTHONPATH": str(tmp_path),
    }


def test_a_bad_env_file_line_is_named(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("A=1\nexport B=2\n")
    with pytest.raises(ConfigError, match="not a KEY=VALUE line: 'export B=2'") as e:
        multinode.read_env_file(str(path))
    assert e.value.where == f"{path}:2"


# -- commands -----------------------------------------------------------------------------------


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A 2-host hostfile (w0 slots=2, w1 slots=2), a script, and only PATH in the environment."""
    for key in list(os.environ):
        if key.startswith(multinode.EXPORT_PREFIXES):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.deepspeed_env
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    (tmp_path / "train.py").write_text("")
    return tmp_path


def _plan(*argv: str) -> multinode.MultiNodePlan:
    return multinode.plan(launch._parse(["--hostfile", "hosts", *argv]))


def _node(cwd, rank: int, slots: str, nproc: int, *program: str) -> str:
    env = f"export PYTHONPATH={cwd} CUDA_VISIBLE_DEVICES={slots}"
    run = HEAD + ["--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", str(nproc)]
    run += ["--master_addr", "w0", "--master_port", "29500", *DEFAULTS, "--lifeline", "stdin"]
    run += program
    return f"cd {cwd} && {env} && exec {shlex.join(run)}"


def test_ssh_runs_one_launcher_per_node(job):
    plan = _plan("--ssh_port", "2222", "--include", "w0@w1:1", "train.py", "--lr", "1")
    assert plan.resources == {"w0": [0, 1], "w1": [1]}
    assert [c.argv for c in plan.commands] == [
        ["ssh", "-p", "2222", "w0", _node(job, 0, "0,1", 2, "train.py", "--lr", "1")],
        ["ssh", "-p", "2222", "w1", _node(job, 1, "1", 1, "train.py", "--lr", "1")],
    ]


def test_launcher_flags_reach_every_node(job):
    argv = ["--launcher_args", "-o StrictHostKeyChecking=no", "--master_addr", "10.0.0.1"]
    argv += ["--master_port", "1234", "--enable_each_rank_log", "logs", "--max_restarts", "2"]
    argv += ["--as_deepspeed", "--no_local_rank", "-m", "pkg.train", "x"]
    (first, _) = _plan(*argv).commands
    ssh, remote = first.argv[:4], shlex.split(first.argv[4])
    assert ssh == ["ssh", "-o", "StrictHostKeyChecking=no", "w0"]
    run = remote[remote.index("exec") + 1 :]
    assert run == HEAD + [
        "--nnodes", "2", "--node_rank", "0", "--nproc_per_node", "2",
        "--master_addr", "10.0.0.1", "--master_port", "1234", "--log_dir", "logs",
        "--max_restarts", "2", "--shutdown_timeout", "15", "--rdzv_timeout", "900",
        "--no_local_rank", "--as_deepspeed", "--lifeline", "stdin", "-m", "pkg.train", "x",
    ]  # fmt: skip


def test_pdsh_runs_one_command_with_the_node_rank_from_pdsh(job):
    (command,) = _plan("--launcher", "pdsh", "--ssh_port", "2222", "train.py").commands
    assert command.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    remote = _node(job, 0, "0,1", 2, "train.py").replace("--node_rank 0", "--node_rank %n")
    assert command.argv == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", remote]


def _launcher(rank_env: str, *program: str) -> list[str]:
    run = HEAD + ["--nnodes", "2", "--node_rank_env", rank_env, "--nproc_per_node", "2"]
    run += ["--master_addr", "w0", "--master_port", "29500", *DEFAULTS, "--lifeline", "parent"]
    return run + list(program)


def test_openmpi_starts_one_launcher_per_node(job):
    (command,) = _plan("--launcher", "openmpi", "train.py").commands
    assert command.argv == [
        "mpirun", "-n", "2", "--host", "w0,w1", "--map-by", "ppr:1:node", "--tag-output",
        "-wdir", str(job),
        "-x", f"PYTHONPATH={job}", "-x", "CUDA_VISIBLE_DEVICES=0,1",
        *_launcher("OMPI_COMM_WORLD_RANK", "train.py"),
    ]  # fmt: skip


def test_mpich_starts_one_launcher_per_node(job):
    (command,) = _plan("--launcher", "mpich", "train.py").commands
    assert command.argv == [
        "mpirun", "-n", "2", "-ppn", "1", "-hosts", "w0,w1", "-prepend-rank",
        "-wdir", str(job),
        "-genv", "PYTHONPATH", str(job), "-genv", "CUDA_VISIBLE_DEVICES", "0,1",
        *_launcher("PMI_RANK", "train.py"),
    ]  # fmt: skip


def test_slurm_starts_one_task_per_node(job):
    (command,) = _plan("--launcher", "SLURM", "--launcher_args", "-p gpu", "train.py").commands
    assert command.env == {"PYTHONPATH": str(job), "CUDA_VISIBLE_DEVICES": "0,1"}
    assert command.argv == [
        "srun", "--nodes", "2", "--ntasks-per-node", "1", "--label", "--nodelist", "w0,w1",
        "--chdir", str(job), "--export", "ALL", "-p", "gpu", *_launcher("SLURM_NODEID", "train.py"),
    ]  # fmt: skip


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi", "mpich", "slurm"])
def test_one_command_for_all_nodes_needs_the_same_slots_everywhere(job, launcher):
    with pytest.raises(ConfigError, match="host 'w1' uses slots \\[0\\] and 'w0' uses \\[0, 1\\]"):
        _plan("--launcher", launcher, "-e", "w1:1", "train.py")


def test_node_rank_env_gives_the_node_rank(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    plan = launch.plan_from_args(
        ["--nnodes", "2", "--node_rank_env", "OMPI_COMM_WORLD_RANK", "--master_port", "1", __file__]
    )
    assert plan.node_rank == 1
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
    with pytest.raises(ConfigError, match="--node_rank_env OMPI_COMM_WORLD_RANK: the variable"):
        launch.plan_from_args(["--node_rank_env", "OMPI_COMM_WORLD_RANK", __file__])


def test_no_ssh_runs_this_hosts_share(job, monkeypatch):
    started = []
    monkeypatch.setattr(launch, "run", lambda plan: started.append(plan) or 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "-i", "w0@w1:1"]
    assert launch.main([*argv, "--master_addr", "127.0.0.1", "train.py", "a"]) == 0
    (plan,) = started
    assert (plan.nnodes, plan.node_rank, plan.nproc_per_node) == (2, 1, 1)
    assert (plan.master_addr, plan.master_port) == ("127.0.0.1", 29500)
    assert plan.worker_args == ["-u", "train.py", "--local_rank=${local_rank}", "a"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_no_ssh_needs_a_node_rank(job):
    with pytest.raises(ConfigError, match="--no_ssh runs one node of the job: give --node_rank"):
        _plan("--no_ssh", "train.py")


def test_a_missing_back_end_is_named_before_anything_starts(job, monkeypatch):
    monkeypatch.setenv("PATH", str(job))  # no pdsh here
    with pytest.raises(LaunchError, match="--launcher pdsh: 'pdsh' not found on this host"):
        launch.main(["--hostfile", "hosts", "--launcher", "pdsh", "train.py"])


def _fake_mpirun(directory: Path, says: str) -> None:
    """An ``mpirun`` in ``directory`` whose ``--version`` prints ``says`` (it runs nothing)."""
    mpirun = directory / "mpirun"
    mpirun.write_text(f"#!/bin/sh\necho {shlex.quote(says)}\n")
    mpirun.chmod(0o755)


MPIRUN_VERSIONS = {  # the first line of each MPI's `mpirun --version`
    "openmpi": "mpirun (Open MPI) 5.0.3",
    "openmpi-4": "mpirun.openmpi (OpenRTE) 4.1.4",
    "mpich": "HYDRA build details:",
    "intel": "Intel(R) MPI Library for Linux* OS, Version 2021.13 Build 20240515",
}


@pytest.mark.parametrize(
    ("launcher", "mpi", "named"),
    [
        ("mpich", "openmpi", "Open MPI"),
        ("mpich", "openmpi-4", "Open MPI"),
        ("openmpi", "mpich", "MPICH \\(Hydra\\)"),
        ("openmpi", "intel", "MPICH \\(Hydra\\)"),
    ],
)
def test_an_mpirun_of_the_other_mpi_is_refused_before_anything_starts(
    job, monkeypatch, launcher, mpi, named
):
    _fake_mpirun(job, MPIRUN_VERSIONS[mpi])
    monkeypatch.setenv("PATH", f"{job}{os.pathsep}/bin")
    started = []
    monkeypatch.setattr(remote.Supervisor, "_start", lambda _, command: started.append(command))
    with pytest.raises(
        LaunchError, match=f"--launcher {launcher}: the mpirun on PATH .* is {named}'s"
    ):
        launch.main(["--hostfile", "hosts", "--launcher", launcher, "train.py"])
    assert started == []


@pytest.mark.parametrize(
    ("launcher", "mpi"),
    [("openmpi", "openmpi"), ("openmpi", "openmpi-4"), ("mpich", "mpich"), ("mpich", "intel")],
)
def test_an_mpirun_of_the_named_mpi_passes_the_check(job, monkeypatch, launcher, mpi):
    _fake_mpirun(job, MPIRUN_VERSIONS[mpi])
    monkeypatch.setenv("PATH", f"{job}{os.pathsep}/bin")
    remote.check_mpirun(launcher)


def test_include_without_a_hostfile_selects_slots_of_this_host(job, monkeypatch):
    """As DeepSpeed: the pool is ``localhost`` with this host's GPUs (here 4)."""
    monkeypatch.setattr(launch, "_default_nproc", lambda: 4)
    started = []
    monkeypatch.setattr(launch, "run", lambda plan: started.append(plan) or 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launch.main(["-i", "localhost:1,3", "train.py"]) == 0
    (plan,) = started
    assert (plan.nnodes, plan.nproc_per_node, plan.master_addr) == (1, 2, "localhost")
    assert not plan.port_given  # one node: a free port
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", socket.gethostname()])
def test_a_job_on_this_host_alone_runs_here(job, host):
    (job / "here").write_text(f"{host} slots=2\n")
    plan = multinode.plan(launch._parse(["--hostfile", "here", "train.py"]))
    assert plan.launcher == "local"
    (command,) = plan.commands
    assert command.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert command.argv == HEAD + [
        "--nnodes", "1", "--node_rank", "0", "--nproc_per_node", "2", "--master_addr", host,
        *DEFAULTS, "train.py",
    ]  # fmt: skip


def test_one_remote_host_is_started_over_ssh_and_picks_its_port(job):
    (job / "one").write_text("w9 slots=1\n")
    (command,) = multinode.plan(launch._parse(["--hostfile", "one", "train.py"])).commands
    assert command.argv[:2] == ["ssh", "w9"]
    assert "--master_port" not in shlex.split(command.argv[2])


# -- quoting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_hostile_text_stays_quoted(job, monkeypatch, launcher):
    """Each printed command splits back into the exact words, and the remote shell command into
    the exact program arguments, environment values and directory."""
    weird = job / "dir with 'quote' $(x)"
    weird.mkdir()
    (weird / "hosts").write_text("w0 slots=1\n")
    (weird / "t; rm -rf ~.py").write_text("")
    monkeypatch.chdir(weird)
    monkeypatch.setenv("NCCL_X", "a; rm -rf / `id` $(x) 'q' \"d\"")
    argv = ["--hostfile", "hosts", "--launcher", launcher, "--master_addr", "$(x);y"]
    argv += ["--log_dir", "l'; z", "t; rm -rf ~.py", *HOSTILE]
    (command,) = multinode.plan(launch._parse(argv)).commands
    printed = shlex.split(command.line())
    assert printed[printed.index(command.argv[0]) :] == command.argv
    remote = shlex.split(command.argv[-1])
    assert remote[:2] == ["cd", str(weird)]
    assert remote[remote.index("--master_addr") + 1] == "$(x);y"
    assert remote[remote.index("--log_dir") + 1] == "l'; z"
    assert "NCCL_X=a; rm -rf / `id` $(x) 'q' \"d\"" in remote
    assert remote[-len(HOSTILE) - 1 :] == ["t; rm -rf ~.py", *HOSTILE]


def test_hostile_text_reaches_the_program_through_a_real_shell(job, tmp_path):
    """The remote command, run by sh, hands the program exactly its arguments."""
    command = _plan("train.py", *HOSTILE).commands[0]
    remote = command.argv[-1].replace(shlex.join(HEAD), shlex.join([PY, "-c", _ECHO]))
    out = subprocess.run(["sh", "-c", remote], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)[-len(HOSTILE) :] == HOSTILE


_ECHO = "import json, sys; print(json.dumps(sys.argv[1:]))"


# -- through the CLI ----------------------------------------------------------------------------


def test_dry_run_prints_each_nodes_command(job):
    env = {"PATH": os.environ["PATH"], "HOME": str(job), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [PY, "-m", "zerotron", "launch", "--hostfile", "hosts", "--dry-run", "train.py", "a b"],
        capture_output=True, text=True, env=env, cwd=job, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    pythonpath = f"{job}:{REPO}"
    expected = [
        shlex.join(["ssh", f"w{i}", _node(job, i, "0,1", 2, "train.py", "a b")]) for i in range(2)
    ]
    expected = [line.replace(f"PYTHONPATH={job}", f"PYTHONPATH={pythonpath}") for line in expected]
    assert out.stdout.splitlines() == expected
    assert out.stderr == (
        "zerotron launch: 2 node(s), 4 rank(s): w0 slots 0,1, w1 slots 0,1; "
        "rendezvous at w0:29500\n"
    )


def test_a_bad_hostfile_exits_2_with_the_line_named(job):
    (job / "bad").write_text("w0 slots=2\nw1 slots=0\n")
    out = subprocess.run(
        [PY, "-m", "zerotron", "launch", "--hostfile", "bad", "--dry-run", "train.py"],
        capture_output=True, text=True, cwd=job, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith(
        "zerotron launch: error: bad:2: slots=0 is not a whole number in 1 .. 65536\n  -> "
    )
    assert out.stdout == ""
