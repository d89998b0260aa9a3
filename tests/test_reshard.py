"""Resharding model weights between tensor/pipeline layouts (zerotron.checkpoint.reshard),
single process: split against the TP layers' own shards, merge∘split round trips, the vocabulary
re-padded, ``zerotron convert --target-...`` and load_gpt on a model-parallel checkpoint.

Multi-process checks (a trained tp2×pp2 checkpoint resharded, same logits) are in
tests/distributed/test_reshard_parallel.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from zerotron.checkpoint import load_file, model_file, model_files, read_metadata
from zerotron.checkpoint.convert import main as convert_main
from zerotron.checkpoint.model import load_gpt, save_gpt
from zerotron.checkpoint.reshard import (
    TIED_COPY,
    WORD_EMBEDDING,
    load_model_state_for,
    load_shared_entries,
    merge_model_shards,
    partition_dim,
    split_model_state,
    stage_layer_indices,
)
from zerotron.distributed.comm import Group
from zerotron.errors import CheckpointError, ConfigError
from zerotron.models.gpt import GPT, GPTConfig

ORIG_VOCAB = 100


def config(vocab: int = 128, layers: int = 4) -> GPTConfig:
    return GPTConfig(
        num_layers=layers,
        hidden_size=16,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=vocab,
        orig_vocab_size=ORIG_VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def fake_tp_group(rank: int, size: int) -> Group:
    # Building a TP layer draws and splits its full weight; no collective runs before forward.
    return Group("tp", tuple(range(size)), rank)


def built(cfg: GPTConfig, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    group = fake_tp_group(tp_rank, tp_size) if tp_size > 1 else Group.single("tp")
    return GPT(cfg, tp_group=group).state_dict()


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def stage_shards(full: dict, tp: int, pp: int, rows: int | None = None) -> dict:
    return {
        (t, p): split_model_state(
            full, t, tp, p, pp, orig_vocab_size=ORIG_VOCAB, padded_vocab_size=rows
        )
        for p in range(pp)
        for t in range(tp)
    }


def test_partition_dims_are_the_tp_layers_own():
    model = GPT(config(), tp_group=fake_tp_group(0, 2))
    for name, p in model.named_parameters():
        expected = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        assert partition_dim(name) == expected, name
        assert getattr(p, "partition_stride", 1) == 1, name  # plain chunks (QKV per head)
    assert partition_dim(TIED_COPY) == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_split_equals_the_tp_models_own_shards(tp):
    # A TP layer keeps its chunk of the full weight drawn for TP=1 (same seed): the split of the
    # single-process state must be exactly each rank's state (fused QKV included).
    cfg = config()
    full = built(cfg)
    for rank in range(tp):
        ours = split_model_state(full, rank, tp)
        assert_same_tensors(ours, built(cfg, rank, tp))
        assert all(t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes
                   for t in ours.values())  # fmt: skip


@pytest.mark.parametrize("tp,pp,v", [(2, 2, 1), (1, 2, 1), (2, 1, 1), (4, 4, 1), (1, 2, 2)])
def test_merge_of_split_is_the_full_state(tp, pp, v):
    full = built(config())
    shards = {
        (t, p): split_model_state(full, t, tp, p, pp, virtual_stages=v)
        for p in range(pp)
        for t in range(tp)
    }
    layers = [stage_layer_indices(4, p, pp, v) for p in range(pp)]
    assert sorted(i for ls in layers for i in ls) == [0, 1, 2, 3]
    for p in range(pp):
        keys = shards[(0, p)]
        assert (WORD_EMBEDDING in keys) == (p == 0)
        assert (TIED_COPY in keys) == (p == pp - 1 and pp > 1)
        assert ("final_layernorm.weight" in keys) == (p == pp - 1)
        assert {int(k.split(".")[1]) for k in keys if k.startswith("layers.")} == set(layers[p])
    if pp > 1:  # the last stage's tied copy is its TP shard of the embedding
        for t in range(tp):
            assert torch.equal(shards[(t, pp - 1)][TIED_COPY], shards[(t, 0)][WORD_EMBEDDING])
    assert_same_tensors(merge_model_shards(shards, tp, pp), full)


def test_vocab_is_repadded_and_round_trips_bytes():
    # tp2 pads 100 real ids to 256 rows, tp1 to 128: tp2 -> tp1 -> tp2 gives the same bytes.
    full_256 = built(config(vocab=256))
    assert torch.count_nonzero(full_256[WORD_EMBEDDING][ORIG_VOCAB:]) == 0  # padding is zero
    tp2 = stage_shards(full_256, 2, 2)
    tp1 = stage_shards(merge_model_shards(tp2, 2, 2), 1, 1, rows=128)
    assert tp1[(0, 0)][WORD_EMBEDDING].shape == (128, 16)
    back = stage_shards(merge_model_shards(tp1, 1, 1), 2, 2, rows=256)
    for key in tp2:
        assert_same_tensors(back[key], tp2[key])
    with pytest.raises(ConfigError, match="do not split over 3"):
        split_model_state(full_256, 0, 3, padded_vocab_size=256)


def test_merge_refuses_missing_or_mixed_shards():
    full = built(config())
    shards = stage_shards(full, 2, 2)
    with pytest.raises(CheckpointError, match=r"missing for \(tensor, pipeline\) ranks \[\(1, 1\)"):
        merge_model_shards({k: v for k, v in shards.items() if k != (1, 1)}, 2, 2)
    shards[(1, 0)] = {k: v for k, v in shards[(1, 0)].items() if "layers.0." not in k}
    with pytest.raises(CheckpointError, match="hold different tensors"):
        merge_model_shards(shards, 2, 2)
    both = stage_shards(full, 1, 2)
    both[(0, 1)]["layers.0.input_layernorm.weight"] = full["layers.0.input_layernorm.weight"]
    with pytest.raises(CheckpointError, match="held by pipeline stages 0 and 1"):
        merge_model_shards(both, 1, 2)


# ---- checkpoints on disk ----------------------------------------------------------------------


@pytest.fixture
def tp1_checkpoint(tmp_path):
    cfg = config()
    torch.manual_seed(3)
    model = GPT(cfg)
    path = tmp_path / "tp1"
    save_gpt(path, cfg, model.state_dict(), tag="iter_0000010")
    return path, model


def test_convert_command_round_trip_and_metadata(tp1_checkpoint, tmp_path, capsys):
    src, model = tp1_checkpoint
    out = tmp_path / "tp2pp2"
    argv = ["--load", str(src), "--save", str(out), "--make-vocab-size-divisible-by", "64"]
    assert convert_main([*argv, "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "2"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "weights only: the source holds no optimizer state" in printed
    meta = read_metadata(out, "iter_0000010")
    assert (out / "latest").read_text() == "iter_0000010"
    assert meta["layout"]["tensor_model_parallel_size"] == 2
    assert meta["layout"]["pipeline_model_parallel_size"] == 2
    assert meta["vocab"] == {"size": ORIG_VOCAB, "padded_size": 128}  # 100 -> 64 x 2
    assert meta["model"]["vocab_size"] == 128 and meta["optimizer_states"] is False
    assert meta["converted_from"]["tensor_model_parallel_size"] == 1
    assert sorted(meta["files"]) == sorted(model_files(2, 2))
    rank = load_file(out, "iter_0000010", model_file(1, 1, 2))
    assert "optimizer" not in rank and rank["checkpoint_version"] == 3.0
    assert rank["model"][TIED_COPY].shape == (64, 16)

    back = tmp_path / "back"
    assert convert_main(["--load", str(out), "--save", str(back),
                         "--target-tensor-parallel-size", "1",
                         "--target-pipeline-parallel-size", "1"]) == 0  # fmt: skip
    merged = load_file(back, "iter_0000010", model_file())["model"]
    assert_same_tensors(merged, model.state_dict())
    # The same weights at tp2 x pp2, read for one rank without the offline command.
    state, _ = load_model_state_for(back, None, 1, 2, 1, 2, padded_vocab_size=128)
    assert_same_tensors(state, rank["model"])
    assert load_shared_entries(out) == {"checkpoint_version": 3.0}  # what every rank shares


def test_convert_argument_errors(tp1_checkpoint, tmp_path):
    src, _ = tp1_checkpoint
    with pytest.raises(ConfigError, match="layout conversion takes --load CKPT --save OUT"):
        convert_main(["--load", str(src), "--target-tensor-parallel-size", "2"])
    with pytest.raises(ConfigError, match="4 layers do not divide evenly into 8 pipeline stages"):
        convert_main(["--load", str(src), "--save", str(tmp_path / "x"),
                      "--target-pipeline-parallel-size", "8"])  # fmt: skip


def test_load_gpt_reads_a_model_parallel_checkpoint(tp1_checkpoint, tmp_path):
    src, model = tp1_checkpoint
    out = tmp_path / "tp2pp2"
    convert_main(["--load", str(src), "--save", str(out), "--target-tensor-parallel-size", "2",
                  "--target-pipeline-parallel-size", "2"])  # fmt: skip
    loaded, meta = load_gpt(out)  # one process: merged to tp1 (padding 256 splits over 1)
    assert meta["layout"]["tensor_model_parallel_size"] == 2
    assert loaded.config.vocab_size == 256 and not loaded.training
    tokens = torch.tensor([[1, 5, 99, 7, 3]])
    with torch.no_grad():
        ours, ref = loaded(tokens), model.eval()(tokens)
    assert torch.equal(ours[..., :ORIG_VOCAB], ref[..., :ORIG_VOCAB])  # same weights, same math
    assert json.loads((out / "iter_0000010" / "metadata.json").read_text())["iteration"] == 10
