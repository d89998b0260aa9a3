"""``zerotron pretrain --load`` of a checkpoint Megatron-LM wrote (megatron-core's files in
tests/fixtures/megatron/: per-rank mcore and legacy files, and torch_dist, at tensor x pipeline
parallel 2 x 2 or 1), in process on mock data.

The reference is the conversion ``zerotron convert --from-megatron`` makes, whose logits
tests/test_megatron_checkpoint.py checks against megatron-core's own: loading the Megatron
checkpoint directly must train exactly as loading its conversion.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zerotron.checkpoint.megatron_import import import_megatron
from zerotron.config import parse_megatron_args
from zerotron.errors import CheckpointError, ConfigError
from zerotron.training.loop import TrainSummary
from zerotron.training.pretrain import checkpoint_args, pretrain

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"
MCORE = FIXTURES / "mcore_tp2pp2"

# The fixtures' model (fixtures.json "config"); NullTokenizer with 59 ids (+ EOD) padded to 64.
MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "59",
    "--make-vocab-size-divisible-by", "32",
]  # fmt: skip
RUN = [
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--log-interval", "1",
    "--seed", "1234", "--num-workers", "0",
]  # fmt: skip


def run(*extra: object, model: list[str] = MODEL) -> TrainSummary:
    return pretrain(parse_megatron_args([*model, *RUN, *map(str, extra)]))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The mcore fixture converted by ``zerotron convert --from-megatron``."""
    out = tmp_path_factory.mktemp("converted") / "ckpt"
    import_megatron(MCORE, out)
    return out


@pytest.fixture(scope="module")
def reference(converted) -> TrainSummary:
    return run("--load", converted, "--finetune")


@pytest.mark.parametrize("layout", ["mcore_tp2pp2", "torch_dist_tp2pp2", "legacy_tp1"])
def test_finetune_from_a_megatron_checkpoint_trains_as_from_its_conversion(reference, layout):
    summary = run("--load", FIXTURES / layout, "--finetune")
    assert sorted(summary.losses) == [1, 2, 3]
    assert summary.losses == reference.losses  # bitwise


def test_the_weights_are_megatrons_not_the_initial_ones(reference):
    assert run().losses[1] != reference.losses[1]


def test_no_load_optim_goes_on_from_megatrons_iteration_and_samples():
    """The fixtures were saved at iteration 7 after 56 samples (Megatron's args: 7 x 8)."""
    flags = ("--no-load-optim", "--no-load-rng", "--train-iters", 9, "--global-batch-size", 8)
    summary = run("--load", MCORE, *flags)
    assert sorted(summary.losses) == [8, 9]
    assert summary.state.iteration == 9
    assert summary.state.consumed_train_samples == 56 + 2 * 8


@pytest.mark.parametrize("flags", [(), ("--no-load-optim",)], ids=["resume", "rng"])
def test_megatrons_optimizer_or_rng_state_is_not_pretended(flags):
    with pytest.raises(CheckpointError, match="written by Megatron-LM") as e:
        run("--load", MCORE, *flags)
    assert "--finetune" in e.value.fix and "--no-load-optim --no-load-rng" in e.value.fix


def test_another_model_than_the_checkpoints_is_refused_naming_the_flag():
    model = [a if a != "32" else "64" for a in MODEL]  # --hidden-size 64
    with pytest.raises(CheckpointError, match="hidden_size: 32 in the checkpoint vs 64") as e:
        run("--load", MCORE, "--finetune", model=model)
    assert "--hidden-size 32" in e.value.fix


def test_use_checkpoint_args_reads_megatrons_args(reference, converted):
    argv = [*RUN, "--load", str(MCORE), "--finetune", "--use-checkpoint-args"]
    cfg = parse_megatron_args(argv, checkpoint_args=checkpoint_args)
    m, d = cfg.model, cfg.data
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (
        2,
        32,
        4,
        128,
    )
    assert (m.seq_length, m.max_position_embeddings) == (16, 16)
    assert (d.tokenizer_type, d.vocab_size) == ("NullTokenizer", 59)
    # the default vocabulary padding (128 rows, not Megatron's 64): the real rows are the same
    assert pretrain(cfg).losses == run("--load", converted, "--finetune", model=MODEL[:-2]).losses


def _parallel_sizes(*flags: str) -> tuple[int, int]:
    argv = [*RUN, "--global-batch-size", "8", "--load", str(MCORE), "--finetune",
            "--use-checkpoint-args", *flags]  # fmt: skip
    p = parse_megatron_args(argv, world_size=4, checkpoint_args=checkpoint_args).parallel
    return p.tensor_model_parallel_size, p.pipeline_model_parallel_size


def test_use_mp_args_from_checkpoint_args_takes_megatrons_parallel_sizes_over_the_flags():
    mp_args = ("--use-mp-args-from-checkpoint-args", "--tensor-model-parallel-size", "4")
    assert _parallel_sizes(*mp_args) == (2, 2)  # the checkpoint's, as Megatron forces them
    assert _parallel_sizes() == (1, 1)  # --use-checkpoint-args alone takes the model only


def test_use_mp_args_from_checkpoint_args_needs_use_checkpoint_args():
    with pytest.raises(ConfigError, match="use_checkpoint_args is not set"):
        parse_megatron_args([*MODEL, *RUN, "--use-mp-args-from-checkpoint-args"])


def test_checkpoint_verify_says_a_megatron_checkpoint_looks_like_megatrons():
    from zerotron.checkpoint.checkpoint_cli import main as checkpoint_main

    with pytest.raises(CheckpointError, match="laid out as Megatron-LM writes them") as e:
        checkpoint_main(["verify", str(MCORE)])
    assert "--from-megatron" in e.value.fix and "--finetune" in e.value.fix


def test_checkpoint_verify_calls_a_torch_dist_checkpoint_megatrons(capsys):
    from zerotron.checkpoint.checkpoint_cli import main as checkpoint_main

    assert checkpoint_main(["verify", str(FIXTURES / "torch_dist_tp2pp2")]) != 0
    assert "written by Megatron-LM (torch_dist), not by zerotron" in capsys.readouterr().out


@pytest.mark.parametrize(
    "layout, fmt, tp, pp",
    [("mcore_tp2pp2", "mcore", 2, 2), ("torch_dist_tp2pp2", "torch_dist", 2, 2),
     ("legacy_tp1", "legacy", 1, 1)],
)  # fmt: skip
def test_checkpoint_info_describes_a_megatron_checkpoint(layout, fmt, tp, pp):
    from zerotron.checkpoint.info import checkpoint_info

    info = checkpoint_info(FIXTURES / layout)
    assert (info["writer"], info["format"], info["iteration"]) == ("Megatron-LM", fmt, 7)
    lay = info["layout"]
    assert (lay["tensor_model_parallel_size"], lay["pipeline_model_parallel_size"]) == (tp, pp)
    assert info["model"]["hidden_size"] == 32 and info["model"]["num_layers"] == 2
    assert info["vocab"] == {"size": 60, "padded_size": 64}
    assert info["progress"]["consumed_train_samples"] == 56
    assert info["total_size"] == sum(
        p.stat().st_size for p in (FIXTURES / layout).rglob("*") if p.is_file() and
        p.parent != FIXTURES / layout
    )  # fmt: skip


def test_checkpoint_info_prints_what_reads_a_megatron_checkpoint(capsys):
    from zerotron.checkpoint.checkpoint_cli import main as checkpoint_main

    assert checkpoint_main(["info", str(MCORE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Megatron-LM mcore checkpoint ")
    assert "zerotron convert --from-megatron DIR" in out and "--finetune" in out


@pytest.mark.parametrize("layout", ["mcore_tp2pp2", "torch_dist_tp2pp2", "legacy_tp1"])
def test_generate_reads_a_megatron_checkpoint_as_its_conversion(converted, capsys, layout):
    from zerotron.inference.cli import main as generate_main

    def text(load: Path) -> str:
        generate_main(["--load", str(load), "--prompt", "1 2 3", "--greedy",
                       "--max-new-tokens", "8"])  # fmt: skip
        return capsys.readouterr().out

    assert text(FIXTURES / layout) == text(converted) != ""
