"""Progress of long commands: a bar with ETA on a terminal, plain lines in a log.

Every long command (``preprocess``, ``pretrain``, ``convert``, ``zero-to-fp32``, ``report``)
reports through one :class:`Progress`. On a terminal it draws a ``rich`` bar (description, bar,
percentage, ``done/total unit``, the caller's info, elapsed, ETA) and prints log lines above it;
when the stream is not a terminal (a log file, a pipe, a scheduler's output) it prints a plain
status line every ``log_seconds``, and one when it closes, in one fixed format::

    zero-to-fp32: 3/12 files (25%), 0:00:04 elapsed, ETA 0:00:12, mp_rank_00
    tokenizing: 1,234 documents, 0:00:05 elapsed

(no ``/total``, percentage or ETA when the total is unknown). A caller with its own log lines
(``pretrain``'s iteration lines, ``preprocess``'s ``Processed N documents``) turns the automatic
lines off (``log_seconds=None``) and prints through :meth:`Progress.print` (always) or
:meth:`Progress.note` (only without a bar). ``enabled=False`` (every rank but 0) prints nothing.

Usage::

    with Progress("zero-to-fp32", total=len(files), unit="files") as bar:
        for f in files:
            ...
            bar.update(1, info=f.name)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float | None) -> str:
    """``h:mm:ss`` (rich's style); ``-:--:--`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _count(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"


class Progress:
    """A progress report: a ``rich`` bar on a terminal, plain lines otherwise.

    Args:
        description: what is being done (``"tokenizing"``); starts every plain line.
        total: units of work, or None if unknown (no percentage or ETA then).
        unit: the units' name in plain lines and on the bar (``"files"``).
        completed: units already done (a resumed run), not counted in the rate.
        stream: where the bar or the lines go (default ``sys.stderr``).
        tty: draw a bar (default: whether ``stream`` is a terminal).
        log_seconds: without a bar, a plain line at most this often (None: no automatic lines,
            the caller prints its own).
        enabled: False prints nothing at all (ranks other than 0).
        transient: remove the bar from the terminal when done.
        console: the ``rich`` Console to draw on (tests: ``force_terminal=True`` into a
            StringIO); implies a bar.
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(
        self,
        description: str,
        total: float | None = None,
        *,
        unit: str = "",
        completed: float = 0,
        stream: IO[str] | None = None,
        tty: bool | None = None,
        log_seconds: float | None = 10.0,
        enabled: bool = True,
        transient: bool = False,
        console: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.description, self.total, self.unit = description, total, unit
        self.completed = self._start_completed = completed
        self.info = ""
        self.stream = stream if stream is not None else sys.stderr
        self.log_seconds = log_seconds
        self.enabled = enabled
        self._clock = clock
        self._start = clock()
        self._last_line_at = self._start
        self._logged_completed: float | None = None
        self._bar: Any = None
        if not enabled:
            return
        if console is not None or (tty if tty is not None else _isatty(self.stream)):
            self._bar = self._make_bar(console, transient)

    # ---- the bar (terminal only) -------------------------------------------------------------

    def _make_bar(self, console: Any, transient: bool) -> Any:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        if console is None:
            console = Console(file=self.stream)
        count = "{task.completed:,.0f}" + ("/{task.total:,.0f}" if self.total is not None else "")
        bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn(count + (f" {self.unit}" if self.unit else "")),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=transient,
        )
        self._task = bar.add_task(
            self.description, total=self.total, completed=self.completed, info=""
        )
        bar.start()
        return bar

    @property
    def is_bar(self) -> bool:
        """Whether a bar is drawn (a terminal); else plain lines, or nothing if disabled."""
        return self._bar is not None

    # ---- progress ----------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def eta(self) -> float | None:
        """Seconds left at the rate so far; None when the total or the rate is unknown."""
        if self.total is None:
            return None
        done = self.completed - self._start_completed
        if self.completed >= self.total:
            return 0.0
        if done <= 0:
            return None
        return self.elapsed / done * (self.total - self.completed)

    def line(self) -> str:
        """The plain status line (see the module docstring for its format)."""
        unit = f" {self.unit}" if self.unit else ""
        if self.total is None:
            text = f"{self.description}: {_count(self.completed)}{unit}"
        else:
            pct = 100.0 * self.completed / self.total if self.total else 100.0
            text = (
                f"{self.description}: {_count(self.completed)}/{_count(self.total)}{unit} "
                f"({pct:.0f}%)"
            )
        text += f", {format_seconds(self.elapsed)} elapsed"
        if self.total is not None:
            text += f", ETA {format_seconds(self.eta())}"
        return text + (f", {self.info}" if self.info else "")

    def update(
        self, advance: float = 0, *, completed: float | None = None, info: str | None = None
    ) -> None:
        """Add ``advance`` units (or set ``completed``); ``info`` replaces the trailing text."""
        self.completed = completed if completed is not None else self.completed + advance
        if info is not None:
            self.info = info
        if self._bar is not None:
            self._bar.update(self._task, completed=self.completed, info=self.info)
        elif self.enabled and self.log_seconds is not None:
            now = self._clock()
            if now - self._last_line_at >= self.log_seconds:
                self._emit(now)

    def _emit(self, now: float) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._last_line_at, self._logged_completed = now, self.completed

    # ---- other lines -------------------------------------------------------------------------

    def print(self, text: str) -> None:
        """A log line: above the bar on a terminal, else a line on the stream."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line for logs only: on a terminal the bar already shows it."""
        if self.enabled and self._bar is None:
            print(text, file=self.stream, flush=True)

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the bar, or print the last plain line (unless it is already out)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self.enabled = False  # closed: nothing more to draw or print
        elif self.enabled and self.log_seconds is not None:
            if self._logged_completed != self.completed:
                self._emit(self._clock())
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False
