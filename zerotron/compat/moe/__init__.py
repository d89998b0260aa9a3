"""DeepSpeed's ``deepspeed.moe`` (importable as ``zerotron.moe``): zerotron has no
mixture-of-experts layer yet. Importing works, so scripts with an optional MoE path run;
building an :class:`~zerotron.compat.moe.layer.MoE` layer raises an error saying so, and
:mod:`~zerotron.compat.moe.utils` treats every parameter as a dense one."""

from zerotron.compat.submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
