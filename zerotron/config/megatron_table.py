"""Megatron-LM's flags as a table onto the one schema.

Every schema field is its own flag (Megatron's name in dash style, ``--global-batch-size``)
except :data:`NOT_FLAGS`; :data:`ALIASES` adds other spellings, :data:`SHORTHANDS` the flags
that set a field to a constant. :data:`UNSUPPORTED` lists Megatron flags zerotron knows but
does not implement (an error saying so), :data:`IGNORED` those that only tune what zerotron does
not have (a warning). The parser built from these tables is :mod:`zerotron.config.megatron`.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, NamedTuple

PROG = "zerotron pretrain"

NOT_FLAGS = {
    "world_size": "set by the launcher",
    "data_parallel_size": "derived: world_size / (tensor x pipeline parallel size)",
    "virtual_pipeline_model_parallel_size": "derived from --num-layers-per-virtual-pipeline-stage",
    "num_micro_batches": "derived: global / (micro batch size x data-parallel size)",
    "lr_scheduler_params": "a mapping: give it in a --config or --deepspeed_config file",
    "autotuning_arg_mappings": "a mapping: give it in a --deepspeed_config file",
    "load_universal": "DeepSpeed's universal checkpoints load through zerotron.initialize's engine",
}
"""Schema fields that have no flag (a config file may still give them, to be checked)."""

ALIASES = {
    "layernorm_epsilon": ("--norm-epsilon",),
    "offload_optimizer_device": ("--zero-offload-optimizer",),
    "offload_param_device": ("--zero-offload-param",),
    "save_on_signal": ("--exit-signal-handler",),
    "wandb_team": ("--wandb-entity",),
    # Megatron-DeepSpeed's spellings
    "override_opt_param_scheduler": ("--override-opt_param-scheduler",),
    "use_flash_attn": (
        "--use-flash-attn-v1",
        "--use-flash-attn-v2",
        "--use-flash-attn-triton",
        "--use-flash-attn-builder",
    ),
    "cpu_checkpointing": ("--checkpoint-in-cpu",),
    "contiguous_memory_optimization": ("--contigious-checkpointing",),
    "synchronize_checkpoint_boundary": ("--synchronize-each-layer",),
    "checkpointing_profile": ("--profile-backward",),
}
"""Other Megatron spellings of a flag (newer Megatron renamed --layernorm-epsilon), and
Megatron-DeepSpeed's."""

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
    warned: tuple[str, ...] = ()
    """values taken with ``warning`` ("" for a flag without a value)"""
    warning: str = ""
    """what zerotron does instead of what a ``warned`` value asks"""


_GPT2 = "zerotron implements the GPT-2 architecture"
_PROFILE = (
    "Megatron's nsys / torch profiler switches are not implemented; --profile-steps A:B records "
    "steps A..B on every rank into a Chrome trace and the measured pipeline timeline "
    "(docs/profiling.md)"
)
_TORCH_DIST = (
    "zerotron saves Megatron's torch layout (mp_rank_*/model_optim_rng.pt and its metadata.json); "
    "--load reads torch_dist checkpoints Megatron-LM wrote, and `zerotron convert --to-megatron "
    "DIR --megatron-format torch_dist` writes one"
)
UNSUPPORTED: dict[str, Known] = {
    "--num-experts": Known(True, "mixture-of-experts models are not implemented", ("0", "1")),
    "--moe-expert-parallel-size": Known(True, "expert parallelism is not implemented", ("1",)),
    "--ds-sequence-parallel-size": Known(
        True,
        "DeepSpeed-Ulysses sequence parallelism is not implemented; Megatron's "
        "--sequence-parallel with tensor parallelism is",
        ("1",),
    ),
    "--data-impl": Known(True, "zerotron reads Megatron's mmap .bin/.idx files", ("mmap", "infer")),
    "--mlp-type": Known(True, "residual (PR-MoE) MLPs are not implemented", ("standard",)),
    "--universal-checkpoint": Known(
        False,
        "zerotron pretrain loads zerotron's and Megatron-LM's checkpoints; DeepSpeed's universal "
        "checkpoints load through the DeepSpeed API (import zerotron as deepspeed, "
        "docs/checkpoints.md)",
    ),
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
    "--dataloader-type": Known(
        True, "only Megatron's default single-pass sampler is implemented", ("single",)
    ),
    "--ckpt-format": Known(
        True,
        "zerotron saves Megatron's torch layout (--ckpt-format torch)",
        ok=("torch",),
        warned=("torch_dist",),
        warning=_TORCH_DIST,
    ),
    "--use-dist-ckpt": Known(False, "", warned=("",), warning=_TORCH_DIST),
    "--tokenizer-model": Known(True, "SentencePiece/HF tokenizer models are not supported"),
    "--profile": Known(False, _PROFILE),
    "--use-pytorch-profiler": Known(False, _PROFILE),
    "--profile-step-start": Known(True, _PROFILE),
    "--profile-step-end": Known(True, _PROFILE),
    "--profile-ranks": Known(True, _PROFILE),
    "--batch-size": Known(True, "removed from Megatron-LM; use --micro-batch-size"),
    "--warmup": Known(True, "removed from Megatron-LM; use --lr-warmup-fraction"),
    "--model-parallel-size": Known(
        True, "removed from Megatron-LM; use --tensor-model-parallel-size"
    ),
    "--exit-signal": Known(
        True,
        "--exit-signal-handler (--save-on-signal) saves on SIGTERM or SIGUSR1, not others",
        ("SIGTERM", "SIGUSR1"),
    ),
}
"""Megatron (and DeepSpeed-Megatron) flags zerotron knows but does not implement."""


@functools.cache
def _flag_table(name: str) -> dict[str, tuple[bool, str]]:
    text = resources.files("zerotron.config").joinpath(name).read_text()
    flags = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            flag_name, takes_value, group = line.split("\t")
            flags[flag_name] = (takes_value == "1", group)
    return flags


@functools.cache
def megatron_lm_flags() -> dict[str, tuple[bool, str]]:
    """Every flag of Megatron-LM's parser: ``{flag: (takes a value, its option group)}``, from
    ``megatron_lm_flags.tsv`` (generated by ``tests/fixtures/megatron/make_megatron_flags.py``)."""
    return _flag_table("megatron_lm_flags.tsv")


@functools.cache
def megatron_deepspeed_flags() -> dict[str, tuple[bool, str]]:
    """The flags of Megatron-DeepSpeed's parser that Megatron-LM's lacks, as
    :func:`megatron_lm_flags` (``megatron_deepspeed_flags.tsv``, generated by
    ``tests/fixtures/megatron/make_megatron_deepspeed_flags.py``)."""
    return _flag_table("megatron_deepspeed_flags.tsv")


def not_implemented(name: str) -> Known | None:
    """The refusal of a flag of Megatron-LM's or Megatron-DeepSpeed's parser
    (:func:`megatron_lm_flags`, :func:`megatron_deepspeed_flags`) that zerotron neither
    implements nor ignores, naming its project and option group; None for a flag neither has
    (a typo: an unknown flag)."""
    for project, flags in (
        ("Megatron-LM", megatron_lm_flags()),
        ("Megatron-DeepSpeed", megatron_deepspeed_flags()),
    ):
        if name in flags:
            takes_value, group = flags[name]
            return Known(
                takes_value,
                f"one of {project}'s {group!r} options that zerotron does not implement; "
                f"`{PROG} --help` lists the flags it does",
            )
    return None


_NO_KERNELS = "zerotron has no fused kernels to switch"
_OWN_LOSS = "the output layer's loss is zerotron's own (fused and chunked on the CPU)"
_OVERLAP = "zerotron's data-parallel buckets keep their own order and overlap"
_P2P = "pipeline sends and receives are posted as zerotron's schedule plans them"
_GC = "Python's garbage collector runs as usual"
_TORCH_CKPT = "checkpoints use Megatron's torch layout, which these torch_dist options do not tune"
_LOGGED = (
    "zerotron logs loss, learning rate, loss scale, grad norm, tokens/s, TFLOP/s and memory, "
    "and TensorBoard gets loss, learning rate, loss scale, grad norm and validation loss"
)
_DENSE = "a mixture-of-experts setting, and zerotron's models are dense (--num-experts 1)"
_DS_CKPT = (
    "zerotron's recompute is DeepSpeed's activation checkpointing here (--checkpoint-activations "
    "or --recompute-granularity; --partition-activations, --checkpoint-in-cpu, ...)"
)
IGNORED: dict[str, Known] = {
    # Megatron-DeepSpeed's
    "--moe-loss-coeff": Known(True, _DENSE),
    "--moe-train-capacity-factor": Known(True, _DENSE),
    "--moe-eval-capacity-factor": Known(True, _DENSE),
    "--moe-min-capacity": Known(True, _DENSE),
    "--create-moe-param-group": Known(False, _DENSE),
    "--disable-moe-token-dropping": Known(False, _DENSE),
    "--disable-moe-top2-2nd-expert-sampling": Known(False, _DENSE),
    "--topk": Known(True, _DENSE),
    "--expert-interval": Known(True, _DENSE),
    "--deepspeed-activation-checkpointing": Known(False, _DS_CKPT),
    "--log-batch-size-to-tensorboard": Known(False, _LOGGED),
    "--log-optimizer-states-to-tensorboard": Known(False, _LOGGED),
    "--no-log-learnig-rate-to-tensorboard": Known(False, _LOGGED),
    "--DDP-impl": Known(True, _OVERLAP),
    "--no-contiguous-buffers-in-local-ddp": Known(False, _OVERLAP),
    "--no-scatter-gather-tensors-in-pipeline": Known(False, _P2P),
    "--disable-mem-efficient-ln": Known(False, _NO_KERNELS),
    "--no-query-key-layer-scaling": Known(
        False, "attention scores are computed in fp32 or by SDPA, with no layer scaling to undo"
    ),
    "--mmap-warmup": Known(False, "the .bin files are memory-mapped and read as needed"),
    "--no-load-lr-state": Known(False, "Megatron-DeepSpeed defines it but never reads it"),
    "--use-mcore-models": Known(False, "zerotron has one GPT implementation"),
    "--auto-detect-ckpt-format": Known(
        False, "--load tells zerotron's and Megatron-LM's torch and torch_dist checkpoints apart"
    ),
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
    "--tp-comm-overlap-cfg": Known(True, "Transformer Engine's userbuffer overlap is not used"),
    "--tp-comm-bootstrap-backend": Known(
        True, "Transformer Engine's userbuffer overlap is not used"
    ),
    "--cross-entropy-loss-fusion": Known(False, _OWN_LOSS),
    "--cross-entropy-fusion-impl": Known(True, _OWN_LOSS),
    "--fp16-lm-cross-entropy": Known(False, "the cross entropy is computed in fp32"),
    "--no-rope-fusion": Known(False, _NO_KERNELS),
    "--no-bias-swiglu-fusion": Known(False, _NO_KERNELS),
    "--disable-jit-fuser": Known(False, _NO_KERNELS),
    "--apply-query-key-layer-scaling": Known(
        False, "it only rescales fp16 attention scores; softmax runs inside the attention kernel"
    ),
    "--add-qkv-bias": Known(False, f"linear layers always have biases: {_GPT2}"),
    "--grad-reduce-in-bf16": Known(
        False,
        "bf16 gradients are all-reduced in bf16 already, unless "
        "--accumulate-allreduce-grads-in-fp32",
    ),
    "--ddp-average-in-collective": Known(
        False, "data-parallel gradients are averaged by the all-reduce itself already"
    ),
    "--ddp-num-buckets": Known(True, "buckets are sized by --ddp-bucket-size"),
    "--no-align-grad-reduce": Known(False, _OVERLAP),
    "--no-align-param-gather": Known(False, _OVERLAP),
    "--overlap-param-gather-with-optimizer-step": Known(False, _OVERLAP),
    "--ddp-pad-buckets-for-high-nccl-busbw": Known(False, _OVERLAP),
    "--no-overlap-p2p-communication": Known(False, _P2P),
    "--overlap-p2p-communication-warmup-flush": Known(False, _P2P),
    "--use-ring-exchange-p2p": Known(False, _P2P),
    "--defer-embedding-wgrad-compute": Known(False, _OVERLAP),
    "--wgrad-deferral-limit": Known(True, _OVERLAP),
    "--manual-gc": Known(False, _GC),
    "--manual-gc-interval": Known(True, _GC),
    "--no-manual-gc-eval": Known(False, _GC),
    "--disable-manual-gc-eval": Known(False, _GC),
    "--no-mmap-bin-files": Known(False, "the .bin files are always memory-mapped"),
    "--no-create-attention-mask-in-dataloader": Known(
        False, "a mask is built only for --reset-attention-mask; attention is causal otherwise"
    ),
    "--num-dataset-builder-threads": Known(True, "the dataset index is built on one thread"),
    "--dataloader-defer-npy-index-mmap": Known(False, "the index is memory-mapped at once"),
    "--dataloader-fast-cache-load": Known(False, "the index cache is always read whole"),
    "--ckpt-fully-parallel-save": Known(False, _TORCH_CKPT),
    "--no-ckpt-fully-parallel-save": Known(False, _TORCH_CKPT),
    "--ckpt-fully-parallel-load": Known(False, _TORCH_CKPT),
    "--ckpt-assume-constant-structure": Known(False, _TORCH_CKPT),
    "--async-strategy": Known(True, "--async-save writes from a background thread"),
    "--use-persistent-ckpt-worker": Known(False, "--async-save writes from a background thread"),
    "--log-throughput": Known(False, "tokens/s and TFLOP/s are always logged"),
    "--timing-log-level": Known(True, "the timers line is always logged"),
    "--timing-log-option": Known(True, "the timers line is always logged"),
    "--no-barrier-with-level-1-timing": Known(False, "the timers line is always logged"),
    "--log-params-norm": Known(False, _LOGGED),
    "--log-num-zeros-in-grad": Known(False, _LOGGED),
    "--log-timers-to-tensorboard": Known(False, _LOGGED),
    "--log-memory-to-tensorboard": Known(False, _LOGGED),
    "--log-world-size-to-tensorboard": Known(False, _LOGGED),
    "--log-device-memory-used": Known(False, _LOGGED),
    "--log-memory-interval": Known(True, _LOGGED),
    "--log-progress": Known(False, _LOGGED),
    "--log-energy": Known(False, _LOGGED),
    "--tensorboard-log-interval": Known(True, "TensorBoard is written every --log-interval"),
    "--tensorboard-queue-size": Known(True, "TensorBoard's writer keeps its own queue"),
    "--logging-level": Known(True, "zerotron's output has one level"),
    "--empty-unused-memory-level": Known(True, "the CUDA cache is left to PyTorch"),
}
"""Megatron flags that only tune what zerotron does not have; accepted with a warning."""
