"""HF GPT-2 parity: import gives transformers' logits and loss; export round-trips exactly."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from zerotron.checkpoint.hf import (
    from_hf_state_dict,
    load_hf_dir,
    save_hf_dir,
    to_hf_state_dict,
)
from zerotron.errors import CheckpointError, UnsupportedError
from zerotron.models import GPT

VOCAB, PADDED = 1000, 1024


def random_hf_model(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A tiny GPT-2 whose every parameter (biases and LayerNorms too) is random."""
    torch.manual_seed(seed)
    kw = dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB)
    kw.update(overrides)
    model = GPT2LMHeadModel(GPT2Config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if ".ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return model


def to_ours(hf_model: GPT2LMHeadModel, padded: int | None = PADDED) -> GPT:
    cfg, sd = from_hf_state_dict(hf_model.state_dict(), hf_model.config.to_dict(), padded)
    model = GPT(cfg).eval()
    model.load_state_dict(sd, strict=True)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_parity(hf_model: GPT2LMHeadModel, ours: GPT) -> None:
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_out = hf_model(input_ids=ids, labels=ids)
        logits = ours(ids)
        # Megatron-style labels are already shifted: the loss at t predicts ids[t + 1].
        per_token = ours(ids[:, :-1], labels=ids[:, 1:])
    assert logits.shape == (2, 33, PADDED)
    assert rel_err(logits[..., :VOCAB], hf_out.logits) < 1e-5
    assert torch.all(logits[..., VOCAB:] == -torch.inf)
    assert per_token.dtype == torch.float32 and per_token.shape == (2, 32)
    assert abs(per_token.mean().item() - hf_out.loss.item()) < 1e-5 * hf_out.loss.item()
    reference = F.cross_entropy(
        hf_out.logits[:, :-1].double().reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
    )
    assert rel_err(per_token.double().reshape(-1), reference) < 1e-5


def test_import_from_in_memory_state_dict_matches_transformers():
    hf_model = random_hf_model()
    check_parity(hf_model, to_ours(hf_model))


def test_import_of_unprefixed_keys_with_old_attention_buffers():
    # The original OpenAI checkpoints on the Hub: no "transformer." prefix, causal-mask buffers.
    hf_model = random_hf_model(seed=9)
    sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    cfg, ours_sd = from_hf_state_dict(sd, hf_model.config.to_dict(), PADDED)
    ours = GPT(cfg).eval()
    ours.load_state_dict(ours_sd, strict=True)
    check_parity(hf_model, ours)


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
def test_import_from_directory_matches_transformers(tmp_path, fmt):
    hf_model = random_hf_model(seed=3)
    if fmt == "safetensors":
        hf_model.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").is_file()
    elif fmt == "sharded":
        hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:  # the older pickle format, with the tied lm_head.weight saved too
        hf_model.config.save_pretrained(tmp_path)
        torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    hf_sd, hf_config = load_hf_dir(tmp_path)
    cfg, sd = from_hf_state_dict(hf_sd, hf_config, PADDED)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 4)
    assert (cfg.vocab_size, cfg.orig_vocab_size, cfg.max_position_embeddings) == (PADDED, VOCAB, 64)
    assert torch.all(sd["embedding.word_embeddings.weight"][VOCAB:] == 0)
    ours = GPT(cfg).eval()
    ours.load_state_dict(sd, strict=True)
    check_parity(hf_model, ours)


def test_export_then_reload_in_transformers_is_identical(tmp_path):
    hf_model = random_hf_model(seed=5, n_inner=96)
    ours = to_ours(hf_model)
    hf_sd, hf_config = to_hf_state_dict(ours.state_dict(), ours.config)
    save_hf_dir(tmp_path / "out", hf_sd, hf_config)
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    original, back = hf_model.state_dict(), reloaded.state_dict()
    assert set(original) == set(back)
    for key, tensor in original.items():
        assert torch.equal(tensor, back[key]), key
    assert back["lm_head.weight"].data_ptr() == back["transformer.wte.weight"].data_ptr()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["vocab_size"] == VOCAB and written["n_inner"] == 96
    for key in ("n_layer", "n_embd", "n_head", "n_positions", "layer_norm_epsilon"):
        assert getattr(reloaded.config, key) == getattr(hf_model.config, key), key


def test_save_hf_dir_keeps_other_files(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    ours = to_ours(random_hf_model())
    save_hf_dir(tmp_path, *to_hf_state_dict(ours.state_dict(), ours.config))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "model.safetensors", "vocab.json"]  # no temp files left


def test_vocab_padding_does_not_change_the_loss():
    hf_model = random_hf_model(seed=7)
    unpadded, padded = to_ours(hf_model, padded=None), to_ours(hf_model, padded=PADDED)
    assert unpadded.config.vocab_size == VOCAB
    with torch.no_grad():  # padded rows that would dominate any softmax they took part in
        padded.embedding.word_embeddings.weight[VOCAB:] = 100.0
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    loss_a = unpadded(ids[:, :-1], labels=ids[:, 1:])
    loss_b = padded(ids[:, :-1], labels=ids[:, 1:])
    assert torch.equal(loss_a, loss_b)
    loss_b.sum().backward()
    assert torch.all(padded.embedding.word_embeddings.weight.grad[VOCAB:] == 0)


def test_unsupported_hf_variants_are_refused():
    hf_model = random_hf_model()
    sd, config = hf_model.state_dict(), hf_model.config.to_dict()
    with pytest.raises(UnsupportedError, match="activation_function"):
        from_hf_state_dict(sd, {**config, "activation_function": "relu"})
    with pytest.raises(UnsupportedError, match="scale_attn_by_inverse_layer_idx"):
        from_hf_state_dict(sd, {**config, "scale_attn_by_inverse_layer_idx": True})
    untied = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 1})
    with pytest.raises(UnsupportedError, match="untied"):
        from_hf_state_dict(untied, config)


def test_incomplete_or_mismatched_hf_checkpoints_are_clear_errors(tmp_path):
    hf_model = random_hf_model()
    sd, config = hf_model.state_dict(), hf_model.config.to_dict()
    missing = {k: v for k, v in sd.items() if k != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(CheckpointError, match=r"h\.1\.mlp\.c_fc\.bias"):
        from_hf_state_dict(missing, config)
    with pytest.raises(CheckpointError, match=r"h\.1\."):  # config says 1 layer, weights have 2
        from_hf_state_dict(sd, {**config, "n_layer": 1})
    with pytest.raises(CheckpointError, match="wte"):
        from_hf_state_dict(sd, {**config, "vocab_size": VOCAB + 1})
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no weights"):
        load_hf_dir(tmp_path)
