"""`zerotron pretrain` end to end, in process: exact resume, bf16, fp16 skipping, --train-iters 0,
checkpoint mismatches, vocab re-padding, --finetune.

Every run trains a 2-layer, 64-wide GPT-2 on the first 20 documents of the bundled corpus, with
dropout on (0.1) and gradient accumulation 2 (micro batch 2, global batch 4), so "identical" means
the data position, the dropout RNG streams, the optimizer and the scheduler all came back.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import zerotron.cli
import zerotron.training.build
import zerotron.training.pretrain
from zerotron.checkpoint import load_file, model_file, read_latest_tag, tag_for_iteration
from zerotron.config import parse_megatron_args
from zerotron.errors import CheckpointError, ConfigError
from zerotron.training.build import lm_loss
from zerotron.training.loop import TrainSummary
from zerotron.training.pretrain import checkpoint_args, pretrain

REPO = Path(__file__).resolve().parent.parent
GPT2_VOCAB = 50257

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--split", "80,10,10", "--log-interval", "4", "--eval-interval", "4",
    "--eval-iters", "1", "--seed", "1234",
    "--num-workers", "0",  # loader workers cost seconds per in-process run (test_samplers has them)
]  # fmt: skip


def run(data: str, *extra: object) -> TrainSummary:
    """``zerotron pretrain`` with the tiny model on ``data`` plus ``extra`` flags, in process."""
    return pretrain(parse_megatron_args([*TINY, "--data-path", data, *map(str, extra)]))


def ckpt(save_dir: Path, iteration: int) -> dict:
    return load_file(save_dir, tag_for_iteration(iteration), model_file())


def assert_same_tensors(a: object, b: object, path: str = "") -> None:
    """Nested dicts/lists of tensors and numbers are bitwise equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_tensors(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def base_ckpt(data_prefix, tmp_path_factory) -> Path:
    """A run of 8 iterations stopped by --exit-interval at 4: a checkpoint to resume from."""
    save = tmp_path_factory.mktemp("base") / "ckpt"
    run(data_prefix, "--train-iters", 8, "--exit-interval", 4, "--save", save, "--save-interval", 8)
    assert read_latest_tag(save) == "iter_0000004"
    return save


def test_validation_perplexity_goes_to_tensorboard_when_asked(data_prefix, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(data_prefix, "--train-iters", 4, "--tensorboard-dir", tmp_path / "tb",
        "--log-validation-ppl-to-tensorboard")  # fmt: skip
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("lm loss validation")]
    ppl = [(e.step, e.value) for e in events.Scalars("lm loss validation ppl")]
    assert [step for step, _ in loss] == [step for step, _ in ppl] == [4]
    assert ppl[0][1] == pytest.approx(math.exp(loss[0][1]), rel=1e-6)


def test_megatrons_wandb_flags_log_each_step(data_prefix, tmp_path, fake_wandb):
    """--wandb-project turns W&B on, as in Megatron-LM; the run's name, entity and directory
    reach wandb.init, and every step's loss (DeepSpeed's event names) reaches wandb.log."""
    calls = fake_wandb
    summary = run(data_prefix, "--train-iters", 2, "--wandb-project", "p", "--wandb-exp-name",
                  "n", "--wandb-entity", "e", "--wandb-save-dir", tmp_path)  # fmt: skip
    assert calls[0] == (
        "init",
        {"project": "p", "group": None, "entity": "e", "name": "n", "dir": str(tmp_path)},
    )
    losses = {c[2]: c[1]["Train/Samples/train_loss"] for c in calls
              if c[0] == "log" and "Train/Samples/train_loss" in c[1]}  # fmt: skip
    assert losses == pytest.approx({4: summary.losses[1], 8: summary.losses[2]}, rel=1e-6)
    assert calls[-1] == ("finish",)


@pytest.mark.parametrize(
    "ramp",
    [
        ("--step-batch-size-schedule", "0:4 512:8"),  # 512 tokens = 16 samples of 32
        ("--rampup-batch-size", "4", "4", "16"),  # 4, then 8 from 16 samples on
    ],
)
def test_a_batch_size_ramp_trains_as_engines_built_for_each_size(data_prefix, tmp_path, ramp):
    """Batch size 4 for 16 samples, then 8, in one run (its engine built for 8, resized to 4,
    then back to 8): the same losses, bit for bit, as a run built for 4 stopped after those 16
    samples, then resumed into the ramp's second stretch by an engine built for 8. Every run
    asks the dataset for the same 32 samples (its order depends on that); the LR is constant."""
    flags = ["--lr-decay-style", "constant", "--save-interval", 1000]
    ramped = run(data_prefix, *flags, "--train-iters", 6, "--global-batch-size", 8, *ramp,
                 "--log-interval", 2)  # fmt: skip
    assert sorted(ramped.losses) == list(range(1, 7))
    assert ramped.state.consumed_train_samples == 4 * 4 + 2 * 8
    sizes = [int(line.split("global batch size:")[1].split("|")[0]) for line in
             ramped.interval_lines]  # fmt: skip
    assert sizes == [4, 4, 8]  # the log lines of iterations 2, 4 and 6
    first = run(data_prefix, *flags, "--train-iters", 8, "--exit-interval", 4,
                "--save", tmp_path / "ckpt")  # fmt: skip
    second = run(data_prefix, *flags, "--train-iters", 6, "--global-batch-size", 8, *ramp,
                 "--load", tmp_path / "ckpt", "--use-checkpoint-opt-param-scheduler")  # fmt: skip
    assert {**first.losses, **second.losses} == ramped.losses
    assert second.valid_loss == ramped.valid_loss
    assert second.state.consumed_valid_samples == ramped.state.consumed_valid_samples


def test_per_split_data_paths_train_as_one_path_given_every_document(data_prefix, capsys):
    """--train-data-path P trains on every document of P: as --data-path P --split 100,0,0;
    --valid-data-path gives the validation data, and without it there is none."""
    flags = [*TINY, "--train-iters", "4"]
    whole = pretrain(parse_megatron_args([*flags, "--data-path", data_prefix, "--split", "100,0,0",
                                          "--eval-iters", "0"]))  # fmt: skip
    both = pretrain(parse_megatron_args([*flags, "--train-data-path", data_prefix,
                                         "--valid-data-path", data_prefix]))  # fmt: skip
    assert sorted(both.losses) == [1, 2, 3, 4]
    assert both.losses == whole.losses  # bitwise
    assert both.valid_loss is not None and math.isfinite(both.valid_loss)
    capsys.readouterr()
    alone = pretrain(parse_megatron_args([*flags, "--train-data-path", data_prefix]))
    assert alone.losses == whole.losses and alone.valid_loss is None
    assert " > no --valid-data-path: no validation data" in capsys.readouterr().out


def test_deepspeeds_activation_checkpointing_options_run_its_checkpoint_with_the_same_losses(
    data_prefix, monkeypatch
):
    """--checkpoint-activations with --checkpoint-in-cpu (Megatron-DeepSpeed's flags): the full
    recompute runs DeepSpeed's CheckpointFunction (zerotron.parallel.recompute), keeping the
    inputs in host memory, and trains bit for bit as torch's checkpoint does; the next run
    without the option is back on torch's."""
    from zerotron.parallel import recompute

    calls = []
    real = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a: calls.append(1) or real(*a))
    flags = ("--train-iters", 4, "--checkpoint-activations")
    torch_path = run(data_prefix, *flags)
    assert calls == []
    ds_path = run(data_prefix, *flags, "--checkpoint-in-cpu")
    assert len(calls) == 4 * 2 * 2  # 4 steps x 2 micro-batches x 2 layers (units of 1 layer)
    assert ds_path.losses == torch_path.losses and ds_path.valid_loss == torch_path.valid_loss
    assert run(data_prefix, *flags).losses == torch_path.losses and len(calls) == 16


def test_reset_iteration_counts_from_0_with_the_checkpoints_weights_and_optimizer(
    data_prefix, base_ckpt
):
    """Megatron-DeepSpeed's --reset-iteration: iterations and samples count from 0 (so the data
    starts over), the weights, Adam's moments and the LR schedule load: the losses are neither a
    fresh run's nor --finetune's (fresh optimizer and schedule)."""
    flags = ("--train-iters", 8)  # the checkpoint's schedule
    # without the checkpoint's RNG state, as --finetune: the same dropout masks
    reset = run(data_prefix, *flags, "--load", base_ckpt, "--reset-iteration", "--no-load-rng")
    assert sorted(reset.losses) == list(range(1, 9))
    assert reset.state.consumed_train_samples == 8 * 4
    finetune = run(data_prefix, *flags, "--load", base_ckpt, "--finetune")
    fresh = run(data_prefix, *flags)
    assert reset.losses[1] == finetune.losses[1] != fresh.losses[1]  # the same weights, batch
    assert reset.losses[2] != finetune.losses[2]  # then Adam's moments differ


def test_a_kill_switch_file_saves_and_exits(data_prefix, tmp_path, monkeypatch):
    """Megatron-DeepSpeed's --kill-switch-file: created during iteration 2, the run saves at 2
    and exits; present at the start, nothing trains."""
    from zerotron.engine.core import Engine

    switch = tmp_path / "stop"
    real = Engine.train_batch
    steps = []

    def train_batch(self, data_iter=None):
        steps.append(1)
        if len(steps) == 2:
            switch.touch()
        return real(self, data_iter)

    monkeypatch.setattr(Engine, "train_batch", train_batch)
    flags = ("--train-iters", 8, "--kill-switch-file", switch, "--save", tmp_path / "ckpt")
    summary = run(data_prefix, *flags, "--save-interval", 100)
    assert sorted(summary.losses) == [1, 2] and summary.exited_early
    assert read_latest_tag(tmp_path / "ckpt") == "iter_0000002"
    again = run(data_prefix, *flags, "--load", tmp_path / "ckpt", "--save-interval", 100)
    assert again.losses == {} and again.exited_early and again.state.iteration == 2
    assert read_latest_tag(tmp_path / "ckpt") == "iter_0000002"


def _without_model_flags() -> list[str]:
    out, skip = [], False
    for a in TINY:
        if skip:
            skip = False
        elif a in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
            skip = True
        else:
            out.append(a)
    return out


def test_use_checkpoint_args_resumes_without_the_model_flags(data_prefix, base_ckpt):
    """Megatron's --use-checkpoint-args: the model's shape comes from the checkpoint, and the
    run resumes exactly as one given the same shape by flags."""
    flags = ["--train-iters", 8, "--load", base_ckpt]
    ref = run(data_prefix, *flags)
    argv = [*_without_model_flags(), "--data-path", data_prefix, "--use-checkpoint-args"]
    cfg = parse_megatron_args([*argv, *map(str, flags)], checkpoint_args=checkpoint_args)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (2, 64, 4, 32)
    assert pretrain(cfg).losses == ref.losses


def test_use_checkpoint_args_leaves_what_the_command_line_gives(base_ckpt):
    argv = [*_without_model_flags(), "--hidden-size", "128", "--load", str(base_ckpt)]
    cfg = parse_megatron_args(
        [*argv, "--use-checkpoint-args", "--train-iters", "8"], checkpoint_args=checkpoint_args
    )
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (128, 2)


def test_use_checkpoint_args_needs_a_load():
    with pytest.raises(ConfigError, match="no --load is given"):
        parse_megatron_args(
            [*_without_model_flags(), "--use-checkpoint-args", "--train-iters", "8"],
            checkpoint_args=checkpoint_args,
        )


# ---- exact resume ---------------------------------------------------------------------------


def resume_check(data: str, tmp_path: Path, n: int, k: int, *extra: object) -> dict[int, float]:
    """N iterations in one run vs k + resume to N: identical losses, eval losses, final state."""
    flags = ["--train-iters", n, "--save-interval", 1000, *extra]
    whole = run(data, *flags, "--save", tmp_path / "whole")
    first = run(data, *flags, "--exit-interval", k, "--save", tmp_path / "parts")
    assert sorted(first.losses) == list(range(1, k + 1))
    assert first.valid_loss is None  # an exit-interval stop skips the final evaluation
    shutil.copytree(tmp_path / "parts", tmp_path / "parts_copy")
    second = run(data, *flags, "--load", tmp_path / "parts", "--save", tmp_path / "parts")
    assert sorted(second.losses) == list(range(k + 1, n + 1))

    assert {**first.losses, **second.losses} == whole.losses  # bitwise, every iteration
    assert second.valid_loss == whole.valid_loss and second.test_loss == whole.test_loss
    assert second.state.consumed_train_samples == whole.state.consumed_train_samples
    assert second.state.consumed_valid_samples == whole.state.consumed_valid_samples
    a, b = ckpt(tmp_path / "whole", n), ckpt(tmp_path / "parts", n)
    for key in ("model", "optimizer", "opt_param_scheduler", "rng_state", "iteration"):
        assert_same_tensors(a[key], b[key], key)

    # The check can fail: without the saved RNG states the dropout masks after resuming differ.
    norng = run(data, *flags, "--load", tmp_path / "parts_copy", "--no-load-rng")
    assert norng.losses[k + 1] != whole.losses[k + 1]
    return whole.losses


def test_exact_resume_fp32_with_dropout_and_accumulation(data_prefix, tmp_path):
    cfg = parse_megatron_args([*TINY, "--train-iters", "8"])
    assert cfg.training.num_micro_batches == 2
    assert cfg.model.hidden_dropout == cfg.model.attention_dropout == 0.1
    resume_check(data_prefix, tmp_path, 8, 4)


def test_bf16_trains_keeps_fp32_masters_and_resumes_exactly(data_prefix, tmp_path):
    losses = resume_check(data_prefix, tmp_path, 10, 5, "--bf16", "--lr", "3e-3")
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[10] < losses[1] - 0.3, losses

    state = ckpt(tmp_path / "whole", 10)
    weights = state["model"]
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    masters = [m for group in state["optimizer"]["fp32_from_fp16_params"] for m in group]
    # One fp32 master per parameter (the tied embedding is one parameter), covering the model.
    assert all(m.dtype == torch.float32 for m in masters)
    unique = {t.data_ptr(): t for t in weights.values()}  # saved ties share storage
    assert sum(m.numel() for m in masters) == sum(t.numel() for t in unique.values())
    for m in masters:  # each bf16 weight is its master rounded to bf16
        assert any(
            t.shape == m.shape and torch.equal(m.to(torch.bfloat16), t) for t in unique.values()
        )
    # and the masters hold what bf16 cannot: updates smaller than a bf16 ulp accumulate there.
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)


# ---- fp16 -----------------------------------------------------------------------------------


def test_fp16_run_trains_and_logs_a_skipped_iteration(data_prefix, monkeypatch):
    """Iteration 2's gradient is made inf: skipped, counted in the log, the scale halves."""
    calls = {"train": 0}

    def poisoned(model, batch):
        loss = lm_loss(model, batch)
        if model.training:
            calls["train"] += 1
            if calls["train"] == 3:  # the first micro-batch of iteration 2
                return loss * math.inf
        return loss

    monkeypatch.setattr(zerotron.training.build, "lm_loss", poisoned)
    s = run(
        data_prefix,
        *("--fp16", "--initial-loss-scale", 1024, "--hysteresis", 1, "--lr", "3e-3"),
        *("--train-iters", 10, "--log-interval", 5, "--eval-interval", 100),
    )
    assert s.losses[2] == math.inf
    finite = {i: v for i, v in s.losses.items() if i != 2}
    assert all(math.isfinite(v) for v in finite.values())
    assert s.losses[10] < s.losses[1] - 0.3, s.losses

    first, second = s.interval_lines
    assert "number of skipped iterations:   1 |" in first
    assert "number of skipped iterations:   0 |" in second
    assert "number of nan iterations:   0 |" in first
    assert "loss scale: 512.0 |" in first and "loss scale: 512.0 |" in second
    # The skipped iteration is left out of the interval's mean loss.
    mean = sum(finite[i] for i in (1, 3, 4, 5)) / 4
    assert f"lm loss: {mean:.6E} |" in first


# ---- building only --------------------------------------------------------------------------


def test_train_iters_zero_prints_arguments_and_parameter_count(capsys):
    layers, h, heads, ffn, seq, pos, div = 3, 48, 4, 80, 24, 40, 256
    argv = ["pretrain", "--num-layers", layers, "--hidden-size", h]
    argv += ["--num-attention-heads", heads, "--ffn-hidden-size", ffn, "--seq-length", seq]
    argv += ["--max-position-embeddings", pos, "--make-vocab-size-divisible-by", div]
    argv += ["--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 0, "--lr", 1e-3]
    argv += ["--kernels", "linear=torch"]  # wins over the suite's ZEROTRON_KERNELS (conftest)
    assert zerotron.cli.main(list(map(str, argv))) == 0
    out = capsys.readouterr().out
    kernels = (
        " kernels: linear=torch (forced), matmul16=- (n/a), attention=- (n/a), loss_chunk=- (n/a)\n"
    )
    assert out.count(" kernels: ") == 1 and kernels in out  # the choices, printed once

    padded = -(-GPT2_VOCAB // div) * div
    assert padded == 50432
    per_layer = (
        2 * h  # input LayerNorm
        + 3 * h * h + 3 * h  # query_key_value
        + h * h + h  # attention dense
        + 2 * h  # post-attention LayerNorm
        + ffn * h + ffn  # dense_h_to_4h
        + h * ffn + h  # dense_4h_to_h
    )  # fmt: skip
    expected = padded * h + pos * h + layers * per_layer + 2 * h
    assert f" > number of parameters on model parallel rank 0: {expected}\n" in out
    assert "------------------------ arguments ------------------------" in out
    assert "-------------------- end of arguments ---------------------" in out
    assert f"  hidden_size {'.' * (48 - len('hidden_size'))} {h}\n" in out
    assert f"  ffn_hidden_size {'.' * (48 - len('ffn_hidden_size'))} {ffn}\n" in out
    assert " iteration " not in out


# ---- checkpoints that do not fit ------------------------------------------------------------


def test_other_hidden_size_is_a_clear_error(data_prefix, base_ckpt):
    with pytest.raises(CheckpointError) as e:
        run(data_prefix, "--train-iters", 8, "--load", base_ckpt, "--hidden-size", 32)
    msg = str(e.value)
    assert "iter_0000004" in msg
    # Every mismatching tensor with both shapes: 50304 = 50257 padded to a multiple of 128.
    for line in (
        "embedding.word_embeddings.weight: checkpoint [50304, 64] vs model [50304, 32]",
        "embedding.position_embeddings.weight: checkpoint [32, 64] vs model [32, 32]",
        "layers.0.self_attention.query_key_value.weight: checkpoint [192, 64] vs model [96, 32]",
        "layers.1.mlp.dense_h_to_4h.weight: checkpoint [256, 64] vs model [128, 32]",
        "final_layernorm.bias: checkpoint [64] vs model [32]",
    ):
        assert line in msg
    assert "--hidden-size 64" in msg  # the flag to pass
    assert "Traceback" not in msg and "size mismatch" not in msg  # not torch's message


def test_vocab_padding_difference_alone_resumes_identically(data_prefix, base_ckpt):
    """Padding 50257 to a multiple of 256 (50432) instead of 128 (50304) is not a mismatch."""
    assert -(-GPT2_VOCAB // 128) * 128 == 50304 and -(-GPT2_VOCAB // 256) * 256 == 50432
    same = run(data_prefix, "--train-iters", 8, "--load", base_ckpt)
    repadded = run(
        data_prefix, "--train-iters", 8, "--load", base_ckpt, "--make-vocab-size-divisible-by", 256
    )
    assert sorted(same.losses) == [5, 6, 7, 8]
    assert repadded.losses == same.losses  # weights, Adam moments and the batches all carried
    assert repadded.valid_loss == same.valid_loss


# ---- --finetune -----------------------------------------------------------------------------


def test_finetune_loads_weights_only_and_starts_at_zero(data_prefix, base_ckpt, monkeypatch):
    seen = {}

    def capture(run_, state, *args):
        seen.update(run=run_, state=state)
        return TrainSummary(state=state, losses={})

    flags = ["--train-iters", 6, "--load", base_ckpt, "--finetune", "--lr-warmup-iters", 2]
    with monkeypatch.context() as m:
        m.setattr(zerotron.training.pretrain, "train", capture)
        run(data_prefix, *flags)
    state, engine = seen["state"], seen["run"].engine
    assert (state.iteration, state.consumed_train_samples, state.consumed_valid_samples) == (0,) * 3
    assert engine.global_steps == 0 and engine.global_samples == 0
    assert engine.get_lr() == [0.0, 0.0]  # the warmup starts from 0
    assert len(engine.optimizer.optimizer.state) == 0  # no Adam moments loaded
    saved = ckpt(base_ckpt, 4)
    live = seen["run"].model.state_dict()
    assert live.keys() == saved["model"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(live[key], value), key
    # The loaded checkpoint had trained: finetuning starts from it, not from a fresh init.
    assert saved["optimizer"]["optimizer"]["state"]

    s = run(data_prefix, *flags, "--log-interval", 1, "--eval-interval", 100)
    assert sorted(s.losses) == list(range(1, 7))
    first = s.interval_lines[0]
    assert first.startswith(f" iteration {1:8d}/{6:8d} |")
    assert f"consumed samples: {4:12d} |" in first
    assert f"learning rate: {1e-3 * 1 / 2:.3E} |" in first  # step 1 of a 2-step warmup
    assert f"learning rate: {1e-3:.3E} |" in s.interval_lines[1]


def test_resume_with_a_smaller_validation_split_names_it(data_prefix, tmp_path):
    """Resuming with fewer validation samples than the checkpoint's evaluations consumed is an
    error about the validation split (not the training data)."""
    run(
        data_prefix, "--train-iters", 8, "--eval-iters", 6, "--save", tmp_path, "--save-interval", 8
    )
    with pytest.raises(ConfigError, match="validation split") as e:
        run(data_prefix, "--train-iters", 8, "--eval-iters", 1, "--load", tmp_path)
    assert "--eval-interval" in str(e.value)
