"""``--async-save``: persist a checkpoint in the background while training goes on.

A save is cut in three: the collective start (room on every rank, the writer empties the
temporary tag directory), the writes, and the collective commit (every rank wrote: the writer
renames the tag into place, then the trackers). With an :class:`AsyncCheckpointWriter` the
start and a :func:`snapshot` of every tensor (so that training may change them) happen in the
step; the writes run on a background thread; the commit runs on the main thread of every rank
together, as soon as :meth:`~AsyncCheckpointWriter.poll` (called once per iteration) sees every
rank's writes done, or at the next save, load or exit (:meth:`~AsyncCheckpointWriter.wait`). So
the previous checkpoint and the trackers are untouched until the new tag is complete, one
save at a time, and a write failure is raised on every rank at that commit, naming the file.
Megatron-LM's ``--async-save`` finalizes the same way (a per-iteration check that every rank is
done, then the tracker).
"""

from __future__ import annotations

import atexit
import collections
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from zerotron.distributed import watchdog


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live in new host memory, views and sharing kept.

    Each storage is copied once and every tensor is rebuilt on its copy with the same offset,
    shape and stride, so ``torch.save`` of the snapshot writes the same bytes as of ``obj``
    (a CUDA tensor becomes a CPU one). Containers are copied; other values are immutable.
    """
    copies: dict[tuple[int, int, str], torch.UntypedStorage] = {}

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:
            return t.detach().cpu().clone()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), str(storage.device))
        new = copies.get(key)
        if new is None:
            new = storage.cpu() if storage.device.type != "cpu" else storage.clone()
            copies[key] = new
        out = torch.empty(0, dtype=t.dtype).set_(new, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out.requires_grad_(t.requires_grad)

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, collections.OrderedDict):
            return collections.OrderedDict((k, copy(v)) for k, v in value.items())
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple):
            return tuple(copy(v) for v in value)
        if isinstance(value, set):
            return {copy(v) for v in value}
        return value

    with torch.no_grad():
        return copy(obj)


class _Pending:
    """One save in flight: its writer thread and how to commit it."""

    def __init__(
        self,
        write: Callable[[], BaseException | None],
        commit: Callable[[BaseException | None], None],
        any_rank: Callable[[bool], bool] | None,
        what: str,
    ) -> None:
        self.commit, self.any_rank, self.what = commit, any_rank, what
        self.failure: BaseException | None = None
        # Not a daemon: an interpreter exiting without close() still lets the files finish.
        self.thread = threading.Thread(target=self._run, args=(write,), name="zerotron-ckpt")
        self.thread.start()

    def _run(self, write: Callable[[], BaseException | None]) -> None:
        try:
            self.failure = write()
        except BaseException as e:  # noqa: BLE001 (re-raised on the main thread at commit)
            self.failure = e


class AsyncCheckpointWriter:
    """Writes one checkpoint at a time on a background thread (see the module docstring).

    Pass it to :func:`zerotron.checkpoint.save_load.save_checkpoint` (``writer=``); the Engine
    does when ``engine.checkpoint_writer`` is set. Every rank calls :meth:`poll` at the same
    points (each iteration), and :meth:`close` before it exits.
    """

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        # A script that never calls close() (DeepSpeed's API has no such call) still commits
        # its last save when the interpreter exits normally.
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 (exiting: say it, the previous tag is intact)
            print(f"zerotron: the background checkpoint save failed at exit: {e}", file=sys.stderr)

    @property
    def busy(self) -> bool:
        """Whether a save is in flight (written or not, not yet committed)."""
        return self._pending is not None

    def start(
        self,
        write: Callable[[], BaseException | None],
        commit: Callable[[BaseException | None], None],
        any_rank: Callable[[bool], bool] | None,
        what: str,
    ) -> None:
        """Run ``write`` (returns a failure or None) in the background; ``commit(failure)`` on
        the main thread later. Waits for (and commits) the save before it first."""
        self.wait()
        self._pending = _Pending(write, commit, any_rank, what)

    def poll(self) -> bool:
        """Commit the save in flight if every rank has written it; True when none is left.

        A collective while a save is in flight (with ``any_rank``): call it on every rank.
        """
        pending = self._pending
        if pending is None:
            return True
        done = not pending.thread.is_alive()
        if pending.any_rank is not None:
            done = not pending.any_rank(not done)  # every rank's writes are done
        if done:
            self.wait()
        return done

    def wait(self) -> None:
        """Wait for the save in flight and commit it; raises its failure (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        # Peers may wait in the commit's barrier meanwhile: a long write is not a hang.
        with watchdog.busy(f"finishing its background checkpoint write ({pending.what})"):
            pending.thread.join()
        pending.commit(pending.failure)

    def close(self, commit: bool = True) -> None:
        """Before exiting: wait for the writes; commit them unless ``commit`` is False (an
        error exit of a multi-rank job, whose peers may be gone: the tag is then left
        uncommitted, the previous checkpoint stays the latest, the next save cleans it up)."""
        if commit:
            self.wait()
            return
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.thread.join()
