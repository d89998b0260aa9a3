"""``deepspeed.ops.op_builder``: the builders of the ops zerotron provides, for scripts that
check an op before they use it (``CPUAdamBuilder().is_compatible()``, ``.NAME``).

DeepSpeed's builders JIT-compile a C++/CUDA extension; zerotron's optimizers are torch code and
need none, so ``is_compatible()`` is True and ``load()`` refuses, naming the class to use
instead. Builders of ops zerotron does not have are absent (the import fails by name).
"""

from __future__ import annotations

from typing import NoReturn

from zerotron.errors import UnsupportedError


class OpBuilder:
    """A DeepSpeed op that zerotron provides as a torch class (:attr:`USE`), nothing to build."""

    NAME = ""
    USE = ""

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        """DeepSpeed's module path of the compiled op."""
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True: the op's zerotron class runs on this machine."""
        return True

    def load(self, verbose: bool = True) -> NoReturn:
        """Refused: there is no compiled extension to load."""
        raise UnsupportedError(
            f"zerotron has no compiled {self.name!r} extension to load (its ops are torch code)",
            where=f"{type(self).__name__}().load()",
            fix=f"use {self.USE} directly; drop the load() call",
        )

    jit_load = load


class CPUAdamBuilder(OpBuilder):
    """DeepSpeed's CPU Adam op: ``DeepSpeedCPUAdam``."""

    NAME = "cpu_adam"
    USE = "deepspeed.ops.adam.DeepSpeedCPUAdam"


class FusedAdamBuilder(OpBuilder):
    """DeepSpeed's fused (CUDA) Adam op: ``FusedAdam``."""

    NAME = "fused_adam"
    USE = "deepspeed.ops.adam.FusedAdam"


class CPUAdagradBuilder(OpBuilder):
    """DeepSpeed's CPU Adagrad op: ``DeepSpeedCPUAdagrad``."""

    NAME = "cpu_adagrad"
    USE = "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"


class CPULionBuilder(OpBuilder):
    """DeepSpeed's CPU Lion op: ``DeepSpeedCPULion``."""

    NAME = "cpu_lion"
    USE = "deepspeed.ops.lion.DeepSpeedCPULion"


class FusedLionBuilder(OpBuilder):
    """DeepSpeed's fused (CUDA) Lion op: ``FusedLion``."""

    NAME = "fused_lion"
    USE = "deepspeed.ops.lion.FusedLion"


BUILDERS = (CPUAdamBuilder, FusedAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder)


def compatible_ops() -> dict[str, bool]:
    """``{op name: True}`` for every op here (DeepSpeed's ``ops.__compatible_ops__``)."""
    return {b.NAME: True for b in BUILDERS}
