"""Generation on the GPU: greedy equals transformers' generate on the same device and
zerotron's own CPU run (fp32, the weights of tests/test_generate.py's fixture); sampling with a
seed, or with the CPU generator a user passes, is reproducible."""

from __future__ import annotations

import pytest
import torch

from tests.test_generate import make_hf_and_ours, prompt
from zerotron.inference import generate, generate_batch

NEW = 24


@pytest.fixture(scope="module")
def models(device):
    """(transformers on the device, zerotron on the device, zerotron on the CPU), fp32."""
    hf, ours_cpu = make_hf_and_ours()
    ours = type(ours_cpu)(ours_cpu.config).eval()
    ours.load_state_dict(ours_cpu.state_dict())
    return hf.to(device), ours.to(device), ours_cpu


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_greedy_equals_transformers_and_the_cpu(models, device, use_kv_cache):
    hf, ours, ours_cpu = models
    ids = prompt(7)
    expected = hf.generate(
        torch.tensor([ids], device=device),
        do_sample=False,
        max_new_tokens=NEW,
        pad_token_id=0,
        eos_token_id=None,
    )[0, len(ids) :].tolist()
    got = generate(ours, ids, NEW, greedy=True, use_kv_cache=use_kv_cache)
    assert got == expected
    assert got == generate(ours_cpu, ids, NEW, greedy=True, use_kv_cache=use_kv_cache)
    assert len(set(got)) > 3  # a non-degenerate sequence, so the comparison means something


def test_batch_greedy_equals_one_by_one(models):
    _, ours, _ = models
    prompts = [prompt(3, seed=1), prompt(9, seed=2)]
    one_by_one = [generate(ours, p, NEW, greedy=True) for p in prompts]
    assert generate_batch(ours, prompts, NEW, greedy=True) == one_by_one


def test_sampling_is_reproducible_with_a_seed_or_a_cpu_generator(models):
    _, ours, _ = models
    kw = dict(temperature=1.5, top_k=50, top_p=0.95)
    seeded = generate(ours, prompt(4), 20, seed=7, **kw)
    assert seeded == generate(ours, prompt(4), 20, seed=7, **kw)
    a = generate(ours, prompt(4), 20, generator=torch.Generator().manual_seed(3), **kw)
    b = generate(ours, prompt(4), 20, generator=torch.Generator().manual_seed(3), **kw)
    assert a == b and len(a) == 20
