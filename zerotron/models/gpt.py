"""GPT-2 (Radford et al., 2019), written against the tensor-parallel layers.

Learned absolute positions, pre-LayerNorm blocks, GELU (tanh approximation), input and output
embeddings tied, dropout on the embeddings, the residual branches and the attention probabilities.
Weights are ``N(0, init_method_std)``; the two projections that write into the residual stream
(attention ``dense`` and ``mlp.dense_4h_to_h``) use ``init_method_std / sqrt(2 * num_layers)``;
biases are zero, LayerNorm weights one.

Parameter names (Megatron-LM's, without its ``language_model.encoder`` prefixes)::

    embedding.word_embeddings.weight              [vocab_size (padded), hidden]
    embedding.position_embeddings.weight          [max_position_embeddings, hidden]
    layers.{i}.input_layernorm.{weight,bias}
    layers.{i}.self_attention.query_key_value.{weight,bias}   [3 * hidden, hidden]
    layers.{i}.self_attention.dense.{weight,bias}             [hidden, hidden]
    layers.{i}.post_attention_layernorm.{weight,bias}
    layers.{i}.mlp.dense_h_to_4h.{weight,bias}                [ffn_hidden, hidden]
    layers.{i}.mlp.dense_4h_to_h.{weight,bias}                [hidden, ffn_hidden]
    final_layernorm.{weight,bias}

The rows of ``query_key_value`` are ordered per head, as in Megatron-LM: ``[heads, (q, k, v),
head_dim]``, so a column split across tensor-parallel ranks hands each rank whole heads.
(HuggingFace's GPT-2 orders them ``[(q, k, v), heads, head_dim]``; ``checkpoint.hf`` converts.)

Vocabulary padding: the embedding has ``vocab_size`` rows, padded for efficient splitting; ids
``>= orig_vocab_size`` are never real tokens. Their logits are left out of the loss and returned as
``-inf``, so neither training nor sampling ever sees them (:mod:`~zerotron.models.lm_head`).

Device-specific fast paths (16-bit CPU attention, the fused loss, the eager embedding lookup, the
linear layers' oneDNN matmuls) are chosen by :func:`zerotron.kernels.kernel_policy` for the
tensors' device; on CUDA the model is plain PyTorch.

Tensors are batch-first: tokens ``[b, s]``, hidden states ``[b, s, h]``.

Tensor parallelism (the TP group of ``zerotron.distributed.state()`` when the model is built):
each TP rank holds ``num_attention_heads / tp`` whole heads (a column split of
``query_key_value``), the MLP is split column then row, the word embedding and the tied output
layer by vocabulary rows, and the loss is the vocab-parallel cross entropy. Dropout inside a TP
region (attention probabilities) draws from the model-parallel RNG stream
(``get_rng_tracker().fork()``, set up by ``model_parallel_seed``); dropout on the replicated
residual stream draws from the default stream, identical on all TP ranks. With
``sequence_parallel`` the residual stream, LayerNorms and their dropout run on sequence shards
``[b, s/tp, h]`` (forked stream); the LayerNorms, row-parallel biases and position embeddings are
marked ``sequence_parallel`` and their gradients must be summed across TP with
``zerotron.parallel.tensor.allreduce_sequence_parallel_grads(model)`` once per step.
At TP=1 none of this runs: the model is the plain single-process one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerotron.distributed.comm import Group
from zerotron.distributed.rng import get_rng_tracker
from zerotron.distributed.state import state
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.kernels import (
    TiedGrad,
    embedding_lookup,
    kernel_policy,
    sdpa_fp32,
    sdpa_math_16bit,
)
from zerotron.models.lm_head import LMHead
from zerotron.parallel import recompute
from zerotron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    mark_sequence_parallel,
    scaled_init_method_normal,
    tp_group_attribute,
)

# State-dict keys whose dim 0 is the padded vocabulary (re-padded when the padding changes).
VOCAB_PADDED_KEYS = ("embedding.word_embeddings.weight",)

RECOMPUTE_GRANULARITIES = (None, "full", "selective")


@dataclass
class GPTConfig:
    """The model's shape and regularization, named as Megatron-LM's flags."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # padded: the embedding has this many rows
    ffn_hidden_size: int | None = None  # -> 4 * hidden_size
    max_position_embeddings: int | None = None  # -> seq_length
    orig_vocab_size: int | None = None  # the tokenizer's vocabulary; -> vocab_size
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    recompute_granularity: str | None = None  # None | "full" | "selective"
    # full recompute, as Megatron: "uniform" checkpoints every recompute_num_layers layers as one
    # unit (all layers recomputed); "block" recomputes only the first recompute_num_layers layers.
    recompute_method: str | None = None  # -> "uniform" with full granularity
    recompute_num_layers: int | None = None  # -> 1 (uniform) / num_layers (block)
    bias: bool = True
    # Megatron's --sequence-parallel: only takes effect with a tensor-parallel size > 1.
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.orig_vocab_size is None:
            self.orig_vocab_size = self.vocab_size
        self._validate()

    def _validate(self) -> None:
        def bad(key: str, what: str, fix: str) -> ConfigError:
            return ConfigError(f"{what} (got {getattr(self, key)!r})", where=key, fix=fix)

        for key in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
            "ffn_hidden_size",
            "max_position_embeddings",
            "orig_vocab_size",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(key, "must be a positive integer", "set a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise bad(
                "hidden_size",
                f"is not divisible by num_attention_heads={self.num_attention_heads}",
                "choose hidden_size a multiple of num_attention_heads",
            )
        if self.orig_vocab_size > self.vocab_size:
            raise bad(
                "orig_vocab_size",
                f"is larger than the padded vocab_size={self.vocab_size}",
                "pad the vocabulary up, never down",
            )
        if self.seq_length > self.max_position_embeddings:
            raise bad(
                "seq_length",
                f"exceeds max_position_embeddings={self.max_position_embeddings}",
                "raise max_position_embeddings or shorten seq_length",
            )
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise bad(key, "must be in [0, 1)", "use a probability such as 0.1")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise bad(
                "recompute_granularity", "must be full, selective or unset", "use full or selective"
            )
        if self.recompute_method not in (None, "uniform", "block"):
            raise bad("recompute_method", "must be uniform, block or unset", "use uniform or block")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise bad(
                "recompute_method",
                "only applies to recompute_granularity=full",
                "set recompute_granularity=full or drop recompute_method",
            )
        n = self.recompute_num_layers
        if n is not None:
            if self.recompute_granularity != "full":
                raise bad(
                    "recompute_num_layers",
                    "only applies to recompute_granularity=full",
                    "set recompute_granularity=full or drop recompute_num_layers",
                )
            if not 0 <= n <= self.num_layers:
                raise bad(
                    "recompute_num_layers",
                    f"must be between 0 and num_layers={self.num_layers}",
                    "recompute at most every layer",
                )

    @property
    def kv_channels(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        """Plain, JSON-friendly dict (defaults resolved) for checkpoint metadata."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "model config") -> GPTConfig:
        """Inverse of :meth:`to_dict`; unknown or missing keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model config keys {unknown}",
                where=where,
                fix=f"known keys: {sorted(names)}",
            )
        try:
            return cls(**d)
        except TypeError as e:  # a required key is missing
            raise ConfigError(f"incomplete model config: {e}", where=where) from e


class KVCache:
    """Keys and values of the positions seen so far, for incremental decoding.

    One ``[batch, heads, max_length, head_dim]`` buffer per layer for keys and one for values;
    ``length`` positions are filled. The model appends the new positions of a forward pass and
    then advances ``length``, so positions continue where the last call stopped.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        head_dim: int,
        max_length: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch_size, num_heads, max_length, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_length = max_length
        self.length = 0

    @classmethod
    def for_model(cls, model: GPT, batch_size: int, max_length: int | None = None) -> KVCache:
        """A cache shaped for ``model`` (its parameters' dtype and device)."""
        cfg = model.config
        p = model.embedding.word_embeddings.weight
        return cls(
            cfg.num_layers,
            batch_size,
            cfg.num_attention_heads // model.tp_group.size,  # this TP rank's heads
            cfg.kv_channels,
            max_length or cfg.max_position_embeddings,
            dtype=p.dtype,
            device=p.device,
        )

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key``/``value`` [b, heads, s, d] after the filled positions; return all."""
        end = self.length + key.shape[2]
        self.keys[layer][:, :, self.length : end] = key
        self.values[layer][:, :, self.length : end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class SelfAttention(nn.Module):
    """Multi-head causal self-attention: fused QKV projection, SDPA core, output projection."""

    tp_group = tp_group_attribute()

    def __init__(self, config: GPTConfig, layer_index: int, tp_group: Group):
        super().__init__()
        self.layer_index = layer_index
        self.tp_group = tp_group
        # Whole heads per TP rank: qkv rows are [heads, (q, k, v), head_dim].
        self.num_heads = _divide_heads(config.num_attention_heads, tp_group.size)
        self.head_dim = config.kv_channels
        self.attention_dropout = config.attention_dropout
        self.recompute_core = config.recompute_granularity == "selective"
        h = config.hidden_size
        sp = _sequence_parallel(config, tp_group)
        self.query_key_value = ColumnParallelLinear(
            h,
            3 * h,
            bias=config.bias,
            gather_output=False,
            init_method=init_method_normal(config.init_method_std),
            sequence_parallel=sp,
            tp_group=tp_group,
        )
        self.dense = RowParallelLinear(
            h,
            h,
            bias=config.bias,
            input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            sequence_parallel=sp,
            tp_group=tp_group,
        )

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        qkv = self.query_key_value(x)  # [b, s, 3 * h / tp]; s is the full sequence under SP
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.num_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, heads, s, head_dim], views
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, k, v)
        dropout_p = self.attention_dropout if self.training else 0.0
        # Each TP rank holds other heads: their dropout draws from the model-parallel stream.
        with _model_parallel_rng(self.tp_group, dropout_p > 0):
            if self.recompute_core and torch.is_grad_enabled():
                # Selective recompute: keep only q, k, v; redo softmax(QK^T)V in backward.
                # Non-reentrant checkpoint stashes the RNG state in effect here (the forked
                # stream under TP) and restores it on rerun: dropout masks repeat exactly.
                context = checkpoint(
                    _core_attention,
                    q,
                    k,
                    v,
                    attention_mask,
                    is_causal,
                    dropout_p,
                    use_reentrant=False,
                )
            else:
                context = _core_attention(q, k, v, attention_mask, is_causal, dropout_p)
        return self.dense(context.transpose(1, 2).reshape(b, s, -1))


def _divide_heads(heads: int, tp: int) -> int:
    if heads % tp:
        raise UnsupportedError(
            f"num_attention_heads {heads} is not divisible by the tensor-parallel size {tp}",
            where="GPT",
            fix="choose a tensor-parallel size that divides the number of heads",
        )
    return heads // tp


def _sequence_parallel(config: GPTConfig, tp_group: Group) -> bool:
    return config.sequence_parallel and tp_group.size > 1


def _model_parallel_rng(tp_group: Group, draws: bool):
    """``get_rng_tracker().fork()`` where TP ranks must draw differently, else nothing.

    At TP=1 nothing is forked, so a single-process model draws exactly what it always did.
    """
    return get_rng_tracker().fork() if draws and tp_group.size > 1 else contextlib.nullcontext()


def _core_attention(q, k, v, attention_mask, is_causal, dropout_p):
    """``softmax(q k^T / sqrt(d) + mask) v`` by ``F.scaled_dot_product_attention``.

    SDPA picks its backend (flash on CPU; flash, memory-efficient or cuDNN on CUDA), except for
    16-bit tensors without attention dropout on the CPU, where the kernel choice may be SDPA's
    MATH kernel kept in 16 bits (the policy's ``attention_16bit``) or SDPA on fp32 copies
    (``attention_fp32``), whichever beat flash on the machine
    (:mod:`~zerotron.kernels.attention_cpu`).
    """
    low = q.dtype in (torch.bfloat16, torch.float16)
    if low and dropout_p == 0:
        policy = kernel_policy(q.device)
        if policy.attention_16bit:
            return sdpa_math_16bit(q, k, v, attention_mask, is_causal)
        if policy.attention_fp32:
            return sdpa_fp32(q, k, v, attention_mask, is_causal)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask, dropout_p=dropout_p, is_causal=is_causal
    )


class MLP(nn.Module):
    """h -> ffn_hidden (GELU, tanh approximation) -> h."""

    def __init__(self, config: GPTConfig, tp_group: Group):
        super().__init__()
        h, ffn = config.hidden_size, config.ffn_hidden_size
        sp = _sequence_parallel(config, tp_group)
        self.dense_h_to_4h = ColumnParallelLinear(
            h,
            ffn,
            bias=config.bias,
            gather_output=False,
            init_method=init_method_normal(config.init_method_std),
            sequence_parallel=sp,
            tp_group=tp_group,
        )
        self.dense_4h_to_h = RowParallelLinear(
            ffn,
            h,
            bias=config.bias,
            input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            sequence_parallel=sp,
            tp_group=tp_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """Pre-LN block: ``x + drop(attn(ln(x)))``, then ``x + drop(mlp(ln(x)))``."""

    tp_group = tp_group_attribute()

    def __init__(self, config: GPTConfig, layer_index: int, tp_group: Group):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(h, eps=eps, bias=config.bias)
        self.self_attention = SelfAttention(config, layer_index, tp_group)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=eps, bias=config.bias)
        self.mlp = MLP(config, tp_group)
        self.hidden_dropout = config.hidden_dropout
        self.tp_group = tp_group
        # Under SP the residual stream is split along the sequence: LayerNorms see a shard and
        # dropout must draw differently on each rank.
        self.sequence_parallel = _sequence_parallel(config, tp_group)
        if self.sequence_parallel:
            mark_sequence_parallel(self.input_layernorm.parameters())
            mark_sequence_parallel(self.post_attention_layernorm.parameters())

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), attention_mask, is_causal, kv_cache)
        x = x + self._dropout(attn)
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.hidden_dropout > 0:
            with _model_parallel_rng(self.tp_group, self.sequence_parallel):
                return F.dropout(x, self.hidden_dropout, training=True)
        return x


class Embedding(nn.Module):
    """Word embeddings (vocab-parallel, tied to the output layer) + learned positions + dropout."""

    tp_group = tp_group_attribute()

    def __init__(self, config: GPTConfig, tp_group: Group):
        super().__init__()
        init = init_method_normal(config.init_method_std)
        self.tp_group = tp_group
        self.sequence_parallel = _sequence_parallel(config, tp_group)
        # Under SP the word embeddings come out reduce-scattered: [b, s/tp, h].
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            init_method=init,
            init_rows=config.orig_vocab_size,  # padding must not shift later layers' init
            sequence_parallel=self.sequence_parallel,
            tp_group=tp_group,
        )
        # Positions are replicated across TP ranks, not split.
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        init(self.position_embeddings.weight.data)
        if self.sequence_parallel:  # each rank adds only its shard's positions
            mark_sequence_parallel(self.position_embeddings.parameters())
        self.hidden_dropout = config.hidden_dropout

    def external_parameters(self) -> list[nn.Parameter]:
        """The forward slices the position table itself (:mod:`zerotron.parallel.declarations`)."""
        return [self.position_embeddings.weight]

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        offset: int = 0,
        tied: TiedGrad | None = None,
    ) -> torch.Tensor:
        """``tied``: the fused loss's slot for the word embedding's gradient (TP=1; see
        :mod:`~zerotron.kernels.tied_grad`)."""
        eager = kernel_policy(tokens.device).eager_embedding
        lookup = _eager_word_embedding if eager else _word_embedding
        x = lookup(self.word_embeddings, tokens, tied)
        s = x.shape[1]  # this rank's sequence shard under SP
        if self.sequence_parallel:
            first = self.tp_group.rank * s
            offset += first
            if position_ids is not None:
                position_ids = position_ids[:, first : first + s]
        if position_ids is None:  # positions offset..offset+s: a slice, no gather needed
            x = x + self.position_embeddings.weight[offset : offset + s]
        else:
            x = x + self.position_embeddings(position_ids)
        if self.training and self.hidden_dropout > 0:
            with _model_parallel_rng(self.tp_group, self.sequence_parallel):
                x = F.dropout(x, self.hidden_dropout, training=True)
        return x


def _word_embedding(
    embedding: VocabParallelEmbedding, tokens: torch.Tensor, tied: TiedGrad | None = None
) -> torch.Tensor:
    """The word-embedding lookup.

    ``tied`` (TP=1, with the fused loss on the same weight): the lookup's rows are added into
    the loss's gradient in place (:mod:`~zerotron.kernels.tied_grad`), with no ``[vocab, h]``
    tensor of their own.
    """
    if tied is not None and embedding.tp_group.size == 1:
        return embedding_lookup(tokens, embedding.weight, tied)
    return embedding(tokens)


# The lookup eager even inside ``torch.compile`` (a graph break before it), where the kernel
# policy's ``eager_embedding`` holds (the CPU): compiled, its backward (the tied ``[vocab, h]``
# weight's gradient) becomes inductor's decomposition (zero a ``[vocab, h]`` fp32 buffer,
# scatter-add the rows, cast), many times slower there than eager's ``embedding_dense_backward``
# (bench/README.md).
_eager_word_embedding = torch.compiler.disable(_word_embedding)


def _deepspeed_checkpoint(fn, *args, use_reentrant: bool = False):
    """:func:`zerotron.parallel.recompute.checkpoint` called as torch's ``checkpoint`` is."""
    return recompute.checkpoint(fn, *args)


def _checkpoint_with_tracker(fn, *args, use_reentrant: bool = False):
    """``checkpoint`` that also restores the RNG tracker's streams when it reruns ``fn``."""
    return checkpoint(fn, *args, use_reentrant=use_reentrant, context_fn=_tracker_contexts)


def _tracker_contexts():
    saved = get_rng_tracker().get_states()  # called as the checkpointed forward starts

    @contextlib.contextmanager
    def replay():
        tracker = get_rng_tracker()
        now = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(now)

    return contextlib.nullcontext(), replay()


def _run_unit(layers, x, attention_mask, is_causal):
    for layer in layers:
        x = layer(x, attention_mask, is_causal, None)
    return x


def run_layers_recomputed(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
    config: GPTConfig,
    tp_size: int,
) -> torch.Tensor:
    """``layers`` in training with full recompute, as Megatron does per pipeline stage.

    ``recompute_method`` "uniform" checkpoints every ``recompute_num_layers`` consecutive layers
    as one unit (default 1); "block" checkpoints each of the first ``recompute_num_layers``
    layers (default all) and runs the rest plainly. ``layers`` is the whole model, or one
    pipeline chunk's layers: the counts are per chunk, as Megatron's are per stage. A
    checkpointed unit keeps only its input; backward reruns it with the RNG state of its
    forward (the tracker's model-parallel streams too, under tensor parallelism, which torch's
    checkpoint does not know), so dropout masks repeat exactly.
    """
    ckpt = checkpoint if tp_size == 1 else _checkpoint_with_tracker
    if recompute.config() != recompute.CheckpointingConfig():
        # DeepSpeed's activation checkpointing options (partition, CPU copies, ...): its
        # CheckpointFunction, which keeps the inputs as configured and restores the RNG streams
        ckpt = _deepspeed_checkpoint
    n = config.recompute_num_layers
    if (config.recompute_method or "uniform") == "block":
        count = len(layers) if n is None else n
        for i, layer in enumerate(layers):
            args = (x, attention_mask, is_causal, None)
            x = ckpt(layer, *args, use_reentrant=False) if i < count else layer(*args)
        return x
    n = n or 1
    for start in range(0, len(layers), n):
        unit = layers[start : start + n]
        x = ckpt(_run_unit, unit, x, attention_mask, is_causal, use_reentrant=False)
    return x


class GPT(nn.Module):
    """GPT-2 language model. See the module docstring for structure and parameter names."""

    tp_group = tp_group_attribute()

    def __init__(self, config: GPTConfig, tp_group: Group | None = None):
        super().__init__()
        self.config = config
        self.tp_group = state().tp if tp_group is None else tp_group
        self.sequence_parallel = _sequence_parallel(config, self.tp_group)
        self.embedding = Embedding(config, self.tp_group)
        self.layers = nn.ModuleList(
            TransformerLayer(config, i, self.tp_group) for i in range(config.num_layers)
        )
        self.final_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layernorm_epsilon, bias=config.bias
        )
        if self.sequence_parallel:
            mark_sequence_parallel(self.final_layernorm.parameters())
        self.lm_head = LMHead(
            config.vocab_size,
            config.orig_vocab_size,
            self.tp_group,
            vocab_start_index=self.embedding.word_embeddings.vocab_start_index,
            sequence_parallel=self.sequence_parallel,
        )

    def external_parameters(self) -> list[nn.Parameter]:
        """The tied output layer reads the word embedding (see zerotron.parallel.declarations)."""
        return [self.embedding.word_embeddings.weight]

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, vocab_size]``, or with ``labels`` the per-token loss ``[b, s]`` (fp32).

        ``labels[b, t]`` is the token that should follow ``tokens[b, t]`` (already shifted, as in
        Megatron-LM); the caller applies its loss mask. ``attention_mask`` is a bool tensor
        broadcastable to ``[b, 1, s, keys]`` with True where a query may attend to a key (causal
        masking is then the caller's job); without it attention is causal. With ``kv_cache`` the
        tokens continue the cached positions (keys = cached + s) and the cache is advanced.
        """
        offset = kv_cache.length if kv_cache is not None else 0
        self._check_input(tokens, position_ids, offset)
        attention_mask, is_causal = _attention_mask(attention_mask, offset, tokens)
        training = torch.is_grad_enabled() and kv_cache is None
        # The fused loss and the lookup may share the tied weight's gradient (kernels.tied_grad).
        tied = self.lm_head.tied_slot(labels, tokens.device) if training else None

        x = self.embedding(tokens, position_ids, offset, tied)
        x = self._run_layers(x, attention_mask, is_causal, kv_cache, training)
        x = self.final_layernorm(x)
        if kv_cache is not None:
            kv_cache.length += tokens.shape[1]
        return self.lm_head(x, self.embedding.word_embeddings.weight, labels, tied)

    def _check_input(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None, offset: int
    ) -> None:
        cfg = self.config
        s = tokens.shape[1]
        if position_ids is None and offset + s > cfg.max_position_embeddings:
            raise ConfigError(
                f"{offset + s} positions exceed max_position_embeddings="
                f"{cfg.max_position_embeddings}",
                where="GPT.forward",
                fix="shorten the input (or the number of tokens to generate)",
            )
        if self.sequence_parallel and s % self.tp_group.size:
            raise UnsupportedError(
                f"sequence parallelism splits the {s} input positions across "
                f"{self.tp_group.size} tensor-parallel ranks, which does not divide them",
                where="GPT.forward",
                fix="use a sequence length divisible by the tensor-parallel size, or build the "
                "model without sequence_parallel (e.g. for generation)",
            )

    def _run_layers(self, x, attention_mask, is_causal, kv_cache, training_pass: bool):
        """The transformer layers, with full recompute per ``recompute_method`` when training
        (:func:`run_layers_recomputed`)."""
        cfg = self.config
        if not training_pass or cfg.recompute_granularity != "full":
            for layer in self.layers:
                x = layer(x, attention_mask, is_causal, kv_cache)
            return x
        return run_layers_recomputed(
            self.layers, x, attention_mask, is_causal, cfg, self.tp_group.size
        )

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; the tied embedding counts once (it is one parameter).

        ``exclude_embeddings`` leaves out the word and position embeddings.
        """
        skip = set(map(id, self.embedding.parameters())) if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)


def _attention_mask(
    attention_mask: torch.Tensor | None, offset: int, tokens: torch.Tensor
) -> tuple[torch.Tensor | None, bool]:
    """``(mask, is_causal)`` for SDPA: causal without a mask; after ``offset`` cached positions
    the new queries see every cached key and, causally, each other."""
    if attention_mask is not None:
        return attention_mask, False
    s = tokens.shape[1]
    if offset == 0:
        return None, True
    if s == 1:  # one new query sees every key
        return None, False
    keys = torch.arange(offset + s, device=tokens.device)
    queries = torch.arange(offset, offset + s, device=tokens.device)
    return keys[None, :] <= queries[:, None], False


def print_num_parameters(model: GPT, rank: int = 0) -> int:
    """Print Megatron-LM's parameter-count line for this model-parallel rank; return the count."""
    n = model.num_parameters()
    print(f" > number of parameters on model parallel rank {rank}: {n}", flush=True)
    return n
