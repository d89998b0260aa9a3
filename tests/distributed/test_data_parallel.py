"""Data parallelism on 2 gloo ranks: the same training as one process, gradient traffic exactly
once per step, buckets reduced while backward still runs, and the 16-bit wire.

Engines come from ``build_run`` (the tiny 2-layer, 64-wide GPT-2, fp32, dropout 0) and train on
random token ids. The single-process reference runs in the test process with the same global
batch of 4 samples per step: micro-batch 2 × 2 accumulation steps there, micro-batch 2 on each of
2 ranks (or 1 × 2 accumulation steps on each) here.
"""

from __future__ import annotations

import pytest
import torch

from zerotron.config import parse_megatron_args
from zerotron.distributed.comm import ledger
from zerotron.distributed.state import state
from zerotron.parallel.data_parallel import DataParallel
from zerotron.training.build import Run, build_run

from .spawn import run_ranks

SEQ, VOCAB, STEPS, GBS = 16, 50257, 5, 4
DP = 2


def build(micro_batch_size: int, world_size: int, *extra: object) -> Run:
    argv = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4]
    argv += ["--seq-length", SEQ, "--lr", 1e-3, "--seed", 1234, "--clip-grad", 1.0]
    argv += ["--hidden-dropout", 0, "--attention-dropout", 0, "--train-iters", STEPS]
    argv += ["--micro-batch-size", micro_batch_size, "--global-batch-size", GBS, *extra]
    cfg = parse_megatron_args([str(a) for a in argv], world_size=world_size)
    return build_run(cfg, device=torch.device("cpu"))


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The 4 samples of step ``step`` (random tokens; every position counts)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    return {
        "tokens": ids[:, :-1],
        "labels": ids[:, 1:],
        "loss_mask": torch.ones(GBS, SEQ),
        "position_ids": torch.arange(SEQ).expand(GBS, SEQ),
    }


def micro_batches(mbs: int, dp_rank: int, dp_size: int):
    """This rank's micro-batches in order, as MegatronPretrainingSampler deals them."""
    for step in range(STEPS):
        batch = global_batch(step)
        for start in range(0, GBS, mbs * dp_size):
            lo = start + dp_rank * mbs
            yield {k: v[lo : lo + mbs] for k, v in batch.items()}


def train(run: Run, mbs: int, dp_rank: int, dp_size: int):
    data = micro_batches(mbs, dp_rank, dp_size)
    losses = [float(run.engine.train_batch(data)) for _ in range(STEPS)]
    grad_norm = run.engine.last_step.grad_norm
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    return losses, grad_norm, weights


SGD = ("--optimizer", "sgd", "--lr", "0.1")


def _train_rank(mbs: int, *extra: str):
    run = build(mbs, DP, *extra)
    assert run.engine.data_parallel is not None
    assert run.engine.gradient_accumulation_steps() == GBS // (mbs * DP)
    return train(run, mbs, state().dp_rank, DP)


def _traffic_rank():
    """Two steps of 2 micro-batches with small buckets: what each backward sent, and how many
    buckets were launched when layer 0's first weight got its gradient."""
    run = build(1, DP, "--ddp-bucket-size", 20_000)
    engine, model = run.engine, run.model
    dp: DataParallel = engine.data_parallel
    grad_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # When layer 0's first weight has its gradient, backward is not finished (its LayerNorm and
    # the embeddings come later).
    seen: list[int] = []
    model.layers[0].input_layernorm.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(ledger.count("dp", "all_reduce"))
    )
    per_micro, launched = [], []
    data = micro_batches(1, state().dp_rank, DP)
    for _ in range(2):
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(data)
            before = ledger.count("dp", "all_reduce")
            seen.clear()
            with ledger.capture() as cap:
                engine.backward(engine.loss_fn(engine, batch))
            launched.append(seen[0] - before)
            per_micro.append(cap.summary())
        engine.step()
    return grad_numel, per_micro, launched, dp.describe()


def _bf16_rank(fp32_reduce: bool):
    """One bf16 backward: gradient bytes on the wire and the averaged fp32 gradients."""
    extra = ["--bf16"] + (["--accumulate-allreduce-grads-in-fp32"] if fp32_reduce else [])
    run = build(2, DP, *extra)
    numel = sum(p.numel() for p in run.model.parameters())
    data = micro_batches(2, state().dp_rank, DP)
    with ledger.capture() as cap:
        run.engine.backward(run.engine.loss_fn(run.engine, next(data)))
    grads = [p.main_grad.clone() for p in run.model.parameters()]
    return numel, cap.total("dp", "all_reduce"), grads


def _all_cases(rank: int) -> dict:
    # One spawn for every case: each rank pays torch's optimizer import (seconds) only once.
    return {
        "adam_mbs2": _train_rank(2),
        "sgd_mbs1": _train_rank(1, *SGD),
        "traffic": _traffic_rank(),
        "bf16": _bf16_rank(False),
        "bf16_fp32_reduce": _bf16_rank(True),
    }


DP_RUNS = pytest.mark.xdist_group("data_parallel")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_all_cases, DP)


def assert_same_run(got, ref, exact: bool) -> None:
    losses, norm, weights = got
    ref_losses, ref_norm, ref_weights = ref
    if exact:
        assert losses == ref_losses and norm == ref_norm
        for k in ref_weights:
            assert torch.equal(weights[k], ref_weights[k]), k
        return
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)


@DP_RUNS
def test_dp2_equals_one_process(ranks):
    # One process: micro-batch 2, 2 accumulation steps. dp2: micro-batch 2 on each rank. The
    # all-reduce adds the same two partial gradients one process accumulates (each halved), so
    # every loss, the grad norm and every weight match bit for bit.
    reference = train(build(2, 1), 2, 0, 1)
    for r in ranks:
        assert_same_run(r["adam_mbs2"], reference, exact=True)
    losses = reference[0]
    assert losses != losses[:1] * STEPS  # the model did train


@DP_RUNS
def test_dp2_with_accumulation_equals_one_process(ranks):
    # Micro-batch 1, 2 accumulation steps per rank vs 4 in one process: the same samples per
    # step, summed in another order, so equal up to rounding. SGD here: Adam divides by sqrt(v)
    # and turns rounding noise in gradients that are exactly zero in theory (the key bias:
    # softmax ignores a shift) into full-size steps, which no tolerance could tell from a bug.
    reference = train(build(1, 1, *SGD), 1, 0, 1)
    for r in ranks:
        assert_same_run(r["sgd_mbs1"], reference, exact=False)


@DP_RUNS
def test_gradient_bytes_once_per_step_and_buckets_overlap_backward(ranks):
    for r in ranks:
        grad_numel, per_micro, launched, buckets = r["traffic"]
        assert sum(b["numel"] for b in buckets) == grad_numel
        assert len(buckets) > 3
        assert all(b["dtype"] == "torch.float32" for b in buckets)
        # Non-boundary micro-batches (0, 2) send nothing; boundaries (1, 3) every gradient once.
        assert per_micro[0] == per_micro[2] == {}
        for boundary in (per_micro[1], per_micro[3]):
            assert boundary == {("dp", "all_reduce"): (grad_numel * 4, len(buckets))}
        # At layer 0's hook on a boundary some buckets are in flight, not yet all of them.
        assert launched[0] == launched[2] == 0
        assert 0 < launched[1] < len(buckets) and 0 < launched[3] < len(buckets)


@pytest.mark.parametrize("case", ["bf16", "bf16_fp32_reduce"])
@DP_RUNS
def test_bf16_wire_and_fp32_reduction(ranks, case):
    (numel, nbytes, grads0), (_, _, grads1) = (r[case] for r in ranks)
    # bf16 on the wire unless --accumulate-allreduce-grads-in-fp32.
    assert nbytes == numel * (4 if case == "bf16_fp32_reduce" else 2)
    for a, b in zip(grads0, grads1):  # both ranks hold the same averaged fp32 gradient
        assert a.dtype == torch.float32 and torch.equal(a, b)
