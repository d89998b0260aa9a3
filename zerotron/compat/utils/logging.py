"""DeepSpeed's ``deepspeed.utils.logging``: the ``DeepSpeed`` logger and :func:`log_dist`.

The logger is DeepSpeed's: named ``"DeepSpeed"``, level WARNING, its own stdout handler with
DeepSpeed's format, not propagated to the root logger, so a script that configures it (or
reads ``logger.level``) sees what it would under DeepSpeed. zerotron's own messages are printed
by the layers that own them, not through this logger.
"""

from __future__ import annotations

import functools
import logging
import sys

LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _make_logger(name: str, level: int) -> logging.Logger:
    log = logging.getLogger(name)
    log.setLevel(level)
    log.propagate = False
    if not any(getattr(h, "_zerotron", False) for h in log.handlers):  # once per process
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._zerotron = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    return log


logger = _make_logger("DeepSpeed", logging.WARNING)


@functools.lru_cache(None)
def warning_once(*args: object) -> None:
    """``logger.warning`` once per distinct message."""
    logger.warning(*args)


logger.warning_once = warning_once  # type: ignore[attr-defined]


def set_log_level_from_string(log_level: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level (``"debug"``, ``"info"``, ...) of ``custom_logger`` (default: the
    DeepSpeed logger) and of its handlers."""
    level = LOG_LEVELS.get(log_level.lower())
    if level is None:
        raise ValueError(f"invalid log level {log_level!r}: use one of {sorted(LOG_LEVELS)}")
    target = custom_logger or logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_dist_msg(message: str, ranks: list[int] | None = None) -> str | None:
    """``"[Rank r] message"`` if this rank should log it, else None.

    Without a process group every process logs (as rank -1). With one, only the ranks listed
    in ``ranks`` log; ``ranks=[-1]`` means every rank, and no ``ranks`` means none (DeepSpeed's
    rule: pass ``ranks=[0]`` for a message from rank 0).
    """
    from zerotron.distributed.init import get_rank, is_initialized

    initialized = is_initialized()
    rank = get_rank() if initialized else -1
    ranks = ranks or []
    if initialized and not (ranks and (ranks[0] == -1 or rank in set(ranks))):
        return None
    return f"[Rank {rank}] {message}"


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` on the ranks :func:`get_dist_msg` picks."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """Print ``message`` on the ranks :func:`get_dist_msg` picks, whatever the log level."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


@functools.lru_cache(None)
def _log_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, list(ranks) if ranks is not None else None, level)


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """:func:`log_dist`, once per distinct (message, ranks, level) in this process."""
    _log_once(message, tuple(ranks) if ranks is not None else None, level)


logger.log_dist_once = log_dist_once  # type: ignore[attr-defined]
