"""``zerotron launch --nproc_per_node 2 -m zerotron generate`` on a tensor-parallel checkpoint
prints what ``zerotron generate`` prints in one process for the same weights.

A tiny GPT-2 (the bundled tokenizer, 2 layers, hidden 32) is saved at TP 1, resharded to a
TP 2 checkpoint (``zerotron convert --target-tensor-parallel-size 2``), and generated from under
the launcher: 2 ranks, each holding half the heads and half the vocabulary, decoding with the
same seed; only rank 0 prints. Greedy and seeded sampling at TP 2 against the merged model in
one process are also checked on gloo ranks in tests/distributed/test_reshard_parallel.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from zerotron import cli
from zerotron.checkpoint import read_metadata
from zerotron.checkpoint.model import save_gpt
from zerotron.models.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy"]
SAMPLE = ["--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "40", "--seed", "7"]


def test_launched_tp2_generation_prints_the_single_process_text(tmp_path, capsys):
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=64,
        vocab_size=50304,
        orig_vocab_size=50257,
    )
    torch.manual_seed(0)
    save_gpt(tmp_path / "tp1", cfg, GPT(cfg).state_dict())
    tp2 = tmp_path / "tp2"
    assert cli.main(["convert", "--load", str(tmp_path / "tp1"), "--save", str(tp2),
                     "--target-tensor-parallel-size", "2"]) == 0  # fmt: skip
    assert read_metadata(tp2, "release")["layout"]["tensor_model_parallel_size"] == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    capsys.readouterr()

    assert cli.main(["generate", "--load", str(tmp_path / "tp1"),
                     "--prompts-file", str(prompts), *SAMPLE]) == 0  # fmt: skip
    expected = capsys.readouterr().out.splitlines()
    assert len(expected) == 4 and expected[0].startswith(PROMPTS[0])  # text, ---- per prompt

    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run(
        [sys.executable, "-m", "zerotron.launcher.launch", "--nproc_per_node", "2",
         "-m", "zerotron", "generate", "--load", str(tp2), "--prompts-file", str(prompts),
         *SAMPLE],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    by_rank: dict[int, list[str]] = {0: [], 1: []}
    for line in r.stdout.splitlines():
        m = re.match(r"\[rank(\d)\]: (.*)$", line)
        if m:
            by_rank[int(m.group(1))].append(m.group(2))
    assert by_rank[0] == expected
    assert by_rank[1] == []  # only rank 0 prints
