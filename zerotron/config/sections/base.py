"""What every schema section is made of: the frozen section base, tolerant number types, and
the value checks sections share (a choice with did-you-mean, a field's flag name)."""

from __future__ import annotations

import difflib
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from zerotron.errors import ConfigError, UnsupportedError

# YAML reads `5e8` and `1e-4` as strings, and users write 5e8 for integers.


def to_int(value: Any) -> Any:
    """``5e8``, ``"1e6"``, ``4.0`` -> int; other values pass through for pydantic to judge."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value}")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return value


def to_float(value: Any) -> Any:
    """``"1e-4"`` -> float; other values pass through for pydantic to judge."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value}")
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    return value


Int = Annotated[int, BeforeValidator(to_int)]
"""An int that also accepts integral floats and strings such as ``5e8`` or ``"1e6"``."""

Float = Annotated[float, BeforeValidator(to_float)]
"""A float that also accepts strings such as ``"1e-4"`` (YAML 1.1 reads those as strings)."""


class Section(BaseModel):
    """A section of :class:`~zerotron.config.schema.Config`."""

    # Unknown keys are errors; sections are copied into each Config (never shared) and frozen.
    model_config = ConfigDict(extra="forbid", frozen=True, revalidate_instances="always")


def flag(name: str) -> str:
    """The Megatron flag for a field name: ``global_batch_size`` -> ``--global-batch-size``."""
    return "--" + name.replace("_", "-")


def check_choice(where: str, value: str, supported: tuple, unsupported: tuple = ()) -> None:
    """Raise UnsupportedError for a known-but-unimplemented value, ConfigError for a typo."""
    if value in supported:
        return
    if value in unsupported:
        raise UnsupportedError(
            f"{value} is not supported by zerotron",
            where=where,
            fix=f"use {' or '.join(supported)}",
        )
    close = difflib.get_close_matches(value, [*supported, *unsupported], n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        f"unknown value {value!r}", where=where, fix=f"{hint}choose from {', '.join(supported)}"
    )
