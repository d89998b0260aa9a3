"""Megatron-LM's flags as a table onto the one schema.

Every schema field is its own flag (Megatron's name in dash style, ``--global-batch-size``)
except :data:`NOT_FLAGS`; :data:`ALIASES` adds other spellings, :data:`SHORTHANDS` the flags
that set a field to a constant. :data:`UNSUPPORTED` lists Megatron flags zerotron knows but
does not implement (an error saying so), :data:`IGNORED` those that only tune what zerotron does
not have (a warning). The parser built from these tables is :mod:`zerotron.config.megatron`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

PROG = "zerotron pretrain"

NOT_FLAGS = {
    "world_size": "set by the launcher",
    "data_parallel_size": "derived: world_size / (tensor x pipeline parallel size)",
    "virtual_pipeline_model_parallel_size": "derived from --num-layers-per-virtual-pipeline-stage",
    "num_micro_batches": "derived: global / (micro batch size x data-parallel size)",
    "lr_scheduler_params": "a mapping: give it in a --config or --deepspeed_config file",
    "autotuning_arg_mappings": "a mapping: give it in a --deepspeed_config file",
}
"""Schema fields that have no flag (a config file may still give them, to be checked)."""

ALIASES = {
    "layernorm_epsilon": ("--norm-epsilon",),
    "offload_optimizer_device": ("--zero-offload-optimizer",),
    "offload_param_device": ("--zero-offload-param",),
    "save_on_signal": ("--exit-signal-handler",),
}
"""Other Megatron spellings of a flag (newer Megatron renamed --layernorm-epsilon)."""

UNSUPPORTED_CHOICES = {
    "lr_decay_style": ("WSD",),
    "optimizer": ("muon", "dist_muon"),
}
"""Megatron values of a supported flag that zerotron does not implement."""

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")
"""What `zerotron pretrain` cannot run without (Megatron asserts the same)."""


class Shorthand(NamedTuple):
    """A flag that sets schema field ``field`` to ``value``."""

    field: str
    value: Any
    help: str
    section: str | None
    """the --help group it is listed in (None: the top level)"""


SHORTHANDS: dict[str, Shorthand] = {
    "--recompute-activations": Shorthand(
        "recompute_granularity",
        "selective",
        "same as --recompute-granularity selective (Megatron's shorthand)",
        "model",
    ),
    "--use-distributed-optimizer": Shorthand(
        "zero_stage",
        1,
        "Megatron's distributed optimizer: fp32 master weights and optimizer states "
        "sharded over data-parallel ranks, i.e. ZeRO stage 1 (same as --zero-stage 1)",
        None,
    ),
}
"""Megatron's flags that stand for a value of another field."""


class Known(NamedTuple):
    """A Megatron flag zerotron recognizes without implementing it."""

    takes_value: bool
    why: str
    ok: tuple[str, ...] = ()
    """values that ask for what zerotron does anyway (e.g. --context-parallel-size 1)"""


_GPT2 = "zerotron implements the GPT-2 architecture"
_PROFILE = (
    "Megatron's nsys / torch profiler switches are not implemented; --profile-steps A:B records "
    "steps A..B on every rank into a Chrome trace and the measured pipeline timeline "
    "(docs/profiling.md)"
)
UNSUPPORTED: dict[str, Known] = {
    "--num-experts": Known(True, "mixture-of-experts models are not implemented", ("0",)),
    "--expert-model-parallel-size": Known(True, "expert parallelism is not implemented", ("1",)),
    "--context-parallel-size": Known(
        True,
        "context parallelism is not implemented; for long sequences use tensor parallelism "
        "with --sequence-parallel",
        ("1",),
    ),
    "--swiglu": Known(False, f"SwiGLU is not implemented: {_GPT2} (GELU MLP)"),
    "--squared-relu": Known(False, f"squared ReLU is not implemented: {_GPT2} (GELU MLP)"),
    "--group-query-attention": Known(False, "grouped-query attention is not implemented"),
    "--num-query-groups": Known(True, "grouped-query attention is not implemented"),
    "--untie-embeddings-and-output-weights": Known(
        False, f"untied output weights are not implemented: {_GPT2} (tied embeddings)"
    ),
    "--position-embedding-type": Known(
        True, f"only learned absolute position embeddings exist: {_GPT2}", ("learned_absolute",)
    ),
    "--use-rotary-position-embeddings": Known(
        False, f"rotary embeddings are not implemented: {_GPT2}"
    ),
    "--normalization": Known(True, f"only LayerNorm is implemented: {_GPT2}", ("LayerNorm",)),
    "--disable-bias-linear": Known(False, f"linear layers always have biases: {_GPT2}"),
    "--apply-residual-connection-post-layernorm": Known(
        False, f"only pre-LayerNorm blocks are implemented: {_GPT2}"
    ),
    "--transformer-impl": Known(
        True, "Transformer Engine is not used: the layers are plain PyTorch", ("local",)
    ),
    "--fp8-format": Known(True, "FP8 training is not implemented; use --bf16 or --fp16"),
    "--use-torch-fsdp2": Known(False, "FSDP2 is not used (ZeRO stage 3 is the same idea)"),
    "--rampup-batch-size": Known(True, "batch-size ramp-up is not implemented"),
    "--train-data-path": Known(True, "per-split data paths are not implemented; use --data-path"),
    "--valid-data-path": Known(True, "per-split data paths are not implemented; use --data-path"),
    "--test-data-path": Known(True, "per-split data paths are not implemented; use --data-path"),
    "--dataloader-type": Known(
        True, "only Megatron's default single-pass sampler is implemented", ("single",)
    ),
    "--ckpt-format": Known(
        True, "checkpoints use Megatron's torch layout (--ckpt-format torch) only", ("torch",)
    ),
    "--use-dist-ckpt": Known(False, "distributed checkpoints are not implemented"),
    "--tokenizer-model": Known(True, "SentencePiece/HF tokenizer models are not supported"),
    "--profile": Known(False, _PROFILE),
    "--use-pytorch-profiler": Known(False, _PROFILE),
    "--profile-step-start": Known(True, _PROFILE),
    "--profile-step-end": Known(True, _PROFILE),
    "--profile-ranks": Known(True, _PROFILE),
    "--checkpoint-activations": Known(
        False, "removed from Megatron-LM; use --recompute-granularity full"
    ),
    "--batch-size": Known(True, "removed from Megatron-LM; use --micro-batch-size"),
    "--warmup": Known(True, "removed from Megatron-LM; use --lr-warmup-fraction"),
    "--model-parallel-size": Known(
        True, "removed from Megatron-LM; use --tensor-model-parallel-size"
    ),
}
"""Megatron (and DeepSpeed-Megatron) flags zerotron knows but does not implement."""

_NO_KERNELS = "zerotron has no fused kernels to switch"
IGNORED: dict[str, Known] = {
    "--use-mcore-models": Known(False, "zerotron has one GPT implementation"),
    "--use-legacy-models": Known(False, "zerotron has one GPT implementation"),
    "--no-masked-softmax-fusion": Known(False, _NO_KERNELS),
    "--no-bias-gelu-fusion": Known(False, _NO_KERNELS),
    "--no-bias-dropout-fusion": Known(False, _NO_KERNELS),
    "--no-gradient-accumulation-fusion": Known(False, _NO_KERNELS),
    "--no-persist-layer-norm": Known(False, _NO_KERNELS),
    "--no-async-tensor-model-parallel-allreduce": Known(False, "deprecated in Megatron-LM too"),
    "--attention-softmax-in-fp32": Known(False, "softmax runs inside scaled_dot_product_attention"),
    "--use-cpu-initialization": Known(
        False, "weights are always initialized whole and then split across tensor-parallel ranks"
    ),
    "--distributed-backend": Known(
        True, "the backend follows the device: nccl on CUDA, gloo on CPU"
    ),
    "--overlap-grad-reduce": Known(
        False, "data-parallel buckets are always reduced while backward runs"
    ),
    "--overlap-param-gather": Known(
        False,
        "the distributed optimizer's (ZeRO-1's) parameter all-gathers run bucketed and "
        "concurrent at the end of its step, not overlapped with the next forward",
    ),
    "--tp-comm-overlap": Known(
        False,
        "the column-parallel backward always overlaps its all-reduce (reduce-scatter with "
        "--sequence-parallel) with the weight-gradient matmul, as Megatron's async all-reduce "
        "does; Transformer Engine's userbuffer GEMM overlap is not implemented",
    ),
    "--log-throughput": Known(False, "tokens/s and TFLOP/s are always logged"),
    "--timing-log-level": Known(True, "the timers line is always logged"),
    "--empty-unused-memory-level": Known(True, "the CUDA cache is left to PyTorch"),
}
"""Megatron flags that only tune what zerotron does not have; accepted with a warning."""
