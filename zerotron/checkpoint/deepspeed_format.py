"""DeepSpeed's own checkpoint files: read the ones DeepSpeed writes, and make zerotron's ZeRO
saves readable by DeepSpeed's ``zero_to_fp32``.

A DeepSpeed checkpoint (``engine.save_checkpoint(dir)``, one model-parallel rank)::

    <dir>/latest                                         the tag, e.g. "global_step3"
    <dir>/<tag>/mp_rank_00_model_states.pt               stages 0-2: weights (16-bit), scheduler,
                                                         counters, param_shapes, buffer_names
    <dir>/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3, one per rank: buffers only
    <dir>/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   ZeRO 1-3, one per rank

Stages 1-2 cut each parameter group's flat fp32 vector (the parameters one after another, in
``param_shapes`` order) into equal contiguous slices, one per rank (the last one padded);
stage 3 cuts each parameter on its own into ``ceil(n / N)``-element chunks and rank R's flat
group is its chunks one after another. The optimizer's elementwise state (Adam's ``exp_avg``,
``exp_avg_sq``) has the shape of the rank's flat partition. :func:`read_deepspeed_checkpoint`
puts every parameter's fp32 master and moments back together from all ranks' files, so a
zerotron engine of any ZeRO stage and data-parallel size can take them
(:func:`zero_state_from_full` cuts them again for one zerotron rank).

Loading is safe: ``torch.load(weights_only=True)`` with :data:`SAFE_GLOBALS`, the few non-tensor
types DeepSpeed pickles into these files, each unpickled as a local stand-in (DeepSpeed is never
imported); any other type is refused with a :class:`~zerotron.errors.CheckpointError` naming the
file and the type.

DeepSpeed's universal checkpoints (``ds_to_universal.py``'s output) are read by
:mod:`zerotron.checkpoint.deepspeed_universal` into the same :class:`DeepSpeedCheckpoint`. The
other direction (zerotron's saves for DeepSpeed's ``zero_to_fp32``) is
:mod:`zerotron.checkpoint.deepspeed_view`. :func:`deepspeed_fp32_state_dict` is DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint`` on a DeepSpeed checkpoint.
"""

from __future__ import annotations

import argparse
import enum
import math
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zerotron.errors import CheckpointError

MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")

# DeepSpeed's key names (deepspeed/checkpoint/constants.py)
OSD = "optimizer_state_dict"
FP32_GROUPS_12 = "single_partition_of_fp32_groups"
FP32_GROUPS_3 = "fp32_flat_groups"
BASE_STATE_12 = "base_optimizer_state"
PARTITION_COUNT = "partition_count"
# Entries of DeepSpeed's model-states file that are not the caller's client state.
DS_MODEL_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
    }
)


# ---- safe loading ---------------------------------------------------------------------------


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an int)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Attrs:
    """A stand-in unpickled as a plain bag of attributes (pickle's BUILD sets ``__dict__``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


class LossScaler(_Attrs):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (``cur_scale``, ...)."""


class DynamicLossScaler(_Attrs):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


class FragmentAddress(_Attrs):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (numel, start)."""


SAFE_GLOBALS: list[Any] = [
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    argparse.Namespace,  # DeepSpeed saves the script's ``args`` when initialize() had them
]
"""The non-tensor types DeepSpeed's checkpoint files hold, as ``(stand-in, DeepSpeed's name)``
(found by loading real DeepSpeed 0.19 checkpoints with ``weights_only=True``)."""

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_deepspeed_file(path: str | Path) -> Any:
    """``torch.load`` one DeepSpeed file (CPU, ``weights_only=True``, :data:`SAFE_GLOBALS`)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            # memory-mapped: slices are read when touched, as zerotron's own loads do
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = found.group(1) if found else "an object"
        raise CheckpointError(
            f"the file holds {what}, which is not on the allow-list of types a DeepSpeed "
            "checkpoint may hold; it was not loaded (unpickling it could run code)",
            where=str(path),
            fix="load only checkpoints you trust; if this type is a plain data class of a "
            "newer DeepSpeed, report it so it can join the allow-list "
            "(zerotron.checkpoint.deepspeed_format.SAFE_GLOBALS)",
        ) from e
    except FileNotFoundError as e:
        raise CheckpointError("file missing", where=str(path)) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(
            f"cannot read the file ({e})", where=str(path), fix="copy the checkpoint again"
        ) from e


# ---- finding a DeepSpeed checkpoint ---------------------------------------------------------


def is_deepspeed_tag(tag_dir: str | Path) -> bool:
    """Whether ``tag_dir`` holds a checkpoint DeepSpeed wrote (its model-states file, and not
    zerotron's ``mp_rank_00/model_optim_rng.pt``)."""
    tag_dir = Path(tag_dir)
    if (tag_dir / "mp_rank_00").is_dir() or (tag_dir / "mp_rank_00_000").is_dir():
        return False
    return (tag_dir / MODEL_STATES).is_file() or (
        tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ).is_file()


def deepspeed_tag(load_dir: str | Path, tag: str | None) -> str | None:
    """``tag``, or the one DeepSpeed's ``latest`` file names; None when there is no tracker."""
    if tag is not None:
        return tag
    latest = Path(load_dir) / "latest"
    if not latest.is_file():
        return None
    return latest.read_text().strip() or None


# ---- reading ---------------------------------------------------------------------------------


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint put back together: whole tensors per parameter name."""

    tag_dir: Path
    zero_stage: int
    dp_size: int
    module: dict[str, Tensor]
    """The module's state dict: weights as saved (stages 0-2; 16-bit under bf16/fp16), or
    from the fp32 masters at stage 3 (DeepSpeed saves empty weights there), and buffers."""
    model_states: dict[str, Any]
    """The (rank 0) model-states file without ``module``: scheduler, counters, client state."""
    masters: dict[str, Tensor] = field(default_factory=dict)
    """Parameter name -> fp32 master (ZeRO checkpoints)."""
    moments: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    """Optimizer state key (``exp_avg``, ...) -> parameter name -> whole tensor."""
    scalars: dict[str, Any] = field(default_factory=dict)
    """Optimizer state that is one value for all elements (Adam's ``step``)."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The torch optimizer's groups as saved (hyperparameters; ``params`` indices)."""
    loss_scaler: dict[str, Any] | None = None
    """fp16 checkpoints: the loss scaler's attributes (``cur_scale``, ``cur_iter``,
    ``last_overflow_iter``, ``cur_hysteresis``, ``dynamic``, ...); None otherwise."""

    @property
    def client_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_states.items() if k not in DS_MODEL_KEYS}


def read_deepspeed_checkpoint(
    tag_dir: str | Path, *, optimizer: bool = True
) -> DeepSpeedCheckpoint:
    """Read the DeepSpeed checkpoint in ``tag_dir`` (one model-parallel rank, ZeRO 0-3);
    with ``optimizer`` also every rank's optimizer file (ZeRO stages 1-3)."""
    tag_dir = Path(tag_dir)
    model = read_model_states(tag_dir)
    module = dict(model["module"])
    states = {k: v for k, v in model.items() if k != "module"}
    optim_files = _optim_files(tag_dir)
    if not optim_files:
        return DeepSpeedCheckpoint(tag_dir, 0, int(model.get("dp_world_size", 1)), module, states)
    first = load_deepspeed_file(tag_dir / optim_files[0])
    osd = require_entries(first, (OSD,), tag_dir / optim_files[0])[OSD]
    stage = int(osd.get("zero_stage", 0))
    count = osd.get(PARTITION_COUNT)
    dp = int(max(count) if isinstance(count, (list, tuple)) else count)
    if dp != len(optim_files):
        raise CheckpointError(
            f"the optimizer files say {dp} data-parallel ranks, {len(optim_files)} are present",
            where=str(tag_dir),
            fix="copy the complete checkpoint directory (every rank wrote one file)",
        )
    ckpt = DeepSpeedCheckpoint(tag_dir, stage, dp, module, states)
    shapes = [{n: tuple(s) for n, s in g.items()} for g in model["param_shapes"]]
    if not optimizer and stage < 3:
        return ckpt
    # stage 3 keeps no weights in its model files: they come from the masters, so the
    # optimizer files are read even for the weights alone
    osds = [osd] + [load_deepspeed_file(tag_dir / f)[OSD] for f in optim_files[1:]]
    consolidate(ckpt, osds, shapes, stage)
    ckpt.loss_scaler = fp16_loss_scaler(module, osd.get("loss_scaler"))
    if stage == 3:
        weights_from_masters(module, ckpt.masters)  # as DeepSpeed restores stage-3 weights
        merge_frozen_stage3(tag_dir, model, module, dp)
    return ckpt


def read_model_states(tag_dir: Path) -> dict[str, Any]:
    """The (rank 0) model-states file of the DeepSpeed checkpoint in ``tag_dir``, checked to
    be of one model-parallel rank with its module's state dict."""
    path = tag_dir / MODEL_STATES
    if not path.is_file():
        path = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model = require_entries(load_deepspeed_file(path), ("module", "param_shapes"), path)
    if int(model.get("mp_world_size", 1) or 1) != 1:
        raise CheckpointError(
            f"the checkpoint was saved with model parallel size {model['mp_world_size']}",
            where=str(tag_dir),
            fix="only DeepSpeed checkpoints of one model-parallel rank (mp_rank_00) load",
        )
    if not isinstance(model["module"], Mapping):
        raise CheckpointError(
            "the model-states file holds no module state dict (DeepSpeed's pipeline "
            "checkpoints keep the weights in layer_XX-model_states.pt files)",
            where=str(path),
            fix="only DeepSpeed checkpoints without pipeline parallelism load",
        )
    return model


def weights_from_masters(module: dict[str, Tensor], masters: Mapping[str, Tensor]) -> None:
    """Set ``module``'s weights to the fp32 ``masters``, each in the dtype ``module`` saved it
    in (what DeepSpeed does when it restores weights from its masters)."""
    for name, master in masters.items():
        module[name] = master.to(module[name].dtype if name in module else master.dtype)


def fp16_loss_scaler(module: Mapping[str, Tensor], scaler: Any) -> dict[str, Any] | None:
    """The loss scaler's attributes when DeepSpeed trained in fp16 (fp16 weights), else None."""
    if any(t.dtype == torch.float16 for t in module.values()) and hasattr(scaler, "__dict__"):
        return dict(vars(scaler))
    return None


def merge_frozen_stage3(
    tag_dir: Path, model: Mapping[str, Any], module: dict[str, Tensor], dp: int
) -> None:
    """Stage 3 keeps frozen parameters as ``ceil(n / dp)``-element fragments, one in each
    rank's model-states file: put them together into ``module``."""
    frozen = model.get("frozen_param_shapes") or {}
    if not frozen:
        return
    fragments = [model.get("frozen_param_fragments") or {}]
    for r in range(1, dp):
        name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        fragments.append(load_deepspeed_file(tag_dir / name).get("frozen_param_fragments") or {})
    for name, shape in frozen.items():
        missing = [r for r, f in enumerate(fragments) if name not in f]
        if missing:
            raise CheckpointError(
                f"frozen parameter {name!r} has no fragment in the model-states files of "
                f"ranks {missing}",
                where=str(tag_dir),
                fix="copy the complete checkpoint directory (every rank wrote one file)",
            )
        flat = torch.cat([f[name].reshape(-1) for f in fragments])[: math.prod(shape)]
        module[name] = flat.view(tuple(shape)).clone()


def _optim_files(tag_dir: Path) -> list[str]:
    found = {}
    for f in tag_dir.iterdir():
        m = OPTIM_FILE.fullmatch(f.name)
        if m:
            found[int(m.group(2))] = f.name
    return [found[r] for r in sorted(found)]


def require_entries(obj: Any, keys: Sequence[str], where: Path) -> dict[str, Any]:
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"not a DeepSpeed checkpoint file: expected entries {list(keys)}, found {have}",
            where=str(where),
        )
    return obj


def consolidate(
    ckpt: DeepSpeedCheckpoint,
    osds: list[dict[str, Any]],
    shapes: list[dict[str, tuple[int, ...]]],
    stage: int,
) -> None:
    """Fill ``ckpt.masters``/``moments``/``scalars``/``param_groups`` from every rank's
    optimizer state (``osds[r]``)."""
    where = str(ckpt.tag_dir)
    if stage == 3:
        masters = [osd[FP32_GROUPS_3] for osd in osds]
        base = [osd[OSD] for osd in osds]
    else:
        masters = [osd[FP32_GROUPS_12] for osd in osds]
        base = [osd[BASE_STATE_12] for osd in osds]
    n_groups = len(masters[0])
    # DeepSpeed's elastic form (zero_optimization.elastic_checkpoint) keeps a list of the
    # groups' states and no param groups; its rigid form, torch's optimizer state_dict
    states = [dict(enumerate(b)) if isinstance(b, list) else b["state"] for b in base]
    groups = [] if isinstance(base[0], list) else base[0]["param_groups"]
    ckpt.param_groups = [{k: v for k, v in g.items()} for g in groups]
    if "base_optimizer_state_step" in osds[0]:  # the elastic form's copy of a group-held step
        ckpt.scalars["base_optimizer_state_step"] = osds[0]["base_optimizer_state_step"]
    # per rank and group: {key: flat tensor} of the elementwise state, scalars aside
    elementwise: list[list[dict[str, Tensor]]] = []
    for state in states:
        per_group = []
        for i in range(n_groups):
            entry = state.get(i, {})
            flat = {}
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.dim() == 1 and key != "step":
                    flat[key] = value
                else:
                    ckpt.scalars.setdefault(key, value)
            per_group.append(flat)
        elementwise.append(per_group)
    keys = sorted({k for per in elementwise for g in per for k in g})
    if stage == 3:
        names = [(n, s) for g in shapes for n, s in g.items()]
        cat_m = [torch.cat([t.reshape(-1).float() for t in m]) for m in masters]
        cat_s = {
            k: [torch.cat([g[k].reshape(-1).float() for g in per]) for per in elementwise]
            for k in keys
        }
        offset = 0
        for name, shape in names:
            numel = math.prod(shape)
            chunk = math.ceil(numel / ckpt.dp_size)

            def whole(flats: list[Tensor], off: int = offset, n: int = numel, c: int = chunk):
                return torch.cat([f[off : off + c] for f in flats])[:n]

            if offset + chunk > cat_m[0].numel():
                raise CheckpointError(
                    f"the fp32 partitions end before parameter {name!r}",
                    where=where,
                    fix="the optimizer files do not belong to this model-states file",
                )
            ckpt.masters[name] = whole(cat_m).view(shape).clone()
            for k in keys:
                ckpt.moments.setdefault(k, {})[name] = whole(cat_s[k]).view(shape).clone()
            offset += chunk
        return
    if len(shapes) != n_groups:
        raise CheckpointError(
            f"{len(shapes)} parameter groups in param_shapes, {n_groups} in the optimizer files",
            where=where,
        )
    for i, group in enumerate(shapes):
        full_m = torch.cat([m[i].reshape(-1).float() for m in masters])
        full_s = {
            k: torch.cat([per[i][k].reshape(-1).float() for per in elementwise]) for k in keys
        }
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            if offset + numel > full_m.numel():
                raise CheckpointError(
                    f"parameter group {i}'s fp32 partitions hold {full_m.numel()} elements, "
                    f"fewer than its parameters need",
                    where=where,
                    fix="the optimizer files do not belong to this model-states file",
                )
            ckpt.masters[name] = full_m[offset : offset + numel].view(shape).clone()
            for k in keys:
                ckpt.moments.setdefault(k, {})[name] = (
                    full_s[k][offset : offset + numel].view(shape).clone()
                )
            offset += numel


# ---- into a zerotron ZeRO rank ----------------------------------------------------------------


def zero_state_from_full(
    target: Mapping[str, Any],
    masters: Mapping[str, Tensor],
    moments: Mapping[str, Mapping[str, Tensor]],
    scalars: Mapping[str, Any],
    lr: float | None,
    where: str,
) -> dict[str, Any]:
    """The ZeRO state (``ZeroOptimizer.load_state_dict``'s input) of the zerotron rank whose
    current state dict is ``target`` (it gives the layout), cut from whole tensors."""
    lay = target["layout"]
    missing = [e["name"] for e in lay if e["name"] not in masters]
    extra = sorted(set(masters) - {e["name"] for e in lay})
    if missing or extra:
        raise CheckpointError(
            f"the checkpoint's parameters differ from this model's (missing in the "
            f"checkpoint: {missing[:5]}; not in the model: {extra[:5]})",
            where=where,
            fix="build the model the DeepSpeed run trained (same modules and names)",
        )
    sizes = [t.numel() for t in target["fp32_partitions"]]

    def cut(full: Mapping[str, Tensor]) -> list[Tensor]:
        out = [torch.zeros(n, dtype=torch.float32) for n in sizes]
        for e in lay:
            value = full[e["name"]]
            if tuple(value.shape) != tuple(e["shape"]):
                raise CheckpointError(
                    f"parameter {e['name']!r} has shape {list(value.shape)} in the checkpoint, "
                    f"{list(e['shape'])} in the model",
                    where=where,
                )
            start, length, offset = int(e["start"]), int(e["length"]), int(e["offset"])
            flat = value.reshape(-1).float()
            out[int(e["partition"])][offset : offset + length] = flat[start : start + length]
        return out

    new_masters = cut(masters)
    cut_moments = {k: cut(v) for k, v in moments.items()}
    groups = target["optimizer"]["param_groups"]
    state = {}
    for g in groups:
        for idx in g["params"]:
            entry: dict[str, Any] = {
                k: (v.clone() if isinstance(v, Tensor) else v) for k, v in scalars.items()
            }
            for k, parts in cut_moments.items():
                entry[k] = parts[idx]
            if entry:
                state[idx] = entry
    new_groups = [{**g, **({"lr": lr} if lr is not None else {})} for g in groups]
    return {
        **{k: v for k, v in target.items() if k not in ("optimizer", "fp32_partitions")},
        "optimizer": {"state": state, "param_groups": new_groups},
        "fp32_partitions": new_masters,
    }


# ---- DeepSpeed's zero_to_fp32 on DeepSpeed's checkpoints --------------------------------------


def deepspeed_fp32_state_dict(
    checkpoint_dir: str | Path, tag: str | None, exclude_frozen_parameters: bool = False
) -> dict[str, Tensor] | None:
    """The fp32 state dict of a ZeRO checkpoint DeepSpeed saved, as DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint`` gives it (buffers, frozen parameters, the
    fp32 masters, then tied names); None when ``checkpoint_dir``'s tag is not DeepSpeed's."""
    tag = deepspeed_tag(checkpoint_dir, tag)
    if tag is None or not is_deepspeed_tag(Path(checkpoint_dir) / tag):
        return None
    tag_dir = Path(checkpoint_dir) / tag
    ckpt = read_deepspeed_checkpoint(tag_dir)
    if not ckpt.masters:
        raise CheckpointError(
            "the DeepSpeed checkpoint has no ZeRO optimizer files: it is not a ZeRO checkpoint",
            where=str(tag_dir),
            fix="its mp_rank_00_model_states.pt 'module' entry holds the whole weights",
        )
    names = ckpt.model_states.get("buffer_names") or []
    out = {n: ckpt.module[n].float() for n in names if n in ckpt.module}
    if not exclude_frozen_parameters:
        for name in ckpt.model_states.get("frozen_param_shapes") or {}:
            out[name] = ckpt.module[name]
    out.update(ckpt.masters)
    for alias, name in (ckpt.model_states.get("shared_params") or {}).items():
        if name in out:
            out[alias] = out[name]
    return out
