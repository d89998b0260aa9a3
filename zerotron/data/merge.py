"""``zerotron merge-datasets``: concatenate several ``.bin/.idx`` prefixes into one.

Megatron-LM's ``tools/merge_datasets.py`` takes a directory and merges every pair in it in
name order; this also takes explicit prefixes, in the order given. The result is the same as
preprocessing the inputs' corpora one after the other into a single output.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from zerotron.config.args import ArgumentParser
from zerotron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    data_file,
    exists,
    index_file,
)
from zerotron.errors import DataError


def resolve_inputs(
    inputs: Sequence[str | os.PathLike], exclude: str | os.PathLike | None = None
) -> list[Path]:
    """Prefixes named by ``inputs``: a directory stands for every complete pair in it, sorted.

    A path ending in ``.bin`` or ``.idx`` is taken as its prefix. ``exclude`` (the output) is
    left out of directory listings so a re-run does not merge the output into itself.
    """
    skip = Path(exclude).resolve() if exclude is not None else None
    prefixes: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(
                p.with_suffix("")
                for p in item.iterdir()
                if p.suffix == ".idx" and not p.name.startswith(".") and exists(p.with_suffix(""))
            )
            found = [p for p in found if p.resolve() != skip]
            if not found:
                raise DataError(
                    "no .bin/.idx pairs in this directory",
                    where=str(item),
                    fix="pass a directory holding outputs of `zerotron preprocess`, or prefixes",
                )
            prefixes += found
            continue
        prefix = item.with_suffix("") if item.suffix in (".bin", ".idx") else item
        if not exists(prefix):
            missing = index_file(prefix) if data_file(prefix).is_file() else data_file(prefix)
            raise DataError(
                "file not found",
                where=str(missing),
                fix="each --input is a directory or a prefix (path without .bin/.idx)",
            )
        prefixes.append(prefix)
    return prefixes


def merge_datasets(
    prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike
) -> MMapIndexedDataset:
    """Write the concatenation of ``prefixes`` to ``output_prefix`` (atomically) and open it."""
    if not prefixes:
        raise DataError("nothing to merge", fix="pass at least one --input")
    out = Path(output_prefix).resolve()
    for p in prefixes:
        if Path(p).resolve() == out:
            raise DataError(
                "the output prefix is also an input",
                where=str(p),
                fix="choose a different --output-prefix",
            )
    dtype = MMapIndexedDataset(prefixes[0]).dtype
    with MMapIndexedDatasetBuilder(output_prefix, dtype) as builder:
        for p in prefixes:
            builder.add_index(p)
    return MMapIndexedDataset(output_prefix)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="zerotron merge-datasets",
        description="Concatenate .bin/.idx datasets (same vocabulary) into one.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="a directory (every pair in it, in name order) and/or prefixes, in order",
    )
    p.add_argument("--output-prefix", required=True, help="prefix of the merged .bin/.idx")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    prefixes = resolve_inputs(args.input, exclude=args.output_prefix)
    merged = merge_datasets(prefixes, args.output_prefix)
    print(
        f"merged {len(prefixes)} datasets: {merged.num_documents:,} documents, "
        f"{merged.num_tokens:,} tokens ({merged.dtype}) in {time.perf_counter() - start:.1f} s "
        f"-> {args.output_prefix}.bin, {args.output_prefix}.idx"
    )
    return 0
