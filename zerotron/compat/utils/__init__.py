"""DeepSpeed's ``deepspeed.utils`` (importable as ``zerotron.utils``).

- logging: :data:`logger` (DeepSpeed's ``"DeepSpeed"`` logger), :func:`log_dist`,
  :func:`log_dist_once`, :func:`print_dist`, :func:`set_log_level_from_string`;
- :class:`RepeatingLoader` (from ``deepspeed.runtime.dataloader``);
- :mod:`~zerotron.compat.utils.groups`: the process-group getters;
- ZeRO-3 leaf modules: :func:`set_z3_leaf_modules`, :func:`unset_z3_leaf_modules`,
  :func:`get_z3_leaf_modules` (:mod:`~zerotron.compat.utils.z3_leaf_module`);
- whole fp32 values of a parameter at any ZeRO stage: ``safe_get_full_fp32_param``,
  ``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their setters and the ZeRO-3
  ``safe_get_local_*`` (:mod:`~zerotron.compat.utils.tensor_fragment`);
- :mod:`~zerotron.compat.utils.zero_to_fp32`: consolidating a ZeRO checkpoint (imported when
  named, as in DeepSpeed).
"""

from zerotron.compat.runtime.dataloader import RepeatingLoader
from zerotron.compat.submodules import submodule_getattr
from zerotron.compat.utils import groups
from zerotron.compat.utils.logging import (
    log_dist,
    log_dist_once,
    logger,
    print_dist,
    set_log_level_from_string,
)
from zerotron.compat.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from zerotron.compat.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "log_dist_once",
    "logger",
    "print_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "set_log_level_from_string",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

__getattr__ = submodule_getattr(__name__)
