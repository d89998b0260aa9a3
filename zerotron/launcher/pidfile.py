"""``--save_pid``: the PID of each node's launcher in ``/tmp/<PID>.zerotron``, for programs that
start ``zerotron launch`` and need to find (and signal) the process whose children are the ranks.

``<PID>`` is the PID of the ``zerotron launch`` the program started (it knows it: it started
that process); the file holds the PID of the node's launcher, with no newline. As with
DeepSpeed's ``/tmp/<PID>.deepspeed``, every node of a multi-node job writes its own file on its
own machine, named by the launching process's PID (``--save_pid_as``, passed on to the nodes), and
a one-node job's launcher is the process that was started, so its file holds its own PID. The file
is written atomically and removed when the launcher exits (not after SIGKILL: nothing runs then).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from zerotron.errors import ConfigError
from zerotron.fileio import atomic_write_text

PID_DIR = "/tmp"  # DeepSpeed's; fixed, so that a program can find the file without asking
SUFFIX = ".zerotron"


def path_of(key: int) -> str:
    """``/tmp/<key>.zerotron``."""
    return os.path.join(PID_DIR, f"{key}{SUFFIX}")


@contextlib.contextmanager
def saved(key: int | None) -> Iterator[str | None]:
    """Write this process's PID to :func:`path_of` ``(key)`` for the duration (None: nothing).

    A file left there by a launcher that is gone (killed) is replaced; one naming a live process
    other than this one is a ConfigError: another job uses that name.
    """
    if key is None:
        yield None
        return
    path, me = path_of(key), os.getpid()
    owner = _owner(path)
    if owner is not None and owner != me and _alive(owner):
        raise ConfigError(
            f"--save_pid: {path} names launcher PID {owner}, which is still running",
            fix="let that job finish, or stop it; a file left by a launcher that is gone is "
            "replaced",
        )
    atomic_write_text(path, str(me))
    try:
        yield path
    finally:
        if _owner(path) == me:  # a later launcher may own it now
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def _owner(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
