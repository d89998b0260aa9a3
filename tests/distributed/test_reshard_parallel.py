"""A checkpoint trained at tp2 × pp2, resharded offline, gives the same model on every layout;
and ``generate`` on it under tp2 gives the tokens the merged tp1 model gives in one process.

One spawn of 4 gloo ranks: ``zerotron pretrain`` trains the tiny GPT-2 (2 layers, hidden 64,
4 heads, sequence 16, AdamW) for 2 steps at tp2 × pp2 and saves; the model loaded back in that
layout computes the logits of fixed tokens (stage 0 sends its activation to stage 1). Rank 0
reshards the checkpoint with :func:`reshard_checkpoint` (what ``zerotron convert
--target-...`` runs) to tp1×pp1, tp1×pp2 and tp2×pp1; each 4-rank layout (the rest data
parallel) builds its run, loads its checkpoint through the Engine (the optimizer starts
fresh: none was resharded) and computes the logits again. Under tp2 the ranks also generate,
greedily and with seeded sampling, from the original checkpoint via ``load_gpt``.

Checked in this process: every layout's logits (and ``load_gpt``'s merged tp1 model's) equal
the original's within 1e-6 of the largest logit, over the real vocabulary (the paddings differ:
50304 rows at tp1, 50432 at tp2); tp2 → tp1 → tp2 gives every tensor back bit for bit; the tp2
ranks generate what the merged model generates here.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import load_file, model_files, read_latest_tag
from zerotron.checkpoint.model import load_gpt
from zerotron.checkpoint.reshard import reshard_checkpoint
from zerotron.config import parse_megatron_args
from zerotron.distributed import comm
from zerotron.distributed.state import destroy_model_parallel, initialize_model_parallel, state
from zerotron.inference.generate import generate
from zerotron.training.build import build_run
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

ORIG_VOCAB = 50257  # GPT-2's tokenizer, bundled
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
    "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--seed", "1234", "--train-iters", "2", "--save-interval", "1000", "--num-workers", "0",
]  # fmt: skip
LAYOUTS = {"tp2pp2": (2, 2), "tp1pp1": (1, 1), "tp1pp2": (1, 2), "tp2pp1": (2, 1)}
PROMPT = [464, 3290, 318, 257]
SAMPLING = {"temperature": 0.8, "top_k": 50, "seed": 11}
NEW_TOKENS = 10


def _tokens() -> torch.Tensor:
    return torch.randint(0, ORIG_VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _logits(run) -> torch.Tensor | None:
    """Logits of :func:`_tokens` on the last pipeline stage (None on the others)."""
    ps, tokens = state(), _tokens()
    run.model.eval()
    with torch.no_grad():
        if ps.pp_size == 1:
            return run.model(tokens)
        (chunk,) = run.model.chunks
        if ps.pp_rank == 0:
            comm.send(chunk(None, {"tokens": tokens}), ps.pp.global_rank(1))
            return None
        hidden = torch.empty(*tokens.shape, run.model.config.hidden_size)
        comm.recv(hidden, ps.pp.global_rank(0))
        return chunk(hidden, {"tokens": tokens})


def _layout_logits(ckpt: str, data: str, tp: int, pp: int) -> torch.Tensor | None:
    """Build the run of a layout, load ``ckpt`` (saved in that layout) and compute logits."""
    initialize_model_parallel(tp, pp)
    argv = [*TINY, "--data-path", data, *_flags(tp, pp)]
    run = build_run(parse_megatron_args(argv, world_size=4))
    run.engine.load_checkpoint(ckpt, load_optimizer_states=False, load_rng=False)
    return _logits(run)


def _rank(rank: int, data: str, root: str) -> dict:
    out = {}
    with contextlib.redirect_stdout(io.StringIO()):
        argv = [*TINY, "--data-path", data, *_flags(2, 2), "--save", f"{root}/tp2pp2"]
        pretrain(parse_megatron_args(argv, world_size=4))
        out["tp2pp2"] = _layout_logits(f"{root}/tp2pp2", data, 2, 2)
        destroy_model_parallel()
        if rank == 0:  # offline, as `zerotron convert` does
            for name, (tp, pp) in LAYOUTS.items():
                if name != "tp2pp2":
                    reshard_checkpoint(f"{root}/tp2pp2", f"{root}/{name}", tp, pp)
        comm.barrier()
        for name in ("tp1pp2", "tp2pp1"):
            out[name] = _layout_logits(f"{root}/{name}", data, *LAYOUTS[name])
            destroy_model_parallel()
        # Generation at tp2 straight from the tp2 x pp2 checkpoint (merged, then this TP shard).
        initialize_model_parallel(2, 1)
        model, _ = load_gpt(f"{root}/tp2pp2")
        out["tp_size"] = model.tp_group.size
        out["greedy"] = generate(model, PROMPT, NEW_TOKENS, greedy=True)
        out["sampled"] = generate(model, PROMPT, NEW_TOKENS, **SAMPLING)
        destroy_model_parallel()
    return out


TP2_PP2 = pytest.mark.xdist_group("reshard_tp2_pp2")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def tp2_pp2(data_prefix, tmp_path_factory) -> tuple[list[dict], Path]:
    """One spawn: the tp2 x pp2 checkpoint, resharded and generated from on 4 ranks."""
    root = tmp_path_factory.mktemp("reshard")
    return run_ranks(_rank, 4, data_prefix, str(root), timeout=240), root


@TP2_PP2
def test_resharded_layouts_give_the_tp2_pp2_logits(tp2_pp2):
    _check_logits(*tp2_pp2)


@TP2_PP2
def test_reshard_round_trip_is_exact(tp2_pp2):
    _check_round_trip(tp2_pp2[1])


@TP2_PP2
def test_generation_at_tp2_equals_one_process(tp2_pp2):
    _check_generation(*tp2_pp2)


def _close(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest logit difference over the real vocabulary, relative to the largest logit."""
    a, ref = a[..., :ORIG_VOCAB].double(), ref[..., :ORIG_VOCAB].double()
    return float((a - ref).abs().max() / ref.abs().max())


def _check_logits(results: list[dict], root: Path) -> None:
    last_stage = [2, 3]  # tp2 x pp2: ranks 2 and 3 hold stage 1
    ref = results[2]["tp2pp2"]
    assert ref.shape == (2, 16, 50432)
    assert torch.equal(results[3]["tp2pp2"], ref)  # TP ranks gather the same logits
    assert all(results[r]["tp2pp2"] is None for r in range(4) if r not in last_stage)
    worst = {}
    # tp1 x pp2 and tp2 x pp1 on 4 ranks: pp2 stage 1 is ranks 2, 3; pp1: every rank.
    for name, ranks in (("tp1pp2", last_stage), ("tp2pp1", range(4))):
        for r in ranks:
            worst[name] = max(worst.get(name, 0.0), _close(results[r][name], ref))
    merged, _ = load_gpt(root / "tp1pp1")  # the offline tp1 checkpoint, in one process
    direct, _ = load_gpt(root / "tp2pp2")  # the tp2 x pp2 files merged on load
    assert merged.config.vocab_size == 50304 and direct.config.vocab_size == 50432
    with torch.no_grad():
        worst["tp1pp1"] = _close(merged(_tokens()), ref)
        worst["load_gpt"] = _close(direct(_tokens()), ref)
    print("max |logit diff| / max |logit| vs tp2pp2:", worst)
    assert all(v <= 1e-6 for v in worst.values()), worst
    assert ref[..., ORIG_VOCAB:].eq(float("-inf")).all()  # padding never gets probability


def _check_round_trip(root: Path) -> None:
    tag = read_latest_tag(root / "tp2pp2")
    reshard_checkpoint(root / "tp1pp1", root / "back", 2, 2)
    for f in model_files(2, 2):
        original = load_file(root / "tp2pp2", tag, f)["model"]
        back = load_file(root / "back", tag, f)["model"]
        assert original.keys() == back.keys(), f
        for key, t in original.items():
            assert back[key].dtype == t.dtype and torch.equal(back[key], t), f"{f}: {key}"


def _check_generation(results: list[dict], root: Path) -> None:
    model, _ = load_gpt(root / "tp1pp1")
    greedy = generate(model, PROMPT, NEW_TOKENS, greedy=True)
    sampled = generate(model, PROMPT, NEW_TOKENS, **SAMPLING)
    assert greedy != sampled  # the sampled run does sample
    for r in results:
        assert r["tp_size"] == 2
        assert r["greedy"] == greedy and r["sampled"] == sampled
