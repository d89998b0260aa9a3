"""Real DeepSpeed checkpoints in and out (issue 14, item 4), without DeepSpeed installed.

The fixtures under tests/fixtures/deepspeed_ckpt/ were written by DeepSpeed 0.19.8 itself
(``make_deepspeed_checkpoints.py``, which also records DeepSpeed's own losses after loading
them, and what DeepSpeed's ``zero_to_fp32`` returned for checkpoints zerotron saved):

- zerotron's compat engine (``import zerotron as deepspeed``) loads each DeepSpeed checkpoint
  (ZeRO 1, 2, 3 fp32, ZeRO 2 bf16, ZeRO 2 and 3 fp16; two data-parallel ranks) and continues
  with DeepSpeed's losses (and in fp16 its loss scales);
- zerotron's ZeRO saves (stages 1-3, two ranks) hold what DeepSpeed's ``zero_to_fp32`` reads,
  and it reads the weights zerotron saved (the recorded hashes);
- loading is ``weights_only`` with an allow-list: another type is refused, naming it.

One two-rank run (module-scoped) loads every fixture and saves every stage.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.spawn import run_ranks
from tests.fixtures.deepspeed_ckpt import tiny
from zerotron.checkpoint.deepspeed_format import (
    SAFE_GLOBALS,
    load_deepspeed_file,
    read_deepspeed_checkpoint,
)
from zerotron.errors import CheckpointError

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"
GROUP = pytest.mark.xdist_group("deepspeed_ckpt")  # one spawn for the tests that read it
FP32_RTOL = 1e-5
# bf16: measured equal here (both engines run the same bf16 ops on the same CPU), but the
# fixture's losses were recorded on one CPU and bf16 matmul kernels differ between CPUs (oneDNN
# AMX, AVX512-BF16, plain): one bf16 ulp (2**-8) flipped in one of the 28 outputs moves the mean
# squared error by about 3e-4 relative. 1e-3 allows a few such flips and still fails a load that
# drops the Adam moments (7.8e-3 relative on the first step after the load).
BF16_RTOL = 1e-3
# fp16: on a step where the loss scale grows, DeepSpeed's ZeRO step updates the scale before it
# unscales, so it divides that step's gradients by the new scale (twice the one backward used;
# zerotron divides by the one backward used). From the same start the runs then part by up to
# 1.8e-3 relative within 6 steps; after the load they agree within 1.7e-4 over the 3 steps,
# where a load without the Adam moments is off by up to 7.4e-3.
FP16_RTOL = 1e-3
# DeepSpeed's checkpoint -> zerotron at another stage (and precision)
CROSS = {
    "zero2_fp32_into_zero3": ("zero2_fp32", 3, "fp32"),
    "zero3_fp16_into_zero1": ("zero3_fp16", 1, "fp16"),
}


def _train(engine: Any, steps: range, rank: int, scales: list | None = None) -> list[float]:
    losses = []
    for step in steps:
        x, y = tiny.batch(step, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()))
        if scales is not None:
            scales.append(float(engine.cur_scale))
    return losses


def _engine(stage: int, precision: str) -> Any:
    import zerotron as deepspeed  # DeepSpeed's API, zerotron's engine

    model = tiny.build_model()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=tiny.config(stage, precision)
    )
    return engine


def _two_ranks(rank: int, save_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {c: (c, s, p) for c, (s, p) in tiny.CASES.items()}
    cases.update({name: (src, stage, prec) for name, (src, stage, prec) in CROSS.items()})
    for name, (src, stage, precision) in cases.items():
        engine = _engine(stage, precision)
        path, client = engine.load_checkpoint(str(FIXTURES / src))
        scales: list[float] = []
        out[name] = {
            "path": path,
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "losses": _train(engine, range(tiny.SAVE_STEP, tiny.TOTAL_STEPS), rank, scales),
            "loss_scales": scales,
        }
    for stage in tiny.SAVE_STAGES:
        _engine(stage, "fp32").save_checkpoint(f"{save_root}/zero{stage}", tag="global_step0")
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("zerotron_saves")
    return run_ranks(_two_ranks, tiny.DP, str(root), timeout=300), root


def _recorded(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "losses.json").read_text())


# ---- DeepSpeed's checkpoints in --------------------------------------------------------------


@GROUP
@pytest.mark.parametrize("case", [c for c, (_, p) in tiny.CASES.items() if p == "fp32"])
def test_fp32_continues_with_deepspeeds_losses(two_ranks, case):
    results, _ = two_ranks
    want = _recorded(case)["continued"]
    for rank in range(tiny.DP):
        got = results[rank][case]["losses"]
        assert got == pytest.approx(want[rank], rel=FP32_RTOL, abs=0), (case, rank)


@GROUP
def test_bf16_continues_with_deepspeeds_losses(two_ranks):
    results, _ = two_ranks
    want = _recorded("zero2_bf16")["continued"]
    for rank in range(tiny.DP):
        got = results[rank]["zero2_bf16"]["losses"]
        assert got == pytest.approx(want[rank], rel=BF16_RTOL, abs=0), rank


@GROUP
@pytest.mark.parametrize("case", ["zero2_fp16", "zero3_fp16"])
def test_fp16_continues_with_deepspeeds_losses(two_ranks, case):
    results, _ = two_ranks
    want = _recorded(case)["continued"]
    for rank in range(tiny.DP):
        got = results[rank][case]["losses"]
        assert got == pytest.approx(want[rank], rel=FP16_RTOL, abs=0), (case, rank)


@GROUP
@pytest.mark.parametrize(
    "case,source", [("zero2_fp16", "zero2_fp16"), ("zero3_fp16_into_zero1", "zero3_fp16")]
)
def test_fp16_continues_with_deepspeeds_loss_scale(two_ranks, case, source):
    """The dynamic loss scale and its counters come back: the scale doubles when DeepSpeed's
    did (a fresh scaler would start again at 2^8 and double a step later)."""
    results, _ = two_ranks
    want = _recorded(source)["continued_loss_scales"]
    for rank in range(tiny.DP):
        assert results[rank][case]["loss_scales"] == want, (case, rank)


@GROUP
def test_deepspeed_stage2_checkpoint_continues_on_zerotron_stage3(two_ranks):
    results, _ = two_ranks
    want = _recorded("zero2_fp32")["continued"]
    for rank in range(tiny.DP):
        got = results[rank]["zero2_fp32_into_zero3"]["losses"]
        assert got == pytest.approx(want[rank], rel=FP32_RTOL, abs=0), rank


@GROUP
def test_loading_restores_deepspeeds_step_counters(two_ranks):
    results, _ = two_ranks
    samples = tiny.SAVE_STEP * tiny.MICRO_BATCH * tiny.DP
    for case in tiny.CASES:
        got = results[0][case]
        assert (got["global_steps"], got["global_samples"]) == (tiny.SAVE_STEP, samples), case
        assert got["path"] == str(FIXTURES / case / f"global_step{tiny.SAVE_STEP}")


def test_deepspeed_continuation_equals_its_uninterrupted_run():
    # the reference itself: DeepSpeed's reload is exact, so matching it is matching the
    # uninterrupted run
    for case in tiny.CASES:
        rec = _recorded(case)
        assert rec["continued"] == rec["uninterrupted"], case


def test_every_stage_reads_the_same_fp32_masters():
    # DeepSpeed's stages compute the same fp32 run; each layout is put back to the same tensors
    ref = read_deepspeed_checkpoint(FIXTURES / "zero1_fp32" / "global_step3")
    for case in ("zero2_fp32", "zero3_fp32"):
        got = read_deepspeed_checkpoint(FIXTURES / case / "global_step3")
        for name, master in ref.masters.items():
            assert torch.equal(got.masters[name], master), (case, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got.moments[key][name], ref.moments[key][name]), (case, key)


def test_fp32_masters_equal_the_saved_weights():
    ckpt = read_deepspeed_checkpoint(FIXTURES / "zero2_fp32" / "global_step3")
    assert set(ckpt.masters) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for name, master in ckpt.masters.items():
        assert torch.equal(master, ckpt.module[name]), name


# ---- safe loading ---------------------------------------------------------------------------


def test_deepspeed_files_need_the_allow_list():
    # the allow-list is what DeepSpeed's files hold: without it, weights_only refuses them
    path = FIXTURES / "zero2_fp32" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(pickle.UnpicklingError, match="deepspeed"):
        torch.load(path, weights_only=True)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        assert isinstance(torch.load(path, weights_only=True), dict)


class Unlisted:
    """A type no allow-list names."""


def test_a_type_off_the_allow_list_is_refused_naming_file_and_type(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    buf = io.BytesIO()
    torch.save({"module": {}, "args": Unlisted()}, buf)
    path.write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError) as err:
        load_deepspeed_file(path)
    msg = str(err.value)
    assert str(path) in msg and "test_deepspeed_checkpoint.Unlisted" in msg


# ---- zerotron's saves out, for DeepSpeed's zero_to_fp32 --------------------------------------


def _deepspeed_reader(tag_dir: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32 rule, written from its documentation and source (0.19.8): the
    model-states files (``*_model_states.pt``) give buffers and ``param_shapes``, every
    ``*_optim_states.pt`` (sorted by rank) its fp32 groups; stages 1-2 concatenate each group
    over ranks and read the parameters one after another, stage 3 takes ``ceil(n / ranks)``
    elements of each parameter from every rank."""
    models = sorted(glob.glob(str(tag_dir / "*_model_states.pt")))
    optims = sorted(glob.glob(str(tag_dir / "*_optim_states.pt")))
    model = torch.load(models[0], weights_only=True)
    osds = [torch.load(f, weights_only=True)["optimizer_state_dict"] for f in optims]
    stage, world = int(osds[0]["zero_stage"]), int(osds[0]["partition_count"])
    assert world == len(optims)
    out = {k: v.float() for k, v in model["module"].items() if k in model["buffer_names"]}
    if stage <= 2:
        groups = [o["single_partition_of_fp32_groups"] for o in osds]
        for i, shapes in enumerate(model["param_shapes"]):
            flat = torch.cat([g[i] for g in groups])
            offset = 0
            for name, shape in shapes.items():
                out[name] = flat[offset : offset + shape.numel()].view(shape)
                offset += shape.numel()
            align = 2 * world
            assert math.ceil(offset / align) == math.ceil(flat.numel() / align)
    else:
        flats = [torch.cat([t.reshape(-1) for t in o["fp32_flat_groups"]]) for o in osds]
        offset = 0
        for shapes in model["param_shapes"]:
            for name, shape in shapes.items():
                chunk = math.ceil(shape.numel() / world)
                full = torch.cat([f[offset : offset + chunk] for f in flats])
                out[name] = full[: shape.numel()].view(shape)
                offset += chunk
        assert offset == flats[0].numel()
    for alias, name in model["shared_params"].items():
        out[alias] = out[name]
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


def _recorded_zero_to_fp32(stage: int) -> dict[str, dict[str, Any]]:
    return json.loads((FIXTURES / "zero_to_fp32.json").read_text())[f"zero{stage}"]


@pytest.mark.parametrize("stage", tiny.SAVE_STAGES)
def test_deepspeeds_zero_to_fp32_read_the_saved_weights(stage):
    # what DeepSpeed's reader returned for zerotron's save is the model zerotron saved
    want = _recorded_zero_to_fp32(stage)
    model = tiny.build_model().state_dict()
    assert list(want) == list(model)
    for name, t in model.items():
        assert want[name]["sha256"] == _digest(t.float()), name


@GROUP
@pytest.mark.parametrize("stage", tiny.SAVE_STAGES)
def test_zerotron_save_still_gives_deepspeed_the_same_weights(two_ranks, stage):
    _, root = two_ranks
    got = _deepspeed_reader(root / f"zero{stage}" / "global_step0")
    want = _recorded_zero_to_fp32(stage)
    assert {n: _digest(t.contiguous()) for n, t in got.items()} == {
        n: w["sha256"] for n, w in want.items()
    }


@GROUP
@pytest.mark.parametrize("stage", tiny.SAVE_STAGES)
def test_zerotron_save_has_the_files_deepspeeds_reader_globs(two_ranks, stage):
    _, root = two_ranks
    tag_dir = root / f"zero{stage}" / "global_step0"
    names = sorted(os.listdir(tag_dir))
    models = [n for n in names if n.endswith("_model_states.pt")]
    optims = [n for n in names if n.endswith("_optim_states.pt")]
    if stage == 3:
        assert models == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(tiny.DP)]
    else:
        assert models == ["mp_rank_00_model_states.pt"]
    assert len(optims) == tiny.DP
    osd = torch.load(tag_dir / optims[0], weights_only=True)["optimizer_state_dict"]
    groups = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    assert (osd["zero_stage"], osd["partition_count"]) == (stage, tiny.DP)
    assert all(t.dtype == torch.float32 for t in osd[groups])
    model = torch.load(tag_dir / models[0], weights_only=True)
    assert model["buffer_names"] == ["scale"] and "shared_params" in model


def _zero_states(full: dict[str, torch.Tensor], stage: int, dp: int) -> list[dict[str, Any]]:
    """zerotron's ZeRO files of ``dp`` ranks for ``full`` (each parameter cut on its own into
    ``ceil(n / dp)`` chunks, one flat partition per rank; see zerotron/zero/state_dict.py)."""
    states = []
    for r in range(dp):
        layout, pieces, offset = [], [], 0
        for name, t in full.items():
            chunk = math.ceil(t.numel() / dp)
            start = min(r * chunk, t.numel())
            length = min(chunk, t.numel() - start)
            piece = torch.zeros(chunk)
            piece[:length] = t.reshape(-1)[start : start + length]
            pieces.append(piece)
            layout.append(
                dict(name=name, shape=list(t.shape), numel=t.numel(), chunk=chunk)
                | dict(start=start, length=length, partition=0, offset=offset)
            )
            offset += chunk
        states.append(
            {"zero_stage": stage, "dp_rank": r, "dp_size": dp, "layout": layout}
            | {"fp32_partitions": [torch.cat(pieces)]}
        )
    return states


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_view_gives_frozen_and_tied_weights(tmp_path, stage):
    from zerotron.checkpoint.deepspeed_view import deepspeed_view

    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g)}
    frozen = {"f": torch.randn(4, generator=g)} if stage < 3 else {}
    buffers = {"buf": torch.arange(3.0)}
    dp = 4  # b has 7 elements: its last rank's chunk is one element plus padding
    for r, state in enumerate(_zero_states(full, stage, dp)):
        extra = deepspeed_view(
            state, dp_rank=r, buffers=buffers, shared_params={"tied": "a"}, frozen=frozen
        )
        torch.save(state, tmp_path / f"zero_dp_rank_{r}_mp_rank_00_000_optim_states.pt")
        for name, contents in extra.items():
            torch.save(contents, tmp_path / name)
    got = _deepspeed_reader(tmp_path)
    if frozen:  # DeepSpeed's stage 1-2 reader takes the whole frozen tensors from rank 0
        model = torch.load(tmp_path / "mp_rank_00_model_states.pt", weights_only=True)
        got.update(model["frozen_param_fragments"])
    want = {**buffers, **full, **frozen, "tied": full["a"]}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stage3_with_frozen_parameters_writes_no_deepspeed_view():
    from zerotron.checkpoint.deepspeed_view import deepspeed_view

    state = _zero_states({"a": torch.ones(5)}, 3, 2)[0]
    frozen = {"f": torch.ones(2)}
    assert deepspeed_view(state, dp_rank=0, buffers={}, shared_params={}, frozen=frozen) is None


def test_a_zerotron_checkpoint_is_not_taken_for_deepspeeds(tmp_path):
    from zerotron.checkpoint.deepspeed_format import is_deepspeed_tag

    assert is_deepspeed_tag(FIXTURES / "zero3_fp32" / "global_step3")
    (tmp_path / "mp_rank_00").mkdir()  # zerotron's model file beside the view for DeepSpeed
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert not is_deepspeed_tag(tmp_path)


def test_stage3_frozen_parameters_come_from_every_ranks_fragment(tmp_path):
    # DeepSpeed's stage 3 keeps a frozen parameter as one ceil(n / dp) fragment per rank
    src = FIXTURES / "zero3_fp32" / "global_step3"
    frozen = torch.arange(5.0)  # 3 + 2 elements (+1 padding) over two ranks
    for r in range(tiny.DP):
        name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        model = torch.load(src / name, weights_only=True)
        model["frozen_param_shapes"] = {"frozen": torch.Size([5])}
        model["frozen_param_fragments"] = {
            "frozen": torch.cat([frozen, torch.zeros(1)])[3 * r :][:3]
        }
        torch.save(model, tmp_path / name)
        optim = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        (tmp_path / optim).write_bytes((src / optim).read_bytes())
    ckpt = read_deepspeed_checkpoint(tmp_path)
    assert torch.equal(ckpt.module["frozen"], frozen)


@pytest.mark.parametrize("case", ["zero2_fp32", "zero3_fp32"])
def test_get_fp32_state_dict_reads_deepspeeds_checkpoint(case):
    # DeepSpeed's function under its compat name, on DeepSpeed's own checkpoint: buffers first,
    # then the fp32 masters (fp32 training: equal to the weights DeepSpeed saved at stage 2)
    from zerotron.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / case))
    ref = read_deepspeed_checkpoint(FIXTURES / "zero2_fp32" / "global_step3").module
    assert list(got) == ["scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert all(torch.equal(got[k], ref[k]) for k in got)


def test_a_missing_ranks_optimizer_file_is_named(tmp_path):
    src = FIXTURES / "zero2_fp32" / "global_step3"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    with pytest.raises(CheckpointError, match="say 2 data-parallel ranks, 1 are present"):
        read_deepspeed_checkpoint(tmp_path)


def test_another_models_parameters_are_listed():
    from zerotron.checkpoint.deepspeed_format import zero_state_from_full

    ckpt = read_deepspeed_checkpoint(FIXTURES / "zero2_fp32" / "global_step3")
    target = _zero_states({"fc1.weight": torch.zeros(64, 64), "head.weight": torch.zeros(3)}, 2, 2)
    target[0]["optimizer"] = {"state": {}, "param_groups": [{"params": [0]}]}
    with pytest.raises(CheckpointError) as err:
        zero_state_from_full(target[0], ckpt.masters, ckpt.moments, ckpt.scalars, None, "here")
    assert "missing in the checkpoint: ['head.weight']" in str(err.value)
    assert "'fc1.bias'" in str(err.value)


def test_zerotrons_own_commands_say_a_deepspeed_checkpoint_is_deepspeeds(capsys):
    """`zerotron checkpoint info` / `generate` read zerotron's metadata.json: on DeepSpeed's
    checkpoint they say whose it is and what reads it, not that metadata.json is missing."""
    from zerotron.checkpoint.checkpoint_cli import main as checkpoint_main

    with pytest.raises(CheckpointError, match="written by DeepSpeed, not by zerotron") as e:
        checkpoint_main(["info", str(FIXTURES / "zero2_fp32")])
    assert "engine.load_checkpoint" in e.value.fix
