"""The Engine with a ZeroOptimizer on 2 gloo ranks, through DeepSpeed's API (loss_fn,
train_batch, save/load_checkpoint): stages 1/2/3 resume from a checkpoint with the same losses
bit for bit, client_state round-trips, tag None follows ``latest``, an fp16 overflow is counted
in ``skipped_steps``; zero-to-fp32 of a real stage-1/2/3 save equals the weights it saved; a
ZeRO checkpoint loads at another data-parallel size by re-partitioning (or, with that off,
refuses by naming zero-to-fp32), and a non-ZeRO engine refuses its optimizer state.

The model is zerotron's GPT, tiny (2 layers, hidden 64, vocabulary 512, sequence 16), fp32
with dropout (its RNG state is part of what resumes), AdamW with weight decay and a warmup
schedule; each rank trains on its own micro-batches (2 per step).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import build_metadata, layout
from zerotron.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zerotron.distributed import comm
from zerotron.distributed.rng import model_parallel_seed
from zerotron.distributed.state import state
from zerotron.engine import Engine, grad_norm_hooks
from zerotron.errors import CheckpointError
from zerotron.models.gpt import GPT, GPTConfig
from zerotron.optim import OptimizerParamScheduler
from zerotron.precision import MixedPrecisionOptimizer, make_loss_scaler
from zerotron.training.build import lm_loss

from .spawn import run_ranks

DP, SEQ, VOCAB, MBS, GAS = 2, 16, 512, 2, 2
STEPS, SAVE_AT = 4, 2
CONFIG = GPTConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=SEQ,
    vocab_size=VOCAB,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


def micro_batch(step: int, micro: int, dp_rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    ids = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    return {
        "tokens": ids[:, :-1],
        "labels": ids[:, 1:],
        "loss_mask": torch.ones(MBS, SEQ),
        "position_ids": torch.arange(SEQ).expand(MBS, SEQ),
    }


def step_batches(step: int) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(step, m, state().dp_rank) for m in range(GAS)]


def make_engine(
    stage: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    wall_clock: bool = False,
    dropout: float = 0.1,
    gas: int = GAS,
) -> Engine:
    """GPT + AdamW + schedule wrapped by ZeroOptimizer(stage) (stage 0: MixedPrecision +
    no data parallelism, for the refusal checks)."""
    from zerotron.zero import ZeroOptimizer, ZeroOptions
    from zerotron.zero.stage3 import partition_parameters

    torch.manual_seed(seed)
    model_parallel_seed(seed)
    config = dataclasses.replace(CONFIG, hidden_dropout=dropout, attention_dropout=dropout)
    model = GPT(config).to(dtype)
    ps = state()
    if stage == 3:
        # LayerNorms (64 elements) stay whole: both kinds of stage-3 parameter are exercised.
        partition_parameters(model, ps.dp, persistence_threshold=100)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    reduce_fn, is_counted = grad_norm_hooks(ps)
    scaler = make_loss_scaler(dtype, initial_scale=2.0**10, hysteresis=1)
    if stage == 0:
        opt = MixedPrecisionOptimizer(adamw, loss_scaler=scaler, clip_grad=1.0)
    else:
        options = ZeroOptions(
            stage=stage,
            reduce_bucket_size=20_000,  # several buckets
            allgather_bucket_size=20_000,
            sub_group_size=30_000,  # several fp32 partitions per rank
            gather_16bit_weights_on_model_save=True,
        )
        opt = ZeroOptimizer(
            model,
            adamw,
            options,
            group=ps.dp,
            loss_scaler=scaler,
            clip_grad=1.0,
            reduce_fn=reduce_fn,
            is_counted=is_counted,
        )
    sched = OptimizerParamScheduler(opt, max_lr=1e-3, lr_decay_steps=10, lr_warmup_steps=2)
    meta = build_metadata(
        model_config=CONFIG.to_dict(),
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        data_parallel_size=ps.dp_size,
    )
    return Engine(
        model,
        opt,
        sched,
        loss_fn=lm_loss,
        micro_batch_size=MBS,
        gradient_accumulation_steps=gas,
        checkpoint_metadata=meta,
        wall_clock_breakdown=wall_clock,
    )


def train(engine: Engine, steps: range) -> list[float]:
    return [float(engine.train_batch(iter(step_batches(s)))) for s in steps]


def _resume_case(stage: int, root: Path) -> dict:
    """Straight run of STEPS steps, saving after SAVE_AT; a fresh engine (other init) loads
    the latest tag and runs the rest."""
    a = make_engine(stage, seed=1)
    assert a.zero_optimization_stage() == stage and a.data_parallel is a.optimizer
    losses = train(a, range(SAVE_AT))
    client = {"epoch": 7, "ids": torch.arange(3)}
    a.save_checkpoint(root, client_state=client)  # tag None -> global_step2, `latest`
    # the weights at the save (stage 3: gathered, a collective); copies: stages 1/2 give views
    saved = {k: v.clone() for k, v in a.module_state_dict().items()}
    losses += train(a, range(SAVE_AT, STEPS))

    b = make_engine(stage, seed=2)
    where, got = b.load_checkpoint(root)  # tag None: follow `latest`
    resumed = train(b, range(SAVE_AT, STEPS))
    return {
        "losses": losses,
        "resumed": resumed,
        "where": where,
        "client": got,
        "lr": (a.get_lr(), b.get_lr()),
        "counters": ((a.global_steps, a.global_samples), (b.global_steps, b.global_samples)),
        "weights": (a.module_state_dict(), b.module_state_dict()),  # pickled at return
        "saved": saved,
        "memory": a.optimizer.memory_report(),
    }


def _overflow_case() -> dict:
    """fp16 stage 2: a poisoned step is skipped (counted, scale halved, weights unchanged)."""
    engine = make_engine(2, seed=3, dtype=torch.float16)
    poison = {"on": False}

    def loss_fn(model, batch):
        loss = lm_loss(model, batch)
        return loss * math.inf if poison["on"] and state().dp_rank == 1 else loss

    engine.loss_fn = loss_fn
    train(engine, range(1))
    scale, before = engine.cur_scale, engine.module_state_dict()
    poison["on"] = True
    train(engine, range(1, 2))
    skipped = engine.skipped_steps
    same = all(torch.equal(v, engine.module_state_dict()[k]) for k, v in before.items())
    poison["on"] = False
    train(engine, range(2, 3))
    return {
        "scales": (scale, engine.loss_scale),
        "skipped": (skipped, engine.skipped_steps),
        "unchanged": same,
        "ok": engine.last_step.update_successful,
    }


def _repartition_case(root: Path) -> list[float]:
    """Stage 2 without dropout (so one process can replay it): save at SAVE_AT, go on."""
    engine = make_engine(2, seed=4, dropout=0.0)
    train(engine, range(SAVE_AT))
    engine.save_checkpoint(root)
    return train(engine, range(SAVE_AT, STEPS))


def _all_cases(rank: int, root: str) -> dict:
    out = {}
    for stage in (1, 2, 3):
        out[stage] = _resume_case(stage, Path(root) / f"stage{stage}")
    out["overflow"] = _overflow_case()
    out["repartition"] = _repartition_case(Path(root) / "repartition")
    comm.barrier()
    return out


ENGINE_ZERO = pytest.mark.xdist_group("engine_zero")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("zero_ckpt")
    return run_ranks(_all_cases, DP, str(root), timeout=240), root


@pytest.mark.parametrize("stage", [1, 2, 3])
@ENGINE_ZERO
def test_resume_gives_the_same_losses_bitwise(ranks, stage):
    results, _ = ranks
    for r in results:
        case = r[stage]
        assert case["resumed"] == case["losses"][SAVE_AT:]  # exact floats
        assert case["where"].endswith("global_step2")
        assert case["client"].keys() == {"epoch", "ids"} and case["client"]["epoch"] == 7
        assert torch.equal(case["client"]["ids"], torch.arange(3))
        assert case["lr"][0] == case["lr"][1]
        assert case["counters"][0] == case["counters"][1] == (STEPS, STEPS * MBS * GAS * DP)
        a, b = case["weights"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # both ranks report the same (data-parallel mean) losses
    assert results[0][stage]["losses"] == results[1][stage]["losses"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@ENGINE_ZERO
def test_checkpoint_files_and_zero_to_fp32(ranks, stage):
    results, root = ranks
    tag_dir = root / f"stage{stage}" / "global_step2"
    files = sorted(p.name for p in tag_dir.iterdir())
    zero = [layout.zero_file(d) for d in range(DP)]
    extra = ["pytorch_model.bin"] if stage == 3 else []  # gather_16bit_weights_on_model_save
    # what DeepSpeed's zero_to_fp32 reads beside the ZeRO files (tests/test_deepspeed_checkpoint.py)
    if stage == 3:
        extra += [f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(DP)]
    else:
        extra += ["mp_rank_00_model_states.pt"]
    assert files == sorted(["metadata.json", "mp_rank_00", *zero, *extra])
    model_file = torch.load(tag_dir / layout.model_file(), weights_only=True)
    assert "optimizer" not in model_file and model_file["zero_stage"] == stage
    assert model_file["dp_world_size"] == DP
    zero_file = torch.load(tag_dir / zero[1], weights_only=True)
    assert zero_file["dp_rank"] == 1 and zero_file["zero_stage"] == stage

    saved = results[0][stage]["saved"]  # fp32 training: master weights == parameters
    assert all(torch.equal(model_file["model"][k], v) for k, v in saved.items())
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tag_dir)
    assert consolidated.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(consolidated[k], v), k
    if stage == 3:
        gathered = torch.load(tag_dir / "pytorch_model.bin", weights_only=True)
        assert all(torch.equal(gathered[k], v) for k, v in saved.items())


@ENGINE_ZERO
def test_fp16_overflow_is_skipped_and_counted(ranks):
    for r in ranks[0]:
        o = r["overflow"]
        assert o["skipped"] == (1, 1) and o["unchanged"] and o["ok"]
        assert o["scales"][1] == o["scales"][0] / 2


@ENGINE_ZERO
def test_other_data_parallel_size_is_repartitioned_or_refused_by_name(ranks):
    """A dp2 stage-2 checkpoint loaded by one process (data-parallel size 1): re-partitioned,
    it continues as the two ranks did (same global batches; the sums run in another order);
    with re-partitioning off it is refused naming zero-to-fp32, as a plain engine refuses the
    partitioned optimizer state (weights alone load)."""
    results, root = ranks
    one = make_engine(2, seed=5, dropout=0.0, gas=GAS * DP)
    where, _ = one.load_checkpoint(root / "repartition")
    assert where.endswith("global_step2") and one.global_steps == SAVE_AT
    consolidated = get_fp32_state_dict_from_zero_checkpoint(root / "repartition")
    assert all(torch.equal(v, consolidated[k]) for k, v in one.module.state_dict().items())
    losses = [
        float(one.train_batch(iter([micro_batch(s, m, r) for r in range(DP) for m in range(GAS)])))
        for s in range(SAVE_AT, STEPS)
    ]
    assert losses == pytest.approx(results[0]["repartition"], rel=1e-5, abs=0)

    strict = make_engine(2, seed=5)
    strict.repartition_zero_checkpoints = False
    with pytest.raises(CheckpointError, match="zero-to-fp32") as e:
        strict.load_checkpoint(root / "stage2")
    assert "partitioned over 2 data-parallel ranks; this run has 1" in str(e.value)
    plain = make_engine(0, seed=5)
    with pytest.raises(CheckpointError, match="ZeRO stage 2"):
        plain.load_checkpoint(root / "stage2")
    plain.load_checkpoint(root / "stage2", load_optimizer_states=False)
    saved = torch.load(root / "stage2" / "global_step2" / layout.model_file(), weights_only=True)
    assert all(torch.equal(v, saved["model"][k]) for k, v in plain.module.state_dict().items())
    assert plain.global_steps == SAVE_AT


def test_wall_clock_breakdown_times_each_phase():
    engine = make_engine(0, seed=6, wall_clock=True)
    assert engine.wall_clock_breakdown()
    for mb in [micro_batch(0, m, 0) for m in range(GAS)]:
        engine.backward(lm_loss(engine, mb))  # engine(...) is the timed forward
    engine.step()
    times = engine.wall_clock_summary()
    assert set(times) == {"forward", "backward", "backward_allreduce", "step"}
    assert times["forward"] > 0 and times["backward"] > 0 and times["step"] > 0
    assert engine.wall_clock_summary()["forward"] == 0.0  # read with reset


PRETRAIN = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
    "--lr-decay-style", "constant", "--clip-grad", "1.0", "--split", "80,10,10",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--seed", "1234",
    "--train-iters", "3", "--num-workers", "0",
]  # fmt: skip


def _layout_rank(rank: int, data: str, layout: list[str], stages: list[int]) -> dict:
    import contextlib
    import io

    from zerotron.config import parse_megatron_args
    from zerotron.distributed.state import destroy_model_parallel
    from zerotron.training.pretrain import pretrain

    out = {}
    for stage in [0, *stages]:
        argv = [*PRETRAIN, "--data-path", data, *layout, "--zero-stage", str(stage)]
        with contextlib.redirect_stdout(io.StringIO()):
            out[stage] = pretrain(parse_megatron_args(argv, world_size=4)).losses
        destroy_model_parallel()
    return out


def test_zero1_under_pipeline_parallelism_trains_as_without(data_prefix):
    """dp2 x pp2: ZeRO stage 1 (the tied embedding's gradient summed over the first and last
    stage before the reduce-scatter) gives the losses of plain data parallelism."""
    layout = ["--pipeline-model-parallel-size", "2"]
    results = run_ranks(_layout_rank, 4, data_prefix, layout, [1], timeout=240)
    for r in results:
        assert r[1] == pytest.approx(r[0], rel=1e-5, abs=0)
        assert len(r[0]) == 3


def test_zero_with_sequence_parallelism_trains_as_without(data_prefix):
    """dp2 x tp2 with --sequence-parallel: the sequence-parallel parameters' gradients are
    summed over TP on ZeRO's partitions (the full gradients are gone by then)."""
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    results = run_ranks(_layout_rank, 4, data_prefix, layout, [1, 2, 3], timeout=240)
    for r in results:
        for stage in (1, 2, 3):
            assert r[stage] == pytest.approx(r[0], rel=1e-5, abs=0), stage
        assert len(r[0]) == 3


def _pretrain_resume_rank(rank: int, data: str, root: str) -> dict:
    import contextlib
    import io

    from zerotron.config import parse_megatron_args
    from zerotron.distributed.state import destroy_model_parallel
    from zerotron.training.pretrain import pretrain

    base = [a for a in PRETRAIN if a not in ("--pipeline-model-parallel-size", "2")]
    base = [*base[: base.index("--train-iters")], "--train-iters", "4", "--zero-stage", "2"]
    base += ["--num-workers", "0", "--data-path", data, "--save-interval", "1000"]

    def run(*extra: str) -> dict:
        with contextlib.redirect_stdout(io.StringIO()):
            losses = pretrain(parse_megatron_args([*base, *extra], world_size=2)).losses
        destroy_model_parallel()
        return losses

    straight = run()
    first = run("--save", root, "--exit-interval", "2")
    second = run("--load", root, "--save", root)
    return {"straight": straight, "first": first, "second": second}


def test_pretrain_zero2_saves_iteration_tags_and_resumes_exactly(data_prefix, tmp_path):
    """`zerotron pretrain --zero-stage 2` on 2 ranks: stopped at iteration 2 and resumed, the
    losses are those of the straight run; the checkpoint is Megatron's iter_0000002 tag with
    one ZeRO file per rank and both trackers."""
    results = run_ranks(_pretrain_resume_rank, DP, data_prefix, str(tmp_path), timeout=240)
    for r in results:
        assert r["first"] == {k: v for k, v in r["straight"].items() if k <= 2}
        assert r["second"] == {k: v for k, v in r["straight"].items() if k > 2}
    tag = tmp_path / "iter_0000002"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (tmp_path / "latest").read_text().strip() == "iter_0000004"
    assert {layout.zero_file(d) for d in range(DP)} <= {p.name for p in tag.iterdir()}
    meta = (tag / "metadata.json").read_text()
    assert '"zero_stage": 2' in meta and '"data_parallel_size": 2' in meta
