"""Config files: read YAML or JSON with errors that name ``file:line``; write them atomically.

A config file holds the same names as the command-line flags, in either dash or underscore
style, flat or grouped by section::

    num-layers: 12            # flat, dash style
    training:                 # grouped by section, underscore style
      micro_batch_size: 4
      global_batch_size: 32

Which keys exist is the schema's business (:mod:`zerotron.config.schema`); this module only
turns bytes into a mapping and remembers where each key was written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from zerotron.errors import ConfigError
from zerotron.fileio import atomic_write_text

Locate = Callable[[tuple[str, ...]], str]
"""Maps a key path such as ``("training", "micro_batch_size")`` to ``"run.yaml:7"``."""


def read_config_file(path: str | os.PathLike) -> tuple[dict[str, Any], Locate]:
    """Parse a ``.json`` file as JSON, anything else as YAML.

    Returns the top-level mapping and a function giving ``file:line`` for a key path (just the
    file name where the line is unknown). Syntax errors, duplicate keys and a top level that is
    not a mapping raise :class:`ConfigError` naming ``file:line``.
    """
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            "config file not found", where=path, fix="check the path given to --config"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file: {e}", where=path) from None

    lines = _key_lines(text, path)
    data = _parse_json(text, path) if path.endswith(".json") else _parse_yaml(text, path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping of keys to values, got {type(data).__name__}",
            where=f"{path}:1",
            fix="write one `name: value` per line (YAML) or a JSON object",
        )

    def locate(key_path: tuple[str, ...]) -> str:
        line = lines.get(tuple(key_path))
        return f"{path}:{line}" if line else path

    return data, locate


def write_config_file(data: dict[str, Any], path: str | os.PathLike) -> None:
    """Write a mapping (e.g. ``Config.to_dict()``) as JSON (``.json``) or YAML, atomically."""
    path = str(path)
    if path.endswith(".json"):
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    atomic_write_text(path, text)


def _parse_yaml(text: str, path: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _yaml_error(e, path) from None
    except RecursionError:
        raise too_deep(path) from None


def too_deep(where: str | None) -> ConfigError:
    """Python's parsers recurse once per level: a config nested thousands deep is refused."""
    return ConfigError(
        "the config is nested too deeply (lists or objects inside each other, level after level)",
        where=where,
        fix="a config nests a few levels at most: check that the file is the config you meant",
    )


def _yaml_error(e: yaml.YAMLError, path: str) -> ConfigError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    what = f"YAML syntax error: {problem}" + (f" ({context})" if context else "")
    return ConfigError(what, where=where, fix="fix the YAML syntax at that line")


def _parse_json(text: str, path: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"key {key!r} is given twice", where=path, fix="keep one of them")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"JSON syntax error: {e.msg} (column {e.colno})",
            where=f"{path}:{e.lineno}",
            fix="fix the JSON syntax at that line",
        ) from None
    except RecursionError:
        raise too_deep(path) from None


def _key_lines(text: str, path: str) -> dict[tuple[str, ...], int]:
    """Line numbers of the keys of the top two levels, and duplicate-key errors.

    YAML's node tree carries marks; JSON objects are YAML flow mappings, so one walk serves
    both. Where PyYAML cannot compose the text, the real parser reports the syntax error.
    """
    try:
        root = yaml.compose(text)
    except (yaml.YAMLError, RecursionError):
        return {}
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if not isinstance(node, yaml.MappingNode) or len(prefix) >= 2:
            return
        for key_node, value_node in node.value:
            key = (*prefix, str(key_node.value))
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(
                    f"key {'.'.join(key)!r} is given twice (first at line {lines[key]})",
                    where=f"{path}:{line}",
                    fix="keep one of them",
                )
            lines[key] = line
            walk(value_node, key)

    walk(root, ())
    return lines
