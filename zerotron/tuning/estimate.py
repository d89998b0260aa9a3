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
- ``host``: bytes offload moved to CPU memory (not in ``total``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from zerotron.errors import ConfigError

if TYPE_CHECKING:
    from zerotron.config import Config

RECOMPUTE = ("none", "selective", "full")
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

    @property
    def world_size(self) -> int:
        """Ranks in the layout: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        """The layout of a resolved config (data-parallel size and micro-batches derived)."""
        par, m, z = cfg.parallel, cfg.model, cfg.zero
        return cls(
            tp=par.tensor_model_parallel_size,
            pp=par.pipeline_model_parallel_size,
            dp=par.data_parallel_size or 1,
            vpp=par.virtual_pipeline_model_parallel_size or 1,
            sequence_parallel=bool(par.sequence_parallel) and par.tensor_model_parallel_size > 1,
            zero_stage=z.zero_stage,
            micro_batch_size=cfg.training.micro_batch_size or 1,
            num_microbatches=cfg.training.num_micro_batches or 1,
            recompute=m.recompute_granularity or "none",
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
    raise NotImplementedError("estimate: body lands in the next commit on r16-estimate")
