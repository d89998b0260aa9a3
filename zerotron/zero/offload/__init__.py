"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters on the host or on NVMe.

ZeRO partitions the fp32 master weights and optimizer states over data-parallel ranks; this
module decides *where* a rank's partition lives while it is not being stepped. The math does
not change: stepping through :class:`OffloadedOptimizer` gives bitwise the same masters and
states as stepping the same torch optimizer over the same tensors without offload.

Pieces (the ZeRO optimizer in :mod:`zerotron.zero.optimizer` composes them; the options are
:class:`~zerotron.zero.options.OffloadOptions`, nested in ``ZeroOptions``):

- :mod:`~zerotron.zero.offload.swap`: :class:`NVMeSwapper`, named tensors in raw files under
  ``<root>/zerotron_swap/<name>/``, one file per key. Writes go to a temporary file that is
  renamed over the old one only when every byte is in, so a full disk
  (:class:`~zerotron.errors.DiskFullError`) never corrupts what was there. Reads check the
  exact size. No pickle anywhere: dtype and shape stay in memory.
- :mod:`~zerotron.zero.offload.pinned_pool`: the reusable host buffers NVMe offload streams
  sub-groups through.
- :mod:`~zerotron.zero.offload.optimizer`: :class:`OffloadedOptimizer`, steps a torch optimizer
  (Adam, AdamW, SGD: elementwise optimizers that keep per-parameter state) whose parameters are
  the rank's fp32 master "sub-groups" (DeepSpeed's ``sub_group_size`` pieces). ``cpu`` keeps
  masters and states in host memory and steps there; ``nvme`` keeps them in files and streams
  them through a pool of ``buffer_count`` slots, one sub-group per slot, reading the next
  sub-groups and writing the previous ones on a background thread while the current one steps.
- :mod:`~zerotron.zero.offload.param_store`: :class:`ParamOffloadStore`, ZeRO-3's
  ``offload_param``: 16-bit parameter shards kept on the host or in files, ``put`` / ``get``
  by key.

Offload is a memory trade, not an approximation. What each device keeps resident:

============  ======================================================================
``none``      masters and states where the caller made them (the accelerator)
``cpu``       masters and states in host memory (masters pinned with ``pin_memory``)
``nvme``      ``buffer_count`` sub-groups' masters and states, plus each sub-group's
              scalar state (Adam's ``step``), a few bytes
============  ======================================================================

``buffer_count`` counts sub-groups resident at once (DeepSpeed counts tensor buffers; its
default of 4 holds one Adam sub-group: master, gradient and two moments). Swap files are
scratch: they are deleted by :meth:`OffloadedOptimizer.close` (or at exit) and are not
fsynced; checkpoints (:meth:`OffloadedOptimizer.state_dict`) are the durable copy.
"""

from zerotron.zero.offload.optimizer import MasterView, OffloadedOptimizer
from zerotron.zero.offload.param_store import ParamOffloadStore
from zerotron.zero.offload.swap import NVMeSwapper

__all__ = ["MasterView", "NVMeSwapper", "OffloadedOptimizer", "ParamOffloadStore"]
