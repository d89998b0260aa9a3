"""Megatron's ways to name the training data, resolved to one: ``--data-path`` with ``--split``,
or one path per split (``--train-data-path``, ``--valid-data-path``, ``--test-data-path``); each
may also come from a file (``--data-args-path``, ``--per-split-data-args-path``).

Each path is a prefix, a weighted blend ``W1 P1 W2 P2 ...`` or several prefixes, as Megatron
writes them. After :func:`resolve_data_paths` the files are read into ``data_path`` or the
per-split fields, and only one of the two ways is left.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from zerotron.config.sections.data import PER_SPLIT_FIELDS, DataConfig, parse_data_path
from zerotron.errors import ConfigError

# The per-split file's keys, in split order (Megatron's names).
SPLIT_KEYS = ("train", "valid", "test")


def resolve_data_paths(d: DataConfig, fill: Callable[..., None]) -> None:
    """Read ``data_args_path`` / ``per_split_data_args_path`` into the path fields (``fill``
    sets values on the frozen section) and refuse two ways of naming the data at once."""
    if d.data_args_path is not None:
        if d.data_path is not None:
            raise _both("--data-args-path", "--data-path")
        items = _read_text(d.data_args_path).split()
        parse_data_path(items, where=d.data_args_path)
        fill(d, data_path=items)
    if d.per_split_data_args_path is not None:
        if d.per_split:
            raise _both("--per-split-data-args-path", "--train/valid/test-data-path")
        fill(d, **_read_per_split(d.per_split_data_args_path))
    if d.per_split and d.data_path is not None:
        raise _both("--train/valid/test-data-path", "--data-path")


def _both(a: str, b: str) -> ConfigError:
    return ConfigError(
        f"{a} and {b} both name the data",
        where="data",
        fix=f"give one of them: {b}, or {a}",
    )


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"cannot read it: {e.strerror if isinstance(e, OSError) else e}",
            where=path,
            fix="give a readable UTF-8 text file",
        ) from None


def _read_per_split(path: str) -> dict[str, list[str] | None]:
    """The per-split file: ``{"train": PATH, "valid": PATH, "test": PATH}``, each a string or a
    list as --data-path; a split left out (or null) has no data."""
    try:
        given = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"not JSON: {e.msg}", where=f"{path}:{e.lineno}", fix='write {"train": "PREFIX", ...}'
        ) from None
    if not isinstance(given, dict) or not set(given) <= set(SPLIT_KEYS):
        have = sorted(given) if isinstance(given, dict) else type(given).__name__
        raise ConfigError(
            f"expected an object with the keys {', '.join(SPLIT_KEYS)}, found {have}",
            where=path,
            fix='write {"train": "PREFIX", "valid": "PREFIX", "test": "PREFIX"}',
        )
    out: dict[str, list[str] | None] = {}
    for key, field in zip(SPLIT_KEYS, PER_SPLIT_FIELDS):
        value = given.get(key)
        if value is None:
            out[field] = None
            continue
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, (str, int, float)) for i in items):
            raise ConfigError(
                f"{key!r} is {value!r}, not a path string or a list",
                where=f"{path}: {key}",
                fix='write "W1 PREFIX1 W2 PREFIX2" or ["PREFIX"]',
            )
        out[field] = [str(i) for i in items]
        parse_data_path(out[field], where=f"{path}: {key}")
    return out
