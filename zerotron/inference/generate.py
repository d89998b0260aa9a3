"""Text generation: sampling filters (temperature, top-k, top-p) and the decoding loop.

The loop feeds the prompt once and then one token per step, reusing the keys and values of past
positions from a :class:`~zerotron.models.gpt.KVCache` (``use_kv_cache=False`` recomputes the
whole sequence every step: slower, same tokens). Padded vocabulary entries (ids ``>=
orig_vocab_size``) are cut off before sampling, so they can never be produced.

Several prompts of different lengths decode together in :func:`generate_batch`: they are padded
on the left, with an attention mask that hides the padding and position ids that start at 0 where
each prompt starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zerotron.errors import ConfigError
from zerotron.models.gpt import GPT, KVCache


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf``."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -torch.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches ``p``.

    A token is kept when the probability of the tokens ranked before it is below ``p``, so the
    most likely token always stays.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove = torch.empty_like(mass_before, dtype=torch.bool).scatter_(-1, order, mass_before >= p)
    return logits.masked_fill(remove, -torch.inf)


def sample_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next-token ids ``[b]`` from ``logits`` ``[b, vocab]``.

    ``greedy`` (or ``top_k=1``) takes the argmax; otherwise logits are divided by ``temperature``,
    filtered by top-k then top-p, and sampled (with ``generator`` when given).
    """
    _check_sampling(temperature, top_k, top_p)
    if greedy or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    logits = top_p_filter(top_k_filter(logits, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device.type != probs.device.type:
        # torch samples only with a generator of the tensor's device type: a CPU generator (the
        # default torch.Generator()) with a model on CUDA draws on the CPU, from its stream.
        on = probs.to(generator.device)
        return torch.multinomial(on, 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature > 0:
        raise ConfigError(
            f"temperature must be positive (got {temperature})",
            where="--temperature",
            fix="use --greedy for deterministic decoding",
        )
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (got {top_k})", where="--top-k", fix="0 disables it")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(
            f"top_p must be in (0, 1] (got {top_p})", where="--top-p", fix="1 disables"
        )


@torch.no_grad()
def generate(
    model: GPT,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    eod: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    use_kv_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Continue one prompt; return the new token ids (ending with ``eod`` if it was produced).

    ``seed`` (or an explicit ``generator``) makes sampling reproducible; ``on_token`` is called
    with each new token as soon as it is chosen (for printing as it goes).
    """
    callback = None if on_token is None else (lambda ids: on_token(int(ids[0])))
    return generate_batch(
        model,
        [prompt_ids],
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        eod=eod,
        seed=seed,
        generator=generator,
        use_kv_cache=use_kv_cache,
        on_step=callback,
    )[0]


@torch.no_grad()
def generate_batch(
    model: GPT,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    eod: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    use_kv_cache: bool = True,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Continue several prompts together; one list of new token ids per prompt.

    A prompt stops after producing ``eod``; the loop ends when all have stopped or after
    ``max_new_tokens``. ``on_step`` receives the ``[batch]`` tokens chosen at each step.
    """
    cfg = model.config
    _check_sampling(temperature, top_k, top_p)
    prompts = [torch.as_tensor(p, dtype=torch.long).flatten().tolist() for p in prompts]
    _check_prompts(prompts, max_new_tokens, cfg.orig_vocab_size, cfg.max_position_embeddings)
    if max_new_tokens == 0:
        return [[] for _ in prompts]

    device = model.embedding.word_embeddings.weight.device
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    batch, prompt_len = len(prompts), max(map(len, prompts))
    total = prompt_len + max_new_tokens
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, prompt_len - len(p) : prompt_len] = torch.tensor(p, device=device)
    pad = torch.tensor([prompt_len - len(p) for p in prompts], device=device)
    padded = bool(pad.any())
    if padded:  # left padding: positions start at each prompt's first token
        steps = torch.arange(total, device=device)
        position_ids = (steps[None, :] - pad[:, None]).clamp(min=0)
        real_key = steps[None, :] >= pad[:, None]  # [b, total]

    cache = KVCache.for_model(model, batch, total) if use_kv_cache else None
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    try:
        cur = prompt_len
        for _ in range(max_new_tokens):
            start = cache.length if cache is not None else 0
            kwargs = {}
            if padded:
                kwargs["position_ids"] = position_ids[:, start:cur]
                kwargs["attention_mask"] = _padded_causal_mask(real_key[:, :cur], start)
            logits = model(tokens[:, start:cur], kv_cache=cache, **kwargs)
            next_ids = sample_logits(
                logits[:, -1, : cfg.orig_vocab_size],  # padded vocab entries are never candidates
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                greedy=greedy,
                generator=generator,
            )
            tokens[:, cur] = next_ids
            cur += 1
            if on_step is not None:
                on_step(next_ids)
            if eod is not None:
                done |= next_ids == eod
                if bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return [_until_eod(row, eod) for row in tokens[:, prompt_len:cur].tolist()]


def _padded_causal_mask(real_key: torch.Tensor, start: int) -> torch.Tensor:
    """``[b, 1, queries, keys]``: causal, padding hidden; a padding query sees itself (no NaN)."""
    keys = torch.arange(real_key.shape[1], device=real_key.device)
    queries = keys[start:]
    causal = keys[None, :] <= queries[:, None]
    itself = keys[None, :] == queries[:, None]
    return ((causal[None] & real_key[:, None, :]) | itself[None])[:, None]


def _until_eod(row: list[int], eod: int | None) -> list[int]:
    if eod is not None and eod in row:
        return row[: row.index(eod) + 1]
    return row


def _check_prompts(
    prompts: list[list[int]], max_new_tokens: int, vocab: int, max_positions: int
) -> None:
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token", fix="give a non-empty prompt")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > max_positions:
        raise ConfigError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"max_position_embeddings={max_positions}",
            fix=f"generate at most {max(max_positions - longest, 0)} tokens or shorten the prompt",
        )
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ConfigError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})",
                fix="tokenize with the tokenizer the model was trained with",
            )
