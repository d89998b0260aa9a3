"""Seeded fuzzing of checkpoint metadata.json and the trackers (issue 19, Proof: fuzz test).

Each damaged checkpoint is loaded through the tracker, metadata and file readers and through
``zerotron convert``: success or a ZerotronError (exit 2, no traceback), and nothing is ever
written into the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import zerotron.cli
from zerotron.checkpoint.save_load import (
    load_file,
    read_latest_tag,
    read_metadata,
    resolve_tag,
    save_checkpoint,
)
from zerotron.errors import ZerotronError

TAG = "iter_0000001"
VALUES: list[Any] = [None, True, 0, -1, 2**70, 1.5, "", "x", "../../etc", [], [1], {}, {"a": 1}]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("ckpt") / "ckpt"
    save_checkpoint(save, TAG, {"model.pt": {"w": torch.zeros(2)}})
    return save


def _damage_metadata(rng: random.Random, meta: dict) -> bytes:
    op = rng.randrange(5)
    text = json.dumps(meta).encode()
    if op == 0:
        return text[: rng.randrange(len(text))]
    if op == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(100)))
    if op == 2:
        return json.dumps(rng.choice(VALUES)).encode()
    meta = dict(meta)
    key = rng.choice([*meta, "extra"])
    if op == 3:
        meta.pop(key, None)
    else:
        sub = meta.get(key)
        if isinstance(sub, dict) and sub and rng.random() < 0.5:
            sub = dict(sub)
            sub[rng.choice(list(sub))] = rng.choice(VALUES)
            meta[key] = sub
        else:
            meta[key] = rng.choice(VALUES)
    return json.dumps(meta).encode()


def _damage_tracker(rng: random.Random) -> bytes:
    return rng.choice(
        [b"", b"\xff\xfe", b"iter_9999999\n", b"../x", b"7", b"-1", b"iter_0000001\x00",
         bytes(rng.randrange(256) for _ in range(20)), b"1" * 400]
    )  # fmt: skip


def _listing(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _load_all(save: Path) -> None:
    tag = read_latest_tag(save)
    tag = resolve_tag(save, tag)
    meta = read_metadata(save, tag)
    for relpath in meta.get("files", []):
        load_file(save, tag, relpath)


def check_seed(seed: int, pristine: Path, tmp_path: Path) -> None:
    rng = random.Random(seed)
    save = tmp_path / f"s{seed}"
    shutil.copytree(pristine, save)
    meta = json.loads((save / TAG / "metadata.json").read_text())
    if rng.random() < 0.7:
        (save / TAG / "metadata.json").write_bytes(_damage_metadata(rng, meta))
    if rng.random() < 0.5:
        name = rng.choice(["latest", "latest_checkpointed_iteration.txt"])
        (save / name).write_bytes(_damage_tracker(rng))
    before = _listing(save)
    with contextlib.suppress(ZerotronError):
        _load_all(save)
    assert _listing(save) == before, seed
    shutil.rmtree(save)


def test_fuzz_checkpoint_metadata_and_trackers(pristine, tmp_path):
    """300 damaged checkpoints: success or a ZerotronError, the directory untouched."""
    for seed in range(300):
        check_seed(seed, pristine, tmp_path)


def test_fuzz_convert_cli_exits_0_or_2(pristine, tmp_path, capsys):
    """20 damaged checkpoints through ``zerotron convert``: exit 2, no traceback."""
    for seed in range(20):
        rng = random.Random(seed)
        save = tmp_path / f"c{seed}"
        shutil.copytree(pristine, save)
        meta = json.loads((save / TAG / "metadata.json").read_text())
        (save / TAG / "metadata.json").write_bytes(_damage_metadata(rng, meta))
        before = _listing(save)
        rc = zerotron.cli.main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "hf")])
        err = capsys.readouterr().err
        assert rc in (0, 2) and "Traceback" not in err, (seed, err)
        assert _listing(save) == before, seed


def test_latest_naming_a_tag_longer_than_a_file_name_is_a_checkpoint_error(pristine, tmp_path):
    """Seed 12: 400 digits in ``latest`` raised OSError ENAMETOOLONG from is_dir()."""
    check_seed(12, pristine, tmp_path)
    save = tmp_path / "long"
    shutil.copytree(pristine, save)
    (save / "latest").write_text("1" * 400)
    with pytest.raises(ZerotronError, match="invalid checkpoint tag"):
        resolve_tag(save)


@pytest.mark.parametrize("text", ["1" * 400, "-1"])
def test_megatron_tracker_out_of_range_is_a_checkpoint_error(pristine, tmp_path, text):
    """400 digits made an unusable tag (ENAMETOOLONG); -1 was already refused (kept as a guard)."""
    save = tmp_path / "meg"
    shutil.copytree(pristine, save)
    (save / "latest").unlink()
    (save / "latest_checkpointed_iteration.txt").write_text(text)
    with pytest.raises(ZerotronError, match="expected an iteration number"):
        resolve_tag(save)
