"""Exceptions that users see.

Every error a user can cause (bad flags, bad data, a checkpoint that does not fit) is raised as a
subclass of :class:`ZerotronError` with three parts: *what* was wrong, *where* (file:line, key
path, rank), and *what to do*. The CLI prints these without a traceback; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import sys


def _rank_prefix() -> str:
    # Only consult torch.distributed if the program already imported it: errors.py stays cheap.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return ""
    return f"rank {dist.get_rank()}: " if dist.get_world_size() > 1 else ""


class ZerotronError(Exception):
    """Base class: ``what`` happened ``where``; ``fix`` says what to do about it."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self.format())

    def format(self) -> str:
        head = f"{self.where}: {self.what}" if self.where else self.what
        msg = _rank_prefix() + head
        if self.fix:
            msg += f"\n  -> {self.fix}"
        return msg


class ConfigError(ZerotronError):
    """A flag, config key or combination of values is invalid."""


class UnsupportedError(ConfigError):
    """A known feature of Megatron-LM or DeepSpeed that zerotron does not implement."""


class DataError(ZerotronError):
    """Input data (JSON lines, .bin/.idx files, dataset splits) is malformed or unusable."""


class TokenizerError(ZerotronError):
    """Vocabulary files are missing or inconsistent."""


class CheckpointError(ZerotronError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


class DistributedError(ZerotronError):
    """Process groups, ranks or collectives are misconfigured or failed."""


class LaunchError(ZerotronError):
    """The launcher could not start or keep the job running."""


class DiskFullError(ZerotronError):
    """A write ran out of space; nothing partial was left behind."""


class TrainingError(ZerotronError):
    """Training went wrong in a way that makes going on pointless (a NaN/Inf loss or grad norm)."""
