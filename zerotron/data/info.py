"""``zerotron dataset-info``: what a tokenized dataset holds and how it splits into samples.

Reads only the ``.idx`` files (no index is built or written): documents, tokens, token dtype,
document lengths, and per split its documents, tokens and samples per epoch at a sequence
length; for a blend also the weights. ``make demo`` prints this after preprocessing.
"""

from __future__ import annotations

import numpy as np

from zerotron.config.args import ArgumentParser
from zerotron.data import index_builder as ib
from zerotron.data.indexed_dataset import MMapIndexedDataset
from zerotron.errors import ConfigError


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="zerotron dataset-info",
        description="Statistics of tokenized .bin/.idx data and its train/valid/test split.",
    )
    p.add_argument(
        "--data-path",
        nargs="+",
        required=True,
        help="one prefix (without .bin/.idx), WEIGHT PREFIX pairs, or several prefixes",
    )
    p.add_argument("--split", default="969,30,1", help="train,valid,test shares of documents")
    p.add_argument("--seq-length", type=int, default=1024, help="tokens per sample")
    p.add_argument("--seed", type=int, default=1234, help="data seed (reported only)")
    p.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="show how many epochs of the train split this many samples take",
    )
    return p


def split_stats(ds: MMapIndexedDataset, doc_sizes: np.ndarray, split: str, seq_length: int):
    """Per split: (name, first doc, stop doc, documents, tokens, samples per epoch)."""
    rows = []
    for name, (lo, hi) in zip(ib.SPLIT_NAMES, ib.split_ranges(split, ds.num_documents)):
        tokens = int(doc_sizes[lo:hi].sum())
        samples = max(tokens - 1, 0) // seq_length  # samples overlap by one token
        rows.append((name, lo, hi, hi - lo, tokens, samples))
    return rows


def _split_hint(num_documents: int) -> str:
    """Where a split comes out empty: a --split that gives every split a document, if any."""
    suggestion = ib.suggest_split(num_documents, [True, True, True])
    return f"; --split {suggestion} gives each split a document" if suggestion else ""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.seq_length < 1:
        raise ConfigError(f"--seq-length must be positive, got {args.seq_length}")
    if args.train_samples is not None and args.train_samples < 0:
        raise ConfigError(f"--train-samples must be non-negative, got {args.train_samples}")
    ib.parse_split(args.split)  # a bad --split fails before any file is opened

    from rich import box
    from rich.console import Console
    from rich.table import Table

    path = ib.parse_data_path(args.data_path)
    datasets = [MMapIndexedDataset(p) for p in path.prefixes]
    weights = ib.blend_weights(path, datasets) if path.is_blend else [1.0]
    console = Console(highlight=False)
    sizes = [ib.document_sizes(ds) for ds in datasets]

    if path.is_blend:
        console.print(f"[bold]blend of {len(datasets)} datasets[/]")
    for d, (ds, s, w) in enumerate(zip(datasets, sizes, weights)):
        head = (
            f"[bold]{d}[/]  weight {w:.4f}  {ds.prefix}"
            if path.is_blend
            else f"[bold]dataset[/] {ds.prefix}"
        )
        console.print(head)
        pad = "   " if path.is_blend else "  "
        console.print(
            f"{pad}{ds.num_documents:,} documents, {ds.num_tokens:,} tokens ({ds.dtype}, "
            f"{ds.num_tokens * ds.dtype.itemsize / 2**20:,.1f} MiB)"
        )
        if s.size:
            console.print(
                f"{pad}tokens per document: min {s.min():,}, median {np.median(s):,.0f}, "
                f"mean {s.mean():,.1f}, max {s.max():,}"
            )
    console.print()

    splits = Table(
        title=f"--split {args.split} at --seq-length {args.seq_length} (seed {args.seed})",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    if path.is_blend:
        splits.add_column("#")
    for col in ("split", "documents", "range", "tokens", "samples/epoch"):
        splits.add_column(
            col, justify="left" if col in ("split", "range") else "right", no_wrap=True
        )
    if args.train_samples:
        splits.add_column("train epochs", justify="right", no_wrap=True)
    warnings = []
    for d, (ds, s, w) in enumerate(zip(datasets, sizes, weights)):
        for name, lo, hi, docs, tokens, samples in split_stats(ds, s, args.split, args.seq_length):
            row = [str(d)] if path.is_blend else []
            row += [name, f"{docs:,}", f"[{lo:,}, {hi:,})", f"{tokens:,}", f"{samples:,}"]
            if args.train_samples:
                if name == "train" and tokens:
                    # A blend takes weight * N samples from each dataset.
                    want = int(np.ceil(args.train_samples * w))
                    row.append(f"{(want * args.seq_length + 1) / tokens:,.2f}")
                else:
                    row.append("" if name != "train" else "-")
            splits.add_row(*row)
            if docs == 0:
                of = f" of {ds.prefix.name}" if path.is_blend else ""
                warnings.append(
                    f"{name} split{of} is empty (asking for {name} samples is an error)"
                    + _split_hint(ds.num_documents)
                )
    console.print(splits)
    if args.train_samples:
        console.print(
            f"train epochs: passes over the train split for {args.train_samples:,} samples"
        )
    for text in warnings:
        console.print(f"[yellow]note:[/] {text}")
    return 0
