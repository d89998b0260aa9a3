"""Value converters for the loaders' key tables: ``(key path, value) -> value``, raising a
ConfigError that names the key path as the user wrote it
(``zero_optimization.stage: 'x' is not an integer``).

:func:`from_field` derives the converter of a schema field from its type and bounds, so a key
that only renames a field (the offload keys, for one) is validated by the field's own
definition, written once in :mod:`zerotron.config.sections`.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel

from zerotron.errors import ConfigError

Parse = Callable[[str, Any], Any]


def bad_value(path: str, value: Any, expected: str) -> ConfigError:
    """``<path>: <value> is not <expected>``."""
    return ConfigError(f"{path}: {value!r} is not {expected}", fix="correct the value")


def INT(path: str, value: Any) -> int:
    """An integer; 5e8 and "5e8" are accepted (DeepSpeed configs write bucket sizes so)."""
    if isinstance(value, bool):
        raise bad_value(path, value, "an integer")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise bad_value(path, value, "an integer") from None
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise bad_value(path, value, "an integer")
        return int(value)
    if not isinstance(value, int):
        raise bad_value(path, value, "an integer")
    return value


def FLOAT(path: str, value: Any) -> float:
    if isinstance(value, bool):
        raise bad_value(path, value, "a number")
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise bad_value(path, value, "a number") from None
    if not isinstance(value, (int, float)):
        raise bad_value(path, value, "a number")
    return float(value)


def BOOL(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(path, value, "true or false")
    return value


def STR(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_value(path, value, "a string")
    return value


def OPTIONAL(parse: Parse) -> Parse:
    """``parse``, with null passing through as None."""

    def check(path: str, value: Any) -> Any:
        return None if value is None else parse(path, value)

    return check


OPT_STR = OPTIONAL(STR)


def CHOICE(*choices: str, fold: bool = True) -> Parse:
    """One of ``choices`` (case-insensitively when ``fold``), returned in its canonical case."""

    def parse(path: str, value: Any) -> str:
        if isinstance(value, str):
            for c in choices:
                if value == c or (fold and value.lower() == c.lower()):
                    return c
        raise bad_value(path, value, f"one of {', '.join(choices)}")

    return parse


def POSITIVE(parse: Parse) -> Parse:
    def check(path: str, value: Any) -> Any:
        value = parse(path, value)
        if value <= 0:
            raise bad_value(path, value, "positive")
        return value

    return check


def NON_NEGATIVE(parse: Parse) -> Parse:
    def check(path: str, value: Any) -> Any:
        value = parse(path, value)
        if value < 0:
            raise bad_value(path, value, "zero or positive")
        return value

    return check


def BETAS(path: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise bad_value(path, value, "a pair [beta1, beta2]")
    return FLOAT(f"{path}[0]", value[0]), FLOAT(f"{path}[1]", value[1])


def parse_at(parse: Parse, path: str, value: Any) -> Any:
    """``parse(path, value)``, its error naming ``path`` in ``where`` rather than in the
    message: for callers whose errors are matched on their key path (the offload options)."""
    try:
        return parse(path, value)
    except ConfigError as e:
        raise ConfigError(e.what.removeprefix(f"{path}: "), where=path, fix=e.fix) from None


_BASE: dict[Any, Parse] = {int: INT, float: FLOAT, bool: BOOL, str: STR}


def from_field(section: type[BaseModel], name: str) -> Parse:
    """The converter a schema field's definition implies: its type (int, float, bool, str or
    a Literal of strings), optional when it may be None, positive for ``gt=0`` and zero or
    positive for ``ge=0``. Other bounds are left to the schema."""
    info = section.model_fields[name]
    annotation, optional = info.annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation, optional = args[0], True
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        parse = CHOICE(*typing.get_args(annotation))
    else:
        parse = _BASE[annotation]
    for bound in info.metadata:
        # pydantic keeps Field(gt=..., ge=...) as annotated-types objects with these attributes
        if getattr(bound, "gt", None) == 0:
            parse = POSITIVE(parse)
        elif getattr(bound, "ge", None) == 0:
            parse = NON_NEGATIVE(parse)
    return OPTIONAL(parse) if optional else parse
