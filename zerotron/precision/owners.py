"""Which optimizer wrapper owns a model parameter (holds its fp32 master and states).

DeepSpeed finds a parameter's master through attributes on the parameter (``_hp_mapping``,
``_z3_optimizer``); zerotron keeps parameters free of references to optimizers (a parameter
must stay ``torch.save``-able), so the wrappers register here instead:
:class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` and
:class:`~zerotron.zero.ZeroOptimizer` call :func:`set_owner` for the parameters they step,
and :func:`owner_of` answers for DeepSpeed's ``safe_get_full_*`` functions. The table holds
parameters and their owners weakly: it keeps nothing alive (an owner held strongly would hold
its parameters, and so its own key, forever, with every master and Adam moment it made).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_owner(params: Iterable[Tensor], owner: Any) -> None:
    """Record ``owner`` as the optimizer wrapper of each of ``params`` (the latest wins)."""
    ref = weakref.ref(owner)
    for p in params:
        _OWNERS[p] = ref


def owner_of(p: Tensor) -> Any:
    """The optimizer wrapper that last registered ``p`` and is still alive, or None."""
    ref = _OWNERS.get(p)
    return None if ref is None else ref()
