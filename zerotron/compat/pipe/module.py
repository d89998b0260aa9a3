"""DeepSpeed's ``PipelineModule``: a model written as a list of layers, cut into pipeline stages.

::

    from zerotron.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [
        TiedLayerSpec("embed", nn.Embedding, vocab, h),
        *[LayerSpec(Block, h) for _ in range(8)],
        TiedLayerSpec("embed", nn.Embedding, vocab, h, forward_fn=lambda e, x: x @ e.weight.t()),
    ]
    model = PipelineModule(layers, num_stages=2, loss_fn=nn.CrossEntropyLoss())

Every rank lists the whole model; :class:`PipelineModule` builds only the layers of its own
pipeline stage (``zerotron.distributed.state().pp_rank``), so a stage never allocates another
stage's weights. The layers are split by ``partition_method``:

- ``"parameters"`` (default): contiguous stages balanced by trainable parameter count (a
  ``LayerSpec`` is built on the meta device to be counted: no memory, no random draws);
- ``"uniform"``: equal layer counts (earlier stages take the spare layers);
- ``"type:<regex>"``: balanced by the number of layers whose class name matches the regex
  (case-insensitive), e.g. ``"type:Block"`` puts the same number of blocks on each stage.

The boundaries are :attr:`PipelineModule.parts` (stage ``s`` holds ``parts[s]:parts[s+1]``),
computed with :mod:`zerotron.pipeline.partition`; every stage holds at least one layer.

Layers may be ``LayerSpec`` (built here), ``TiedLayerSpec``, ready ``nn.Module`` objects or plain
callables (``lambda x: x.flatten(1)``). ``forward(x)`` runs the local layers in order, each on the
previous one's output; with ``activation_checkpoint_interval=k`` every ``k`` consecutive layers
that hold parameters run through ``activation_checkpoint_func``
(:func:`zerotron.parallel.recompute.checkpoint`, which is ``zerotron.checkpointing.checkpoint``),
unless no input of theirs requires grad (token ids into an embedding): checkpointed, their
parameters would get no gradient, so they run plainly.

Tied layers: all ``TiedLayerSpec`` with one ``key`` share one module per stage (built at the
first use on that stage; later uses call it again, through ``forward_fn(module, x)`` when
given). A key used on several stages has a copy on each: the copies are made equal at build
time (broadcast from the first of those stages) and
:meth:`PipelineModule.allreduce_tied_weight_gradients` sums their ``tied_weight_attr``
gradients over those stages after backward, so every copy steps with the gradient of the one
shared weight. Copies on all but the first stage are marked
``shared`` so the gradient norm counts the weight once. The pipeline runtime adapter
(:mod:`zerotron.pipe.stage`) calls the reduction for you.

Parameter names follow DeepSpeed: ``"<global layer index>.<name>"`` for ordinary layers and
``"tied_modules.<key>.<name>"`` for tied ones.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.init import get_world_size, init_distributed, new_group
from zerotron.distributed.state import (
    initialize_model_parallel,
    is_model_parallel_initialized,
    state,
)
from zerotron.distributed.topology import ProcessTopology
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.parallel.recompute import checkpoint
from zerotron.pipeline.partition import partition_balanced, partition_uniform
from zerotron.precision.grads import grad_of


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)`` (DeepSpeed's)."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ConfigError(
                f"LayerSpec needs an nn.Module subclass, got {typename!r}",
                where="LayerSpec",
                fix="pass the class itself (LayerSpec(nn.Linear, 4, 4)), not an instance",
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """A new instance of the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` weights are shared by every spec with the same ``key``.

    ``forward_fn(module, x)``, when given, is how this use calls the shared module (e.g. the
    output layer multiplying by an embedding's weight).
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)


Layer = LayerSpec | nn.Module | Callable[..., Any]
PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")


class PipelineModule(nn.Module):
    """This pipeline stage's share of a model given as a list of layers (module docstring).

    ``num_stages`` (or ``topology``, a :class:`~zerotron.distributed.topology.ProcessTopology`)
    must match the pipeline-parallel size of :func:`zerotron.distributed.state`; None takes it
    from there. When no model-parallel layout exists yet, the module builds one as DeepSpeed's
    ``PipeDataParallelTopology`` does: ``num_stages`` pipeline stages, the rest data parallel
    (``topology``: its tensor and pipeline sizes). ``loss_fn(outputs, labels)`` turns the last
    stage's output into the loss.
    ``seed_layers``: seed torch (and ``random``, numpy) with ``base_seed + layer index`` before
    building each layer, and with ``base_seed * micro_offset + layer index`` before running it
    (DeepSpeed's behaviour), so a layer's weights do not depend on which stage builds it.
    ``dynamic_shape``: activations between stages may change shape from step to step (their
    shapes are sent every step; otherwise only at the first).
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
    ):
        super().__init__()
        ps = _state_for(num_stages, topology)
        self.num_stages = _num_stages(num_stages, topology, ps.pp_size)
        self.stage_id = ps.pp_rank
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        if activation_checkpoint_interval < 0:
            raise ConfigError(
                f"must be >= 0, got {activation_checkpoint_interval}",
                where="PipelineModule(activation_checkpoint_interval=...)",
            )
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape  # the runtime's variable_seq_lengths
        self._layer_specs = list(layers)
        for i, layer in enumerate(self._layer_specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise ConfigError(
                    f"a pipeline layer must be a LayerSpec, an nn.Module or a callable, got "
                    f"{type(layer).__name__}",
                    where=f"PipelineModule(layers[{i}])",
                )
        self.partition_method = partition_method
        self.parts = partition_layers(self._layer_specs, self.num_stages, partition_method)
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.micro_offset = 0
        self.forward_funcs: list[Callable[..., Any]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        self.tied_comms = self._index_tied_modules(ps)
        self._synchronize_tied_weights()

    # ---- building ----------------------------------------------------------------------------

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)

    def _build(self) -> None:
        for index in range(self._local_start, self._local_stop):
            layer = self._layer_specs[index]
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    if self.seed_layers:
                        self._seed(self.base_seed + index)
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                if layer.forward_fn is None:
                    self.forward_funcs.append(module)
                else:
                    self.forward_funcs.append(_TiedCall(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                if self.seed_layers:
                    self._seed(self.base_seed + index)
                module = layer.build()
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                self.forward_funcs.append(layer)
            else:
                self.forward_funcs.append(layer)

    def _index_tied_modules(self, ps: Any) -> dict[str, Group]:
        """Per tied key: the group of the stages that hold it (this rank's dp and tp)."""
        topo = ps.topology
        comms: dict[str, Group] = {}
        keys: dict[str, list[int]] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stage = _stage_of(self.parts, index)
                stages = keys.setdefault(layer.key, [])
                if stage not in stages:
                    stages.append(stage)
        for key in sorted(keys):
            stages = sorted(keys[key])
            holders: list[int] = []
            if self.stage_id in stages:
                holders = [topo.rank(pp=s, dp=ps.dp_rank, tp=ps.tp_rank) for s in stages]
            if len(stages) > 1:
                # Every rank creates every group, in the same order (torch requires it).
                pg = None
                for dp_rank in range(topo.dp):
                    for tp_rank in range(topo.tp):
                        ranks = [topo.rank(pp=s, dp=dp_rank, tp=tp_rank) for s in stages]
                        made = new_group(ranks)  # with the job's timeout
                        if ps.rank in ranks:
                            pg = made
                if holders:
                    comms[key] = Group("tied", tuple(holders), holders.index(ps.rank), pg)
            elif holders:
                comms[key] = Group.single("tied", ps.rank)
            if key in self.tied_modules and stages[0] != self.stage_id:
                for weight in self._tied_weights(key):
                    weight.shared = True  # counted once in the gradient norm: on the first stage
        return comms

    def _tied_weights(self, key: str) -> list[torch.Tensor]:
        module = self.tied_modules[key]
        weights = []
        for attr in self.tied_weight_attrs[key]:
            obj: Any = module
            for part in attr.split("."):
                obj = getattr(obj, part)
            weights.append(obj)
        return weights

    @torch.no_grad()
    def _synchronize_tied_weights(self) -> None:
        """Copy each tied weight from the first stage holding it to the others."""
        for key, group in self.tied_comms.items():
            for weight in self._tied_weights(key):
                comm.broadcast(weight.data, group, 0)

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum each tied weight's gradient over the stages holding it (after backward).

        The gradient is the parameter's ``main_grad`` where it has one (data-parallel buffers),
        else ``.grad``; a copy without a gradient this step contributes zeros.
        """
        for key, group in self.tied_comms.items():
            if group.size == 1:
                continue
            for weight in self._tied_weights(key):
                grad = grad_of(weight)
                if grad is None:
                    weight.grad = grad = torch.zeros_like(weight)
                comm.all_reduce(grad, group)

    # ---- running -----------------------------------------------------------------------------

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on ``forward_input`` (checkpointed every ``interval``)."""
        self.micro_offset += 1
        n = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        x = forward_input
        if interval == 0 or not torch.is_grad_enabled():
            return self._exec_range(0, n)(x)
        for start in range(0, n, interval):
            stop = min(start + interval, n)
            run = self._exec_range(start, stop)
            args = x if isinstance(x, tuple) else (x,)
            # A checkpointed run whose inputs need no gradient (token ids into an embedding)
            # would give its parameters none: such a run goes without checkpointing.
            needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            if needs_grad and self._is_checkpointable(self.forward_funcs[start:stop]):
                x = self.activation_checkpoint_func(run, *args)
            else:
                x = run(x)
        return x

    def _exec_range(self, start: int, stop: int) -> Callable[..., Any]:
        micro_offset = self.micro_offset

        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:stop]):
                if self.seed_layers:
                    self._seed(self.base_seed * micro_offset + self._local_start + start + i)
                x = layer(x)
            return x

        return run

    def _is_checkpointable(self, funcs: Sequence[Callable[..., Any]]) -> bool:
        if self.checkpointable_layers is not None:
            names = {type(f).__name__ for f in funcs}
            return bool(names & set(self.checkpointable_layers))
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # ---- DeepSpeed's helpers ------------------------------------------------------------------

    def topology(self) -> ProcessTopology:
        return state().topology

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline stage holding global layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ConfigError(
                f"layer {layer_idx} is outside 0..{len(self._layer_specs) - 1}",
                where="PipelineModule.stage_owner",
            )
        return _stage_of(self.parts, layer_idx)

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1


class _TiedCall:
    """``forward_fn(module, x)``: a later use of a tied module."""

    def __init__(self, forward_fn: Callable[[nn.Module, Any], Any], module: nn.Module):
        self.forward_fn = forward_fn
        self.module = module

    def __call__(self, x: Any) -> Any:
        return self.forward_fn(self.module, x)


def _state_for(num_stages: int | None, topology: ProcessTopology | None) -> Any:
    """The parallel state, laid out for ``num_stages`` / ``topology`` first when no layout
    exists yet (a collective then: every rank builds the module)."""
    if is_model_parallel_initialized() or (num_stages is None and topology is None):
        return state()
    init_distributed()  # the launcher's process group, if the script did not make it yet
    world = get_world_size()
    tp = topology.tp if topology is not None else 1
    pp = topology.pp if topology is not None else int(num_stages or 1)
    if topology is not None and topology.world_size != world:
        raise ConfigError(
            f"the topology has {topology.world_size} ranks but the job has {world}",
            where="PipelineModule(topology=...)",
            fix="build the topology for this world size",
        )
    if pp < 1 or world % (pp * tp):
        raise ConfigError(
            f"{pp} pipeline stages (x {tp} tensor-parallel ranks) do not divide the {world} "
            "ranks of the job",
            where="PipelineModule(num_stages=...)",
            fix=f"launch a multiple of {pp * tp} processes, or pass another num_stages",
        )
    if pp * tp == 1:
        return state()
    return initialize_model_parallel(tp, pp)


def _num_stages(num_stages: int | None, topology: ProcessTopology | None, pp_size: int) -> int:
    if topology is not None:
        if num_stages is not None and num_stages != topology.pp:
            raise ConfigError(
                f"num_stages={num_stages} but the topology has {topology.pp} pipeline stages",
                where="PipelineModule",
                fix="pass one of them",
            )
        num_stages = topology.pp
    if num_stages is None:
        return pp_size
    if num_stages != pp_size:
        raise ConfigError(
            f"PipelineModule has {num_stages} stages but the pipeline-parallel size is {pp_size}",
            where="PipelineModule(num_stages=...)",
            fix=f"pass num_stages={pp_size}, or initialize_model_parallel("
            f"pipeline_model_parallel_size={num_stages}) before building the module",
        )
    return num_stages


def _stage_of(parts: Sequence[int], index: int) -> int:
    for stage in range(len(parts) - 1):
        if parts[stage] <= index < parts[stage + 1]:
            return stage
    raise AssertionError(f"layer {index} outside {parts}")


# ---- partitioning ------------------------------------------------------------------------------


def partition_layers(layers: Sequence[Layer], num_stages: int, method: str) -> list[int]:
    """Stage boundaries ``[0, ..., len(layers)]`` for ``method`` (see the module docstring)."""
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(layers), num_stages)
    if lowered == "parameters":
        return partition_balanced([float(layer_parameters(x)) for x in layers], num_stages)
    if lowered.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise ConfigError(
                f"bad regular expression {pattern!r}: {e}", where="partition_method"
            ) from None
        weights = [1.0 if regex.search(layer_name(x)) else 0.0 for x in layers]
        if not any(weights):
            names = sorted({layer_name(x) for x in layers})
            raise ConfigError(
                f"no layer's class name matches {pattern!r}",
                where=f"partition_method={method!r}",
                fix=f"match one of {', '.join(names)}",
            )
        return partition_balanced(weights, num_stages)
    if lowered == "profile":
        raise UnsupportedError(
            "partition_method='profile' (DeepSpeed has not implemented it either)",
            where="PipelineModule",
            fix="use 'parameters', 'uniform' or 'type:<regex>'",
        )
    raise ConfigError(
        f"unknown partition method {method!r}",
        where="PipelineModule(partition_method=...)",
        fix=f"use one of {', '.join(PARTITION_METHODS)}",
    )


def layer_name(layer: Layer) -> str:
    """The class name ``type:`` partitioning matches: the spec's class, module's or function's."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def layer_parameters(layer: Layer) -> int:
    """Trainable parameters of a layer; a spec is built on the meta device to count them."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # a constructor that needs real tensors: build it, draws undone
            with torch.random.fork_rng(devices=[]):
                module = layer.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0
