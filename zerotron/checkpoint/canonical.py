"""A checkpoint of any layout read as canonical per-parameter records, lazily.

Whatever layout saved it (tensor parallel, pipeline parallel with or without virtual stages,
any data-parallel size, ZeRO stage 0-3, offloaded or not: offload does not change the files),
a GPT checkpoint holds, for every parameter, the same few full tensors: the weight (in the
params dtype), the fp32 master, and the elementwise optimizer state (Adam's ``exp_avg`` and
``exp_avg_sq``), plus a step count; and, beside them, state every rank shares (iteration,
consumed samples, step counters, LR scheduler, loss scaler) and per-rank RNG streams.
:class:`CanonicalCheckpoint` gives those, one full tensor at a time, under the single-process
GPT's parameter names (the last pipeline stage's tied copy ``output_layer.weight`` is the word
embedding, kept once).

Where each piece lives in the source:

- weights: ``model`` of the model file of each (tp, pp) rank, tensor-parallel shards along
  :func:`~zerotron.checkpoint.reshard.partition_dim`;
- stage 0: the model file's ``optimizer`` (``MixedPrecisionOptimizer.state_dict()``): torch's
  optimizer state numbered in the order of the weight-decay groups
  (:func:`~zerotron.optim.get_param_groups` over the rank's parameters), and the fp32 masters
  of 16-bit parameters per group (``fp32_from_fp16_params``);
- stages 1-3: one file per data-parallel rank whose ``layout`` says where each parameter's
  chunk lies in the flat fp32 sub-groups (masters and optimizer state alike, see
  :mod:`zerotron.checkpoint.zero_to_fp32`).

Source files are opened with ``torch.load(mmap=True, weights_only=True)``; only the slices a
tensor needs are touched, and the mappings are dropped again (:meth:`release`) once the tensors
read since the last release pass the size of the largest tensor (:data:`RELEASE_FLOOR` at
least), so the pages a conversion has touched stay bounded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zerotron.checkpoint import layout as names
from zerotron.checkpoint.reshard import (
    TIED_COPY,
    VOCAB_KEYS,
    WORD_EMBEDDING,
    orig_vocab_size_of,
    partition_dim,
    stage_layer_indices,
    target_padded_vocab_size,
)
from zerotron.checkpoint.save_load import read_metadata, resolve_tag
from zerotron.checkpoint.zero_to_fp32 import (
    BUFFER_NAMES_KEY,
    SHARED_PARAMS_KEY,
    _load,
    _partition_sizes,
    plan_parameters,
    zero_files_by_mp_rank,
)
from zerotron.errors import CheckpointError, ConfigError
from zerotron.optim import get_param_groups

# zerotron's ZeRO sub-group sizes when none is configured (zerotron.zero.options.default_sizes;
# the checkpoint layer sits below zero, tests/test_convert_layouts.py keeps them equal).
DEFAULT_SUB_GROUP_SIZE = {1: int(1e9), 2: int(1e9), 3: int(2e6)}
LOW_PRECISION = (torch.float16, torch.bfloat16)
RELEASE_FLOOR = 64 << 20
"""Source mappings are dropped once the tensors read since the last drop pass the largest
tensor's bytes or this, whichever is larger (re-opening a file for every small tensor costs
more than the pages it frees)."""

# Model-file entries that are not client state (the Engine writes them itself).
ENGINE_ENTRIES = frozenset(
    {
        "model",
        "optimizer",
        "opt_param_scheduler",
        "rng_state",
        "checkpoint_version",
        "global_steps",
        "global_samples",
        SHARED_PARAMS_KEY,
        BUFFER_NAMES_KEY,
        names.ZERO_STAGE_KEY,
        names.DP_SIZE_KEY,
    }
)
# Client entries that describe one run's flags and ranks: not carried to another layout.
NOT_CARRIED = ("args",)
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class Layout:
    """How a checkpoint is cut: parallel sizes, ZeRO stage, sub-group size, vocabulary rows.

    ``sub_group_size`` None: zerotron's default for the stage; ``padded_vocab_size`` None: the
    vocabulary padded to 128 × tp (Megatron's rule; :meth:`with_defaults` fills both).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_stages: int = 1
    data_parallel: int = 1
    zero_stage: int = 0
    sub_group_size: int | None = None
    padded_vocab_size: int | None = None

    def __post_init__(self) -> None:
        for key in ("tensor_parallel", "pipeline_parallel", "virtual_stages", "data_parallel"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{key.replace('_', ' ')} size must be a positive integer, got {value!r}",
                    where=f"--target-{key.replace('_', '-')}-size",
                )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(
                f"ZeRO stage {self.zero_stage!r} is not 0, 1, 2 or 3", where="--target-zero-stage"
            )
        if self.zero_stage >= 2 and self.pipeline_parallel > 1:
            raise ConfigError(
                f"ZeRO stage {self.zero_stage} with pipeline parallelism (as in DeepSpeed)",
                where="--target-zero-stage",
                fix="use ZeRO stage 0 or 1 with pipeline parallelism",
            )
        if self.virtual_stages > 1 and self.pipeline_parallel == 1:
            raise ConfigError(
                "virtual pipeline stages need a pipeline-parallel size > 1",
                where="--target-virtual-pipeline-parallel-size",
            )

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Layout:
        """The layout a checkpoint's metadata.json records (virtual stages if recorded)."""
        lay = meta.get("layout") or {}
        return cls(
            tensor_parallel=int(lay.get("tensor_model_parallel_size", 1)),
            pipeline_parallel=int(lay.get("pipeline_model_parallel_size", 1)),
            virtual_stages=int(lay.get("virtual_pipeline_model_parallel_size") or 1),
            data_parallel=int(lay.get("data_parallel_size", 1)),
            zero_stage=int(lay.get("zero_stage", 0)),
            padded_vocab_size=(meta.get("vocab") or {}).get("padded_size"),
        )

    @property
    def sub_group(self) -> int:
        """ZeRO sub-group size in elements (the default for the stage when None)."""
        return self.sub_group_size or DEFAULT_SUB_GROUP_SIZE.get(self.zero_stage, int(1e9))

    def with_defaults(
        self, meta: Mapping[str, Any], make_vocab_size_divisible_by: int = 128
    ) -> Layout:
        """This layout with ``padded_vocab_size`` (from ``meta``'s vocabulary) and
        ``sub_group_size`` filled in."""
        rows = self.padded_vocab_size or target_padded_vocab_size(
            meta, self.tensor_parallel, make_vocab_size_divisible_by
        )
        return replace(self, padded_vocab_size=rows, sub_group_size=self.sub_group)

    def mp_ranks(self) -> list[tuple[int, int]]:
        """Every (tp_rank, pp_rank), pipeline stage major (the order of the model files)."""
        return [(t, p) for p in range(self.pipeline_parallel) for t in range(self.tensor_parallel)]

    def describe(self) -> str:
        """``tp2 pp2 (2 virtual) dp1 ZeRO-1``."""
        v = f" ({self.virtual_stages} virtual)" if self.virtual_stages > 1 else ""
        return (
            f"tp{self.tensor_parallel} pp{self.pipeline_parallel}{v} dp{self.data_parallel} "
            f"ZeRO-{self.zero_stage}"
        )


@dataclass
class ParamRecord:
    """Every full tensor of one parameter (the source's vocabulary padding)."""

    name: str
    weight: Tensor
    master: Tensor | None = None
    state: dict[str, Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


def layer_index(key: str) -> int | None:
    """The global layer index of a ``layers.N.`` key (None for others)."""
    m = _LAYER.match(key)
    return int(m.group(1)) if m else None


def canonical_order(keys: list[str]) -> list[str]:
    """The single-process GPT's order: embedding, layers by index, then the rest."""

    def rank(item: tuple[int, str]) -> tuple[int, int, int]:
        pos, key = item
        layer = layer_index(key)
        if key.startswith("embedding."):
            return (0, 0, pos)
        if layer is not None:
            return (1, layer, pos)
        return (2, 0, pos)

    return [k for _, k in sorted(enumerate(keys), key=rank)]


def module_order(keys: list[str], pp_size: int) -> list[str]:
    """Parameter order of a rank's module: the GPT's (pp 1), or the pipeline's StageModel's
    (``training/build.py``), which registers the embedding, the final LayerNorm and the tied
    copy before its layers."""
    if pp_size == 1:
        return list(keys)
    first = [k for k in keys if k.startswith("embedding.")]
    layers = [k for k in keys if layer_index(k) is not None]
    rest = [k for k in keys if k not in set(first) | set(layers)]
    return first + rest + layers


def no_decay_names(shapes: Mapping[str, torch.Size]) -> tuple[list[str], list[str]]:
    """(decayed, not decayed) names in the weight-decay groups' rule
    (:func:`zerotron.optim.get_param_groups`, asked with shape-only parameters)."""
    params = {
        n: torch.nn.Parameter(torch.empty(s, device="meta"), requires_grad=True)
        for n, s in shapes.items()
    }
    by_id = {id(p): n for n, p in params.items()}
    groups = get_param_groups(list(params.items()), 1.0)
    decay = [by_id[id(p)] for g in groups if g["wd_mult"] for p in g["params"]]
    other = [by_id[id(p)] for g in groups if not g["wd_mult"] for p in g["params"]]
    return decay, other


class CanonicalCheckpoint:
    """A checkpoint of any layout, read lazily as full per-parameter tensors (module docstring).

    Open with :func:`open_checkpoint`; a context manager (``close`` drops the mappings).
    """

    def __init__(self, load_dir: str | os.PathLike, tag: str | None = None):
        self.root = Path(load_dir)
        self.tag = resolve_tag(self.root, tag)
        self.tag_dir = names.tag_dir(self.root, self.tag)
        self.where = str(self.tag_dir)
        self.meta = read_metadata(self.root, self.tag)
        lay = Layout.from_metadata(self.meta)
        tp, pp = lay.tensor_parallel, lay.pipeline_parallel
        self._files: dict[str, Any] = {}
        self._touched = 0
        self._shards: dict[tuple[int, int], dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self.owner: dict[str, int] = {}
        """Pipeline rank holding each canonical name."""
        buffers: set[str] = set()
        for t, p in lay.mp_ranks():
            f = self._model_file(t, p)
            model = f.get("model")
            if not isinstance(model, Mapping):
                raise CheckpointError("no 'model' entry", where=self._where(self._mrel(t, p)))
            self._shards[(t, p)] = {k: (v.shape, v.dtype) for k, v in model.items()}
            buffers |= set(f.get(BUFFER_NAMES_KEY) or ())
            if t == 0:
                for key in model:
                    if key == TIED_COPY and pp > 1:
                        continue
                    if key in self.owner:
                        raise CheckpointError(
                            f"{key} is held by pipeline stages {self.owner[key]} and {p}",
                            where=self.where,
                            fix="the checkpoint mixes saves of different layouts",
                        )
                    self.owner[key] = p
            elif set(model) != set(self._shards[(0, p)]):
                diff = sorted(set(model) ^ set(self._shards[(0, p)]))
                raise CheckpointError(
                    f"tensor-parallel ranks 0 and {t} of pipeline stage {p} hold different "
                    f"tensors: {diff[:5]}",
                    where=self.where,
                    fix="the checkpoint is incomplete or mixes saves; re-save it",
                )
        self.names: list[str] = canonical_order(list(self.owner))
        """Every model tensor, single-process GPT names and order."""
        self.buffers = buffers
        self.shapes: dict[str, torch.Size] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for name in self.names:
            shape, dtype = self._shards[(0, self.owner[name])][name]
            dim = partition_dim(name)
            if dim is not None and tp > 1:
                shape = torch.Size([*shape[:dim], shape[dim] * tp, *shape[dim + 1 :]])
            self.shapes[name], self.dtypes[name] = torch.Size(shape), dtype
        self.num_layers = len({i for i in map(layer_index, self.names) if i is not None})
        self.layout = replace(
            lay,
            virtual_stages=self._virtual_stages(lay),
            zero_stage=self._zero_stage(lay),
            padded_vocab_size=self.shapes[WORD_EMBEDDING][0]
            if WORD_EMBEDDING in self.shapes
            else lay.padded_vocab_size,
        )
        self.orig_vocab_size = orig_vocab_size_of(self.meta)
        self.largest_bytes = max(
            (self.shapes[n].numel() * 4 for n in self.names), default=0
        )  # fp32: masters and moments are the largest copies of any parameter
        self.trained: list[str] = []
        """The names with optimizer state (empty: the checkpoint has none)."""
        self.state_keys: tuple[str, ...] = ()
        """Elementwise optimizer-state keys (``exp_avg``, ``exp_avg_sq``), in saved order."""
        self.entry_order: tuple[str, ...] = ()
        """Every per-parameter optimizer-state key (``step`` too) in saved order."""
        self._settings: dict[bool, dict[str, Any]] = {}
        self._stage0: dict[tuple[int, int], dict[str, tuple[int, int, int | None]]] = {}
        self._plans: dict[tuple[int, int], dict[str, Any]] = {}
        self._zero_rels: dict[tuple[int, int], list[str]] = {}
        if self.layout.zero_stage:
            self._index_zero()
        else:
            self._index_stage0()

    # ---- files ---------------------------------------------------------------------------

    def _mrel(self, t: int, p: int) -> str:
        return names.model_file(t, p, self.layout_pp)

    @property
    def layout_pp(self) -> int:
        return int((self.meta.get("layout") or {}).get("pipeline_model_parallel_size", 1))

    def _where(self, rel: str) -> str:
        return f"{self.where}/{rel}"

    def _file(self, rel: str) -> Any:
        if rel not in self._files:
            self._files[rel] = _load(self.tag_dir, rel)
        return self._files[rel]

    def _model_file(self, t: int, p: int) -> Mapping[str, Any]:
        f = self._file(self._mrel(t, p))
        if not isinstance(f, Mapping):
            raise CheckpointError("not a model file", where=self._where(self._mrel(t, p)))
        return f

    def release(self) -> None:
        """Drop every memory-mapped source file (their touched pages go with them)."""
        self._files.clear()
        self._touched = 0

    def close(self) -> None:
        self.release()

    def __enter__(self) -> CanonicalCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- layout detection ----------------------------------------------------------------

    def _virtual_stages(self, lay: Layout) -> int:
        pp = lay.pipeline_parallel
        held = {
            p: {layer_index(k) for k in self._shards[(0, p)] if layer_index(k) is not None}
            for p in range(pp)
        }
        n = self.num_layers
        for v in range(1, max(1, n // max(pp, 1)) + 1):
            if pp * v > n or n % (pp * v):
                continue
            if all(held[p] == set(stage_layer_indices(n, p, pp, v)) for p in range(pp)):
                return v
        if pp == 1:
            return 1
        raise CheckpointError(
            f"the pipeline stages hold layers {[sorted(held[p]) for p in range(pp)]}, which no "
            "uniform partition (with or without virtual stages) gives",
            where=self.where,
            fix="the checkpoint was cut by another partition method; reshard it with the tool "
            "that wrote it",
        )

    def _zero_stage(self, lay: Layout) -> int:
        first = self._model_file(0, 0)
        return int(first.get(names.ZERO_STAGE_KEY, lay.zero_stage) or 0)

    def _rank_params(self, t: int, p: int) -> list[str]:
        """The trained parameters of source rank (t, p) in its module's order."""
        keys = [k for k in self._shards[(t, p)] if k not in self.buffers]
        return module_order(keys, self.layout.pipeline_parallel)

    def _classify_settings(
        self, group: Mapping[str, Any], members: list[str], nd: set[str]
    ) -> None:
        if not members:
            return
        kind = members[0] in nd
        if any((m in nd) != kind for m in members):
            raise CheckpointError(
                "an optimizer parameter group mixes decayed and not decayed parameters",
                where=self.where,
                fix="only zerotron's weight-decay grouping (optim.get_param_groups) converts",
            )
        self._settings.setdefault(kind, {k: v for k, v in group.items() if k != "params"})

    def _index_stage0(self) -> None:
        for t, p in self.layout.mp_ranks():
            opt = self._model_file(t, p).get("optimizer")
            if not isinstance(opt, Mapping) or "optimizer" not in opt:
                if (t, p) != (0, 0) and self.trained:
                    raise CheckpointError("no optimizer state", where=self._where(self._mrel(t, p)))
                return
            order = self._rank_params(t, p)
            shapes = {k: self._shards[(t, p)][k][0] for k in order}
            decay, no_decay = no_decay_names(shapes)
            groups = [g for g in (decay, no_decay) if g]
            saved = opt["optimizer"].get("param_groups", [])
            if [len(g.get("params", ())) for g in saved] != [len(g) for g in groups]:
                raise CheckpointError(
                    f"the optimizer's parameter groups hold {[len(g['params']) for g in saved]} "
                    f"parameters; the weight-decay groups of this rank's "
                    f"{len(order)} parameters have {[len(g) for g in groups]}",
                    where=self._where(self._mrel(t, p)),
                    fix="only checkpoints of zerotron's weight-decay grouping convert",
                )
            nd = set(no_decay)
            index: dict[str, tuple[int, int, int | None]] = {}
            for g, (group, members) in enumerate(zip(saved, groups)):
                self._classify_settings(group, members, nd)
                low = 0
                for idx, name in zip(group["params"], members):
                    is16 = self._shards[(t, p)][name][1] in LOW_PRECISION
                    index[name] = (int(idx), g, low if is16 else None)
                    low += is16
            self._stage0[(t, p)] = index
            state = opt["optimizer"].get("state", {})
            if (t, p) == (0, 0) and state:
                first_idx = next(iter(state))
                entry = state[first_idx]
                first_name = next(n for n, v in index.items() if v[0] == int(first_idx))
                shard = self._shards[(t, p)][first_name][0]
                self.entry_order = tuple(entry)
                self.state_keys = tuple(
                    k
                    for k, v in entry.items()
                    if isinstance(v, Tensor) and v.dim() >= 1 and v.shape == shard
                )
        self.trained = [n for n in self.names if n not in self.buffers]

    def _index_zero(self) -> None:
        by_rank = zero_files_by_mp_rank(self.tag_dir)
        for t, p in self.layout.mp_ranks():
            rels = by_rank.get((t, p))
            if not rels:
                raise CheckpointError(
                    f"no ZeRO files for model-parallel rank tp={t} pp={p}",
                    where=self.where,
                    fix="copy the complete checkpoint directory",
                )
            self._zero_rels[(t, p)] = rels
            states = [self._file(r) for r in rels]
            sizes = [_partition_sizes(s, self._where(r)) for s, r in zip(states, rels)]
            plans = {pl.name: pl for pl in plan_parameters(states, self.where, sizes)}
            self._plans[(t, p)] = plans
            order = self._rank_params(t, p)
            if set(plans) != set(order):
                raise CheckpointError(
                    f"the ZeRO files of rank tp={t} pp={p} hold other parameters than its model "
                    f"file: {sorted(set(plans) ^ set(order))[:5]}",
                    where=self.where,
                    fix="the directory mixes files of different saves",
                )
            _, no_decay = no_decay_names({k: self._shards[(t, p)][k][0] for k in order})
            nd = set(no_decay)
            members: dict[int, list[str]] = {}
            for e in states[0]["layout"]:
                members.setdefault(int(e["partition"]), []).append(e["name"])
            groups = states[0]["optimizer"].get("param_groups", [])
            for s, group in enumerate(groups):
                self._classify_settings(group, members.get(s, []), nd)
            state = states[0]["optimizer"].get("state", {})
            if (t, p) == (0, 0) and state:
                entry = state[next(iter(state))]
                self.entry_order = tuple(entry)
                self.state_keys = tuple(
                    k
                    for k, v in entry.items()
                    if k != "step" and isinstance(v, Tensor) and v.dim() >= 1
                )
        self.trained = [n for n in self.names if n not in self.buffers]

    # ---- reading -------------------------------------------------------------------------

    @property
    def has_optimizer(self) -> bool:
        """Whether the checkpoint holds optimizer state (masters at least)."""
        return bool(self.trained)

    def group_settings(self, no_decay: bool) -> dict[str, Any]:
        """The torch param-group hyper-parameters (lr, betas, weight_decay...) of the decayed
        or the not-decayed group, as saved."""
        if no_decay not in self._settings:
            other = self._settings.get(not no_decay)
            if other is None:
                raise CheckpointError("the checkpoint holds no optimizer groups", where=self.where)
            wd = {"weight_decay": 0.0, "wd_mult": 0.0} if no_decay else {}
            return {**other, **{k: v for k, v in wd.items() if k in other}}
        return dict(self._settings[no_decay])

    def tensor(self, name: str, kind: str = "weight") -> Tensor:
        """The full tensor of ``name``: ``kind`` "weight" (params dtype), "master" (fp32) or an
        optimizer-state key (fp32). A fresh tensor, not a view into the source."""
        if name not in self.owner:
            raise CheckpointError(f"no tensor {name!r} in the checkpoint", where=self.where)
        p = self.owner[name]
        tp = self.layout.tensor_parallel
        dim = partition_dim(name) if tp > 1 else None
        dtype = self.dtypes[name] if kind == "weight" else torch.float32
        out = torch.empty(self.shapes[name], dtype=dtype)
        parts = out.chunk(tp, dim=dim) if dim is not None else (out,)
        for t, view in enumerate(parts):
            view.copy_(self._shard(name, kind, t, p, view.shape))
        self._touched += out.numel() * out.element_size()
        if self._touched >= max(self.largest_bytes, RELEASE_FLOOR):
            self.release()
        return out

    def record(self, name: str) -> ParamRecord:
        """Every kind of ``name``'s tensors at once."""
        rec = ParamRecord(name, self.tensor(name))
        if name in self.trained:
            rec.master = self.tensor(name, "master")
            rec.state = {k: self.tensor(name, k) for k in self.state_keys}
            rec.scalars = self.scalars(name)
        return rec

    def records(self) -> Iterator[ParamRecord]:
        for name in self.names:
            yield self.record(name)

    def scalars(self, name: str) -> dict[str, Any]:
        """The non-elementwise optimizer state of ``name`` (Adam's ``step``), copied."""
        entry = self._state_entry(name)
        return {
            k: (v.clone() if isinstance(v, Tensor) else v)
            for k, v in entry.items()
            if k not in self.state_keys
        }

    def step(self, name: str) -> Any:
        """Adam's step count of ``name`` (None if it never stepped)."""
        return self.scalars(name).get("step")

    def _state_entry(self, name: str) -> Mapping[str, Any]:
        p = self.owner[name]
        if self.layout.zero_stage:
            plan = self._plans[(0, p)][name]
            piece = plan.pieces[0]
            st = self._file(self._zero_rels[(0, p)][piece.rank])
            return st["optimizer"].get("state", {}).get(piece.partition, {})
        idx, _, _ = self._stage0[(0, p)][name]
        opt = self._model_file(0, p)["optimizer"]["optimizer"]
        return opt.get("state", {}).get(idx, {})

    def _shard(self, name: str, kind: str, t: int, p: int, shape: torch.Size) -> Tensor:
        if kind == "weight":
            return self._model_file(t, p)["model"][name]
        if name not in self.trained:
            raise CheckpointError(f"{name!r} has no optimizer state", where=self.where)
        if self.layout.zero_stage:
            return self._zero_shard(name, kind, t, p, shape)
        idx, g, low = self._stage0[(t, p)][name]
        opt = self._model_file(t, p)["optimizer"]
        if kind == "master":
            if low is None:  # an fp32 parameter is its own master
                return self._model_file(t, p)["model"][name].float()
            return opt["fp32_from_fp16_params"][g][low]
        entry = opt["optimizer"].get("state", {}).get(idx)
        if entry is None or kind not in entry:
            raise CheckpointError(
                f"no optimizer state {kind!r} for {name}", where=self._where(self._mrel(t, p))
            )
        return entry[kind]

    def _zero_shard(self, name: str, kind: str, t: int, p: int, shape: torch.Size) -> Tensor:
        plan = self._plans[(t, p)][name]
        out = torch.empty(plan.numel, dtype=torch.float32)
        for piece in plan.pieces:
            st = self._file(self._zero_rels[(t, p)][piece.rank])
            if kind == "master":
                flat = st["fp32_partitions"][piece.partition]
            else:
                flat = st["optimizer"]["state"][piece.partition][kind]
            out[piece.start : piece.start + piece.length] = flat[
                piece.offset : piece.offset + piece.length
            ]
        return out.view(shape)

    # ---- shared state --------------------------------------------------------------------

    def client_state(self) -> dict[str, Any]:
        """The first rank's client entries (iteration, consumed samples...), in saved order,
        without the old run's flags (:data:`NOT_CARRIED`)."""
        first = self._model_file(0, 0)
        return {k: v for k, v in first.items() if k not in ENGINE_ENTRIES and k not in NOT_CARRIED}

    def engine_entry(self, key: str, default: Any = None) -> Any:
        """An entry every rank's model file shares (``global_steps``, ``opt_param_scheduler``,
        ``checkpoint_version``...), from the first rank's."""
        return self._model_file(0, 0).get(key, default)

    def optimizer_extras(self) -> dict[str, Any]:
        """``grad_scaler`` and ``num_skipped_steps`` (the same on every rank)."""
        if self.layout.zero_stage:
            src = self._file(self._zero_rels[(0, 0)][0])
        else:
            src = self._model_file(0, 0).get("optimizer") or {}
        return {
            "grad_scaler": src.get("grad_scaler"),
            "num_skipped_steps": src.get("num_skipped_steps", 0),
        }

    def rng_state(self, tp_rank: int, pp_rank: int) -> Any:
        """Rank (tp_rank, pp_rank)'s saved RNG streams, if the source has that rank."""
        lay = self.layout
        if tp_rank >= lay.tensor_parallel or pp_rank >= lay.pipeline_parallel:
            return None
        return self._model_file(tp_rank, pp_rank).get("rng_state")

    def is_vocab(self, name: str) -> bool:
        return name in VOCAB_KEYS


def open_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> CanonicalCheckpoint:
    """The checkpoint ``load_dir`` (tag ``tag``, default the trackers') as canonical records."""
    return CanonicalCheckpoint(load_dir, tag)
