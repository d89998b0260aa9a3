"""A hung job, diagnosed: the launcher's side of the collective watchdog.

Each rank's :mod:`zerotron.distributed.watchdog` writes a report into the directory the
launcher names in ``ZEROTRON_WATCHDOG_DIR`` once one of its waits in a collective passes the
threshold. :class:`HangWatch` (polled by the launcher's process watchdog,
:class:`zerotron.launcher.failures.Watchdog`) then

1. asks every rank of this node where it is (it writes ``<dir>/request``; each rank's watchdog
   thread answers within a second with its wait, or none, and its Python stack), and waits for
   the answers, a few seconds at most: a rank that is stopped, or stuck holding the interpreter
   lock, cannot answer, and that is an answer too;
2. prints a summary (:func:`summarize`) naming the ranks that never arrived: members of the
   group that wait in another op or at an earlier call on the group, or in nothing, and ranks
   that did not answer, each with where its stack stands;
3. ends the job (``--watchdog-action abort``, the default: every rank of the node is stopped,
   SIGTERM then SIGKILL after ``--shutdown_timeout``, and the launcher exits with
   :data:`HANG_EXIT_CODE`), or keeps waiting (``--watchdog-action wait``; the process group's
   own timeout still bounds the wait). A rank busy on purpose (it marked a long task with
   :func:`zerotron.distributed.watchdog.busy`, as checkpoint writes do) is named with its task
   and the job keeps waiting; the ranks are asked again after another threshold, so a wait that
   outlasts the task still ends the job.

Across nodes each node's launcher sees its own ranks' reports. A member on another node is
judged by its heartbeat, which the waiting ranks read from the job's store: behind (fewer calls
entered on the group than this one's number: named) or in the call too (not named); without a
heartbeat it is said to be on another node, whose launcher reports on its own ranks.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zerotron.distributed.watchdog import ENV_DIR, ENV_TIMEOUT, REQUEST, describe, where

HANG_EXIT_CODE = 124  # as coreutils' timeout: the job did not finish, it was stopped
ACTIONS = ("abort", "wait")
ENV_ACTION = "ZEROTRON_WATCHDOG_ACTION"
ANSWER_GRACE_S = 3.0  # beyond two of the ranks' periods, for stacks to be formatted and written
_STACK_LINES = 4  # of a named rank's main-thread stack, in the summary

__all__ = ["ACTIONS", "ENV_ACTION", "ENV_DIR", "ENV_TIMEOUT", "HANG_EXIT_CODE", "HangWatch"]


@dataclass
class HangWatch:
    """Notices the ranks' watchdog reports in ``directory`` and acts on them (see above).

    ``say`` prints a line of the launcher's; :meth:`poll` is called with this node's running
    workers (pid -> global rank) and returns True when the job must be ended now.
    """

    directory: str
    action: str = "abort"
    say: Callable[[str], None] = print
    grace_s: float = ANSWER_GRACE_S
    asked_at: float | None = None  # time.monotonic() of the request; None: nothing reported
    request_time: float = 0.0  # the request file's mtime (answers newer than it count)
    told: set[tuple] = field(default_factory=set)  # stuck waits already summarized
    aborted: bool = False
    quiet_until: float = 0.0  # time.monotonic() before which a known stuck wait is not re-asked
    _period: float = 1.0  # the reporting ranks' watchdog period (they answer within it)

    def poll(self, workers: dict[int, int]) -> bool:
        reports = read_reports(self.directory, workers)
        if self.asked_at is None:
            stuck = [r for r in reports.values() if _stuck(r) and _key(r) not in self.told]
            if not stuck or time.monotonic() < self.quiet_until:
                return False
            first = min(stuck, key=lambda r: r["rank"])
            self.say(f"watchdog: {describe(first)}; asking every rank where it is")
            self._ask()
            self._period = min(1.0, max(0.05, first["threshold_s"] / 10))
            return False
        answered = {r for r, rep in reports.items() if rep["_mtime"] >= self.request_time}
        waited = time.monotonic() - self.asked_at
        if set(workers.values()) - answered and waited < 2 * self._period + self.grace_s:
            return False
        stuck = {r: rep for r, rep in reports.items() if _stuck(rep)}
        lines = summarize(reports, answered, sorted(workers.values()))
        for line in lines:
            self.say(f"watchdog: {line}")
        self.asked_at = None
        busy = {r: rep["busy"] for r, rep in reports.items() if r in answered and rep.get("busy")}
        if busy:
            # A rank busy on purpose (a slow checkpoint write) is not a hang: ask again after
            # another threshold, and end the job only if the wait outlasts the busy task.
            self.say("watchdog: " + "; ".join(f"rank {r} is {what}" for r, what in busy.items())
                     + ": the job keeps waiting")  # fmt: skip
            self.quiet_until = time.monotonic() + min(r["threshold_s"] for r in stuck.values())
            return False
        self.told |= {_key(rep) for rep in stuck.values()}
        if self.action == "wait":
            self.say("watchdog: --watchdog-action wait: the job keeps waiting")
            return False
        self.say(f"watchdog: ending the job (exit code {HANG_EXIT_CODE}); "
                 "--watchdog-action wait would keep waiting")  # fmt: skip
        self.aborted = True
        return True

    def _ask(self) -> None:
        path = os.path.join(self.directory, REQUEST)
        with open(path, "w") as f:
            f.write(str(time.time()))
        self.request_time = os.stat(path).st_mtime
        self.asked_at = time.monotonic()


def read_reports(directory: str, workers: dict[int, int]) -> dict[int, dict[str, Any]]:
    """The newest report of each running worker (``workers``: pid -> rank), by rank."""
    out: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        try:
            mtime = os.stat(path).st_mtime
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced, or from a rank that is gone
        if workers.get(report.get("pid")) != report.get("rank"):
            continue  # a previous attempt's worker
        report["_mtime"] = mtime
        out[report["rank"]] = report
    return out


def summarize(
    reports: dict[int, dict[str, Any]], answered: set[int], local: list[int]
) -> list[str]:
    """Lines naming, for every stuck wait, the ranks that never arrived and where they are.

    ``reports``: each rank's newest report; ``answered``: the ranks that answered the request;
    ``local``: the ranks of this node still running (the others are on other nodes).
    """
    waits: dict[tuple, list[int]] = {}
    for rank, rep in sorted(reports.items()):
        if _stuck(rep):
            waits.setdefault(_key(rep), []).append(rank)
    lines: list[str] = []
    missing: dict[int, str] = {}
    for waiters in waits.values():
        w = reports[waiters[0]]["waiting"]
        lines.append(f"{_who(waiters)} waited {max(_waited(reports, waiters)):.1f} s in "
                     f"{where(w)}")  # fmt: skip
        members = w["peers"] + waiters if w["peers"] is not None else w["ranks"]
        heard = _heard(reports, waiters)
        for m in sorted(set(members) - set(waiters)):
            if m not in reports and m not in local and heard.get(m, -1) >= w["seq"]:
                continue  # on another node, and its heartbeat says it is in this call too
            why = _absence(m, w, waiters, reports.get(m), m in answered, m in local)
            if why is not None and m not in reports and m not in local and m in heard:
                why = (f"is on another node, and behind: its heartbeat says it entered "
                       f"{heard[m]} calls on that group")  # fmt: skip
            if why is not None:
                missing.setdefault(m, why)
    mutual = _mutual_p2p(waits, reports)
    if mutual:
        lines.append(f"{_who(mutual)} wait for each other in point-to-point messages that do "
                     "not match (an ordering deadlock)")  # fmt: skip
    if not missing:
        lines.append("no rank could be named as missing: every member is waiting")
        return lines
    lines.append(f"never arrived: {_who(sorted(missing))}")
    for rank, why in sorted(missing.items()):
        lines.append(f"rank {rank} {why}")
        stack = _main_stack(reports.get(rank))
        lines += [f"  {line}" for line in stack]
    return lines


def _absence(
    rank: int,
    w: dict[str, Any],
    waiters: list[int],
    rep: dict[str, Any] | None,
    answered: bool,
    local: bool,
) -> str | None:
    """Why member ``rank`` is not in the wait ``w`` of ``waiters`` (None: it waits in
    point-to-point with one of them too, which :func:`_mutual_p2p` reports)."""
    if rep is None or not answered:
        if not local:
            return "is on another node (its own launcher reports on it)"
        return "did not answer (stopped, crashed in C++, or holding the interpreter lock)"
    mine = rep["waiting"]
    if mine is None:
        return "is not waiting in a collective (busy or sleeping elsewhere); its stack:"
    if w["peers"] is None and mine["group"] == w["group"] and mine["ranks"] == w["ranks"]:
        if mine["seq"] < w["seq"]:
            return f"is behind: it waits in call {mine['seq']} ({mine['op']}) on that group"
        if mine["seq"] > w["seq"]:
            return f"is ahead: it waits in call {mine['seq']} ({mine['op']}) on that group"
    if w["peers"] is not None and mine["peers"] is not None and set(mine["peers"]) & {*waiters}:
        return None
    return f"waits elsewhere: in {where(mine)}; its stack:"


def _mutual_p2p(waits: dict[tuple, list[int]], reports: dict[int, dict[str, Any]]) -> list[int]:
    """Ranks stuck in point-to-point with each other: r waits with p, and p with r."""
    p2p = {r for key, ranks in waits.items() if key[0] == "p2p" for r in ranks}

    def peers(r: int) -> list[int]:
        return reports[r]["waiting"]["peers"]

    return sorted(r for r in p2p if any(p in p2p and r in peers(p) for p in peers(r)))


def _heard(reports: dict[int, dict[str, Any]], waiters: list[int]) -> dict[int, int]:
    """The members' call counts on the group as the waiters' reports heard them (the highest)."""
    out: dict[int, int] = {}
    for r in waiters:
        for member, calls in reports[r].get("heard", {}).items():
            out[int(member)] = max(out.get(int(member), -1), calls)
    return out


def _stuck(rep: dict[str, Any]) -> bool:
    w = rep["waiting"]
    return w is not None and w["waited_s"] >= rep["threshold_s"]


def _key(rep: dict[str, Any]) -> tuple:
    w = rep["waiting"]
    if w["peers"] is not None:
        return ("p2p", rep["rank"], w["op"], tuple(w["peers"]))
    return ("group", w["group"], tuple(w["ranks"]), w["seq"], w["op"])


def _waited(reports: dict[int, dict[str, Any]], ranks: list[int]) -> list[float]:
    return [reports[r]["waiting"]["waited_s"] for r in ranks]


def _who(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def _main_stack(rep: dict[str, Any] | None) -> list[str]:
    """The innermost frames of a report's first (main) thread: file:line and source."""
    if rep is None or not rep.get("stacks"):
        return []
    text = next(iter(rep["stacks"].values()))
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-2 * _STACK_LINES :]


def prepare_dir(directory: str) -> str:
    """Create the reports' directory and clear a previous job's reports from it."""
    os.makedirs(directory, exist_ok=True)
    for path in glob.glob(os.path.join(directory, "rank*.json")) + [
        os.path.join(directory, REQUEST)
    ]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return directory
