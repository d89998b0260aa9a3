"""The sections of the one schema, one module per concern, and the table of them.

Field names are Megatron's argument names, unique across sections, so a flat key
(``hidden_size``) and a sectioned key (``model.hidden_size``) name the same thing:
:data:`FIELD_SECTION` maps one to the other.
"""

from zerotron.config.sections.autotuning import AutotuningConfig
from zerotron.config.sections.base import Float, Int, Section, check_choice, flag
from zerotron.config.sections.data import DataConfig, parse_data_path, parse_split
from zerotron.config.sections.model import ModelConfig
from zerotron.config.sections.parallel import ParallelConfig
from zerotron.config.sections.precision import PrecisionConfig
from zerotron.config.sections.profiling import FlopsProfilerConfig
from zerotron.config.sections.runtime import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    MonitorConfig,
)
from zerotron.config.sections.training import OptimizerConfig, SchedulerConfig, TrainingConfig
from zerotron.config.sections.zero import ZeroConfig

SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "parallel": ParallelConfig,
    "zero": ZeroConfig,
    "activation_checkpointing": ActivationCheckpointingConfig,
    "monitor": MonitorConfig,
    "autotuning": AutotuningConfig,
    "flops_profiler": FlopsProfilerConfig,
}
"""Section name (the Config attribute) -> its class, in the order ``describe`` walks them."""

FIELD_SECTION: dict[str, str] = {
    name: section for section, cls in SECTIONS.items() for name in cls.model_fields
}
"""Flat field name -> its section. Names are unique across sections (checked at import)."""

assert len(FIELD_SECTION) == sum(len(c.model_fields) for c in SECTIONS.values())

__all__ = [
    "FIELD_SECTION",
    "SECTIONS",
    "ActivationCheckpointingConfig",
    "AutotuningConfig",
    "CheckpointConfig",
    "DataConfig",
    "Float",
    "FlopsProfilerConfig",
    "Int",
    "ModelConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "Section",
    "TrainingConfig",
    "ZeroConfig",
    "check_choice",
    "flag",
    "parse_data_path",
    "parse_split",
]
