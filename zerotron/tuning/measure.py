"""What a live run really holds, per term of the estimator, to check it against.

:func:`measure_run` builds a run as ``zerotron pretrain`` does and trains it on random tokens
under :class:`zerotron.engine.memory_breakdown.StepMemory` (the one measurement: the training
loop's ``--memory-breakdown-step`` uses it too); :func:`write_byte_tokenizer` and
:func:`synthetic_batches` make the small inputs such runs want.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotron.distributed import comm
from zerotron.engine.memory_breakdown import TERMS, StepMemory
from zerotron.kernels import KernelShape, choose_kernels


def write_byte_tokenizer(directory: str) -> list[str]:
    """A 257-token byte-level GPT-2 tokenizer (the 256 bytes and ``<|endoftext|>``, no merges)
    written to ``directory``; returns the ``--vocab-file`` / ``--merge-file`` flags that use it.
    Small models measured with it are not dominated by a 50257-row embedding."""
    import json
    from pathlib import Path

    from zerotron.data.tokenizer import EOD_TOKEN, bytes_to_unicode
    from zerotron.fileio import atomic_open

    encoder = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    encoder[EOD_TOKEN] = len(encoder)
    vocab, merges = Path(directory) / "vocab.json", Path(directory) / "merges.txt"
    for path, text in ((vocab, json.dumps(encoder)), (merges, "#version: 0.2\n")):
        with atomic_open(path, "w") as f:
            f.write(text)
    return ["--vocab-file", str(vocab), "--merge-file", str(merges)]


def synthetic_batches(cfg: Any, vocab_size: int, seed: int = 0) -> Any:
    """An endless iterator of random GPT micro-batches shaped as ``cfg`` says."""
    gen = torch.Generator().manual_seed(seed)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    while True:
        tokens = torch.randint(0, vocab_size, (b, s + 1), generator=gen)
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s).contiguous(),
        }


def measure_run(cfg: Any, steps: int = 1) -> dict[str, int]:
    """Build ``cfg``'s run on this rank (model-parallel groups already set up, as ``zerotron
    pretrain`` sets them), train ``steps`` steps on random tokens and return what this rank
    held, per estimator term (:data:`~zerotron.engine.memory_breakdown.TERMS`; each term's
    largest over the steps): model states, ``activations`` (one micro-batch's forward, or the
    pipeline schedule's micro-batches in flight), ``loss_workspace`` and ``comm_buffers`` (see
    :mod:`zerotron.engine.memory_breakdown`)."""
    from zerotron.training.build import build_run

    run = build_run(cfg)
    # the kernels pretrain would run (its --kernels, else the cached or measured ones)
    shape = KernelShape.from_config(cfg, run.tokenizer.vocab_size)
    choose_kernels(shape, run.engine.device, cfg.model.kernels, group=comm.world_group())
    data = synthetic_batches(cfg, run.tokenizer.vocab_size)
    out = dict.fromkeys(TERMS, 0)
    for _ in range(steps):
        with StepMemory(run.engine) as step:
            run.engine.train_batch(data)
        assert step.terms is not None
        out = {t: max(out[t], step.terms[t]) for t in TERMS}
    return out
