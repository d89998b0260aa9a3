"""Issue 14's resume matrix: a checkpoint saved on one layout resumes on another, optimizer and all.

Each case saves on layout A at iteration K (``--exit-interval K``) and resumes on layout B with
``--load``; iterations K+1..N must have the losses of the uninterrupted run on B (1e-5 relative,
fp32), on every rank. Weights, fp32 masters, Adam's moments and step counts, the LR schedule and
the data position all have to come over for that: the schedule warms up for one iteration and
then decays (every step has its own learning rate), and the resumed run must log the
uninterrupted run's learning rate, consumed samples and loss scale on the iterations it runs.

The model is the equivalence matrix's tiny GPT on ``--mock-data`` (4 layers so that pp2 holds
two virtual stages of one layer; hidden 64; NullTokenizer with 1001 ids, padded to 1024 rows on
every tensor-parallel size here, so A and B start from the same weights), Adam's epsilon 1e-6 as
there (rounding noise in a zero gradient stays small against it), global batch 4, dropout 0.

A fifth case re-pads the vocabulary (1008 rows at tp1 to 1024 at tp2) and continues the saved
run's own losses (padded ids never reach the loss).

Cost: three spawns, since A and B may have different world sizes: two ranks (A of the dp2 and
NVMe cases, the NVMe case's B runs, the re-padding case), four ranks (A of the tp2pp2 and tp1
cases, the B runs of the dp4 and virtual-stage cases), two ranks again (the tp1 dp2 ZeRO-3 B
runs).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from zerotron.checkpoint import tag_for_iteration
from zerotron.checkpoint.relayout import refuse_other_model
from zerotron.checkpoint.save_load import write_trackers
from zerotron.config import parse_megatron_args
from zerotron.distributed import comm
from zerotron.distributed.state import destroy_model_parallel
from zerotron.errors import CheckpointError
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

K, N = 1, 3  # save at iteration K, compare K+1..N
TOL = 1e-5

TINY = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-eps", "1e-6",
    "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--seed", "1234", "--train-iters", str(N), "--save-interval", "1000", "--num-workers", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
]  # fmt: skip


def _layout(tp=1, pp=1, vpp=1, zero=0, offload=None) -> tuple[str, ...]:
    flags = ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    if vpp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", 4 // (pp * vpp)]
    flags += ["--zero-stage", zero]
    if offload:
        flags += ["--zero-offload-optimizer", offload]
    return tuple(map(str, flags))


# case -> ((world size, flags) of A, (world size, flags) of B, what the log says)
CASES = {
    "tp2pp2_zero1_to_tp1dp2_zero3": (
        (4, _layout(tp=2, pp=2, zero=1)),
        (2, _layout(zero=3)),
        "checkpoint saved at tp2 pp2 dp1 zero1; loading into tp1 pp1 dp2 zero3",
    ),
    "dp2_zero2_to_dp4_zero1_cpu": (
        (2, _layout(zero=2)),
        (4, _layout(zero=1, offload="cpu")),
        "checkpoint saved at tp1 pp1 dp2 zero2; loading into tp1 pp1 dp4 zero1 offload cpu",
    ),
    "tp1_to_tp2_virtual_stages": (
        (4, _layout(pp=2)),
        (4, _layout(tp=2, pp=2, vpp=2, zero=1)),
        "checkpoint saved at tp1 pp2 dp2 zero0; loading into tp2 pp2 vpp2 dp1 zero1",
    ),
    "dp2_zero3_nvme_to_tp2": (
        (2, _layout(zero=3, offload="nvme")),
        (2, _layout(tp=2)),
        "checkpoint saved at tp1 pp1 dp2 zero3 offload nvme; loading into tp2 pp1 dp1 zero0",
    ),
}


# Another vocabulary padding: tp1 padded to a multiple of 8 (1008 rows) resumed on tp2 (1024).
# Padded ids never reach the loss (their logits are -inf), so the resumed run must continue the
# saved run itself: its iterations K+1..N are the reference here.
REPAD = (
    (*_layout(), "--make-vocab-size-divisible-by", "8"),
    _layout(tp=2),
    "checkpoint saved at tp1 pp1 dp2 zero0; loading into tp2 pp1 dp1 zero0: weights "
    "re-sharded, vocabulary re-padded from 1008 to 1024 rows, optimizer state re-cut",
)


def _pretrain(world: int, root: str, run: str, flags: tuple[str, ...], *extra: object) -> dict:
    argv = [*TINY, *flags, *map(str, extra)]
    if "nvme" in flags:
        nvme = Path(root) / f"nvme_{run}"
        nvme.mkdir(exist_ok=True)
        argv += ["--offload-optimizer-nvme-path", str(nvme)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = pretrain(parse_megatron_args(argv, world_size=world))
    destroy_model_parallel()  # the next layout on these ranks builds its own groups
    return {
        "losses": summary.losses,
        "lines": summary.interval_lines,
        "stdout": out.getvalue(),
    }


def _jobs_rank(rank: int, world: int, root: str, jobs: list[tuple[str, str]]) -> dict:
    """Run ``jobs`` in turn on this world size: ("save", case) saves A's checkpoint at K,
    ("resume", case) runs B uninterrupted and B resumed from A's checkpoint, ("repad", name)
    runs :data:`REPAD`'s saved run to N and resumes its iteration K on the other padding."""
    out = {}
    for what, case in jobs:
        ckpt = f"{root}/{case}"
        if what == "repad":  # the saved run goes on to N; resume from its iteration K
            flags_a, flags_b, _ = REPAD
            saved = _pretrain(world, root, case, flags_a, "--save-interval", K, "--save", ckpt)
            if rank == 0:
                write_trackers(ckpt, tag_for_iteration(K))
            comm.barrier()
            resumed = _pretrain(world, root, f"{case}_resumed", flags_b, "--load", ckpt)
            out[case] = {"whole": saved, "resumed": resumed}
            continue
        (_, flags_a), (_, flags_b), _ = CASES[case]
        if what == "save":
            _pretrain(world, root, f"{case}_a", flags_a, "--exit-interval", K, "--save", ckpt)
        else:
            out[case] = {
                "whole": _pretrain(world, root, f"{case}_whole", flags_b),
                "resumed": _pretrain(world, root, f"{case}_resumed", flags_b, "--load", ckpt),
            }
    return out


RUNS = pytest.mark.xdist_group("resume_layouts")  # one set of spawns for every test here


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Per case, per rank of B: the uninterrupted and the resumed run."""
    root = str(tmp_path_factory.mktemp("resume_layouts"))
    phases = [
        (2, [("save", "dp2_zero2_to_dp4_zero1_cpu"), ("save", "dp2_zero3_nvme_to_tp2"),
             ("resume", "dp2_zero3_nvme_to_tp2"), ("repad", "repad")]),
        (4, [("save", "tp2pp2_zero1_to_tp1dp2_zero3"), ("resume", "dp2_zero2_to_dp4_zero1_cpu"),
             ("save", "tp1_to_tp2_virtual_stages"), ("resume", "tp1_to_tp2_virtual_stages")]),
        (2, [("resume", "tp2pp2_zero1_to_tp1dp2_zero3")]),
    ]  # fmt: skip
    results: dict[str, list[dict]] = {}
    for world, jobs in phases:
        per_rank = run_ranks(_jobs_rank, world, world, root, jobs, timeout=300)
        for case in per_rank[0]:
            results[case] = [r[case] for r in per_rank]
    return results


def _assert_continues(ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        whole, resumed = r["whole"]["losses"], r["resumed"]["losses"]
        assert sorted(resumed) == list(range(K + 1, N + 1)), f"rank {rank}: {resumed}"
        for it, loss in resumed.items():
            ref = whole[it]
            assert abs(loss - ref) <= TOL * abs(ref), f"rank {rank} iteration {it}: {loss} {ref}"


@RUNS
def test_tp2_pp2_zero1_resumes_on_tp1_dp2_zero3(runs):
    _assert_continues(runs["tp2pp2_zero1_to_tp1dp2_zero3"])


@RUNS
def test_dp2_zero2_resumes_on_dp4_zero1_with_cpu_offload(runs):
    _assert_continues(runs["dp2_zero2_to_dp4_zero1_cpu"])


@RUNS
def test_tp1_resumes_on_tp2_with_virtual_pipeline_stages(runs):
    _assert_continues(runs["tp1_to_tp2_virtual_stages"])


@RUNS
def test_zero3_nvme_offload_resumes_on_tp2(runs):
    _assert_continues(runs["dp2_zero3_nvme_to_tp2"])


@RUNS
def test_vocabulary_re_padded_continues_the_saved_run(runs):
    _assert_continues(runs["repad"])


_CARRIED = ("iteration", "consumed samples", "learning rate", "loss scale")


def _carried(line: str) -> dict[str, str]:
    """The fields of an iteration line that come from the checkpoint (not from this step)."""
    fields = dict(re.findall(r" ([a-z ]+): +(\S+) \|", line))
    fields["iteration"] = line.split("|")[0].split()[1]
    return {k: fields[k] for k in _CARRIED}


@RUNS
def test_schedule_data_position_and_loss_scale_continue(runs):
    for case, ranks in runs.items():
        for rank, r in enumerate(ranks):
            whole = [_carried(line) for line in r["whole"]["lines"]]
            resumed = [_carried(line) for line in r["resumed"]["lines"]]
            assert resumed == whole[K:], f"{case} rank {rank}"


@RUNS
def test_the_log_says_once_what_was_converted(runs):
    for case, ranks in runs.items():
        said = REPAD[2] if case == "repad" else CASES[case][2]
        logged = "".join(r["resumed"]["stdout"] for r in ranks)
        assert logged.count(said) == 1, f"{case}: {said!r} not logged once in\n{logged}"


def test_another_model_is_refused_listing_every_difference():
    saved = {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
        "seq_length": 16, "vocab_size": 1024, "orig_vocab_size": 1001, "hidden_dropout": 0.1,
        "bias": True, "sequence_parallel": False,
    }  # fmt: skip
    now = {
        **saved, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 512, "bias": False,
        # what a layout change may change, or what shapes no tensor: not differences
        "seq_length": 32, "vocab_size": 2048, "hidden_dropout": 0.0, "sequence_parallel": True,
    }  # fmt: skip
    meta = {"model": saved, "vocab": {"size": 1001, "padded_size": 1024}}
    with pytest.raises(CheckpointError) as e:
        refuse_other_model(
            meta, now, 1001, "ckpt/iter_0000001", "tp2 pp2 dp1 zero1", "tp1 pp1 dp2 zero3"
        )
    assert str(e.value) == (
        "ckpt/iter_0000001: the checkpoint holds another model than this run's (4 differences; "
        "a change of layout is carried over, from tp2 pp2 dp1 zero1 to tp1 pp1 dp2 zero3, a "
        "change of model is not):\n"
        "    bias: True in the checkpoint vs False now (--bias)\n"
        "    ffn_hidden_size: 256 in the checkpoint vs 512 now (--ffn-hidden-size)\n"
        "    hidden_size: 64 in the checkpoint vs 128 now (--hidden-size)\n"
        "    num_layers: 2 in the checkpoint vs 4 now (--num-layers)\n"
        "  -> pass --ffn-hidden-size 256 --hidden-size 64 --num-layers 2 (the checkpoint's "
        "metadata.json has its model config and tokenizer), or start without --load"
    )
