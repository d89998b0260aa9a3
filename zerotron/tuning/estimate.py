"""Per-rank memory of a training run, computed from the model's shape and the layout alone.

    from zerotron.tuning.estimate import Layout, ModelShape, estimate
    shape = ModelShape.gpt2("1.5B", seq_length=1024)
    mem = estimate(shape, Layout(tp=2, dp=4, zero_stage=1, micro_batch_size=4))
    mem.total, mem.fits(80 * 2**30), mem.as_dict()

Pure arithmetic: no processes, no tensors. The terms (bytes on one rank's device):

- ``parameters``, ``gradients``, ``master_weights``, ``optimizer_states``: model states, from
  the per-element byte counts of :mod:`~zerotron.tuning.zero_memory` (the same counts that
  reproduce DeepSpeed's printed tables), for this rank's parameters (its TP shard, its pipeline
  stage) partitioned over DP by the ZeRO stage and moved to the host by offload;
- ``activations``: what autograd keeps for backward (:mod:`~zerotron.tuning.activations`);
- ``comm_buffers``: gradient buckets and ZeRO gather / reduce buffers;
- ``loss_workspace``: the fused output-layer loss's temporaries;
- ``host``: bytes offload (and DeepSpeed's ``cpu_checkpointing`` of full recompute's inputs)
  moved to CPU memory (not in ``total``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from zerotron.errors import ConfigError
from zerotron.kernels.policy import KernelChoices
from zerotron.tuning import activations as act
from zerotron.tuning.model_states import model_state_bytes
from zerotron.tuning.zero_memory import OPTIMIZER_STATES

if TYPE_CHECKING:
    from zerotron.config import Config

RECOMPUTE = ("none", "selective", "full")
DEVICES = ("cuda", "cpu")
PRECISIONS = ("fp32", "fp16", "bf16")
OFFLOAD = ("none", "cpu", "nvme")

# GPT-2's sizes (Radford et al. 2019; Megatron's names): layers, hidden, heads.
GPT2_SIZES = {
    "124M": (12, 768, 12),
    "355M": (24, 1024, 16),
    "774M": (36, 1280, 20),
    "1.5B": (48, 1600, 25),
}
GPT2_VOCAB = 50257


@dataclass(frozen=True)
class ModelShape:
    """The shape of zerotron's GPT: what memory depends on.

    ``vocab_size`` is the tokenizer's; the estimator pads it to a multiple of
    ``make_vocab_size_divisible_by * tp`` as zerotron does. ``max_position_embeddings`` defaults
    to ``seq_length`` (the position table's rows).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    tied_embeddings: bool = True
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1

    @property
    def ffn(self) -> int:
        """The MLP's inner size (``4 * hidden_size`` unless given)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def positions(self) -> int:
        """Rows of the position-embedding table."""
        return self.max_position_embeddings or self.seq_length

    def padded_vocab(self, tp: int = 1) -> int:
        """The embedding's rows at tensor-parallel size ``tp`` (zerotron's padding)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def from_config(cls, cfg: Config, vocab_size: int = GPT2_VOCAB) -> ModelShape:
        """The shape of ``cfg.model`` (``vocab_size``: the tokenizer's; GPT-2's by default)."""
        m = cfg.model
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            seq_length=m.seq_length,
            vocab_size=vocab_size,
            ffn_hidden_size=m.ffn_hidden_size,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
            max_position_embeddings=m.max_position_embeddings,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
        )

    @classmethod
    def gpt2(cls, name: str, seq_length: int = 1024) -> ModelShape:
        """GPT-2 ``"124M"``, ``"355M"``, ``"774M"`` or ``"1.5B"`` (50257-token vocabulary)."""
        if name not in GPT2_SIZES:
            raise ConfigError(
                f"unknown GPT-2 size {name!r}",
                where="ModelShape.gpt2",
                fix=f"one of {list(GPT2_SIZES)}",
            )
        layers, hidden, heads = GPT2_SIZES[name]
        return cls(layers, hidden, heads, seq_length, GPT2_VOCAB)

    def layer_parameters(self, tp: int = 1) -> int:
        """Parameters of one transformer layer on one TP rank (row-parallel biases and the
        LayerNorms are replicated)."""
        h, f = self.hidden_size, self.ffn
        ln = 2 * 2 * h
        qkv = 3 * h * h // tp + 3 * h // tp
        dense = h * h // tp + h
        mlp = f * h // tp + f // tp + h * f // tp + h
        return ln + qkv + dense + mlp

    def embedding_parameters(self, tp: int = 1) -> int:
        """Word embedding rows of one TP rank plus the (replicated) position table."""
        return self.padded_vocab(tp) // tp * self.hidden_size + self.positions * self.hidden_size

    def num_parameters(self, tp: int = 1) -> int:
        """Exact parameter count of zerotron's GPT on one TP rank (tied embedding once)."""
        final_ln = 2 * self.hidden_size
        return (
            self.embedding_parameters(tp) + self.num_layers * self.layer_parameters(tp) + final_ln
        )


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over ranks, and what each rank keeps."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    micro_batch_size: int = 1
    num_microbatches: int = 1
    recompute: str = "none"
    precision: str = "bf16"
    offload_optimizer: str = "none"
    offload_param: str = "none"
    # Optional refinements (defaults: zerotron's own).
    recompute_method: str = "uniform"  # full recompute: "uniform" units or "block" (per chunk)
    recompute_num_layers: int | None = None  # its count (None: 1 for uniform, all for block)
    partition_activations: bool = False  # full recompute: DeepSpeed's, inputs split over TP
    cpu_checkpointing: bool = False  # full recompute: DeepSpeed's, inputs kept in host memory
    device: str = "cuda"  # "cuda" | "cpu": which kernels run (attention, fused loss)
    optimizer: str = "adam"  # its states per parameter: zero_memory.OPTIMIZER_STATES
    ddp_bucket_size: int | None = None  # ZeRO-0 data parallel (None: Megatron's default)
    reduce_bucket_size: int | None = None  # ZeRO (None: zerotron's default for the stage)
    allgather_bucket_size: int = 500_000_000
    param_persistence_threshold: int = 100_000  # ZeRO-3: smaller parameters stay whole
    max_reuse_distance: int = 0  # ZeRO-3: kept gathered from forward to backward within it
    reduce_in_fp32: bool = False  # --accumulate-allreduce-grads-in-fp32
    kernels: KernelChoices = KernelChoices()  # on the CPU: which fast paths run (their buffers)

    @property
    def world_size(self) -> int:
        """Ranks in the layout: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @classmethod
    def from_config(
        cls, cfg: Config, device: str = "cuda", kernels: KernelChoices | None = None
    ) -> Layout:
        """The layout of a resolved config (data-parallel size and micro-batches derived);
        ``kernels``: the CPU kernel choices the run makes (default: the defaults)."""
        par, m, z = cfg.parallel, cfg.model, cfg.zero
        full = m.recompute_granularity == "full"
        ac = cfg.activation_checkpointing
        return cls(
            device=device,
            kernels=kernels or KernelChoices(),
            optimizer=cfg.optimizer.optimizer,
            ddp_bucket_size=par.ddp_bucket_size,
            reduce_bucket_size=z.reduce_bucket_size,
            allgather_bucket_size=z.allgather_bucket_size,
            param_persistence_threshold=z.stage3_param_persistence_threshold,
            max_reuse_distance=z.stage3_max_reuse_distance,
            reduce_in_fp32=cfg.precision.accumulate_allreduce_grads_in_fp32,
            tp=par.tensor_model_parallel_size,
            pp=par.pipeline_model_parallel_size,
            dp=par.data_parallel_size or 1,
            vpp=par.virtual_pipeline_model_parallel_size or 1,
            sequence_parallel=bool(par.sequence_parallel) and par.tensor_model_parallel_size > 1,
            zero_stage=z.zero_stage,
            micro_batch_size=cfg.training.micro_batch_size or 1,
            num_microbatches=cfg.training.num_micro_batches or 1,
            recompute=m.recompute_granularity or "none",
            recompute_method=(m.recompute_method or "uniform") if full else "uniform",
            recompute_num_layers=m.recompute_num_layers if full else None,
            partition_activations=full and ac.partition_activations,
            cpu_checkpointing=full and ac.cpu_checkpointing,
            precision=cfg.precision.params_dtype,
            offload_optimizer=z.offload_optimizer_device or "none",
            offload_param=z.offload_param_device or "none",
        )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on ONE rank's device (a GPU; on CPU runs, that rank's RAM)."""

    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    activations: int
    comm_buffers: int
    loss_workspace: int
    host: int = 0
    recompute_workspace: int = 0  # full recompute: one layer rebuilt at a time in backward

    @property
    def total(self) -> int:
        """Device bytes: every term but ``host``."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "host")

    def fits(self, device_bytes: int) -> bool:
        """Whether the device total fits in ``device_bytes``."""
        return self.total <= device_bytes

    def as_dict(self) -> dict[str, int]:
        """The terms and ``total`` as a plain dict (for ``--json``)."""
        d: dict[str, Any] = asdict(self)
        d["total"] = self.total
        return d


def estimate(
    shape: ModelShape, layout: Layout, pipeline_rank: int | None = None
) -> MemoryBreakdown:
    """Per-rank memory; ``pipeline_rank`` None = the rank that needs the most (the first stage
    in 1F1B, which holds p micro-batches in flight)."""
    check(shape, layout)
    if pipeline_rank is None:
        stages = [estimate(shape, layout, r) for r in range(layout.pp)]
        return max(stages, key=lambda m: m.total)
    if not 0 <= pipeline_rank < layout.pp:
        raise ConfigError(
            f"pipeline_rank {pipeline_rank} is outside 0..{layout.pp - 1}",
            where="estimate(pipeline_rank=)",
        )
    first, last = pipeline_rank == 0, pipeline_rank == layout.pp - 1
    states = model_state_bytes(
        stage_modules(shape, layout.tp, layout.pp, pipeline_rank),
        external=tied_external(shape, layout),
        precision=layout.precision,
        zero_stage=layout.zero_stage,
        dp=layout.dp,
        optimizer=layout.optimizer,
        offload_optimizer=layout.offload_optimizer,
        offload_param=layout.offload_param,
        ddp_bucket_size=layout.ddp_bucket_size,
        reduce_bucket_size=layout.reduce_bucket_size,
        allgather_bucket_size=layout.allgather_bucket_size,
        param_persistence_threshold=layout.param_persistence_threshold,
        reduce_in_fp32=layout.reduce_in_fp32,
        num_microbatches=layout.num_microbatches,
        max_reuse_distance=layout.max_reuse_distance,
    )
    case = activation_case(shape, layout)
    kind = "interleaved" if layout.vpp > 1 else "1f1b"
    held = act.stage_in_flight(kind, layout.pp, layout.num_microbatches, layout.vpp, pipeline_rank)
    layers_per_chunk = shape.num_layers // (layout.pp * layout.vpp)
    activations = held * act.chunk_layers_bytes(case, layers_per_chunk)
    # The embedding lives in the first chunk of the first stage, the head in the last chunk of
    # the last stage: as many of them as the schedule holds of those chunks.
    p, m, v = layout.pp, layout.num_microbatches, layout.vpp
    loss = 0
    if first:
        activations += act.chunk_in_flight(kind, p, m, v, 0, 0) * act.embedding_bytes(case)
    if last:
        ends = act.chunk_in_flight(kind, p, m, v, p - 1, v - 1)
        activations += ends * act.head_bytes(case)
        loss = act.loss_workspace(case, in_flight=ends)
    return MemoryBreakdown(
        parameters=states.parameters,
        gradients=states.gradients,
        master_weights=states.master_weights,
        optimizer_states=states.optimizer_states,
        activations=activations,
        comm_buffers=states.comm_buffers + act.tp_comm_bytes(case),
        loss_workspace=loss,
        host=states.host + held * act.host_bytes(case, layers_per_chunk),
        recompute_workspace=act.recompute_workspace(case, layers_per_chunk),
    )


def activation_case(shape: ModelShape, layout: Layout) -> act.ActivationCase:
    """What the activation formulas need from a shape and a layout."""
    return act.ActivationCase(
        seq_length=shape.seq_length,
        micro_batch_size=layout.micro_batch_size,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn,
        vocab_size=shape.vocab_size,
        padded_vocab_size=shape.padded_vocab(layout.tp),
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute,
        recompute_method=layout.recompute_method,
        recompute_num_layers=layout.recompute_num_layers,
        partition_activations=layout.partition_activations,
        cpu_checkpointing=layout.cpu_checkpointing,
        precision=layout.precision,
        device=layout.device,
        hidden_dropout=shape.hidden_dropout,
        attention_dropout=shape.attention_dropout,
        kernels=layout.kernels,
    )


def tied_external(shape: ModelShape, layout: Layout) -> int:
    """Elements of the tied word embedding the output layer reads outside the embedding module
    (ZeRO-3 gathers it for the whole pass); 0 under a pipeline, where the last stage holds its
    own copy."""
    return shape.padded_vocab(layout.tp) // layout.tp * shape.hidden_size if layout.pp == 1 else 0


def stage_modules(shape: ModelShape, tp: int, pp: int, stage: int) -> list[list[int]]:
    """Element counts of the parameters pipeline stage ``stage`` holds on one TP rank, grouped
    by module (the unit ZeRO-3 gathers): its layers, the embedding on the first stage, the final
    LayerNorm on the last (and there, with a pipeline, its copy of the tied embedding)."""
    h, f = shape.hidden_size, shape.ffn
    word = shape.padded_vocab(tp) // tp * h
    layer = [
        [h, h],  # input LayerNorm
        [3 * h * h // tp, 3 * h // tp],  # QKV (column parallel)
        [h * h // tp, h],  # attention output (row parallel: bias whole)
        [h, h],  # post-attention LayerNorm
        [f * h // tp, f // tp],  # MLP in
        [h * f // tp, h],  # MLP out
    ]
    modules: list[list[int]] = []
    if stage == 0:
        modules += [[word], [shape.positions * h]]
    modules += layer * (shape.num_layers // pp)
    if stage == pp - 1:
        modules.append([h, h])
        if pp > 1:
            modules.append([word])  # the tied output layer's copy
    return modules


def check(shape: ModelShape, layout: Layout) -> None:
    """Refuse layouts zerotron cannot run, naming the flag to change."""

    def bad(what: str, where: str, fix: str) -> ConfigError:
        return ConfigError(what, where=where, fix=fix)

    if shape.num_attention_heads % layout.tp:
        raise bad(
            f"num_attention_heads {shape.num_attention_heads} is not divisible by the "
            f"tensor-parallel size {layout.tp}",
            "--tensor-model-parallel-size",
            "choose a tensor-parallel size that divides the number of heads",
        )
    if shape.ffn % layout.tp:
        raise bad(
            f"ffn_hidden_size {shape.ffn} is not divisible by the tensor-parallel size {layout.tp}",
            "--tensor-model-parallel-size",
            "choose a tensor-parallel size that divides ffn_hidden_size",
        )
    if shape.num_layers % (layout.pp * layout.vpp):
        raise bad(
            f"num_layers {shape.num_layers} is not divisible by pipeline size {layout.pp} "
            f"x virtual stages {layout.vpp}",
            "--pipeline-model-parallel-size",
            "choose sizes whose product divides the number of layers",
        )
    if layout.sequence_parallel and layout.tp > 1 and shape.seq_length % layout.tp:
        raise bad(
            f"seq_length {shape.seq_length} is not divisible by the tensor-parallel size "
            f"{layout.tp} (sequence parallelism splits it)",
            "--seq-length",
            "use a sequence length divisible by the tensor-parallel size",
        )
    choices = {
        "recompute": (layout.recompute, RECOMPUTE, "--recompute-granularity"),
        "recompute_method": (layout.recompute_method, ("uniform", "block"), "--recompute-method"),
        "precision": (layout.precision, PRECISIONS, "--bf16 / --fp16"),
        "offload_optimizer": (layout.offload_optimizer, OFFLOAD, "offload_optimizer.device"),
        "offload_param": (layout.offload_param, OFFLOAD, "offload_param.device"),
        "device": (layout.device, DEVICES, "--device"),
        "optimizer": (layout.optimizer, tuple(OPTIMIZER_STATES), "--optimizer"),
    }
    for name, (value, allowed, flag) in choices.items():
        if value not in allowed:
            raise bad(f"{name} {value!r} is not one of {list(allowed)}", flag, "use one of those")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise bad(f"zero_stage {layout.zero_stage} is not 0..3", "--zero-stage", "use 0..3")
    if layout.offload_param != "none" and layout.zero_stage != 3:
        raise bad("offload_param needs ZeRO stage 3", "offload_param.device", "use zero_stage 3")
    if layout.offload_optimizer != "none" and layout.zero_stage == 0:
        raise bad(
            "offload_optimizer needs a ZeRO stage",
            "offload_optimizer.device",
            "use zero_stage >= 1",
        )
    if layout.vpp > 1 and layout.num_microbatches % layout.pp:
        raise bad(
            f"the interleaved schedule needs micro-batches ({layout.num_microbatches}) divisible "
            f"by the pipeline size {layout.pp}",
            "--global-batch-size",
            "choose a batch giving a multiple of the pipeline size in micro-batches",
        )
    for name in ("tp", "pp", "dp", "vpp", "micro_batch_size", "num_microbatches"):
        if getattr(layout, name) < 1:
            raise bad(f"{name} must be at least 1", name, "use a positive size")
