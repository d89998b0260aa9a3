"""Elastic jobs and preemption, for one node's launcher (:mod:`zerotron.launcher.launch`).

- Node counts: ``--nnodes N`` is a fixed count (static rendezvous); torchrun's ``--nnodes
  MIN:MAX``, or ``--min_nodes``/``--max_nodes`` (DeepSpeed's ``--min_elastic_nodes`` and
  ``--max_elastic_nodes``), make the job elastic: torch's c10d rendezvous
  (:class:`zerotron.launcher.rendezvous.ElasticRendezvous`), and after a node is lost the
  ``--max_restarts`` restarts go on with the nodes left, as long as there are ``MIN``.
- Preemption: SIGUSR1 (SLURM's ``--signal=USR1@90``) goes on to the ranks instead of ending the
  launcher, and stops further restarts; SIGTERM the agent passes on itself. Ranks running
  ``zerotron pretrain --save-on-signal`` save and exit with
  :data:`zerotron.training.preemption.EXIT_CODE`, which the launcher then exits with too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import threading

from zerotron.errors import ConfigError
from zerotron.launcher.rendezvous import lost_report
from zerotron.training import preemption


def node_counts(args: argparse.Namespace) -> tuple[int, int | None]:
    """(the most nodes, the fewest or None for a fixed count) from --nnodes [MIN:]MAX,
    --min_nodes and --max_nodes (DeepSpeed's --min/max_elastic_nodes)."""
    most = args.max_nodes if args.max_nodes is not None else args.nnodes
    if args.max_nodes is not None and args.nnodes is not None and args.nnodes != args.max_nodes:
        raise ConfigError(
            f"--nnodes {args.nnodes} and --max_nodes {args.max_nodes} disagree",
            fix="give the largest node count once: --nnodes MIN:MAX, or --min_nodes/--max_nodes",
        )
    most = 1 if most is None else most
    fewest = args.min_nodes
    if fewest is not None and not 1 <= fewest <= most:
        raise ConfigError(
            f"the fewest nodes ({fewest}) must be in 1 .. {most}, the most nodes",
            where="--nnodes MIN:MAX / --min_nodes",
            fix="e.g. --nnodes 1:2 lets a 2-node job go on with 1 node after losing one",
        )
    return most, (None if fewest == most else fewest)


def rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv_conf k=v,k=v`` as torchrun reads it."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--rdzv_conf: {item!r} is not KEY=VALUE",
                fix="e.g. --rdzv_conf last_call_timeout=5",
            )
        conf[key.strip()] = value.strip()
    return conf


def pass_on_usr1(agent: object) -> list[str]:
    """SIGUSR1 (SLURM's warning, ``--signal=USR1@90``) goes on to this node's ranks, which save
    and exit with ``--save-on-signal``; the launcher stays, and restarts no more (the job is
    being stopped, not failing). Its default action would end the launcher alone. Returns the
    list the names of the signals passed on are added to."""
    passed: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        return passed

    def pass_on(signum: int, frame: object) -> None:
        passed.append(signal.Signals(signum).name)
        with contextlib.suppress(AttributeError):
            agent._remaining_restarts = 0  # type: ignore[attr-defined]  # torch's counter
        for worker in agent.get_worker_group().workers:  # type: ignore[attr-defined]
            if worker.id is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(worker.id, signum)

    signal.signal(signal.SIGUSR1, pass_on)
    return passed


def all_saved(agent: object) -> bool:
    """Whether this node's ranks stopped on --save-on-signal after the launcher passed a signal
    on (torch keeps the processes in its private context; unknown counts as no)."""
    try:
        handlers = agent._pcontext.subprocess_handlers.values()  # type: ignore[attr-defined]
        codes = [h.proc.poll() for h in handlers]
    except AttributeError:
        return False
    return saved_codes(codes)


def saved_codes(codes: list[int | None]) -> bool:
    """Whether exit codes say the ranks saved on a signal and stopped: one rank at least exited
    with :data:`~zerotron.training.preemption.EXIT_CODE` and the others with it too or by a signal.

    A rank exits with that code only after the save's last barrier, which every rank passes once
    the checkpoint is complete; the agent then stops the ranks still exiting (SIGTERM), and such
    a rank lost nothing.
    """
    code = preemption.EXIT_CODE
    return code in codes and all(c == code or (c is not None and c < 0) for c in codes)


def saved_message(what: str) -> str:
    """The launcher's word when its ranks saved and stopped on ``what`` (a signal)."""
    return (
        f"stopped by {what}: every local rank saved a checkpoint and exited (--save-on-signal); "
        f"resume with the same command and --load (exit code {preemption.EXIT_CODE})"
    )


def lost_suffix(rdzv: object) -> str:
    """`` (node 1 (ADDR) was lost (restart 1))`` for an error message, or ''."""
    lost = lost_report(getattr(rdzv, "lost", []))
    return f" ({lost})" if lost else ""


def failure_note(report: str, rdzv: object) -> str:
    """What the launcher adds to a failed job's report about the nodes: those that left during
    the job (seen at a restart), and those of the last round whose address the failing ranks
    name as the peer that went away ("Connection closed by peer [ADDR]:PORT")."""
    notes = []
    lost = lost_report(getattr(rdzv, "lost", []))
    if lost:
        notes.append(f"during the job, {lost}")
    own = getattr(rdzv, "label", None)
    for label in getattr(rdzv, "members", []):
        addr = label[label.find("(") + 1 : -1]
        if label != own and re.search(rf"\[?{re.escape(addr)}\]?:\d+", report):
            notes.append(f"the ranks here lost {label}: its ranks (or the node) went away first")
    return "\n".join(notes)
