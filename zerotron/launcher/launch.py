"""``zerotron launch``: run one training program as many processes, on one node or many.

    zerotron launch --nproc_per_node 8 -m zerotron pretrain --tensor-model-parallel-size 2 ...
    zerotron launch --nnodes 2 --node_rank 0 --master_addr node0 --master_port 29500 train.py ...
    zerotron launch --hostfile hosts --include "w0@w1:0,2" --dry-run train.py ...

Each node runs one launcher. It starts PyTorch's elastic agent (the engine behind ``torchrun``)
with a static rendezvous: the agent numbers the ranks node by node (node 0's first; nodes may run
different numbers of them), and every worker finds its peers through the environment that
``torch.distributed``'s ``env://`` reads (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). The flags become a :class:`~zerotron.launcher.node.LaunchPlan`,
checked before anything starts (:mod:`zerotron.launcher.node`). On top of the agent:

- every output line carries its rank (``[rank3]: ...``) and ``--log_dir`` keeps one file per rank
  (:mod:`zerotron.launcher.output`);
- ``OMP_NUM_THREADS`` defaults to cores / local processes, so ranks do not fight over cores;
- every worker starts through :mod:`zerotron.launcher.bootstrap`, which has the kernel kill it
  when this launcher dies (even by SIGKILL) and binds its cores (``--bind_cores_to_rank``);
- with ``--hostfile``, the hosts and slots are selected as DeepSpeed's launcher does
  (:mod:`zerotron.launcher.hostfile`) and each node's command is built per back end
  (:mod:`zerotron.launcher.multinode`);
- when a rank fails, the agent stops the others at once (SIGTERM, then SIGKILL after
  ``--shutdown_timeout``), and the launcher names the rank that failed *first*, shows its
  traceback and exits with its exit code;
- when a rank's collective watchdog reports a wait past ``--watchdog-timeout``, the launcher
  asks every rank where it is, names the ranks that never arrived, and ends the job (exit code
  124) or, with ``--watchdog-action wait``, keeps waiting (:mod:`zerotron.launcher.hangs`).
- ``--nnodes MIN:MAX`` makes the job elastic (torch's c10d rendezvous instead of the static one):
  ``--max_restarts`` restarts go on with the nodes left, naming those that left, and SIGUSR1
  reaches the ranks for ``zerotron pretrain --save-on-signal`` (:mod:`zerotron.launcher.elastic`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from zerotron.errors import LaunchError
from zerotron.launcher import binding, elastic, multinode, network, pidfile, remote, slurm
from zerotron.launcher.node import (  # noqa: F401 - re-exported: tests and tools use these names
    RESOLVE_LIMIT_S,
    ZEROTRON_CLI_MODULES,
    LaunchPlan,
    plan_from_args,
    worker_args,
)
from zerotron.launcher.node import build as _plan
from zerotron.launcher.node import check_program as _check_program
from zerotron.launcher.node import default_nproc as _default_nproc
from zerotron.launcher.node import free_port as _free_port
from zerotron.launcher.node import parse as _parse

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from zerotron.launcher.hangs import HangWatch
    from zerotron.launcher.output import RankStreams

RUN_ID = "zerotron"  # static rendezvous: every node's agent must use the same id
_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def run(plan: LaunchPlan) -> int:
    """Start this node's workers, wait for them, and return the job's exit code."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from zerotron.launcher.hangs import HangWatch
    from zerotron.launcher.output import RankStreams

    rdzv = _rendezvous(plan)
    spec = WorkerSpec(
        role="worker",
        local_world_size=plan.nproc_per_node,
        rdzv_handler=rdzv,
        entrypoint=plan.entrypoint,
        args=(*_bootstrap(plan), *plan.worker_args),
        max_restarts=plan.max_restarts,
        monitor_interval=0.1,  # master_addr/port: the rendezvous gives them, per attempt
    )
    streams = RankStreams(log_dir=plan.log_dir, on_start=_Announcer(plan))
    # torch < 2.12's agent has no shutdown_timeout (it waits a fixed 30 s before SIGKILL); the
    # Watchdog below kills what outlives plan.shutdown_timeout either way.
    deadline: dict[str, float] = {}
    if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:
        deadline["shutdown_timeout"] = plan.shutdown_timeout
    agent = LocalElasticAgent(spec, logs_specs=streams, **deadline)
    where = f"node {plan.node_rank}, rendezvous at {plan.master_addr}"
    hangs = HangWatch(_reports_dir(plan), plan.watchdog_action, _say)
    try:
        return _supervise(plan, agent, streams, hangs, rdzv, where)
    finally:
        _clean_reports_dir(plan, hangs.directory)


def _supervise(
    plan: LaunchPlan,
    agent: LocalElasticAgent,
    streams: RankStreams,
    hangs: HangWatch,
    rdzv: Any,
    where: str,
) -> int:
    """Run the agent under the launcher's watchdog and turn its result into an exit code."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError

    from zerotron.launcher import rendezvous
    from zerotron.launcher.failures import Watchdog, summarize_failures, with_stopped_ranks
    from zerotron.launcher.hangs import HANG_EXIT_CODE
    from zerotron.training import preemption

    with (
        _launcher_state(plan, hangs.directory),
        streams,
        Watchdog(agent, plan.shutdown_timeout, hangs) as watchdog,
    ):
        passed_on = elastic.pass_on_usr1(agent)
        try:
            result = agent.run()
        except SignalException as e:
            name = signal.Signals(e.sigval).name
            if elastic.all_saved(agent):
                _say(elastic.saved_message(name))
                return preemption.EXIT_CODE
            _say(f"stopped by {name}; all local ranks were shut down")
            return 128 + int(e.sigval)
        except RendezvousError as e:
            raise LaunchError(
                f"the elastic rendezvous failed: {_first_line(e)}",
                where=where,
                fix=f"fewer than --min_nodes {plan.min_nodes} nodes came back within "
                "--rdzv_timeout, or node 0's launcher (it serves the rendezvous) is gone"
                + elastic.lost_suffix(rdzv),
            ) from e
        except DistError as e:
            raise LaunchError(
                f"could not open the rendezvous: {_first_line(e)}",
                where=where,
                fix="on node 0 pick a free --master_port; on the others check that node 0 is "
                "up and --master_addr/--master_port reach it",
            ) from e
    lost = rendezvous.lost_report(getattr(rdzv, "lost", []))
    if result is None or not result.is_failed():  # None: the rendezvous closed gracefully
        if lost:
            _say(f"the job finished on the nodes left: {lost}")
        return 0
    if hangs.aborted:  # the watchdog's summary said it all
        return HANG_EXIT_CODE
    if elastic.saved_codes([f.exitcode for f in result.failures.values()]):
        _say(elastic.saved_message(passed_on[0] if passed_on else "a signal"))
        return preemption.EXIT_CODE
    code, report = summarize_failures(
        with_stopped_ranks(agent, result.failures),
        watchdog.exit_times,
        streams,
        watchdog.finished,
        watchdog.killed,
    )
    note = elastic.failure_note(report, rdzv)
    _say(report + (f"\n{note}" if note else ""))
    return code


def _clean_reports_dir(plan: LaunchPlan, directory: str) -> None:
    """Remove the watchdog reports' directory, however the job ended (kept under --log_dir
    only when a rank reported)."""
    if plan.log_dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _reports_dir(plan: LaunchPlan) -> str:
    """Where the ranks' watchdog reports go: ``<log_dir>/watchdog``, kept, or a temporary
    directory removed at the end."""
    from zerotron.launcher.hangs import prepare_dir

    if plan.log_dir is not None:
        return prepare_dir(os.path.join(plan.log_dir, "watchdog"))
    return tempfile.mkdtemp(prefix="zerotron-watchdog-")


def _rendezvous(plan: LaunchPlan):  # -> RendezvousHandler
    """Static rendezvous for a fixed node count, torch's c10d one (elastic) for MIN:MAX."""
    from zerotron.launcher.rendezvous import ElasticRendezvous, StaticRendezvous

    if plan.elastic:
        rdzv = ElasticRendezvous(
            plan.master_addr,
            plan.master_port,
            node_rank=plan.node_rank,
            local_addr=network.route_source(plan.master_addr, plan.master_port),
            min_nodes=plan.min_nodes or plan.nnodes,
            max_nodes=plan.nnodes,
            run_id=RUN_ID,
            timeout_s=plan.rdzv_timeout,
            conf=plan.rdzv_conf,
            max_restarts=plan.max_restarts,
            say=_say,
        )
    else:
        rdzv = StaticRendezvous(
            plan.master_addr,
            partial(_port_of_attempt, plan),
            node_rank=plan.node_rank,
            nnodes=plan.nnodes,
            run_id=RUN_ID,
            timeout_s=plan.rdzv_timeout,
        )
        rdzv.say = _say  # progress while waiting for the other nodes
    return rdzv


def _port_of_attempt(plan: LaunchPlan, attempt: int) -> int:
    """The rendezvous port of attempt 0, 1, ...: every node computes the same one on its own."""
    if attempt == 0:
        return plan.master_port
    if plan.nnodes == 1 and not plan.port_given:
        return _free_port()
    return (plan.master_port + attempt - 1) % 65535 + 1  # 1 .. 65535


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _bootstrap(plan: LaunchPlan) -> list[str]:
    """The interpreter arguments that run :mod:`zerotron.launcher.bootstrap` before the program:
    the worker dies with this process and binds its cores, then execs ``plan.worker_args``."""
    options = ["--parent", str(os.getpid())]
    if plan.bind is not None:
        options += binding.bootstrap_options(plan.bind.cpus)
    return ["-m", "zerotron.launcher.bootstrap", *options, "--"]


def _banner(
    plan: LaunchPlan,
    envs: dict[int, dict[str, str]] | None = None,
    ifname_vars: list[str] | None = None,
) -> str:
    """What this node runs: its global ranks from the workers' ``envs`` as the agent numbered
    them (nodes may run different numbers of ranks), or from the plan alone: exact for one node,
    only the local count for many. ``ifname_vars``: the socket variables the launcher sets
    (default: those not set now)."""
    if envs:
        any_env = next(iter(envs.values()))
        node, nnodes = int(any_env["GROUP_RANK"]), int(any_env["GROUP_WORLD_SIZE"])
        first, last = (f(int(env["RANK"]) for env in envs.values()) for f in (min, max))
        world, where = any_env["WORLD_SIZE"], f"{any_env['MASTER_ADDR']}:{any_env['MASTER_PORT']}"
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        ranks += f" of {world}"
    else:
        node, nnodes, n = plan.node_rank, plan.nnodes, plan.nproc_per_node
        ranks = "rank 0 of 1" if n == 1 else f"ranks 0-{n - 1} of {n}"
        ranks = ranks if nnodes == 1 else f"{n} local rank(s)"
        where = f"{plan.master_addr}:{plan.master_port}"
    omp = os.environ["OMP_NUM_THREADS"] if plan.omp_num_threads is None else plan.omp_num_threads
    text = f"node {node} of {nnodes}: {ranks}, rendezvous at {where}, OMP_NUM_THREADS={omp}"
    if plan.socket_ifname is not None:
        if ifname_vars is None:
            ifname_vars = [v for v in network.IFNAME_VARS if v not in os.environ]
        text += f", {'/'.join(ifname_vars)}={plan.socket_ifname}"
    if plan.bind is not None:
        text += f", {plan.bind.describe()}"
    return text


class _Announcer:
    """Says the banner when the agent starts the workers (it knows their ranks only then), once
    per new layout: restarts on another port or with other nodes say it again."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan, self.said = plan, ""
        # Made before the launcher sets them: the banner names only what the user left unset.
        self.ifname_vars = [v for v in network.IFNAME_VARS if v not in os.environ]

    def __call__(self, envs: dict[int, dict[str, str]]) -> None:
        text = _banner(self.plan, envs, self.ifname_vars)
        if text != self.said:
            _say(text)
            self.said = text


def _say(text: str) -> None:
    print(
        "\n".join(f"zerotron launch: {line}" for line in text.splitlines()),
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def _launcher_state(plan: LaunchPlan, reports_dir: str | None = None) -> Iterator[None]:
    """Set what the agent reads from the launcher's process, and put it back afterwards.

    The agent passes OMP_NUM_THREADS, GLOO/NCCL_SOCKET_IFNAME (and PYTHONPATH, which
    ``--as-deepspeed`` extends) on from os.environ and installs its own signal handlers;
    restoring them keeps ``run`` safe to call from a longer-lived Python program (the tuner).
    """
    from zerotron.launcher import hangs

    keys = ("OMP_NUM_THREADS", "PYTHONPATH", *network.IFNAME_VARS, hangs.ENV_DIR, hangs.ENV_TIMEOUT)
    saved_env = {key: os.environ.get(key) for key in keys}
    if reports_dir is not None:
        os.environ[hangs.ENV_DIR] = reports_dir
    if plan.watchdog_timeout is not None:
        os.environ[hangs.ENV_TIMEOUT] = f"{plan.watchdog_timeout:g}"
    if plan.omp_num_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(plan.omp_num_threads)
    if plan.socket_ifname is not None:  # what the user set stays
        for var in network.IFNAME_VARS:
            os.environ.setdefault(var, plan.socket_ifname)
    if plan.as_deepspeed:
        from zerotron.compat import as_deepspeed

        as_deepspeed.environ(os.environ)
    saved_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for name in _HANDLED_SIGNALS:
            if hasattr(signal, name):
                saved_handlers[name] = signal.getsignal(getattr(signal, name))
    elastic_log = logging.getLogger("torch.distributed.elastic")
    saved_log = (elastic_log.propagate, list(elastic_log.handlers))
    if not plan.verbose:
        # The agent logs each step of a shutdown as a warning; the launcher's summary says it once.
        elastic_log.propagate = False
        elastic_log.handlers = [logging.NullHandler()]
    try:
        yield
    finally:
        elastic_log.propagate, elastic_log.handlers = saved_log
        for name, handler in saved_handlers.items():
            signal.signal(getattr(signal, name), handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main(argv: list[str] | None = None) -> int:
    """``zerotron launch [flags] script.py|-m module [args...]``; returns the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.autotuning:  # DeepSpeed's --autotuning tune|run: zerotron.tuning.tune
        from zerotron.launcher.autotune import run_autotuning

        _check_program(args.script, args.module)
        return run_autotuning(args, argv)
    slurm.fill_in(args, os.environ)  # hosts, slots, node rank of a SLURM allocation
    if multinode.wanted(args):
        _check_program(args.script, args.module)
        if args.bind_core_list is not None:  # each node shares it out; its text is checked here
            binding.parse_cpu_list(args.bind_core_list)
        run_node = lambda node_argv: _run_node(plan_from_args(node_argv))  # noqa: E731
        local = _default_nproc() if args.hostfile is None else 1
        return multinode.run_job(args, run_node, local)
    plan = _plan(args)
    if args.dry_run:
        _say(_banner(plan) + f", {plan.nproc_per_node} process(es) running:")
        print(shlex.join([plan.entrypoint, *plan.worker_args]), flush=True)
        return 0
    if args.lifeline is None:
        return _run_node(plan)
    # Started by a launching node (launcher/remote.py), which reads this node's last line.
    remote.watch_lifeline(args.lifeline, _say)
    code = _run_node(plan)
    with contextlib.suppress(OSError):  # the launching node may be gone
        _say(f"node {plan.node_rank} exits with code {code}")
    return code


def _run_node(plan: LaunchPlan) -> int:
    """:func:`run`, with ``--save_pid``'s file there while it runs."""
    with pidfile.saved(plan.pid_key) as path:
        if path is not None:
            _say(f"launcher PID {os.getpid()} saved in {path}")
        return run(plan)


if __name__ == "__main__":
    from zerotron import cli

    sys.exit(cli.main(["launch", *sys.argv[1:]]))  # the CLI's error messages and exit codes
