"""``zerotron pretrain --save-on-signal``: on SIGTERM or SIGUSR1, save a checkpoint and exit.

SLURM (``#SBATCH --signal=USR1@90``) and Kubernetes (SIGTERM, then SIGKILL after the grace
period) warn a job before they stop it. With ``--save-on-signal`` (Megatron's
``--exit-signal-handler``) the signal only raises a flag; the loop asks :meth:`Preemption.agreed`
after every iteration, every rank finishes that iteration, saves a checkpoint at it and exits with
:data:`EXIT_CODE`. The resumed run (``--load``) then goes on from exactly there: nothing is lost.

The signal reaches the ranks at different moments (one may be inside iteration 7 while another
is already past it), so no rank decides alone: each iteration the ranks take the maximum of their
flags (the signal's number, 0 for none) with one all-reduce of a single integer, and all stop
after the same iteration when any rank has one. Megatron all-gathers
the flag for the same reason.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch

from zerotron.distributed import comm

SIGNALS = ("SIGTERM", "SIGUSR1")
EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: stopped on request with a checkpoint; resume with --load
"""The exit code of a rank that saved and exited on a signal (not 0: the run is not finished;
not 128 + N: it was not killed)."""


class Preemption:
    """Catches :data:`SIGNALS` while the loop runs; a context manager that restores the previous
    handlers (main thread only: elsewhere Python cannot install handlers and nothing is caught)."""

    def __init__(self) -> None:
        self.received: int = 0  # the first signal's number, 0 while none came
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                num = getattr(signal, name)
                self._saved[num] = signal.signal(num, self._catch)
        return self

    def __exit__(self, *exc: object) -> None:
        for num, handler in self._saved.items():
            signal.signal(num, handler)
        self._saved.clear()

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:  # a second signal (SLURM may repeat it) changes nothing
            self.received = signum

    def agreed(self) -> str | None:
        """The signal's name when any rank has one (every rank gets the same answer), else None.

        A collective on every rank, once per iteration: all ranks must call it at the same point.
        """
        num = self.received
        world = comm.world_group()
        if world.size > 1:
            num = int(comm.all_reduce(torch.tensor([num]), world, op="max").item())
        return signal.Signals(num).name if num else None
