"""GPT model: shapes, initialization, tying, recompute, parameter count, bf16, KV cache, layers."""

import math

import pytest
import torch
import torch.nn.functional as F

import zerotron.models.gpt as gpt_module
from zerotron.errors import ConfigError, UnsupportedError
from zerotron.models import GPT, VOCAB_PADDED_KEYS, GPTConfig, KVCache, print_num_parameters
from zerotron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from zerotron.parallel.tensor.layers import _init_partition


def config(**kw) -> GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=128,
        orig_vocab_size=100,
    )
    return GPTConfig(**{**base, **kw})


def batch(cfg: GPTConfig, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.orig_vocab_size, (b, cfg.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def test_shapes_and_padded_logits():
    cfg = config()
    model = GPT(cfg).eval()
    tokens, labels = batch(cfg)
    logits = model(tokens)
    assert logits.shape == (2, 32, 128)
    assert torch.all(logits[..., 100:] == -math.inf) and torch.isfinite(logits[..., :100]).all()
    loss = model(tokens, labels=labels)
    assert loss.shape == (2, 32) and loss.dtype == torch.float32
    reference = F.cross_entropy(
        logits[..., :100].reshape(-1, 100), labels.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(loss.reshape(-1), reference, rtol=1e-6, atol=1e-6)


def test_config_defaults_validation_and_round_trip():
    cfg = config(recompute_granularity="full", recompute_num_layers=1)
    assert (cfg.ffn_hidden_size, cfg.max_position_embeddings, cfg.kv_channels) == (256, 32, 16)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    assert config(vocab_size=100, orig_vocab_size=None).orig_vocab_size == 100
    with pytest.raises(ConfigError, match="num_attention_heads"):
        config(num_attention_heads=5)
    with pytest.raises(ConfigError, match="orig_vocab_size"):
        config(orig_vocab_size=200)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        config(max_position_embeddings=16)
    with pytest.raises(ConfigError, match="recompute_granularity"):
        config(recompute_granularity="some")
    with pytest.raises(ConfigError, match="recompute_num_layers"):
        config(recompute_num_layers=1)
    with pytest.raises(ConfigError, match="hidden_dropout"):
        config(hidden_dropout=1.5)
    with pytest.raises(ConfigError, match="unknown model config keys"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_embd": 64})


def test_initialization_statistics():
    cfg = config(num_layers=4, hidden_size=128, ffn_hidden_size=512, vocab_size=512)
    torch.manual_seed(0)
    model = GPT(cfg)
    scaled = 0.02 / math.sqrt(2 * cfg.num_layers)
    expected_std = {"query_key_value.weight": 0.02, "dense_h_to_4h.weight": 0.02}
    expected_std |= {"self_attention.dense.weight": scaled, "dense_4h_to_h.weight": scaled}
    expected_std |= {"word_embeddings.weight": 0.02, "position_embeddings.weight": 0.02}
    checked = 0
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "layernorm" in name:
            assert torch.all(p == 1), name
        else:
            std = next(v for k, v in expected_std.items() if name.endswith(k))
            if name.endswith("word_embeddings.weight"):  # padding rows start at zero
                assert not p[cfg.orig_vocab_size :].any(), name
                p = p[: cfg.orig_vocab_size]
            n = p.numel()  # standard error of the sample std is std / sqrt(2n); allow 5 of them
            assert abs(p.std().item() - std) < 5 * std / math.sqrt(2 * n), name
            assert abs(p.mean().item()) < 5 * std / math.sqrt(n), name
            checked += 1
    assert checked == 2 + 4 * cfg.num_layers


def test_same_seed_same_model():
    torch.manual_seed(3)
    a = GPT(config()).state_dict()
    torch.manual_seed(3)
    b = GPT(config()).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_output_layer_is_tied_to_the_input_embedding():
    cfg = config()
    model = GPT(cfg)
    word = model.embedding.word_embeddings.weight
    assert not any(p.shape == word.shape and p is not word for p in model.parameters())
    tokens = torch.full((1, 8), 5)  # only token 5 is looked up in the input embedding
    labels = torch.full((1, 8), 7)
    model(tokens, labels=labels).sum().backward()
    rows_with_grad = (word.grad.abs().sum(1) > 0).nonzero().flatten().tolist()
    assert rows_with_grad == list(range(100))  # the output layer reaches every real row...
    with torch.no_grad():  # ...and changing a row changes that token's logit
        before = model(tokens)[0, -1, 42].item()
        word[42] += 1.0
        assert model(tokens)[0, -1, 42].item() != before


def closed_form_parameter_count(cfg: GPTConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    per_layer = 2 * (2 * h)  # two LayerNorms
    per_layer += 3 * h * h + 3 * h + h * h + h  # qkv and dense
    per_layer += h * f + f + f * h + h  # MLP
    return cfg.vocab_size * h + cfg.max_position_embeddings * h + cfg.num_layers * per_layer + 2 * h


def test_parameter_count_and_megatron_line(capsys):
    cfg = config(num_layers=3, ffn_hidden_size=96, max_position_embeddings=48)
    model = GPT(cfg)
    expected = closed_form_parameter_count(cfg)
    assert model.num_parameters() == expected
    embeddings = (cfg.vocab_size + cfg.max_position_embeddings) * cfg.hidden_size
    assert model.num_parameters(exclude_embeddings=True) == expected - embeddings
    assert print_num_parameters(model) == expected
    assert (
        capsys.readouterr().out == f" > number of parameters on model parallel rank 0: {expected}\n"
    )


def loss_and_grads(cfg: GPTConfig, seed: int = 0):
    torch.manual_seed(1234)
    model = GPT(cfg).train()
    tokens, labels = batch(cfg)
    torch.manual_seed(seed)  # dropout masks
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full"),  # uniform, one layer per unit: every layer
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(recompute_granularity="selective"),
    ],
)
def test_recompute_gives_identical_loss_and_grads_with_dropout(recompute, monkeypatch):
    base = dict(hidden_dropout=0.1, attention_dropout=0.1)
    loss, grads = loss_and_grads(config(**base))
    calls = []
    core = gpt_module._core_attention
    monkeypatch.setattr(gpt_module, "_core_attention", lambda *a: calls.append(1) or core(*a))
    loss_rc, grads_rc = loss_and_grads(config(**base, **recompute))
    # Recompute really happened: the attention core ran again in backward for recomputed layers.
    block = recompute.get("recompute_method") == "block"
    recomputed = recompute["recompute_num_layers"] if block else 2
    assert len(calls) == 2 + recomputed
    assert torch.equal(loss, loss_rc)
    for name in grads:
        assert torch.equal(grads[name], grads_rc[name]), name
    # Dropout is active: another seed changes the loss (else the check above would be vacuous).
    assert not torch.equal(loss, loss_and_grads(config(**base), seed=1)[0])


def test_bf16_forward_and_fp32_loss():
    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens, labels = batch(cfg)
    loss32 = model(tokens, labels=labels)
    model.to(torch.bfloat16)
    loss16 = model(tokens, labels=labels)
    assert loss16.dtype == torch.float32
    assert model(tokens).dtype == torch.bfloat16
    torch.testing.assert_close(loss16, loss32, rtol=0.02, atol=0.02)
    loss16.mean().backward()
    assert model.embedding.word_embeddings.weight.grad.dtype == torch.bfloat16


def test_explicit_attention_mask_means_may_attend():
    cfg = config()
    model = GPT(cfg).eval()
    tokens, _ = batch(cfg)
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    torch.testing.assert_close(
        model(tokens, attention_mask=causal[None, None]), model(tokens), rtol=1e-6, atol=1e-6
    )
    # Hiding the first key from every query but itself changes the later positions only.
    mask = causal.clone()
    mask[1:, 0] = False
    out = model(tokens, attention_mask=mask[None, None])
    assert torch.equal(out[:, 0], model(tokens)[:, 0])
    assert not torch.allclose(out[:, 1:], model(tokens)[:, 1:])


def test_kv_cache_matches_full_forward():
    cfg = config()
    model = GPT(cfg).eval()
    tokens, _ = batch(cfg)
    full = model(tokens)
    cache = KVCache.for_model(model, batch_size=2)
    pieces = [model(tokens[:, :5], kv_cache=cache)]  # prefill
    pieces += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(5, 9)]  # one at a time
    pieces.append(model(tokens[:, 9:], kv_cache=cache))  # a chunk after cached positions
    assert cache.length == 32
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        model(tokens[:, :1], kv_cache=cache)


def test_too_long_input_is_a_clear_error():
    model = GPT(config())
    with pytest.raises(ConfigError, match="33 positions exceed max_position_embeddings=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_vocab_parallel_cross_entropy_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 50, generator=g)).requires_grad_()
    target = torch.randint(0, 50, (2, 5), generator=g)
    weights = torch.rand(2, 5, generator=g)
    ours = vocab_parallel_cross_entropy(logits * 1.0, target)
    (ours * weights).sum().backward()
    grad_ours, logits.grad = logits.grad, None
    ref = F.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none")
    (ref.reshape(2, 5) * weights).sum().backward()
    torch.testing.assert_close(ours.reshape(-1), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_ours, logits.grad, rtol=1e-6, atol=1e-7)
    half = vocab_parallel_cross_entropy(logits.detach().bfloat16(), target)
    assert half.dtype == torch.float32


def test_parallel_layers_at_tp1_and_their_attributes():
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 12)
    row = RowParallelLinear(12, 8, bias=False)
    emb = VocabParallelEmbedding(16, 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(col(x), x @ col.weight.t() + col.bias)
    assert row.bias is None
    assert (col.weight.partition_dim, row.weight.partition_dim, emb.weight.partition_dim) == (
        0,
        1,
        0,
    )
    assert col.weight.tensor_model_parallel and col.bias.tensor_model_parallel
    assert not hasattr(row.weight, "sequence_parallel") and row.weight.partition_stride == 1
    assert torch.equal(emb(torch.tensor([3, 15])), emb.weight[[3, 15]])
    for make in (
        lambda: ColumnParallelLinear(8, 12, tp_size=2),
        lambda: RowParallelLinear(12, 8, tp_size=2, tp_rank=1),
        lambda: VocabParallelEmbedding(16, 8, tp_size=4),
    ):
        with pytest.raises(UnsupportedError, match="tensor parallelism"):
            make()


@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 3)])
def test_partitioned_init_assembles_to_the_tp1_weight(dim, stride):
    init = lambda t: torch.nn.init.normal_(t, std=0.02)  # noqa: E731
    full = torch.empty(12, 6)
    torch.manual_seed(0)
    _init_partition(full, (12, 6), dim, init, tp_size=1, tp_rank=0, stride=stride)
    shards = []
    for rank in range(2):
        shard = torch.empty((6, 6) if dim == 0 else (12, 3))
        torch.manual_seed(0)
        _init_partition(shard, (12, 6), dim, init, tp_size=2, tp_rank=rank, stride=stride)
        shards.append(shard)
    if stride == 1:
        assert torch.equal(torch.cat(shards, dim), full)
    else:  # rank r holds blocks r, r + 2, r + 4 of the six stride blocks
        blocks = [b for r in range(3) for b in (shards[0].chunk(3)[r], shards[1].chunk(3)[r])]
        assert torch.equal(torch.cat(blocks), full)


def test_vocab_padded_keys_name_the_vocab_rows():
    sd = GPT(config()).state_dict()
    for key in VOCAB_PADDED_KEYS:
        assert sd[key].shape[0] == 128


def test_vocab_padding_does_not_change_the_initial_model():
    # Layouts pad the vocabulary differently (50304 at TP 1, 50432 at TP 2); the model they start
    # from must be the same: real rows equal, padding rows zero, every other tensor identical.
    def build(padded: int) -> GPT:
        torch.manual_seed(0)
        return GPT(config(vocab_size=padded, orig_vocab_size=1000))

    a, b = build(1024).state_dict(), build(1088).state_dict()
    for key in a:
        if key == "embedding.word_embeddings.weight":
            assert torch.equal(a[key][:1000], b[key][:1000])
            assert not a[key][1000:].any() and not b[key][1000:].any()
        else:
            assert torch.equal(a[key], b[key]), key
