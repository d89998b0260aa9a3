"""The one configuration schema: typed sections, validation, and the values derived from them.

Every entry point (Megatron-style flags, our YAML/JSON files, DeepSpeed JSON) is a loader onto
:class:`Config`. Field names are Megatron's argument names, unique across sections, so a
flat key (``hidden_size``) and a sectioned key (``model.hidden_size``) name the same thing.

A Config holds two kinds of values:

* inputs, as the user gave them (or the defaults), which :meth:`Config.to_dict` returns and
  :meth:`Config.from_dict` takes back;
* derived values, filled in by validation where the input was left empty, as Megatron's
  ``validate_args`` does: ``ffn_hidden_size`` (4h), ``max_position_embeddings`` (seq_length),
  ``global_batch_size`` / ``micro_batch_size`` / ``num_micro_batches`` (any two give the third),
  ``data_parallel_size`` (world / (tp·pp)), ``train_iters`` from ``train_samples`` and back,
  ``lr_decay_iters`` (train_iters), ``lr_decay_samples``, ``lr_warmup_samples``,
  ``start/end_weight_decay`` (weight_decay), ``virtual_pipeline_model_parallel_size``,
  ``pipeline_schedule`` (1f1b, or interleaved with virtual stages), ``recompute_method`` /
  ``recompute_num_layers`` (uniform, 1).

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
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from zerotron.errors import ConfigError, UnsupportedError

# --------------------------------------------------------------------------------------------
# Value types: YAML reads `5e8` and `1e-4` as strings, and users write 5e8 for integers.


def _to_int(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value}")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value}")
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    return value


Int = Annotated[int, BeforeValidator(_to_int)]
"""An int that also accepts integral floats and strings such as ``5e8`` or ``"1e6"``."""

Float = Annotated[float, BeforeValidator(_to_float)]
"""A float that also accepts strings such as ``"1e-4"`` (YAML 1.1 reads those as strings)."""

TOKENIZER_TYPES = ("GPT2BPETokenizer",)
"""Tokenizers zerotron implements."""

UNSUPPORTED_TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
)
"""Megatron-LM tokenizer types zerotron knows about but does not implement."""


def flag(name: str) -> str:
    """The Megatron flag for a field name: ``global_batch_size`` -> ``--global-batch-size``."""
    return "--" + name.replace("_", "-")


class _Section(BaseModel):
    # Unknown keys are errors; sections are copied into each Config (never shared) and frozen.
    model_config = ConfigDict(extra="forbid", frozen=True, revalidate_instances="always")


# --------------------------------------------------------------------------------------------
# Sections. Defaults are Megatron-LM's (megatron/training/arguments.py) where it has one.


class ModelConfig(_Section):
    """GPT shape, regularization, activation recomputation."""

    num_layers: Int | None = Field(None, gt=0, description="Number of transformer layers.")
    hidden_size: Int | None = Field(None, gt=0, description="Transformer hidden size.")
    num_attention_heads: Int | None = Field(None, gt=0, description="Number of attention heads.")
    ffn_hidden_size: Int | None = Field(
        None, gt=0, description="MLP hidden size; 4 * hidden_size when not given."
    )
    seq_length: Int | None = Field(None, gt=0, description="Sequence length of a sample.")
    max_position_embeddings: Int | None = Field(
        None, gt=0, description="Number of position embeddings; seq_length when not given."
    )
    make_vocab_size_divisible_by: Int = Field(
        128, gt=0, description="Pad the vocabulary to a multiple of this times the TP size."
    )
    layernorm_epsilon: Float = Field(1e-5, gt=0, description="LayerNorm epsilon.")
    init_method_std: Float = Field(0.02, gt=0, description="Std of the normal weight init.")
    hidden_dropout: Float = Field(0.1, ge=0, lt=1, description="Dropout on hidden states.")
    attention_dropout: Float = Field(0.1, ge=0, lt=1, description="Dropout on attention probs.")
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None,
        description="Activation recomputation: 'full' recomputes whole layers, 'selective' "
        "only the attention core.",
    )
    recompute_method: Literal["uniform", "block"] | None = Field(
        None,
        description="With full recomputation: 'uniform' checkpoints every recompute_num_layers "
        "layers as one unit, 'block' recomputes the first recompute_num_layers layers of each "
        "pipeline stage. Default uniform.",
    )
    recompute_num_layers: Int | None = Field(
        None, gt=0, description="Layers per recompute unit (uniform) or per stage (block); 1."
    )
    compile: bool = Field(False, description="Wrap the model in torch.compile.")


class DataConfig(_Section):
    """Tokenized data, its split, the tokenizer, the data loader."""

    data_path: list[str] | None = Field(
        None,
        description="Dataset prefix, or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...', or several "
        "prefixes weighted by their size.",
    )
    split: str = Field(
        "969,30,1", description="Train,valid,test proportions of the documents (Megatron's)."
    )
    tokenizer_type: str = Field("GPT2BPETokenizer", description="Tokenizer.")
    vocab_file: str | None = Field(
        None, description="GPT-2 encoder.json (Megatron's --vocab-file); default: the bundled one."
    )
    merge_file: str | None = Field(
        None, description="GPT-2 vocab.bpe merges; the bundled one if not given."
    )
    num_workers: Int = Field(2, ge=0, description="Data loader worker processes.")
    eod_mask_loss: bool = Field(False, description="Mask the loss on end-of-document tokens.")
    reset_position_ids: bool = Field(False, description="Restart position ids after each EOD.")
    reset_attention_mask: bool = Field(
        False, description="Do not attend across documents (EOD) inside a sample."
    )
    data_cache_path: str | None = Field(
        None, description="Directory for index caches; next to the data when not given."
    )

    @field_validator("data_path", mode="before")
    @classmethod
    def _split_blend_string(cls, value: Any) -> Any:
        # A file may give the blend as one string "0.3 A 0.7 B", or numbers in a YAML list.
        if isinstance(value, str):
            return value.split()
        if isinstance(value, list):
            return [str(v) for v in value]
        return value

    @field_validator("data_path")
    @classmethod
    def _check_blend(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            parse_data_path(value)
        return value

    @field_validator("split")
    @classmethod
    def _check_split(cls, value: str) -> str:
        parse_split(value)
        return value

    @field_validator("tokenizer_type")
    @classmethod
    def _check_tokenizer(cls, value: str) -> str:
        check_choice("data.tokenizer_type", value, TOKENIZER_TYPES, UNSUPPORTED_TOKENIZER_TYPES)
        return value

    @property
    def blend(self) -> tuple[list[str], list[float] | None] | None:
        """``(prefixes, weights)`` from data_path; weights None means 'by dataset size'."""
        return None if self.data_path is None else parse_data_path(self.data_path)

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        """The split normalized to fractions summing to 1 (train, valid, test)."""
        return parse_split(self.split)


class TrainingConfig(_Section):
    """Batch sizes, length of training, evaluation and logging intervals, seed."""

    micro_batch_size: Int | None = Field(
        None, gt=0, description="Samples per forward/backward pass on one model replica."
    )
    global_batch_size: Int | None = Field(
        None,
        gt=0,
        description="Samples per optimizer step over all replicas: micro_batch_size * "
        "data_parallel_size * num_micro_batches. micro_batch_size * data_parallel_size "
        "when not given.",
    )
    num_micro_batches: Int | None = Field(
        None,
        gt=0,
        description="Gradient accumulation steps (DeepSpeed's gradient_accumulation_steps); "
        "derived from the batch sizes when not given.",
    )
    train_iters: Int | None = Field(
        None, ge=0, description="Iterations (optimizer steps) to train for over all runs."
    )
    train_samples: Int | None = Field(
        None, gt=0, description="Samples to train for over all runs (instead of train_iters)."
    )
    exit_interval: Int | None = Field(
        None, gt=0, description="Exit after an iteration divisible by this."
    )
    exit_duration_in_mins: Int | None = Field(
        None, gt=0, description="Exit after this many minutes."
    )
    seed: Int = Field(1234, ge=0, description="Seed for python, numpy, torch.")
    eval_interval: Int = Field(1000, gt=0, description="Iterations between evaluations.")
    eval_iters: Int = Field(100, ge=0, description="Iterations per evaluation (0: none).")
    log_interval: Int = Field(100, gt=0, description="Iterations between log lines.")
    tensorboard_dir: str | None = Field(None, description="Write TensorBoard events here.")


class OptimizerConfig(_Section):
    """Optimizer and gradient clipping. Megatron's 'adam' is AdamW (decoupled weight decay)."""

    optimizer: Literal["adam", "adamw", "sgd", "lamb"] = Field(
        "adam",
        description="adam (AdamW unless adam_w_mode is off, as in Megatron and DeepSpeed), adamw, "
        "sgd or lamb.",
    )
    lr: Float | None = Field(None, ge=0, description="Peak learning rate.")
    min_lr: Float = Field(0.0, ge=0, description="Learning rate at the end of decay.")
    weight_decay: Float = Field(0.01, ge=0, description="Decoupled weight decay.")
    start_weight_decay: Float | None = Field(
        None, ge=0, description="Weight decay at the start (with an increment style)."
    )
    end_weight_decay: Float | None = Field(
        None, ge=0, description="Weight decay at the end of training (with an increment style)."
    )
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="How weight decay goes from start to end; constant keeps weight_decay.",
    )
    clip_grad: Float = Field(1.0, ge=0, description="Clip the global grad L2 norm (0: off).")
    adam_beta1: Float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: Float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    adam_eps: Float = Field(1e-8, gt=0, description="Adam epsilon.")
    sgd_momentum: Float = Field(0.9, ge=0, description="SGD momentum.")
    sgd_nesterov: bool = Field(False, description="Nesterov momentum for SGD.")
    adam_w_mode: bool = Field(
        True,
        description="With optimizer adam: decoupled weight decay (AdamW); off gives Adam with "
        "L2-coupled decay (DeepSpeed's adam_w_mode).",
    )
    lamb_max_coeff: Float = Field(10.0, gt=0, description="Lamb: upper bound of the trust ratio.")
    lamb_min_coeff: Float = Field(0.01, ge=0, description="Lamb: lower bound of the trust ratio.")


class SchedulerConfig(_Section):
    """Learning-rate schedule: linear warmup, then decay to min_lr (Megatron's semantics)."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = Field(
        "linear", description="Decay after warmup."
    )
    lr_decay_iters: Int | None = Field(
        None, ge=0, description="Iterations to decay over; train_iters when not given."
    )
    lr_decay_samples: Int | None = Field(
        None, ge=0, description="Samples to decay over (sample-based training); train_samples."
    )
    lr_warmup_fraction: Float | None = Field(
        None, ge=0, le=1, description="Warmup as a fraction of the decay length."
    )
    lr_warmup_iters: Int = Field(0, ge=0, description="Iterations of linear warmup.")
    lr_warmup_samples: Int = Field(0, ge=0, description="Samples of linear warmup.")
    lr_warmup_init: Float = Field(0.0, ge=0, description="Learning rate warmup starts from.")
    override_opt_param_scheduler: bool = Field(
        False, description="On resume, take the schedule from the flags, not the checkpoint."
    )
    use_checkpoint_opt_param_scheduler: bool = Field(
        False, description="On resume, take the schedule from the checkpoint, not the flags."
    )
    lr_scheduler_type: (
        Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"] | None
    ) = Field(
        None,
        description="A DeepSpeed scheduler (its JSON's scheduler.type) instead of Megatron's "
        "warmup + decay; its parameters are lr_scheduler_params.",
    )
    lr_scheduler_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Parameters of lr_scheduler_type (DeepSpeed's scheduler.params).",
    )


class PrecisionConfig(_Section):
    """Mixed precision and dynamic loss scaling (DeepSpeed's semantics for fp16)."""

    fp16: bool = Field(False, description="16-bit float params, fp32 master weights.")
    bf16: bool = Field(False, description="bfloat16 params, fp32 master weights.")
    loss_scale: Float | None = Field(
        None, gt=0, description="Static loss scale for fp16; dynamic scaling when not given."
    )
    initial_loss_scale: Float = Field(2.0**32, gt=0, description="First dynamic loss scale.")
    min_loss_scale: Float = Field(1.0, gt=0, description="Floor of the dynamic loss scale.")
    loss_scale_window: Int = Field(
        1000, gt=0, description="Overflow-free steps before the scale doubles."
    )
    hysteresis: Int = Field(2, ge=1, description="Overflows tolerated before the scale halves.")
    consecutive_hysteresis: bool = Field(
        False, description="Refill hysteresis after each overflow-free step (DeepSpeed's)."
    )
    accumulate_allreduce_grads_in_fp32: bool = Field(
        False, description="Accumulate and all-reduce gradients in fp32."
    )
    fp16_auto_cast: bool = Field(
        False, description="fp16: cast floating-point inputs of the model to fp16 (DeepSpeed)."
    )

    @property
    def params_dtype(self) -> Literal["fp32", "fp16", "bf16"]:
        """The dtype model parameters are kept in."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"


class CheckpointConfig(_Section):
    """Where checkpoints go and what they carry."""

    save: str | None = Field(None, description="Directory to save checkpoints to.")
    load: str | None = Field(None, description="Directory to load a checkpoint from.")
    save_interval: Int | None = Field(
        None, gt=0, description="Iterations between checkpoint saves."
    )
    no_save_optim: bool = Field(False, description="Do not save the optimizer state.")
    no_load_optim: bool = Field(False, description="Do not load the optimizer state.")
    no_save_rng: bool = Field(False, description="Do not save RNG states.")
    no_load_rng: bool = Field(False, description="Do not load RNG states.")
    finetune: bool = Field(
        False, description="Load weights only (no optimizer, no RNG) and start at iteration 0."
    )
    exit_on_missing_checkpoint: bool = Field(
        False, description="With --load, stop if no checkpoint is found instead of starting fresh."
    )
    use_node_local_storage: bool = Field(
        False,
        description="Each node writes its own ranks' files to a node-local directory "
        "(DeepSpeed's checkpoint.use_node_local_storage).",
    )
    checkpoint_tag_validation: Literal["Ignore", "Warn", "Fail"] = Field(
        "Warn",
        description="What to do when ranks save under different tags (DeepSpeed's "
        "checkpoint.tag_validation).",
    )


class ParallelConfig(_Section):
    """The process grid: world = pipeline x data x tensor parallel."""

    tensor_model_parallel_size: Int = Field(1, ge=1, description="Tensor-parallel size.")
    pipeline_model_parallel_size: Int = Field(1, ge=1, description="Pipeline-parallel size.")
    sequence_parallel: bool = Field(
        False, description="Shard LayerNorm and dropout along the sequence (needs TP > 1)."
    )
    num_layers_per_virtual_pipeline_stage: Int | None = Field(
        None, gt=0, description="Layers per virtual stage: interleaved 1F1B schedule."
    )
    virtual_pipeline_model_parallel_size: Int | None = Field(
        None,
        gt=0,
        description="Virtual stages per pipeline rank; derived from "
        "num_layers_per_virtual_pipeline_stage.",
    )
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved"] | None = Field(
        None,
        description="Pipeline schedule (zerotron's flag; Megatron has none): 1f1b by default, "
        "interleaved with virtual stages, gpipe (all forwards, then all backwards) on request.",
    )
    distributed_timeout_minutes: Int = Field(
        10, gt=0, description="Timeout of collectives; a hung rank fails the job after it."
    )
    ddp_bucket_size: Int | None = Field(
        None, gt=0, description="Elements per data-parallel gradient bucket."
    )
    world_size: Int = Field(1, ge=1, description="Number of processes; set by the launcher.")
    data_parallel_size: Int | None = Field(
        None, ge=1, description="world_size / (tensor x pipeline size); derived."
    )


OffloadDevice = Literal["none", "cpu", "nvme"]


class ZeroConfig(_Section):
    """ZeRO and the data-parallel gradient reduction (DeepSpeed's zero_optimization and the
    top-level keys about reducing gradients). Defaults are DeepSpeed's."""

    zero_stage: Int = Field(
        0,
        ge=0,
        le=3,
        description="ZeRO stage: 0 plain data parallelism, 1 optimizer states, 2 + gradients, "
        "3 + parameters partitioned over the data-parallel ranks.",
    )
    allgather_partitions: bool = Field(
        True, description="All-gather updated parameters in one call (not broadcasts)."
    )
    allgather_bucket_size: Int = Field(
        500_000_000, gt=0, description="Elements all-gathered at a time."
    )
    overlap_comm: bool | None = Field(
        None,
        description="Overlap gradient reduction with backward; default on for stage 3, off "
        "otherwise (DeepSpeed's).",
    )
    reduce_scatter: bool = Field(
        True, description="Reduce gradients with reduce-scatter (not all-reduce)."
    )
    reduce_bucket_size: Int | None = Field(
        None,
        gt=0,
        description="Elements reduced at a time; unset: 4e6 at stage 3, 5e8 at stages 1-2 "
        "(a DeepSpeed config's default is 5e8).",
    )
    contiguous_gradients: bool = Field(
        True, description="Copy reduced gradients into one contiguous buffer."
    )
    round_robin_gradients: bool = Field(
        False, description="Stage 1/2: assign gradients to partitions round-robin."
    )
    offload_optimizer_device: OffloadDevice = Field(
        "none", description="Where fp32 master weights and optimizer states live: none, cpu, nvme."
    )
    offload_optimizer_nvme_path: str | None = Field(
        None, description="Directory for optimizer states offloaded to NVMe."
    )
    offload_optimizer_pin_memory: bool = Field(
        False, description="Pin the host memory of offloaded optimizer states."
    )
    offload_optimizer_buffer_count: Int = Field(
        4, gt=0, description="Buffers streaming optimizer states from NVMe."
    )
    offload_param_device: OffloadDevice = Field(
        "none", description="Stage 3: where partitioned 16-bit parameters live: none, cpu, nvme."
    )
    offload_param_nvme_path: str | None = Field(
        None, description="Directory for parameters offloaded to NVMe."
    )
    offload_param_pin_memory: bool = Field(
        False, description="Pin the host memory of offloaded parameters."
    )
    offload_param_buffer_count: Int = Field(
        5, gt=0, description="Buffers streaming parameters from NVMe."
    )
    offload_param_buffer_size: Int = Field(
        100_000_000, gt=0, description="Elements per parameter buffer (NVMe)."
    )
    offload_param_max_in_cpu: Int = Field(
        1_000_000_000, ge=0, description="Parameter elements kept in host memory (NVMe)."
    )
    sub_group_size: Int | None = Field(
        None,
        gt=0,
        description="Elements per optimizer sub-group stepped at a time (offload streams them); "
        "unset: 2e6 at stage 3, 1e9 at stages 1-2 (a DeepSpeed config's default is 1e9).",
    )
    stage3_prefetch_bucket_size: Int | None = Field(
        None,
        ge=0,
        description="Stage 3: parameter elements fetched ahead of use; unset: the next module "
        "only (a DeepSpeed config's default is 5e7).",
    )
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0, description="Stage 3: parameters this small stay whole (not partitioned)."
    )
    stage3_max_live_parameters: Int = Field(
        1_000_000_000, ge=0, description="Stage 3: gathered parameter elements kept at most."
    )
    stage3_max_reuse_distance: Int = Field(
        1_000_000_000, ge=0, description="Stage 3: keep a parameter gathered if reused this soon."
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="Stage 3: save consolidated 16-bit weights with each checkpoint."
    )
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="With offload to cpu, step with the built-in CPU optimizer."
    )
    prescale_gradients: bool = Field(
        False, description="Divide gradients by the data-parallel size before reducing them."
    )
    gradient_predivide_factor: Float = Field(
        1.0, gt=0, description="Divide gradients by this before reducing, the rest after."
    )
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="dtype of gradients on the wire; the parameters' dtype when not given."
    )

    @property
    def offload_optimizer(self) -> bool:
        return self.offload_optimizer_device != "none"

    @property
    def offload_param(self) -> bool:
        return self.offload_param_device != "none"


class ActivationCheckpointingConfig(_Section):
    """DeepSpeed's activation_checkpointing section (``zerotron.checkpointing.configure``)."""

    partition_activations: bool = Field(
        False, description="Split checkpointed activations across tensor-parallel ranks."
    )
    cpu_checkpointing: bool = Field(
        False, description="Keep checkpointed activations in host memory."
    )
    contiguous_memory_optimization: bool = Field(
        False, description="Copy checkpointed activations into one contiguous buffer."
    )
    number_checkpoints: Int | None = Field(
        None, gt=0, description="Checkpoints per forward (for the contiguous buffer)."
    )
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Synchronize the device at each checkpoint boundary."
    )
    checkpointing_profile: bool = Field(
        False, description="Time the checkpointed forward and recompute (DeepSpeed's profile)."
    )


class MonitorConfig(_Section):
    """DeepSpeed's monitors (tensorboard, wandb, csv_monitor) and wall-clock timers."""

    tensorboard_enabled: bool = Field(False, description="Write TensorBoard events.")
    tensorboard_output_path: str = Field("", description="Directory of TensorBoard events.")
    tensorboard_job_name: str = Field(
        "DeepSpeedJobName", description="Subdirectory of tensorboard_output_path."
    )
    wandb_enabled: bool = Field(False, description="Log to Weights & Biases.")
    wandb_group: str | None = Field(None, description="W&B group.")
    wandb_team: str | None = Field(None, description="W&B team (entity).")
    wandb_project: str = Field("deepspeed", description="W&B project.")
    csv_monitor_enabled: bool = Field(False, description="Write metrics to CSV files.")
    csv_monitor_output_path: str = Field("", description="Directory of the CSV files.")
    csv_monitor_job_name: str = Field(
        "DeepSpeedJobName", description="Subdirectory of csv_monitor_output_path."
    )
    wall_clock_breakdown: bool = Field(
        False, description="Time forward, backward and step on every rank and log them."
    )


SECTIONS: dict[str, type[_Section]] = {
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
}

FIELD_SECTION: dict[str, str] = {
    name: section for section, cls in SECTIONS.items() for name in cls.model_fields
}
"""Flat field name -> its section. Names are unique across sections (checked at import)."""

assert len(FIELD_SECTION) == sum(len(c.model_fields) for c in SECTIONS.values())


# --------------------------------------------------------------------------------------------
# Parsers shared by validation and the data layer.


def check_choice(where: str, value: str, supported: tuple, unsupported: tuple = ()) -> None:
    """Raise UnsupportedError for a known-but-unimplemented value, ConfigError for a typo."""
    if value in supported:
        return
    if value in unsupported:
        raise UnsupportedError(
            f"{value} is not supported by zerotron",
            where=where,
            fix=f"use {' or '.join(supported)}",
        )
    close = difflib.get_close_matches(value, [*supported, *unsupported], n=1, cutoff=0.5)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        f"unknown value {value!r}", where=where, fix=f"{hint}choose from {', '.join(supported)}"
    )


def parse_data_path(items: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: ``[P]``, ``[W1, P1, W2, P2, ...]`` or ``[P1, P2, ...]``.

    Returns ``(prefixes, weights)``; weights is None when they are to come from dataset sizes.
    """
    where = "data.data_path"
    if not items:
        raise ConfigError("no dataset prefix given", where=where, fix="--data-path PREFIX")

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    weights = [number(s) for s in items[0::2]]
    if len(items) % 2 == 1 or all(w is None for w in weights):
        if any(number(s) is not None for s in items):
            raise ConfigError(
                f"a blend needs a weight before every prefix: {' '.join(items)!r}",
                where=where,
                fix="write 'W1 PREFIX1 W2 PREFIX2 ...', or only prefixes",
            )
        return list(items), None
    if any(w is None for w in weights) or any(number(p) is not None for p in items[1::2]):
        raise ConfigError(
            f"a blend alternates weights and prefixes: {' '.join(items)!r}",
            where=where,
            fix="write 'W1 PREFIX1 W2 PREFIX2 ...'",
        )
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ConfigError(
            f"blend weights must be positive numbers, got {weights}",
            where=where,
            fix="give each prefix a weight > 0 (leave out a prefix you do not want)",
        )
    return list(items[1::2]), weights


def parse_split(split: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``969/30/1``) -> fractions; missing parts are 0, as in Megatron."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise ConfigError(
            f"split {split!r} is not up to three non-negative numbers",
            where="data.split",
            fix="write train,valid,test proportions, e.g. --split 969,30,1",
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(
            f"split {split!r} sums to 0", where="data.split", fix="give the train part a weight"
        )
    return values[0] / total, values[1] / total, values[2] / total


# --------------------------------------------------------------------------------------------
# Key normalization: flat or sectioned keys, dash or underscore style.


def normalize_key(key: Any) -> str:
    """``--num-layers`` / ``num-layers`` / ``num_layers`` -> ``num_layers``."""
    return str(key).lstrip("-").replace("-", "_")


def suggest(name: str, choices: list[str]) -> str | None:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_error(path: tuple[str, ...], where: str) -> ConfigError:
    """The error for a key path the schema does not have, with the closest known key."""
    name = normalize_key(path[-1])
    section = normalize_key(path[0]) if len(path) > 1 else None
    if section in SECTIONS:
        choices = list(SECTIONS[section].model_fields)
    else:
        choices = [*FIELD_SECTION, *SECTIONS]
    close = suggest(name, choices)
    fix = f"did you mean {close!r}?" if close else "see `zerotron pretrain --help` for the keys"
    return ConfigError(f"unknown key {'.'.join(path)!r}", where=where, fix=fix)


class Keys(NamedTuple):
    """Keys sorted into sections by :func:`nest_keys`."""

    nested: dict[str, dict[str, Any]]
    """section -> field -> value, for every key the schema has"""
    unknown: dict[tuple[str, ...], Any]
    """key paths as written (e.g. ``("model", "use-flash-attn")``) the schema does not have"""
    origin: dict[tuple[str, str], str]
    """(section, field) -> where the value was written, for error messages"""


def nest_keys(
    data: Mapping[str, Any], where: Callable[[tuple[str, ...]], str] | None = None
) -> Keys:
    """Sort keys (flat or under their section, dash or underscore style) into sections.

    Unknown keys are returned, not raised, so a caller can recognize Megatron flags zerotron
    does not support. ``where(path)`` renders the location of a key path as written (default:
    the dotted path).
    """
    where = where or (lambda path: ".".join(path))
    keys = Keys({}, {}, {})

    def put(section: str, name: str, value: Any, path: tuple[str, ...]) -> None:
        if name in keys.nested.setdefault(section, {}):
            raise ConfigError(
                f"{section}.{name} is given twice", where=where(path), fix="keep one of them"
            )
        keys.nested[section][name] = value
        keys.origin[(section, name)] = where(path)

    for raw_key, value in data.items():
        key = normalize_key(raw_key)
        if key in SECTIONS:
            if value is None:  # an empty YAML section
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"section {key!r} must be a mapping of keys, got {value!r}",
                    where=where((str(raw_key),)),
                    fix=f"write `{key}:` followed by indented `name: value` lines",
                )
            for raw_sub, sub_value in value.items():
                sub = normalize_key(raw_sub)
                path = (str(raw_key), str(raw_sub))
                if sub in SECTIONS[key].model_fields:
                    put(key, sub, sub_value, path)
                elif sub in FIELD_SECTION:
                    right = FIELD_SECTION[sub]
                    raise ConfigError(
                        f"{sub!r} belongs to section {right!r}, not {key!r}",
                        where=where(path),
                        fix=f"move it under `{right}:` or write it at the top level",
                    )
                else:
                    keys.unknown[path] = sub_value
        elif key in FIELD_SECTION:
            put(FIELD_SECTION[key], key, value, (str(raw_key),))
        else:
            keys.unknown[(str(raw_key),)] = value
    return keys


def _validation_error(e: ValidationError, origin: Mapping[tuple[str, str], str]) -> ConfigError:
    """Turn pydantic's report into ours: one line per bad key with where, path and value."""
    lines = []
    for err in e.errors():
        loc = tuple(str(p) for p in err["loc"])
        path = ".".join(loc)
        if err["type"] == "extra_forbidden":
            text = f"{path}: unknown key"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            text = f"{path} = {err['input']!r}: {msg[0].lower()}{msg[1:]}"
        source = origin.get(loc[:2])
        lines.append((source, text))
    if len(lines) == 1:
        (source, text), fix = lines[0], "correct the value"
        return ConfigError(text, where=source, fix=fix)
    what = "invalid values:" + "".join(
        f"\n    {source + ': ' if source else ''}{text}" for source, text in lines
    )
    return ConfigError(what, fix="correct the values named above")


# --------------------------------------------------------------------------------------------
# The config.


def _fill(section: _Section, **values: Any) -> None:
    """Set derived values on a frozen section; only validation may do this."""
    for name, value in values.items():
        object.__setattr__(section, name, value)


def _multiples(value: int, unit: int) -> str:
    lower = value // unit * unit
    return f"{lower} or {lower + unit}" if lower else f"{unit}"


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
            raise _validation_error(e, origin or {}) from None

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
    def lr_decay_steps(self) -> int | None:
        """Length of the LR decay in samples, as Megatron's scheduler counts it (it advances
        by global_batch_size per iteration). None when the run has no length."""
        t, s = self.training, self.scheduler
        if t.train_iters is None:
            return None
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
        return s.lr_warmup_samples

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
        self._check_precision()
        self._resolve_model()
        self._resolve_parallel()
        self._resolve_batch()
        self._resolve_length()
        self._check_checkpoint()
        self._resolve_zero()
        return self

    def _warn(self, message: str) -> None:
        self._warnings.append(message)

    def _check_precision(self) -> None:
        p = self.precision
        if p.fp16 and p.bf16:
            raise ConfigError(
                "fp16 and bf16 are both set",
                where="precision",
                fix="choose one of --fp16 / --bf16",
            )
        if p.min_loss_scale > p.initial_loss_scale:
            raise ConfigError(
                f"min_loss_scale {p.min_loss_scale} is above initial_loss_scale "
                f"{p.initial_loss_scale}",
                where="precision.min_loss_scale",
                fix="lower --min-loss-scale or raise --initial-loss-scale",
            )
        if p.loss_scale is not None and not p.fp16:
            self._warn("loss_scale is used only with fp16; ignored")

    def _resolve_model(self) -> None:
        m = self.model
        if m.hidden_size and m.num_attention_heads and m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"hidden_size {m.hidden_size} is not divisible by num_attention_heads "
                f"{m.num_attention_heads}",
                where="model.hidden_size",
                fix="choose --num-attention-heads dividing --hidden-size, e.g. "
                f"{_divisors_near(m.hidden_size, m.num_attention_heads)}",
            )
        if m.ffn_hidden_size is None and m.hidden_size is not None:
            _fill(m, ffn_hidden_size=4 * m.hidden_size)
        if m.max_position_embeddings is None and m.seq_length is not None:
            _fill(m, max_position_embeddings=m.seq_length)
        if (
            m.max_position_embeddings is not None
            and m.seq_length is not None
            and m.max_position_embeddings < m.seq_length
        ):
            raise ConfigError(
                f"max_position_embeddings {m.max_position_embeddings} is less than seq_length "
                f"{m.seq_length}",
                where="model.max_position_embeddings",
                fix=f"set --max-position-embeddings to at least {m.seq_length}, or shorten "
                "--seq-length",
            )
        if m.recompute_granularity != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(m, name) is not None:
                    raise ConfigError(
                        f"{name} is set but recompute_granularity is {m.recompute_granularity!r}",
                        where=f"model.{name}",
                        fix=f"{name} applies only with --recompute-granularity full",
                    )
            return
        _fill(m, recompute_method=m.recompute_method or "uniform")
        _fill(m, recompute_num_layers=m.recompute_num_layers or 1)
        if m.num_layers is not None and m.recompute_num_layers > m.num_layers:
            raise ConfigError(
                f"recompute_num_layers {m.recompute_num_layers} exceeds num_layers {m.num_layers}",
                where="model.recompute_num_layers",
                fix=f"set --recompute-num-layers to at most {m.num_layers}",
            )

    def _resolve_parallel(self) -> None:
        par, m = self.parallel, self.model
        tp, pp, world = (
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            par.world_size,
        )
        if world % (tp * pp):
            raise ConfigError(
                f"world_size {world} is not divisible by tensor_model_parallel_size {tp} × "
                f"pipeline_model_parallel_size {pp} = {tp * pp}",
                where="parallel.world_size",
                fix=f"launch a multiple of {tp * pp} processes, or change "
                "--tensor-model-parallel-size / --pipeline-model-parallel-size",
            )
        dp = world // (tp * pp)
        if par.data_parallel_size not in (None, dp):
            raise ConfigError(
                f"data_parallel_size {par.data_parallel_size} != world_size {world} / "
                f"(tensor_model_parallel_size {tp} × pipeline_model_parallel_size {pp}) = {dp}",
                where="parallel.data_parallel_size",
                fix="leave data_parallel_size out: it is derived",
            )
        _fill(par, data_parallel_size=dp)
        for name in ("num_attention_heads", "ffn_hidden_size"):
            value = getattr(m, name)
            if value is not None and value % tp:
                raise ConfigError(
                    f"{name} {value} is not divisible by tensor_model_parallel_size {tp}",
                    where=f"model.{name}",
                    fix=f"choose {flag(name)} and --tensor-model-parallel-size so that it is",
                )
        if par.sequence_parallel and tp == 1:
            _fill(par, sequence_parallel=False)
            self._warn("sequence_parallel disabled: it needs tensor_model_parallel_size > 1")
        if par.sequence_parallel and m.seq_length is not None and m.seq_length % tp:
            raise ConfigError(
                f"seq_length {m.seq_length} is not divisible by tensor_model_parallel_size {tp}, "
                "which sequence_parallel needs",
                where="model.seq_length",
                fix=f"use a --seq-length that is a multiple of {tp}",
            )
        if pp > 1 and m.num_layers is not None and m.num_layers % pp:
            raise ConfigError(
                f"num_layers {m.num_layers} is not divisible by pipeline_model_parallel_size {pp}",
                where="model.num_layers",
                fix=f"use a multiple of {pp} layers, or another --pipeline-model-parallel-size",
            )
        self._resolve_virtual_pipeline()
        self._resolve_pipeline_schedule()

    def _resolve_pipeline_schedule(self) -> None:
        """Interleaved exactly when there are virtual stages; 1F1B unless GPipe is asked for."""
        par = self.parallel
        kind, vpp = par.pipeline_schedule, par.virtual_pipeline_model_parallel_size
        where = "parallel.pipeline_schedule"
        if vpp is not None and kind not in (None, "interleaved"):
            raise ConfigError(
                f"pipeline_schedule {kind!r} has one model chunk per stage, but "
                f"num_layers_per_virtual_pipeline_stage gives {vpp} virtual stages per rank",
                where=where,
                fix="drop --pipeline-schedule (virtual stages run the interleaved schedule), or "
                "drop --num-layers-per-virtual-pipeline-stage",
            )
        if vpp is None and kind == "interleaved":
            raise ConfigError(
                "the interleaved schedule needs virtual pipeline stages",
                where=where,
                fix="set --num-layers-per-virtual-pipeline-stage (fewer than the layers per "
                "stage), or use --pipeline-schedule 1f1b",
            )
        if kind is None and par.pipeline_model_parallel_size > 1:
            _fill(par, pipeline_schedule="interleaved" if vpp is not None else "1f1b")

    def _resolve_virtual_pipeline(self) -> None:
        par, m = self.parallel, self.model
        per_stage_layers = par.num_layers_per_virtual_pipeline_stage
        vpp = par.virtual_pipeline_model_parallel_size
        if per_stage_layers is None and vpp is None:
            return
        pp = par.pipeline_model_parallel_size
        if pp < 2:
            raise ConfigError(
                f"virtual pipeline stages need pipeline_model_parallel_size > 1, got {pp}",
                where="parallel.num_layers_per_virtual_pipeline_stage",
                fix="set --pipeline-model-parallel-size, or drop "
                "--num-layers-per-virtual-pipeline-stage",
            )
        if m.num_layers is None:
            raise ConfigError(
                "virtual pipeline stages need num_layers",
                where="model.num_layers",
                fix="set --num-layers",
            )
        layers = m.num_layers // pp
        if per_stage_layers is None:
            if layers % vpp:
                raise ConfigError(
                    f"{layers} layers per pipeline stage do not split into "
                    f"virtual_pipeline_model_parallel_size {vpp} stages",
                    where="parallel.virtual_pipeline_model_parallel_size",
                    fix="choose a divisor of the layers per stage",
                )
            per_stage_layers = layers // vpp
        if layers % per_stage_layers:
            raise ConfigError(
                f"num_layers {m.num_layers} / pipeline_model_parallel_size {pp} = {layers} "
                f"layers per stage is not divisible by num_layers_per_virtual_pipeline_stage "
                f"{per_stage_layers}",
                where="parallel.num_layers_per_virtual_pipeline_stage",
                fix=f"use a divisor of {layers}",
            )
        derived = layers // per_stage_layers
        if vpp is not None and vpp != derived:
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size {vpp} != {layers} layers per stage / "
                f"num_layers_per_virtual_pipeline_stage {per_stage_layers} = {derived}",
                where="parallel.virtual_pipeline_model_parallel_size",
                fix="give only one of them",
            )
        # One virtual stage per rank is the plain (non-interleaved) schedule, as in Megatron.
        _fill(
            par,
            num_layers_per_virtual_pipeline_stage=per_stage_layers,
            virtual_pipeline_model_parallel_size=derived if derived > 1 else None,
        )

    def _resolve_batch(self) -> None:
        """global = micro × data-parallel × accumulation; any two give the third."""
        t = self.training
        dp = self.parallel.data_parallel_size
        mbs, gbs, nmb = t.micro_batch_size, t.global_batch_size, t.num_micro_batches
        where = "training.global_batch_size"
        if mbs is None and gbs is None:
            raise ConfigError(
                "no batch size given",
                where="training.micro_batch_size",
                fix="set --micro-batch-size (and --global-batch-size for gradient accumulation)",
            )
        if mbs is not None and gbs is not None and nmb is not None:
            if gbs != mbs * dp * nmb:
                raise ConfigError(
                    f"global_batch_size {gbs} != micro_batch_size {mbs} × data_parallel_size "
                    f"{dp} × num_micro_batches {nmb} = {mbs * dp * nmb}",
                    where=where,
                    fix="give only two of the three; the third is derived",
                )
        elif mbs is not None and gbs is not None:
            if gbs % (mbs * dp):
                raise ConfigError(
                    f"global_batch_size {gbs} is not divisible by micro_batch_size {mbs} × "
                    f"data_parallel_size {dp} = {mbs * dp}",
                    where=where,
                    fix=f"set --global-batch-size to a multiple of {mbs * dp} (e.g. "
                    f"{_multiples(gbs, mbs * dp)}), or change --micro-batch-size",
                )
            nmb = gbs // (mbs * dp)
        elif mbs is not None:
            nmb = nmb or 1  # Megatron: no global batch size means no accumulation
            gbs = mbs * dp * nmb
        else:
            nmb = nmb or 1
            if gbs % (dp * nmb):
                raise ConfigError(
                    f"global_batch_size {gbs} is not divisible by data_parallel_size {dp} × "
                    f"num_micro_batches {nmb} = {dp * nmb}",
                    where=where,
                    fix=f"set the global batch size to a multiple of {dp * nmb}",
                )
            mbs = gbs // (dp * nmb)
        _fill(t, micro_batch_size=mbs, global_batch_size=gbs, num_micro_batches=nmb)
        vpp = self.parallel.virtual_pipeline_model_parallel_size
        pp = self.parallel.pipeline_model_parallel_size
        if vpp is not None and nmb % pp:
            raise ConfigError(
                f"the interleaved schedule needs num_micro_batches {nmb} (global_batch_size "
                f"{gbs} / (micro_batch_size {mbs} × data_parallel_size {dp})) to be divisible "
                f"by pipeline_model_parallel_size {pp}",
                where="training.global_batch_size",
                fix=f"use a global batch size giving a multiple of {pp} micro-batches, or drop "
                "--num-layers-per-virtual-pipeline-stage",
            )

    def _resolve_length(self) -> None:
        """train_iters / train_samples and the LR schedule lengths, as Megatron resolves them."""
        t, s, o = self.training, self.scheduler, self.optimizer
        gbs = t.global_batch_size
        if o.lr is not None and o.min_lr > o.lr:
            raise ConfigError(
                f"min_lr {o.min_lr} is above lr {o.lr}",
                where="optimizer.min_lr",
                fix="set --min-lr at or below --lr",
            )
        self._resolve_weight_decay()
        if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set",
                where="scheduler",
                fix="choose where the schedule comes from on resume: flags or checkpoint",
            )
        if t.train_iters is not None and t.train_samples is not None:
            raise ConfigError(
                f"train_iters {t.train_iters} and train_samples {t.train_samples} are both set",
                where="training.train_iters",
                fix="give the length of training once: --train-iters or --train-samples",
            )
        if t.train_samples is not None:
            self._check_unused("sample-based", lr_decay_iters=None, lr_warmup_iters=0)
            if s.lr_warmup_fraction is not None and s.lr_warmup_samples:
                raise _both_warmups("lr_warmup_samples", s.lr_warmup_samples, s)
            iters = t.train_samples // gbs  # Megatron rounds down
            if iters == 0:
                raise ConfigError(
                    f"train_samples {t.train_samples} is less than one global batch "
                    f"({gbs} samples)",
                    where="training.train_samples",
                    fix=f"train for at least {gbs} samples",
                )
            if t.train_samples % gbs:
                self._warn(
                    f"train_samples {t.train_samples} is not a multiple of global_batch_size "
                    f"{gbs}: training runs {iters} iterations ({iters * gbs} samples)"
                )
            _fill(t, train_iters=iters)
            _fill(s, lr_decay_samples=s.lr_decay_samples or t.train_samples)
        elif t.train_iters is not None:
            self._check_unused("iteration-based", lr_decay_samples=None, lr_warmup_samples=0)
            if s.lr_warmup_fraction is not None and s.lr_warmup_iters:
                raise _both_warmups("lr_warmup_iters", s.lr_warmup_iters, s)
            _fill(t, train_samples=t.train_iters * gbs)
            decay_iters = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters
            _fill(
                s,
                lr_decay_iters=decay_iters,
                lr_decay_samples=decay_iters * gbs,
                lr_warmup_samples=s.lr_warmup_iters * gbs,
            )
        else:
            return
        decay, warmup = self.lr_decay_steps, self.lr_warmup_steps
        if t.train_iters and s.lr_decay_style != "constant" and decay == 0:
            raise ConfigError(
                "the learning rate decays over 0 samples",
                where="scheduler.lr_decay_iters",
                fix="set --lr-decay-iters > 0, or --lr-decay-style constant",
            )
        if t.train_iters and decay and warmup >= decay:
            raise ConfigError(
                f"the warmup ({warmup:g} samples) is not shorter than the decay ({decay} samples)",
                where="scheduler",
                fix="shorten --lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction, or "
                "lengthen --lr-decay-iters / --lr-decay-samples",
            )

    def _resolve_weight_decay(self) -> None:
        """Megatron: a constant style takes weight_decay; the others need start and end."""
        o = self.optimizer
        given = [n for n in ("start_weight_decay", "end_weight_decay") if getattr(o, n) is not None]
        if o.weight_decay_incr_style == "constant":
            if given:
                raise ConfigError(
                    f"{given[0]} is set but weight_decay_incr_style is 'constant'",
                    where=f"optimizer.{given[0]}",
                    fix="use --weight-decay, or set --weight-decay-incr-style linear/cosine",
                )
            _fill(o, start_weight_decay=o.weight_decay, end_weight_decay=o.weight_decay)
        elif len(given) < 2:
            raise ConfigError(
                f"weight_decay_incr_style {o.weight_decay_incr_style!r} needs "
                "start_weight_decay and end_weight_decay",
                where="optimizer.weight_decay_incr_style",
                fix="set --start-weight-decay and --end-weight-decay",
            )

    def _check_unused(self, mode: str, **expected: Any) -> None:
        """In one mode (iteration- or sample-based) the other mode's knobs must stay unset."""
        for name, default in expected.items():
            value = self._inputs["scheduler"][name]
            if value != default:
                other = "--train-samples" if mode == "sample-based" else "--train-iters"
                raise ConfigError(
                    f"{name} {value} is set, but training is {mode} ({other})",
                    where=f"scheduler.{name}",
                    fix=f"use the {mode} counterpart of {flag(name)}",
                )

    def _check_checkpoint(self) -> None:
        c = self.checkpoint
        if c.save is not None and c.save_interval is None:
            raise ConfigError(
                f"save {c.save!r} is set without save_interval",
                where="checkpoint.save_interval",
                fix="set --save-interval N (a checkpoint is also written at the end)",
            )

    def _resolve_zero(self) -> None:
        """DeepSpeed's rules for ZeRO: what each stage allows, overlap_comm's default."""
        z, pp = self.zero, self.parallel.pipeline_model_parallel_size
        stage = z.zero_stage
        if stage >= 2 and pp > 1:
            raise UnsupportedError(
                f"ZeRO stage {stage} with pipeline parallelism (pipeline_model_parallel_size "
                f"{pp}): gradients and parameters partitioned across data-parallel ranks do not "
                "compose with the pipeline's micro-batch gradient accumulation (DeepSpeed refuses "
                "it too)",
                where="zero.zero_stage",
                fix="use ZeRO stage 1 (or 0) with pipeline parallelism",
            )
        if z.offload_optimizer and stage == 0:
            raise ConfigError(
                f"offload_optimizer.device {z.offload_optimizer_device!r} needs ZeRO stage 1, 2 "
                "or 3 (stage 0 keeps no partitioned optimizer state to offload)",
                where="zero.offload_optimizer_device",
                fix="set zero_optimization.stage >= 1, or offload_optimizer.device none",
            )
        if z.offload_param and stage != 3:
            raise ConfigError(
                f"offload_param.device {z.offload_param_device!r} needs ZeRO stage 3 (only stage "
                f"3 partitions parameters); stage is {stage}",
                where="zero.offload_param_device",
                fix="set zero_optimization.stage 3, or offload_param.device none",
            )
        for kind in ("optimizer", "param"):
            device = getattr(z, f"offload_{kind}_device")
            if device == "nvme" and not getattr(z, f"offload_{kind}_nvme_path"):
                raise ConfigError(
                    f"offload_{kind}.device 'nvme' needs nvme_path",
                    where=f"zero.offload_{kind}_nvme_path",
                    fix=f"set zero_optimization.offload_{kind}.nvme_path to a directory on a "
                    "fast local disk",
                )
        if z.overlap_comm is None:
            _fill(z, overlap_comm=stage == 3)
        if stage >= 1 and self.optimizer.optimizer == "lamb":
            raise UnsupportedError(
                "Lamb under ZeRO: its trust ratio needs each whole tensor's norm, but ZeRO steps "
                "flat partitions that cut tensors apart",
                where="optimizer.optimizer",
                fix="use Lamb with zero_optimization.stage 0, or Adam/AdamW with ZeRO",
            )


def _both_warmups(name: str, value: int, s: SchedulerConfig) -> ConfigError:
    return ConfigError(
        f"lr_warmup_fraction {s.lr_warmup_fraction} and {name} {value} are both set",
        where="scheduler.lr_warmup_fraction",
        fix=f"give one of --lr-warmup-fraction / {flag(name)}",
    )


def _divisors_near(n: int, target: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    divisors.sort(key=lambda d: (abs(d - target), d))
    return " or ".join(str(d) for d in sorted(divisors[:2]))


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
