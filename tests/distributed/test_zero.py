"""ZeRO stages 1-3 on gloo ranks (zerotron.zero.ZeroOptimizer) against one process.

Every configuration trains a few steps of data parallelism × gradient accumulation and is
compared with a plain single-process run in this test process: the same model and initial
weights, the same micro-batches (all ranks' data, in order), torch's AdamW with two weight
decay groups and ``clip_grad_norm_``. Checked within 1e-5 relative: the loss of every step (the
DP mean on every rank), the gradient norm of every step (Adam and clipping hide a gradient's
scale from the weights; the norm does not) and every final weight (per tensor).

Models: a plain ``nn.Sequential`` MLP with odd sizes (so chunks are padded) and zerotron's GPT
(2 layers, hidden 64, vocab 128, sequence 16, dropout off). Layouts: dp2 (stages 0-3, each
with offload none/cpu/nvme), dp2 × tp2 (stages 1-3; 2-3 with sequence parallelism), dp2 × pp2
(stage 1 under the 1F1B pipeline runtime, tied embedding summed before the reduction).

Also: resume from a saved ZeRO state (stages 1-3, with offload) equals the uninterrupted run;
DeepSpeed's gradient_predivide_factor, prescale_gradients, reduce_scatter=False and
overlap_comm=False change nothing; the inf-norm (a max across ranks) clips as torch's; an fp16
overflow skips the step in every stage (no weight or state changes, scale halved, skip counted);
bf16 trains; the comm ledger equals the closed form (stage 3 = 1.5× DP on the wire);
``memory_report`` equals the ZeRO paper's formulas at N=2 and N=4; stage 3 reloads the masters
of parameters rewritten under GatheredParameters(modifier_rank=0), and only those; a reentrant
activation checkpoint (nested backward) does not make buckets go twice.

Adam's ``eps`` is 1e-4: an element whose gradient is mathematically zero but holds rounding
noise (the attention key bias: softmax ignores a per-query constant) would otherwise take an
update of ``lr × noise / |noise|`` whose sign depends on the summation order; with a larger eps
the update stays proportional to the noise (see tests/distributed/test_equivalence_matrix.py).

Cost: two spawns (2 and 4 ranks), each a module-scoped fixture that one test per check reads.
What the ranks run, and the one-process reference: tests/distributed/zero_runs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerotron.distributed.comm import Group
from zerotron.errors import UnsupportedError
from zerotron.zero import OffloadOptions

from .spawn import run_ranks
from .zero_runs import (
    GAS,
    LEDGER_SIZES,
    TOL,
    _dp2_rank,
    _dp4_rank,
    adamw,
    make_model,
    reference,
    zero_optimizer,
)

# The tests reading one spawn share an xdist group (--dist loadgroup, in pyproject's addopts):
# one worker runs them all, so each spawn runs once.
DP2 = pytest.mark.xdist_group("zero_dp2")
DP4 = pytest.mark.xdist_group("zero_dp4")


# ------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def references():
    refs = {kind: reference(kind, dp=2) for kind in ("mlp", "gpt")}
    refs["mlp inf-norm"] = reference("mlp", dp=2, norm_type=math.inf)
    return refs


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> list[dict]:
    """One spawn, every dp2 configuration (see the module docstring and each test)."""
    return run_ranks(_dp2_rank, 2, str(tmp_path_factory.mktemp("zero_dp2")), timeout=240)


@pytest.fixture(scope="module")
def dp4() -> list[dict]:
    """One spawn: dp2 x tp2 (stages 1-3, and 2-3 with sequence parallelism), dp2 x pp2 stage 1,
    memory at N=4, pipelines refuse stages 2/3."""
    return run_ranks(_dp4_rank, 4, timeout=240)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)).item()


def check_equal(result: dict, ref: dict, what: str) -> None:
    """Losses, gradient norms (Adam and clipping hide a gradient's scale from the weights:
    the norm does not) and final weights, within TOL relative."""
    for key in ("losses", "norms"):
        for got, want in zip(result[key], ref[key], strict=True):
            assert abs(got - want) <= TOL * abs(want), f"{what}: {key} {result[key]} vs {ref[key]}"
    for name, want in ref["weights"].items():
        err = rel_err(result["weights"][name], want)
        assert err <= TOL, f"{what}: {name} differs by {err:.2e} relative"


@DP2
@pytest.mark.parametrize("kind", ["mlp", "gpt", "mlp inf-norm"])
def test_dp2_stages_equal_one_process(dp2, references, kind):
    ref = references[kind]
    # the weights moved: a tolerance cannot pass just because nothing changed
    start = dict(make_model(kind.split()[0]).named_parameters())
    moved = max(rel_err(start[n].detach(), w) for n, w in ref["weights"].items())
    assert moved > 100 * TOL
    configs = [k for k in dp2[0] if k[0] == kind]
    assert len(configs) == {"mlp": 10 + 3 + 3, "gpt": 10 + 1 + 2, "mlp inf-norm": 1}[kind]
    for key in configs:
        for rank in range(2):
            check_equal(dp2[rank][key], ref, f"{key} rank {rank}")


# ------------------------------------------------------------------------------------------
# Tests of the above


@DP2
def test_fp16_overflow_skips_the_step_in_every_stage(dp2):
    for rank in range(2):
        for stage in (1, 2, 3):
            r = dp2[rank]["fp16", stage]
            assert r["skipped"] and r["unchanged"] and r["state_entries"] > 2, (stage, r)
            assert r["num_skipped"] == 1 and r["next_ok"], (stage, r)
            assert r["scale"] == (256.0, 128.0), (stage, r)


@DP2
def test_stage3_modified_parameters_reload_their_masters(dp2):
    for rank in range(2):
        r = dp2[rank]["modified"]
        assert r["weight"].eq(0.5).all()
        for e in r["layout"]:
            span = slice(e["offset"], e["offset"] + e["length"])
            got, was = r["after"][e["partition"]][span], r["parts"][e["partition"]][span]
            if e["name"] == "0.weight":
                assert got.eq(0.5).all()
            else:
                assert torch.equal(got, was), e["name"]
                assert e["length"] == 0 or not torch.equal(was, was.bfloat16().float()), e["name"]


@DP2
def test_buckets_overlap_with_backward(dp2):
    """Later layers' buckets are on the wire before backward reaches the first layer; stage 1
    communicates only on the micro-batch that ends the accumulation, stage 2 on every one."""
    buckets = 3  # reduce_bucket_size=40: one per layer (bias 4 or 32 elements, then weight)
    for rank in range(2):
        (s1_before0, s1_after0), (s1_before1, s1_after1) = dp2[rank]["overlap"][1]
        assert (s1_before0, s1_after0) == (0, 0)
        assert 0 < s1_before1 < s1_after1 == buckets
        (s2_before0, s2_after0), (s2_before1, s2_after1) = dp2[rank]["overlap"][2]
        assert 0 < s2_before0 < s2_after0 == buckets
        assert buckets < s2_before1 < s2_after1 == 2 * buckets


@DP2
def test_reentrant_checkpointing_sends_each_bucket_once(dp2):
    """A nested backward (reentrant recompute) does not end the reduction early: each bucket is
    reduce-scattered once per micro-batch, and the result equals the plain run's."""
    plain, ckpt = dp2[0]["reentrant"][False], dp2[0]["reentrant"][True]
    assert plain[0][("dp", "reduce_scatter")][1] == GAS * 3
    assert ckpt[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(ckpt[1], plain[1]))


@DP2
def test_bf16_trains(dp2):
    for stage in (1, 2, 3):
        losses = dp2[0]["bf16", stage]
        assert losses == dp2[1]["bf16", stage]
        assert losses[-1] < 0.8 * losses[0], (stage, losses)


@DP2
def test_bf16_grad_partitions_give_the_fp32_bits(dp2):
    """Storing one micro-batch's bf16 rows in bf16 and promoting before a second is added
    changes no bit of the step (stage 3, with and without accumulation, clipping on)."""
    for rank in range(2):
        for gas, runs in dp2[rank]["bf16 partitions"].items():
            assert len(runs["default"]) == len(runs["fp32"])
            for a, b in zip(runs["default"], runs["fp32"]):
                assert torch.equal(a, b), (rank, gas)


def _ledger_closed_form(world: int, stage: int, gas: int) -> dict:
    """Bytes per step on the dp group (fp32): what each op records (see comm's docstring)."""
    dims = LEDGER_SIZES
    numels = [n for a, b in zip(dims, dims[1:]) for n in (a * b, b)]
    chunks = [-(-n // world) for n in numels]
    rs = world * sum(chunks) * 4  # every rank sends its whole padded gradient
    ag = sum(chunks) * 4  # every rank contributes its chunks
    if stage == 0:
        return {"all_reduce": sum(numels) * 4}
    if stage == 1:
        return {"reduce_scatter": rs, "all_gather": ag}
    if stage == 2:
        return {"reduce_scatter": gas * rs, "all_gather": ag}
    return {"reduce_scatter": gas * rs, "all_gather": 2 * gas * ag}  # stage 3: fwd + bwd gathers


def _by_op(summary: dict, group: str = "dp") -> dict:
    out = {}
    for (g, op), (nbytes, _calls) in summary.items():
        if g == group and not (op == "all_reduce" and nbytes <= 8):  # norm/overflow scalars
            out[op] = out.get(op, 0) + nbytes
    return out


@DP2
def test_comm_ledger_matches_closed_form(dp2):
    for stage in (0, 1, 2, 3):
        for gas, summary in dp2[0]["ledger", stage].items():
            assert _by_op(summary) == _ledger_closed_form(2, stage, gas), (stage, gas, summary)
    # Stage 3 moves 1.5x the bytes of plain data parallelism (on the wire of a ring: all-reduce
    # 2(n-1)/n x, reduce-scatter (n-1)/n x, all-gather (n-1) x the recorded bytes).
    n = 2
    dp_wire = _by_op(dp2[0]["ledger", 0][1])["all_reduce"] * 2 * (n - 1) / n
    s3 = _by_op(dp2[0]["ledger", 3][1])
    s3_wire = s3["reduce_scatter"] * (n - 1) / n + s3["all_gather"] * (n - 1)
    assert s3_wire == 1.5 * dp_wire
    # communication_data_type=bf16 halves the gradients' bytes (fp32 parameters still gather
    # in fp32).
    for gas, summary in dp2[0]["ledger", "bf16 wire"].items():
        expected = _ledger_closed_form(2, 2, gas)
        expected["reduce_scatter"] //= 2
        assert _by_op(summary) == expected, (gas, summary)


ZERO_FORMULA = {1: lambda n: 2 + 2 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n}


@DP4
def test_dp2_pp2_stage1_equals_one_process(dp4, references):
    """Global ranks 0, 1: stage 0 of DP ranks 0, 1; ranks 2, 3: stage 1 (it has the loss)."""
    ref = references["gpt"]
    for dp_rank in range(2):
        first, last = dp4[dp_rank]["pp2"], dp4[2 + dp_rank]["pp2"]
        assert first["norms"] == last["norms"] and not first["losses"]
        weights = {**first["weights"], **last["weights"]}
        assert sorted(weights) == sorted(ref["weights"])
        result = {"losses": last["losses"], "norms": last["norms"], "weights": weights}
        check_equal(result, ref, f"pp2 stage 1 dp rank {dp_rank}")


@DP4
def test_dp2_tp2_stages_equal_one_process(dp4, references):
    """Global ranks 0, 1 are TP ranks 0, 1 of DP rank 0; 2, 3 those of DP rank 1. With
    sequence parallelism (stages 2, 3) the gradients of replicated parameters are summed over
    TP on the partitions (``ZeroOptimizer.allreduce_grads``)."""
    dims = dp4[0]["tp_dims"]
    for key in [("tp2", 1), ("tp2", 2), ("tp2", 3), ("tp2_sp", 2), ("tp2_sp", 3)]:
        for dp_rank in range(2):
            shards = [dp4[2 * dp_rank + t][key] for t in range(2)]
            weights = {
                n: torch.cat([s["weights"][n] for s in shards], dim=d)
                if d is not None
                else shards[0]["weights"][n]
                for n, d in dims.items()
            }
            for s in shards:  # replicated parameters agree across TP ranks
                assert all(
                    torch.equal(s["weights"][n], weights[n]) for n, d in dims.items() if d is None
                )
            result = {
                "losses": shards[0]["losses"],
                "norms": shards[0]["norms"],
                "weights": weights,
            }
            check_equal(result, references["gpt"], f"{key} dp rank {dp_rank}")


def check_memory_matches_zero_formulas(results, world):
    """The most a rank holds between micro-batches (stage 1: full gradients after the first;
    stage 3: fp32 partitions after the second) against the paper's formula."""
    for stage in (1, 2, 3):
        for rank in range(world):
            r = results[rank]["memory", stage]
            expected = ZERO_FORMULA[stage](world) * r["psi"]
            ratio = max(r["report"]["total"], r["accumulated"]["total"]) / expected
            assert abs(ratio - 1) <= 0.10, (world, stage, rank, ratio, r)


def check_stage3_keeps_one_copy_of_the_partition(results, world):
    """Stage 3 without offload: the shards are views of the fp32 masters (no 16-bit copy,
    ``params`` 0 bytes: every weight here is partitioned); one micro-batch's gradient partition
    stays in bf16, the wire dtype (2 bytes per element), and turns fp32 when a second one is
    added (4 bytes)."""
    for rank in range(world):
        r = results[rank]["memory", 3]
        assert r["report"]["params"] == 0, r
        assert r["report"]["grads"] == 2 * r["psi"] // world, r
        assert r["accumulated"]["params"] == 0, r
        assert r["accumulated"]["grads"] == 4 * r["psi"] // world, r


@DP2
def test_grad_accum_dtype(dp2):
    """fp32 gradient partitions under bf16 parameters: 4 bytes per element of the partition."""
    r = dp2[0]["memory", "fp32 accum"]
    assert r["report"]["grads"] == 4 * r["psi"] // 2


@DP4
def test_pipeline_refuses_stage_2_and_3(dp4):
    assert len(dp4[0]["pp_refused"]) == 2
    assert all("pipeline" in msg for msg in dp4[0]["pp_refused"])


@DP2
def test_memory_matches_zero_formulas_on_2_ranks(dp2):
    check_memory_matches_zero_formulas(dp2, 2)


@DP4
def test_memory_matches_zero_formulas_on_4_ranks(dp4):
    check_memory_matches_zero_formulas(dp4, 4)


@DP2
def test_stage3_keeps_one_copy_of_the_partition_on_2_ranks(dp2):
    check_stage3_keeps_one_copy_of_the_partition(dp2, 2)


@DP4
def test_stage3_keeps_one_copy_of_the_partition_on_4_ranks(dp4):
    check_stage3_keeps_one_copy_of_the_partition(dp4, 4)


class _Lamb(torch.optim.Optimizer):
    """Stands for any optimizer with a per-tensor (not elementwise) update."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


def test_non_elementwise_optimizer_is_refused():
    model = make_model("mlp")
    with pytest.raises(UnsupportedError, match="elementwise"):
        zero_optimizer(model, _Lamb(model.parameters()), stage=1, group=Group.single("dp"))


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (2, "nvme")])
def test_layout_and_reload_model_params(tmp_path, stage, offload):
    """No processes: rank 1 of a 2-rank group (construction and reload do not communicate).
    Every layout entry points at the chunk of its parameter in the fp32 partitions — before
    and after the model's weights are replaced and ``reload_model_params`` is called."""
    model = make_model("mlp")
    options = OffloadOptions(device=offload, nvme_path=str(tmp_path) if offload == "nvme" else None)
    opt = zero_optimizer(
        model, adamw(model), stage=stage, group=Group("dp", (0, 1), 1, None),
        offload_optimizer=options, sub_group_size=300,
    )  # fmt: skip
    params = dict(model.named_parameters())

    def check() -> None:
        sd = opt.state_dict()
        assert sd["dp_rank"] == 1 and sd["dp_size"] == 2 and len(sd["fp32_partitions"]) > 1
        for e in sd["layout"]:
            flat = params[e["name"]].detach().reshape(-1)
            assert e["start"] == e["chunk"] and e["length"] == min(
                e["chunk"], e["numel"] - e["start"]
            )
            part = sd["fp32_partitions"][e["partition"]]
            got = part[e["offset"] : e["offset"] + e["length"]]
            assert torch.equal(got, flat[e["start"] : e["start"] + e["length"]]), e["name"]
            assert part[e["offset"] + e["length"] : e["offset"] + e["chunk"]].eq(0).all()

    check()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    opt.reload_model_params()
    check()
    opt.close()
