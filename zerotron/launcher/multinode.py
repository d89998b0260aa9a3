"""``zerotron launch --hostfile``: the command each node runs, per launcher back end.

Every back end starts one ``zerotron launch`` per node (the per-node launcher of
:mod:`zerotron.launcher.launch`, on torch's elastic agent), never the ranks themselves, so rank
numbering, prefixed output, failure summaries and restarts are the same everywhere:

- ``ssh`` (default): one ``ssh [-p PORT] [LAUNCHER_ARGS] HOST COMMAND`` per node, this host
  included when it is in the hostfile (as DeepSpeed does);
- ``pdsh``: one ``pdsh -w HOSTS COMMAND`` for all nodes (``%n`` is the node's rank: its place in
  ``-w``, which is the hostfile's order);
- ``openmpi`` / ``mpich``: one ``mpirun`` with one process per node, which reads its node rank
  from ``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK``;
- ``slurm``: one ``srun`` with one task per node (node rank ``SLURM_NODEID``).

Each back end labels its lines with the node (pdsh's ``host:``, mpirun's ``--tag-output`` /
``-prepend-rank``, srun's ``--label``) and each node's launcher gets a ``--lifeline``, so that
:mod:`zerotron.launcher.remote` can start, watch and stop the nodes.

``COMMAND`` (ssh, pdsh) is one shell string built only from ``shlex.quote``-d words: it changes
to the launching node's working directory, exports the propagated environment (``NCCL_*``,
``PYTHON*``, ``CUDA_*``, ``ZEROTRON_*`` and the ``KEY=VALUE`` lines of ``.deepspeed_env`` (or
``$DS_ENV_FILE``) and ``.zerotron_env`` in the home and working directories, taken literally),
and runs the same Python executable. ``CUDA_VISIBLE_DEVICES`` is the node's selected slots.
:func:`plan` returns the commands, which ``--dry-run`` prints and :func:`run_job` runs; with
``--no_ssh``, or for a job on this host alone, this host runs its own share.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from zerotron.errors import ConfigError
from zerotron.launcher import remote
from zerotron.launcher.flags import DEFAULT_MASTER_PORT
from zerotron.launcher.hostfile import read_hostfile, select_resources

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "CUDA_", "ZEROTRON_")
PDSH_FAN_OUT = 1024
# Where each back end tells a node's launcher its node rank.
NODE_RANK_ENV = {"openmpi": "OMPI_COMM_WORLD_RANK", "mpich": "PMI_RANK", "slurm": "SLURM_NODEID"}
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass
class NodeCommand:
    """One command the launching node runs: ``argv`` with ``env`` added to its environment."""

    hosts: list[str]  # the nodes it starts (one for ssh, all for the others)
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """The command as one shell line; ``shlex.split`` of it gives back the exact words."""
        head = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        return shlex.join(head + self.argv)


@dataclass
class MultiNodePlan:
    """The selected resources and the commands that start the job on them."""

    resources: dict[str, list[int]]
    master_addr: str
    master_port: int | None  # None: one node, whose launcher picks a free port
    launcher: str
    commands: list[NodeCommand]


def wanted(args: argparse.Namespace) -> bool:
    """Whether ``args`` select hosts or slots (a hostfile, or ``--include``/``--exclude`` of
    this host's slots, named ``localhost``, as DeepSpeed does without a hostfile)."""
    return (
        args.hostfile is not None
        or bool(args.include or args.exclude)
        or args.allocation is not None
    )


def node_rank_from(var: str) -> int:
    """``--node_rank_env VAR``: the node rank that mpirun or srun put in ``VAR``."""
    value = os.environ.get(var, "")
    if not value.isdigit():
        raise ConfigError(
            f"--node_rank_env {var}: the variable is {'unset' if not value else repr(value)}",
            fix="start this launcher through mpirun or srun, which set it, or give --node_rank",
        )
    return int(value)


def plan(args: argparse.Namespace, local_slots: int = 1, cwd: str | None = None) -> MultiNodePlan:
    """The commands that start the job of ``args`` (``zerotron launch`` flags with --hostfile).

    Without a hostfile the pool is ``localhost slots=local_slots``. A job on this host alone (its
    only host is ``localhost``, a loopback address or this host's name) runs here, as does
    ``--no_ssh``: one command, this node's own launcher.
    """
    if args.hostfile is not None:
        pool = read_hostfile(args.hostfile)
    elif args.allocation is not None:  # a SLURM allocation's hosts (launcher/slurm.py)
        pool = args.allocation
    else:
        pool = {"localhost": local_slots}
    resources = select_resources(pool, args.include, args.exclude, args.nnodes, args.nproc_per_node)
    master_addr = args.master_addr or next(iter(resources))
    port = args.master_port
    if port is None and len(resources) > 1:  # nodes agree on it without talking
        port = DEFAULT_MASTER_PORT
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"--master_port must be in 1 .. 65535, got {port}")
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        raise ConfigError(f"--ssh_port must be in 1 .. 65535, got {args.ssh_port}")
    cwd = os.path.abspath(cwd or os.getcwd())
    env = propagated_env(os.environ, cwd)
    try:
        extra = shlex.split(args.launcher_args)
    except ValueError as e:
        raise ConfigError(f"--launcher_args {args.launcher_args!r}: {e}") from None
    build = {"ssh": _ssh, "pdsh": _pdsh, "openmpi": _openmpi, "mpich": _mpich, "slurm": _slurm}
    job = _Job(args, resources, master_addr, port, cwd, env, extra)
    if args.no_ssh or _only_this_host(resources):
        rank = args.node_rank if args.no_ssh else 0
        return MultiNodePlan(resources, master_addr, port, "local", [_local(job, rank)])
    return MultiNodePlan(resources, master_addr, port, args.launcher, build[args.launcher](job))


@dataclass
class _Job:
    args: argparse.Namespace
    resources: dict[str, list[int]]
    master_addr: str
    master_port: int | None
    cwd: str
    env: dict[str, str]  # propagated environment
    extra: list[str]  # --launcher_args, split

    def launch_argv(self, node_rank: str | None, nproc: int, started: bool = True) -> list[str]:
        """The per-node ``zerotron launch`` (node_rank None: read from the back end's variable);
        ``started``: by this launcher, through a back end (it ends when this launcher does)."""
        a = self.args
        rank = (
            ["--node_rank", node_rank]
            if node_rank is not None
            else ["--node_rank_env", NODE_RANK_ENV[a.launcher]]
        )
        argv = [sys.executable, "-u", "-m", "zerotron.launcher.launch"]
        argv += ["--nnodes", str(len(self.resources)), *rank, "--nproc_per_node", str(nproc)]
        argv += ["--master_addr", self.master_addr]
        argv += [] if self.master_port is None else ["--master_port", str(self.master_port)]
        argv += _passed_on(a)
        if started:
            argv += ["--lifeline", remote.LIFELINE_OF[a.launcher]]
        return argv + (["-m"] if a.module else []) + [a.script, *a.script_args]

    def shell(self, node_rank: str, slots: list[int]) -> str:
        """The remote shell command of one node (ssh, pdsh): every word of it quoted."""
        q = shlex.quote
        exports = {**self.env, "CUDA_VISIBLE_DEVICES": _devices(slots)}
        export = " ".join(q(f"{k}={v}") for k, v in exports.items())
        run = " ".join(q(w) for w in self.launch_argv(node_rank, len(slots)))
        return f"cd {q(self.cwd)} && export {export} && exec {run}"

    def uniform_slots(self) -> list[int]:
        """The slots every node uses; back ends that run one command everywhere need them equal."""
        first = next(iter(self.resources.values()))
        odd = [h for h, s in self.resources.items() if s != first]
        if odd:
            raise ConfigError(
                f"--launcher {self.args.launcher} starts the same command on every node, but "
                f"host {odd[0]!r} uses slots {self.resources[odd[0]]} and "
                f"{next(iter(self.resources))!r} uses {first}",
                where="--launcher",
                fix="select the same slots on every host, or use --launcher ssh",
            )
        return first


def _ssh(job: _Job) -> list[NodeCommand]:
    port = ["-p", str(job.args.ssh_port)] if job.args.ssh_port is not None else []
    return [
        NodeCommand([host], ["ssh", *port, *job.extra, host, job.shell(str(i), slots)])
        for i, (host, slots) in enumerate(job.resources.items())
    ]


def _pdsh(job: _Job) -> list[NodeCommand]:
    slots = job.uniform_slots()
    env = {"PDSH_RCMD_TYPE": "ssh"}
    if job.args.ssh_port is not None:  # after the user's own
        given = os.environ.get("PDSH_SSH_ARGS_APPEND", "")
        env["PDSH_SSH_ARGS_APPEND"] = f"{given} -p {job.args.ssh_port}".lstrip()
    hosts = list(job.resources)
    argv = ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", ",".join(hosts), *job.extra]
    return [NodeCommand(hosts, [*argv, job.shell("%n", slots)], env)]


def _exports(job: _Job, slots: list[int]) -> dict[str, str]:
    return {**job.env, "CUDA_VISIBLE_DEVICES": _devices(slots)}


def _openmpi(job: _Job) -> list[NodeCommand]:
    slots, hosts = job.uniform_slots(), list(job.resources)
    argv = ["mpirun", "-n", str(len(hosts)), "--host", ",".join(hosts), "--map-by", "ppr:1:node"]
    argv += ["--tag-output", "-wdir", job.cwd, *job.extra]
    for key, value in _exports(job, slots).items():
        argv += ["-x", f"{key}={value}"]
    return [NodeCommand(hosts, argv + job.launch_argv(None, len(slots)))]


def _mpich(job: _Job) -> list[NodeCommand]:
    slots, hosts = job.uniform_slots(), list(job.resources)
    argv = ["mpirun", "-n", str(len(hosts)), "-ppn", "1", "-hosts", ",".join(hosts)]
    argv += ["-prepend-rank", "-wdir", job.cwd, *job.extra]
    for key, value in _exports(job, slots).items():
        argv += ["-genv", key, value]
    return [NodeCommand(hosts, argv + job.launch_argv(None, len(slots)))]


def _slurm(job: _Job) -> list[NodeCommand]:
    # srun passes srun's own environment on (--export=ALL), so values need no escaping here.
    slots, hosts = job.uniform_slots(), list(job.resources)
    argv = ["srun", "--nodes", str(len(hosts)), "--ntasks-per-node", "1", "--label"]
    argv += ["--nodelist", ",".join(hosts), "--chdir", job.cwd, "--export", "ALL", *job.extra]
    env = _exports(job, slots)
    return [NodeCommand(hosts, argv + job.launch_argv(None, len(slots)), env)]


def _local(job: _Job, node_rank: int | None) -> NodeCommand:
    """--no_ssh: this host's own launcher, as node ``node_rank`` of the hostfile's job."""
    hosts = list(job.resources)
    if node_rank is None or not 0 <= node_rank < len(hosts):
        raise ConfigError(
            f"--no_ssh runs one node of the job: give --node_rank in 0 .. {len(hosts) - 1}",
            fix="run the same command on every host with its own --node_rank "
            f"(hosts in order: {', '.join(hosts)})",
        )
    slots = job.resources[hosts[node_rank]]
    env = {"CUDA_VISIBLE_DEVICES": _devices(slots)}
    return NodeCommand([hosts[node_rank]], job.launch_argv(str(node_rank), len(slots), False), env)


def _only_this_host(resources: dict[str, list[int]]) -> bool:
    if len(resources) != 1:
        return False
    host = next(iter(resources))
    here = socket.gethostname()
    return host in ("localhost", here, here.split(".")[0]) or host.startswith("127.")


def _passed_on(a: argparse.Namespace) -> list[str]:
    """The launcher flags every node's launcher gets as given here."""
    out: list[str] = []
    if a.log_dir is not None:
        out += ["--log_dir", a.log_dir]
    out += ["--max_restarts", str(a.max_restarts), "--shutdown_timeout", str(a.shutdown_timeout)]
    out += ["--rdzv_timeout", str(a.rdzv_timeout)]
    if a.watchdog_timeout is not None:
        out += ["--watchdog-timeout", f"{a.watchdog_timeout:g}"]
    if a.watchdog_action is not None:
        out += ["--watchdog-action", a.watchdog_action]
    if getattr(a, "min_nodes", None) is not None:  # elastic: every node runs the c10d rendezvous
        out += ["--min_nodes", str(a.min_nodes)]
    if getattr(a, "rdzv_conf", ""):
        out += ["--rdzv_conf", a.rdzv_conf]
    for flag in ("no_local_rank", "as_deepspeed", "verbose", "bind_cores_to_rank"):
        if getattr(a, flag):
            out.append(f"--{flag}")
    if a.bind_core_list is not None:
        out += ["--bind_core_list", a.bind_core_list]
    if a.save_pid:  # every node's file is named by this process's PID, as in DeepSpeed
        out += ["--save_pid_as", str(a.save_pid_as or os.getpid())]
    return out


def _devices(slots: list[int]) -> str:
    return ",".join(map(str, slots))


def propagated_env(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """What every node's environment gets from here, sorted by name.

    ``PYTHONPATH`` starts with the working directory (as DeepSpeed's launcher does), and
    ``CUDA_VISIBLE_DEVICES`` is left out: each node's is its selected slots. Names a shell could
    not export (possible in an environment) are left out too.
    """
    env = {
        k: v
        for k, v in environ.items()
        if k.startswith(EXPORT_PREFIXES) and k != "CUDA_VISIBLE_DEVICES" and _ENV_KEY.match(k)
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, environ.get("PYTHONPATH")) if p)
    names = (environ.get("DS_ENV_FILE", ".deepspeed_env"), ".zerotron_env")  # DeepSpeed's name
    for directory in (os.path.expanduser("~"), cwd):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                env.update(read_env_file(path))
    return dict(sorted(env.items()))


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (blank lines and ``#`` comments skipped); values are literal text."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {getattr(e, 'strerror', None) or e}", where=path) from None
    env = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not _ENV_KEY.match(key):
            raise ConfigError(
                f"not a KEY=VALUE line: {line!r}",
                where=f"{path}:{number}",
                fix="write one NAME=value per line (NAME: letters, digits, '_'); the value is "
                "exported as written, without shell expansion",
            )
        env[key] = value.strip()
    return env


def run_job(
    args: argparse.Namespace, run_node: Callable[[list[str]], int], local_slots: int = 1
) -> int:
    """``zerotron launch --hostfile``: print the commands (--dry-run), run this node's share
    (--no_ssh, or a job on this host alone) through ``run_node(launch flags)``, or start every
    node and watch them to the end (:mod:`zerotron.launcher.remote`); the job's exit code."""
    job = plan(args, local_slots)
    summary = ", ".join(f"{h} slots {_devices(s)}" for h, s in job.resources.items())
    ranks = sum(map(len, job.resources.values()))
    say = f"{len(job.resources)} node(s), {ranks} rank(s): {summary}; rendezvous at "
    where = job.master_addr + (
        " (a free port)" if job.master_port is None else f":{job.master_port}"
    )
    print(f"zerotron launch: {say}{where}", file=sys.stderr, flush=True)
    if args.dry_run:
        for command in job.commands:
            print(command.line(), flush=True)
        return 0
    if job.launcher == "local":
        (command,) = job.commands
        # This process only launches: the node's GPUs are its selected slots.
        os.environ.update(command.env)
        return run_node(command.argv[4:])  # past "python -u -m zerotron.launcher.launch"
    return remote.supervise(job, args.shutdown_timeout)
