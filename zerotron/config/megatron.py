"""Megatron-LM's command line onto the schema: ``zerotron pretrain --num-layers 12 ...``.

The flags are generated from the schema (one per field, Megatron's name in dash style), so the
two never drift apart; the exceptions (aliases, shorthands, Megatron flags zerotron refuses or
ignores) are the tables of :mod:`zerotron.config.megatron_table`. ``--config FILE`` reads the
same names from YAML or JSON. Precedence: a flag on the command line > the config file > the
schema's default; every flag defaults to ``argparse.SUPPRESS`` so only the flags actually given
override the file.

Megatron-LM has hundreds of flags. The ones zerotron implements are listed by ``--help``; the
common ones it knows but does not implement raise :class:`UnsupportedError` saying why; those
that only tune Megatron's CUDA kernels, overlap or logging are accepted and ignored, with a
warning in :attr:`Config.warnings`; every other flag of Megatron-LM's parser (the generated
table ``megatron_lm_flags.tsv``) raises :class:`UnsupportedError` naming its
option group. Anything else is an unknown flag and the error suggests the closest valid one.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic.fields import FieldInfo

from zerotron.config.args import ArgumentParser
from zerotron.config.deepspeed import deepspeed_keys
from zerotron.config.deepspeed_table import DEEPSPEED_DEFAULTS
from zerotron.config.files import Locate, read_config_file
from zerotron.config.keys import nest_keys, normalize_key, unknown_key_error
from zerotron.config.megatron_table import (
    ALIASES,
    IGNORED,
    NOT_FLAGS,
    PROG,
    REQUIRED,
    SHORTHANDS,
    UNSUPPORTED,
    UNSUPPORTED_CHOICES,
    Known,
    megatron_deepspeed_flags,
    megatron_lm_flags,
    not_implemented,
)
from zerotron.config.schema import Config
from zerotron.config.sections import FIELD_SECTION, SECTIONS, check_choice, flag
from zerotron.config.sections.base import to_int
from zerotron.errors import ConfigError, UnsupportedError

# --------------------------------------------------------------------------------------------
# The parser


def _int(text: str) -> int:
    return to_int(text)


_int.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"


def _choice(name: str, choices: tuple[str, ...]):
    def parse(text: str) -> str:
        check_choice(flag(name), text, choices, UNSUPPORTED_CHOICES.get(name, ()))
        return text

    return parse


def _base_type(annotation: Any) -> Any:
    """``Int | None`` -> int, ``Literal[...] | None`` -> the Literal, and so on."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _argument(name: str, info: FieldInfo) -> dict[str, Any]:
    """add_argument keywords for a schema field."""
    base = _base_type(info.annotation)
    default = "" if info.default is None else f" (default: {info.default})"
    kwargs: dict[str, Any] = {"dest": name, "help": f"{info.description}{default}"}
    if base is bool:
        # --x / --no-x where the default is on (or derived), a plain switch otherwise.
        kwargs["action"] = "store_true" if info.default is False else argparse.BooleanOptionalAction
    elif typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        kwargs.update(type=_choice(name, choices), metavar="{" + ",".join(choices) + "}")
    elif typing.get_origin(base) is list:
        numbers = _base_type(typing.get_args(base)[0]) is int
        kwargs.update(nargs="*", metavar="N" if numbers else "PATH")
    elif base is int:
        kwargs.update(type=_int, metavar="N")
    elif base is float:
        kwargs.update(type=float, metavar="X")
    else:
        kwargs.update(metavar=name.split("_")[-1].upper())
    return kwargs


class _Refuse(argparse.Action):
    """A known Megatron flag zerotron does not implement: raise unless the value is harmless."""

    def __init__(self, option_strings, dest, known: Known, **kwargs):
        self.known = known
        super().__init__(option_strings, dest, nargs="*" if known.takes_value else 0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        note = _refuse(option_string, " ".join(values) if values else None, self.known, PROG)
        if note:
            namespace._notes = [*getattr(namespace, "_notes", []), note]


class _Ignore(argparse.Action):
    """A Megatron flag without effect here: remember a warning, set nothing."""

    def __init__(self, option_strings, dest, known: Known, **kwargs):
        self.known = known
        super().__init__(option_strings, dest, nargs=1 if known.takes_value else 0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        notes = getattr(namespace, "_notes", [])
        notes.append(_ignored_note(option_string, self.known))
        namespace._notes = notes


def _refuse(name: str, value: str | None, known: Known, where: str) -> str | None:
    """Raise for a flag zerotron does not implement, unless ``value`` is one it takes; then
    the warning to give (or None)."""
    if value is not None and value in known.ok:
        return None
    shown = f"{name} {value}" if value else name
    if (value or "") in known.warned:
        return f"{shown}: {known.warning}"
    raise UnsupportedError(f"{shown} is not supported: {known.why}", where=where)


def _ignored_note(name: str, known: Known) -> str:
    return f"{name} has no effect in zerotron ({known.why}); ignored"


def _add_shorthands(group: Any, section: str | None) -> None:
    for name, short in SHORTHANDS.items():
        if short.section == section:
            group.add_argument(
                name, action="store_const", const=short.value, dest=short.field, help=short.help
            )


def build_parser() -> ArgumentParser:
    """The ``zerotron pretrain`` parser: every schema field as its Megatron flag."""
    parser = ArgumentParser(
        prog=PROG,
        description="Pretrain a GPT model with Megatron-LM's flags.",
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.HelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON file with the same names as the flags (dash or underscore style, "
        "flat or grouped by section); flags given on the command line override it",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for name, info in cls.model_fields.items():
            if name not in NOT_FLAGS:
                group.add_argument(flag(name), *ALIASES.get(name, ()), **_argument(name, info))
        _add_shorthands(group, section)
    _add_shorthands(parser, None)
    ds = parser.add_argument_group("DeepSpeed")
    ds.add_argument(
        "--deepspeed",
        action="store_true",
        help="train with the DeepSpeed-style engine options of --deepspeed_config / --zero-stage "
        "(accepted for Megatron-DeepSpeed scripts; zerotron always uses its one engine)",
    )
    ds.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="deepspeed_config",
        metavar="FILE",
        help="DeepSpeed JSON config (ZeRO, fp16/bf16, optimizer, scheduler, batch sizes); it "
        "overrides --config, flags override it",
    )
    ds.add_argument(
        "--deepspeed-unknown-keys",
        "--deepspeed_unknown_keys",
        dest="deepspeed_unknown_keys",
        choices=("error", "warn"),
        help="an unknown key inside a known section of --deepspeed_config "
        "(zero_optimization.stag): error (default) or warn and ignore it",
    )
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        type=int,
        dest="local_rank",
        help="passed by launchers; ignored (the rank comes from the environment)",
    )
    for name, known in UNSUPPORTED.items():
        parser.add_argument(name, action=_Refuse, known=known, help=argparse.SUPPRESS)
    for name, known in IGNORED.items():
        parser.add_argument(name, action=_Ignore, known=known, help=argparse.SUPPRESS)
    taken = {s for action in parser._actions for s in action.option_strings}
    for name in (megatron_lm_flags().keys() | megatron_deepspeed_flags().keys()) - taken:
        known = not_implemented(name)
        parser.add_argument(name, action=_Refuse, known=known, help=argparse.SUPPRESS)
    return parser


# --------------------------------------------------------------------------------------------
# Flags + file -> Config


MP_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
"""What a checkpoint's args give only with --use-mp-args-from-checkpoint-args (then over the
flags, as Megatron's force)."""

CheckpointArgs = Callable[[str], Mapping[str, Any]]
"""``--use-checkpoint-args``: the --load directory -> flat schema values its checkpoint gives."""


def parse_megatron_args(
    argv: Sequence[str], world_size: int = 1, checkpoint_args: CheckpointArgs | None = None
) -> Config:
    """Parse ``zerotron pretrain`` flags (and ``--config FILE``) into a validated Config.

    ``world_size`` is the number of processes (the launcher's WORLD_SIZE). ``checkpoint_args``
    reads what ``--use-checkpoint-args`` takes from the ``--load`` checkpoint (the training
    layer gives it; the config layer reads no checkpoint). Raises :class:`ConfigError` for bad
    or missing values and unknown flags, :class:`UnsupportedError` for Megatron features
    zerotron does not implement; ``--help`` raises SystemExit(0).
    """
    given = vars(build_parser().parse_args(list(argv)))
    if "wandb_project" in given:  # Megatron-LM logs to W&B when a project is named
        given.setdefault("wandb_enabled", True)
    notes = given.pop("_notes", [])
    given.pop("local_rank", None)
    given.pop("deepspeed", None)
    config_path = given.pop("config", None)
    ds_path = given.pop("deepspeed_config", None)
    ds_unknown = given.pop("deepspeed_unknown_keys", None)
    cfg = _build(
        given,
        config_path,
        world_size,
        notes,
        require=True,
        deepspeed_config=ds_path,
        deepspeed_unknown_keys=ds_unknown,
        checkpoint_args=checkpoint_args,
    )
    a = cfg.activation_checkpointing
    options = [k for k, v in a.model_dump().items() if v and k != "number_checkpoints"]
    if options and cfg.model.recompute_granularity != "full":  # the GPT's full recompute uses them
        cfg._warnings.append(
            f"activation_checkpointing {', '.join(options)}: no effect without full recompute "
            "(--checkpoint-activations or --recompute-granularity full)"
        )
    if cfg.checkpoint.load_universal:  # else --load would look for 'latest' and start afresh
        raise UnsupportedError(
            "zerotron pretrain does not load DeepSpeed's universal checkpoints; the DeepSpeed "
            "API's engine.load_checkpoint does (a script with import zerotron as deepspeed)",
            where="checkpoint.load_universal",
            fix="remove load_universal from the config",
        )
    return cfg


def load_config(path: str | os.PathLike, world_size: int = 1) -> Config:
    """A Config from a YAML/JSON file alone (defaults for everything it leaves out)."""
    return _build({}, str(path), world_size, [], require=False)


def _build(
    given: dict[str, Any],
    config_path: str | None,
    world_size: int,
    notes: list,
    require: bool,
    deepspeed_config: str | None = None,
    deepspeed_unknown_keys: str | None = None,
    checkpoint_args: CheckpointArgs | None = None,
) -> Config:
    nested: dict[str, dict[str, Any]] = {}
    origin: dict[tuple[str, str], str] = {}
    if config_path is not None:
        data, locate = read_config_file(config_path)
        keys = nest_keys(data, where=locate)
        notes += _screen_unknown(keys.unknown, locate)
        written = keys.nested.get("parallel", {}).pop("world_size", None)
        if written is not None and written != world_size:  # the launcher knows better
            notes.append(
                f"{keys.origin[('parallel', 'world_size')]}: world_size {written} is replaced by "
                f"the {world_size} processes launched"
            )
        nested, origin = keys.nested, keys.origin
    if deepspeed_config is not None:
        _merge_deepspeed(
            deepspeed_config, given, nested, origin, notes, world_size, deepspeed_unknown_keys
        )
    for name, value in given.items():  # the command line wins over the file
        section = FIELD_SECTION[name]
        nested.setdefault(section, {})[name] = value
        origin[(section, name)] = flag(name)
    nested.setdefault("parallel", {})["world_size"] = world_size
    origin[("parallel", "world_size")] = "launcher"
    _fill_from_checkpoint(nested, origin, checkpoint_args)
    if require:
        _check_required(nested, config_path)
    cfg = Config.from_dict(nested, origin=origin)
    cfg._warnings.extend(notes)
    return cfg


def _fill_from_checkpoint(
    nested: dict[str, dict[str, Any]],
    origin: dict[tuple[str, str], str],
    checkpoint_args: CheckpointArgs | None,
) -> None:
    """``--use-checkpoint-args``: the checkpoint's values where flags and file gave none."""
    ckpt = nested.get("checkpoint", {})
    if not ckpt.get("use_checkpoint_args"):
        if ckpt.get("use_mp_args_from_checkpoint_args"):
            raise ConfigError(
                "use_mp_args_from_checkpoint_args takes the parallel sizes with the model's "
                "shape, but use_checkpoint_args is not set",
                where="checkpoint.use_mp_args_from_checkpoint_args",
                fix="add --use-checkpoint-args",
            )
        return
    load = ckpt.get("load")
    if not load:
        raise ConfigError(
            "use_checkpoint_args takes the model's shape from the --load checkpoint, but no "
            "--load is given",
            where="checkpoint.use_checkpoint_args",
            fix="add --load DIR, or give the model flags and drop --use-checkpoint-args",
        )
    if checkpoint_args is None:
        raise ConfigError(
            "use_checkpoint_args is read by zerotron pretrain only",
            where="checkpoint.use_checkpoint_args",
            fix="give the model flags themselves here",
        )
    for name, value in checkpoint_args(load).items():
        section = FIELD_SECTION[name]
        if name in MP_ARGS:  # Megatron forces these over the flags, when asked
            if not ckpt.get("use_mp_args_from_checkpoint_args"):
                continue
        elif nested.setdefault(section, {}).get(name) is not None:
            continue
        nested.setdefault(section, {})[name] = value
        origin[(section, name)] = f"the checkpoint in {load}"


def _merge_deepspeed(
    path: str,
    given: dict[str, Any],
    nested: dict[str, dict[str, Any]],
    origin: dict[tuple[str, str], str],
    notes: list,
    world_size: int,
    unknown_keys: str | None = None,
) -> None:
    """A DeepSpeed JSON over the --config file's values (its DeepSpeed defaults only where
    neither file set the field); flags are applied after, so they win."""

    def size(name: str) -> int:
        value = given.get(name, nested.get("parallel", {}).get(name, 1))
        return to_int(value)

    keys = deepspeed_keys(
        path,
        world_size=world_size,
        tensor_model_parallel_size=size("tensor_model_parallel_size"),
        pipeline_model_parallel_size=size("pipeline_model_parallel_size"),
        require_batch=False,  # the flags may give the batch sizes
        unknown_keys=unknown_keys,
    )
    for section, values in keys.nested.items():
        nested.setdefault(section, {}).update(values)
    for section, values in DEEPSPEED_DEFAULTS.items():
        for name, value in values.items():
            nested.setdefault(section, {}).setdefault(name, value)
    origin.update(keys.origin)
    notes.extend(keys.notes)


def _screen_unknown(unknown: dict[tuple[str, ...], Any], locate: Locate) -> list[str]:
    """Keys of a config file the schema lacks: Megatron's unsupported or no-op flags, else an
    unknown-key error naming the file, line and the closest key."""
    notes = []
    for path, value in unknown.items():
        name = flag(normalize_key(path[-1]))
        if name in IGNORED:
            notes.append(_ignored_note(name, IGNORED[name]))
        elif known := UNSUPPORTED.get(name) or not_implemented(name):
            if value is not None and value is not False:
                text = None if value is True else " ".join(map(str, _as_list(value)))
                note = _refuse(name, text, known, locate(path))
                if note:
                    notes.append(note)
        elif name not in ("--local-rank",):
            raise unknown_key_error(path, locate(path))
    return notes


def _is_zero(value: Any) -> bool:
    try:
        return value is not None and to_int(value) == 0
    except ValueError:
        return False  # not a number: validation reports it


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _check_required(nested: dict[str, dict[str, Any]], config_path: str | None) -> None:
    def value(name: str) -> Any:
        return nested.get(FIELD_SECTION[name], {}).get(name)

    missing = [
        flag(name)
        for name in REQUIRED
        # a global batch size alone gives the micro batch size (DeepSpeed's train_batch_size)
        if value(name) is None
        and not (name == "micro_batch_size" and value("global_batch_size") is not None)
    ]
    iters = value("train_iters")
    if iters is None and value("train_samples") is None:
        missing.append("--train-iters (or --train-samples)")
    elif value("lr") is None and not _is_zero(iters):
        missing.append("--lr")
    if missing:
        where = f"{PROG} (and {config_path})" if config_path else PROG
        raise ConfigError(
            f"missing required flag{'s' if len(missing) > 1 else ''}: {', '.join(missing)}",
            where=where,
            fix="give them on the command line or in the --config file",
        )
