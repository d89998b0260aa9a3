"""Configuration: one typed schema, loaders for Megatron flags, DeepSpeed JSON and YAML/JSON.

    from zerotron.config import parse_megatron_args
    cfg = parse_megatron_args(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", 1)))
    cfg.model.hidden_size, cfg.training.num_micro_batches, cfg.parallel.data_parallel_size
    print(cfg.describe())

See :mod:`zerotron.config.schema` for the sections and what validation derives.
"""

from zerotron.config.files import read_config_file, write_config_file
from zerotron.config.megatron import build_parser, load_config, parse_megatron_args
from zerotron.config.schema import (
    FIELD_SECTION,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    SchedulerConfig,
    TrainingConfig,
    format_config,
    parse_data_path,
    parse_split,
)

__all__ = [
    "FIELD_SECTION",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "build_parser",
    "format_config",
    "load_config",
    "parse_data_path",
    "parse_megatron_args",
    "parse_split",
    "read_config_file",
    "write_config_file",
]
