import os

import pytest

from zerotron.fileio import atomic_dir, atomic_open, atomic_write_text, commit_dir


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")
    atomic_write_text(p, "new")
    assert p.read_text() == "new"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_failed_write_leaves_old_content_and_no_temp(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")
    with pytest.raises(RuntimeError), atomic_open(p) as f:
        f.write(b"partial")
        raise RuntimeError("killed")
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_commit_dir_replaces_directory(tmp_path):
    final = tmp_path / "ckpt"
    for content in ("one", "two"):
        tmp = atomic_dir(final)
        with open(os.path.join(tmp.name, "x"), "w") as f:
            f.write(content)
        commit_dir(tmp.name, final)
        tmp.cleanup()
    assert (final / "x").read_text() == "two"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
