"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam``, both zerotron's one Adam."""

from zerotron.compat.ops.adam.cpu_adam import DeepSpeedCPUAdam
from zerotron.compat.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
