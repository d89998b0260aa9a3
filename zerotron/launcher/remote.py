"""Starting every node of a ``zerotron launch --hostfile`` job, and watching them to the end.

The launching node runs the commands that :func:`zerotron.launcher.multinode.plan` builds (one
``ssh`` per node, itself included when it is in the hostfile; or one ``pdsh``, ``mpirun`` or
``srun`` for all nodes), prints each line they write with its node's host in front
(``worker-1: [rank5]: ...``, as pdsh does) and decides what the job's exit code is:

- Every node's launcher ends with ``node I exits with code C`` and, when one of its ranks
  failed, its own account of which rank failed first (:mod:`zerotron.launcher.failures`). The
  launching node names the node that failed first (a node whose rank failed on its own, before
  one whose ranks failed because a peer on another node left, before one that was stopped), shows
  that node's account, and exits with its code. A failed node never gives exit code 0.
- After a node fails, the others get ``--shutdown_timeout`` seconds (plus :data:`GRACE_S` for
  their launchers to report) to end on their own (their ranks usually fail at once on the closed
  connections); then they are stopped.
- SIGINT, SIGTERM and SIGHUP stop every node, and the launcher exits with 128 + the signal.

A node's launcher must also end when the launching one ends without a word (SIGKILL) or the
connection to it drops. Every node's launcher gets ``--lifeline`` (:func:`watch_lifeline`):

- ``stdin`` (ssh, pdsh): it ends when its standard input closes. ssh forwards the end of its
  input to the remote command, and the launching launcher holds the only write end of each ssh's
  input (pdsh: pdsh holds its ssh clients' input), so the remote input closes when the launching
  process ends for any reason, SIGKILL included, when it closes it on purpose (how it stops the
  ssh nodes, so that their reports still arrive), and when sshd loses the connection. Chosen over
  ``ssh -tt`` and SIGHUP: a pseudo-terminal merges stderr into stdout and rewrites line ends,
  and a killed launching process leaves its ssh clients, and so the remote session, alive.
- ``parent`` (mpirun, srun): it ends when its parent process (mpirun's or srun's daemon, which
  do not pass input to every node) exits; mpirun and srun stop their tasks themselves otherwise.

The one pdsh, mpirun or srun process gets SIGTERM when the launching launcher dies (Linux's
parent-death signal): each would otherwise live on, and its nodes with it, until it next writes
to the closed pipe.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, TextIO

from zerotron.errors import LaunchError
from zerotron.launcher.failures import caused_by_peer

if TYPE_CHECKING:
    from zerotron.launcher.multinode import MultiNodePlan, NodeCommand

GRACE_S = 10.0  # beyond --shutdown_timeout: for a node's launcher to stop its ranks and report
TAIL_LINES = 200  # stderr lines kept per node for the final report
PARENT_POLL_S = 0.2
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LIFELINES = ("stdin", "parent")
# Which lifeline each back end's node launchers get (see the module docstring).
LIFELINE_OF = {
    "ssh": "stdin",
    "pdsh": "stdin",
    "openmpi": "parent",
    "mpich": "parent",
    "slurm": "parent",
}
_SAY = "zerotron launch: "
_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_FAILED = re.compile(r"rank (\d+) failed first: (.*)")
_CAUSE = re.compile(r"cause: (.*)")
_EXITS = re.compile(r"node (\d+) exits with code (\d+)")
_STOPPED = re.compile(r"stopped by (SIG\w+)")
# How each back end marks which node a line came from (pdsh: "host: ", mpirun --tag-output:
# "[job,rank]<stdout>:", mpich -prepend-rank: "[rank] ", srun --label: "rank: ").
_TAGS = {
    "pdsh": re.compile(r"([\w.-]+): "),
    "openmpi": re.compile(r"\[\d+,(\d+)\]<std(?:out|err|diag)>: ?"),
    "mpich": re.compile(r"\[(\d+)\] ?"),
    "slurm": re.compile(r" *(\d+): ?"),
}


def watch_lifeline(kind: str, say: Callable[[str], None]) -> None:
    """Stop this node's launcher when the launching node goes away (see the module docstring).

    A daemon thread waits for the end of standard input (``stdin``) or for the parent process to
    exit (``parent``), then sends SIGTERM to this process: the elastic agent stops the node's
    ranks on it, as on any SIGTERM.
    """
    if kind not in LIFELINES:
        raise ValueError(f"lifeline {kind!r} is not one of {LIFELINES}")

    def watch() -> None:
        if kind == "stdin":
            with contextlib.suppress(OSError):
                while os.read(0, 1 << 16):
                    pass  # nothing is ever sent; only the end matters
            why = "its input closed (the launching node, or the connection to it, is gone)"
        else:
            parent = os.getppid()
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
            why = f"its parent process {parent} exited"
        with contextlib.suppress(OSError, ValueError):  # the console may have gone with it
            say(f"{why}: stopping this node's ranks")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zerotron-lifeline", daemon=True).start()


@dataclass
class _Node:
    """One node of the job, as its output tells it."""

    rank: int
    host: str
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    code: int | None = None  # its launcher's "exits with code", or its ssh's exit code
    failed_at: float | None = None  # when it was seen to fail (time.monotonic())
    first_rank: int | None = None
    how: str = ""
    cause: str = ""
    stopped: str | None = None  # the signal that stopped its launcher

    @property
    def name(self) -> str:
        return f"node {self.rank} ({self.host})"

    def report(self) -> list[str]:
        """Its launcher's closing account: the trailing run of its ``zerotron launch:`` lines."""
        said: list[str] = []
        for line in reversed(self.tail):
            if not line.startswith(_SAY):
                break
            said.append(line.removeprefix(_SAY))
        return [line for line in reversed(said) if not _EXITS.fullmatch(line)]


@dataclass
class _Started:
    """One back-end process (an ssh, or the one pdsh/mpirun/srun) and the nodes it runs."""

    command: NodeCommand
    nodes: list[_Node]
    proc: subprocess.Popen
    ended: float | None = None
    readers: list[threading.Thread] = field(default_factory=list)


class Supervisor:
    """Starts the commands of a plan, relays their output, and stops them (see module docs)."""

    def __init__(
        self,
        plan: MultiNodePlan,
        shutdown_timeout: float,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.plan = plan
        self.nodes = [_Node(i, host) for i, host in enumerate(plan.resources)]
        self._by_host = {node.host: node for node in self.nodes}
        self._stdout, self._stderr = stdout or sys.stdout, stderr or sys.stderr
        self._stop_after = shutdown_timeout + GRACE_S
        self._started: list[_Started] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._signal: int | None = None
        self._stopping_at: float | None = None

    def run(self) -> int:
        """Start every node, wait for all of them, and return the job's exit code."""
        for command in self.plan.commands:
            if shutil.which(command.argv[0]) is None:
                raise LaunchError(
                    f"--launcher {self.plan.launcher}: {command.argv[0]!r} not found on this host",
                    fix=_INSTALL.get(command.argv[0], "install it, or use --launcher ssh"),
                )
        if self.plan.launcher in _MPI_MARKS:
            check_mpirun(self.plan.launcher)
        saved = self._catch_signals()
        try:
            for command in self.plan.commands:
                self._start(command)
            self._watch()
        finally:
            for name, handler in saved.items():
                signal.signal(getattr(signal, name), handler)
            self._kill()
        for started in self._started:
            for reader in started.readers:
                reader.join(timeout=5)  # a grandchild may still hold the pipe
        return self._outcome()

    # -- starting and stopping -------------------------------------------------------------------

    def _start(self, command: NodeCommand) -> None:
        nodes = [self._by_host[host] for host in command.hosts]
        # The one back-end process ends with this one. (Not ssh: preexec_fn is unsafe once the
        # relay threads of the nodes started before run; ssh's nodes end through their input.)
        one = len(command.hosts) > 1 or self.plan.launcher != "ssh"
        proc = subprocess.Popen(
            command.argv,
            env={**os.environ, **command.env},
            preexec_fn=_dies_with_parent() if one else None,
            stdin=subprocess.PIPE,  # the nodes' lifeline (ssh, pdsh): never written, closed to stop
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's ctrl-C reaches the launcher, which stops all
        )
        started = _Started(command, nodes, proc)
        for pipe, console in ((proc.stdout, self._stdout), (proc.stderr, self._stderr)):
            reader = threading.Thread(
                target=self._relay,
                args=(started, pipe, console, console is self._stderr),
                name=f"zerotron-relay-{proc.pid}",
                daemon=True,
            )
            reader.start()
            started.readers.append(reader)
        self._started.append(started)

    def _catch_signals(self) -> dict[str, object]:
        saved: dict[str, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return saved

        def caught(signum: int, frame: object) -> None:
            if self._signal is None:
                self._signal = signum
            else:  # a second ctrl-C: no more waiting for the nodes' reports
                self._stopping_at = float("-inf")
            self._wake.set()

        for name in _SIGNALS:
            saved[name] = signal.signal(getattr(signal, name), caught)
        return saved

    def _watch(self) -> None:
        while True:
            now = time.monotonic()
            running = False
            for started in self._started:
                code = started.proc.poll()
                if code is None:
                    running = True
                elif started.ended is None:
                    self._ended(started, code, now)
            if not running:
                return
            if self._stopping_at is None:
                failed = [n.failed_at for n in self.nodes if n.failed_at is not None]
                if self._signal is not None:
                    self._say(f"{signal.Signals(self._signal).name}: stopping every node")
                    self._stop(now)
                elif failed and now - min(failed) > self._stop_after:
                    self._say("stopping the nodes that are still running")
                    self._stop(now)
            elif now - self._stopping_at > self._stop_after:
                self._kill()
            self._wake.wait(0.1)
            self._wake.clear()

    def _ended(self, started: _Started, code: int, now: float) -> None:
        started.ended = now
        for node in started.nodes:
            if len(started.nodes) == 1 and node.code is None:
                node.code = _exit_code(code)  # ssh passes the node launcher's exit code on
            if (code != 0 or (node.code or 0) != 0) and node.failed_at is None:
                node.failed_at = now

    def _stop(self, now: float) -> None:
        """Tell every node to stop its ranks: close the lifelines, signal mpirun/pdsh/srun."""
        self._stopping_at = now
        for started in self._started:
            with contextlib.suppress(OSError):
                started.proc.stdin.close()  # ssh: the remote launcher's input ends
            if started.ended is not None or self.plan.launcher == "ssh":
                continue
            with contextlib.suppress(ProcessLookupError):
                if self.plan.launcher == "pdsh":  # pdsh passes no input on: end its ssh clients
                    os.killpg(started.proc.pid, signal.SIGTERM)
                else:  # mpirun and srun pass SIGTERM on to their tasks
                    started.proc.send_signal(signal.SIGTERM)

    def _kill(self) -> None:
        for started in self._started:
            if started.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(started.proc.pid, signal.SIGKILL)
                started.proc.wait()

    # -- output ----------------------------------------------------------------------------------

    def _relay(self, started: _Started, pipe: IO[bytes], console: TextIO, is_stderr: bool) -> None:
        tag = _TAGS.get(self.plan.launcher) if len(started.nodes) > 1 else None
        for raw in pipe:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            node = started.nodes[0] if tag is None else None
            if tag is not None:
                m = tag.match(line)
                node = self._node_of(m.group(1)) if m else None
                if node is not None:
                    line = line[m.end() :]
            with self._lock:
                if node is not None:
                    self._seen(node, line, is_stderr)
                text = line if node is None else f"{node.host}: {line}"
                with contextlib.suppress(BrokenPipeError, ValueError):
                    console.write(text + "\n")
                    console.flush()
        pipe.close()

    def _node_of(self, tag: str) -> _Node | None:
        if tag.isdigit() and self.plan.launcher != "pdsh":
            return self.nodes[int(tag)] if int(tag) < len(self.nodes) else None
        return self._by_host.get(tag)

    def _seen(self, node: _Node, line: str, is_stderr: bool) -> None:
        if not is_stderr:
            return
        node.tail.append(line)
        said = line.removeprefix(_SAY)
        if said == line:
            return
        if m := _FAILED.fullmatch(said):
            node.first_rank, node.how = int(m.group(1)), m.group(2)
            node.failed_at = node.failed_at or time.monotonic()
        elif (m := _CAUSE.fullmatch(said)) and not node.cause:
            node.cause = m.group(1)
        elif m := _EXITS.fullmatch(said):
            node.code = int(m.group(2))
            if node.code and node.failed_at is None:
                node.failed_at = time.monotonic()
            self._wake.set()
        elif m := _STOPPED.match(said):
            node.stopped = m.group(1)

    def _say(self, text: str) -> None:
        with self._lock, contextlib.suppress(BrokenPipeError, ValueError):
            self._stderr.write("".join(f"{_SAY}{line}\n" for line in text.splitlines()))
            self._stderr.flush()

    # -- the outcome -----------------------------------------------------------------------------

    def _outcome(self) -> int:
        backend = max((_exit_code(s.proc.returncode) for s in self._started), default=0)
        # A node that named a failed rank failed, also when its last line was lost.
        failed = [n for n in self.nodes if n.code or (n.code is None and n.first_rank is not None)]
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            left = [n.name for n in self.nodes if n.code is None]
            said = f"stopped by {name}; every node was stopped"
            if left:
                said += f" (no word from {', '.join(left)}: its ssh/back end was ended)"
            self._say(said)
            return 128 + self._signal
        if not failed:
            if backend == 0:
                return 0
            self._say(
                f"{self.plan.launcher} exited with code {backend}, but no node's launcher "
                "reported a failure: see the lines above"
            )
            return backend
        first, *others = sorted(failed, key=self._order)
        lines = [f"{first.name} failed first: {self._how(first)}"]
        if first.cause:
            lines.append(f"cause: {first.cause}")
        report = first.report()
        if report:
            lines.append(f"{first.name}'s report:")
            lines += [f"  {line}" for line in report]
        else:
            said = list(first.tail)[-12:]
            head = "reported nothing; its last lines:" if said else "wrote nothing to stderr"
            lines.append(f"{first.name} {head}")
            lines += [f"  {line}" for line in said]
        if others:
            lines.append("then: " + "; ".join(f"{n.name}: {self._how(n)}" for n in others))
        self._say("\n".join(lines))
        return first.code or backend or 1

    def _kind(self, node: _Node) -> int:
        """0: a rank failed on its own, 1: because a peer left, 2: the node was stopped."""
        if node.stopped or (self._stopping_at and (node.failed_at or 0) >= self._stopping_at):
            return 2
        return 1 if caused_by_peer(node.cause or node.how) else 0

    def _order(self, node: _Node) -> tuple[int, float, int]:
        """By kind (:meth:`_kind`), then by when its failure was seen."""
        return (self._kind(node), node.failed_at or float("inf"), node.rank)

    def _how(self, node: _Node) -> str:
        if node.stopped:
            return f"stopped by {node.stopped} (exit code {node.code})"
        if node.first_rank is None:
            via = "its ssh" if self.plan.launcher == "ssh" else "its launcher"
            return f"{via} exited with code {node.code} before naming a failed rank"
        peer = " (a peer left)" if self._kind(node) == 1 else ""
        return f"rank {node.first_rank}, {node.how}{peer}"


_INSTALL = {
    "pdsh": "install pdsh (Debian/Ubuntu: apt-get install pdsh), or use --launcher ssh",
    "mpirun": "install Open MPI or MPICH (Debian/Ubuntu: apt-get install openmpi-bin), or use "
    "--launcher ssh",
    "srun": "run inside a SLURM allocation (salloc/sbatch), or use --launcher ssh",
    "ssh": "install an ssh client (Debian/Ubuntu: apt-get install openssh-client)",
}


# What each MPI's `mpirun --version` says of itself. MPICH's Hydra also runs Intel MPI and
# MVAPICH, which take MPICH's flags; Open MPI 4 calls its runtime OpenRTE.
_MPI_MARKS = {
    "openmpi": ("Open MPI", "OpenRTE", "open-mpi.org"),
    "mpich": ("HYDRA", "Intel(R) MPI"),
}
_MPI_NAMES = {"openmpi": "Open MPI", "mpich": "MPICH (Hydra)"}


def check_mpirun(launcher: str) -> None:
    """Refuse an ``mpirun`` on PATH from the other MPI than ``--launcher`` names.

    Open MPI's and MPICH's mpirun take different flags (``--host``/``-x`` against
    ``-hosts``/``-genv``), and each stops at the other's with a parse error that does not say
    so; a machine with both (Debian's ``mpirun`` alternative) runs whichever is first. An
    ``mpirun`` that says nothing this recognises is left to run.
    """
    try:
        said = subprocess.run(
            ["mpirun", "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return  # mpirun's own error, when it runs, says more than a guess here
    text = said.stdout + said.stderr
    for other, marks in _MPI_MARKS.items():
        if other != launcher and any(mark in text for mark in marks):
            raise LaunchError(
                f"--launcher {launcher}: the mpirun on PATH ({shutil.which('mpirun')}) is "
                f"{_MPI_NAMES[other]}'s, not {_MPI_NAMES[launcher]}'s",
                fix=f"use --launcher {other}, or put {_MPI_NAMES[launcher]}'s mpirun first on "
                "PATH (a cluster's `module load`; Debian installs mpirun.openmpi and "
                "mpirun.mpich)",
            )


def _dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get SIGTERM when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # died before the signal was armed
            os._exit(1)

    return arm


def _exit_code(code: int) -> int:
    """A child's return code as a shell shows it: a signal N is 128 + N."""
    return 128 - code if code < 0 else code


def supervise(plan: MultiNodePlan, shutdown_timeout: float) -> int:
    """Run ``plan``'s commands (one per back-end process) to the end; the job's exit code."""
    return Supervisor(plan, shutdown_timeout).run()
