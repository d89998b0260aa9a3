"""Megatron-DeepSpeed's own checkpoints (tests/fixtures/megatron_deepspeed/, written by its
``pretrain_gpt.py`` under DeepSpeed: the pipeline engine at TP=2 x PP=2, ``--no-pipeline-parallel``
at TP=2, and the latter at its last commit, whose fused QKV rows are ordered differently, alone
and at TP=2 x DP=2 under ZeRO 2, and the pipeline engine at its last commit in bf16; their
optimizer state: test_megatron_deepspeed_optim.py).

fixtures.json has Megatron-DeepSpeed's logits on fixed tokens, computed by the model it had just
saved; no DeepSpeed is needed here. The commands (``convert --from-megatron``, ``pretrain
--load``, ``generate --load``, ``checkpoint info``) take them as they take Megatron-LM's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_megatron_checkpoint import assert_same_cut, files_read
from zerotron.checkpoint import megatron_io
from zerotron.checkpoint.megatron import _flatten, read_megatron
from zerotron.checkpoint.megatron_export import export_megatron
from zerotron.checkpoint.megatron_import import import_megatron
from zerotron.checkpoint.megatron_rank import megatron_weights_for
from zerotron.config import parse_megatron_args
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.models.gpt import GPT
from zerotron.training.loop import TrainSummary
from zerotron.training.pretrain import checkpoint_args, pretrain

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_deepspeed"
EXPECTED = json.loads((FIXTURES / "fixtures.json").read_text())
NAMES = list(EXPECTED["fixtures"])
PIPE, NOPIPE, FPDT = (FIXTURES / n for n in ("pipe_tp2pp2", "nopipe_tp2", "fpdt_nopipe_tp2"))
TAG = "global_step3"

# The fixtures' model: Megatron-DeepSpeed's flags in fixtures.json ("model_flags").
MODEL = EXPECTED["model_flags"]
RUN = [
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--log-interval", "1",
    "--seed", "1234", "--num-workers", "0",
]  # fmt: skip


def _logits(source: Path) -> torch.Tensor:
    """zerotron's GPT with the imported weights, on the fixtures' tokens (the real vocabulary)."""
    config, state, _ = read_megatron(source)
    model = GPT(config).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        out = model(torch.tensor(EXPECTED["text"])[:, :-1])
    return out[..., : config.orig_vocab_size]


def _theirs(name: str) -> torch.Tensor:
    vocab = int(EXPECTED["model_flags"][EXPECTED["model_flags"].index("--vocab-size") + 1])
    return torch.tensor(EXPECTED["fixtures"][name]["logits"])[..., : vocab + 1]  # + EOD


@pytest.mark.parametrize("name", NAMES)
def test_import_gives_megatron_deepspeeds_logits(name):
    # The bf16 run's logits came from bf16 arithmetic (ours: fp32 on its bf16 weights): they
    # differ by about one bf16 step (2^-8 at logits near 1; measured 4.4e-3); a misplaced
    # tensor or QKV row moves them by more than 0.1.
    atol = 1e-2 if name.endswith("_bf16") else 1e-5
    torch.testing.assert_close(_logits(FIXTURES / name), _theirs(name), rtol=0, atol=atol)


def test_import_says_who_wrote_it_and_how():
    found = {n: read_megatron(FIXTURES / n)[2] for n in NAMES}
    assert {
        n: (i["writer"], i["format"], i["tensor_parallel"], i["pipeline_parallel"], i["iteration"])
        for n, i in found.items()
    } == {
        "pipe_tp2pp2": ("Megatron-DeepSpeed", "pipeline-engine", 2, 2, 3),
        "nopipe_tp2": ("Megatron-DeepSpeed", "no-pipeline-parallel", 2, 1, 3),
        "fpdt_nopipe_tp2": ("Megatron-DeepSpeed", "no-pipeline-parallel", 2, 1, 3),
        "fpdt_nopipe_tp2dp2_zero2": ("Megatron-DeepSpeed", "no-pipeline-parallel", 2, 1, 3),
        "fpdt_pipe_tp2pp2_bf16": ("Megatron-DeepSpeed", "pipeline-engine", 2, 2, 3),
    }
    assert {i["consumed_train_samples"] for i in found.values()} == {12}  # 3 x 4


def test_a_global_step_directory_reads_as_its_save_directory():
    torch.testing.assert_close(_logits(PIPE / TAG), _logits(PIPE), rtol=0, atol=0)


def _rewrite_args(src: Path, dst: Path, change) -> Path:
    """A copy of ``src`` whose model-states files' args went through ``change``."""
    shutil.copytree(src, dst)
    for file in (dst / TAG).glob("mp_rank_*_model_states.pt"):
        loaded = megatron_io.load_safe(file)
        args = vars(loaded["args"]).copy()
        change(args)
        loaded["args"] = argparse.Namespace(**args)
        torch.save(loaded, file)
    return dst


def test_the_fpdt_flag_in_the_args_decides_the_qkv_order(tmp_path):
    """Without ``ds_sequence_parallel_fpdt`` in its args the last commit's checkpoint would be
    read with the older per-head order, and its logits would not be Megatron-DeepSpeed's."""
    older = _rewrite_args(FPDT, tmp_path / "older", lambda a: a.pop("ds_sequence_parallel_fpdt"))
    assert (_logits(older) - _theirs(FPDT.name)).abs().max() > 0.1


def test_a_missing_layer_file_is_refused(tmp_path):
    copy = shutil.copytree(PIPE, tmp_path / "ckpt")
    (copy / TAG / "layer_03-model_01-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="layer files are missing: layer_03-model_01-"):
        read_megatron(copy)


def test_zero_stage_3_weights_are_refused_with_what_to_do(tmp_path):
    copy = shutil.copytree(NOPIPE, tmp_path / "ckpt")
    file = copy / TAG / "mp_rank_00_model_states.pt"
    loaded = megatron_io.load_safe(file)
    loaded["ds_config"]["zero_optimization"]["stage"] = 3
    torch.save(loaded, file)
    with pytest.raises(UnsupportedError, match="ZeRO stage 3") as e:
        read_megatron(copy)
    assert "zero_to_fp32" in e.value.fix


def test_a_grouped_query_model_is_refused(tmp_path):
    gqa = _rewrite_args(NOPIPE, tmp_path / "gqa", lambda a: a.update(num_key_value_heads=2))
    with pytest.raises(UnsupportedError, match="num_key_value_heads=2"):
        read_megatron(gqa)


def _layer(i: int, t: int) -> str:
    return f"layer_0{i}-model_0{t}-model_states.pt"


@pytest.mark.parametrize(
    "name, rank, layout, files",
    [
        # its own layout: the rank's tensor rank, its stage's layer (1) and the ends (01, 04)
        ("pipe_tp2pp2", (1, 1), (2, 2), [_layer(1, 1), _layer(3, 1), _layer(4, 1)]),
        # another tensor size: the stage's layer (0) of every tensor rank
        ("pipe_tp2pp2", (0, 0), (1, 2), [_layer(i, t) for i in (1, 2, 4) for t in (0, 1)]),
        ("nopipe_tp2", (1, 1), (2, 2), ["mp_rank_01_model_states.pt"]),
    ],
)
def test_a_run_reads_only_the_files_of_its_part(monkeypatch, name, rank, layout, files):
    read = files_read(monkeypatch, name=lambda path: path.name)
    (t, p), (tp, pp) = rank, layout
    own, _, _ = megatron_weights_for(FIXTURES / name, t, tp, p, pp, padded_vocab_size=64)
    assert sorted(read) == sorted(files)
    assert_same_cut(own, read_megatron(FIXTURES / name)[1], t, tp, p, pp)


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1), (4, 2)])
def test_every_rank_of_any_layout_gets_the_full_reads_weights(tp, pp):
    _, full, _ = read_megatron(PIPE)
    for t in range(tp):
        for p in range(pp):
            own, _, _ = megatron_weights_for(PIPE, t, tp, p, pp, padded_vocab_size=64)
            assert_same_cut(own, full, t, tp, p, pp)


def test_generated_null_tokenizer_text_keeps_the_prompt_and_the_new_ids_apart(capsys):
    from zerotron.inference.cli import main as generate_main

    generate_main(["--load", str(PIPE), "--prompt", "1 2 3", "--greedy", "--max-new-tokens", "8"])
    ids = capsys.readouterr().out.split()
    assert ids[:3] == ["1", "2", "3"] and 3 < len(ids) <= 11
    assert all(0 <= int(i) <= 60 for i in ids)  # "325" would be no id of this vocabulary


# ---- the commands ------------------------------------------------------------------------------


def run(*extra: object) -> TrainSummary:
    return pretrain(parse_megatron_args([*MODEL, *RUN, *map(str, extra)]))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The pipeline fixture converted by ``zerotron convert --from-megatron``."""
    out = tmp_path_factory.mktemp("converted") / "ckpt"
    import_megatron(PIPE, out)
    return out


@pytest.mark.parametrize("name", ["pipe_tp2pp2", "nopipe_tp2"])
def test_pretrain_finetunes_from_it_as_from_its_conversion(converted, name, tmp_path):
    conversion = converted if name == PIPE.name else tmp_path / "ckpt"
    if name != PIPE.name:
        import_megatron(FIXTURES / name, conversion)
    summary = run("--load", FIXTURES / name, "--finetune")
    assert sorted(summary.losses) == [1, 2, 3]
    assert summary.losses == run("--load", conversion, "--finetune").losses  # bitwise


def test_no_load_optim_goes_on_from_its_iteration_and_samples():
    summary = run("--load", PIPE, "--no-load-optim", "--no-load-rng", "--train-iters", 5)
    assert sorted(summary.losses) == [4, 5]
    assert summary.state.consumed_train_samples == 12 + 2 * 4


def test_its_optimizer_state_is_not_pretended():
    """A ZeRO-0 fp32 run keeps its optimizer state in the model-states files, not read: the run
    stops and says how to go on (ZeRO runs' partitions are read: the next test file)."""
    with pytest.raises(CheckpointError, match="written by Megatron-DeepSpeed") as e:
        run("--load", NOPIPE)
    assert "--finetune" in e.value.fix


def test_use_checkpoint_args_reads_its_args():
    argv = [*RUN, "--load", str(NOPIPE), "--finetune", "--use-checkpoint-args"]
    m = parse_megatron_args(argv, checkpoint_args=checkpoint_args).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (
        2,
        64,
        4,
        128,
    )


def test_generate_reads_it_as_its_conversion(converted, capsys):
    from zerotron.inference.cli import main as generate_main

    def text(load: Path) -> str:
        generate_main(["--load", str(load), "--prompt", "1 2 3", "--greedy",
                       "--max-new-tokens", "8"])  # fmt: skip
        return capsys.readouterr().out

    assert text(PIPE) == text(converted) != ""


def test_checkpoint_verify_says_megatron_deepspeed_wrote_it():
    from zerotron.checkpoint.checkpoint_cli import main as checkpoint_main

    with pytest.raises(CheckpointError, match="written by Megatron-DeepSpeed, not by") as e:
        checkpoint_main(["verify", str(NOPIPE)])
    assert "--from-megatron" in e.value.fix


@pytest.mark.parametrize(
    "source, fmt", [(PIPE, "pipeline-engine"), (NOPIPE, "no-pipeline-parallel")]
)
def test_checkpoint_info_describes_it(source, fmt):
    from zerotron.checkpoint.info import checkpoint_info

    info = checkpoint_info(source)
    assert (info["writer"], info["format"], info["tag"]) == ("Megatron-DeepSpeed", fmt, TAG)
    assert info["progress"] == {
        "iteration": 3,
        "consumed_train_samples": 12,
        "consumed_train_tokens": 12 * 16,
    }
    assert info["model"]["hidden_size"] == 64 and info["vocab"]["padded_size"] == 64


# ---- zerotron's checkpoints out as Megatron-DeepSpeed's -----------------------------------------


def _export(converted: Path, out: Path, tp: int, pp: int, qkv: str = "per-head") -> Path:
    return export_megatron(converted, out, "megatron-deepspeed", tp, pp, qkv_order=qkv)


def test_an_export_holds_megatron_deepspeeds_own_tensors(converted, tmp_path):
    """Imported and exported at its own layout, the pipeline fixture's layer files come back
    with the same names, shapes and values as Megatron-DeepSpeed wrote them."""
    out = _export(converted, tmp_path / "out", 2, 2)
    ours = sorted(f.name for f in out.glob("layer_*"))
    assert ours == sorted(f.name for f in (PIPE / TAG).glob("layer_*"))
    for name in ours:
        theirs, mine = (megatron_io.load_safe(d / name) for d in (PIPE / TAG, out))
        assert list(mine) == list(theirs)
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_an_export_names_its_files_and_trackers_as_deepspeed_does(converted, tmp_path):
    out = _export(converted, tmp_path / "out", 2, 2)
    assert out.name == TAG and (out.parent / "latest").read_text() == TAG
    assert (out.parent / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(f.name for f in out.glob("mp_rank_*")) == sorted(
        f.name for f in (PIPE / TAG).glob("mp_rank_*")
    )
    states = megatron_io.load_safe(out / "mp_rank_03_model_states.pt")
    assert states["module"] is None and states["iteration"] == 3
    args = states["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.num_key_value_heads == args.num_attention_heads == 4  # compared by its loader


@pytest.mark.parametrize("qkv", ["per-head", "blocks"])
@pytest.mark.parametrize("tp, pp", [(2, 2), (2, 1), (1, 1)])
def test_an_export_reads_back_with_megatron_deepspeeds_logits(converted, tmp_path, tp, pp, qkv):
    out = _export(converted, tmp_path / "out", tp, pp, qkv)
    torch.testing.assert_close(_logits(out.parent), _theirs(PIPE.name), rtol=0, atol=1e-5)


def test_a_blocks_export_orders_each_tensor_ranks_qkv_rows_as_the_fpdt_commit_does(
    converted, tmp_path
):
    heads = _export(converted, tmp_path / "h", 2, 2)
    blocks = _export(converted, tmp_path / "b", 2, 2, "blocks")
    key = "self_attention.query_key_value.weight"
    for name in ("layer_02-model_00-model_states.pt", "layer_03-model_01-model_states.pt"):
        per_head = megatron_io.load_safe(heads / name)[key]  # [2 heads, (q, k, v), 16] rows
        q, k, v = per_head.view(2, 3, 16, -1).unbind(1)
        expected = torch.cat([q.reshape(32, -1), k.reshape(32, -1), v.reshape(32, -1)])
        assert torch.equal(megatron_io.load_safe(blocks / name)[key], expected)
    args = megatron_io.load_safe(blocks / "mp_rank_00_model_states.pt")["args"]
    assert args.ds_sequence_parallel_fpdt is False  # what tells the order on import


def test_an_export_without_the_qkv_order_says_how_to_tell_it(converted, tmp_path):
    with pytest.raises(ConfigError, match="needs --megatron-deepspeed-qkv per-head or blocks") as e:
        export_megatron(converted, tmp_path / "out", "megatron-deepspeed", 2, 2)
    assert "merge-base --is-ancestor 676a482c" in e.value.fix


def test_an_export_at_pipeline_size_1_also_holds_the_module_no_pipeline_parallel_loads(
    converted, tmp_path
):
    out = _export(converted, tmp_path / "out", 2, 1)
    ours = megatron_io.load_safe(out / "mp_rank_01_model_states.pt")["module"]
    theirs = megatron_io.load_safe(NOPIPE / TAG / "mp_rank_01_model_states.pt")["module"]
    flat = {k: v.shape for k, v in _flatten(ours).items()}
    assert flat == {k: v.shape for k, v in _flatten(theirs).items()}  # names and shapes


def test_megatron_deepspeed_loaded_our_exports_with_its_own_logits():
    """Recorded by make_megatron_deepspeed_fixtures.py: Megatron-DeepSpeed itself loaded the
    exports with --finetune (per-head: the pipeline engine TP 2 x PP 2 and --no-pipeline-parallel
    TP 2 before its FPDT commit; blocks: --no-pipeline-parallel TP 2 at its last commit)."""
    checked = EXPECTED["exports_loaded_by_megatron_deepspeed"]
    assert sorted(checked) == ["fpdt_nopipe_tp2", "nopipe_tp2", "pipe_tp2pp2"]
    assert all(c["max_abs_logit_difference"] < 1e-5 for c in checked.values())
