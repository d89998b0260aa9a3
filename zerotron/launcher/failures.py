"""Who failed first, and what it said: the launcher's account of a failed job.

When one rank fails, its peers usually fail too, moments later, on broken connections (gloo) or
when the launcher stops them. The useful report names the rank that failed *first*, shows its
traceback and exits with its exit code. The agent cannot tell: it looks at its workers every
0.1 s and stamps failures in whole seconds, so by its account they all fail together.

A rank's failure moment is taken as

- the moment its last words reached the launcher: a traceback after which the rank printed
  nothing more than ``LAST_WORDS_S`` seconds later. The exception happened then; tearing the
  process down can take much longer (meanwhile its peers see the closed connections and exit
  first, and the launcher may even stop it). A traceback followed by more output later was
  handled, and is not the reason the rank ended.
- otherwise the moment its process ended (``os._exit``, a crash, the OOM killer: nothing was
  printed), seen by :class:`Watchdog` within microseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import ElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from zerotron.launcher.output import RankStreams

LAST_WORDS_S = 2.0  # output allowed after a fatal traceback (teardown messages)
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class Watchdog:
    """Watches the worker processes beside the agent: when each ended, and who must be killed.

    - Exit times. One thread per worker blocks in ``waitid(WNOWAIT)``, which returns the moment
      the process ends without reaping it (the agent still collects its exit status).
    - Deadline. After a failure the agent sends SIGTERM to the other workers but then waits a
      fixed 30 s before SIGKILL. Here a worker still alive ``shutdown_timeout`` seconds after the
      first failure is killed, with its whole process group (as the agent would).
    """

    def __init__(self, agent: ElasticAgent, shutdown_timeout: float) -> None:
        self._agent = agent
        self._shutdown_timeout = shutdown_timeout
        self.exit_times: dict[int, float] = {}  # pid -> time.monotonic() when it ended
        self._running: set[int] = set()
        self._failed_at: float | None = None
        self._doomed: set[int] = set()  # running when the first failure happened
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerotron-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if hasattr(os, "waitid"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        watched: set[int] = set()
        while not self._stop.wait(0.01):
            for worker in self._agent.get_worker_group().workers:
                pid = worker.id
                if pid is not None and pid not in watched:
                    watched.add(pid)
                    with self._lock:
                        self._running.add(pid)
                    threading.Thread(
                        target=self._wait, args=(pid,), name=f"zerotron-wait-{pid}", daemon=True
                    ).start()
            self._enforce_deadline()

    def _wait(self, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            failed = not (info.si_code == os.CLD_EXITED and info.si_status == 0)
        except ChildProcessError:  # the agent reaped it already; it knows how it ended
            failed = False
        now = time.monotonic()
        with self._lock:
            self.exit_times[pid] = now
            self._running.discard(pid)
            if failed and self._failed_at is None:
                self._failed_at, self._doomed = now, set(self._running)

    def _enforce_deadline(self) -> None:
        with self._lock:
            if self._failed_at is None or time.monotonic() - self._failed_at < (
                self._shutdown_timeout
            ):
                return
            # Only the failed attempt's workers: a restarted group may be running already.
            survivors = self._doomed & self._running
            self._failed_at, self._doomed = None, set()
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each worker leads its own session


def summarize_failures(
    failures: dict[int, ProcessFailure], exit_times: dict[int, float], streams: RankStreams
) -> tuple[int, str]:
    """Name the rank that failed first and show what it printed; return (exit code, text).

    ``failures`` maps global rank -> the agent's ProcessFailure; ``exit_times`` maps pid -> when
    it ended (:class:`Watchdog`); ``streams`` has each rank's last stderr lines with arrival times
    and the time of its last output line.

    The exit code is the first rank's, a signal N counting as 128 + N, except when the rank's
    last words were a traceback and a signal ended it while it was exiting (the launcher stopping
    it, or an abort in a library's teardown): that rank failed by raising, which is exit code 1.
    """
    inf = float("inf")

    def order(item: tuple[int, ProcessFailure]) -> tuple[float, float, bool, int]:
        rank, f = item
        said = _last_words_at(rank, streams)
        return (min(said, exit_times.get(f.pid, inf)), f.timestamp, _stopped_by_us(f), rank)

    (rank, first), *others = sorted(failures.items(), key=order)
    raised = _last_words_at(rank, streams) < inf
    code = _exit_code(first.exitcode)
    how = _how(first.exitcode)
    if raised and first.exitcode < 0:
        code, how = 1, f"raised an exception, then was {how} while exiting"
    lines = [f"rank {rank} failed first: {how}"]
    tail = [text for _, text in streams.tail(rank)]
    start = traceback_start(tail)
    if start is not None:
        lines.append(f"rank {rank}'s traceback:")
        said = tail[start:]
    else:
        said = tail[-12:]
        lines.append(
            f"rank {rank}'s last lines on stderr:"
            if said
            else f"rank {rank} wrote nothing to stderr"
        )
    lines += [f"  {line}" for line in said]
    if others:
        lines.append("then: " + ", ".join(f"rank {r} {_how(f.exitcode)}" for r, f in others))
    log = streams.log_path(rank)
    if log:
        lines.append(f"rank {rank}'s full output: {log}")
    return code, "\n".join(lines)


def _last_words_at(rank: int, streams: RankStreams) -> float:
    """When the rank's final traceback arrived, if nothing came later (see above); else inf."""
    lines = streams.tail(rank)
    start = traceback_start([text for _, text in lines])
    if start is None or streams.last_output(rank) - lines[start][0] > LAST_WORDS_S:
        return float("inf")
    return lines[start][0]


def traceback_start(lines: list[str]) -> int | None:
    """Index of the line that starts the last Python traceback, chained exceptions included."""
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
    if not starts:
        return None
    k = len(starts) - 1
    # "During handling of the above exception..." joins a traceback to the one before it.
    while k > 0 and any(line.startswith(_CHAINED) for line in lines[starts[k - 1] + 1 : starts[k]]):
        k -= 1
    return starts[k]


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by signal {-exitcode} ({_signal_name(-exitcode)})"
    return f"exit code {exitcode}"


def _stopped_by_us(failure: ProcessFailure) -> bool:
    """SIGTERM and SIGKILL are how the launcher stops the ranks that are still running."""
    return failure.exitcode in (-signal.SIGTERM, -signal.SIGKILL)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def _exit_code(exitcode: int) -> int:
    """A worker's exit code as the launcher's: a signal N becomes 128 + N, as in a shell."""
    return 128 - exitcode if exitcode < 0 else exitcode
