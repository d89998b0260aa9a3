"""Is a checkpoint whole? Checksums and the completeness its layout implies.

A tag is *complete* when its metadata.json reads, every file it records is there with the
recorded size, and every file its layout implies is there: one model file per (tensor,
pipeline) rank and, when it holds a ZeRO optimizer state, one partition file per (data, tensor,
pipeline) rank. *Verified* adds the sha256 of every file. ``zerotron checkpoint verify`` reports
both; a load checks completeness of the tag it picks (:func:`zerotron.checkpoint.resolve_tag`,
stat calls only) and the checksum of each file it reads (``load_file``), so a corrupt file is
refused by name and ``--load DIR`` falls back to the newest complete tag.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotron.checkpoint import layout
from zerotron.checkpoint.checksums import check_file
from zerotron.checkpoint.metadata import read_metadata
from zerotron.errors import CheckpointError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: ``file`` (relative to the tag directory) and what."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def layout_sizes(meta: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(tensor, pipeline, data parallel size, ZeRO stage) recorded in metadata.json."""
    lay = meta.get("layout") or {}
    return (
        int(lay.get("tensor_model_parallel_size", 1)),
        int(lay.get("pipeline_model_parallel_size", 1)),
        int(lay.get("data_parallel_size", 1)),
        int(lay.get("zero_stage", 0)),
    )


def holds_zero_state(meta: Mapping[str, Any]) -> bool:
    """Whether the tag holds ZeRO partition files (a ZeRO run saved with its optimizer).

    A save without the optimizer (``--no-save-optim``, a resharded checkpoint) records no
    partition file, and says so with ``optimizer_states: false`` where the writer knows it.
    """
    tp, pp, dp, stage = layout_sizes(meta)
    if stage == 0 or meta.get("optimizer_states") is False:
        return False
    recorded = set(meta.get("files") or [])
    return not recorded or any(f in recorded for f in layout.zero_files(dp, tp, pp))


def expected_files(meta: Mapping[str, Any]) -> list[str]:
    """Every rank file the layout in ``meta`` implies (model files, ZeRO partitions).

    None for a tag whose metadata.json has no ``layout`` (files saved by a tool, not a run).
    """
    if not isinstance(meta.get("layout"), dict):
        return []
    tp, pp, dp, _ = layout_sizes(meta)
    files = layout.model_files(tp, pp)
    if holds_zero_state(meta):
        files += layout.zero_files(dp, tp, pp)
    return files


def _layout_text(meta: Mapping[str, Any]) -> str:
    tp, pp, dp, stage = layout_sizes(meta)
    return f"tensor parallel {tp}, pipeline parallel {pp}, data parallel {dp}, ZeRO {stage}"


def tag_problems(
    load_dir: str | os.PathLike, tag: str, *, checksums: bool = True, implied: bool = True
) -> list[Problem]:
    """What is wrong with ``<load_dir>/<tag>`` (empty: nothing).

    ``checksums`` False checks only presence and sizes (stat calls); True also reads every file
    and compares its sha256. ``implied`` also asks for every file the layout implies (False:
    only what metadata.json records, which is what a load picking a tag checks: the loader
    names a missing rank file itself). A tag without a readable metadata.json is reported as
    such (nothing else can be checked).
    """
    root = layout.tag_dir(load_dir, tag)
    if not root.is_dir():
        return [Problem(".", f"the tag directory {root} does not exist")]
    try:
        meta = read_metadata(load_dir, tag)
    except CheckpointError as e:
        return [Problem(layout.METADATA_FILE, e.what)]
    problems: list[Problem] = []
    sums = meta.get("checksums")
    recorded = list(meta.get("files") or [])
    if isinstance(sums, dict):
        for relpath, entry in sorted(sums.items()):
            what = check_file(root / relpath, entry, digest=checksums)
            if what is not None:
                problems.append(Problem(relpath, what))
    for relpath in recorded:
        if not (isinstance(sums, dict) and relpath in sums) and not (root / relpath).is_file():
            problems.append(Problem(relpath, "missing (metadata.json lists it)"))
    named = {p.file for p in problems}
    for relpath in expected_files(meta) if implied else []:
        if relpath not in named and not (root / relpath).is_file():
            problems.append(Problem(relpath, f"missing (the layout, {_layout_text(meta)}, "
                                             "implies it)"))  # fmt: skip
    return problems


def has_checksums(load_dir: str | os.PathLike, tag: str) -> bool:
    """Whether the tag's metadata.json records checksums (checkpoints before them do not)."""
    try:
        return isinstance(read_metadata(load_dir, tag).get("checksums"), dict)
    except CheckpointError:
        return False


def problems_error(
    load_dir: str | os.PathLike, tag: str, problems: list[Problem], fix: str | None = None
) -> CheckpointError:
    """The :class:`CheckpointError` for a tag with ``problems``, naming each file."""
    root = layout.tag_dir(load_dir, tag)
    listed = "; ".join(str(p) for p in problems[:8])
    more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
    return CheckpointError(
        f"checkpoint '{tag}' is corrupt or incomplete: {listed}{more}",
        where=str(root / problems[0].file) if problems[0].file != "." else str(root),
        fix=fix
        or f"load an earlier tag: `zerotron checkpoint verify {load_dir}` lists the good ones; "
        f"name one (--tag) or write it into {Path(load_dir) / 'latest'}",
    )


def check_tag(load_dir: str | os.PathLike, tag: str, *, checksums: bool = False) -> None:
    """Raise :class:`CheckpointError` naming every bad file of the tag (:func:`tag_problems`)."""
    problems = tag_problems(load_dir, tag, checksums=checksums)
    if problems:
        raise problems_error(load_dir, tag, problems)


def tags_newest_first(load_dir: str | os.PathLike) -> list[str]:
    """The tags under ``load_dir`` (directories with a metadata.json), newest first.

    Newest: highest iteration (from metadata.json or an ``iter_`` tag), then latest written.
    """
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        return []
    found = []
    for p in load_dir.iterdir():
        meta_file = p / layout.METADATA_FILE
        if p.name.startswith(".") or not p.is_dir() or not meta_file.is_file():
            continue
        iteration = layout.iteration_from_tag(p.name)
        try:
            meta = read_metadata(load_dir, p.name)
            if isinstance(meta.get("iteration"), int):
                iteration = meta["iteration"]
        except CheckpointError:
            pass  # still a candidate, for verify to report; never a complete one
        found.append((-1 if iteration is None else iteration, meta_file.stat().st_mtime_ns, p.name))
    return [name for *_, name in sorted(found, reverse=True)]


def newest_complete_tag(load_dir: str | os.PathLike, exclude: Iterable[str] = ()) -> str | None:
    """The newest tag under ``load_dir`` whose recorded files are all there with their sizes,
    not in ``exclude`` (None: there is none)."""
    skip = set(exclude)
    for tag in tags_newest_first(load_dir):
        if tag not in skip and not tag_problems(load_dir, tag, checksums=False, implied=False):
            return tag
    return None
