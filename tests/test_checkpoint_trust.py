"""Checkpoints you can trust: checksums, verify/info, refusal and fallback on load, retention,
async save (zerotron.checkpoint.checksums, .verify, .info, .retention, .async_save)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import multiprocessing
import os
import signal
import threading
import time
import warnings

import pytest
import torch

import zerotron.cli
from zerotron.checkpoint import (
    begin_tag,
    build_metadata,
    commit_tag,
    file_checksum,
    layout,
    load_file,
    read_metadata,
    resolve_tag,
    save_checkpoint,
    save_load,
)
from zerotron.checkpoint.async_save import AsyncCheckpointWriter, snapshot
from zerotron.checkpoint.info import checkpoint_info
from zerotron.checkpoint.verify import tag_problems
from zerotron.errors import CheckpointError, DiskFullError

MODEL = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    seq_length=32,
    vocab_size=256,
)


def tp2pp2_zero(save_dir, tag="iter_0000005", iteration=5, **kwargs):
    """A tp2 pp2 dp2 ZeRO-1 checkpoint's files (tiny tensors) saved under ``tag``."""
    meta = build_metadata(
        model_config=MODEL,
        vocab_size=250,
        padded_vocab_size=256,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        data_parallel_size=2,
        zero_stage=1,
    )
    files = {
        f: {
            "model": {"w": torch.full((8,), float(i))},
            "iteration": iteration,
            "consumed_train_samples": 8 * iteration,
        }
        for i, f in enumerate(layout.model_files(2, 2))
    }
    files.update({f: {"m": torch.ones(4) * i} for i, f in enumerate(layout.zero_files(2, 2, 2))})
    return save_checkpoint(save_dir, tag, files, meta, iteration=iteration, **kwargs)


def flip_byte(path, at=-20):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = zerotron.cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------- checksums


def test_checksum_of_every_file_is_recorded(tmp_path):
    root = tp2pp2_zero(tmp_path)
    meta = read_metadata(tmp_path, root.name)
    written = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.pt"))
    assert sorted(meta["checksums"]) == written == meta["files"] and len(written) == 12
    for relpath, entry in meta["checksums"].items():
        assert entry == file_checksum(root / relpath)
    assert not (root / ".checksums").exists()  # the sidecars are no part of the tag


def test_commit_tag_hashes_files_a_writer_wrote_itself(tmp_path):
    """The converter's path: begin_tag, write files any way, commit_tag."""
    tmp = begin_tag(tmp_path, "release")
    (tmp / "mp_rank_00").mkdir()
    torch.save({"model": {"w": torch.arange(3.0)}}, tmp / layout.model_file())
    root = commit_tag(tmp_path, "release", {"layout": {"tensor_model_parallel_size": 1}})
    meta = read_metadata(tmp_path, "release")
    assert meta["checksums"] == {layout.model_file(): file_checksum(root / layout.model_file())}
    assert (tmp_path / "latest").read_text() == "release" and not tmp.exists()


# ---------------------------------------------------------------------------------- verify


def test_verify_names_a_corrupted_byte(tmp_path):
    tp2pp2_zero(tmp_path)
    flip_byte(tmp_path / "iter_0000005" / layout.model_file(1, 1, 2))
    rc, out, _ = cli("checkpoint", "verify", str(tmp_path))
    assert rc == 1
    assert out.splitlines()[:2] == [
        "iter_0000005: BAD (1 problem)",
        f"  {layout.model_file(1, 1, 2)}: sha256 is " + out.split("sha256 is ")[1].split("\n")[0],
    ]
    assert "metadata.json records" in out


def test_verify_names_a_removed_file_and_passes_a_whole_one(tmp_path):
    tp2pp2_zero(tmp_path)
    assert cli("checkpoint", "verify", str(tmp_path))[:2] == (
        0,
        "iter_0000005: ok (checksums and layout)\n",
    )
    (tmp_path / "iter_0000005" / layout.zero_file(1, 0, 1)).unlink()
    rc, out, _ = cli("checkpoint", "verify", str(tmp_path), "--tag", "iter_0000005")
    assert rc == 1 and f"  {layout.zero_file(1, 0, 1)}: missing\n" in out


def test_verify_names_a_rank_file_the_layout_implies(tmp_path):
    """A file that was never written (so never recorded) is found from the layout."""
    tp2pp2_zero(tmp_path)
    root = tmp_path / "iter_0000005"
    meta = read_metadata(tmp_path, "iter_0000005")
    del meta["checksums"][layout.model_file(0, 1, 2)]
    meta["files"].remove(layout.model_file(0, 1, 2))
    (root / "metadata.json").write_text(json.dumps(meta))
    (root / layout.model_file(0, 1, 2)).unlink()
    assert [str(p) for p in tag_problems(tmp_path, "iter_0000005")] == [
        f"{layout.model_file(0, 1, 2)}: missing (the layout, tensor parallel 2, pipeline "
        "parallel 2, data parallel 2, ZeRO 1, implies it)"
    ]


# ------------------------------------------------------------------------------------ load


def test_load_refuses_a_corrupt_file_naming_it(tmp_path):
    root = tp2pp2_zero(tmp_path)
    path = root / layout.zero_file(0, 1, 0)
    flip_byte(path)
    with pytest.raises(CheckpointError) as e:
        load_file(tmp_path, "iter_0000005", layout.zero_file(0, 1, 0))
    assert e.value.where == str(path)
    assert e.value.what.startswith(f"checkpoint file '{layout.zero_file(0, 1, 0)}' is corrupt: ")


def test_load_of_a_named_incomplete_tag_is_refused(tmp_path):
    root = tp2pp2_zero(tmp_path)
    path = root / layout.model_file(1, 0, 2)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError) as e:
        resolve_tag(tmp_path, "iter_0000005")
    assert e.value.where == str(path)
    assert f"{layout.model_file(1, 0, 2)}: size is 100 bytes, metadata.json records" in str(e.value)


def test_load_falls_back_to_the_newest_complete_tag(tmp_path):
    tp2pp2_zero(tmp_path, "iter_0000005", 5)
    tp2pp2_zero(tmp_path, "iter_0000006", 6)
    tp2pp2_zero(tmp_path, "iter_0000007", 7)
    (tmp_path / "iter_0000007" / layout.zero_file(1, 1, 1)).unlink()
    with pytest.warns(UserWarning) as w:
        assert resolve_tag(tmp_path) == "iter_0000006"
    assert str(w[0].message).startswith(
        f"checkpoint 'iter_0000007' in {tmp_path}, which the tracker names, is corrupt or "
        f"incomplete ({layout.zero_file(1, 1, 1)}: missing"
    )
    assert str(w[0].message).endswith("loading 'iter_0000006', the newest complete one")


def test_old_checkpoint_without_checksums_loads_with_one_warning(tmp_path):
    root = tp2pp2_zero(tmp_path)
    meta = read_metadata(tmp_path, root.name)
    del meta["checksums"]
    (root / "metadata.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="records no checksums") as w:
        for f in layout.model_files(2, 2):
            assert load_file(tmp_path, root.name, f)["iteration"] == 5
    assert len([x for x in w if "checksums" in str(x.message)]) == 1


# ------------------------------------------------------------------------------- retention


def test_keep_last_keeps_the_newest_and_never_the_tracked_tag(tmp_path):
    for i in (1, 2, 3, 4):
        save_checkpoint(tmp_path, f"iter_000000{i}", {"a.pt": {"i": i}}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "iter_0000003",
        "iter_0000004",
    ]
    # Newer tags saved without moving the tracker: the tracked one (4) stays whatever its age.
    save_checkpoint(tmp_path, "iter_0000005", {"a.pt": {"i": 5}}, save_latest=False, keep_last=1)
    save_checkpoint(tmp_path, "iter_0000006", {"a.pt": {"i": 6}}, save_latest=False, keep_last=1)
    assert (tmp_path / "latest").read_text() == "iter_0000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000004",
        "iter_0000006",
        "latest",
        "latest_checkpointed_iteration.txt",
    ]


# ------------------------------------------------------------------------------ async save


def test_async_save_writes_the_bytes_of_a_sync_save_while_training_changes_them(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    files = {
        layout.model_file(): {
            "model": {"w": w, "w_t": w.t(), "row": w[1]},  # views: one storage
            "optimizer": {"state": {0: {"exp_avg": torch.ones(5), "step": 3}}},
        }
    }
    save_checkpoint(tmp_path / "sync", "iter_0000001", files, {"m": 1})
    save_checkpoint(tmp_path / "async", "iter_0000000", {layout.model_file(): {"old": 1}})
    writer = AsyncCheckpointWriter()
    save_checkpoint(tmp_path / "async", "iter_0000001", files, {"m": 1}, writer=writer)
    w.add_(100.0)  # training goes on, changing the tensors the save holds
    files[layout.model_file()]["optimizer"]["state"][0]["exp_avg"].zero_()
    writer.wait()
    assert not writer.busy and (tmp_path / "async" / "latest").read_text() == "iter_0000001"
    for name in ("sync", "async"):
        assert (tmp_path / name / "iter_0000001" / layout.model_file()).read_bytes() == (
            tmp_path / "sync" / "iter_0000001" / layout.model_file()
        ).read_bytes()
    meta = [read_metadata(tmp_path / n, "iter_0000001")["checksums"] for n in ("sync", "async")]
    assert meta[0] == meta[1]


def test_snapshot_keeps_views_on_one_storage():
    w = torch.arange(6.0)
    snap = snapshot({"a": w, "b": w[2:4], "p": torch.nn.Parameter(torch.ones(2))})
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
    assert snap["a"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    assert isinstance(snap["p"], torch.nn.Parameter) and snap["b"].tolist() == [2.0, 3.0]


def test_async_save_leaves_the_previous_checkpoint_until_committed(tmp_path):
    save_checkpoint(tmp_path, "iter_0000001", {"a.pt": {"i": 1}})
    gate = threading.Event()
    real = save_load._write_file

    def slow(path, obj):
        assert gate.wait(10)
        real(path, obj)

    writer = AsyncCheckpointWriter()
    save_load._write_file = slow
    try:
        save_checkpoint(tmp_path, "iter_0000002", {"a.pt": {"i": 2}}, writer=writer)
        assert writer.busy and not writer.poll()  # still writing: nothing committed
        assert resolve_tag(tmp_path) == "iter_0000001"
        assert not (tmp_path / "iter_0000002").exists()
        gate.set()
        deadline = time.monotonic() + 10
        while not writer.poll():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        save_load._write_file = real
    assert resolve_tag(tmp_path) == "iter_0000002"


def test_async_write_failure_is_raised_at_the_next_save_naming_the_file(tmp_path):
    real = save_load._write_file

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = AsyncCheckpointWriter()
    save_load._write_file = full
    try:
        save_checkpoint(tmp_path, "iter_0000001", {"big.pt": {"i": 1}}, writer=writer)
    finally:
        save_load._write_file = real
    with pytest.raises(DiskFullError) as e:
        save_checkpoint(tmp_path, "iter_0000002", {"a.pt": {"i": 2}}, writer=writer)
    assert e.value.where == str(tmp_path / ".iter_0000001.tmp" / "big.pt")
    assert not (tmp_path / "latest").exists() and not writer.busy


def _exit_during_async_save(save_dir, ready, kill):
    """Child: start an async save whose write is slow, then exit (close) or be killed."""
    real = save_load._write_file

    def slow(path, obj):
        ready.set()
        time.sleep(30 if kill else 0.3)
        real(path, obj)

    save_load._write_file = slow
    writer = AsyncCheckpointWriter()
    save_checkpoint(save_dir, "iter_0000002", {"a.pt": {"i": 2}}, writer=writer)
    writer.close()  # what pretrain's exit does
    os._exit(0)


@pytest.mark.parametrize("kill", [False, True], ids=["exit", "sigkill"])
def test_exit_waits_for_the_writer_and_a_kill_keeps_the_previous(tmp_path, kill):
    save_checkpoint(tmp_path, "iter_0000001", {"a.pt": {"i": 1}})
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_exit_during_async_save, args=(tmp_path, ready, kill))
    child.start()
    assert ready.wait(20), "the child never started writing"
    if kill:
        os.kill(child.pid, signal.SIGKILL)
    child.join(20)
    assert child.exitcode == (-signal.SIGKILL if kill else 0)
    expected = "iter_0000001" if kill else "iter_0000002"
    assert (tmp_path / "latest").read_text() == expected
    assert resolve_tag(tmp_path) == expected and tag_problems(tmp_path, expected) == []


# -------------------------------------------------------------------------------- info / config


def test_info_of_a_tp2_pp2_zero_checkpoint(tmp_path):
    root = tp2pp2_zero(tmp_path)
    info = checkpoint_info(tmp_path)
    assert info["layout"] == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 1,
        "data_parallel_size": 2,
        "zero_stage": 1,
        "offload_optimizer": "none",
        "offload_param": "none",
        "optimizer_states": True,
    }
    assert info["progress"] == {
        "iteration": 5,
        "consumed_train_samples": 40,
        "consumed_train_tokens": 40 * 32,
    }
    sizes = {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*.*")}
    assert {f["path"]: f["size"] for f in info["files"]} == sizes and len(sizes) == 13
    assert info["total_size"] == sum(sizes.values())
    assert info["convert_to"]["tensor_model_parallel_size"] == [1, 2, 4]  # heads 4, ffn 256
    assert info["convert_to"]["pipeline_model_parallel_size"] == [1, 2, 4]  # 4 layers
    rc, out, _ = cli("checkpoint", "info", str(tmp_path), "--json")
    assert rc == 0 and json.loads(out) == info


def test_deepspeed_keys_for_async_save_and_keep_last():
    from zerotron.config.deepspeed import load_deepspeed_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # writer.type is accepted and ignored, with a warning
        cfg = load_deepspeed_config(
            {
                "train_batch_size": 8,
                "checkpoint": {"writer": {"decoupled": True, "type": "fast"}, "keep_last": 3},
            }
        )[0]
    assert cfg.checkpoint.async_save is True and cfg.checkpoint.save_keep_last == 3
