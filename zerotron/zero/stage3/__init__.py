"""ZeRO stage 3: parameters partitioned at rest, gathered around each module's forward and backward.

:func:`partition_parameters` turns any ``nn.Module`` into a stage-3 module. It first broadcasts
data-parallel rank 0's values of every parameter (as DeepSpeed's ``zero.Init`` does: ranks that
seeded differently still hold one model). Every parameter with more than
``persistence_threshold`` elements is split by the rule of :mod:`zerotron.zero.partition` (chunk
``ceil(n/N)``, rank r owns ``flat[r*chunk:(r+1)*chunk]``): the rank keeps its chunk in
``p.ds_tensor`` and ``p.data`` becomes an empty tensor. Smaller parameters stay whole
(``p.ds_persist = True``; the optimizer treats them as stage 2 does). The attributes are
DeepSpeed's, with their meaning (:mod:`~zerotron.zero.stage3.shards`; ``docs/zero.md``)::

    p.ds_id          unique int per parameter
    p.ds_status      ZeroParamStatus: AVAILABLE (whole), NOT_AVAILABLE (at rest), INFLIGHT
    p.ds_tensor      1-D, ``chunk`` elements: this rank's chunk, zero-padded; p.dtype, or
                     once a ZeroOptimizer without offload owns the model, a view of its
                     fp32 master (one copy of the partition, cast as it is gathered)
    p.ds_shape       torch.Size of the full parameter (``p.shape`` is (0,) at rest)
    p.ds_numel       elements of the full parameter
    p.ds_persist     False (True: kept whole, and no ``ds_tensor``)
    p.zero_modified  True after :class:`GatheredParameters` rewrote it (see below)

``torch.save`` of a stage-3 parameter saves its current data (empty at rest) as a plain
parameter, loadable with ``weights_only=True``.

The life of a parameter in one training step (hooks on every submodule):

1. before a module's forward, its *own* parameters (``recurse=False``) and those registered
   with :func:`register_external_parameter` are gathered: one ``all_gather`` of rank-major rows
   per fetch (all the module's parameters in one collective);
2. after its forward they are released (``p.data`` back to an empty tensor) and its outputs pass
   through a small autograd function whose backward gathers them again; with a
   ``max_reuse_distance``, a parameter whose next use comes soon enough (fewer elements fetched
   in between, along the recorded orders) is kept gathered until then instead;
3. each parameter is released once its gradient has been accumulated (a post-accumulate-grad
   hook registered at partitioning, so it runs before the optimizer's: it only swaps ``p.data``,
   never touches ``p.grad``); whatever is still held when the backward ends is released then.

Gathers are reference-counted, so nesting is free: a parent that holds a tied weight, activation
recompute re-running a layer's forward inside backward (the recomputed layer keeps its parameters
for its own backward, which follows at once: parameters are gathered exactly twice per step with
or without recompute, without reuse), :class:`GatheredParameters` blocks, a reuse hold.

Prefetch: the order in which modules fetch is recorded in the first forward and the first
backward (separately; no-grad forwards, which a model may run along another path, keep a
third); later passes that follow the same order start the gathers of the next modules
asynchronously, up to ``prefetch_bucket_size`` elements in flight and
``max_live_parameters`` gathered in all. Without a ``prefetch_bucket_size`` (zerotron's default;
a DeepSpeed config's default is 5e7) only the next module is gathered ahead, as FSDP2 does: in
backward a deeper prefetch holds parameters while the activations are at their peak. A pass
that departs from the recorded order stops prefetching and the next pass records afresh.

Saved activations: autograd keeps views of the weights it needs for backward (``linear`` saves
``weight.t()``), which would keep a released parameter's memory alive until backward. While a
stage-3 forward runs, a saved-tensor hook stores such a view as (parameter, shape, strides) and
rebuilds it from the re-gathered parameter in backward, so release really frees the memory
(what DeepSpeed's ``mem_efficient_linear`` does for linear layers, here for every op).

Optimizer contract: :class:`~zerotron.zero.optimizer.ZeroOptimizer` calls
:func:`partition_parameters` (unless the model has a coordinator already), builds its fp32
masters from :func:`read_shard`, reduce-scatters the full ``p.grad`` in its own
post-accumulate-grad hook and writes updated chunks back with :func:`write_shard`.
``p.zero_modified``, set by a :class:`GatheredParameters` block with ``modifier_rank`` or by
:func:`load_full_state_dict`, tells it to reload its master chunk (and clear the flag): see
:func:`modified_parameters`.

Offload (``offload_param``): with a ``param_store``
(:class:`zerotron.zero.offload.ParamOffloadStore`) the shards rest in the store between uses
and a fetch reads them from there. With ``cpu``, ``p.ds_tensor`` is the store's host tensor
itself; with ``nvme`` only the file holds the values and ``p.ds_tensor`` is an empty
placeholder: go through :func:`read_shard` / :func:`write_shard`.

Where each part lives:

- :mod:`~zerotron.zero.stage3.shards`: one parameter: its shard, its store, its state;
- :mod:`~zerotron.zero.stage3.gather`: the all-gathers, reference counts, ``GatheredParameters``;
- :mod:`~zerotron.zero.stage3.coordinator`: the hooks, prefetch order, saved-tensor views;
- :mod:`~zerotron.zero.stage3.externals`: parameters used outside the module that owns them.
"""

from __future__ import annotations

from zerotron.zero.stage3.coordinator import (
    ParamCoordinator,
    coordinator_of,
    partition_parameters,
)
from zerotron.zero.stage3.externals import (
    register_external_parameter,
    unregister_external_parameter,
)
from zerotron.zero.stage3.gather import GatheredParameters, gathered_state_dict
from zerotron.zero.stage3.shards import (
    ShardStore,
    ZeroParamStatus,
    is_partitioned,
    is_zero_param,
    iter_partitioned,
    load_full_state_dict,
    modified_parameters,
    partition_param,
    read_shard,
    write_shard,
)

__all__ = [
    "GatheredParameters",
    "ParamCoordinator",
    "ShardStore",
    "ZeroParamStatus",
    "coordinator_of",
    "gathered_state_dict",
    "is_partitioned",
    "is_zero_param",
    "iter_partitioned",
    "load_full_state_dict",
    "modified_parameters",
    "partition_param",
    "partition_parameters",
    "read_shard",
    "register_external_parameter",
    "unregister_external_parameter",
    "write_shard",
]
