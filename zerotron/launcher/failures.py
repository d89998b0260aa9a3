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

Last words are a traceback or zerotron's clean one-line error (``zerotron pretrain: error:
...``). Time alone is not enough: a rank that fails cleanly closes its connections before its
process ends, and its peers' "Connection closed by peer" can arrive first. So a rank whose
last words say a peer left or got stuck (see :data:`_PEER_PHRASES`) ranks after the ranks that
failed on their own, and a rank the launcher stopped after both.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import ElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from zerotron.launcher.hangs import HangWatch
    from zerotron.launcher.output import RankStreams

LAST_WORDS_S = 2.0  # output allowed after a fatal traceback (teardown messages)
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_CLEAN_ERROR = re.compile(r"^(rank \d+: )?zerotron [\w-]+: error: ")
_CPP_FRAME = re.compile(r"^(frame #\d+: |<omitting python frames>)")
_STUCK = re.compile(r"\b(ranks? \d+(?:, \d+)*) (is|are) stuck\b")
# What a rank says when it failed because of a peer, not on its own (lower case).
_PEER_PHRASES = (
    "a peer left",
    " is stuck",
    " are stuck",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "caused by a remote worker",  # gloo: "...typically caused by a remote worker crashing"
    "connection was likely closed",
)


class Watchdog:
    """Watches the worker processes beside the agent: when each ended, and who must be killed.

    - Exit times. One thread per worker blocks in ``waitid(WNOWAIT)``, which returns the moment
      the process ends without reaping it (the agent still collects its exit status).
    - Deadline. After a failure the agent sends SIGTERM to the other workers but then waits a
      fixed 30 s before SIGKILL. Here a worker still alive ``shutdown_timeout`` seconds after the
      first failure is killed, with its whole process group (as the agent would).
    - Hangs. With ``hangs``, the ranks' collective-watchdog reports are looked at every 0.1 s;
      when :class:`~zerotron.launcher.hangs.HangWatch` ends the job, every running worker gets
      SIGTERM at once, and SIGKILL ``shutdown_timeout`` seconds later.
    """

    def __init__(
        self, agent: ElasticAgent, shutdown_timeout: float, hangs: HangWatch | None = None
    ) -> None:
        self._agent = agent
        self.hangs = hangs
        self._shutdown_timeout = shutdown_timeout
        self.exit_times: dict[int, float] = {}  # pid -> time.monotonic() when it ended
        self.finished: dict[int, float] = {}  # global rank -> when it exited with code 0
        self._ranks: dict[int, int] = {}  # pid -> global rank
        self._running: set[int] = set()
        self._failed_at: float | None = None
        self._doomed: set[int] = set()  # running when the first failure happened
        self.killed: set[int] = set()  # pids this watchdog sent SIGKILL (deadline)
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
        ticks = 0
        while not self._stop.wait(0.01):
            ticks += 1
            if self.hangs is not None and ticks % 10 == 0:
                self._look_for_hangs()
            for worker in self._agent.get_worker_group().workers:
                pid = worker.id
                if pid is not None and pid not in watched:
                    watched.add(pid)
                    self._ranks[pid] = worker.global_rank
                    with self._lock:
                        self._running.add(pid)
                    threading.Thread(
                        target=self._wait, args=(pid,), name=f"zerotron-wait-{pid}", daemon=True
                    ).start()
            self._enforce_deadline()

    def _wait(self, pid: int) -> None:
        clean = False
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            clean = info.si_code == os.CLD_EXITED and info.si_status == 0
            failed = not clean
        except ChildProcessError:  # the agent reaped it already; it knows how it ended
            failed = False
        now = time.monotonic()
        with self._lock:
            self.exit_times[pid] = now
            self._running.discard(pid)
            if clean and self._ranks.get(pid) is not None:
                self.finished[self._ranks[pid]] = now
            if failed and self._failed_at is None:
                self._failed_at, self._doomed = now, set(self._running)

    def _look_for_hangs(self) -> None:
        with self._lock:
            workers = {pid: self._ranks[pid] for pid in self._running if pid in self._ranks}
        if not workers or not self.hangs.poll(workers):
            return
        with self._lock:
            if self._failed_at is None:
                self._failed_at, self._doomed = time.monotonic(), set(self._running)
            doomed = set(self._running)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)

    def _enforce_deadline(self) -> None:
        with self._lock:
            if self._failed_at is None or time.monotonic() - self._failed_at < (
                self._shutdown_timeout
            ):
                return
            # Only the failed attempt's workers: a restarted group may be running already.
            survivors = self._doomed & self._running
            self._failed_at, self._doomed = None, set()
            self.killed |= survivors
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each worker leads its own session


def with_stopped_ranks(agent: object, failures: dict[int, ProcessFailure]) -> dict:
    """``failures`` (the agent's, by global rank) with the ranks the agent stopped after the first
    failure, as later torch reports them itself; torch 2.8's subprocess context records only the
    ranks that had failed when it looked. Their exit codes come from the agent's processes (its
    private context, as :func:`zerotron.launcher.elastic.all_saved` reads them)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    try:
        pcontext = agent._pcontext  # type: ignore[attr-defined]
        handlers = pcontext.subprocess_handlers
        workers = agent.get_worker_group().workers  # type: ignore[attr-defined]
    except AttributeError:
        return failures
    out = dict(failures)
    for worker in workers:
        handler = handlers.get(worker.local_rank)
        code = handler.proc.poll() if handler is not None else None
        if worker.global_rank in out or not code:
            continue
        out[worker.global_rank] = ProcessFailure(
            local_rank=worker.local_rank,
            pid=handler.proc.pid,
            exitcode=code,
            error_file=pcontext.error_files.get(worker.local_rank, ""),
        )
    return out


def summarize_failures(
    failures: dict[int, ProcessFailure],
    exit_times: dict[int, float],
    streams: RankStreams,
    finished: dict[int, float] | None = None,
    killed: set[int] | None = None,
) -> tuple[int, str]:
    """Name the rank that failed first and show what it said; return (exit code, text).

    ``failures`` maps global rank -> the agent's ProcessFailure; ``exit_times`` maps pid -> when
    it ended (:class:`Watchdog`); ``streams`` has each rank's last stderr lines with arrival times
    and the time of its last output line; ``finished`` maps the ranks that exited with code 0 to
    when they did; ``killed`` has the pids the launcher's deadline sent SIGKILL.

    The first rank is the earliest of those that failed on their own, before those that failed
    because a peer left or got stuck ("Connection closed by peer", a timeout, zerotron's "a peer
    left"), before those the launcher stopped. Its cause (the exception line, or zerotron's
    one-line error) comes first, then its traceback with C++ frames folded. A rank that exited 0
    while its peers still ran is reported, and named as the cause when every failure came from a
    peer. A rank named as stuck by a timed-out collective is said first.

    The exit code is the first rank's, a signal N counting as 128 + N, except when the rank's
    last words were an error and a signal ended it while it was exiting (the launcher stopping
    it, or an abort in a library's teardown): that rank failed by raising (exit code 1, or 2 for
    zerotron's clean error).
    """
    facts = _facts(failures, exit_times, streams, killed or set())
    (rank, first), *others = sorted(facts.items(), key=lambda item: item[1].order(item[0]))
    code, how = _exit_code(first.failure.exitcode), _how(first.failure.exitcode)
    if first.words is not None and first.failure.exitcode < 0:
        code = 2 if first.words.clean else 1
        how = f"raised an exception, then was {how} while exiting"
    lines = _early_exits(finished or {}, first, rank)
    stuck = _stuck(first)
    if stuck:
        lines.insert(0, f"{stuck} stuck, named by rank {rank}")
    lines.append(f"rank {rank} failed first: {how}")
    lines += _what_it_said(rank, first, streams)
    if others:
        lines.append(
            "then: " + ", ".join(f"rank {r} {_how(f.failure.exitcode)}" for r, f in others)
        )
    log = streams.log_path(rank)
    if log:
        lines.append(f"rank {rank}'s full output: {log}")
    return code, "\n".join(lines)


@dataclass
class _Words:
    """A rank's last words: an uncaught traceback or zerotron's clean one-line error."""

    at: float  # when they arrived (time.monotonic())
    lines: list[str]  # from the start of the traceback or error
    cause: str  # the one line that says what went wrong
    clean: bool  # zerotron's error line (no traceback)


@dataclass
class _Fact:
    failure: ProcessFailure
    words: _Words | None
    at: float  # when it failed: its last words, or its exit
    ended: float  # when its process ended (inf: not seen)
    kind: int = 0  # 0 on its own, 1 because of a peer, 2 stopped by the launcher

    def order(self, rank: int) -> tuple[int, float, int]:
        return (self.kind, self.at, rank)


def _facts(
    failures: dict[int, ProcessFailure],
    exit_times: dict[int, float],
    streams: RankStreams,
    killed: set[int],
) -> dict[int, _Fact]:
    inf = float("inf")
    facts = {}
    for rank, f in failures.items():
        words = _last_words(rank, streams)
        ended = exit_times.get(f.pid, inf)
        facts[rank] = _Fact(f, words, min(words.at if words else inf, ended), ended)
    earliest = min(fact.at for fact in facts.values())
    for fact in facts.values():
        if fact.words is not None and _peer_caused(fact.words):
            fact.kind = 1
        elif fact.words is None and _stopped_by_us(fact.failure, killed) and fact.at > earliest:
            fact.kind = 2
    return facts


def _what_it_said(rank: int, fact: _Fact, streams: RankStreams) -> list[str]:
    if fact.words is not None:
        title = f"rank {rank}'s error:" if fact.words.clean else f"rank {rank}'s traceback:"
        said = fold_cpp_frames(fact.words.lines)
        return [f"cause: {fact.words.cause}", title] + [f"  {line}" for line in said]
    said = fold_cpp_frames([text for _, text in streams.tail(rank)][-12:])
    if not said:
        return [f"rank {rank} wrote nothing to stderr"]
    return [f"rank {rank}'s last lines on stderr:"] + [f"  {line}" for line in said]


def _early_exits(finished: dict[int, float], first: _Fact, rank: int) -> list[str]:
    """Ranks that exited 0 while the first failed rank still ran (it may have failed on their
    closed connections before they were quite gone)."""
    until = first.ended if first.ended < float("inf") else first.at + LAST_WORDS_S
    early = sorted(r for r, at in finished.items() if at <= until)
    if not early:
        return []
    who = f"rank {early[0]}" if len(early) == 1 else "ranks " + ", ".join(map(str, early))
    if first.kind == 1:
        return [
            f"{who} exited with code 0 while the other ranks were still running: the likely "
            f"cause (rank {rank} then failed waiting for it)"
        ]
    return [f"{who} exited with code 0 before rank {rank} failed, while the others still ran"]


def _stuck(fact: _Fact) -> str | None:
    """'rank 3 is' / 'ranks 1, 2 are' when the rank's error names stuck ranks."""
    if fact.words is None:
        return None
    found = _STUCK.findall(" ".join(fact.words.lines))
    return "; ".join(dict.fromkeys(f"{who} {be}" for who, be in found)) or None


def _peer_caused(words: _Words) -> bool:
    return caused_by_peer(" ".join([words.cause, *words.lines[-3:]]))


def caused_by_peer(text: str) -> bool:
    """Whether an error text says that a peer left or got stuck (not a failure of its own)."""
    text = text.lower()
    return any(phrase in text for phrase in _PEER_PHRASES)


def _last_words(rank: int, streams: RankStreams) -> _Words | None:
    """The rank's final traceback or zerotron error, if nothing came later (see above)."""
    lines = streams.tail(rank)
    texts = [text for _, text in lines]
    start, clean = traceback_start(texts), False
    error = _clean_error_start(texts)
    if error is not None and (start is None or error > start):
        start, clean = error, True
    if start is None or streams.last_output(rank) - lines[start][0] > LAST_WORDS_S:
        return None
    said = texts[start:]
    cause = said[0] if clean else _exception_line(said)
    return _Words(lines[start][0], said, cause, clean)


def _clean_error_start(lines: list[str]) -> int | None:
    """Index of the last line of zerotron's clean error ('zerotron pretrain: error: ...')."""
    found = [i for i, line in enumerate(lines) if _CLEAN_ERROR.match(line)]
    return found[-1] if found else None


def _exception_line(traceback: list[str]) -> str:
    """The 'SomeError: message' line after the last frame of a traceback."""
    frames = [i for i, line in enumerate(traceback) if line.startswith('  File "')]
    i = frames[-1] + 1 if frames else 1
    while i < len(traceback) and traceback[i].startswith(" "):
        i += 1  # the frame's source line and its ^^^^ markers
    return traceback[i] if i < len(traceback) else traceback[-1]


def fold_cpp_frames(lines: list[str]) -> list[str]:
    """Lines with each run of C++ stack frames ('frame #3: ...') said in one line."""
    out: list[str] = []
    run = 0
    for line in [*lines, ""]:
        if _CPP_FRAME.match(line):
            run += 1
            continue
        if run:
            out.append(f"[{run} C++ stack frames left out]")
            run = 0
        out.append(line)
    return out[:-1]


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


def _stopped_by_us(failure: ProcessFailure, killed: set[int]) -> bool:
    """SIGTERM is how the agent stops the ranks still running; SIGKILL only when the
    launcher's deadline sent it. Any other SIGKILL (the OOM killer, ``kill -9``) is the rank's
    own failure, even when its exit was seen late (the agent may reap it before the watchdog
    looks, and a loaded machine may run the watchdog's thread late)."""
    if failure.exitcode == -signal.SIGKILL:
        return failure.pid in killed
    return failure.exitcode == -signal.SIGTERM


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def _exit_code(exitcode: int) -> int:
    """A worker's exit code as the launcher's: a signal N becomes 128 + N, as in a shell."""
    return 128 - exitcode if exitcode < 0 else exitcode
