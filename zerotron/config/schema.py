"""The one configuration schema: :class:`Config`, its sections, and its round trips.

Every entry point (Megatron-style flags, our YAML/JSON files, DeepSpeed JSON) is a loader onto
:class:`Config`. Field names are Megatron's argument names, unique across sections, so a
flat key (``hidden_size``) and a sectioned key (``model.hidden_size``) name the same thing.
The sections live in :mod:`zerotron.config.sections`, one module per concern.

A Config holds two kinds of values:

* inputs, as the user gave them (or the defaults), which :meth:`Config.to_dict` returns and
  :meth:`Config.from_dict` takes back;
* derived values, filled in by validation where the input was left empty, as Megatron's
  ``validate_args`` does; :mod:`zerotron.config.derive` is where every one of them is computed.

So after validation every field the training loop reads is set, and re-validating the inputs
with another world size (:meth:`Config.with_world_size`) derives everything afresh. A Config is
frozen: change it with :meth:`Config.replace`, which validates the result.

DeepSpeed's JSON maps onto the same fields (train_batch_size -> global_batch_size,
train_micro_batch_size_per_gpu -> micro_batch_size, gradient_accumulation_steps ->
num_micro_batches, fp16.initial_scale_power p -> initial_loss_scale 2**p, gradient_clipping ->
clip_grad, steps_per_print -> log_interval); what Megatron has no flag for (ZeRO, offload,
monitors) lives in the sections ``zero``, ``activation_checkpointing`` and ``monitor``, which the
flag parser picks up by itself (``--zero-stage``, ``--reduce-bucket-size``, ...). The loader is
:mod:`zerotron.config.deepspeed`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from zerotron.config.batch_ramp import BatchRamp, linear_ramp, step_schedule
from zerotron.config.derive import derive
from zerotron.config.keys import nest_keys, unknown_key_error, validation_error
from zerotron.config.sections import (
    SECTIONS,
    ActivationCheckpointingConfig,
    AutotuningConfig,
    CheckpointConfig,
    DataConfig,
    FlopsProfilerConfig,
    ModelConfig,
    MonitorConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    SchedulerConfig,
    TrainingConfig,
    ZeroConfig,
)
from zerotron.config.token_schedule import in_samples


class Config(BaseModel):
    """The whole configuration of a run, validated, with derived values filled in.

    Build it with :meth:`from_dict` (or a loader: :func:`~zerotron.config.parse_megatron_args`,
    :func:`~zerotron.config.load_config`), not the constructor, so errors come back as
    :class:`~zerotron.errors.ConfigError` naming the key path.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)

    _inputs: dict = PrivateAttr(default_factory=dict)
    _warnings: list = PrivateAttr(default_factory=list)

    # ---- construction and round trips

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, origin: Mapping[tuple[str, str], str] | None = None
    ) -> Config:
        """Validate a mapping: sectioned (as :meth:`to_dict` writes) or flat, any key style.

        ``origin`` maps (section, field) to where a value came from ("run.yaml:7",
        "--hidden-size"), for error messages.
        """
        keys = nest_keys(data)
        if keys.unknown:
            path = next(iter(keys.unknown))
            raise unknown_key_error(path, "Config.from_dict")
        try:
            return cls.model_validate(keys.nested)
        except ValidationError as e:
            raise validation_error(e, origin or {}) from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The inputs, sectioned and JSON-safe; :meth:`from_dict` rebuilds an equal Config."""
        return copy.deepcopy(self._inputs)

    def replace(self, **updates: Any) -> Config:
        """A validated copy with some inputs changed: ``cfg.replace(train_iters=10)``.

        Keys are flat field names; derived values are derived afresh.
        """
        data = self.to_dict()
        keys = nest_keys(updates)
        if keys.unknown:
            raise unknown_key_error(next(iter(keys.unknown)), "Config.replace")
        for section, values in keys.nested.items():
            data.setdefault(section, {}).update(values)
        return Config.from_dict(data)

    def with_world_size(self, world_size: int) -> Config:
        """This config validated for ``world_size`` processes (data_parallel_size and the
        batch arithmetic re-derived)."""
        return self.replace(world_size=world_size)

    def __eq__(self, other: object) -> bool:
        # Inputs determine everything else; warnings are not state.
        return isinstance(other, Config) and self._inputs == other._inputs

    __hash__ = None  # type: ignore[assignment]

    # ---- views

    @property
    def warnings(self) -> list[str]:
        """Things validation adjusted or that are suspicious, for rank 0 to print."""
        return list(self._warnings)

    @property
    def lr_decay_steps(self) -> float | None:
        """Length of the LR decay in samples, as Megatron's scheduler counts it (it advances
        by global_batch_size per iteration; from lr_decay_tokens, a fraction may remain). None
        when the run has no length."""
        t, s = self.training, self.scheduler
        if t.train_iters is None:
            return None
        if s.lr_decay_tokens is not None:
            return in_samples(s.lr_decay_tokens, self)
        return s.lr_decay_samples

    @property
    def lr_warmup_steps(self) -> float | None:
        """Length of the LR warmup in samples (Megatron's units; may be fractional with
        lr_warmup_fraction). None when the run has no length."""
        decay = self.lr_decay_steps
        if decay is None:
            return None
        s = self.scheduler
        if s.lr_warmup_fraction is not None:
            return s.lr_warmup_fraction * decay
        if s.lr_warmup_tokens is not None:
            return in_samples(s.lr_warmup_tokens, self)
        return s.lr_warmup_samples

    @property
    def batch_ramp(self) -> BatchRamp | None:
        """The global batch size by samples consumed, when it ramps up (None: constant)."""
        t = self.training
        if t.step_batch_size_schedule is not None:
            return step_schedule(t.step_batch_size_schedule, self.model.seq_length or 1)
        if t.rampup_batch_size is not None and t.global_batch_size is not None:
            return linear_ramp(t.rampup_batch_size, t.global_batch_size)
        return None

    @property
    def train_valid_test_num_samples(self) -> tuple[int, int, int] | None:
        """Samples each split must supply, as Megatron asks its datasets for them: training,
        validation at every eval_interval plus once at the end, and one test evaluation."""
        t = self.training
        if t.train_iters is None:
            return None
        valid_iters = (t.train_iters // t.eval_interval + 1) * t.eval_iters
        gbs = t.global_batch_size
        return t.train_samples, valid_iters * gbs, t.eval_iters * gbs

    def flat(self) -> dict[str, Any]:
        """Every resolved value under its flat (Megatron) name, plus params_dtype."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            out.update(getattr(self, section).model_dump())
        out["params_dtype"] = {"fp32": "torch.float32", "fp16": "torch.float16"}.get(
            self.precision.params_dtype, "torch.bfloat16"
        )
        return out

    def describe(self) -> str:
        """Megatron's ``arguments`` block; see :func:`format_config`."""
        return format_config(self)

    # ---- validation: Megatron's validate_args, with messages that show the numbers

    @model_validator(mode="after")
    def _resolve(self) -> Config:
        self._inputs = self.model_dump(mode="json")
        self._warnings = []
        derive(self)
        return self


# --------------------------------------------------------------------------------------------
# Printing


def format_config(cfg: Config, title: str = "arguments") -> str:
    """Megatron's block of arguments: one ``  name ...... value`` line per resolved value,
    sorted case-insensitively, dots padding each name to 48 columns."""
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in cfg.flat().items()]
    lines.sort(key=str.lower)
    head = f"------------------------ {title} ------------------------"
    tail = f"-------------------- end of {title} ---------------------"
    return "\n".join([head, *lines, tail])
