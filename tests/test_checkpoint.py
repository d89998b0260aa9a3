"""Checkpoint layer: names, atomic save/load, trackers, killed saves, RNG, fitting state dicts."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import zerotron
from zerotron.checkpoint import (
    build_metadata,
    check_safe,
    file_checksum,
    get_rng_state,
    layout,
    load_file,
    load_model_state,
    read_latest_tag,
    read_metadata,
    repad_vocab,
    resolve_tag,
    save_checkpoint,
    save_load,
    set_rng_state,
    to_safe,
)
from zerotron.errors import CheckpointError


def assert_same(a, b, path="") -> None:
    """Exact structural equality: same container types, same tensors (dtype, shape, values)."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def tiny_metadata(hidden=8):
    return build_metadata(
        model_config={"num_layers": 2, "hidden_size": hidden, "hidden_dropout": 0.1},
        vocab_size=50257,
        padded_vocab_size=50304,
        tokenizer={"type": "GPT2BPETokenizer"},
    )


# --------------------------------------------------------------------------------- names


def test_layout_names_are_megatrons_and_deepspeeds():
    assert layout.tag_for_iteration(600) == "iter_0000600"
    assert layout.tag_for_iteration(0) == "iter_0000000"
    assert layout.tag_for_iteration(12345678) == "iter_12345678"
    assert layout.iteration_from_tag("iter_0000600") == 600
    assert layout.iteration_from_tag("global_step600") is None
    assert layout.iteration_from_tag("iter_600") is None
    assert layout.model_file(0, 0, 1) == "mp_rank_00/model_optim_rng.pt"
    assert layout.model_file(3, 0, 1) == "mp_rank_03/model_optim_rng.pt"
    assert layout.model_file(3, 1, 2) == "mp_rank_03_001/model_optim_rng.pt"
    assert layout.model_file(0, 0, 4) == "mp_rank_00_000/model_optim_rng.pt"
    assert layout.zero_file(5, 1, 2) == "zero_dp_rank_5_mp_rank_01_002_optim_states.pt"
    assert layout.zero_file(0) == "zero_dp_rank_0_mp_rank_00_000_optim_states.pt"
    assert layout.model_files(2, 2) == [
        "mp_rank_00_000/model_optim_rng.pt",
        "mp_rank_01_000/model_optim_rng.pt",
        "mp_rank_00_001/model_optim_rng.pt",
        "mp_rank_01_001/model_optim_rng.pt",
    ]
    assert layout.model_files(2) == [
        "mp_rank_00/model_optim_rng.pt",
        "mp_rank_01/model_optim_rng.pt",
    ]
    assert layout.zero_files(2, 1, 1) == [
        "zero_dp_rank_0_mp_rank_00_000_optim_states.pt",
        "zero_dp_rank_1_mp_rank_00_000_optim_states.pt",
    ]
    assert layout.megatron_tracker("/s").as_posix() == "/s/latest_checkpointed_iteration.txt"
    assert layout.deepspeed_tracker("/s").as_posix() == "/s/latest"
    assert layout.temp_tag_dir("/s", "iter_0000001").as_posix() == "/s/.iter_0000001.tmp"
    for bad in ("", ".hidden", "a/b", "..", " x"):
        with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
            layout.validate_tag(bad)


# ------------------------------------------------------------------------------ save/load


def test_round_trip_nested_state_with_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "iteration": 600,
        "consumed_samples": 4800,
        "args": {"name": "gpt", "betas": (0.9, 0.95), "layers": [1, 2], "none": None},
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "int8": torch.tensor([-1, 2], dtype=torch.int8),
        "rng_state": get_rng_state(),
    }
    final = save_checkpoint(tmp_path, "iter_0000600", {layout.model_file(): state}, tiny_metadata())
    assert final == tmp_path / "iter_0000600"
    loaded = load_file(tmp_path, "iter_0000600", "mp_rank_00/model_optim_rng.pt")
    assert_same(state["model"], loaded["model"])  # OrderedDict stays an OrderedDict
    assert_same(state, loaded)
    # The file itself loads with plain weights_only torch.load.
    torch.load(final / "mp_rank_00/model_optim_rng.pt", weights_only=True)

    meta = read_metadata(tmp_path, "iter_0000600")
    assert meta["tag"] == "iter_0000600" and meta["iteration"] == 600
    assert meta["files"] == ["mp_rank_00/model_optim_rng.pt"]
    assert meta["layout"] == {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "data_parallel_size": 1,
        "zero_stage": 0,
    }
    assert meta["vocab"] == {"size": 50257, "padded_size": 50304}
    assert meta["model"]["hidden_size"] == 8
    assert meta["tokenizer"] == {"type": "GPT2BPETokenizer"}
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["versions"]["zerotron"] == zerotron.__version__
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000600",
        "latest",
        "latest_checkpointed_iteration.txt",
    ]
    assert sorted(os.listdir(final)) == ["metadata.json", "mp_rank_00"]


def test_trackers_content(tmp_path):
    save_checkpoint(tmp_path, "iter_0000600", {"a.pt": {"x": 1}})
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "600"
    assert (tmp_path / "latest").read_text() == "iter_0000600"
    assert read_latest_tag(tmp_path) == resolve_tag(tmp_path) == "iter_0000600"

    # save_latest=False leaves both trackers where they were.
    save_checkpoint(tmp_path, "iter_0000700", {"a.pt": {"x": 2}}, save_latest=False)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "600"
    assert resolve_tag(tmp_path) == "iter_0000600"

    # Megatron's tracker alone (a Megatron-written directory) is enough.
    (tmp_path / "latest").unlink()
    assert read_latest_tag(tmp_path) == "iter_0000600"

    # A DeepSpeed-style tag: `latest` names it, Megatron's tracker (which cannot) goes away.
    save_checkpoint(tmp_path, "global_step7", {"a.pt": {"x": 3}}, iteration=7)
    assert (tmp_path / "latest").read_text() == "global_step7"
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()
    assert read_metadata(tmp_path, "global_step7")["iteration"] == 7

    save_checkpoint(tmp_path, "release", {"a.pt": {"x": 4}})
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    (tmp_path / "latest").unlink()
    assert resolve_tag(tmp_path) == "release"
    assert load_file(tmp_path, resolve_tag(tmp_path), "a.pt") == {"x": 4}


def test_overwrite_same_tag_replaces_it_whole(tmp_path):
    save_checkpoint(tmp_path, "iter_0000010", {"a.pt": {"v": 1}, "old_only.pt": {"v": 0}})
    save_checkpoint(tmp_path, "iter_0000010", {"a.pt": {"v": 2}})
    assert load_file(tmp_path, "iter_0000010", "a.pt") == {"v": 2}
    assert sorted(os.listdir(tmp_path / "iter_0000010")) == ["a.pt", "metadata.json"]
    assert read_metadata(tmp_path, "iter_0000010")["files"] == ["a.pt"]
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000010",
        "latest",
        "latest_checkpointed_iteration.txt",
    ]


def test_ranks_write_into_one_tag_directory(tmp_path):
    """Two 'ranks' (threads with a barrier): each writes its own file, the writer commits."""
    barrier = threading.Barrier(2, timeout=20)
    errors = []

    def rank(r):
        try:
            files = {layout.model_file(r, 0, 1): {"tp_rank": r, "w": torch.full((2,), float(r))}}
            files[layout.zero_file(0, r, 0)] = {"part": torch.tensor([r])}
            save_checkpoint(tmp_path, "s1", files, {}, is_writer=r == 0, barrier=barrier.wait)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert read_metadata(tmp_path, "s1")["files"] == [
        "mp_rank_00/model_optim_rng.pt",
        "mp_rank_01/model_optim_rng.pt",
        "zero_dp_rank_0_mp_rank_00_000_optim_states.pt",
        "zero_dp_rank_0_mp_rank_01_000_optim_states.pt",
    ]
    assert torch.equal(
        load_file(tmp_path, "s1", "mp_rank_01/model_optim_rng.pt")["w"], torch.tensor([1.0, 1.0])
    )
    with pytest.raises(ValueError, match="barrier"):
        save_checkpoint(tmp_path, "s2", {}, is_writer=False)


# ----------------------------------------------------------------------------- killed saves


def _killed_save(save_dir, tag, payload, stage, ready):
    """Child process: start a save of ``tag`` and hang at ``stage`` until SIGKILLed."""

    def hang():
        ready.set()
        time.sleep(60)

    if stage == "writing_files":  # the first file is on disk, the second never completes
        real_write = save_load._write_file
        calls = []

        def write(path, obj):
            if calls:
                hang()
            calls.append(path)
            real_write(path, obj)

        save_load._write_file = write
    elif stage == "between_renames":  # the old tag moved aside, the new one not yet in place
        real_replace = os.replace

        def replace(src, dst):
            real_replace(src, dst)
            if os.path.basename(str(src)) == tag:
                hang()

        os.replace = replace
    elif stage == "before_trackers":  # the tag is complete, the trackers still name the old one
        save_load.write_trackers = lambda *a: hang()
    files = {layout.model_file(): payload, "second.pt": {"big": torch.zeros(1000)}}
    save_checkpoint(save_dir, tag, files, {})
    os._exit(0)  # not reached when the test works: the parent kills us first


@pytest.mark.parametrize(
    "stage, tag",
    [
        ("writing_files", "iter_0000200"),
        ("between_renames", "iter_0000100"),  # overwriting the tag the trackers name
        ("before_trackers", "iter_0000200"),
    ],
)
def test_killed_save_leaves_previous_checkpoint(tmp_path, stage, tag):
    previous = {"weights": torch.arange(5.0), "iteration": 100}
    save_checkpoint(tmp_path, "iter_0000100", {layout.model_file(): previous}, {"m": 1})

    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(
        target=_killed_save,
        args=(tmp_path, tag, {"weights": torch.ones(5), "iteration": 200}, stage, ready),
    )
    child.start()
    assert ready.wait(20), "the child never reached the pause point"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL

    # Trackers untouched, the previous checkpoint loads with its own content.
    assert (tmp_path / "latest").read_text() == "iter_0000100"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    got_tag = resolve_tag(tmp_path)
    assert got_tag == "iter_0000100"
    assert_same(load_file(tmp_path, got_tag, layout.model_file()), previous)
    assert read_metadata(tmp_path, got_tag)["m"] == 1

    # The next save cleans up whatever the killed one left.
    save_checkpoint(tmp_path, "iter_0000300", {layout.model_file(): {"x": 3}})
    left = sorted(os.listdir(tmp_path))
    assert [n for n in left if n.startswith(".")] == []
    assert "iter_0000100" in left and resolve_tag(tmp_path) == "iter_0000300"


# ----------------------------------------------------------------------- weights_only safety


def test_unsafe_objects_are_refused_before_writing(tmp_path):
    state = {"model": {"w": torch.zeros(2)}, "np": {"inner": [1, np.zeros(3)]}}
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, "t", {"a.pt": state})
    assert "numpy.ndarray at ['np']['inner'][1]" in str(e.value)
    assert "weights_only=True" in str(e.value)
    assert not tmp_path.exists() or os.listdir(tmp_path) == []

    class Custom:
        pass

    with pytest.raises(CheckpointError, match="Custom at \\['c'\\]"):
        check_safe({"c": Custom()})
    with pytest.raises(CheckpointError, match="frozenset at \\['s'\\]\\[0\\]"):
        check_safe({"s": [frozenset({1})]})

    safe = to_safe(state)
    check_safe(safe)
    save_checkpoint(tmp_path, "t", {"a.pt": safe})
    back = load_file(tmp_path, "t", "a.pt")
    assert torch.equal(back["np"]["inner"][1], torch.zeros(3, dtype=torch.float64))

    np_scalars = to_safe(
        {"f": np.float32(1.5), "i": np.int64(3), "p": tmp_path, "s": {1}, "fs": frozenset({2})}
    )
    check_safe(np_scalars)
    assert type(np_scalars["fs"]) is set
    assert np_scalars == {"f": 1.5, "i": 3, "p": str(tmp_path), "s": {1}, "fs": {2}}
    assert type(np_scalars["f"]) is float and type(np_scalars["i"]) is int


def test_load_refuses_pickled_objects(tmp_path):
    save_checkpoint(tmp_path, "t", {"a.pt": {"x": 1}})
    # Bypass the save-time check to plant a file weights_only must refuse.
    torch.save({"obj": collections.Counter, "f": len}, tmp_path / "t" / "a.pt")
    meta = read_metadata(tmp_path, "t")
    meta["checksums"]["a.pt"] = file_checksum(tmp_path / "t" / "a.pt")  # it passes the checksum
    (tmp_path / "t" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as e:
        load_file(tmp_path, "t", "a.pt")
    assert "weights_only=True" in str(e.value) and str(tmp_path / "t" / "a.pt") in str(e.value)


# ----------------------------------------------------------------------------------- errors


def test_missing_checkpoint_messages(tmp_path):
    with pytest.raises(CheckpointError) as e:
        resolve_tag(tmp_path / "nowhere")
    assert str(e.value) == (
        f"{tmp_path / 'nowhere'}: no checkpoint to load: found neither 'latest' nor "
        "'latest_checkpointed_iteration.txt'\n"
        "  -> pass the directory given to --save, name a tag explicitly, or start without --load"
    )
    assert read_latest_tag(tmp_path / "nowhere") is None

    save_checkpoint(tmp_path, "iter_0000005", {layout.model_file(): {"x": 1}}, {})
    (tmp_path / "latest").write_text("iter_0000009")
    with pytest.raises(CheckpointError) as e:
        resolve_tag(tmp_path, "iter_0000009")
    assert str(e.value).startswith(
        f"{tmp_path / 'iter_0000009'}: checkpoint 'iter_0000009' does not exist; "
        "present: iter_0000005"
    )
    with pytest.warns(UserWarning, match="'iter_0000009' .* loading 'iter_0000005'"):
        assert resolve_tag(tmp_path) == "iter_0000005"  # the tracker's tag is gone

    with pytest.raises(CheckpointError) as e:
        load_file(tmp_path, "iter_0000005", layout.model_file(1, 0, 1))
    assert str(e.value).startswith(
        f"{tmp_path / 'iter_0000005' / 'mp_rank_01' / 'model_optim_rng.pt'}: checkpoint file "
        "'mp_rank_01/model_optim_rng.pt' is missing; the checkpoint has: metadata.json, "
        "mp_rank_00/model_optim_rng.pt"
    )

    path = tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:40])  # truncated
    with pytest.raises(CheckpointError) as e:
        load_file(tmp_path, "iter_0000005", layout.model_file())
    assert str(e.value).startswith(
        f"{path}: checkpoint file 'mp_rank_00/model_optim_rng.pt' is corrupt: size is 40 bytes"
    )

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("six hundred")
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match="holds 'six hundred', expected an iteration"):
        resolve_tag(tmp_path)

    (tmp_path / "iter_0000005" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="has no metadata.json") as e:
        read_metadata(tmp_path, "iter_0000005")
    assert "if zerotron did, restore its metadata.json" in e.value.fix


# -------------------------------------------------------------------------------------- RNG


def _draw():
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [float(np.random.standard_normal())],
        torch.rand(3),
        torch.randn(3),
    )


def test_rng_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # Leave a cached Gaussian in python's and numpy's generators: it is part of the state.
    random.gauss(0, 1)
    np.random.standard_normal()
    state = get_rng_state(extra={"model_parallel": {"seed": torch.tensor([2718])}})
    save_checkpoint(tmp_path, "r", {"rng.pt": {"rng_state": state}})
    expected = _draw()
    _draw()  # move every generator on

    loaded = load_file(tmp_path, "r", "rng.pt")["rng_state"]
    extra = set_rng_state(loaded)
    got = _draw()
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])
    assert list(extra) == ["model_parallel"]
    assert torch.equal(extra["model_parallel"]["seed"], torch.tensor([2718]))
    assert sorted(loaded) == ["model_parallel", "numpy", "python", "torch"]  # no CUDA here

    with pytest.raises(ValueError, match="overwrite"):
        get_rng_state(extra={"torch": 1})
    with pytest.raises(CheckpointError, match="RNG states in the checkpoint are malformed"):
        set_rng_state({"numpy": {"key": torch.zeros(3)}})


# --------------------------------------------------------------------- fitting state dicts


class TinyLM(nn.Module):
    def __init__(self, vocab=64, hidden=8):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)


VOCAB_KEYS = ("embedding.weight",)


def test_vocab_repad_50304_to_50432():
    torch.manual_seed(0)
    src, dst = TinyLM(vocab=50304, hidden=4), TinyLM(vocab=50432, hidden=4)
    state = src.state_dict()
    repadded = load_model_state(
        dst, state, vocab_keys=VOCAB_KEYS, orig_vocab_size=50257, vocab_size=50257
    )
    assert repadded == ["embedding.weight"]
    emb = dst.embedding.weight.detach()
    assert emb.shape == (50432, 4)
    assert torch.equal(emb[:50257], state["embedding.weight"][:50257])
    assert torch.count_nonzero(emb[50257:]) == 0
    assert torch.equal(dst.proj.weight.detach(), state["proj.weight"])

    # and back down to the smaller padding
    back = TinyLM(vocab=50304, hidden=4)
    load_model_state(back, dst.state_dict(), vocab_keys=VOCAB_KEYS, orig_vocab_size=50257)
    assert torch.equal(back.embedding.weight.detach()[:50257], state["embedding.weight"][:50257])
    assert torch.count_nonzero(back.embedding.weight.detach()[50257:]) == 0

    t = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(repad_vocab(t, 4, 5), torch.cat([t[:4], torch.zeros(1, 2)]))
    with pytest.raises(ValueError):
        repad_vocab(t, 7, 8)


def test_mismatch_lists_every_tensor_with_both_shapes():
    ckpt = TinyLM(vocab=64, hidden=8).state_dict()
    model = TinyLM(vocab=64, hidden=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        load_model_state(
            model,
            ckpt,
            vocab_keys=VOCAB_KEYS,
            orig_vocab_size=50,
            ckpt_config={"num_layers": 2, "hidden_size": 8, "hidden_dropout": 0.1},
            model_config={"num_layers": 2, "hidden_size": 16, "hidden_dropout": 0.0},
            where="ckpt/iter_0000001/mp_rank_00/model_optim_rng.pt",
        )
    shapes = {k: (list(ckpt[k].shape), list(v.shape)) for k, v in before.items()}
    lines = [f"{k}: checkpoint {c} vs model {m}" for k, (c, m) in shapes.items()]
    assert str(e.value) == (
        "ckpt/iter_0000001/mp_rank_00/model_optim_rng.pt: the checkpoint does not fit the model "
        f"({len(lines)} differences):\n    " + "\n    ".join(lines) + "\n"
        "  -> --hidden-size 8 in the checkpoint vs 16 now: pass --hidden-size 8 or start "
        "without --load"
    )
    for k, v in model.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k])


def test_missing_unexpected_and_tokenizer_mismatch():
    ckpt = TinyLM().state_dict()
    ckpt["extra.bias"] = torch.zeros(3)
    del ckpt["norm.bias"]
    with pytest.raises(CheckpointError) as e:
        load_model_state(TinyLM(), ckpt, ckpt_config={"hidden_size": 8, "num_layers": 2})
    assert "\n    norm.bias: missing in checkpoint (model [8])\n" in str(e.value)
    assert "\n    extra.bias: unexpected in checkpoint ([3]), not in the model\n" in str(e.value)
    assert "(2 differences)" in str(e.value)
    assert str(e.value).endswith(
        "-> the checkpoint was saved with --hidden-size 8 --num-layers 2: pass those or start "
        "without --load"
    )

    # A padding difference with another tokenizer is not a re-pad: it is reported.
    with pytest.raises(CheckpointError) as e:
        load_model_state(
            TinyLM(vocab=72),
            TinyLM(vocab=64).state_dict(),
            vocab_keys=VOCAB_KEYS,
            orig_vocab_size=60,
            vocab_size=70,
        )
    assert "vocabulary: checkpoint trained with 60 tokens vs 70 in this tokenizer" in str(e.value)
    # Without the unpadded size a vocab-rows difference cannot be told from another vocabulary.
    with pytest.raises(CheckpointError, match=r"embedding.weight: checkpoint \[64, 8\] vs model"):
        load_model_state(TinyLM(vocab=72), TinyLM(vocab=64).state_dict(), vocab_keys=VOCAB_KEYS)
