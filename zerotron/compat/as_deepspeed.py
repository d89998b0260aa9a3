"""Run a program in which ``import deepspeed`` is zerotron: for Hugging Face Trainer and accelerate.

transformers and accelerate enable their DeepSpeed code only when a ``deepspeed`` package is
importable *and* a ``deepspeed`` distribution is installed (``importlib.util.find_spec`` plus
``importlib.metadata.metadata``/``version``, then version floors such as ``>=0.9.3``). So that
they reach zerotron without anything named deepspeed being installed, and without touching a
real DeepSpeed that may be installed next to zerotron, the alias lives in a directory shipped
inside this package, ``compat/deepspeed_alias/``, which holds

- ``deepspeed/__init__.py``: a tiny package whose attributes are zerotron's and which installs
  :class:`DeepSpeedAliasFinder`, so that every ``deepspeed.X.Y`` is the module ``zerotron.X.Y``
  itself (one copy, shared with code that imports zerotron by its own name);
- ``deepspeed-<version>.dist-info/``: the distribution metadata those libraries read, with
  :data:`DEEPSPEED_VERSION`, the DeepSpeed release whose API zerotron serves.

Putting that directory first on ``PYTHONPATH`` is the whole switch: it applies to the program
and to every process it starts, and to nothing else. Two ways to do it:

    zerotron launch --as-deepspeed --nproc_per_node 2 run_clm.py --deepspeed ds_config.json ...
    python -m zerotron.compat.as_deepspeed run_clm.py --deepspeed ds_config.json ...

(or by hand: ``PYTHONPATH=$(python -m zerotron.compat.as_deepspeed --print-path):$PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from types import ModuleType
from typing import Any

import zerotron
from zerotron.errors import ConfigError

# The DeepSpeed release whose API zerotron serves; the .dist-info directory carries it too
# (tests/test_as_deepspeed.py keeps the two equal).
DEEPSPEED_VERSION = "0.19.8"
ALIAS_PATH = str(Path(__file__).resolve().parent / "deepspeed_alias")
ALIAS_NAME = "deepspeed"


def target_of(fullname: str) -> str | None:
    """The zerotron module that ``fullname`` (``deepspeed.X.Y``) is, or None if not an alias."""
    if not fullname.startswith(ALIAS_NAME + "."):
        return None
    return "zerotron" + fullname[len(ALIAS_NAME) :]


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.X[.Y]`` as ``zerotron.X[.Y]``; installed by the ``deepspeed`` shim."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = target_of(fullname)
        if real is None:
            return None
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:  # a parent is missing: the same answer as for the child
            found = None
        if found is None:
            from zerotron.config.deepspeed_refused import missing_module

            error = missing_module(fullname)
            if error is not None:  # a DeepSpeed module zerotron refuses: say why
                raise error
            return None  # zerotron does not serve it: the usual "No module named ..." follows
        return importlib.util.spec_from_loader(fullname, zerotron.AliasLoader(real))


def install_module_alias(
    name: str,
) -> tuple[str, Callable[[str], Any], Callable[[], list[str]]]:
    """Set up the ``deepspeed`` shim package ``name``: returns its ``__version__``,
    ``__getattr__`` and ``__dir__`` (zerotron's attributes), and installs the finder once."""
    import zerotron

    if not any(isinstance(f, DeepSpeedAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAliasFinder())

    def __getattr__(attr: str) -> Any:
        from zerotron.config.deepspeed_refused import missing_attribute

        try:
            return getattr(zerotron, attr)
        except AttributeError:
            raise missing_attribute(
                "deepspeed",
                attr,
                f"module {name!r} (zerotron's DeepSpeed API) has no attribute {attr!r}; "
                "docs/deepspeed.md lists what zerotron serves",
            ) from None

    def __dir__() -> list[str]:
        return sorted(
            {*zerotron.__all__, *zerotron.COMPAT_MODULES, "zero", "__version__"}
            | set(vars(zerotron))
        )

    return DEEPSPEED_VERSION, __getattr__, __dir__


def environ(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Put the alias directory first on ``env["PYTHONPATH"]`` (in place); returns ``env``."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ALIAS_PATH]
    env["PYTHONPATH"] = os.pathsep.join([ALIAS_PATH, *parts])
    return env


def enable() -> None:
    """Make ``import deepspeed`` zerotron in this process and in the processes it starts.

    Raises ConfigError when a real DeepSpeed was already imported here: its modules would
    stay in use beside zerotron's.
    """
    loaded = sys.modules.get(ALIAS_NAME)
    if loaded is not None and not getattr(loaded, "__file__", "").startswith(ALIAS_PATH):
        raise ConfigError(
            f"a real DeepSpeed is already imported from {getattr(loaded, '__file__', '?')}",
            fix="enable the alias before anything imports deepspeed: run the program with "
            "`python -m zerotron.compat.as_deepspeed` or `zerotron launch --as-deepspeed`",
        )
    environ(os.environ)
    from zerotron.compat import hf

    hf.install()  # accelerate's DeepSpeed runs on CPU-only hosts (see zerotron.compat.hf)
    if ALIAS_PATH in sys.path:
        sys.path.remove(ALIAS_PATH)
    sys.path.insert(0, ALIAS_PATH)
    importlib.invalidate_caches()


USAGE = "python -m zerotron.compat.as_deepspeed [--print-path] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    """Run SCRIPT (or -m MODULE) with its ARGS in this process, ``import deepspeed`` being
    zerotron; ``--print-path`` prints the directory to put first on PYTHONPATH instead."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--print-path"]:
        print(ALIAS_PATH)
        return 0
    asked = args[:1] in (["-h"], ["--help"])
    if not args or asked or args == ["-m"]:
        print(f"usage: {USAGE}", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    enable()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        if not os.path.isfile(args[0]):
            raise ConfigError(
                f"script {args[0]!r} not found",
                fix="give the path of a Python script, or -m MODULE",
            )
        sys.argv = args
        sys.path.insert(1, str(Path(args[0]).resolve().parent))  # as `python script.py` does
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
