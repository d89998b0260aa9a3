"""argparse with the errors users expect: an unknown flag suggests the closest valid one."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn

from zerotron.errors import ConfigError


class _HelpFormatter(argparse.HelpFormatter):
    """Show a flag's default when it says something (not None/False, not already in the help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or action.option_strings == []
        ):
            return text
        return text + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that raises :class:`ConfigError` instead of exiting.

    Abbreviations are off (``--lr`` must never silently mean ``--lr-decay-style``), and an
    unknown flag names the closest known flags.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def known_flags(self) -> list[str]:
        """Flags to suggest: those --help shows (hidden ones exist only to explain themselves)."""
        return [
            s
            for a in self._actions
            if a.help != argparse.SUPPRESS
            for s in a.option_strings
            if s.startswith("--")
        ]

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.unknown(extras)
        return ns

    def unknown(self, extras: list[str]) -> NoReturn:
        flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
        if not flags:
            raise ConfigError(f"unexpected argument {extras[0]!r}", fix=f"see {self.prog} --help")
        flag = flags[0]
        close = difflib.get_close_matches(flag, self.known_flags(), n=3, cutoff=0.6)
        fix = f"did you mean {' or '.join(close)}?" if close else f"see {self.prog} --help"
        raise ConfigError(f"unknown flag {flag}", fix=fix)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message, fix=f"see {self.prog} --help")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)
