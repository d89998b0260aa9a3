"""The sections around the training step: ``checkpoint`` (where checkpoints go, what they
carry), ``activation_checkpointing`` (DeepSpeed's recompute options) and ``monitor``
(DeepSpeed's tensorboard, wandb and csv monitors, wall-clock timers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from zerotron.config.sections.base import Int, Section
from zerotron.errors import ConfigError


class CheckpointConfig(Section):
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
    use_checkpoint_args: bool = Field(
        False,
        description="Take the model's shape (layers, hidden size, heads, FFN size, sequence "
        "length, position embeddings, LayerNorm epsilon) and tokenizer type from the --load "
        "checkpoint where neither the command line nor the config file gives them.",
    )
    reset_iteration: bool = Field(
        False,
        description="After loading, count iterations and consumed samples from 0; the weights, "
        "optimizer and LR schedule load as usual (Megatron-DeepSpeed's).",
    )
    use_mp_args_from_checkpoint_args: bool = Field(
        False,
        description="With use_checkpoint_args, also the tensor- and pipeline-parallel sizes of "
        "the checkpoint, over the flags (Megatron's).",
    )
    exit_on_missing_checkpoint: bool = Field(
        False, description="With --load, stop if no checkpoint is found instead of starting fresh."
    )
    save_on_signal: bool = Field(
        False,
        description="On SIGTERM or SIGUSR1 (a scheduler's warning before preemption), every rank "
        "finishes its iteration, saves a checkpoint to save and exits with code 75 "
        "(Megatron's exit_signal_handler).",
    )
    save_keep_last: Int | None = Field(
        None,
        gt=0,
        description="Keep only the N newest complete checkpoints under save (older tags are "
        "deleted after each new one is committed; the one the tracker names is always kept).",
    )
    async_save: bool = Field(
        False,
        description="Write checkpoints in the background: training goes on while a snapshot "
        "is persisted; the tag is committed once every rank has written (Megatron's "
        "--async-save; DeepSpeed's checkpoint.writer.decoupled).",
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
    load_universal: bool = Field(
        False,
        description="Engine.load_checkpoint reads DeepSpeed universal checkpoints "
        "(ds_to_universal.py's output; the tag from latest_universal) and only those "
        "(DeepSpeed's checkpoint.load_universal).",
    )


class ActivationCheckpointingConfig(Section):
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


class MonitorConfig(Section):
    """DeepSpeed's monitors (tensorboard, wandb, csv_monitor) and wall-clock timers."""

    tensorboard_enabled: bool = Field(False, description="Write TensorBoard events.")
    tensorboard_output_path: str = Field("", description="Directory of TensorBoard events.")
    tensorboard_job_name: str = Field(
        "DeepSpeedJobName", description="Subdirectory of tensorboard_output_path."
    )
    wandb_enabled: bool = Field(False, description="Log to Weights & Biases.")
    wandb_group: str | None = Field(None, description="W&B group.")
    wandb_team: str | None = Field(None, description="W&B team (entity).")
    wandb_project: str = Field(
        "deepspeed",
        description="W&B project (Megatron's --wandb-project on the command line also turns "
        "W&B on).",
    )
    wandb_exp_name: str | None = Field(None, description="W&B run name.")
    wandb_save_dir: str | None = Field(None, description="Directory of W&B's local files.")
    csv_monitor_enabled: bool = Field(False, description="Write metrics to CSV files.")
    csv_monitor_output_path: str = Field("", description="Directory of the CSV files.")
    csv_monitor_job_name: str = Field(
        "DeepSpeedJobName", description="Subdirectory of csv_monitor_output_path."
    )
    wall_clock_breakdown: bool = Field(
        False, description="Time forward, backward and step on every rank and log them."
    )
    profile_steps: str | None = Field(
        None,
        description="Record steps A:B (e.g. 5:6; counted from 1) on every rank: forwards, "
        "backwards, sends/receives and collectives into a Chrome trace (trace.json), the "
        "measured pipeline timeline (figures/pipeline_timeline.png) and its bubble.",
    )
    profile_dir: str | None = Field(
        None,
        description="Where --profile-steps writes (default: the metrics directory, else --save).",
    )

    @field_validator("profile_steps")
    @classmethod
    def _check_profile_steps(cls, value: str | None) -> str | None:
        if value is not None:
            parse_steps(value)
        return value

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(A, B) of profile_steps, None when not profiling."""
        return None if self.profile_steps is None else parse_steps(self.profile_steps)


def parse_steps(text: str, where: str = "monitor.profile_steps") -> tuple[int, int]:
    """``"A:B"`` (or ``"A"``: one step) -> (A, B) with 1 <= A <= B."""
    parts = str(text).strip().split(":")
    first, last = 0, -1
    if len(parts) <= 2 and all(p.strip().isdigit() for p in parts):
        first, last = int(parts[0]), int(parts[-1])
    if not 1 <= first <= last:
        raise ConfigError(
            f"{text!r} is not a range A:B of steps with 1 <= A <= B",
            where=where,
            fix="give the first and last step to record, e.g. 5:6 (steps count from 1)",
        )
    return first, last
