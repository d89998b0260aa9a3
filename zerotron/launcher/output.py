"""Each worker's output, live on the console with its rank in front, and in one log file per rank.

The elastic agent can only send a worker's stdout and stderr to named paths (torchrun's "tee"
writes two files per rank and polls them every 0.1 s). We hand it named pipes instead: one for
stdout and one for stderr per rank, read by one thread that

- prints every line to the launcher's stdout or stderr as ``[rank3]: <line>``,
- appends the raw line to ``<log_dir>/rank3.log`` (stdout and stderr interleaved as they came),
- keeps the last lines of each rank's stderr, so the launcher can show a failed rank's traceback.

Nothing is polled: lines appear as soon as the worker writes them (workers run ``python -u``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import selectors
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

TAIL_LINES = 200  # stderr lines kept per rank for the failure summary
_READ_SIZE = 1 << 16
_LONGEST_LINE = 1 << 16  # bytes without a newline are printed as a line past this
# The gloo of older torch (2.8; not 2.11 and later) prints this to stdout for every process group
# it connects: dropped, so that a rank's output and log hold its own lines on every torch.
_GLOO_CHATTER = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+"
)


@dataclass
class _Stream:
    """One pipe: a rank's stdout or stderr, with the bytes of its unfinished last line."""

    rank: int
    attempt: int  # which start of this node's workers wrote into it (0, 1, ...)
    fd: int
    console: TextIO
    is_stderr: bool
    partial: bytes = b""
    log: BinaryIO | None = None  # the rank's log file, shared by its two streams
    why: str = ""  # why the workers were started again ("a rank failed", "the nodes changed")


class RankStreams(LogsSpecs):
    """LogsSpecs for the elastic agent: per-rank pipes, rank-prefixed console, per-rank logs.

    Use as a context manager around ``agent.run()``; leaving it drains what the workers wrote last
    and closes everything. ``tail(rank)`` returns that rank's last stderr lines.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        on_start: Callable[[dict[int, dict[str, str]]], None] | None = None,
    ):
        """``on_start(envs)`` is called with every attempt's worker environments, by local rank,
        before the agent starts them (the launcher's banner)."""
        super().__init__(log_dir=log_dir)
        self._on_start = on_start
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        self._log_dir = log_dir
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self._tmp = tempfile.mkdtemp(prefix="zerotron-launch-")
        self._selector = selectors.DefaultSelector()
        self._pending: list[_Stream] = []  # registered by the pump thread, not by reify's caller
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tails: dict[int, collections.deque[tuple[float, str]]] = {}
        self._logs: dict[int, BinaryIO] = {}
        self._console_ok = True
        self._announced = 0  # the last restart said on the console
        self._starts = 0  # how many times the agent started this node's workers
        self._failures = 0  # TORCHELASTIC_RESTART_COUNT at the last start
        self._last_output: dict[int, float] = {}
        self._broken_logs: set[int] = set()  # ranks whose log file could not be written

    # -- LogsSpecs -------------------------------------------------------------------------------

    @property
    def root_log_dir(self) -> str:
        return self._log_dir or self._tmp

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Make the pipes of one attempt's workers (called by the agent before it starts them)."""
        if self._on_start is not None:
            self._on_start(envs)
        dest = LogsDest()
        # torch counts failed attempts only (TORCHELASTIC_RESTART_COUNT): a restart for a node
        # that joined or left starts workers again under the same count. The launcher's own
        # count of starts names each start's pipes and orders a rank's successive workers.
        attempt, self._starts = self._starts, self._starts + 1
        failures = int(next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0"))
        why = "a rank failed" if failures > self._failures else "the nodes changed"
        self._failures = failures
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            paths = {}
            for name in ("stdout", "stderr"):
                path = os.path.join(self._tmp, f"a{attempt}.rank{rank}.{name}")
                os.mkfifo(path, 0o600)
                # Opening the read end first (non-blocking) lets the agent open the write end
                # without blocking; the pump only sees end-of-file after a writer came and went.
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                self._add(rank, fd, is_stderr=name == "stderr", attempt=attempt, why=why)
                paths[name] = path
            dest.stdouts[local_rank] = paths["stdout"]
            dest.stderrs[local_rank] = paths["stderr"]
            error_file = os.path.join(self._tmp, f"a{attempt}.rank{rank}.error.json")
            dest.error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file  # written by @record-decorated workers
        return dest

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> RankStreams:
        self._thread = threading.Thread(
            target=self._pump, name="zerotron-launch-output", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Copy what is left in the pipes (workers have exited by now), then release everything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._register_pending()
        for key in list(self._selector.get_map().values()):
            self._drain(key.data)
            self._finish(key.data)
        self._selector.close()
        for log in self._logs.values():
            with contextlib.suppress(OSError):
                log.close()
        self._logs.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def tail(self, rank: int) -> list[tuple[float, str]]:
        """A global rank's last stderr lines, as (time.monotonic() when read, text)."""
        return list(self._tails.get(rank, ()))

    def last_output(self, rank: int) -> float:
        """time.monotonic() when the rank's latest line (stdout or stderr) arrived; -inf: none."""
        return self._last_output.get(rank, float("-inf"))

    def log_path(self, rank: int) -> str | None:
        return os.path.join(self._log_dir, f"rank{rank}.log") if self._log_dir else None

    # -- the pump --------------------------------------------------------------------------------

    def _add(self, rank: int, fd: int, *, is_stderr: bool, attempt: int, why: str) -> None:
        log = None
        if self._log_dir is not None:
            log = self._logs.get(rank)
            if log is None:
                log = open(self.log_path(rank), "wb" if attempt == 0 else "ab")  # noqa: SIM115
                self._logs[rank] = log
        console = self._stderr if is_stderr else self._stdout
        with self._lock:
            self._pending.append(_Stream(rank, attempt, fd, console, is_stderr, log=log, why=why))

    def _register_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for stream in pending:
            if not stream.is_stderr:  # once per rank and attempt
                self._start_attempt(stream)
            self._selector.register(stream.fd, selectors.EVENT_READ, stream)

    def _start_attempt(self, stream: _Stream) -> None:
        """A (re)started worker: finish its predecessor's output, then mark the restart."""
        for key in list(self._selector.get_map().values()):
            old = key.data
            if old.rank == stream.rank and old.attempt < stream.attempt:
                self._drain(old)  # the old worker is gone: its pipe holds all it wrote
                self._finish(old)
        self._tails[stream.rank] = collections.deque(maxlen=TAIL_LINES)
        self._last_output.pop(stream.rank, None)
        if not stream.attempt:
            return
        marker = f"--- zerotron launch: restart {stream.attempt} ---"
        if stream.log is not None and stream.rank not in self._broken_logs:
            with contextlib.suppress(OSError):
                stream.log.write(f"{marker}\n".encode())
        if stream.attempt > self._announced:
            self._announced = stream.attempt
            self._write(self._stderr, f"zerotron launch: {stream.why}; restart {stream.attempt}\n")

    def _pump(self) -> None:
        while not self._stop.is_set():
            self._register_pending()
            for key, _ in self._selector.select(timeout=0.02):
                if self._read(key.data) is False:
                    self._finish(key.data)

    def _read(self, stream: _Stream) -> bool | None:
        """Copy one chunk: True if there was data, None if the pipe is empty, False at its end."""
        try:
            chunk = os.read(stream.fd, _READ_SIZE)
        except BlockingIOError:
            return None
        if not chunk:
            return False
        data = stream.partial + chunk
        # A lone \r ends a line too (progress bars redraw with it); a \r at the end of the chunk
        # may be the first half of \r\n, so it waits for the next one.
        held = b"\r" if data.endswith(b"\r") else b""
        data = data[: len(data) - len(held)].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = data.split(b"\n")
        if len(rest) > _LONGEST_LINE:
            lines.append(rest)
            rest = b""
        stream.partial = rest + held
        self._emit(stream, lines)
        return True

    def _drain(self, stream: _Stream) -> None:
        while self._read(stream):
            pass

    def _finish(self, stream: _Stream) -> None:
        if stream.partial.rstrip(b"\r"):
            self._emit(stream, [stream.partial.rstrip(b"\r")])
        stream.partial = b""
        self._selector.unregister(stream.fd)
        os.close(stream.fd)

    def _emit(self, stream: _Stream, lines: list[bytes]) -> None:
        lines = [line for line in lines if not _GLOO_CHATTER.fullmatch(line)]
        if not lines:
            return
        if stream.log is not None and stream.rank not in self._broken_logs:
            try:
                stream.log.write(b"".join(line + b"\n" for line in lines))
                stream.log.flush()
            except OSError as e:  # a full disk must not stop the job: its pipes must keep flowing
                self._broken_logs.add(stream.rank)
                self._write(
                    self._stderr, f"zerotron launch: rank {stream.rank}'s log stopped: {e}\n"
                )
        text = [line.decode("utf-8", errors="replace") for line in lines]
        # torch.distributed prints uncaught exceptions with this same prefix: do not double it.
        prefix = f"[rank{stream.rank}]: "
        now = self._last_output[stream.rank] = time.monotonic()
        if stream.is_stderr:
            self._tails[stream.rank].extend((now, t.removeprefix(prefix)) for t in text)
        self._write(
            stream.console,
            "".join(t + "\n" if t.startswith(prefix) else f"{prefix}{t}\n" for t in text),
        )

    def _write(self, console: TextIO, text: str) -> None:
        if not self._console_ok:
            return
        try:
            console.write(text)
            console.flush()
        except (BrokenPipeError, ValueError):  # the console is gone: keep the logs going
            self._console_ok = False
