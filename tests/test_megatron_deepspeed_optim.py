"""Megatron-DeepSpeed's optimizer state carried by ``zerotron convert --from-megatron``.

Fixtures (tests/fixtures/megatron_deepspeed/, written by Megatron-DeepSpeed's own
``pretrain_gpt.py`` under DeepSpeed): ``pipe_tp2pp2`` (the pipeline engine, ZeRO stage 1, one
data-parallel rank, fp32), ``fpdt_nopipe_tp2dp2_zero2`` (``--no-pipeline-parallel`` at its last
commit, two data-parallel ranks, ZeRO stage 2, fp32) and ``fpdt_pipe_tp2pp2_bf16`` (the pipeline
engine at its last commit with ``--bf16``, ZeRO stage 0: DeepSpeed's bf16 optimizer's files).
fixtures.json records, per model-parallel rank and parameter, the sha256 of the fp32 master and
Adam moments as DeepSpeed's own ``safe_get_full_*`` returned them right after the save.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint.canonical import open_checkpoint
from zerotron.checkpoint.megatron import read_megatron
from zerotron.checkpoint.megatron_deepspeed_optim import optimizer_files, read_rank
from zerotron.checkpoint.megatron_import import import_megatron, read_megatron_optimizer
from zerotron.config import parse_megatron_args
from zerotron.errors import CheckpointError
from zerotron.training.pretrain import pretrain

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_deepspeed"
EXPECTED = json.loads((FIXTURES / "fixtures.json").read_text())
TAG = "global_step3"
ZERO_00 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
WITH_OPTIMIZER = ["pipe_tp2pp2", "fpdt_nopipe_tp2dp2_zero2", "fpdt_pipe_tp2pp2_bf16"]
KIND_OF = {"fp32": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
TRAIN = [
    *EXPECTED["model_flags"],
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95",
    "--mock-data", "--eval-iters", "0", "--log-interval", "1", "--seed", "1234",
    "--num-workers", "0",
]  # fmt: skip
RUN = [*TRAIN, "--lr-warmup-iters", "1", "--lr-decay-iters", "3"]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module", params=WITH_OPTIMIZER)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def imported(name, tmp_path_factory) -> Path:
    """The fixture converted by ``zerotron convert --from-megatron`` (its tag directory)."""
    return Path(import_megatron(FIXTURES / name, tmp_path_factory.mktemp(name))[0])


def test_each_ranks_state_is_what_deepspeed_had(name):
    """Every model-parallel rank's files, read back per parameter, give DeepSpeed's own full
    tensors byte for byte (the data-parallel slices joined, the padding dropped)."""
    recorded = EXPECTED["fixtures"][name]["optimizer_digests"]
    tp = 2
    files = optimizer_files(FIXTURES / name / TAG)
    assert len(files) == len(recorded)
    for entry in recorded:
        mp = entry["pipeline_rank"] * tp + entry["tensor_rank"]
        part = read_rank(FIXTURES / name / TAG, mp, files[mp])
        ours = {"master": part.masters, **part.moments}
        got = {
            param: {key: _digest(ours[kind][param]) for key, kind in KIND_OF.items()}
            for param in entry["params"]
        }
        assert got == entry["params"]


def test_the_merged_masters_are_the_weights(name):
    """An fp32 run's masters are its weights, a bf16 run's weights are its masters rounded to
    bf16 (DeepSpeed copies them after every step): merged over tensor ranks (and reordered,
    at the last commit, from its QKV block order) exactly as the weights are."""
    merged, _ = read_megatron_optimizer(FIXTURES / name)
    _, weights, _ = read_megatron(FIXTURES / name)
    assert set(merged["master"]) == set(weights)
    for key, weight in weights.items():
        assert merged["master"][key].dtype == torch.float32
        assert torch.equal(merged["master"][key].to(weight.dtype), weight), key
    if name.endswith("_bf16"):  # (so that the rounding above could hide nothing)
        assert all(w.dtype == torch.bfloat16 for w in weights.values())
        assert any(not torch.equal(merged["master"][k], w.float()) for k, w in weights.items())
    assert all((merged["exp_avg_sq"][k] >= 0).all() for k in weights)


def test_what_the_optimizer_files_say_of_the_run(name):
    _, found = read_megatron_optimizer(FIXTURES / name)
    stage, dp = {
        "pipe_tp2pp2": (1, 1),
        "fpdt_nopipe_tp2dp2_zero2": (2, 2),
        "fpdt_pipe_tp2pp2_bf16": (0, 1),  # DeepSpeed's bf16 optimizer, at ZeRO stage 0
    }[name]
    assert (found.zero_stage, found.data_parallel) == (stage, dp)
    assert float(found.step) == 3.0
    assert [g["weight_decay"] for g in found.param_groups] == [0.1, 0.0]


def test_the_conversion_holds_the_training_state(name, imported):
    merged, _ = read_megatron_optimizer(FIXTURES / name)
    meta = json.loads((imported / "metadata.json").read_text())
    assert meta["optimizer_states"] is True
    assert meta["converted_from"]["data_parallel_size"] == (2 if "dp2" in name else 1)
    with open_checkpoint(imported.parent) as ckpt:
        assert ckpt.tag == "iter_0000003" and ckpt.state_keys == ("exp_avg", "exp_avg_sq")
        for key in ckpt.names:
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ckpt.tensor(key, kind), merged[kind][key]), (key, kind)
            assert float(ckpt.step(key)) == 3.0
        assert ckpt.client_state() == {
            "iteration": 3,
            "consumed_train_samples": 12,
            "consumed_valid_samples": 0,
        }
        scheduler = ckpt.engine_entry("opt_param_scheduler")
        assert (scheduler["num_steps"], scheduler["max_lr"], scheduler["min_lr"]) == (
            12,
            1e-3,
            1e-4,
        )
        decayed = ckpt.group_settings(False)
        assert (decayed["betas"], decayed["eps"], decayed["weight_decay"]) == (
            (0.9, 0.95),
            1e-8,
            0.1,
        )
        assert ckpt.group_settings(True)["weight_decay"] == 0.0


def test_pretrain_goes_on_from_the_conversion_with_its_optimizer(tmp_path):
    """The converted checkpoint resumes as a zerotron one: iteration 3 and 12 samples on, and
    the engine's Adam state after the load is the imported one."""
    from zerotron.training.build import build_run
    from zerotron.training.load import resume
    from zerotron.training.loop import TrainState

    load = Path(import_megatron(FIXTURES / "pipe_tp2pp2", tmp_path / "ckpt")[0]).parent
    run = build_run(parse_megatron_args([*RUN, "--train-iters", "5", "--load", str(load)]))
    state = TrainState()
    resume(run, state)
    assert (state.iteration, state.consumed_train_samples) == (3, 12)
    merged, _ = read_megatron_optimizer(FIXTURES / "pipe_tp2pp2")
    opt = run.engine.optimizer
    while not isinstance(opt, torch.optim.AdamW):  # the wrappers around torch's AdamW
        opt = opt.optimizer
    for key, master in run.model.named_parameters():  # fp32: the parameters are the masters
        assert torch.equal(opt.state[master]["exp_avg"], merged["exp_avg"][key]), key
        assert torch.equal(opt.state[master]["exp_avg_sq"], merged["exp_avg_sq"][key]), key
        assert float(opt.state[master]["step"]) == 3.0
    summary = pretrain(parse_megatron_args([*RUN, "--train-iters", "5", "--load", str(load)]))
    assert sorted(summary.losses) == [4, 5]
    assert summary.state.consumed_train_samples == 12 + 2 * 4


@pytest.mark.parametrize("name", ["pipe_tp2pp2", "fpdt_pipe_tp2pp2_bf16"])
def test_pretrain_goes_on_from_the_checkpoint_itself_as_from_its_conversion(name, tmp_path):
    """``--load`` on Megatron-DeepSpeed's own directory takes its training state as the
    conversion does: the same losses, bit for bit, from iteration 3 on."""
    load = Path(import_megatron(FIXTURES / name, tmp_path / "ckpt")[0]).parent
    bf16 = ["--bf16"] if name.endswith("_bf16") else []
    argv = [*RUN, *bf16, "--train-iters", "5", "--load"]
    direct = pretrain(parse_megatron_args([*argv, str(FIXTURES / name)]))
    assert sorted(direct.losses) == [4, 5]
    assert direct.state.consumed_train_samples == 12 + 2 * 4
    assert direct.losses == pretrain(parse_megatron_args([*argv, str(load)])).losses


def test_a_stage_0_fp32_run_converts_its_weights_only(tmp_path):
    path, info = import_megatron(FIXTURES / "nopipe_tp2", tmp_path / "ckpt")
    assert info["optimizer"] is False
    assert json.loads((Path(path) / "metadata.json").read_text()).get("optimizer_states") is None


def test_a_missing_data_parallel_file_is_refused(tmp_path):
    copy = shutil.copytree(FIXTURES / "fpdt_nopipe_tp2dp2_zero2", tmp_path / "ckpt")
    (copy / TAG / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="say 2 data-parallel ranks, 1 are present"):
        read_megatron_optimizer(copy)


def test_a_token_based_schedule_is_carried_in_samples(tmp_path):
    """Megatron-DeepSpeed's --lr-decay-tokens / --lr-warmup-tokens positions become samples as
    zerotron's config makes them of the same flags (tokens / seq_length)."""
    from zerotron.checkpoint import megatron_io

    copy = shutil.copytree(FIXTURES / "pipe_tp2pp2", tmp_path / "ckpt")
    file = copy / TAG / "mp_rank_00_model_states.pt"
    loaded = megatron_io.load_safe(file)
    loaded["lr_scheduler"].update(lr_decay_tokens=1000, lr_warmup_tokens=40)
    torch.save(loaded, file)
    out = Path(import_megatron(copy, tmp_path / "out")[0])
    with open_checkpoint(out.parent) as ckpt:
        scheduler = ckpt.engine_entry("opt_param_scheduler")
    cfg = parse_megatron_args([*TRAIN, "--train-iters", "5", "--lr-decay-tokens", "1000",
                               "--lr-warmup-tokens", "40"])  # fmt: skip
    assert (scheduler["lr_decay_steps"], scheduler["lr_warmup_steps"]) == (1000 / 16, 40 / 16)
    assert (cfg.lr_decay_steps, cfg.lr_warmup_steps) == (1000 / 16, 40 / 16)


def test_checkpoint_info_says_which_carry_their_optimizer():
    from zerotron.checkpoint.info import checkpoint_info, format_info

    found = {n: checkpoint_info(FIXTURES / n) for n in ("pipe_tp2pp2", "nopipe_tp2")}
    assert {n: i["optimizer_partitions"] for n, i in found.items()} == {
        "pipe_tp2pp2": True,
        "nopipe_tp2": False,
    }
    assert "`zerotron convert --from-megatron` carry" in format_info(found["pipe_tp2pp2"])


def test_convert_lays_the_import_out_as_the_target_flags_say(tmp_path):
    """``--target-*`` with ``--from-megatron``: the training state written for tp2 dp2 ZeRO-1,
    holding the same tensors as the one-process import."""
    from zerotron.checkpoint.convert import main as convert_main

    argv = ["--from-megatron", str(FIXTURES / "pipe_tp2pp2"), "--save", str(tmp_path / "out"),
            "--target-tensor-parallel-size", "2", "--target-data-parallel-size", "2",
            "--target-zero-stage", "1"]  # fmt: skip
    assert convert_main(argv) == 0
    merged, _ = read_megatron_optimizer(FIXTURES / "pipe_tp2pp2")
    with open_checkpoint(tmp_path / "out") as ckpt:
        lay = ckpt.layout
        assert (lay.tensor_parallel, lay.data_parallel, lay.zero_stage) == (2, 2, 1)
        for key in ckpt.names:
            assert torch.equal(ckpt.tensor(key, "exp_avg_sq"), merged["exp_avg_sq"][key]), key
            assert torch.equal(ckpt.tensor(key, "master"), merged["master"][key]), key


# ---- back out to Megatron-DeepSpeed, training state included --------------------------------


def _export_state(tmp_path: Path, name: str, qkv: str, pp: int, dp: int, stage: int) -> Path:
    from zerotron.checkpoint.megatron_export import export_megatron

    ours = Path(import_megatron(FIXTURES / name, tmp_path / "imported")[0]).parent
    return export_megatron(ours, tmp_path / "out", "megatron-deepspeed", 2, pp, qkv_order=qkv,
                           zero_stage=stage, data_parallel=dp)  # fmt: skip


@pytest.mark.parametrize(
    "name, qkv, pp, dp, stage",
    [("pipe_tp2pp2", "per-head", 2, 1, 1), ("fpdt_nopipe_tp2dp2_zero2", "blocks", 1, 2, 2)],
)
def test_an_export_with_its_training_state_holds_deepspeeds_own_optimizer_files(
    tmp_path, name, qkv, pp, dp, stage
):
    """Imported and exported at its own layout, each optimizer file holds the fp32 slices and
    moments DeepSpeed wrote, element for element (DeepSpeed's rigid form there, its elastic form
    here), and each model-states file the same parameter shapes. One exception, by design:
    the last pipeline stage's copy of the position embeddings, which GPTModelPipe ties along
    with the word embeddings but never uses there (no gradient reaches it, so DeepSpeed's copy
    drifts under weight decay alone); the export writes the first stage's."""
    from zerotron.checkpoint.deepspeed_format import load_deepspeed_file
    from zerotron.checkpoint.megatron_io import load_safe

    out, theirs = _export_state(tmp_path, name, qkv, pp, dp, stage), FIXTURES / name / TAG
    files = sorted(f.name for f in theirs.glob("zero_pp_rank_*"))
    assert sorted(f.name for f in out.glob("zero_pp_rank_*")) == files
    for file in files:
        a = load_deepspeed_file(theirs / file)["optimizer_state_dict"]
        b = load_deepspeed_file(out / file)["optimizer_state_dict"]
        unused = slice(0, 0)
        if pp > 1 and int(file.split("mp_rank_")[1][:2]) // 2 == pp - 1:  # the last stage's
            where = a["param_slice_mappings"][0]["tied_modules.embed.position_embeddings.weight"]
            unused = slice(where.start, where.start + where.numel)
        fp32 = "single_partition_of_fp32_groups"
        for i, (x, y) in enumerate(zip(a[fp32], b[fp32], strict=True)):
            pairs = [(x, y)] + [
                (a["base_optimizer_state"]["state"][i][k], b["base_optimizer_state"][i][k])
                for k in ("exp_avg", "exp_avg_sq")
            ]
            for theirs_t, ours_t in pairs:
                keep = torch.ones(theirs_t.numel(), dtype=torch.bool)
                if i == 0:
                    keep[unused] = False
                assert torch.equal(theirs_t[keep], ours_t[keep]), (file, i)
        assert b["partition_count"] == [dp, dp] and b["base_optimizer_state_step"] == 3
    for file in sorted(f.name for f in theirs.glob("mp_rank_*")):
        a, b = load_safe(theirs / file), load_safe(out / file)
        assert [list(g.values()) for g in a["param_shapes"]] == [
            list(g.values()) for g in b["param_shapes"]
        ]
        assert b["dp_world_size"] == dp and b["args"].consumed_train_samples == 12


def test_zerotron_reads_its_export_back(tmp_path):
    out = _export_state(tmp_path, "pipe_tp2pp2", "per-head", 2, 1, 1)
    back, _ = read_megatron_optimizer(out.parent)
    first, _ = read_megatron_optimizer(FIXTURES / "pipe_tp2pp2")
    for kind, state in first.items():
        assert set(back[kind]) == set(state)
        assert all(torch.equal(back[kind][k], v) for k, v in state.items()), kind


def test_an_export_of_the_training_state_is_refused_where_it_cannot_be_written(tmp_path):
    from zerotron.checkpoint.convert import main as convert_main
    from zerotron.checkpoint.megatron_export import export_megatron
    from zerotron.errors import ConfigError

    weights_only = Path(import_megatron(FIXTURES / "nopipe_tp2", tmp_path / "w")[0]).parent
    with pytest.raises(CheckpointError, match="no Adam state to export"):
        export_megatron(weights_only, tmp_path / "o1", "megatron-deepspeed", 2, 1,
                        qkv_order="per-head", zero_stage=1)  # fmt: skip
    base = ["--load", str(weights_only), "--to-megatron", str(tmp_path / "o2")]
    with pytest.raises(ConfigError, match="ZeRO stage 1 or 2 only"):
        convert_main([*base, "--megatron-format", "mcore", "--target-zero-stage", "1"])
    with pytest.raises(ConfigError, match="does not apply to --to-megatron"):
        convert_main([*base, "--megatron-format", "mcore", "--target-data-parallel-size", "2"])


def test_adams_step_kept_per_param_group_is_read(tmp_path):
    """apex's FusedAdam, Megatron-DeepSpeed's optimizer on GPUs, keeps the step in each param
    group, not per parameter: the conversion takes it from there."""
    from zerotron.checkpoint.deepspeed_format import SAFE_GLOBALS

    copy = shutil.copytree(FIXTURES / "pipe_tp2pp2", tmp_path / "apex")
    for file in (copy / TAG).glob("zero_pp_rank_*"):
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            saved = torch.load(file, weights_only=True)
        osd = saved["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        for entry, group in zip(base["state"].values(), base["param_groups"], strict=True):
            group["step"] = int(entry.pop("step"))
        # (DeepSpeed's classes came in as zerotron's stand-ins: not saved back)
        del osd["loss_scaler"], osd["param_slice_mappings"]
        osd["zero_stage"] = int(osd["zero_stage"])
        torch.save(saved, file)
    _, found = read_megatron_optimizer(copy)
    assert found.step == 3
    with open_checkpoint(Path(import_megatron(copy, tmp_path / "out")[0]).parent) as ckpt:
        assert all(torch.equal(ckpt.step(k), torch.tensor(3.0)) for k in ckpt.names)


def test_megatron_deepspeed_went_on_from_the_export_as_from_its_own_checkpoint():
    """Recorded by the fixture script: Megatron-DeepSpeed loaded the pipeline fixture's import
    exported with its training state (no --finetune) and trained its fourth iteration with the
    loss it has going on from its own checkpoint; right after the two loads DeepSpeed saw the
    same optimizer state everywhere but in the last stage's unused copy of the position
    embeddings (see the test above)."""
    record = EXPECTED["training_state_export_continued_by_megatron_deepspeed"]
    assert record["loss_4_from_the_export"] == record["loss_4_from_its_own_checkpoint"]
    unused = "tied_modules.embed.position_embeddings.weight"
    assert record["optimizer_state_seen_differently"] == sorted(
        f"pipeline 1 tensor {t}: {unused} {kind}"
        for t in (0, 1)
        for kind in ("exp_avg", "exp_avg_sq", "fp32")
    )


def test_an_export_pads_each_group_inside_its_last_slice(tmp_path):
    """With padding (groups that do not split into 2 x dp evenly: dp 3 here), every
    data-parallel rank's slice has DeepSpeed's partition size, with the padding zeros inside the
    last one and group_paddings 0 (DeepSpeed's loader would pad Adam's step too), and zerotron
    reads the files back to the same tensors."""
    from zerotron.checkpoint.deepspeed_format import load_deepspeed_file

    out = _export_state(tmp_path, "pipe_tp2pp2", "per-head", 2, 3, 1)
    theirs = load_deepspeed_file(FIXTURES / "pipe_tp2pp2" / TAG / ZERO_00)["optimizer_state_dict"]
    osds = [load_deepspeed_file(f)["optimizer_state_dict"]
            for f in sorted(out.glob("zero_pp_rank_*_mp_rank_00_*"))]  # fmt: skip
    assert len(osds) == 3 and all(o["group_paddings"] == [0, 0] for o in osds)
    for group, whole in enumerate(theirs["single_partition_of_fp32_groups"]):
        slices = [o["single_partition_of_fp32_groups"][group] for o in osds]
        padded = -(-whole.numel() // 6) * 6
        assert [s.numel() for s in slices] == [padded // 3] * 3 and padded > whole.numel()
        joined = torch.cat(slices)
        assert torch.equal(joined[: whole.numel()], whole)
        assert torch.count_nonzero(joined[whole.numel() :]) == 0
    back, _ = read_megatron_optimizer(out.parent)
    first, _ = read_megatron_optimizer(FIXTURES / "pipe_tp2pp2")
    assert all(torch.equal(back["exp_avg"][k], v) for k, v in first["exp_avg"].items())


def test_a_bf16_export_names_its_files_as_a_bf16_run_looks_for_them(tmp_path):
    out = _export_state(tmp_path, "fpdt_pipe_tp2pp2_bf16", "blocks", 2, 1, 1)
    assert sorted(f.name for f in out.glob("*optim_states.pt")) == [
        f"bf16_zero_pp_rank_0_mp_rank_{m:02d}_optim_states.pt" for m in range(4)
    ]
    back, _ = read_megatron_optimizer(out.parent)
    first, _ = read_megatron_optimizer(FIXTURES / "fpdt_pipe_tp2pp2_bf16")
    assert all(torch.equal(back["master"][k], v) for k, v in first["master"].items())


def test_an_export_without_a_schedule_or_with_zero_2_pipelines_is_refused(tmp_path, monkeypatch):
    from zerotron.checkpoint.canonical import CanonicalCheckpoint
    from zerotron.errors import ConfigError

    with pytest.raises(ConfigError, match="pipeline engine runs ZeRO stage 0 or 1"):
        _export_state(tmp_path / "a", "pipe_tp2pp2", "per-head", 2, 1, 2)
    entry = CanonicalCheckpoint.engine_entry
    monkeypatch.setattr(
        CanonicalCheckpoint,
        "engine_entry",
        lambda self, key, default=None: (
            None if key == "opt_param_scheduler" else entry(self, key, default)
        ),
    )
    with pytest.raises(CheckpointError, match="no learning-rate schedule"):
        _export_state(tmp_path / "b", "pipe_tp2pp2", "per-head", 2, 1, 1)
