"""What one node's launcher runs: :class:`LaunchPlan`, built and checked from the flags.

:func:`plan_from_args` parses ``zerotron launch``'s flags (:mod:`zerotron.launcher.flags`) and
checks them before anything starts: the program exists, ``--master_addr`` resolves, the log
directory is writable, the node counts and the watchdog's options are valid. The plan then says
everything :func:`zerotron.launcher.launch.run` needs, and nothing is read from the flags again.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import threading
from dataclasses import dataclass, field

from zerotron.errors import ConfigError, LaunchError
from zerotron.fileio import check_writable_dir
from zerotron.launcher import binding, elastic, multinode, network
from zerotron.launcher.flags import DEFAULT_MASTER_PORT, build_parser

# Commands of zerotron's own CLI read LOCAL_RANK from the environment; their first argument is a
# subcommand, so a --local_rank in front of it would not parse.
ZEROTRON_CLI_MODULES = ("zerotron", "zerotron.cli", "zerotron.__main__")
RESOLVE_LIMIT_S = 10.0  # a --master_addr that takes longer to resolve is refused


@dataclass
class LaunchPlan:
    """Everything one node's launcher needs, validated."""

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    port_given: bool  # False: the launcher picked master_port (one node only)
    entrypoint: str  # the program each worker runs (the Python interpreter)
    worker_args: list[str]  # its arguments; ``${local_rank}`` is filled in per worker
    log_dir: str | None
    max_restarts: int
    shutdown_timeout: int
    rdzv_timeout: int
    omp_num_threads: int | None  # None: OMP_NUM_THREADS is already set and left alone
    verbose: bool = False
    as_deepspeed: bool = False  # workers' `import deepspeed` is zerotron (compat/as_deepspeed.py)
    socket_ifname: str | None = None  # many nodes: the interface that reaches master_addr
    bind: binding.Binding | None = None  # --bind_cores_to_rank: each local rank's CPUs
    pid_key: int | None = None  # --save_pid: this launcher's PID goes to /tmp/<pid_key>.zerotron
    watchdog_timeout: float | None = None  # None: the ranks' default (see distributed.watchdog)
    watchdog_action: str = "abort"  # or "wait" (see launcher.hangs)
    min_nodes: int | None = None  # elastic (torch's c10d rendezvous) when below nnodes
    rdzv_conf: dict[str, str] = field(default_factory=dict)  # --rdzv_conf, elastic only

    @property
    def elastic(self) -> bool:
        """Whether the node count may change (``--nnodes MIN:MAX``, ``--min_nodes``)."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def plan_from_args(argv: list[str]) -> LaunchPlan:
    """Parse and check the flags; raises ConfigError (bad values) or LaunchError (no program)."""
    return build(parse(argv))


def parse(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.script is None:
        raise ConfigError(
            "no program to run",
            fix="end the command with a script and its arguments, or -m MODULE and its arguments",
        )
    return args


def build(args: argparse.Namespace) -> LaunchPlan:
    if args.node_rank_env is not None:
        args.node_rank = multinode.node_rank_from(args.node_rank_env)
    args.nnodes, min_nodes = elastic.node_counts(args)
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    args.master_addr = args.master_addr or "127.0.0.1"
    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc()
    if nproc < 1:
        raise ConfigError(
            f"--nproc_per_node must be at least 1, got {nproc}",
            fix="give the number of processes to start on this node, e.g. --nproc_per_node 2",
        )
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(
            f"--node_rank {args.node_rank} is not in 0 .. {args.nnodes - 1} "
            f"(--nnodes {args.nnodes})",
            fix="number the nodes 0 .. nnodes-1; node 0 hosts the rendezvous",
        )
    if args.master_port is None:
        # One node: a free port, so jobs (and tests) started side by side do not collide. Many
        # nodes must agree on the port without talking, hence the well-known default.
        port = free_port() if args.nnodes == 1 else DEFAULT_MASTER_PORT
    else:
        port = args.master_port
    if not 1 <= port <= 65535:
        raise ConfigError(f"--master_port must be in 1 .. 65535, got {port}")
    _check_resolves(args.master_addr, port)
    ifname = network.plan_ifname(args.master_addr, port, args.nnodes)
    rdzv_conf = elastic.rdzv_conf(args.rdzv_conf)
    if args.max_restarts < 0:
        raise ConfigError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.shutdown_timeout < 0 or args.rdzv_timeout < 1:
        raise ConfigError("--shutdown_timeout must be >= 0 and --rdzv_timeout >= 1 seconds")
    if args.log_dir is not None:  # found now, not when the first rank writes its log
        check_writable_dir(args.log_dir, "--log_dir")
    check_program(args.script, args.module)
    bound = None
    if args.bind_cores_to_rank or args.bind_core_list is not None:
        bound = binding.rank_cpus(nproc, args.bind_core_list)
    watchdog_timeout, watchdog_action = _watchdog_options(args)
    omp = None
    if "OMP_NUM_THREADS" not in os.environ:  # the user's setting stays
        omp = bound.cores_per_rank if bound else max(1, _cores() // nproc)
    pid_key = args.save_pid_as if args.save_pid_as is not None else None
    if args.save_pid and pid_key is None:
        pid_key = os.getpid()
    return LaunchPlan(
        nproc_per_node=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=port,
        port_given=args.master_port is not None,
        entrypoint=sys.executable,
        worker_args=worker_args(
            args.script, args.script_args, args.module, args.no_local_rank, args.as_deepspeed
        ),
        log_dir=args.log_dir,
        max_restarts=args.max_restarts,
        shutdown_timeout=args.shutdown_timeout,
        rdzv_timeout=args.rdzv_timeout,
        omp_num_threads=omp,
        verbose=args.verbose,
        as_deepspeed=args.as_deepspeed,
        socket_ifname=ifname,
        bind=bound,
        pid_key=pid_key,
        watchdog_timeout=watchdog_timeout,
        watchdog_action=watchdog_action,
        min_nodes=min_nodes,
        rdzv_conf=rdzv_conf,
    )


def _watchdog_options(args: argparse.Namespace) -> tuple[float | None, str]:
    """--watchdog-timeout and --watchdog-action, or their environment variables."""
    from zerotron.launcher import hangs

    timeout = args.watchdog_timeout
    if timeout is None and os.environ.get(hangs.ENV_TIMEOUT, "").strip():
        raw = os.environ[hangs.ENV_TIMEOUT]
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigError(
                f"{hangs.ENV_TIMEOUT}={raw!r} is not a number of seconds",
                fix="give seconds (0 turns the watchdog off), or unset it",
            ) from None
    if timeout is not None and timeout < 0:
        raise ConfigError(
            f"--watchdog-timeout must be >= 0 seconds (0: off), got {timeout:g}",
            fix="give seconds, well under --distributed-timeout-minutes",
        )
    action = args.watchdog_action or os.environ.get(hangs.ENV_ACTION, "").strip() or "abort"
    if action not in hangs.ACTIONS:
        raise ConfigError(
            f"watchdog action {action!r} is not one of {', '.join(hangs.ACTIONS)}",
            where=f"--watchdog-action / {hangs.ENV_ACTION}",
        )
    return timeout, action


def worker_args(
    script: str,
    script_args: list[str],
    module: bool,
    no_local_rank: bool,
    as_deepspeed: bool = False,
) -> list[str]:
    """The interpreter arguments of every worker, with ``${local_rank}`` for the agent to fill.

    ``--local_rank=N`` goes right after the script, before its own arguments (the convention of
    DeepSpeed's launcher and torch.distributed.launch), so a script whose parser collects trailing
    arguments still sees it as a flag. zerotron's own CLI never gets it: it reads LOCAL_RANK.
    With ``as_deepspeed`` the program starts through :mod:`zerotron.compat.as_deepspeed`.
    """
    from torch.distributed.elastic.utils import macros

    head = ["-u", "-m", script] if module else ["-u", script]  # -u: lines reach us as written
    if as_deepspeed:
        head = ["-u", "-m", "zerotron.compat.as_deepspeed", *head[1:]]
    pass_local_rank = not no_local_rank and not (module and script in ZEROTRON_CLI_MODULES)
    local_rank = [f"--local_rank={macros.local_rank}"] if pass_local_rank else []
    return head + local_rank + list(script_args)


def check_program(script: str, module: bool) -> None:
    if module:
        # Only the top-level package is looked up: finding a submodule would import its parents
        # here, in the launcher. Workers run with the current directory on sys.path (python -m).
        top = script.split(".")[0]
        if not top or (importlib.util.find_spec(top) is None and not _in_cwd(top)):
            raise LaunchError(
                f"-m {script}: no module named {top!r}",
                fix="check the module name, the current directory and the Python environment",
            )
    elif not os.path.isfile(script):
        raise LaunchError(
            f"training script {script!r} not found",
            fix="give the path of a Python script, or -m MODULE to run a module",
        )


def _check_resolves(addr: str, port: int, limit_s: float = RESOLVE_LIMIT_S) -> None:
    """Refuse a --master_addr that does not resolve, at once: torch would retry it for the whole
    --rdzv_timeout (15 minutes by default). A resolver that hangs is given ``limit_s``."""
    outcome: list[BaseException | None] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            outcome.append(None)
        except (OSError, UnicodeError) as e:
            outcome.append(e)

    worker = threading.Thread(target=resolve, name="zerotron-resolve", daemon=True)
    worker.start()
    worker.join(limit_s)
    fix = "give node 0's host name or IP address, as every node can reach it"
    if not outcome:
        raise ConfigError(f"--master_addr {addr!r} did not resolve within {limit_s:g} s", fix=fix)
    err = outcome[0]
    if err is not None:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConfigError(f"--master_addr {addr!r} does not resolve: {reason}", fix=fix)


def _in_cwd(top: str) -> bool:
    return os.path.isdir(top) or os.path.isfile(f"{top}.py")


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
