"""Checkpoint faults (issue 19): a full or read-only disk, corrupt weights, bad paths and files.

Each test is the regression test of one finding: F2 (a full disk gives the clean DiskFullError,
no temp files, the previous checkpoint kept), F4 (a non-finite loss or weight is refused) and the
checkpoint part of F5 (bad paths found at start, bad tracker/metadata/HF files refused cleanly).
The full-disk tests mount a small tmpfs (the suite runs as root) and unmount it afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import zerotron.cli
from zerotron.checkpoint import file_checksum, model_file, save_load
from zerotron.checkpoint.save_load import read_latest_tag, read_metadata, save_checkpoint
from zerotron.errors import CheckpointError, DiskFullError

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "100",
    "--eval-iters", "1", "--seed", "1234",
    "--num-workers", "0",  # loader workers cost seconds per in-process run (test_samplers has them)
]  # fmt: skip

CKPT_MB = 40  # one checkpoint of the tiny model with its Adam state: 39.9 MB


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block; skipped where mounting is refused."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def leftovers(save: Path) -> list[str]:
    """Temporary names a save left behind (dot files: .iter_N.tmp, .latest.tmp-..., ...)."""
    return sorted(n for n in os.listdir(save) if n.startswith("."))


def pretrain_cli(data: str, save: Path, *extra: object) -> int:
    argv = ["pretrain", *TINY, "--data-path", data, "--save", str(save), *map(str, extra)]
    return zerotron.cli.main(argv)


# ---- F2: a full disk ------------------------------------------------------------------------


def test_full_disk_is_refused_before_writing_with_sizes(data_prefix, tmp_path, capsys):
    """pretrain --save on a tmpfs with room for one checkpoint: the second save is refused
    up front (needed and free sizes named), exit 2, no temp dir, the first checkpoint kept."""
    with tmpfs(tmp_path / "disk", f"{CKPT_MB + 20}m") as disk:
        save = disk / "ckpt"
        rc = pretrain_cli(data_prefix, save, "--train-iters", 2, "--save-interval", 1)
        err = capsys.readouterr().err
        assert rc == 2, err
        assert "Traceback" not in err
        assert "not enough space for checkpoint files" in err
        assert "it needs 3" in err and "MiB is free" in err  # ~39 MiB needed, ~20 MiB free
        assert leftovers(save) == []
        assert read_latest_tag(save) == "iter_0000001"
        assert sorted(os.listdir(save)) == [
            "iter_0000001",
            "latest",
            "latest_checkpointed_iteration.txt",
            "metrics",  # the run's metrics file (zerotron report), beside the checkpoints
        ]


def test_disk_filling_inside_torch_save_is_disk_full(tmp_path, monkeypatch):
    """The disk fills inside torch.save (the free-space check fooled, as by another writer):
    torch's inline_container RuntimeError becomes DiskFullError; nothing partial remains."""
    monkeypatch.setattr(save_load, "_space_problem", lambda save_dir, files: None)
    with tmpfs(tmp_path / "disk", "2m") as disk:
        save = disk / "ckpt"
        save_checkpoint(save, "iter_0000001", {"small.pt": {"w": torch.zeros(10)}})
        big = {"model.pt": {"w": torch.ones(1024 * 1024)}}  # 4 MiB on a 2 MiB disk
        with pytest.raises(DiskFullError, match="no space left on device") as e:
            save_checkpoint(save, "iter_0000002", big)
        assert "nothing partial was kept" in e.value.fix
        assert leftovers(save) == []
        assert read_latest_tag(save) == "iter_0000001"
        assert sorted(os.listdir(save / "iter_0000001")) == ["metadata.json", "small.pt"]


def _fail_on(monkeypatch, name: str, code: int) -> None:
    """Make writing a file called ``name`` (through pathlib or open) fail with ``code``."""
    real_open = open

    def failing_open(file, mode="r", *args, **kwargs):
        if "w" in mode and Path(os.fspath(file)).name.startswith((name, f".{name}")):
            raise OSError(code, os.strerror(code), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    monkeypatch.setattr("io.open", failing_open)  # what pathlib calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
@pytest.mark.parametrize("name", ["model.pt", "metadata.json", "latest"])
def test_each_write_path_maps_disk_errors(tmp_path, monkeypatch, name, code):
    """ENOSPC/EDQUOT/EROFS writing a model file, metadata.json or a tracker: DiskFullError, no
    temp files, the previous checkpoint and trackers kept."""
    save = tmp_path / "ckpt"
    save_checkpoint(save, "iter_0000001", {"model.pt": {"w": torch.zeros(4)}})
    _fail_on(monkeypatch, name, code)
    with pytest.raises(DiskFullError) as e:
        save_checkpoint(save, "iter_0000002", {"model.pt": {"w": torch.ones(4)}})
    monkeypatch.undo()
    assert "nothing partial was kept" in e.value.fix
    assert leftovers(save) == []
    if name != "latest":  # a failed tracker write leaves the new checkpoint, unnamed
        assert not (save / "iter_0000002").exists()
    assert read_latest_tag(save) == "iter_0000001"
    assert json.loads((save / "iter_0000001" / "metadata.json").read_text())["iteration"] == 1


# ---- F4: silent corruption --------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_step_ckpt(data_prefix, tmp_path_factory) -> Path:
    """A checkpoint of the tiny model after one iteration."""
    save = tmp_path_factory.mktemp("f4") / "ckpt"
    argv = [
        "pretrain",
        *TINY,
        "--data-path",
        data_prefix,
        "--save",
        str(save),
        "--save-interval",
        "1",
    ]
    assert (
        zerotron.cli.main(
            [*argv, "--train-iters", "3", "--exit-interval", "1", "--eval-iters", "0"]
        )
        == 0
    )
    return save


def flip_bit(save: Path, copy: Path, tensor: str, element: int = 0, bit: int = 30) -> Path:
    """``save`` copied to ``copy`` with one bit of one float of ``tensor`` flipped in its bytes."""
    shutil.copytree(save, copy)
    path = copy / "iter_0000001" / model_file()
    weights = torch.load(path, weights_only=True)["model"][tensor]
    if element < 0:  # the first value in [1, 2): its exponent is 0x7f, one flip from NaN/Inf
        element = int(((weights >= 1) & (weights < 2)).nonzero()[0, 0])
    raw = path.read_bytes()
    at = raw.find(weights.contiguous().numpy().tobytes())
    assert at >= 0 and raw.count(weights.numpy().tobytes()) == 1
    pos = at + 4 * element + bit // 8  # little-endian float32
    data = bytearray(raw)
    data[pos] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))
    # As if the bit flipped in memory before the save: the recorded checksum matches the file,
    # so what refuses it is the non-finite check, not the checksum.
    meta_path = copy / "iter_0000001" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["checksums"][model_file()] = file_checksum(path)
    meta_path.write_text(json.dumps(meta))
    return copy


def test_flipped_bit_to_inf_is_refused_at_load(data_prefix, one_step_ckpt, tmp_path, capsys):
    """A LayerNorm weight in [1, 2) with its top exponent bit flipped is NaN/Inf: refused,
    naming the file and the tensor (it used to load and train on NaN losses, exit 0)."""
    load = flip_bit(one_step_ckpt, tmp_path / "ckpt", "final_layernorm.weight", -1)
    argv = ["pretrain", *TINY, "--data-path", data_prefix, "--load", str(load)]
    rc = zerotron.cli.main([*argv, "--train-iters", "3", "--eval-iters", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert f"iter_0000001/{model_file()}" in err
    assert "tensor model.final_layernorm.weight holds 1 NaN/Inf value" in err


def test_flipped_bit_to_huge_weight_stops_at_the_nan_loss(
    data_prefix, one_step_ckpt, tmp_path, capsys
):
    """A position embedding with a flipped exponent bit is finite but huge: the first resumed
    iteration's loss is NaN and the run stops there with exit 2, naming the iteration."""
    load = flip_bit(one_step_ckpt, tmp_path / "ckpt", "embedding.position_embeddings.weight")
    argv = ["pretrain", *TINY, "--data-path", data_prefix, "--load", str(load)]
    rc = zerotron.cli.main([*argv, "--train-iters", "3", "--eval-iters", "0"])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "Traceback" not in captured.err
    assert "at iteration 2: training diverged or the weights are corrupt" in captured.err
    assert "lm loss: 0.000000E+00" not in captured.out


def test_nan_check_off_counts_and_never_logs_a_zero_loss(
    data_prefix, one_step_ckpt, tmp_path, capsys
):
    """--no-check-for-nan-in-loss-and-grad goes on; the log line says nan, counted, not 0."""
    load = flip_bit(one_step_ckpt, tmp_path / "ckpt", "embedding.position_embeddings.weight")
    argv = ["pretrain", *TINY, "--data-path", data_prefix, "--load", str(load)]
    argv += ["--train-iters", "3", "--eval-iters", "0", "--no-check-for-nan-in-loss-and-grad"]
    rc = zerotron.cli.main(argv)
    out = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith(" iteration        2/"))
    assert "lm loss: NAN |" in line and "number of nan iterations:   1 |" in line


# ---- F5: bad paths found at start -------------------------------------------------------------


def test_save_path_that_is_a_file_is_refused_before_training(data_prefix, tmp_path, capsys):
    """--save naming a file fails at start (exit 2, no traceback), not at the first save."""
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    rc = pretrain_cli(data_prefix, target, "--train-iters", 2, "--save-interval", 2)
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "Traceback" not in captured.err
    assert "--save: " in captured.err and "exists and is not a directory" in captured.err
    assert "training ..." not in captured.out


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_unwritable_output_dir_is_refused_before_training(data_prefix, tmp_path, capsys, flag):
    """--save or --tensorboard-dir on a read-only filesystem fails at start with exit 2."""
    with tmpfs(tmp_path / "ro", "1m,ro") as ro:
        save = tmp_path / "ckpt" if flag != "--save" else ro / "ckpt"
        extra = [flag, ro / "tb"] if flag != "--save" else []
        rc = pretrain_cli(data_prefix, save, "--train-iters", 2, "--save-interval", 2, *extra)
        captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "Traceback" not in captured.err
    assert f"{flag}: cannot write into {ro}" in captured.err
    assert "training ..." not in captured.out


@pytest.mark.parametrize("monitor", ["TensorBoardMonitor", "CsvMonitor"])
def test_unwritable_monitor_dir_is_a_config_error(tmp_path, monitor):
    """A DeepSpeed tensorboard/csv_monitor output_path that cannot be written: ConfigError."""
    from zerotron.engine import monitors
    from zerotron.errors import ConfigError

    with tmpfs(tmp_path / "ro", "1m,ro") as ro, pytest.raises(ConfigError) as e:
        getattr(monitors, monitor)(str(ro), "job")
    assert "output_path" in e.value.where and "cannot write into" in e.value.what


# ---- F5: bad trackers and metadata.json -------------------------------------------------------


def small_ckpt(save: Path) -> Path:
    save_checkpoint(save, "iter_0000001", {"model.pt": {"w": torch.zeros(2)}})
    return save


@pytest.mark.parametrize("tracker", ["latest", "latest_checkpointed_iteration.txt"])
def test_tracker_with_non_utf8_bytes_is_a_checkpoint_error(tmp_path, tracker):
    save = small_ckpt(tmp_path / "ckpt")
    (save / "latest").unlink()
    (save / tracker).write_bytes(b"iter_\xff\xfe0001\n")
    with pytest.raises(CheckpointError, match="the tracker file is not text") as e:
        read_latest_tag(save)
    assert e.value.where == str(save / tracker)


def test_tracker_with_non_utf8_bytes_exits_2(tmp_path, capsys):
    save = small_ckpt(tmp_path / "ckpt")
    (save / "latest").write_bytes(b"\x80\x81")
    rc = zerotron.cli.main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "the tracker file is not text" in err


BAD_METADATA = {
    "top level list": ([1, 2], "the top level is a list"),
    "layout list": ({"layout": [1]}, "layout is a list"),
    "tp size string": (
        {"layout": {"tensor_model_parallel_size": "2"}},
        "layout.tensor_model_parallel_size is a string",
    ),
    "tp size zero": (
        {"layout": {"tensor_model_parallel_size": 0}},
        "layout.tensor_model_parallel_size is an integer (0), expected a positive integer",
    ),
    "model list": ({"model": ["num_layers", 2]}, "model is a list"),
    "vocab size float": ({"vocab": {"size": 1.5}}, "vocab.size is a number"),
    "iteration string": ({"iteration": "5"}, "iteration is a string"),
    "files object": ({"files": {"a": 1}}, "files is an object"),
    "files of numbers": ({"files": [1]}, "files is a list"),
}


@pytest.mark.parametrize("case", BAD_METADATA, ids=list(BAD_METADATA))
def test_metadata_with_wrong_types_is_refused(tmp_path, case):
    save = small_ckpt(tmp_path / "ckpt")
    bad, said = BAD_METADATA[case]
    (save / "iter_0000001" / "metadata.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError) as e:
        read_metadata(save, "iter_0000001")
    assert said in e.value.what


def test_metadata_with_wrong_types_exits_2(tmp_path, capsys):
    save = small_ckpt(tmp_path / "ckpt")
    (save / "iter_0000001" / "metadata.json").write_text('{"model": "gpt2", "layout": []}')
    rc = zerotron.cli.main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "metadata.json: " in err


# ---- F5: bad HuggingFace directories ----------------------------------------------------------

HF_CONFIG = {"model_type": "gpt2", "vocab_size": 16, "n_positions": 8, "n_embd": 8}
HF_CONFIG |= {"n_layer": 1, "n_head": 2}


def hf_dir(root: Path, config: object = HF_CONFIG, index: object = None) -> Path:
    """An HF GPT-2 directory: config.json and (with ``index``) a sharded safetensors index."""
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (root / "config.json").write_text(text)
    if index is not None:
        text = index if isinstance(index, str) else json.dumps(index)
        (root / "model.safetensors.index.json").write_text(text)
    return root


def one_shard(path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"transformer.wte.weight": torch.zeros(16, 8)}, str(path))


def _outside(tmp: Path) -> dict:
    one_shard(tmp / "elsewhere" / "secret.safetensors")
    return {"weight_map": {"transformer.wte.weight": "../elsewhere/secret.safetensors"}}


def _absolute(tmp: Path) -> dict:
    one_shard(tmp / "elsewhere" / "abs.safetensors")
    return {"weight_map": {"x": str(tmp / "elsewhere" / "abs.safetensors")}}


def _inside(tmp: Path) -> dict:
    one_shard(tmp / "hf" / "model-1.safetensors")
    return {"weight_map": {"transformer.wte.weight": "model-1.safetensors"}}


def _symlink_out(tmp: Path) -> dict:
    one_shard(tmp / "elsewhere" / "linked.safetensors")
    (tmp / "hf").mkdir()
    (tmp / "hf" / "shard.safetensors").symlink_to(tmp / "elsewhere" / "linked.safetensors")
    return {"weight_map": {"x": "shard.safetensors"}}


def _nan_weight(tmp: Path) -> dict:
    from safetensors.torch import save_file

    (tmp / "hf").mkdir()
    w = torch.zeros(16, 8)
    w[3, 5] = math.nan
    save_file({"transformer.wte.weight": w}, str(tmp / "hf" / "model-1.safetensors"))
    return {"weight_map": {"transformer.wte.weight": "model-1.safetensors"}}


HF_CASES = {
    "no directory": (None, None, "no such directory"),
    "no config.json": ("missing", None, "no config.json"),
    "malformed config.json": ('{"n_layer": 1,', None, "config.json is not valid JSON"),
    "config.json a list": ("[1, 2]", None, "config.json is not a JSON object"),
    "no vocab_size": ({"n_layer": 1}, None, "config.json has no integer vocab_size"),
    "n_layer a string": ({**HF_CONFIG, "n_layer": "one"}, _inside, "value of the wrong type"),
    "malformed index": (HF_CONFIG, '{"weight_map": ', "index.json is not valid JSON"),
    "index without weight_map": (HF_CONFIG, {"metadata": {}}, "weight_map is missing"),
    "missing shard": (
        HF_CONFIG,
        {"weight_map": {"x": "model-00002-of-00002.safetensors"}},
        "weights file is missing",
    ),
    "shard outside (..)": (HF_CONFIG, _outside, "lies outside the model directory"),
    "shard outside (absolute)": (HF_CONFIG, _absolute, "lies outside the model directory"),
    "shard outside (symlink)": (HF_CONFIG, _symlink_out, "lies outside the model directory"),
    "corrupt shard": (HF_CONFIG, "corrupt", "cannot read the weights file"),
    "NaN weight": (HF_CONFIG, _nan_weight, "tensor transformer.wte.weight holds 1 NaN/Inf"),
}


@pytest.mark.parametrize("case", HF_CASES, ids=list(HF_CASES))
def test_bad_hf_directory_exits_2(tmp_path, capsys, case):
    """zerotron convert --from-hf on a broken HF directory: exit 2, the reason, no traceback."""
    config, index, said = HF_CASES[case]
    src = tmp_path / "hf"
    if callable(index):
        index = index(tmp_path)
    if index == "corrupt":
        index = {"weight_map": {"x": "model-1.safetensors"}}
        src.mkdir()
        (src / "model-1.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    if config is not None:
        hf_dir(src, None if config == "missing" else config, index)
    rc = zerotron.cli.main(["convert", "--from-hf", str(src), "--save", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert said in err
    assert not (tmp_path / "out").exists()


# ---- F2: the other writers (HF export, zero-to-fp32's streaming safetensors) -------------------


def test_hf_export_on_a_full_disk_is_refused_up_front(tmp_path):
    from zerotron.checkpoint.hf import save_hf_dir

    with tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(DiskFullError, match=r"needs 4\.0 MiB, 1\.0 MiB is free"):
            save_hf_dir(disk / "hf", {"w": torch.zeros(1024 * 1024)}, {"model_type": "gpt2"})
        assert os.listdir(disk / "hf") == []


def test_hf_export_filling_the_disk_leaves_nothing(tmp_path, monkeypatch):
    from zerotron.checkpoint import hf

    monkeypatch.setattr(hf, "check_free_space", lambda *a: None)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(DiskFullError, match="no space left on device"):
            hf.save_hf_dir(disk / "hf", {"w": torch.zeros(1024 * 1024)}, {"model_type": "gpt2"})
        assert os.listdir(disk / "hf") == []


@pytest.mark.parametrize("precheck", [True, False])
def test_zero_to_fp32_writer_on_a_full_disk(tmp_path, monkeypatch, precheck):
    """The streaming safetensors writer of zero-to-fp32: refused up front with sizes, or (the
    check bypassed) DiskFullError at the write that fills the disk; no temp file either way."""
    zero_to_fp32 = importlib.import_module("zerotron.checkpoint.zero_to_fp32")
    if not precheck:
        monkeypatch.setattr(zero_to_fp32, "check_free_space", lambda *a: None)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(DiskFullError) as e:
            w = zero_to_fp32.SafetensorsWriter(
                disk / "w.safetensors", [("w", torch.float32, (1 << 20,))]
            )
            try:
                w.write("w", 0, torch.ones(1 << 20))
            except BaseException:
                w.abort()
                raise
        said = "not enough space for w.safetensors" if precheck else "no space left on device"
        assert said in e.value.what
        assert os.listdir(disk) == []
