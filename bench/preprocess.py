"""Benchmark: ``zerotron preprocess`` against a straightforward pure-Python GPT-2 preprocessor.

The baseline is what Megatron-LM's ``tools/preprocess_data.py`` does with its
``GPT2BPETokenizer``, written out here: a ``multiprocessing.Pool`` maps lines (``imap``, chunks
of 32) to workers that ``json.loads`` each line and run the pure-Python GPT-2 BPE (regex
pre-tokenization, byte-to-unicode table, merge the lowest-ranked pair until none is left, with a
cache of words already seen); the parent appends each document with ``add_item`` +
``end_document``. Both sides use the same corpus, the same number of worker processes and write
the same ``.bin/.idx`` format, and the bench checks the files are byte-identical.

    python bench/preprocess.py [--input corpus.jsonl] [--workers 2] [--repeat 3]

Prints tokens/s of each side and their ratio (best run and median run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import regex

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from zerotron.data import preprocess as zpp  # noqa: E402
from zerotron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder  # noqa: E402

GPT2 = REPO / "zerotron" / "data" / "gpt2"
DEFAULT_CORPORA = [Path("/work/shared/data/corpus/pd_mix.jsonl"), REPO / "data" / "austen.jsonl"]


# --------------------------------------------------------------------------- the baseline


class PurePythonGPT2:
    """GPT-2's BPE as OpenAI's encoder.py and Megatron's gpt2_tokenization.py run it."""

    PATTERN = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def __init__(self, vocab_file: Path, merge_file: Path):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.eod = self.encoder["<|endoftext|>"]
        printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        self.byte_encoder = {b: chr(b) for b in printable}
        for n, b in enumerate(b for b in range(256) if b not in self.byte_encoder):
            self.byte_encoder[b] = chr(256 + n)
        self.cache: dict[str, str] = {}

    def bpe(self, token: str) -> str:
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            bigram = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i + 1 < len(word) and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
        out = " ".join(word)
        self.cache[token] = out
        return out

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for token in self.PATTERN.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids


class BaselineEncoder:
    def __init__(self, key: str, append_eod: bool):
        self.key, self.append_eod = key, append_eod

    def initializer(self) -> None:
        BaselineEncoder.tokenizer = PurePythonGPT2(GPT2 / "encoder.json", GPT2 / "vocab.bpe")

    def encode(self, line: str) -> list[int]:
        if not line.strip():
            return []
        ids = self.tokenizer.tokenize(json.loads(line)[self.key])
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
        return ids


def baseline(path: Path, prefix: str, workers: int, key: str, append_eod: bool) -> None:
    encoder = BaselineEncoder(key, append_eod)
    with (
        open(path, encoding="utf-8") as fin,
        multiprocessing.Pool(workers, initializer=encoder.initializer) as pool,
        MMapIndexedDatasetBuilder(prefix) as builder,
    ):
        for ids in pool.imap(encoder.encode, fin, 32):
            if ids:
                builder.add_item(ids)
                builder.end_document()


# --------------------------------------------------------------------------- the comparison


def ours(path: Path, prefix: str, workers: int, key: str, append_eod: bool) -> None:
    argv = ["--input", str(path), "--output-prefix", prefix, "--json-keys", key]
    argv += ["--workers", str(workers), "--log-interval", str(10**12)]
    with contextlib.redirect_stdout(io.StringIO()):
        zpp.main(argv + (["--append-eod"] if append_eod else []))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = next((c for c in DEFAULT_CORPORA if c.is_file()), DEFAULT_CORPORA[-1])
    p.add_argument("--input", type=Path, default=default, help="JSON lines corpus")
    p.add_argument("--workers", type=int, default=2, help="worker processes, both sides")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (best and median)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    p.add_argument("--quick", action="store_true", help="first 50 documents, one run per side")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            head = Path(tmp) / "head.jsonl"
            with open(args.input, encoding="utf-8") as f:
                head.write_text("".join(line for _, line in zip(range(50), f)), encoding="utf-8")
            args.input, args.repeat = head, 1
        run(args)


def run(args: argparse.Namespace) -> None:

    size = args.input.stat().st_size
    print(f"corpus {args.input} ({size / 1e6:.1f} MB), {args.workers} workers, "
          f"{args.repeat} runs per side, {os.cpu_count()} CPUs")  # fmt: skip
    times: dict[str, list[float]] = {"zerotron": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = {"zerotron": f"{tmp}/z", "baseline": f"{tmp}/b_text_document"}
        for _ in range(args.repeat):  # alternate so background load hits both sides alike
            for side, fn in (("zerotron", ours), ("baseline", baseline)):
                run = (args.input, out[side], args.workers, args.json_key, args.append_eod)
                times[side].append(timed(fn, *run))
        z_prefix = zpp.output_prefix_for(out["zerotron"], args.json_key)
        same = all(
            Path(f"{z_prefix}{ext}").read_bytes() == Path(f"{out['baseline']}{ext}").read_bytes()
            for ext in (".bin", ".idx")
        )
        tokens = MMapIndexedDataset(z_prefix).num_tokens
    if not same:
        sys.exit("FAIL: zerotron and the baseline wrote different token ids")
    print(f"identical .bin/.idx on both sides: {tokens:,} tokens\n")
    print(f"{'':10} {'best s':>8} {'median s':>9} {'best tokens/s':>15} {'median tokens/s':>16}")
    rate = {}
    for side, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        rate[side] = (tokens / best, tokens / med)
        print(f"{side:10} {best:8.2f} {med:9.2f} {rate[side][0]:15,.0f} {rate[side][1]:16,.0f}")
    best_ratio = rate["zerotron"][0] / rate["baseline"][0]
    median_ratio = rate["zerotron"][1] / rate["baseline"][1]
    print(f"\nratio zerotron / pure-Python baseline: {best_ratio:.1f}x (best), "
          f"{median_ratio:.1f}x (median); goal >= 5x")  # fmt: skip


if __name__ == "__main__":
    main()
