"""Configuration: one typed schema, loaders for Megatron flags, DeepSpeed JSON and YAML/JSON.

    from zerotron.config import parse_megatron_args
    cfg = parse_megatron_args(sys.argv[1:], world_size=int(os.environ.get("WORLD_SIZE", 1)))
    cfg.model.hidden_size, cfg.training.num_micro_batches, cfg.parallel.data_parallel_size
    print(cfg.describe())

    from zerotron.config import load_deepspeed_config
    cfg, resolved = load_deepspeed_config("ds.json", world_size=2)   # DeepSpeed's JSON

Where things are: :mod:`~zerotron.config.schema` (the Config), :mod:`~zerotron.config.sections`
(its sections, one module per concern), :mod:`~zerotron.config.keys` (key styles, unknown keys,
key paths in errors), :mod:`~zerotron.config.derive` (every derived value: batch geometry, data
parallel size, schedule lengths...), and the loaders onto it: :mod:`~zerotron.config.megatron`
(flags), :mod:`~zerotron.config.files` (YAML/JSON), :mod:`~zerotron.config.deepspeed` (DeepSpeed's
JSON, its key table in :mod:`~zerotron.config.deepspeed_table`).
"""

from zerotron.config.deepspeed import (
    AutoValues,
    deepspeed_keys,
    format_resolved,
    load_deepspeed_config,
    read_deepspeed_config,
)
from zerotron.config.files import read_config_file, write_config_file
from zerotron.config.megatron import build_parser, load_config, parse_megatron_args
from zerotron.config.schema import Config, format_config
from zerotron.config.sections import (
    FIELD_SECTION,
    SECTIONS,
    ActivationCheckpointingConfig,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    MonitorConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    SchedulerConfig,
    TrainingConfig,
    ZeroConfig,
    parse_data_path,
    parse_split,
)

__all__ = [
    "FIELD_SECTION",
    "SECTIONS",
    "ActivationCheckpointingConfig",
    "AutoValues",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "ZeroConfig",
    "build_parser",
    "deepspeed_keys",
    "format_config",
    "format_resolved",
    "load_deepspeed_config",
    "load_config",
    "parse_data_path",
    "parse_megatron_args",
    "parse_split",
    "read_config_file",
    "read_deepspeed_config",
    "write_config_file",
]
