"""DeepSpeed's universal checkpoints in, without DeepSpeed installed.

The fixtures are ``tests/fixtures/deepspeed_ckpt/<case>/global_step3_universal`` (with
``latest_universal``): DeepSpeed 0.19.8's own ``ds_to_universal.py`` converted the ZeRO-2 fp32,
ZeRO-3 fp32, ZeRO-2 bf16 and ZeRO-2 fp16 checkpoints beside them, and DeepSpeed loaded each
with ``"checkpoint": {"load_universal": true}`` and trained 3 more steps on two ranks
(``universal_losses.json``; ``make_deepspeed_checkpoints.py --part universal``).

- zerotron's compat engine, with the same config, loads each and continues with DeepSpeed's
  losses (fp16: and its loss scales), also into another ZeRO stage and on one rank instead of two;
- a universal checkpoint holds exactly the masters, moments and step of the ZeRO checkpoint it
  was converted from;
- the refusals: the flag and the checkpoint must agree, and slicing metadata of tensor- or
  expert-parallel runs, missing or mismatched files are named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.spawn import run_ranks
from tests.fixtures.deepspeed_ckpt import tiny
from tests.test_deepspeed_checkpoint import BF16_RTOL, FP16_RTOL, FP32_RTOL
from zerotron.checkpoint.deepspeed_format import read_deepspeed_checkpoint
from zerotron.checkpoint.deepspeed_universal import read_universal_checkpoint
from zerotron.engine.deepspeed_checkpoint import deepspeed_tag_dir
from zerotron.errors import CheckpointError

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"
GROUP = pytest.mark.xdist_group("deepspeed_universal")  # one spawn for the tests that read it
RTOL = {"fp32": FP32_RTOL, "bf16": BF16_RTOL, "fp16": FP16_RTOL}
ZERO = f"global_step{tiny.SAVE_STEP}"  # the ZeRO checkpoint each universal one came from
# a universal checkpoint -> a zerotron engine of another ZeRO stage (two ranks)
CROSS = {
    "zero2_fp32_into_zero3": ("zero2_fp32", 3),
    "zero3_fp32_into_zero1": ("zero3_fp32", 1),
    "zero2_bf16_into_zero3": ("zero2_bf16", 3),
}


def _engine(stage: int, precision: str, gas: int = 1) -> Any:
    import zerotron as deepspeed  # DeepSpeed's API, zerotron's engine

    config = tiny.config(stage, precision, universal=True)
    config["gradient_accumulation_steps"] = gas
    model = tiny.build_model()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _continue(engine: Any, ranks: list[int]) -> tuple[list[list[float]], list[float]]:
    """Train on from the save: one micro-batch of each DeepSpeed rank in ``ranks`` per step;
    each one's losses, and the loss scale after each step."""
    losses: list[list[float]] = [[] for _ in ranks]
    scales = []
    for step in range(tiny.SAVE_STEP, tiny.TOTAL_STEPS):
        for i, rank in enumerate(ranks):
            x, y = tiny.batch(step, rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[i].append(float(loss.item()))
        scales.append(float(engine.cur_scale))
    return losses, scales


def _load_and_continue(rank: int, world: int, stage: int, precision: str, src: str) -> dict:
    # one rank stands for DeepSpeed's two: their micro-batches one after the other
    ranks = [rank] if world == tiny.DP else list(range(tiny.DP))
    engine = _engine(stage, precision, gas=len(ranks))
    path, _ = engine.load_checkpoint(str(FIXTURES / src))  # the tag latest_universal names
    losses, scales = _continue(engine, ranks)
    return {"path": path, "global_steps": engine.global_steps, "losses": losses, "scales": scales}


def _two_ranks(rank: int) -> dict[str, Any]:
    cases = {c: (c, tiny.CASES[c][0]) for c in tiny.UNIVERSAL_CASES} | CROSS
    return {
        name: _load_and_continue(rank, tiny.DP, stage, tiny.CASES[src][1], src)
        for name, (src, stage) in cases.items()
    }


def _one_rank(rank: int) -> dict[str, Any]:
    return {"zero3_fp32_into_zero2": _load_and_continue(rank, 1, 2, "fp32", "zero3_fp32")}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_ranks, tiny.DP, timeout=300)


def _recorded(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "universal_losses.json").read_text())


def _assert_continues(got: list[list[float]], case: str) -> None:
    want = _recorded(case)["continued"]
    rtol = RTOL[tiny.CASES[case][1]]
    for rank in range(tiny.DP):
        assert got[rank] == pytest.approx(want[rank], rel=rtol, abs=0), (case, rank)


# ---- zerotron continues DeepSpeed's run ---------------------------------------------------------


@GROUP
@pytest.mark.parametrize("case", tiny.UNIVERSAL_CASES)
def test_universal_checkpoint_continues_with_deepspeeds_losses(two_ranks, case):
    _assert_continues([two_ranks[r][case]["losses"][0] for r in range(tiny.DP)], case)


@GROUP
@pytest.mark.parametrize("name", sorted(CROSS))
def test_universal_checkpoint_continues_on_another_zero_stage(two_ranks, name):
    _assert_continues([two_ranks[r][name]["losses"][0] for r in range(tiny.DP)], CROSS[name][0])


def test_universal_checkpoint_continues_on_one_rank():
    # DeepSpeed's two ranks' micro-batches accumulated on one rank: the same steps
    got = run_ranks(_one_rank, 1, timeout=300)[0]["zero3_fp32_into_zero2"]
    _assert_continues(got["losses"], "zero3_fp32")


@GROUP
def test_fp16_universal_checkpoint_continues_with_deepspeeds_loss_scale(two_ranks):
    want = _recorded("zero2_fp16")["continued_loss_scales"]
    for rank in range(tiny.DP):
        assert two_ranks[rank]["zero2_fp16"]["scales"] == want, rank


@GROUP
def test_universal_load_restores_the_step_counters_and_names_the_tag(two_ranks):
    for case in tiny.UNIVERSAL_CASES:
        got = two_ranks[0][case]
        assert got["path"] == str(FIXTURES / case / tiny.UNIVERSAL_TAG)
        assert got["global_steps"] == _recorded(case)["global_steps"] == tiny.TOTAL_STEPS


def test_deepspeeds_universal_continuation_is_its_zero_continuation():
    # the reference: DeepSpeed's continuation from the universal checkpoint is the one from the
    # ZeRO checkpoint. fp32: one loss of the two is one fp32 ulp apart (9.7e-8 relative), because
    # losses.json was recorded on another CPU; on the one that recorded universal_losses.json,
    # DeepSpeed's ZeRO continuation gave the universal one's losses bit for bit.
    for case in tiny.UNIVERSAL_CASES:
        zero = json.loads((FIXTURES / case / "losses.json").read_text())
        for rank in range(tiny.DP):
            got = _recorded(case)["continued"][rank]
            assert got == pytest.approx(zero["continued"][rank], rel=2e-7, abs=0), case
        if "continued_loss_scales" in zero:
            assert _recorded(case)["continued_loss_scales"] == zero["continued_loss_scales"]


# ---- the files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", tiny.UNIVERSAL_CASES)
def test_universal_checkpoint_holds_the_zero_checkpoints_state(case):
    universal = read_universal_checkpoint(FIXTURES / case / tiny.UNIVERSAL_TAG)
    zero = read_deepspeed_checkpoint(FIXTURES / case / ZERO)
    assert (universal.zero_stage, universal.dp_size) == (zero.zero_stage, zero.dp_size)
    for name, master in zero.masters.items():
        assert torch.equal(universal.masters[name], master), name
    assert universal.masters.keys() == zero.masters.keys()
    assert universal.moments.keys() == zero.moments.keys() == {"exp_avg", "exp_avg_sq"}
    for key, per_name in zero.moments.items():
        for name, moment in per_name.items():
            assert torch.equal(universal.moments[key][name], moment), (key, name)
    assert universal.scalars.keys() == zero.scalars.keys() == {"step"}
    assert torch.equal(universal.scalars["step"], zero.scalars["step"])
    assert universal.param_groups == zero.param_groups
    assert universal.loss_scaler == zero.loss_scaler
    for name, weight in zero.module.items():  # weights (from the masters) and buffers
        assert weight.dtype == universal.module[name].dtype, name
        assert torch.equal(universal.module[name], weight), name
    assert universal.client_state == zero.client_state == {}


def test_weights_alone_read_no_optimizer_state():
    ckpt = read_universal_checkpoint(FIXTURES / "zero3_fp32" / tiny.UNIVERSAL_TAG, optimizer=False)
    assert len(ckpt.masters) == 4 and not ckpt.moments and not ckpt.scalars


# ---- which tag: the flag and the files agree ---------------------------------------------------


def test_the_flag_picks_the_tag_latest_universal_names():
    src = FIXTURES / "zero2_fp32"
    assert deepspeed_tag_dir(src, None, universal=True) == src / tiny.UNIVERSAL_TAG
    assert deepspeed_tag_dir(src, tiny.UNIVERSAL_TAG, universal=True) == src / tiny.UNIVERSAL_TAG
    assert deepspeed_tag_dir(src, None, universal=False) == src / ZERO


def test_a_universal_checkpoint_without_the_flag_is_refused():
    with pytest.raises(CheckpointError, match="load_universal") as err:
        deepspeed_tag_dir(FIXTURES / "zero2_fp32", tiny.UNIVERSAL_TAG, universal=False)
    assert str(FIXTURES / "zero2_fp32" / tiny.UNIVERSAL_TAG) in str(err.value)


def test_the_flag_with_a_checkpoint_that_is_not_universal_is_refused():
    with pytest.raises(CheckpointError, match="no universal checkpoint") as err:
        deepspeed_tag_dir(FIXTURES / "zero2_fp32", ZERO, universal=True)
    assert "ds_to_universal.py" in str(err.value)


def test_the_flag_without_latest_universal_is_refused(tmp_path):
    (tmp_path / "latest").write_text(ZERO)  # a ZeRO checkpoint's tracker is not enough
    with pytest.raises(CheckpointError, match="no 'latest_universal' file"):
        deepspeed_tag_dir(tmp_path, None, universal=True)


def test_the_deepspeed_key_is_read_into_the_config():
    from zerotron.config import load_deepspeed_config

    on, _ = load_deepspeed_config(tiny.config(2, "fp32", universal=True))
    off, _ = load_deepspeed_config(tiny.config(2, "fp32"))
    assert (on.checkpoint.load_universal, off.checkpoint.load_universal) == (True, False)


def test_zerotron_pretrain_refuses_load_universal(tmp_path):
    # pretrain's --load reads 'latest' only: the key would otherwise start a run afresh
    from zerotron.config import parse_megatron_args
    from zerotron.errors import UnsupportedError

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"checkpoint": {"load_universal": True}}))
    flags = "--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
    flags += f"--micro-batch-size 1 --train-iters 2 --lr 1e-3 --deepspeed_config {ds}"
    with pytest.raises(UnsupportedError, match="checkpoint.load_universal"):
        parse_megatron_args(flags.split())


# ---- what is refused in the files --------------------------------------------------------------


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / tiny.UNIVERSAL_TAG
    shutil.copytree(FIXTURES / case / tiny.UNIVERSAL_TAG, dst)
    return dst


def test_tensor_parallel_slicing_metadata_is_refused(tmp_path):
    tag_dir = _copy("zero2_fp32", tmp_path)
    path = tag_dir / "zero" / "fc2.weight" / "fp32.pt"
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "vocab_tensor": True}, path)
    with pytest.raises(CheckpointError, match=r"slicing metadata \['vocab_tensor'\]") as err:
        read_universal_checkpoint(tag_dir)
    assert str(path) in str(err.value)


def test_a_checkpoint_of_several_model_parallel_ranks_is_refused(tmp_path):
    tag_dir = _copy("zero2_fp32", tmp_path)
    path = tag_dir / "mp_rank_00_model_states.pt"
    model = torch.load(path, weights_only=True)
    torch.save({**model, "mp_world_size": 2}, path)
    with pytest.raises(CheckpointError, match="model parallel size 2"):
        read_universal_checkpoint(tag_dir)


def test_a_pipeline_checkpoint_is_refused(tmp_path):
    # DeepSpeed's pipeline checkpoints keep the weights in layer files: 'module' is None
    tag_dir = _copy("zero2_fp32", tmp_path)
    path = tag_dir / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(path, weights_only=True), "module": None}, path)
    with pytest.raises(CheckpointError, match="no module state dict"):
        read_universal_checkpoint(tag_dir)


def test_a_parameter_without_its_moment_is_named(tmp_path):
    tag_dir = _copy("zero3_fp32", tmp_path)
    (tag_dir / "zero" / "fc2.bias" / "exp_avg_sq.pt").unlink()
    with pytest.raises(CheckpointError, match=r"'fc2.bias' has optimizer states \['exp_avg'\]"):
        read_universal_checkpoint(tag_dir)


def test_a_missing_master_is_named(tmp_path):
    tag_dir = _copy("zero2_bf16", tmp_path)
    path = tag_dir / "zero" / "fc1.bias" / "fp32.pt"
    path.unlink()
    with pytest.raises(CheckpointError, match="file missing") as err:
        read_universal_checkpoint(tag_dir, optimizer=False)
    assert str(path) in str(err.value)


def test_a_tensor_of_another_size_is_refused(tmp_path):
    tag_dir = _copy("zero3_fp32", tmp_path)
    path = tag_dir / "zero" / "fc2.bias" / "exp_avg.pt"
    torch.save(torch.zeros(8), path)
    with pytest.raises(CheckpointError, match=r"8 elements; .* shape \[7\]"):
        read_universal_checkpoint(tag_dir)


def test_parameters_with_different_steps_are_refused(tmp_path):
    tag_dir = _copy("zero2_fp32", tmp_path)
    torch.save(torch.tensor(4.0), tag_dir / "zero" / "fc2.weight" / "step.pt")
    with pytest.raises(CheckpointError, match="Adam's step is 4.0 here and 3.0"):
        read_universal_checkpoint(tag_dir)
