"""Converting a checkpoint between layouts with its optimizer state, in one process.

The source is a real Engine's save (tiny GPT: 4 layers, hidden 64, bf16 parameters so the fp32
masters differ from the weights, two Adam steps). Each target rank's files are checked against
what that rank's own objects hold: its module's state_dict (a GPT built for that tensor-parallel
rank, cut into its pipeline stage), and a real ZeroOptimizer over a simulated data-parallel
group that loads the converted partition (its own layout check) and saves it back unchanged;
their values against the source Engine's live masters and Adam moments. Round trips A -> B -> A
give the same bytes; the converter's memory is checked by counting the tensors alive.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from zerotron.checkpoint import layout as names
from zerotron.checkpoint import load_file, read_metadata
from zerotron.checkpoint.canonical import (
    DEFAULT_SUB_GROUP_SIZE,
    CanonicalCheckpoint,
    Layout,
    open_checkpoint,
)
from zerotron.checkpoint.convert import main as convert_main
from zerotron.checkpoint.convert_layout import convert_checkpoint
from zerotron.checkpoint.reshard import TIED_COPY, WORD_EMBEDDING, partition_dim
from zerotron.checkpoint.state import repad_vocab
from zerotron.checkpoint.stream_save import Pending, save_streaming
from zerotron.checkpoint.target import files_for_rank
from zerotron.config import parse_megatron_args
from zerotron.distributed.comm import Group
from zerotron.errors import CheckpointError, ConfigError
from zerotron.models.gpt import GPT, GPTConfig
from zerotron.models.gpt_stage import build_gpt_stages
from zerotron.optim import get_param_groups
from zerotron.precision.mixed import MixedPrecisionOptimizer
from zerotron.training.build import StageModel, build_run, lm_loss
from zerotron.zero.optimizer import ZeroOptimizer
from zerotron.zero.options import ZeroOptions, default_sizes
from zerotron.zero.state_dict import load_zero_state_dict

SEQ, VOCAB, TAG = 16, 100, "iter_0000002"
FLAGS = ["--num-layers", 4, "--hidden-size", 64, "--num-attention-heads", 4]
FLAGS += ["--seq-length", SEQ, "--lr", 1e-3, "--seed", 1234, "--bf16", "--train-iters", 10]
FLAGS += ["--micro-batch-size", 2, "--global-batch-size", 2, "--hidden-dropout", 0]
FLAGS += ["--attention-dropout", 0, "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB]


def build(*extra: object):
    return build_run(parse_megatron_args([str(a) for a in [*FLAGS, *extra]]))


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return {
        "tokens": ids[:, :-1],
        "labels": ids[:, 1:],
        "loss_mask": torch.ones(2, SEQ),
        "position_ids": torch.arange(SEQ).expand(2, SEQ),
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(checkpoint dir, {name: (weight, master, exp_avg, exp_avg_sq, step)} from the live
    engine, GPT config): a tp1 pp1 ZeRO-0 save after two steps."""
    root = tmp_path_factory.mktemp("convert")
    run = build()
    engine = run.engine
    for seed in (1, 2):
        loss = lm_loss(engine, batch(seed))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root / "ref", TAG, {"iteration": 2, "consumed_train_samples": 4})
    opt = engine.optimizer
    name_of = {id(p): n for n, p in engine.module.named_parameters()}
    live = {}
    for p, m in zip(opt.model_params, opt.master_params):
        st = opt.optimizer.state[m]
        live[name_of[id(p)]] = (p.detach().clone(), m.detach().clone(), st["exp_avg"].clone(),
                                st["exp_avg_sq"].clone(), st["step"].clone())  # fmt: skip
    return root, live, run.model.config


def same(a, b, path=""):
    """Exact equality of two loaded checkpoint objects (tensors: dtype, shape and bytes)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


def tag_files(root) -> list[str]:
    return [f for f in read_metadata(root, TAG)["files"] if f != names.METADATA_FILE]


def assert_same_checkpoint(a, b) -> None:
    assert tag_files(a) == tag_files(b)
    for rel in tag_files(a):
        same(load_file(a, TAG, rel), load_file(b, TAG, rel), rel)


def convert(src, dst, **target) -> None:
    convert_checkpoint(src, dst, Layout(**target))


def test_default_sub_group_sizes_are_zeros():
    for stage in (1, 2, 3):
        assert default_sizes(stage, None, None)[1] == DEFAULT_SUB_GROUP_SIZE[stage]


def test_same_layout_is_the_engines_own_save(source):
    root, _, _ = source
    with open_checkpoint(root / "ref") as ckpt:
        assert ckpt.layout == Layout(padded_vocab_size=128)
        files = files_for_rank(ckpt, ckpt.layout, 0, 0, 0)
    assert list(files) == tag_files(root / "ref")
    for rel, obj in files.items():
        same(load_file(root / "ref", TAG, rel), obj, rel)


def test_zero_files_load_into_an_engine_which_saves_them_back_unchanged(source):
    root, _, _ = source
    convert(root / "ref", root / "z1", zero_stage=1, sub_group_size=20000)
    engine = build("--zero-stage", 1, "--sub-group-size", 20000).engine
    engine.load_checkpoint(root / "z1", TAG)
    engine.save_checkpoint(root / "z1-again", TAG, {"iteration": 2, "consumed_train_samples": 4})
    # The Engine may also write DeepSpeed's zero_to_fp32 view of a one-rank ZeRO save (its
    # *_model_states.pt and each partition's "optimizer_state_dict"): not converted yet.
    converted, saved = tag_files(root / "z1"), tag_files(root / "z1-again")
    assert set(converted) <= set(saved)
    assert all(f.endswith("model_states.pt") for f in set(saved) - set(converted))
    for rel in converted:
        again = load_file(root / "z1-again", TAG, rel)
        again.pop("optimizer_state_dict", None)
        same(load_file(root / "z1", TAG, rel), again, rel)


def expected_shard(live, name, kind, t, tp, rows) -> torch.Tensor:
    """Rank t's shard of the live engine's tensor (0 weight, 1 master, 2/3 moments)."""
    full = live[WORD_EMBEDDING if name == TIED_COPY else name][kind]
    if name in (WORD_EMBEDDING, TIED_COPY):
        full = repad_vocab(full, VOCAB + 1, rows)
    dim = partition_dim(name)
    return full.chunk(tp, dim=dim)[t] if dim is not None and tp > 1 else full


def real_rank_module(cfg: GPTConfig, t: int, tp: int, p: int, pp: int, v: int, rows: int):
    """The module rank (t, p) builds: a GPT for TP rank t, cut into pipeline stage p."""
    cfg = GPTConfig(**{**cfg.to_dict(), "vocab_size": rows})
    group = Group("tp", tuple(range(tp)), t) if tp > 1 else Group.single("tp")
    model = GPT(cfg, tp_group=group).to(torch.bfloat16)
    return model if pp == 1 else StageModel(build_gpt_stages(model, p, pp, v))


LAYOUTS = [  # (tp, pp, virtual, dp, stage)
    (2, 2, 1, 1, 1),
    (1, 2, 2, 2, 1),
    (2, 1, 1, 3, 3),
    (2, 2, 2, 1, 0),
]


def check_whole_optimizer(module, saved: dict, live, t: int, tp: int, rows: int) -> None:
    """Stage 0: a MixedPrecisionOptimizer of the rank loads the converted state and saves it
    back unchanged; its masters and moments are the live engine's, parameter by parameter."""
    mixed = MixedPrecisionOptimizer(torch.optim.AdamW(get_param_groups(module, 0.01), lr=1e-3))
    mixed.load_state_dict(saved)
    same(mixed.state_dict(), saved)
    name_of = {id(p): n for n, p in module.named_parameters()}
    for p, m in zip(mixed.model_params, mixed.master_params):
        name = name_of[id(p)]
        st = mixed.optimizer.state[m]
        for kind, got in ((1, m), (2, st["exp_avg"]), (3, st["exp_avg_sq"])):
            assert torch.equal(got, expected_shard(live, name, kind, t, tp, rows)), name
        assert torch.equal(st["step"], live[WORD_EMBEDDING][4])


@pytest.mark.parametrize("tp,pp,v,dp,stage", LAYOUTS)
def test_every_rank_is_what_its_own_objects_save(source, tp, pp, v, dp, stage):
    root, live, cfg = source
    rows = 128 * tp
    with open_checkpoint(root / "ref") as ckpt:
        target = Layout(tp, pp, v, dp, stage, sub_group_size=3000)
        for t, p in target.mp_ranks():
            module = real_rank_module(cfg, t, tp, p, pp, v, rows)
            own = module.state_dict()
            for d in range(dp):
                files = files_for_rank(ckpt, target, t, p, d)
                if d == 0:
                    model_file = files[names.model_file(t, p, pp)]
                    weights = model_file["model"]
                    assert list(weights) == list(own)  # the module's own order
                    for k, w in weights.items():
                        assert w.shape == own[k].shape and w.dtype == own[k].dtype, k
                        assert torch.equal(w, expected_shard(live, k, 0, t, tp, rows)), k
                if stage == 0:
                    assert list(files) == [names.model_file(t, p, pp)]
                    check_whole_optimizer(module, model_file["optimizer"], live, t, tp, rows)
                    continue
                zero_state = files[names.zero_file(d, t, p)]
                opt = torch.optim.AdamW(get_param_groups(module, 0.01), lr=1e-3)
                group = Group("dp", tuple(range(dp)), d) if dp > 1 else Group.single("dp")
                zero = ZeroOptimizer(
                    module, opt, ZeroOptions(stage=stage, sub_group_size=3000), group=group
                )
                load_zero_state_dict(zero, zero_state)  # refuses another layout by name
                same(zero.state_dict(), zero_state)
                for info in zero.infos:  # each chunk against the live engine's tensors
                    sub = zero.sub_groups[info.sub_group].master
                    got = {1: sub, 2: zero.optimizer.state[sub]["exp_avg"]}
                    got[3] = zero.optimizer.state[sub]["exp_avg_sq"]
                    for kind, flat in got.items():
                        want = expected_shard(live, info.name, kind, t, tp, rows).reshape(-1)
                        piece = flat[info.offset : info.offset + info.length]
                        assert torch.equal(piece, want[info.start : info.start + info.length])
                    step = zero.optimizer.state[sub]["step"]
                    assert torch.equal(step, live[WORD_EMBEDDING][4])


@pytest.mark.parametrize(
    "a,b",
    [
        ({"tensor_parallel": 2, "pipeline_parallel": 2, "zero_stage": 1},
         {"data_parallel": 2, "zero_stage": 3}),
        ({"pipeline_parallel": 2, "virtual_stages": 2},
         {"tensor_parallel": 2, "data_parallel": 2, "zero_stage": 2}),
        ({"data_parallel": 2, "zero_stage": 2}, {"data_parallel": 4, "zero_stage": 1}),
    ],
)  # fmt: skip
def test_round_trip_gives_the_same_bytes(source, tmp_path, a, b):
    root, _, _ = source
    convert(root / "ref", tmp_path / "a", **a)
    convert(tmp_path / "a", tmp_path / "b", **b)
    convert(tmp_path / "b", tmp_path / "a2", **a)
    assert_same_checkpoint(tmp_path / "a", tmp_path / "a2")


def test_back_to_the_source_layout_gives_the_source(source, tmp_path):
    root, _, _ = source
    convert(root / "ref", tmp_path / "a", tensor_parallel=2, pipeline_parallel=2, zero_stage=1)
    convert(tmp_path / "a", tmp_path / "ref2")  # tp1 pp1 ZeRO-0 again
    assert_same_checkpoint(root / "ref", tmp_path / "ref2")


def test_memory_holds_one_full_tensor_at_a_time(source, tmp_path, monkeypatch):
    """Counting, not timing: while a target tensor is written no full source tensor is alive,
    and while one is cut no other is; the written tensors are bounded by the largest tensor."""
    root, _, _ = source
    alive: set[int] = set()
    peak = {"full": 0, "at_write": 0, "written": 0}
    read = CanonicalCheckpoint.tensor

    def counted(self, name, kind="weight"):
        out = read(self, name, kind)
        alive.add(id(out))
        weakref.finalize(out, alive.discard, id(out))
        peak["full"] = max(peak["full"], len(alive))
        return out

    def on_tensor(t):
        peak["at_write"] = max(peak["at_write"], len(alive))
        peak["written"] = max(peak["written"], t.numel() * t.element_size())

    monkeypatch.setattr(CanonicalCheckpoint, "tensor", counted)
    target = Layout(2, 2, 1, 1, 1, sub_group_size=3000)
    convert_checkpoint(root / "ref", tmp_path / "out", target, on_tensor=on_tensor)
    with open_checkpoint(root / "ref") as ckpt:
        largest = ckpt.largest_bytes  # the largest parameter in fp32 (source padding)
    assert peak["full"] == 1 and peak["at_write"] == 0
    # A written tensor is one parameter's shard or one sub-group's flat partition, which closes
    # before 3000 elements unless one chunk alone is larger.
    assert largest // 2 <= peak["written"] <= max(largest, 3000 * 4)


def test_command_flags_and_refusals(source, tmp_path, capsys):
    root, _, _ = source
    out = tmp_path / "cli"
    argv = ["--load", str(root / "ref"), "--save", str(out)]
    flags = ["--target-tensor-parallel-size", "2", "--target-zero-stage", "1"]
    assert convert_main([*argv, *flags, "--target-data-parallel-size", "2"]) == 0
    assert "tp2 pp1 dp2 ZeRO-1; weights and optimizer state" in capsys.readouterr().out
    meta = read_metadata(out, TAG)
    assert meta["layout"] == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                              "data_parallel_size": 2, "zero_stage": 1}  # fmt: skip
    # (no offload keys: the files do not depend on it, the run that loads them chooses)
    assert (
        meta["converted_from"]["padded_vocab_size"] == 128 and meta["vocab"]["padded_size"] == 256
    )
    with pytest.raises(ConfigError, match="do not divide evenly"):
        convert_main([*argv, "--target-pipeline-parallel-size", "3"])
    with pytest.raises(ConfigError, match="ZeRO stage 2 with pipeline"):
        convert_main([*argv, "--target-pipeline-parallel-size", "2", "--target-zero-stage", "2"])


def test_streamed_file_loads_safely_and_memory_mapped(tmp_path):
    a = torch.randn(3, 4)
    tree = {"x": Pending((3, 4), torch.float32, lambda: a.clone()), "y": [a[1], (0.9, 0.99)]}
    save_streaming(tree, tmp_path / "f.pt")
    for mmap in (False, True):
        got = torch.load(tmp_path / "f.pt", weights_only=True, mmap=mmap)
        same(got, {"x": a, "y": [a[1], (0.9, 0.99)]})
    bad = {"x": Pending((2,), torch.float32, lambda: torch.zeros(3))}
    with pytest.raises(CheckpointError, match="expected \\[2\\]"):
        save_streaming(bad, tmp_path / "g.pt")
