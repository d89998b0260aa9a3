"""Text generation: greedy parity with transformers, KV cache, sampling filters, padding, seeds."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from zerotron.checkpoint.hf import from_hf_state_dict
from zerotron.errors import ConfigError
from zerotron.inference import generate, generate_batch, sample_logits, top_k_filter, top_p_filter
from zerotron.models import GPT, GPTConfig

VOCAB, PADDED = 1000, 1024


@pytest.fixture(scope="module")
def hf_and_ours():
    return make_hf_and_ours()


def make_hf_and_ours() -> tuple[GPT2LMHeadModel, GPT]:
    """transformers' GPT-2 with well-spread random weights and zerotron's GPT holding them."""
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB)
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            base = 1.0 if ".ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    cfg, sd = from_hf_state_dict(hf.state_dict(), hf.config.to_dict(), PADDED)
    ours = GPT(cfg).eval()
    ours.load_state_dict(sd)
    return hf, ours


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_greedy_equals_transformers_generate(hf_and_ours, use_kv_cache):
    hf, ours = hf_and_ours
    ids = prompt(7)
    expected = hf.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None
    )[0, len(ids) :].tolist()
    got = generate(ours, ids, 24, greedy=True, use_kv_cache=use_kv_cache)
    assert got == expected
    assert len(set(got)) > 3  # a non-degenerate sequence, so the comparison means something


def test_kv_cache_sampling_equals_recomputing(hf_and_ours):
    _, ours = hf_and_ours
    kw = dict(temperature=0.8, top_k=50, top_p=0.9, seed=11)
    with_cache = generate(ours, prompt(5), 30, use_kv_cache=True, **kw)
    without = generate(ours, prompt(5), 30, use_kv_cache=False, **kw)
    assert with_cache == without


def test_seed_reproducibility(hf_and_ours):
    _, ours = hf_and_ours
    a = generate(ours, prompt(4), 20, temperature=2.0, seed=1)
    b = generate(ours, prompt(4), 20, temperature=2.0, seed=1)
    c = generate(ours, prompt(4), 20, temperature=2.0, seed=2)
    d = generate(ours, prompt(4), 20, temperature=2.0, generator=torch.Generator().manual_seed(1))
    assert a == b == d
    assert a != c


def test_top_k_one_is_greedy(hf_and_ours):
    _, ours = hf_and_ours
    assert generate(ours, prompt(6), 16, top_k=1, temperature=3.0, seed=5) == generate(
        ours, prompt(6), 16, greedy=True
    )


def test_padded_vocab_is_never_sampled():
    torch.manual_seed(0)
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        seq_length=64,
        vocab_size=128,
        orig_vocab_size=100,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # tied: padded rows would win every softmax they were part of
        model.embedding.word_embeddings.weight[100:] = 1e4
    out = generate(model, [1, 2, 3], 60, temperature=10.0, seed=0)
    assert len(out) == 60 and max(out) < 100
    assert len(set(out)) > 20  # high temperature: spread over the real vocabulary


def test_top_k_filter_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 2.5]])
    kept = top_k_filter(logits, 3)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, True]]
    assert torch.equal(kept[torch.isfinite(kept)], torch.tensor([3.0, 2.0, 2.5]))
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_top_p_filter_keeps_the_nucleus():
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    keep = lambda p: torch.isfinite(top_p_filter(logits, p)).tolist()[0]  # noqa: E731
    assert keep(0.5) == [False, True, False, False]
    assert keep(0.7) == [False, True, False, True]  # 0.5 < 0.7: the next one is needed
    assert keep(0.81) == [False, True, True, True]
    assert keep(1.0) == [True, True, True, True]
    assert keep(1e-6) == [False, True, False, False]  # the most likely token always stays


def test_sampling_respects_the_filters():
    logits = torch.tensor([[0.0, 1.0, 0.5, 4.0, 3.0, 2.0]]).expand(4000, -1)
    g = torch.Generator().manual_seed(0)
    ids = sample_logits(logits, top_k=2, temperature=5.0, generator=g)
    assert set(ids.tolist()) == {3, 4}
    ids = sample_logits(logits, temperature=100.0, generator=g)  # nearly uniform
    assert set(ids.tolist()) == set(range(6))
    assert torch.equal(sample_logits(logits[:2], greedy=True), torch.tensor([3, 3]))


def test_eod_stops_generation(hf_and_ours):
    _, ours = hf_and_ours
    greedy = generate(ours, prompt(6), 10, greedy=True)
    eod = greedy[3]
    first = greedy.index(eod)
    assert generate(ours, prompt(6), 10, greedy=True, eod=eod) == greedy[: first + 1]


def test_batch_of_different_lengths_equals_one_by_one(hf_and_ours):
    _, ours = hf_and_ours
    prompts = [prompt(3, seed=1), prompt(9, seed=2), prompt(6, seed=3)]
    singles = [generate(ours, p, 12, greedy=True) for p in prompts]
    for use_kv_cache in (True, False):
        batch = generate_batch(ours, prompts, 12, greedy=True, use_kv_cache=use_kv_cache)
        assert batch == singles


def test_batch_rows_stop_at_their_own_eod(hf_and_ours):
    _, ours = hf_and_ours
    prompts = [prompt(4, seed=4), prompt(5, seed=5)]
    singles = [generate(ours, p, 12, greedy=True) for p in prompts]
    eod = singles[0][2]
    expected = [s[: s.index(eod) + 1] if eod in s else s for s in singles]
    assert generate_batch(ours, prompts, 12, greedy=True, eod=eod) == expected


def test_streaming_callback_and_mode_restored(hf_and_ours):
    _, ours = hf_and_ours
    seen = []
    ours.train()
    out = generate(ours, torch.tensor(prompt(5)), 8, greedy=True, on_token=seen.append)
    assert ours.training
    ours.eval()
    assert seen == out == generate(ours, prompt(5), 8, greedy=True)


def test_bad_requests_are_clear_errors(hf_and_ours):
    _, ours = hf_and_ours
    with pytest.raises(ConfigError, match="max_position_embeddings=64"):
        generate(ours, prompt(60), 10)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        generate(ours, [5, VOCAB + 3], 2)  # a padded id is not a real token either
    with pytest.raises(ConfigError, match="at least one token"):
        generate(ours, [], 2)
    with pytest.raises(ConfigError, match="temperature"):
        generate(ours, [1], 2, temperature=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        generate(ours, [1], 2, top_p=0.0)
    assert generate(ours, [1, 2], 0) == []
