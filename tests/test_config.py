"""The config layer: schema defaults, Megatron flags, YAML/JSON files, validation messages."""

import json
import math
import shlex

import pydantic
import pytest

from zerotron.config import (
    Config,
    build_parser,
    format_config,
    load_config,
    parse_megatron_args,
    parse_split,
    write_config_file,
)
from zerotron.errors import ConfigError, UnsupportedError

BASE = shlex.split(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 4 --lr 1e-3 --train-iters 100"
)


def without(*flags: str) -> list[str]:
    """BASE less some of its flags (each takes one value)."""
    out = list(BASE)
    for f in flags:
        i = out.index(f)
        del out[i : i + 2]
    return out


def parse(*extra: str, world_size: int = 1) -> Config:
    return parse_megatron_args([*BASE, *extra], world_size=world_size)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- defaults


def test_defaults_match_megatron():
    """Values of megatron/training/arguments.py (NVIDIA/Megatron-LM main, 2025), checked there."""
    megatron = {
        "make_vocab_size_divisible_by": 128,
        "layernorm_epsilon": 1e-5,  # --norm-epsilon
        "init_method_std": 0.02,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
        "weight_decay": 0.01,
        "clip_grad": 1.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-08,
        "optimizer": "adam",
        "seed": 1234,
        "eval_interval": 1000,
        "eval_iters": 100,
        "log_interval": 100,
        "lr_decay_style": "linear",
        "lr_warmup_iters": 0,
        "lr_warmup_fraction": None,
        "lr_warmup_init": 0.0,
        "min_lr": 0.0,
        "loss_scale": None,
        "initial_loss_scale": 2**32,
        "min_loss_scale": 1.0,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "num_workers": 2,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "distributed_timeout_minutes": 10,
        "ddp_bucket_size": None,
        "variable_seq_lengths": False,  # megatron.core ModelParallelConfig
        "recompute_granularity": None,
        "exit_interval": None,
        "save_interval": None,
    }
    flat = parse().flat()
    for name, value in megatron.items():
        assert flat[name] == value, name
    # Megatron's legacy default split is the string '969, 30, 1'.
    assert parse().data.split_fractions == parse_split("969, 30, 1")
    assert parse().data.split_fractions == (0.969, 0.03, 0.001)


def test_megatron_derivations():
    cfg = parse(world_size=2)
    assert cfg.model.ffn_hidden_size == 4 * 64
    assert cfg.model.max_position_embeddings == 32
    # no --global-batch-size: micro batch x data-parallel size, one micro-batch
    assert cfg.training.global_batch_size == 4 * 2
    assert cfg.training.num_micro_batches == 1
    assert cfg.scheduler.lr_decay_iters == 100
    assert cfg.parallel.data_parallel_size == 2


# ---- precedence: flag > file > default


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "run.yaml",
            "model:\n  hidden-size: 128\n  num_attention_heads: 8\n"
            "optimizer:\n  lr: 3e-4\nseed: 7\nweight-decay: 0.1\n",
        ),
        (
            "run.json",
            json.dumps(
                {
                    "hidden_size": 128,
                    "num-attention-heads": 8,
                    "lr": 3e-4,
                    "training": {"seed": 7},
                    "optimizer": {"weight_decay": 0.1},
                }
            ),
        ),
    ],
)
def test_precedence_flag_over_file_over_default(tmp_path, name, text):
    path = write(tmp_path, name, text)
    argv = without("--num-attention-heads", "--lr")
    cfg = parse_megatron_args([*argv, "--config", path, "--seed", "9", "--hidden-size", "256"])
    assert cfg.training.seed == 9  # flag beats file
    assert cfg.model.hidden_size == 256  # flag beats file
    assert cfg.model.num_attention_heads == 8  # file (no flag)
    assert cfg.optimizer.weight_decay == 0.1  # file beats default
    assert cfg.optimizer.lr == 3e-4  # file (YAML reads 3e-4 as a string)
    assert cfg.training.eval_iters == 100  # default
    cfg = parse_megatron_args([*argv, "--config", path, "--lr", "0.5", "--weight-decay", "0"])
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (0.5, 0.0)


def test_config_file_alone(tmp_path):
    path = write(tmp_path, "c.yaml", "num_layers: 4\nhidden_size: 32\nmicro_batch_size: 2\n")
    cfg = load_config(path, world_size=2)
    assert (cfg.model.num_layers, cfg.training.global_batch_size) == (4, 4)


# ---- errors people meet


def test_unknown_flag_suggests_closest():
    with pytest.raises(ConfigError) as e:
        parse("--hiden-size", "64")
    assert e.value.what == "unknown flag --hiden-size"
    assert e.value.fix.startswith("did you mean --hidden-size")
    assert not isinstance(e.value, UnsupportedError)


def test_unknown_config_key_names_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, "c.yaml", "num_layers: 2\n\nhiden-size: 64\n")
    with pytest.raises(ConfigError) as e:
        parse("--config", path)
    assert e.value.where == f"{path}:3"
    assert e.value.what == "unknown key 'hiden-size'"
    assert e.value.fix == "did you mean 'hidden_size'?"

    path = write(tmp_path, "d.json", '{\n  "model": {\n    "num_layer": 2\n  }\n}\n')
    with pytest.raises(ConfigError) as e:
        parse("--config", path)
    assert (e.value.where, e.value.what) == (f"{path}:3", "unknown key 'model.num_layer'")
    assert e.value.fix == "did you mean 'num_layers'?"


def test_key_in_wrong_section(tmp_path):
    path = write(tmp_path, "c.yaml", "model:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="'lr' belongs to section 'optimizer', not 'model'"):
        parse("--config", path)


def test_unsupported_flags_say_so(tmp_path):
    with pytest.raises(UnsupportedError) as e:
        parse("--swiglu")
    assert e.value.what.startswith("--swiglu is not supported: SwiGLU is not implemented")
    with pytest.raises(UnsupportedError, match="--num-experts 8 is not supported: mixture"):
        parse("--num-experts", "8")
    with pytest.raises(UnsupportedError, match="WSD is not supported"):
        parse("--lr-decay-style", "WSD")
    # The value that asks for what zerotron does anyway is fine.
    assert parse("--context-parallel-size", "1").parallel.data_parallel_size == 1
    # The same names in a file.
    path = write(tmp_path, "c.yaml", "num_layers: 2\nswiglu: true\n")
    with pytest.raises(UnsupportedError) as e:
        parse("--config", path)
    assert e.value.where == f"{path}:2"


def test_ignored_flag_warns():
    cfg = parse("--use-mcore-models", "--no-bias-gelu-fusion")
    assert len(cfg.warnings) == 2 and "--use-mcore-models has no effect" in cfg.warnings[0]


@pytest.mark.parametrize(
    "flags", [("--ckpt-format", "torch_dist"), ("--use-dist-ckpt",)], ids=["format", "use"]
)
def test_megatrons_torch_dist_checkpoint_format_is_taken_saying_what_is_saved(tmp_path, flags):
    """Megatron-LM's default format: the run goes on, saving the torch layout, and says so."""
    cfg = parse(*flags)
    assert cfg.warnings == [
        f"{' '.join(flags)}: zerotron saves Megatron's torch layout (mp_rank_*/model_optim_rng.pt "
        "and its metadata.json); --load reads torch_dist checkpoints Megatron-LM wrote, and "
        "`zerotron convert --to-megatron DIR --megatron-format torch_dist` writes one"
    ]
    key = flags[0][2:].replace("-", "_")
    path = write(tmp_path, "c.yaml", f"{key}: {flags[1] if len(flags) > 1 else 'true'}\n")
    assert parse("--config", path).warnings == cfg.warnings  # the same key in a file


def test_other_checkpoint_formats_are_refused():
    assert parse("--ckpt-format", "torch").warnings == []
    with pytest.raises(UnsupportedError, match="--ckpt-format zarr is not supported"):
        parse("--ckpt-format", "zarr")


# The flags of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (2026), with
# placeholder paths.
GPT3_EXAMPLE = shlex.split(
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 "
    "--global-batch-size 1536 "
    "--step-batch-size-schedule '0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536' "
    "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 "
    "--adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 "
    "--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000 "
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path d_text_document "
    "--vocab-file v.json --merge-file m.txt --split 949,50,1 --log-interval 100 "
    "--save-interval 10000 --eval-interval 1000 --save ckpt --load ckpt --eval-iters 10 "
    "--tensorboard-dir tb"
)


def test_megatron_lms_gpt3_example_parses_as_written():
    cfg = parse_megatron_args(GPT3_EXAMPLE, world_size=128)
    assert (cfg.parallel.data_parallel_size, cfg.training.num_micro_batches) == (1, 1536)
    assert cfg.model.attention_backend == "auto" and cfg.warnings == []
    # 2.4B tokens are 1,171,875 samples of 2048
    assert cfg.batch_ramp.steps[:2] == ((0, 16), (1_171_875, 320))
    assert cfg.batch_ramp.final == 1536


# examples_deepspeed/MoE/ds_pretrain_gpt_350M_dense.sh of Megatron-DeepSpeed (f4157bea), the
# GPT script of DeepSpeed's tutorials, with its default values, activation checkpointing on and
# its ds_config_gpt_TEMPLATE.json filled in as the script fills it.
MDS_GPT_350M = shlex.split(
    "--override-opt_param-scheduler --adam-beta1 0.9 --adam-beta2 0.95 "
    "--tensor-model-parallel-size 1 --moe-expert-parallel-size 1 --num-experts 1 "
    "--moe-loss-coeff 0.01 --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 "
    "--moe-min-capacity 4 --init-method-std 0.014 --lr-decay-tokens 260000000000 "
    "--lr-warmup-tokens 375000000 --micro-batch-size 4 --exit-duration-in-mins 30000000 "
    "--global-batch-size 256 --num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --train-tokens 300000000000 "
    "--train-samples 439453125 --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine "
    "--split 98,2,0 --log-interval 10 --eval-interval 100 --eval-iters 10 --save-interval 1000 "
    "--weight-decay 0.1 --clip-grad 1.0 --hysteresis 2 --num-workers 0 --fp16 --load ckpt "
    "--save ckpt --tensorboard-queue-size 1 --log-timers-to-tensorboard "
    "--log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard --tensorboard-dir tb "
    "--checkpoint-activations --create-moe-param-group --disable-moe-token-dropping "
    "--vocab-file v.json --merge-file m.txt --data-path d_text_document "
    "--deepspeed --deepspeed_config DS_JSON --pipeline-model-parallel-size 1 "
    "--no-pipeline-parallel --deepspeed-activation-checkpointing"
)
MDS_CONFIG = {
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
             "min_loss_scale": 1, "initial_scale_power": 11},
    "bf16": {"enabled": False},
    "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 80,
                            "max_difficulty": 2048, "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 69000,
                                                "difficulty_step": 8}},
    "wall_clock_breakdown": False,
}  # fmt: skip


def test_megatron_deepspeeds_gpt_example_parses_as_written(tmp_path):
    path = write(tmp_path, "ds.json", json.dumps(MDS_CONFIG))
    cfg = parse_megatron_args([a if a != "DS_JSON" else path for a in MDS_GPT_350M], world_size=64)
    m, t = cfg.model, cfg.training
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    # 300e9 tokens are 146,484,375 samples of 2048: 572,205 steps of 256 (the last one passes it)
    assert t.train_iters == 572_205 < 439_453_125 // 256
    assert (cfg.lr_decay_steps, cfg.lr_warmup_steps) == (260e9 / 2048, 375e6 / 2048)
    assert cfg.scheduler.override_opt_param_scheduler
    assert [w.split()[0] for w in cfg.warnings] == [
        "--moe-loss-coeff", "--moe-train-capacity-factor", "--moe-eval-capacity-factor",
        "--moe-min-capacity", "--tensorboard-queue-size", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--create-moe-param-group",
        "--disable-moe-token-dropping", "--deepspeed-activation-checkpointing",
    ]  # fmt: skip


def test_checkpoint_activations_is_megatrons_uniform_full_recompute():
    ours = parse("--checkpoint-activations", "--checkpoint-num-layers", "2").model
    megatron = parse(*shlex.split("--recompute-granularity full --recompute-method uniform "
                                  "--recompute-num-layers 2")).model  # fmt: skip
    fields = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    assert [getattr(ours, f) for f in fields] == [getattr(megatron, f) for f in fields]
    assert parse("--checkpoint-num-layers", "3").model.recompute_granularity is None  # unused
    with pytest.raises(ConfigError, match="checkpoint_activations asks for full recompute"):
        parse("--checkpoint-activations", "--recompute-granularity", "selective")


def _megatron_deepspeed_lr(tokens: float, warmup: float, decay: float, lr: float, low: float):
    """Megatron-DeepSpeed's OptimizerParamScheduler.get_lr with token-based warmup and cosine
    decay, written out from its source."""
    if warmup > 0 and tokens <= warmup:
        return lr * tokens / warmup
    if tokens > decay:
        return low
    ratio = (tokens - warmup) / (decay - warmup)
    return low + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - low)


def test_a_token_schedule_follows_megatron_deepspeeds_formula():
    """Warmup over 1,000 tokens and cosine decay over 9,000 (not whole samples of 32), 4 samples
    a step: the learning rate at every step is Megatron-DeepSpeed's at that many tokens."""
    import torch

    from zerotron.engine.builder import build_scheduler

    cfg = parse("--lr-warmup-tokens", "1000", "--lr-decay-tokens", "9000", "--lr-decay-style",
                "cosine", "--min-lr", "1e-5", "--train-iters", "100")  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    scheduler = build_scheduler(cfg, optimizer)
    seq, gbs = cfg.model.seq_length, cfg.training.global_batch_size
    for step in range(100):
        want = _megatron_deepspeed_lr(step * gbs * seq, 1000, 9000, cfg.optimizer.lr, 1e-5)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=0), step
        scheduler.step(gbs)


@pytest.mark.parametrize(
    "flags, match",
    [
        (("--lr-warmup-tokens", "1000"), "lr_warmup_tokens is set without lr_decay_tokens"),
        (("--lr-decay-tokens", "9000", "--lr-decay-iters", "50"), "lr_decay_tokens and lr_decay"),
        (("--lr-decay-tokens", "9000", "--lr-warmup-tokens", "100", "--lr-warmup-iters", "2"),
         "lr_warmup_tokens and lr_warmup_iters are both set"),
    ],
)  # fmt: skip
def test_a_length_in_tokens_and_otherwise_is_refused(flags, match):
    with pytest.raises(ConfigError, match=match):
        parse(*flags, "--train-iters", "100")


def test_train_tokens_stops_before_the_step_that_would_start_with_them():
    seq, gbs = 32, 4  # BASE's
    assert (
        parse("--train-iters", "100", "--train-tokens", str(10 * gbs * seq)).training.train_iters
        == 10
    )
    assert (
        parse(
            "--train-iters", "100", "--train-tokens", str(10 * gbs * seq + 1)
        ).training.train_iters
        == 11
    )
    assert (
        parse("--train-iters", "5", "--train-tokens", str(10 * gbs * seq)).training.train_iters == 5
    )
    # with a batch-size ramp: 4, 4, then 8 a step
    ramp = ("--global-batch-size", "8", "--rampup-batch-size", "4", "4", "8")
    assert (
        parse("--train-iters", "100", "--train-tokens", str(16 * seq), *ramp).training.train_iters
        == 3
    )


def test_no_pipeline_parallel_needs_a_pipeline_size_of_1():
    assert parse("--no-pipeline-parallel").parallel.pipeline_model_parallel_size == 1
    with pytest.raises(ConfigError, match="no_pipeline_parallel is set with"):
        parse("--no-pipeline-parallel", "--pipeline-model-parallel-size", "2", world_size=2)


def test_a_megatron_deepspeed_flag_zerotron_lacks_is_refused_naming_its_group():
    with pytest.raises(UnsupportedError) as e:
        parse("--random-ltd")
    assert e.value.what.startswith("--random-ltd is not supported: one of Megatron-DeepSpeed's")
    with pytest.raises(UnsupportedError, match="--num-experts 8 is not supported"):
        parse("--num-experts", "8")


def test_zerotron_reads_each_megatron_deepspeed_flag_it_knows_as_megatron_deepspeed_does():
    from zerotron.config.megatron_table import megatron_deepspeed_flags

    flags = megatron_deepspeed_flags()
    ours = {s: a.nargs != 0 for a in build_parser()._actions for s in a.option_strings}
    differ = {f: takes for f, (takes, _) in flags.items() if ours[f] != takes}
    assert differ == {} and len(flags) > 100


def test_a_linear_ramp_follows_megatrons_formula():
    """--rampup-batch-size 16 8 1000 up to 64: 16 + 8 * floor(c / (1000 / 6)) until 1000."""
    cfg = parse("--global-batch-size", "64", "--rampup-batch-size", "16", "8", "1000")
    ramp = cfg.batch_ramp
    per_increment = 1000 / ((64 - 16) // 8)
    for consumed in range(0, 1200, 7):
        want = 64 if consumed > 1000 else 16 + 8 * int(consumed / per_increment)
        assert ramp.size_at(consumed) == want, consumed


def test_train_samples_under_a_ramp_count_steps_as_megatron():
    cfg = parse_megatron_args([*without("--train-iters"), "--train-samples", "40",
                               "--step-batch-size-schedule", "0:4 256:8"])  # fmt: skip
    # 4 samples a step below 256 / 32 = 8 samples, then 8: 4, 8, 16, 24, 32, 40
    assert (cfg.training.train_iters, cfg.training.global_batch_size) == (6, 8)


def test_train_iters_under_a_ramp_give_its_samples():
    cfg = parse("--global-batch-size", "8", "--rampup-batch-size", "4", "4", "8")
    assert cfg.training.train_samples == 4 + 4 + 98 * 8  # 100 iterations


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--step-batch-size-schedule", "64:4 128:8"], "does not start at 0 tokens"),
        (["--step-batch-size-schedule", "0:4 64"], "'64' is not THRESHOLD:SIZE"),
        (["--step-batch-size-schedule", "0:6 64:8"], "reaches 6, not a multiple of"),
        (["--global-batch-size", "4", "--step-batch-size-schedule", "0:4 64:8"],
         "global_batch_size 4 is not the last size 8"),
        (["--global-batch-size", "8", "--rampup-batch-size", "3", "2", "8"], "does not reach"),
        (["--global-batch-size", "8", "--rampup-batch-size", "4", "4"], "takes 3 numbers"),
    ],
)  # fmt: skip
def test_a_bad_batch_size_ramp_says_what_is_wrong(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse(*flags)


def test_a_megatron_lm_flag_zerotron_lacks_names_its_option_group(tmp_path):
    with pytest.raises(UnsupportedError) as e:
        parse("--moe-router-topk", "2")
    assert e.value.what.startswith(
        "--moe-router-topk 2 is not supported: one of Megatron-LM's 'transformer configuration' "
        "options that zerotron does not implement"
    )
    path = write(tmp_path, "c.yaml", "num_layers: 2\nmoe_router_topk: 2\n")
    with pytest.raises(UnsupportedError) as e:
        parse("--config", path)
    assert e.value.where == f"{path}:2"


def test_a_misspelt_flag_is_still_unknown_and_suggests_only_implemented_flags():
    with pytest.raises(ConfigError) as e:
        parse("--moe-router-topkk", "2")
    assert not isinstance(e.value, UnsupportedError)
    assert e.value.what == "unknown flag --moe-router-topkk" and "moe" not in e.value.fix


def test_zerotron_reads_each_megatron_lm_flag_it_knows_as_megatron_lm_does():
    """A flag zerotron implements, refuses or ignores takes a value exactly when Megatron-LM's
    does (else the next flag would be swallowed, or a value left over)."""
    from zerotron.config.megatron_table import megatron_lm_flags

    flags = megatron_lm_flags()
    ours = {s: a.nargs != 0 for a in build_parser()._actions for s in a.option_strings}
    differ = {f: takes for f, (takes, _) in flags.items() if ours[f] != takes}
    assert differ == {} and len(flags) > 800


def test_megatron_logging_and_kernel_switches_are_accepted_with_warnings():
    cfg = parse("--manual-gc", "--log-params-norm", "--cross-entropy-loss-fusion")
    assert [w.split()[0] for w in cfg.warnings] == [
        "--manual-gc",
        "--log-params-norm",
        "--cross-entropy-loss-fusion",
    ]


def test_attention_backend_flash_forces_sdpa_attention():
    assert parse("--attention-backend", "flash").model.kernels == "attention=sdpa"


@pytest.mark.parametrize("backend", ["fused", "unfused", "local"])
def test_transformer_engines_attention_backends_warn(backend):
    cfg = parse("--attention-backend", backend)
    assert cfg.model.kernels is None
    assert cfg.warnings == [
        f"attention_backend {backend!r} has no effect in zerotron (attention is SDPA or the "
        "kernel the chooser picks, docs/kernels.md); ignored"
    ]


def test_kv_channels_must_be_the_head_width():
    assert parse("--kv-channels", "16").model.kv_channels == 16  # 64 / 4 heads
    with pytest.raises(UnsupportedError) as e:
        parse("--kv-channels", "32")
    assert e.value.where == "model.kv_channels" and e.value.fix.endswith("set it to 16")


def test_tp_comm_overlap_warns_that_the_column_parallel_backward_overlaps_anyway():
    cfg = parse("--tensor-model-parallel-size", "2", "--tp-comm-overlap", world_size=2)
    assert len(cfg.warnings) == 1
    assert cfg.warnings[0].startswith("--tp-comm-overlap has no effect in zerotron (the column")


@pytest.mark.parametrize(
    ("kernels", "forced"),
    [((), "attention=sdpa"), (("--kernels", "linear=torch"), "linear=torch,attention=sdpa")],
)
def test_use_flash_attn_forces_sdpa_attention(kernels, forced):
    """Megatron-LM's flash-attn switch is SDPA's own kernels (flash on CUDA and on the CPU):
    the CPU kernel choice ``attention=sdpa``, added to what --kernels forces."""
    cfg = parse("--use-flash-attn", *kernels)
    assert cfg.model.use_flash_attn and cfg.model.kernels == forced and cfg.warnings == []


def test_use_flash_attn_in_a_file_forces_sdpa_attention(tmp_path):
    path = write(tmp_path, "c.yaml", "use_flash_attn: true\nkernels: attention=sdpa\n")
    assert parse("--config", path).model.kernels == "attention=sdpa"


def test_use_flash_attn_against_another_forced_attention_is_refused():
    with pytest.raises(ConfigError) as e:
        parse("--use-flash-attn", "--kernels", "attention=math16")
    assert e.value.where == "model.use_flash_attn"
    assert e.value.what.endswith("but kernels forces attention=math16")


def test_megatrons_distributed_optimizer_flags_start_as_zero_1():
    """A Megatron-LM script's ``--use-distributed-optimizer --overlap-grad-reduce
    --overlap-param-gather``: ZeRO stage 1, the two overlap switches warned about."""
    cfg = parse("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    assert cfg.zero.zero_stage == 1
    assert [w.split(" has no effect")[0].split()[-1] for w in cfg.warnings] == [
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ]


def test_launcher_local_rank_is_accepted():
    assert parse("--local_rank=3").training.seed == 1234
    assert parse("--local-rank", "0").training.seed == 1234


def test_missing_required_flags():
    with pytest.raises(ConfigError) as e:
        parse_megatron_args(["--num-layers", "2", "--lr", "0.1"])
    assert e.value.what == (
        "missing required flags: --hidden-size, --num-attention-heads, --seq-length, "
        "--micro-batch-size, --train-iters (or --train-samples)"
    )
    # --train-iters 0 (print the configuration and exit) needs no learning rate.
    assert parse_megatron_args(BASE[:10] + ["--train-iters", "0"]).optimizer.lr is None


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    assert "--global-batch-size" in capsys.readouterr().out


def test_yaml_and_json_syntax_errors_name_the_line(tmp_path):
    path = write(tmp_path, "bad.yaml", "num_layers: 2\nhidden_size: 64\nlr: [0.1\nseed: 1\n")
    with pytest.raises(ConfigError) as e:
        parse("--config", path)
    assert e.value.where.startswith(f"{path}:") and e.value.what.startswith("YAML syntax error")
    assert int(e.value.where.rsplit(":", 1)[1]) in (3, 4)
    path = write(tmp_path, "bad.json", '{\n  "num_layers": 2,\n  "lr": ,\n}\n')
    with pytest.raises(ConfigError) as e:
        parse("--config", path)
    assert e.value.where == f"{path}:3" and e.value.what.startswith("JSON syntax error")
    path = write(tmp_path, "dup.yaml", "seed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match="given twice") as e:
        parse("--config", path)
    assert e.value.where == f"{path}:2"


def test_bad_value_names_key_path_and_origin(tmp_path):
    path = write(tmp_path, "c.yaml", "training:\n  eval_iters: lots\n")
    with pytest.raises(ConfigError) as e:
        parse("--config", path)
    assert e.value.where == f"{path}:2"
    assert e.value.what.startswith("training.eval_iters = 'lots': expected an integer")
    with pytest.raises(ConfigError) as e:
        parse("--hidden-dropout", "1.5")
    assert e.value.where == "--hidden-dropout"
    assert e.value.what.startswith("model.hidden_dropout = 1.5: input should be less than 1")


# ---- batch arithmetic and the process grid


def test_batch_arithmetic_errors_show_the_arithmetic():
    with pytest.raises(ConfigError) as e:
        parse("--global-batch-size", "10")
    assert e.value.what == (
        "global_batch_size 10 is not divisible by micro_batch_size 4 × data_parallel_size 1 = 4"
    )
    assert e.value.where == "training.global_batch_size"
    with pytest.raises(ConfigError) as e:
        parse("--global-batch-size", "12", "--tensor-model-parallel-size", "2", world_size=4)
    assert e.value.what == (
        "global_batch_size 12 is not divisible by micro_batch_size 4 × data_parallel_size 2 = 8"
    )
    data = {"micro_batch_size": 4, "global_batch_size": 24, "num_micro_batches": 2}
    with pytest.raises(ConfigError) as e:
        Config.from_dict(data)
    assert e.value.what == (
        "global_batch_size 24 != micro_batch_size 4 × data_parallel_size 1 × "
        "num_micro_batches 2 = 8"
    )


@pytest.mark.parametrize("world, tp, pp, mbs, gbs", [(1, 1, 1, 4, 32), (8, 2, 2, 2, 16)])
def test_num_micro_batches(world, tp, pp, mbs, gbs):
    cfg = parse(
        *f"--micro-batch-size {mbs} --global-batch-size {gbs} --tensor-model-parallel-size {tp} "
        f"--pipeline-model-parallel-size {pp}".split(),
        world_size=world,
    )
    dp = world // (tp * pp)
    assert cfg.parallel.data_parallel_size == dp
    assert cfg.training.num_micro_batches == gbs // (mbs * dp)
    assert mbs * dp * cfg.training.num_micro_batches == gbs


def test_any_two_batch_sizes_give_the_third():
    cfg = Config.from_dict({"global_batch_size": 32, "num_micro_batches": 4, "world_size": 2})
    assert cfg.training.micro_batch_size == 32 // (4 * 2)
    cfg = Config.from_dict({"micro_batch_size": 3, "num_micro_batches": 5, "world_size": 2})
    assert cfg.training.global_batch_size == 3 * 2 * 5


def test_world_size_must_divide_by_tp_times_pp():
    with pytest.raises(ConfigError) as e:
        parse("--tensor-model-parallel-size", "4", world_size=6)
    assert e.value.what == (
        "world_size 6 is not divisible by tensor_model_parallel_size 4 × "
        "pipeline_model_parallel_size 1 = 4"
    )
    assert e.value.where == "parallel.world_size"


def test_with_world_size_revalidates():
    cfg = parse("--global-batch-size", "16", "--tensor-model-parallel-size", "2", world_size=2)
    assert (cfg.parallel.data_parallel_size, cfg.training.num_micro_batches) == (1, 4)
    bigger = cfg.with_world_size(4)
    assert (bigger.parallel.data_parallel_size, bigger.training.num_micro_batches) == (2, 2)
    assert bigger.training.global_batch_size == 16
    with pytest.raises(ConfigError, match="world_size 3 is not divisible"):
        cfg.with_world_size(3)
    with pytest.raises(ConfigError, match="global_batch_size 16 is not divisible by"):
        cfg.with_world_size(16)  # dp 8: 4 x 8 = 32 does not divide 16
    # Without --global-batch-size it follows the data-parallel size, as in Megatron.
    assert parse().with_world_size(4).training.global_batch_size == 16


def test_tensor_and_pipeline_shape_checks():
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not divisible by tensor"):
        parse("--tensor-model-parallel-size", "8", world_size=8)
    with pytest.raises(ConfigError, match="num_layers 2 is not divisible by pipeline"):
        parse("--pipeline-model-parallel-size", "4", world_size=4)
    cfg = parse(*shlex.split("--num-layers 8 --pipeline-model-parallel-size 2"), world_size=2)
    cfg = cfg.replace(num_layers_per_virtual_pipeline_stage=2, global_batch_size=8)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == (8 // 2) // 2
    with pytest.raises(ConfigError, match="interleaved schedule needs num_micro_batches 3"):
        cfg.replace(global_batch_size=12)
    cfg = parse("--sequence-parallel")
    assert cfg.parallel.sequence_parallel is False and "sequence_parallel" in cfg.warnings[0]
    assert parse("--variable-seq-lengths").parallel.variable_seq_lengths is True


# ---- model, precision, schedule checks


def test_model_and_precision_checks():
    with pytest.raises(ConfigError) as e:
        parse("--hidden-size", "66")
    assert e.value.what == "hidden_size 66 is not divisible by num_attention_heads 4"
    with pytest.raises(ConfigError) as e:
        parse("--fp16", "--bf16")
    assert e.value.what == "fp16 and bf16 are both set"
    with pytest.raises(ConfigError, match="max_position_embeddings 16 is less than seq_length 32"):
        parse("--max-position-embeddings", "16")
    with pytest.raises(ConfigError, match="recompute_num_layers is set but"):
        parse("--recompute-num-layers", "1")
    cfg = parse("--recompute-granularity", "full")
    assert (cfg.model.recompute_method, cfg.model.recompute_num_layers) == ("uniform", 1)
    assert parse("--recompute-activations").model.recompute_granularity == "selective"
    assert parse("--bf16").precision.params_dtype == "bf16"
    with pytest.raises(ConfigError, match="save_interval"):
        parse("--save", "/tmp/x")


def test_warmup_and_decay_options():
    with pytest.raises(ConfigError) as e:
        parse("--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.1")
    assert e.value.what == "lr_warmup_fraction 0.1 and lr_warmup_iters 10 are both set"
    with pytest.raises(ConfigError, match="lr_decay_samples 10 is set, but training is iter"):
        parse("--lr-decay-samples", "10")
    with pytest.raises(ConfigError, match="min_lr 0.1 is above lr 0.001"):
        parse("--min-lr", "0.1")
    cfg = parse("--lr-warmup-iters", "10", "--lr-decay-iters", "80")
    gbs = cfg.training.global_batch_size
    assert (cfg.lr_warmup_steps, cfg.lr_decay_steps) == (10 * gbs, 80 * gbs)
    with pytest.raises(ConfigError, match="warmup .* is not shorter than the decay"):
        parse("--lr-warmup-iters", "100")


def test_train_samples_to_iters_like_megatron():
    argv = without("--train-iters")
    cfg = parse_megatron_args(
        [
            *argv,
            "--global-batch-size",
            "32",
            "--train-samples",
            "1000",
            "--lr-warmup-fraction",
            "0.1",
        ]
    )
    # megatron/training/training.py update_train_iters: train_samples // global_batch_size
    assert cfg.training.train_iters == 1000 // 32
    assert cfg.lr_decay_steps == 1000  # lr_decay_samples defaults to train_samples
    assert cfg.lr_warmup_steps == pytest.approx(0.1 * 1000)
    assert "training runs 31 iterations (992 samples)" in cfg.warnings[0]
    with pytest.raises(ConfigError, match="lr_warmup_iters 5 is set, but training is sample"):
        parse_megatron_args([*argv, "--train-samples", "1000", "--lr-warmup-iters", "5"])


# ---- value formats


def test_numbers_like_5e8(tmp_path):
    argv = without("--train-iters", "--lr")
    cfg = parse_megatron_args([*argv, "--train-samples", "5e8", "--lr", "1"])
    assert cfg.training.train_samples == 5 * 10**8
    path = write(tmp_path, "c.yaml", "train_samples: 5e8\nddp_bucket_size: 4e7\nlr: 1e-4\n")
    cfg = parse_megatron_args([*argv, "--config", path])
    assert (cfg.training.train_samples, cfg.parallel.ddp_bucket_size) == (5 * 10**8, 4 * 10**7)
    assert cfg.optimizer.lr == 1e-4
    path = write(tmp_path, "c.json", '{"train_samples": 5e8, "lr": 1}')
    assert parse_megatron_args([*argv, "--config", path]).training.train_samples == 5 * 10**8
    with pytest.raises(ConfigError, match="training.train_samples = 2.5: expected an integer"):
        Config.from_dict({"micro_batch_size": 1, "train_samples": 2.5})
    with pytest.raises(ConfigError, match="invalid int value: '1.5e0'"):
        parse("--seed", "1.5e0")


def test_blended_data_paths(tmp_path):
    assert parse("--data-path", "0.3", "A", "0.7", "B").data.blend == (["A", "B"], [0.3, 0.7])
    assert parse("--data-path", "A").data.blend == (["A"], None)
    assert parse("--data-path", "A", "B").data.blend == (["A", "B"], None)
    assert parse().data.blend is None
    path = write(tmp_path, "c.yaml", "data_path: 0.25 /d/x_text_document 0.75 /d/y\n")
    cfg = parse("--config", path)
    assert cfg.data.blend == (["/d/x_text_document", "/d/y"], [0.25, 0.75])
    with pytest.raises(ConfigError, match="a blend alternates weights and prefixes"):
        parse("--data-path", "0.3", "A", "B", "C")
    with pytest.raises(ConfigError, match="a blend needs a weight before every prefix"):
        parse("--data-path", "0.3", "A", "B")


def test_per_split_data_paths():
    d = parse("--train-data-path", "0.3", "A", "0.7", "B", "--valid-data-path", "V").data
    assert (d.train_data_path, d.valid_data_path, d.test_data_path) == (
        ["0.3", "A", "0.7", "B"],
        ["V"],
        None,
    )
    assert d.per_split and d.data_path is None
    with pytest.raises(ConfigError, match="a blend alternates") as e:
        parse("--valid-data-path", "0.3", "A", "B", "C")
    assert e.value.where == "data.valid_data_path"


def test_per_split_data_paths_and_data_path_are_one_or_the_other():
    with pytest.raises(ConfigError, match="--train/valid/test-data-path and --data-path both"):
        parse("--data-path", "A", "--test-data-path", "T")


def test_data_args_path_holds_data_paths_value(tmp_path):
    path = write(tmp_path, "data.txt", "0.25 /d/x_text_document\n0.75 /d/y\n")
    assert parse("--data-args-path", path).data.blend == (
        ["/d/x_text_document", "/d/y"],
        [0.25, 0.75],
    )
    with pytest.raises(ConfigError, match="--data-args-path and --data-path both"):
        parse("--data-args-path", path, "--data-path", "A")
    with pytest.raises(ConfigError, match="cannot read it") as e:
        parse("--data-args-path", str(tmp_path / "missing.txt"))
    assert e.value.where == str(tmp_path / "missing.txt")


def test_per_split_data_args_path_holds_the_three_paths(tmp_path):
    path = write(tmp_path, "s.json", '{"train": "0.5 A 0.5 B", "valid": ["V"], "test": null}')
    d = parse("--per-split-data-args-path", path).data
    assert (d.train_data_path, d.valid_data_path, d.test_data_path) == (
        ["0.5", "A", "0.5", "B"],
        ["V"],
        None,
    )


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"train": "A",\n "vaild": "V"}', "expected an object with the keys train, valid, test"),
        ('{"train": "A",\n "valid": 3}', "'valid' is 3, not a path string or a list"),
        ('{"train": "A",\n "valid" "V"}', "not JSON: Expecting ':' delimiter"),
        ('{"train": "0.5 A B"}', "a blend needs a weight before every prefix"),
    ],
)
def test_a_bad_per_split_data_args_file_says_where(tmp_path, text, match):
    path = write(tmp_path, "s.json", text)
    with pytest.raises(ConfigError, match=match) as e:
        parse("--per-split-data-args-path", path)
    assert e.value.where.startswith(path)


def test_split_formats():
    assert parse("--split", "90/5/5").data.split_fractions == (0.9, 0.05, 0.05)
    assert parse("--split", "98,2").data.split_fractions == (0.98, 0.02, 0.0)
    with pytest.raises(ConfigError, match="split '1,x' is not"):
        parse("--split", "1,x")


# ---- round trips and printing


def test_to_dict_from_dict_round_trip(tmp_path):
    cfg = parse(
        *shlex.split(
            "--global-batch-size 16 --bf16 --lr-decay-style cosine --lr-warmup-fraction 0.01 "
            "--data-path 0.5 A 0.5 B --tensor-model-parallel-size 2 --save /ckpt "
            "--save-interval 10 --recompute-granularity full"
        ),
        world_size=4,
    )
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data  # JSON-safe
    again = Config.from_dict(data)
    assert again == cfg and again.flat() == cfg.flat()
    assert data["training"]["num_micro_batches"] is None  # inputs, not derived values
    for name in ("c.yaml", "c.json"):
        write_config_file(data, tmp_path / name)
        assert load_config(tmp_path / name, world_size=4).flat() == cfg.flat()
    assert cfg != cfg.replace(seed=1)


def test_config_is_frozen():
    cfg = parse()
    with pytest.raises(pydantic.ValidationError):
        cfg.model.hidden_size = 128
    assert cfg.replace(hidden_size=128).model.ffn_hidden_size == 512


def test_format_config_is_megatrons_block():
    cfg = parse()
    lines = format_config(cfg).splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower)
    assert "  num_layers " + "." * (48 - len("num_layers")) + " 2" in body
    assert "  params_dtype " + "." * (48 - len("params_dtype")) + " torch.float32" in body
    assert len(body) == len(cfg.flat())
    assert cfg.describe() == format_config(cfg)
    assert math.isclose(cfg.flat()["lr"], 1e-3)


def test_weight_decay_increment_like_megatron():
    cfg = parse("--weight-decay", "0.1")
    assert (cfg.optimizer.start_weight_decay, cfg.optimizer.end_weight_decay) == (0.1, 0.1)
    cfg = parse(
        *shlex.split(
            "--weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.1"
        )
    )
    assert (cfg.optimizer.start_weight_decay, cfg.optimizer.end_weight_decay) == (0.0, 0.1)
    # Megatron increments weight decay over train_iters x global_batch_size samples.
    assert cfg.training.train_samples == 100 * 4
    with pytest.raises(ConfigError, match="needs start_weight_decay and end_weight_decay"):
        parse("--weight-decay-incr-style", "cosine", "--start-weight-decay", "0")
    with pytest.raises(ConfigError, match="start_weight_decay is set but"):
        parse("--start-weight-decay", "0")
    assert parse("--lr-decay-style", "inverse-square-root").scheduler.lr_decay_style == (
        "inverse-square-root"
    )


def test_train_valid_test_num_samples_like_megatron():
    cfg = parse("--eval-interval", "30", "--eval-iters", "5", "--global-batch-size", "8")
    # megatron/training/training.py get_train_valid_test_num_samples
    assert cfg.train_valid_test_num_samples == (100 * 8, (100 // 30 + 1) * 5 * 8, 5 * 8)


# ---- one derivation: the batch arithmetic every loader shares


@pytest.mark.parametrize(
    "given,want",
    [
        ((2, None, None), (2, 8, 1)),
        ((2, 16, None), (2, 16, 2)),
        ((None, 16, 2), (2, 16, 2)),
        ((2, None, 3), (2, 24, 3)),
        ((2, 16, 2), (2, 16, 2)),
    ],
)
def test_batch_geometry_any_two_give_the_third(given, want):
    from zerotron.config.derive import MEGATRON_BATCH, batch_geometry

    assert batch_geometry(*given, 4, MEGATRON_BATCH) == want
    mbs, gbs, nmb = given
    cfg = Config.from_dict(
        {
            "world_size": 4,
            "micro_batch_size": mbs,
            "global_batch_size": gbs,
            "num_micro_batches": nmb,
        }
    )
    t = cfg.training
    assert (t.micro_batch_size, t.global_batch_size, t.num_micro_batches) == want


def test_partition_activations_is_turned_off_under_sequence_parallelism_with_a_warning():
    cfg = parse("--tensor-model-parallel-size", "2", "--sequence-parallel",
                "--checkpoint-activations", "--partition-activations", world_size=2)  # fmt: skip
    assert not cfg.activation_checkpointing.partition_activations
    assert cfg.warnings == [
        "partition_activations turned off under sequence_parallel: each tensor-parallel rank's "
        "checkpointed layer input is already its 1/tp of the sequence"
    ]
