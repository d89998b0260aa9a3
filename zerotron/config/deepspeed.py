"""DeepSpeed's JSON config onto the one schema (:class:`~zerotron.config.schema.Config`).

    cfg, resolved = load_deepspeed_config("ds.json", world_size=4)
    cfg.zero.zero_stage, cfg.training.num_micro_batches, cfg.optimizer.lr

Every key DeepSpeed documents for what zerotron implements maps onto a schema field (the table
is :data:`~zerotron.config.deepspeed_table.SPEC`; docs/deepspeed.md lists it), with DeepSpeed's
meaning and defaults. This module is the walker that reads a config against that table:

- ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``
  -> ``global_batch_size`` / ``micro_batch_size`` / ``num_micro_batches``: any two give the
  third, with DP = world / (tp · pp); three that disagree are an error showing the arithmetic
  (:func:`~zerotron.config.derive.batch_geometry`, the same arithmetic as the schema's).
- ``fp16.initial_scale_power`` p -> ``initial_loss_scale`` 2**p; ``fp16.loss_scale`` 0 (dynamic)
  -> ``loss_scale`` None; ``gradient_clipping`` -> ``clip_grad``; ``steps_per_print`` ->
  ``log_interval``; ``optimizer.params`` -> ``lr``, ``adam_beta1/2``, ``adam_eps``, ...;
  ``scheduler`` -> ``lr_scheduler_type`` / ``lr_scheduler_params``; ``zero_optimization.X`` ->
  ``zero_stage`` and the fields of the ``zero`` section (``offload_optimizer.device`` ->
  ``offload_optimizer_device``); ``tensorboard.enabled`` -> ``tensorboard_enabled``, ...
- Where DeepSpeed's default differs from Megatron's (gradient clipping 0, steps_per_print 10,
  initial scale 2**16, Adam weight decay 0), a DeepSpeed config gets DeepSpeed's.

``"auto"`` (as Hugging Face writes these configs) is resolved from what the caller knows
(:class:`AutoValues`: the script's ``args``, a passed optimizer's learning rate, the model's
hidden size) and otherwise takes DeepSpeed's default; the resolved dict comes back for printing.

A value of the wrong type names its key path (``zero_optimization.offload_optimizer.device:
'gpu' is not one of none, cpu, nvme``); an unknown key inside a known section
(``zero_optimization.stag``) is an error with the closest known key, since the feature it was
meant to set would silently stay off (``unknown_keys="warn"``, ``zerotron pretrain
--deepspeed-unknown-keys warn`` or ``ZEROTRON_DEEPSPEED_UNKNOWN_KEYS=warn`` make it a warning);
an unknown top-level key is a warning (``Config.warnings``) with the closest known key; a
DeepSpeed feature zerotron does not implement (OneBitAdam, curriculum learning, compression,
...) raises :class:`~zerotron.errors.UnsupportedError` saying so.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zerotron.config.deepspeed_auto import (
    AutoValues,
    auto_leaf,
    auto_optimizer_param,
    auto_scheduler_param,
)
from zerotron.config.deepspeed_table import (
    AUTO,
    BATCH_FIELDS,
    OPTIMIZER_PARAMS,
    OPTIMIZERS,
    REQUIRED,
    SCHEDULER_PARAMS,
    SPEC,
    UNSUPPORTED_OPTIMIZERS,
    UNSUPPORTED_SCHEDULERS,
    Ignored,
    Leaf,
    Refused,
    apply_deepspeed_defaults,
)
from zerotron.config.derive import BatchNames, batch_geometry, data_parallel_size
from zerotron.config.files import read_config_file, too_deep
from zerotron.config.keys import suggest
from zerotron.config.schema import Config
from zerotron.config.sections import FIELD_SECTION
from zerotron.errors import ConfigError, UnsupportedError


@dataclass
class DeepSpeedKeys:
    """A DeepSpeed config sorted onto the schema (see :func:`deepspeed_keys`)."""

    nested: dict[str, dict[str, Any]] = field(default_factory=dict)
    """section -> field -> value, as :meth:`Config.from_dict` takes it"""
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    """(section, field) -> the DeepSpeed key path (and file:line) it came from"""
    notes: list[str] = field(default_factory=list)
    """warnings: unknown keys, ignored keys"""
    resolved: dict[str, Any] = field(default_factory=dict)
    """the DeepSpeed dict with "auto" replaced and the batch sizes completed"""
    has_optimizer: bool = False
    has_scheduler: bool = False


def read_deepspeed_config(
    source: str | os.PathLike | Mapping[str, Any],
) -> tuple[dict[str, Any], Callable[[tuple[str, ...]], str | None]]:
    """A DeepSpeed config as a dict: a JSON file's path, a JSON string, or a mapping.

    Returns it with ``locate(path) -> "file:line"`` (None for a mapping).
    """
    if isinstance(source, Mapping):
        _check_depth(source, None)
        return copy.deepcopy(dict(source)), lambda path: None
    text = os.fspath(source)
    if isinstance(source, str) and text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the DeepSpeed config is not valid JSON: {e}") from None
        except RecursionError:
            raise too_deep(None) from None
        _check_depth(data, None)
        return data, lambda path: None
    data, locate = read_config_file(text)
    _check_depth(data, text)
    return data, locate


MAX_DEPTH = 32
"""DeepSpeed configs nest four levels; deeper ones would overflow deepcopy's recursion."""


def _check_depth(data: Any, where: str | None) -> None:
    """Refuse a config nested deeper than :data:`MAX_DEPTH` (iteratively: no recursion)."""
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise too_deep(where)
        children = node.values() if isinstance(node, Mapping) else node
        if isinstance(node, (Mapping, list, tuple)):
            stack.extend((child, depth + 1) for child in children)


UNKNOWN_KEYS_ENV = "ZEROTRON_DEEPSPEED_UNKNOWN_KEYS"
"""Environment variable: ``warn`` relaxes unknown keys inside known sections to warnings."""


def unknown_keys_mode(mode: str | None = None) -> str:
    """``error`` or ``warn``: ``mode`` if given, else :data:`UNKNOWN_KEYS_ENV`, else error."""
    mode = mode or os.environ.get(UNKNOWN_KEYS_ENV) or "error"
    if mode not in ("error", "warn"):
        raise ConfigError(
            f"unknown-keys mode {mode!r}",
            where=f"--deepspeed-unknown-keys / {UNKNOWN_KEYS_ENV}",
            fix="use 'error' or 'warn'",
        )
    return mode


def deepspeed_keys(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    auto: AutoValues | None = None,
    require_batch: bool = True,
    unknown_keys: str | None = None,
) -> DeepSpeedKeys:
    """Validate a DeepSpeed config and sort it onto schema fields.

    ``require_batch``: a config without any batch size is an error (DeepSpeed's rule); False
    where flags may give them (``zerotron pretrain``). ``unknown_keys``: ``error`` (default, or
    :data:`UNKNOWN_KEYS_ENV`) or ``warn`` for an unknown key inside a known section.

    Raises :class:`ConfigError` naming the key path of a bad value (and ``file:line`` for a
    file), :class:`UnsupportedError` for a feature zerotron does not implement.
    """
    data, locate = read_deepspeed_config(source)
    if not isinstance(data, Mapping):
        raise ConfigError("a DeepSpeed config must be a JSON object", where=_label(source))
    auto = auto or AutoValues()
    out = DeepSpeedKeys(resolved=copy.deepcopy(dict(data)))
    walker = _Walker(out, locate, auto, strict=unknown_keys_mode(unknown_keys) == "error")
    for key, value in data.items():
        if key in ("optimizer", "scheduler"):
            continue
        walker.visit(SPEC, key, value, ())
    walker.optimizer(data.get("optimizer"))
    walker.scheduler(data.get("scheduler"))
    if not require_batch and not walker.batch and not walker.batch_auto:
        return out
    _resolve_batch(
        out,
        walker.batch,
        walker.batch_auto,
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
    )
    return out


def load_deepspeed_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    auto: AutoValues | None = None,
    overrides: Mapping[str, Any] | None = None,
    unknown_keys: str | None = None,
) -> tuple[Config, dict[str, Any]]:
    """A validated Config from a DeepSpeed config; returns ``(config, resolved_dict)``.

    ``overrides`` are flat schema fields that win over the file (flags). DeepSpeed's defaults
    apply where it differs from Megatron's (steps_per_print 10, initial loss scale 2**16, the
    ZeRO bucket sizes; gradient_clipping is 1.0 in both since DeepSpeed 0.19.3).
    """
    keys = deepspeed_keys(
        source,
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        auto=auto,
        unknown_keys=unknown_keys,
    )
    nested = apply_deepspeed_defaults(keys.nested)
    for name, value in (overrides or {}).items():
        nested.setdefault(FIELD_SECTION[name], {})[name] = value
    nested.setdefault("parallel", {}).update(
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
    )
    cfg = Config.from_dict(nested, origin=keys.origin)
    cfg._warnings.extend(keys.notes)
    return cfg, keys.resolved


def _label(source: Any) -> str | None:
    return None if isinstance(source, Mapping) else os.fspath(source)


class _Walker:
    """Walks a DeepSpeed dict against :data:`SPEC`, filling a :class:`DeepSpeedKeys`."""

    def __init__(self, out: DeepSpeedKeys, locate: Callable, auto: AutoValues, strict: bool):
        self.out = out
        self.strict = strict
        self.locate = locate
        self.auto = auto
        self.batch: dict[str, int] = {}
        self.batch_auto = False
        self.lr: float | None = None

    def where(self, path: tuple[str, ...]) -> str | None:
        return self.locate(path)

    def fail(self, e: ConfigError, path: tuple[str, ...]) -> ConfigError:
        where = self.where(path)
        if where and not e.where:
            e.where = where
            e.args = (e.format(),)
        return e

    def set(self, name: str, value: Any, path: tuple[str, ...]) -> None:
        section = FIELD_SECTION[name]
        self.out.nested.setdefault(section, {})[name] = value
        dotted = ".".join(path)
        where = self.where(path)
        self.out.origin[(section, name)] = f"{where} ({dotted})" if where else dotted

    def set_resolved(self, path: tuple[str, ...], value: Any) -> None:
        node = self.out.resolved
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = list(value) if isinstance(value, tuple) else value

    def unknown(self, path: tuple[str, ...], choices: Mapping[str, Any]) -> None:
        close = suggest(path[-1], choices)
        hint = f" (did you mean {'.'.join((*path[:-1], close))!r}?)" if close else ""
        where = self.where(path)
        if self.strict and len(path) > 1:
            # Inside a known section a typo silently leaves a feature off (zero_optimization.stag
            # trains without ZeRO): DeepSpeed's own pydantic sections refuse it too.
            known = ", ".join(sorted(k for k in choices if not k.startswith("_")))
            fix = "correct the spelling" if close else f"{'.'.join(path[:-1])} takes: {known}"
            raise ConfigError(
                f"unknown DeepSpeed key {'.'.join(path)!r}{hint}",
                where=where,
                fix=f"{fix}; --deepspeed-unknown-keys warn (or {UNKNOWN_KEYS_ENV}=warn) "
                "warns and ignores it instead",
            )
        self.out.notes.append(
            f"{where + ': ' if where else ''}unknown DeepSpeed key {'.'.join(path)!r} ignored{hint}"
        )

    def visit(self, spec: Mapping[str, Any], key: str, value: Any, parent: tuple) -> None:
        path = (*parent, key)
        dotted = ".".join(path)
        if key not in spec:
            self.unknown(path, spec)
            return
        node = spec[key]
        if isinstance(node, Refused):
            if not node.harmless(value):
                raise UnsupportedError(
                    f"{dotted}: {node.why}",
                    where=self.where(path),
                    fix=f"remove {dotted!r} from the DeepSpeed config",
                )
            return
        if isinstance(node, Ignored):
            if node.why:
                self.out.notes.append(f"{dotted} has no effect in zerotron ({node.why}); ignored")
            return
        if isinstance(node, dict):
            if value is None:
                return
            if not isinstance(value, Mapping):
                raise self.fail(
                    ConfigError(
                        f"{dotted}: expected an object of keys, got {value!r}",
                        fix="correct the value",
                    ),
                    path,
                )
            for sub, sub_value in value.items():
                self.visit(node, sub, sub_value, path)
            return
        self.leaf(node, path, value)

    def leaf(self, leaf: Leaf, path: tuple[str, ...], value: Any) -> None:
        dotted = ".".join(path)
        is_batch = leaf.field in BATCH_FIELDS
        if value == AUTO:
            value = auto_leaf(dotted, leaf, self.auto)
            if value is None and is_batch:
                self.batch_auto = True
        if value is None:
            return  # null (or an "auto" with nothing to resolve it): the default
        try:
            parsed = leaf.parse(dotted, value)
        except ConfigError as e:
            raise self.fail(e, path) from None
        self.set_resolved(path, parsed)
        if is_batch:
            self.batch[leaf.field] = parsed
            return
        self.set(leaf.field, leaf.to_field(parsed) if leaf.to_field else parsed, path)

    # ---- optimizer and scheduler

    def optimizer(self, block: Any) -> None:
        if block is None:
            return
        path = ("optimizer",)
        if not isinstance(block, Mapping):
            raise self.fail(ConfigError(f"optimizer: expected an object, got {block!r}"), path)
        for key in block:
            if key not in ("type", "params"):
                self.unknown((*path, key), {"type": 0, "params": 0})
        kind = block.get("type")
        if not isinstance(kind, str):
            raise self.fail(
                ConfigError(
                    f"optimizer.type: {kind!r} is not an optimizer name",
                    fix="use Adam, AdamW, Lamb, SGD, Lion or Adagrad",
                ),
                (*path, "type"),
            )
        low = kind.lower()
        if low in UNSUPPORTED_OPTIMIZERS:
            raise UnsupportedError(
                f"optimizer.type: {UNSUPPORTED_OPTIMIZERS[low]} is not supported by zerotron",
                where=self.where((*path, "type")),
                fix="use Adam, AdamW, Lamb, SGD, Lion or Adagrad",
            )
        if low not in OPTIMIZERS:
            close = suggest(low, OPTIMIZERS, cutoff=0.5)
            hint = f"did you mean {close!r}? " if close else ""
            raise ConfigError(
                f"optimizer.type: unknown optimizer {kind!r}",
                where=self.where((*path, "type")),
                fix=f"{hint}use Adam, AdamW, Lamb, SGD, Lion or Adagrad",
            )
        self.out.has_optimizer = True
        self.set("optimizer", OPTIMIZERS[low], (*path, "type"))
        spec = OPTIMIZER_PARAMS[OPTIMIZERS[low]]
        params = block.get("params") or {}
        if not isinstance(params, Mapping):
            raise self.fail(
                ConfigError(f"optimizer.params: expected an object, got {params!r}"),
                (*path, "params"),
            )
        self.out.resolved.setdefault("optimizer", {}).setdefault("params", {})
        for name, value in params.items():
            ppath = (*path, "params", name)
            node = spec.get(name)
            if node is None:
                self.unknown(ppath, spec)
                continue
            if not isinstance(node, Leaf):
                self.visit(spec, name, value, (*path, "params"))
                continue
            if value == AUTO:
                value = auto_optimizer_param(name, node.default, self.auto)
            try:
                parsed = node.parse(".".join(ppath), value)
            except ConfigError as e:
                raise self.fail(e, ppath) from None
            self.set_resolved(ppath, parsed)
            if name == "betas":
                self.set("adam_beta1", parsed[0], ppath)
                self.set("adam_beta2", parsed[1], ppath)
            else:
                self.set(node.field, parsed, ppath)
        # DeepSpeed's defaults for what params leave out (torch's differ: AdamW decays 0.01).
        given = self.out.nested.get("optimizer", {})
        for name, node in spec.items():
            if isinstance(node, Leaf) and name != "betas" and node.field not in given:
                self.set(node.field, node.default, (*path, "params", name))
        self.lr = self.out.nested["optimizer"]["lr"]

    def scheduler(self, block: Any) -> None:
        if block is None:
            return
        path = ("scheduler",)
        if not isinstance(block, Mapping):
            raise self.fail(ConfigError(f"scheduler: expected an object, got {block!r}"), path)
        for key in block:
            if key not in ("type", "params"):
                self.unknown((*path, key), {"type": 0, "params": 0})
        kind = block.get("type")
        if not isinstance(kind, str):
            raise self.fail(
                ConfigError(
                    f"scheduler.type: {kind!r} is not a scheduler name",
                    fix=f"use one of {', '.join(SCHEDULER_PARAMS)}",
                ),
                (*path, "type"),
            )
        if kind in UNSUPPORTED_SCHEDULERS:
            raise UnsupportedError(
                f"scheduler.type: {kind} is not supported by zerotron",
                where=self.where((*path, "type")),
                fix=f"use one of {', '.join(SCHEDULER_PARAMS)}",
            )
        if kind not in SCHEDULER_PARAMS:
            names = list(SCHEDULER_PARAMS)
            close = suggest(str(kind), names, cutoff=0.5)
            hint = f"did you mean {close!r}? " if close else ""
            raise ConfigError(
                f"scheduler.type: {kind!r} is not one of {', '.join(names)}",
                where=self.where((*path, "type")),
                fix=f"{hint}use one of {', '.join(names)}",
            )
        self.out.has_scheduler = True
        spec = SCHEDULER_PARAMS[kind]
        params = block.get("params") or {}
        if not isinstance(params, Mapping):
            raise self.fail(
                ConfigError(f"scheduler.params: expected an object, got {params!r}"),
                (*path, "params"),
            )
        lr = self.lr if self.lr is not None else self.auto.optimizer_lr
        if lr is None:
            lr = self.auto.arg("lr", "learning_rate") or 1e-3
        resolved: dict[str, Any] = {}
        for name, value in params.items():
            ppath = (*path, "params", name)
            if name == "last_batch_iteration":
                continue
            if name not in spec:
                self.unknown(ppath, spec)
                continue
            parse, default = spec[name]
            try:
                if value == AUTO:
                    value = auto_scheduler_param(".".join(ppath), name, default, lr, self.auto)
                resolved[name] = parse(".".join(ppath), value)
            except ConfigError as e:
                raise self.fail(e, ppath) from None
        for name, (_, default) in spec.items():
            if name not in resolved:
                if default is REQUIRED:
                    raise ConfigError(
                        f"scheduler.params.{name} is required by {kind}",
                        where=self.where((*path, "params")),
                        fix=f"add {name!r} to scheduler.params",
                    )
                resolved[name] = default
        if kind == "WarmupLR" and "warmup_max_lr" not in params:
            resolved["warmup_max_lr"] = lr  # DeepSpeed: the optimizer's lr when not given
        self.out.resolved["scheduler"] = {"type": kind, "params": dict(resolved)}
        self.set("lr_scheduler_type", kind, (*path, "type"))
        self.set("lr_scheduler_params", resolved, (*path, "params"))


def _batch_names(world: int, tp: int, pp: int) -> BatchNames:
    """DeepSpeed's key names for the batch arithmetic's errors."""
    return BatchNames(
        global_batch="train_batch_size",
        micro_batch="train_micro_batch_size_per_gpu",
        accumulation="gradient_accumulation_steps",
        data_parallel=lambda dp: f"data-parallel size {dp} (world {world} / (tp {tp} × pp {pp}))",
        where="train_batch_size",
        missing=(
            "neither train_batch_size nor train_micro_batch_size_per_gpu is given",
            None,
            "set train_micro_batch_size_per_gpu (and gradient_accumulation_steps), or "
            "train_batch_size",
        ),
        micro_multiple_fix=lambda tbs, unit: f"use a multiple of {unit}",
        accumulation_multiple_fix=lambda tbs, unit: f"use a multiple of {unit}",
        accumulation_before_dp=True,
    )


def _resolve_batch(
    out: DeepSpeedKeys, batch: dict[str, int], auto: bool, world: int, tp: int, pp: int
) -> None:
    """train_batch_size = micro × accumulation × DP, DP = world / (tp·pp); any two give the
    third, as DeepSpeed's ``_configure_train_batch_size`` does (the arithmetic is
    :func:`~zerotron.config.derive.batch_geometry`, the schema's own)."""
    dp = data_parallel_size(world, tp, pp)
    tbs = batch.get("global_batch_size")
    mbs = batch.get("micro_batch_size")
    gas = batch.get("num_micro_batches")
    if tbs is None and mbs is None and auto:
        mbs = 1  # everything "auto" and nothing to resolve it from
    mbs, tbs, gas = batch_geometry(mbs, tbs, gas, dp, _batch_names(world, tp, pp))
    # Only what the file gave (flags may override one; the schema derives the rest the same way).
    training = out.nested.setdefault("training", {})
    given = {**batch} if batch else {"micro_batch_size": mbs}
    for name, ds_name in BATCH_FIELDS.items():
        if name in given:
            training[name] = given[name]
            out.origin[("training", name)] = ds_name
    out.resolved.update(
        train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas
    )


def format_resolved(resolved: Mapping[str, Any]) -> str:
    """The resolved DeepSpeed config as zerotron prints it once at start (rank 0)."""
    return "zerotron DeepSpeed config (auto values resolved):\n" + json.dumps(
        resolved, indent=2, sort_keys=True, default=str
    )
