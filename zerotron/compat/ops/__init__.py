"""``deepspeed.ops``: DeepSpeed's optimizer classes over zerotron's optimizers.

- :mod:`.adam`: ``DeepSpeedCPUAdam``, ``FusedAdam`` -> :class:`zerotron.optim.adam.Adam`
- :mod:`.adagrad`: ``DeepSpeedCPUAdagrad`` -> :class:`zerotron.optim.adagrad.Adagrad`
- :mod:`.lion`: ``DeepSpeedCPULion``, ``FusedLion`` -> :class:`zerotron.optim.lion.Lion`
- :mod:`.op_builder`: the builders' names, for scripts that check an op before using it

DeepSpeed compiles these ops (C++/CUDA); zerotron's are torch optimizers running torch's fused
or foreach kernels, so nothing is built and every one works on every device.
"""

from zerotron.compat.ops import adagrad, adam, lion, op_builder
from zerotron.compat.submodules import submodule_getattr

__compatible_ops__ = op_builder.compatible_ops()
__getattr__ = submodule_getattr(__name__)  # a refused op (sparse_attention...) says why

__all__ = ["__compatible_ops__", "adagrad", "adam", "lion", "op_builder"]
