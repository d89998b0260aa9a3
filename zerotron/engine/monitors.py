"""Training monitors, as DeepSpeed's ``tensorboard`` / ``wandb`` / ``csv_monitor`` config sections
define them: a :class:`MonitorMaster` fans ``(name, value, step)`` events out to every enabled
writer.

They live in ``engine/`` because the :class:`~zerotron.engine.Engine` writes them at each
optimizer step, and DeepSpeed scripts get theirs from the config handed to ``initialize``; the
module imports nothing from zerotron but ``errors`` and ``fileio``. :func:`training_events` is
what the Engine writes at each step.

What each writer does (only global rank 0 writes; other ranks build a disabled master):

- TensorBoard: a ``torch.utils.tensorboard.SummaryWriter`` with its event files in
  ``<output_path>/<job_name>/``, flushed after every batch of events;
- CSV: one file per metric, ``<output_path>/<job_name>/<name with '/' and ' ' as '_'>.csv``,
  a ``step,<last part of the name>`` header, then one ``step,value`` row per event, written and
  flushed row by row (a crash loses at most the row being written, never leaves half of an older
  one); a restarted job appends to the existing files;
- Weights & Biases: ``wandb.init(project, group, entity=team)``, then ``wandb.log({name: value},
  step=step)``. If ``wandb`` cannot be imported, enabling it is a ConfigError on every rank.

An empty ``output_path`` means the current directory.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from zerotron.errors import ConfigError
from zerotron.fileio import check_writable_dir

Event = tuple[str, float, int]
"""``(name, value, step)``; DeepSpeed keys training events by samples seen."""


class Writer(Protocol):
    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


def _log_dir(output_path: str, job_name: str) -> Path:
    return Path(output_path or ".") / job_name


class TensorBoardMonitor:
    """Scalars into TensorBoard event files under ``<output_path>/<job_name>``."""

    def __init__(self, output_path: str, job_name: str):
        try:  # tensorboard is an extra: the core runs without it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                f"tensorboard is enabled but cannot be imported ({e})",
                where="tensorboard.enabled",
                fix="pip install 'zerotron[tensorboard]', or set tensorboard.enabled to false",
            ) from e

        self.log_dir = _log_dir(output_path, job_name)
        check_writable_dir(self.log_dir, "tensorboard.output_path")
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvMonitor:
    """One CSV file per metric under ``<output_path>/<job_name>`` (DeepSpeed's csv_monitor)."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = _log_dir(output_path, job_name)
        check_writable_dir(self.log_dir, "csv_monitor.output_path")
        self._files: dict[str, Any] = {}

    @staticmethod
    def filename(name: str) -> str:
        """The file a metric goes to: ``Train/Samples/lr`` -> ``Train_Samples_lr.csv``."""
        return name.replace("/", "_").replace(" ", "_") + ".csv"

    def _file(self, name: str) -> Any:
        f = self._files.get(name)
        if f is None:
            path = self.log_dir / self.filename(name)
            f = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 (kept open)
            if f.tell() == 0:
                f.write(f"step,{name.rsplit('/', 1)[-1]}\n")
                f.flush()
            self._files[name] = f
        return f

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            f = self._file(name)
            f.write(f"{int(step)},{float(value)!r}\n")  # repr: the exact float comes back
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            f"wandb is enabled but cannot be imported ({e})",
            where="wandb.enabled",
            fix="pip install wandb, or set wandb.enabled to false",
        ) from e
    return wandb


class WandbMonitor:
    """Events to Weights & Biases (``wandb.log(..., step=step)``)."""

    def __init__(
        self,
        project: str,
        group: str | None,
        team: str | None,
        name: str | None = None,
        save_dir: str | None = None,
    ):
        self.wandb = _import_wandb()
        self.wandb.init(project=project, group=group, entity=team, name=name, dir=save_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.wandb.finish()


def training_events(
    losses: Sequence[Tensor], lr: float, loss_scale: float | None, step: int
) -> list[Event]:
    """DeepSpeed's per-step events, keyed by the samples seen after the step:
    ``Train/Samples/train_loss`` (this rank's micro-batch ``losses`` as backward saw them,
    averaged over the accumulation; none without losses), ``Train/Samples/lr`` (the first
    group's, after the scheduler stepped) and, with fp16 loss scaling,
    ``Train/Samples/loss_scale``."""
    events: list[Event] = []
    if losses:
        mean = torch.stack(list(losses)).float().mean()
        events.append(("Train/Samples/train_loss", mean.item(), step))
    events.append(("Train/Samples/lr", lr, step))
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", loss_scale, step))
    return events


class MonitorMaster:
    """Fans events out to ``writers``; ``enabled`` is False when there are none."""

    def __init__(self, writers: Iterable[Writer] = ()):
        self.writers = list(writers)
        self._closed = False
        if self.writers:
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        return bool(self.writers) and not self._closed

    @classmethod
    def from_config(cls, monitor: Any, rank: int | None = None) -> MonitorMaster:
        """The writers a Config's ``monitor`` section enables; none unless ``rank`` (default:
        the ``RANK`` environment variable, else 0) is 0. A wandb that cannot be imported is
        refused on every rank, so all ranks stop together."""
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        if monitor.wandb_enabled:
            _import_wandb()
        if rank != 0:
            return cls()
        writers: list[Writer] = []
        if monitor.tensorboard_enabled:
            writers.append(
                TensorBoardMonitor(monitor.tensorboard_output_path, monitor.tensorboard_job_name)
            )
        if monitor.csv_monitor_enabled:
            writers.append(
                CsvMonitor(monitor.csv_monitor_output_path, monitor.csv_monitor_job_name)
            )
        if monitor.wandb_enabled:
            writers.append(
                WandbMonitor(
                    monitor.wandb_project,
                    monitor.wandb_group,
                    monitor.wandb_team,
                    monitor.wandb_exp_name,
                    monitor.wandb_save_dir,
                )
            )
        return cls(writers)

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.enabled:
            return
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        """Flush and close every writer (idempotent; also runs at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        for writer in self.writers:
            writer.close()
        if self.writers:
            atexit.unregister(self.close)
