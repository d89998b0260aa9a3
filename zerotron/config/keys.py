"""Key handling for every loader: key styles (flat or sectioned, dash or underscore), sorting
keys into sections, unknown keys with the closest known one, and errors that name the key path
(and ``file:line``) where a value was written.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from zerotron.config.sections import FIELD_SECTION, SECTIONS
from zerotron.errors import ConfigError


def normalize_key(key: Any) -> str:
    """``--num-layers`` / ``num-layers`` / ``num_layers`` -> ``num_layers``."""
    return str(key).lstrip("-").replace("-", "_")


def suggest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name closest to ``name`` (for "did you mean ...?"), or None."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


def unknown_key_error(path: tuple[str, ...], where: str) -> ConfigError:
    """The error for a key path the schema does not have, with the closest known key."""
    name = normalize_key(path[-1])
    section = normalize_key(path[0]) if len(path) > 1 else None
    if section in SECTIONS:
        choices = list(SECTIONS[section].model_fields)
    else:
        choices = [*FIELD_SECTION, *SECTIONS]
    close = suggest(name, choices)
    fix = f"did you mean {close!r}?" if close else "see `zerotron pretrain --help` for the keys"
    return ConfigError(f"unknown key {'.'.join(path)!r}", where=where, fix=fix)


class Keys(NamedTuple):
    """Keys sorted into sections by :func:`nest_keys`."""

    nested: dict[str, dict[str, Any]]
    """section -> field -> value, for every key the schema has"""
    unknown: dict[tuple[str, ...], Any]
    """key paths as written (e.g. ``("model", "swiglu")``) the schema does not have"""
    origin: dict[tuple[str, str], str]
    """(section, field) -> where the value was written, for error messages"""


def nest_keys(
    data: Mapping[str, Any], where: Callable[[tuple[str, ...]], str] | None = None
) -> Keys:
    """Sort keys (flat or under their section, dash or underscore style) into sections.

    Unknown keys are returned, not raised, so a caller can recognize Megatron flags zerotron
    does not support. ``where(path)`` renders the location of a key path as written (default:
    the dotted path).
    """
    where = where or (lambda path: ".".join(path))
    keys = Keys({}, {}, {})

    def put(section: str, name: str, value: Any, path: tuple[str, ...]) -> None:
        if name in keys.nested.setdefault(section, {}):
            raise ConfigError(
                f"{section}.{name} is given twice", where=where(path), fix="keep one of them"
            )
        keys.nested[section][name] = value
        keys.origin[(section, name)] = where(path)

    for raw_key, value in data.items():
        key = normalize_key(raw_key)
        if key in SECTIONS:
            if value is None:  # an empty YAML section
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"section {key!r} must be a mapping of keys, got {value!r}",
                    where=where((str(raw_key),)),
                    fix=f"write `{key}:` followed by indented `name: value` lines",
                )
            for raw_sub, sub_value in value.items():
                sub = normalize_key(raw_sub)
                path = (str(raw_key), str(raw_sub))
                if sub in SECTIONS[key].model_fields:
                    put(key, sub, sub_value, path)
                elif sub in FIELD_SECTION:
                    right = FIELD_SECTION[sub]
                    raise ConfigError(
                        f"{sub!r} belongs to section {right!r}, not {key!r}",
                        where=where(path),
                        fix=f"move it under `{right}:` or write it at the top level",
                    )
                else:
                    keys.unknown[path] = sub_value
        elif key in FIELD_SECTION:
            put(FIELD_SECTION[key], key, value, (str(raw_key),))
        else:
            keys.unknown[(str(raw_key),)] = value
    return keys


def validation_error(e: ValidationError, origin: Mapping[tuple[str, str], str]) -> ConfigError:
    """Turn pydantic's report into ours: one line per bad key with where, path and value."""
    lines = []
    for err in e.errors():
        loc = tuple(str(p) for p in err["loc"])
        path = ".".join(loc)
        if err["type"] == "extra_forbidden":
            text = f"{path}: unknown key"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            text = f"{path} = {err['input']!r}: {msg[0].lower()}{msg[1:]}"
        source = origin.get(loc[:2])
        lines.append((source, text))
    if len(lines) == 1:
        (source, text), fix = lines[0], "correct the value"
        return ConfigError(text, where=source, fix=fix)
    what = "invalid values:" + "".join(
        f"\n    {source + ': ' if source else ''}{text}" for source, text in lines
    )
    return ConfigError(what, fix="correct the values named above")
