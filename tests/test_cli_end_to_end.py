"""The `zerotron` commands as a user runs them: exit codes, a save killed mid-way, HF import ->
generate -> export, and generation from a pretrain checkpoint.

Subprocesses only where the process boundary is the point (exit codes, SIGKILL); everything else
calls ``zerotron.cli.main`` in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zerotron.cli
import zerotron.inference.cli
from zerotron.checkpoint import load_file, model_file, read_latest_tag
from zerotron.checkpoint.checksums import file_checksum
from zerotron.checkpoint.layout import MEGATRON_TRACKER
from zerotron.config import parse_megatron_args
from zerotron.data.tokenizer import build_tokenizer
from zerotron.training.pretrain import pretrain

REPO = Path(__file__).resolve().parent.parent
VOCAB, PADDED = 50257, 50304

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
]  # fmt: skip
TRAIN = [*MODEL, "--lr", "1e-3", "--split", "80,10,10", "--eval-iters", "1", "--log-interval", "2"]


def python_m_zerotron(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "zerotron", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- exit codes -----------------------------------------------------------------------------


def test_train_iters_zero_exits_zero():
    p = python_m_zerotron("pretrain", *MODEL, "--train-iters", "0", "--lr", "1e-3")
    assert p.returncode == 0, p.stderr
    assert " > number of parameters on model parallel rank 0: " in p.stdout
    assert "------------------------ arguments ------------------------" in p.stdout
    assert "error" not in p.stderr


def test_unknown_flag_exits_two_and_suggests():
    p = python_m_zerotron("pretrain", *MODEL, "--train-iters", "0", "--hidden-szie", "64")
    assert p.returncode == 2
    assert "--hidden-szie" in p.stderr and "did you mean --hidden-size" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


# ---- a save killed mid-way ------------------------------------------------------------------

# Runs pretrain; its second checkpoint save stops after every file of the checkpoint is written
# and fsynced, just before the directory is renamed into place, tells the test, and waits to be
# killed.
CHILD = """
import sys, time
from pathlib import Path
import zerotron.checkpoint.save_load as save_load
from zerotron.config import parse_megatron_args
from zerotron.training.pretrain import pretrain

ready, argv = Path(sys.argv[1]), sys.argv[2:]
real_commit = save_load.commit_dir
calls = []

def commit_then_hang_on_second(tmp, final):
    calls.append(final)
    if len(calls) == 2:
        ready.write_text(str(tmp))
        while True:
            time.sleep(60)
    real_commit(tmp, final)

save_load.commit_dir = commit_then_hang_on_second
pretrain(parse_megatron_args(argv))
"""


def test_save_killed_mid_way_leaves_previous_checkpoint_to_resume(data_prefix, tmp_path):
    save = tmp_path / "ckpt"
    flags = [*TRAIN, "--data-path", data_prefix, "--train-iters", "6", "--eval-interval", "100"]
    flags += ["--save", str(save), "--save-interval", "2"]
    (tmp_path / "child.py").write_text(CHILD)
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, str(tmp_path / "child.py"), str(ready), *flags],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 180
            while not ready.exists():
                assert child.poll() is None, (tmp_path / "child.log").read_text()
                assert time.monotonic() < deadline, "the child never reached its second save"
                time.sleep(0.05)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    assert child.returncode == -signal.SIGKILL

    # The save of iteration 4 was complete on disk but not yet in place: the trackers and the
    # loadable checkpoint are iteration 2's.
    assert (save / ".iter_0000004.tmp" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert (save / ".iter_0000004.tmp" / "metadata.json").is_file()
    assert not (save / "iter_0000004").exists()
    assert read_latest_tag(save) == "iter_0000002"
    assert (save / MEGATRON_TRACKER).read_text().strip() == "2"
    state = load_file(save, "iter_0000002", model_file())
    assert state["iteration"] == 2 and state["consumed_train_samples"] == 8

    # Resuming continues from iteration 2 exactly as a run that was never interrupted.
    resumed = pretrain(parse_megatron_args([*flags, "--load", str(save)]))
    whole = pretrain(
        parse_megatron_args([*TRAIN, "--data-path", data_prefix, "--train-iters", "6"])
    )
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    assert resumed.losses == {i: whole.losses[i] for i in (3, 4, 5, 6)}
    assert not (save / ".iter_0000004.tmp").exists()  # the next save cleaned it up
    assert read_latest_tag(save) == "iter_0000006"


# ---- HF import, generate, export -------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model() -> GPT2LMHeadModel:
    """A tiny GPT-2 with the real vocabulary; every weight random and large enough that greedy
    decoding has no near-ties."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if ".ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    return model


def cli(*args: object) -> int:
    return zerotron.cli.main([str(a) for a in args])


def test_convert_generate_and_export_match_transformers(hf_model, tmp_path, capsys):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    hf_model.save_pretrained(hf_dir)
    assert cli("convert", "--from-hf", hf_dir, "--save", ckpt) == 0
    assert read_latest_tag(ckpt) == "release"

    tokenizer = build_tokenizer("GPT2BPETokenizer")
    prompt = "It is a truth universally acknowledged"
    ids = tokenizer.tokenize(prompt)
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tokenizer.eod,
        )
    new = hf_out[0, len(ids) :].tolist()
    if tokenizer.eod in new:  # both stop at the end of the document; zerotron drops the token
        new = new[: new.index(tokenizer.eod)]
    assert new, "the reference generated nothing to compare"

    capsys.readouterr()
    assert (
        cli("generate", "--load", ckpt, "--prompt", prompt, "--greedy", "--max-new-tokens", 12) == 0
    )
    assert capsys.readouterr().out == prompt + tokenizer.detokenize(new) + "\n"

    assert cli("convert", "--load", ckpt, "--to-hf", out) == 0
    back = GPT2LMHeadModel.from_pretrained(out).state_dict()
    original = hf_model.state_dict()
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_generate_from_pretrain_checkpoint_never_emits_padding(data_prefix, tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    pretrain(
        parse_megatron_args(
            [*TRAIN, "--data-path", data_prefix, "--train-iters", "2", "--eval-interval", "100"]
            + ["--save", str(save), "--save-interval", "2"]
        )
    )
    generated: list[list[int]] = []
    real_generate = zerotron.inference.cli.generate

    def recording(*args, **kwargs):
        generated.append(real_generate(*args, **kwargs))
        return generated[-1]

    monkeypatch.setattr(zerotron.inference.cli, "generate", recording)
    prompt = "Mr. Darcy"
    assert cli("generate", "--load", save, "--prompt", prompt, "--max-new-tokens", 16) == 0

    # Make the padding rows win every unmasked argmax: a zero final LayerNorm weight makes every
    # hidden state its bias b; padding rows 100*b then have logit 100*|b|^2, far above any row.
    rigged = tmp_path / "rigged"
    shutil.copytree(save, rigged)
    path = rigged / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    model = state["model"]
    b = torch.randn(64, generator=torch.Generator().manual_seed(0))
    model["final_layernorm.weight"].zero_()
    model["final_layernorm.bias"].copy_(b)
    emb = model["embedding.word_embeddings.weight"]
    assert emb.shape == (PADDED, 64)
    emb[VOCAB:] = 100 * b
    assert (emb @ b).argmax().item() >= VOCAB  # the check below can fail
    torch.save(state, path)
    # as if these weights had been trained: metadata.json records the rigged file's checksum
    meta_path = rigged / "iter_0000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["checksums"][model_file()] = file_checksum(path)
    meta_path.write_text(json.dumps(meta))
    assert (
        cli("generate", "--load", rigged, "--prompt", prompt, "--greedy", "--max-new-tokens", 20)
        == 0
    )
    assert (
        cli(
            "generate",
            "--load",
            rigged,
            "--prompt",
            prompt,
            "--temperature",
            2,
            "--max-new-tokens",
            20,
        )
        == 0
    )

    assert len(generated) == 3
    for ids in generated:
        assert ids and all(0 <= i < VOCAB for i in ids)
    assert generated[1] == [(emb[:VOCAB] @ b).argmax().item()] * len(generated[1])
