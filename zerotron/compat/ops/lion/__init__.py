"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion``, both zerotron's one Lion."""

from zerotron.compat.ops.lion.cpu_lion import DeepSpeedCPULion
from zerotron.compat.ops.lion.fused_lion import FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
