"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad``."""

from zerotron.compat.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
