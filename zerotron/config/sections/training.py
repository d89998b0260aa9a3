"""The sections of a run's length and update rule: ``training`` (batch sizes, length,
intervals, seed), ``optimizer`` and ``scheduler`` (Megatron's semantics and defaults)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from zerotron.config.sections.base import Float, Int, Section


class TrainingConfig(Section):
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
    rampup_batch_size: list[Int] | None = Field(
        None,
        description="START INCREMENT SAMPLES: the global batch size starts at START and grows "
        "by INCREMENT over SAMPLES samples up to global_batch_size (Megatron-LM's linear "
        "ramp-up).",
    )
    step_batch_size_schedule: str | None = Field(
        None,
        description="'THRESHOLD:SIZE ...': the global batch size from each THRESHOLD tokens on "
        "(suffixes K, M, B, T; the first at 0), e.g. '0:16 2.4B:320'; the last size is "
        "global_batch_size.",
    )
    train_iters: Int | None = Field(
        None, ge=0, description="Iterations (optimizer steps) to train for over all runs."
    )
    train_samples: Int | None = Field(
        None, gt=0, description="Samples to train for over all runs (instead of train_iters)."
    )
    train_tokens: Int | None = Field(
        None,
        gt=0,
        description="Stop once this many tokens are consumed, if before the end of train_iters "
        "or train_samples (Megatron-DeepSpeed's).",
    )
    exit_interval: Int | None = Field(
        None, gt=0, description="Exit after an iteration divisible by this."
    )
    exit_duration_in_mins: Int | None = Field(
        None, gt=0, description="Exit after this many minutes."
    )
    kill_switch_file: str | None = Field(
        None,
        description="Exit, saving a checkpoint with --save, once this file exists; checked "
        "before training and after every iteration (Megatron-DeepSpeed's).",
    )
    seed: Int = Field(1234, ge=0, description="Seed for python, numpy, torch.")
    eval_interval: Int = Field(1000, gt=0, description="Iterations between evaluations.")
    eval_iters: Int = Field(100, ge=0, description="Iterations per evaluation (0: none).")
    log_interval: Int = Field(100, gt=0, description="Iterations between log lines.")
    tensorboard_dir: str | None = Field(None, description="Write TensorBoard events here.")
    log_validation_ppl_to_tensorboard: bool = Field(
        False, description="Also write the validation perplexity ('lm loss validation ppl')."
    )
    memory_breakdown_step: Int | None = Field(
        None,
        gt=0,
        description="Measure what each rank holds at iteration N, per term of zerotron "
        "estimate (parameters, gradients, masters, optimizer states, activations, buffers): a "
        "memory record in the metrics file, figures/memory_breakdown.png, and `zerotron "
        "estimate --compare RUN_DIR` beside the estimate. Costs nothing on other steps.",
    )
    metrics_dir: str | None = Field(
        None,
        description="Write the run's metrics file (metrics/rank<R>.jsonl, read by zerotron "
        "report) here; default: the --save directory (none without either).",
    )
    peak_tflops: Float | None = Field(
        None,
        gt=0,
        description="Peak TFLOP/s of one rank for the MFU in the metrics file; default: the "
        "GPU's dense 16-bit tensor-core peak (fp32: its fp32 peak) from a table, on CPU a short "
        "matmul probe.",
    )
    check_for_nan_in_loss_and_grad: bool = Field(
        True,
        description="Stop with an error naming the iteration when the loss or the gradient "
        "norm is NaN/Inf (Megatron's check); off: go on, counting such iterations as nan "
        "iterations.",
    )


class OptimizerConfig(Section):
    """Optimizer and gradient clipping. Megatron's 'adam' is AdamW (decoupled weight decay)."""

    optimizer: Literal["adam", "adamw", "sgd", "lamb", "lion", "adagrad"] = Field(
        "adam",
        description="adam (AdamW unless adam_w_mode is off, as in Megatron and DeepSpeed), adamw, "
        "sgd, lamb, lion or adagrad (DeepSpeed's Lamb, Lion and Adagrad).",
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
    # One field per hyperparameter, shared by the optimizers that have it (DeepSpeed's "betas"
    # and "eps" mean the same for each), so a config switches optimizer without renaming keys.
    adam_beta1: Float = Field(0.9, ge=0, lt=1, description="Adam beta1 (Lamb's and Lion's too).")
    adam_beta2: Float = Field(0.999, ge=0, lt=1, description="Adam beta2 (Lamb's and Lion's too).")
    adam_eps: Float = Field(
        1e-8,
        gt=0,
        description="Adam epsilon (Lamb's and Adagrad's too; a DeepSpeed config's Adagrad "
        "defaults it to 1e-10).",
    )
    sgd_momentum: Float = Field(0.9, ge=0, description="SGD momentum.")
    sgd_nesterov: bool = Field(False, description="Nesterov momentum for SGD.")
    adam_w_mode: bool = Field(
        True,
        description="With optimizer adam: decoupled weight decay (AdamW); off gives Adam with "
        "L2-coupled decay (DeepSpeed's adam_w_mode).",
    )
    lamb_max_coeff: Float = Field(10.0, gt=0, description="Lamb: upper bound of the trust ratio.")
    lamb_min_coeff: Float = Field(0.01, ge=0, description="Lamb: lower bound of the trust ratio.")


class SchedulerConfig(Section):
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
    lr_decay_tokens: Int | None = Field(
        None,
        gt=0,
        description="Tokens to decay over, in place of iterations or samples "
        "(Megatron-DeepSpeed's; tokens are samples x seq_length).",
    )
    lr_warmup_tokens: Int | None = Field(
        None, ge=0, description="Tokens of linear warmup (Megatron-DeepSpeed's)."
    )
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
