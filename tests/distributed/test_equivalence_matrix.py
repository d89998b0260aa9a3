"""Issue 4's equivalence matrix: ``zerotron pretrain`` on every parallel layout equals one process.

A tiny GPT-2 (4 layers, so pp4 holds one layer per stage; hidden 64, 4 heads, sequence 16, fp32,
dropout 0) trains for 5 steps on the first 20 documents of the bundled corpus with a global batch
of 8 (micro-batch 1): 8 micro-batches per step in one process and on the pipeline layouts, 4 per
data-parallel rank under dp2. Each layout runs through ``pretrain(cfg)`` on gloo ranks, the
reference once in this process. Checked against the reference, within 1e-5 relative:

- the loss of each of the 5 steps on every rank, and the validation loss;
- the final weights, read back from the layout's checkpoint (one file per (tensor, pipeline)
  rank, shards concatenated, the last stage's tied-embedding copy checked too), per tensor.

Every layout pads the vocabulary to the same 50432 rows (``--make-vocab-size-divisible-by``
256 / tp): the same full weights at the start whatever the padding rules do.

Optimizer: AdamW (Megatron's ``adam``, weight decay 0.1) with gradient clipping at 0.5, below
every step's gradient norm (2.6 falling to 1.2), so every step clips; the logged gradient norm
(the global one: TP shards, pipeline stages and the tied embedding counted once) must match the
single process's to its printed digits on every rank. ``precision.grads`` sums the norm's squares
in fp64, so no layout's norm drifts (with torch's fp32 norm, TP layouts differed by ~2e-5).

Adam's epsilon is 1e-6, not 1e-8. Adam divides each update by the gradient's running RMS, so a
gradient element that is pure rounding noise (the attention key bias has a mathematically zero
gradient: softmax ignores a constant added to every score; TP, DP and pipeline layouts sum in
another order) becomes an update of up to the full learning rate with arbitrary sign when its
noise (~1e-10) is not small against epsilon, and no per-tensor tolerance honestly covers that
(with 1e-8 the key biases differ by ~1e-4 relative, every other tensor is within 1e-5). With
1e-6 such noise moves a weight by ~1e-4 of a real update and every tensor matches within 1e-5;
the real gradients of this model (~1e-4 after clipping) are still mostly above epsilon, and
every layout and the reference use the same value. Each weight comparison also reports how far
the reference weights moved, so a tolerance cannot pass merely because nothing changed.

Cost: one spawn per world size (2, 4 and 8 ranks), each rank running that size's layouts one
after another (process groups destroyed between them); 2 ranks also check pp2 save and exact
resume, and ``--mock-data`` on tp2, pp2 and dp2 with ZeRO stage 2 (losses and gradient norms
against one process on mock data).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint import load_file, model_file, model_files, tag_for_iteration
from zerotron.config import parse_megatron_args
from zerotron.distributed.state import destroy_model_parallel
from zerotron.errors import ConfigError
from zerotron.training.build import build_run
from zerotron.training.pretrain import pretrain

from .spawn import run_ranks

REPO = Path(__file__).resolve().parents[2]
ITERS = 5
TOL = 1e-5
PADDED_VOCAB_MULTIPLE = 256  # --make-vocab-size-divisible-by 256 / tp: 50432 rows everywhere
WORD_EMBEDDING = "embedding.word_embeddings.weight"
TIED_COPY = "output_layer.weight"
CLIP = 0.5  # below every step's gradient norm (2.6 .. 1.2): every step clips
EPS = "1e-6"  # Adam's epsilon, see the module docstring

TINY = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--optimizer", "adam", "--lr", "1e-3", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--clip-grad", str(CLIP), "--adam-eps", EPS,  # see the docstring
    "--split", "80,10,10", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--seed", "1234", "--train-iters", str(ITERS), "--save-interval", "1000",
    "--num-workers", "0",  # test ranks are daemons: no loader workers
]  # fmt: skip

TP2 = ("--tensor-model-parallel-size", "2")
PP2 = ("--pipeline-model-parallel-size", "2")
# name -> (world size, flags)
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "dp2": (2, ()),
    "tp2": (2, TP2),
    "tp2_sp": (2, (*TP2, "--sequence-parallel")),
    "pp2_1f1b": (2, PP2),
    "pp2_interleaved_v2": (2, (*PP2, "--num-layers-per-virtual-pipeline-stage", "1")),
    "pp4_gpipe": (4, ("--pipeline-model-parallel-size", "4", "--pipeline-schedule", "gpipe")),
    "dp2_tp2": (4, TP2),
    "tp2_pp2": (4, (*TP2, *PP2)),
    "dp2_pp2": (4, PP2),
    "dp2_tp2_pp2": (8, (*TP2, *PP2)),
}


# --mock-data (synthetic documents, zerotron.data.mock) trains every layout as one process does:
# the same 5 losses, validation loss and gradient norms (weights are compared on the corpus
# layouts above). Run in the two-rank spawn: no process start of their own. Their vocabulary is
# Megatron's NullTokenizer --vocab-size 1000 (1001 ids with EOD, 1024 rows): a small embedding.
MOCK_DATA = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000")
MOCK_LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "mock_tp2": (2, TP2),
    "mock_pp2": (2, PP2),
    "mock_dp2_zero2": (2, ("--zero-stage", "2")),
}


def _sizes(flags: tuple[str, ...]) -> tuple[int, int]:
    """(tp, pp) of a layout's flags."""
    get = {k: int(v) for k, v in zip(flags, flags[1:]) if k.endswith("parallel-size")}
    return get.get("--tensor-model-parallel-size", 1), get.get("--pipeline-model-parallel-size", 1)


def _argv(data: str | None, flags: tuple[str, ...], *extra: object) -> list[str]:
    """A layout's flags on ``data`` (None: on --mock-data)."""
    tp, _ = _sizes(flags)
    padding = ("--make-vocab-size-divisible-by", str(PADDED_VOCAB_MULTIPLE // tp))
    source = MOCK_DATA if data is None else ("--data-path", data)
    return [*TINY, *source, *padding, *flags, *map(str, extra)]


def _pretrain(world: int, argv: list[str]):
    with contextlib.redirect_stdout(io.StringIO()):
        summary = pretrain(parse_megatron_args(argv, world_size=world))
    destroy_model_parallel()  # the next layout on these ranks builds its own groups
    norms = [re.search(r"grad norm: (\S+) \|", line) for line in summary.interval_lines]
    return {
        "losses": summary.losses,
        "valid": summary.valid_loss,
        "grad_norms": [m.group(1) if m else None for m in norms],
    }


def _layouts_rank(rank: int, world: int, data: str, root: str, resume: bool) -> dict:
    """Every layout of this world size in turn (and, if asked, pp2 save + resume)."""
    out = {}
    for name, (size, flags) in LAYOUTS.items():
        if size == world:
            out[name] = _pretrain(world, _argv(data, flags, "--save", f"{root}/{name}"))
    if resume:  # the two-rank spawn: also the mock-data layouts
        for name, (_, flags) in MOCK_LAYOUTS.items():
            out[name] = _pretrain(world, _argv(None, flags))
        parts = f"{root}/pp2_parts"
        out["first"] = _pretrain(world, _argv(data, PP2, "--save", parts, "--exit-interval", 3))
        out["second"] = _pretrain(world, _argv(data, PP2, "--load", parts, "--save", parts))
    return out


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory) -> dict:
    """The single-process run: losses, validation loss, initial and final weights."""
    root = tmp_path_factory.mktemp("single")
    argv = _argv(data_prefix, (), "--save", root)
    with contextlib.redirect_stdout(io.StringIO()):
        initial = build_run(parse_megatron_args(argv, world_size=1)).model.state_dict()
    result = _pretrain(1, argv)
    final = load_file(root, tag_for_iteration(ITERS), model_file())["model"]
    assert len(result["grad_norms"]) == ITERS
    assert all(float(n) > CLIP for n in result["grad_norms"])  # every step clips
    return {**result, "initial": initial, "final": final}


@pytest.fixture(scope="module")
def mock_reference() -> dict:
    """The single-process run on --mock-data."""
    return _pretrain(1, _argv(None, ()))


def _run_world(world: int, data: str, root: Path, resume: bool = False) -> list[dict]:
    return run_ranks(_layouts_rank, world, world, data, str(root), resume, timeout=280)


# ---- comparisons ------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _assemble(root: Path, tp: int, pp: int, like: dict[str, torch.Tensor]) -> dict:
    """The full model from a layout's per-(tp, pp) files; TP shards concatenated along the one
    dimension where they are 1/tp of the reference, replicated tensors checked equal first."""
    tag = tag_for_iteration(ITERS)
    full: dict[str, torch.Tensor] = {}
    for p in range(pp):
        shards = [load_file(root, tag, model_file(t, p, pp))["model"] for t in range(tp)]
        for key in shards[0]:
            parts = [s[key] for s in shards]
            ref = like[WORD_EMBEDDING if key == TIED_COPY else key]
            if parts[0].shape == ref.shape:
                for t, other in enumerate(parts[1:], 1):
                    assert _rel(other, parts[0]) <= TOL, f"{key}: tp rank {t} vs 0 (replicated)"
                full[key] = parts[0]
            else:
                (dim,) = [d for d, (n, m) in enumerate(zip(parts[0].shape, ref.shape)) if n != m]
                full[key] = torch.cat(parts, dim=dim)
    return full


def _check_losses(name: str, results: list[dict], ref: dict) -> tuple[list[str], float]:
    """Every rank's step losses, validation loss and grad norms against the reference's."""
    problems = []
    steps = sorted(ref["losses"])
    assert steps == list(range(1, ITERS + 1))
    loss_err = 0.0
    for rank, r in enumerate(results):
        got = r[name]
        if sorted(got["losses"]) != steps:
            problems.append(f"{name} rank {rank}: iterations {sorted(got['losses'])}")
            continue
        for i in steps:
            loss_err = max(loss_err, abs(got["losses"][i] - ref["losses"][i]) / ref["losses"][i])
        loss_err = max(loss_err, abs(got["valid"] - ref["valid"]) / ref["valid"])
    if loss_err > TOL:
        problems.append(f"{name}: losses differ by {loss_err:.3g} relative")
    for rank, r in enumerate(results):
        if r[name]["grad_norms"] != ref["grad_norms"]:
            problems.append(f"{name} rank {rank}: grad norms {r[name]['grad_norms']}")
    return problems, loss_err


def _check_layout(name: str, results: list[dict], root: Path, ref: dict) -> list[str]:
    """Compare one layout with the reference; returns what failed, prints the differences."""
    world, flags = LAYOUTS[name]
    tp, pp = _sizes(flags)
    problems, loss_err = _check_losses(name, results, ref)
    meta = json.loads((root / name / tag_for_iteration(ITERS) / "metadata.json").read_text())
    if sorted(meta["files"]) != sorted(model_files(tp, pp)):
        problems.append(f"{name}: checkpoint files {meta['files']}")
    full = _assemble(root / name, tp, pp, ref["final"])
    expected = set(ref["final"]) | ({TIED_COPY} if pp > 1 else set())
    if set(full) != expected:
        problems.append(f"{name}: tensors {sorted(set(full) ^ expected)} differ in presence")
    worst, worst_key, moved, of_update = 0.0, "", 1.0, 0.0
    for key, t in full.items():
        base = WORD_EMBEDDING if key == TIED_COPY else key
        final, initial = ref["final"][base], ref["initial"][base]
        err = _rel(t, final)
        if err > worst:
            worst, worst_key = err, key
        moved = min(moved, _rel(initial, final))
        # The difference measured against how far training moved the tensor.
        of_update = max(of_update, float((t - final).norm() / (final - initial).norm()))
        if err > TOL:
            problems.append(f"{name}: {key} differs by {err:.3g} relative")
    print(
        f"{name:20s} world {world}: max rel loss diff {loss_err:.1e}, max rel weight diff "
        f"{worst:.1e} ({worst_key}), max diff / update {of_update:.1e}; "
        f"least-moved tensor moved {moved:.1e} of its norm"
    )
    return problems


def _check_results(world: int, results: list[dict], root: Path, ref: dict) -> None:
    """Every layout of this world size against the reference; all differences in one failure."""
    problems = []
    for name, (size, _) in LAYOUTS.items():
        if size == world:
            problems += _check_layout(name, results, root, ref)
    assert not problems, "\n".join(problems)


def _check_world(world: int, data: str, root: Path, ref: dict) -> None:
    _check_results(world, _run_world(world, data, root), root, ref)


# ---- tests ------------------------------------------------------------------------------------


TWO_RANKS = pytest.mark.xdist_group("matrix_two_ranks")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def two_ranks(data_prefix, tmp_path_factory) -> tuple[list[dict], Path]:
    """dp2, tp2, tp2+sp, pp2 1F1B, pp2 interleaved (v=2); pp2 stopped at 3 and resumed."""
    root = tmp_path_factory.mktemp("two_ranks")
    return _run_world(2, data_prefix, root, resume=True), root


@TWO_RANKS
def test_two_ranks_dp_tp_sp_pp_equal_one_process(two_ranks, reference):
    results, root = two_ranks
    _check_results(2, results, root, reference)


@TWO_RANKS
def test_mock_data_trains_tp2_pp2_dp2_zero2_as_one_process(two_ranks, mock_reference):
    """--mock-data needs no corpus, and every layout reads the samples one process reads."""
    results, _ = two_ranks
    assert len(mock_reference["losses"]) == ITERS
    problems = []
    for name in MOCK_LAYOUTS:
        found, loss_err = _check_losses(name, results, mock_reference)
        print(f"{name:20s} world 2: max rel loss diff {loss_err:.1e}")
        problems += found
    assert not problems, "\n".join(problems)


@TWO_RANKS
def test_pp2_resume_is_exact(two_ranks):
    """Resume on the same layout is exact: the losses and the final files, bit for bit."""
    results, root = two_ranks
    for r in results:
        assert sorted(r["first"]["losses"]) == [1, 2, 3]
        assert sorted(r["second"]["losses"]) == [4, 5]
        assert {**r["first"]["losses"], **r["second"]["losses"]} == r["pp2_1f1b"]["losses"]
        assert r["second"]["valid"] == r["pp2_1f1b"]["valid"]
    tag = tag_for_iteration(ITERS)
    for f in model_files(1, 2):
        whole = load_file(root / "pp2_1f1b", tag, f)
        parts = load_file(root / "pp2_parts", tag, f)
        for key in ("model", "optimizer", "opt_param_scheduler", "rng_state", "iteration"):
            _assert_same(whole[key], parts[key], f"{f}/{key}")


def test_four_ranks_pp4_gpipe_and_products(data_prefix, reference, tmp_path):
    """pp4 GPipe (one layer per stage), dp2×tp2, tp2×pp2, dp2×pp2."""
    _check_world(4, data_prefix, tmp_path, reference)


def test_eight_ranks_dp2_tp2_pp2(data_prefix, reference, tmp_path):
    _check_world(8, data_prefix, tmp_path, reference)


def test_pipeline_schedule_flag():
    """1F1B by default, interleaved with virtual stages, GPipe on request; bad mixes refused."""

    def schedule(world: int, *flags: str) -> str | None:
        return parse_megatron_args(_argv("d", flags), world_size=world).parallel.pipeline_schedule

    assert schedule(1) is None
    assert schedule(2, *PP2) == "1f1b"
    assert schedule(2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1") == "interleaved"
    assert schedule(4, "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "gpipe") == (
        "gpipe"
    )
    with pytest.raises(ConfigError, match="needs virtual pipeline stages"):
        schedule(2, *PP2, "--pipeline-schedule", "interleaved")
    with pytest.raises(ConfigError, match="one model chunk per stage"):
        schedule(2, *PP2, "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule",
                 "gpipe")  # fmt: skip
    # dp2 × 3 micro-batches: the interleaved schedule needs a multiple of pp (2).
    with pytest.raises(ConfigError, match="divisible by pipeline_model_parallel_size 2"):
        schedule(
            4, *PP2, "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"
        )


def _assert_same(a: object, b: object, path: str) -> None:
    """Nested dicts/lists of tensors and plain values are bitwise equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path
