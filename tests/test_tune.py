"""The autotuner without a training job: DeepSpeed's ``autotuning`` block (accepted, its
defaults, a bad key), the search space (DeepSpeed's micro-batch arithmetic, ZeRO's memory rule,
pruning by the estimator), the engine measuring itself in one process, and the tuner stepping
over failing, out-of-memory and hung experiments (tiny scripts that fail or sleep)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import zerotron
from zerotron.config import parse_megatron_args
from zerotron.config.deepspeed import load_deepspeed_config
from zerotron.config.sections import AutotuningConfig
from zerotron.errors import ConfigError
from zerotron.launcher.autotune import launch_flags
from zerotron.launcher.flags import build_parser
from zerotron.tuning import results, space
from zerotron.tuning.estimate import Layout, ModelShape, estimate
from zerotron.tuning.experiments import Experiment, Outcome, classify
from zerotron.tuning.tune import Tuner, TuneRequest, autotuning_options
from zerotron.tuning.tune_pretrain import PretrainTuner, pretrain_points, strip_flags

# DeepSpeed's defaults (deepspeed/autotuning/constants.py)
DEEPSPEED_DEFAULTS = {
    "enabled": False,
    "fast": True,
    "results_dir": "autotuning_results",
    "exps_dir": "autotuning_exps",
    "overwrite": True,
    "metric": "throughput",
    "start_profile_step": 3,
    "end_profile_step": 5,
    "metric_path": None,
    "model_info_path": None,
    "tuner_type": "gridsearch",
    "tuner_early_stopping": 5,
    "tuner_num_trials": 50,
    "arg_mappings": None,
    "mp_size": 1,
    "max_train_batch_size": None,
    "min_train_batch_size": 1,
    "max_train_micro_batch_size_per_gpu": 1024,
    "min_train_micro_batch_size_per_gpu": 1,
    "num_tuning_micro_batch_sizes": 3,
}


def test_the_autotuning_block_is_accepted_with_deepspeeds_defaults():
    cfg, _ = load_deepspeed_config({"train_batch_size": 4, "autotuning": {"enabled": True}})
    got = {k: getattr(cfg.autotuning, f"autotuning_{k}") for k in DEEPSPEED_DEFAULTS}
    assert got == {**DEEPSPEED_DEFAULTS, "enabled": True}


def test_every_deepspeed_autotuning_key_sets_its_field():
    block = {
        "enabled": True, "fast": False, "results_dir": "r", "exps_dir": "e", "overwrite": False,
        "metric": "latency", "start_profile_step": 1, "end_profile_step": 4,
        "metric_path": "m.json", "model_info_path": "i.json", "tuner_type": "random",
        "tuner_early_stopping": 2, "tuner_num_trials": 7,
        "arg_mappings": {"train_micro_batch_size_per_gpu ": " --batch-size"}, "mp_size": 2,
        "max_train_batch_size": 64, "min_train_batch_size": 2,
        "max_train_micro_batch_size_per_gpu": 16, "min_train_micro_batch_size_per_gpu": 2,
        "num_tuning_micro_batch_sizes": 4,
        "model_info": {"profile": True, "num_params": 10, "hidden_size": 8, "num_layers": 2},
    }  # fmt: skip
    o = autotuning_options(block)
    assert o.autotuning_arg_mappings == {"train_micro_batch_size_per_gpu": "--batch-size"}
    assert (o.autotuning_model_info_profile, o.autotuning_model_info_num_params) == (True, 10)
    for key, value in block.items():
        if key not in ("arg_mappings", "model_info"):
            assert getattr(o, f"autotuning_{key}") == value, key


def test_an_unknown_autotuning_key_names_its_path():
    with pytest.raises(ConfigError, match=r"autotuning\.tuner_typ.*autotuning\.tuner_type"):
        autotuning_options({"tuner_typ": "random"})


def test_a_bad_autotuning_value_names_its_path():
    with pytest.raises(ConfigError, match=r"autotuning\.metric: 'speed' is not one of"):
        autotuning_options({"metric": "speed"})


def test_pretrain_flags_set_the_autotuning_fields():
    cfg = parse_megatron_args(
        [*TINY, "--autotuning-enabled", "--autotuning-end-profile-step", "9"], world_size=2
    )
    assert cfg.autotuning.autotuning_enabled and cfg.autotuning.autotuning_end_profile_step == 9


def test_the_launcher_takes_deepspeeds_autotuning_flag_and_keeps_it_from_experiments():
    argv = ["--autotuning", "run", "--nproc_per_node", "2", "--zero_stages", "all", "t.py", "-x"]
    args = build_parser().parse_args(argv)
    assert (args.autotuning, args.zero_stages, args.script_args) == ("run", [0, 1, 2, 3], ["-x"])
    assert launch_flags(argv, args.script_args) == ["--nproc_per_node", "2", "t.py"]


# ---- the search space


def test_deepspeeds_micro_batch_list():
    # autotuner.get_tuning_micro_batch_size_list, worked by hand: from max // 2 in strides of
    # (max - min) // num, without the sizes whose accumulation steps equal the largest's.
    assert space.micro_batch_list(1, 16, 3, 16) == [8, 16]
    assert space.micro_batch_list(1, 10, 3, 20) == [5, 6, 10]
    assert space.micro_batch_list(0, 10, 3, 10) == []


def test_zero_stages_of_a_config():
    assert space.zero_stages("all") == [0, 1, 2, 3]
    assert space.zero_stages([2, 1]) == [1, 2]
    assert space.zero_stages(None) == [0]
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        space.zero_stages(4)


def test_deepspeeds_instantiation_memory_rule():
    # 16-bit Adam: 2 + 2 + 16 bytes a parameter; ZeRO-3 divides all of them by the GPUs
    assert space.instantiation_bytes(10**9, 0, 8, fp16=True) == 20e9
    assert space.instantiation_bytes(10**9, 1, 8, fp16=True) == 4e9 + 16e9 / 8
    assert space.instantiation_bytes(10**9, 3, 8, fp16=True) == 20e9 / 8


def test_ds_experiments_set_the_batch_keys_as_deepspeed():
    user = {"train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": [0, 1],
            "overlap_comm": True}, "autotuning": {"enabled": True}}  # fmt: skip
    exps = space.ds_experiments(user, 1, [2, 4], 8, world=4, mp_size=2)
    assert [e.name for e in exps] == ["z1_gas4_tmbspg2", "z1_gas2_tmbspg4"]
    c = exps[0].ds_config
    assert "autotuning" not in c and c["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (2, 4)
    assert c["train_batch_size"] == 2 * 4 * 4 // 2


TINY = [
    "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "1024", "--micro-batch-size", "1", "--global-batch-size", "16",
    "--lr", "1e-4", "--train-iters", "10", "--bf16",
]  # fmt: skip


def _pretrain_request(device: int, **kw) -> TuneRequest:
    return TuneRequest(
        launch_cmd=["true"], script="zerotron", module=True, script_args=["pretrain", *TINY],
        world_size=2, device_memory=device, **kw,
    )  # fmt: skip


def test_the_estimator_prunes_what_does_not_fit():
    req = _pretrain_request(1, zero_stages=[0, 1, 2], micro_batch_sizes=[1, 4])
    tuner = PretrainTuner(req, 2)
    points = [
        p for p in pretrain_points(tuner.cfg, 2, tuner.opts, zero_stages=[0, 1, 2],
                                   micro_batch_sizes=[1, 4]) if p["pp"] == 1
    ]  # fmt: skip
    exps = [tuner.candidate(p)[0] for p in points]
    shape = ModelShape.from_config(tuner.cfg)
    for e, p in zip(exps, points):  # each point's flags give its layout, priced by the estimator
        layout = Layout.from_config(parse_megatron_args(e.script_args, world_size=2))
        got = (layout.tp, layout.zero_stage, layout.micro_batch_size)
        assert got == (p["tp"], p["zero_stage"], p["micro_batch_size"])
        assert e.estimated_bytes == estimate(shape, layout).total
    totals = sorted(e.estimated_bytes for e in exps)
    device = (totals[0] + totals[-1]) // 2
    kept, pruned = space.prune(exps, device)
    assert kept and pruned
    assert all(e.estimated_bytes <= device for e in kept)
    assert all(e.estimated_bytes > device for e in pruned)


def _block_estimates(tuner: PretrainTuner, point: dict) -> dict[int, int]:
    """The estimator's total for each number of block-recomputed layers (1 .. 23 of 24)."""
    from zerotron.tuning.tune_pretrain import estimated_bytes, point_flags

    out = {}
    for n in range(1, 24):
        flags = point_flags({**point, "recompute_num_layers": n})
        out[n] = estimated_bytes(parse_megatron_args([*TINY, *flags], world_size=2))
    return out


BLOCK_POINT = {"zero_stage": 1, "tp": 2, "pp": 1, "recompute": "block", "micro_batch_size": 1,
               "gradient_accumulation_steps": 16, "recompute_num_layers": None}  # fmt: skip


def test_a_block_recompute_point_recomputes_the_fewest_layers_that_fit():
    estimates = _block_estimates(PretrainTuner(_pretrain_request(2**40), 2), BLOCK_POINT)
    assert all(estimates[n] > estimates[n + 1] for n in range(1, 23))  # memory falls with n
    device = (estimates[5] + estimates[6]) // 2  # 6 layers fit, 5 do not
    exp, refused = PretrainTuner(_pretrain_request(device), 2).candidate(BLOCK_POINT)
    assert refused is None
    assert exp.settings["recompute_num_layers"] == 6 and exp.name.startswith("z1_tp2_pp1_rcblk6_")
    assert exp.estimated_bytes == estimates[6]
    cfg = parse_megatron_args(exp.script_args, world_size=2)
    m = cfg.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full",
        "block",
        6,
    )


def test_a_block_recompute_point_that_never_fits_is_left_to_the_pruner():
    tuner = PretrainTuner(_pretrain_request(1), 2)
    exp, refused = tuner.candidate(BLOCK_POINT)
    assert refused is None and exp.settings["recompute_num_layers"] == 23
    assert space.prune([exp], tuner.device) == ([], [exp])


def test_block_recompute_needs_two_layers_per_chunk():
    req = _pretrain_request(2**40)
    req.script_args = [a if a != "24" else "2" for a in req.script_args]  # 2 layers, pp 2
    point = {**BLOCK_POINT, "tp": 1, "pp": 2, "zero_stage": 0}
    assert "2 or more layers per chunk, not 1" in PretrainTuner(req, 2).candidate(point)[1]


def test_an_unknown_recompute_choice_is_refused():
    tuner = PretrainTuner(_pretrain_request(2**40), 2)
    with pytest.raises(ConfigError, match="unknown recompute choice blocks"):
        pretrain_points(tuner.cfg, 2, tuner.opts, recompute=["full", "blocks"])


def test_an_experiment_drops_the_flags_it_sets_itself():
    args = ["--save", "ck", "--recompute-activations", "--recompute-granularity=full", "--lr", "1"]
    assert strip_flags(args) == ["--lr", "1"]
    megatron_deepspeed = ["--checkpoint-activations", "--checkpoint-num-layers", "2", "--lr", "1"]
    assert strip_flags(megatron_deepspeed) == ["--lr", "1"]


# ---- the engine measures itself (one process)


def test_an_enabled_engine_writes_deepspeeds_metric_keys_and_ends(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    metric = tmp_path / "metrics.json"
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3,
                       "metric_path": str(metric)},
    }  # fmt: skip
    engine, *_ = zerotron.initialize(model=model, model_parameters=model.parameters(),
                                     config=config)  # fmt: skip
    steps = []
    with pytest.raises(SystemExit) as stop:
        while len(steps) < 10:
            for _ in range(2):
                engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
                engine.step()
            steps.append(engine.global_steps)
    assert stop.value.code == 0 and steps == [1, 2]  # it ended in step 3
    m = json.loads(metric.read_text())
    assert m["steps"] == 2 and m["train_batch_size"] == 4
    assert m["throughput"] == pytest.approx(4 / (m["latency"] / 1000))
    # two Linear(8, 8) forwards of 2 samples, 2 micro-batches, x3 for the backward
    assert m["flops"] == pytest.approx(3 * 2 * (2 * 2 * 8 * 8) * 2 / (m["latency"] / 1000))


# ---- failing, out-of-memory and hung experiments are recorded and stepped over

SCRIPT = """
import json, sys, time
mode, path = sys.argv[1], sys.argv[2]
if mode == "fail":
    raise RuntimeError("this experiment fails")
if mode == "oom":
    raise MemoryError("pretend the device is full")
if mode == "hang":
    time.sleep(600)
json.dump({"throughput": float(mode), "latency": 1000 / float(mode)}, open(path, "w"))
"""


class _ScriptTuner(Tuner):
    def prepare_experiment(self, exp, result_dir, metric_path):
        exp.script_args = [exp.settings["mode"], str(metric_path)]

    def optimal(self, best):
        return {}, [*self.req.launch_cmd, *best[0].script_args]


def test_failing_oom_and_hung_experiments_are_recorded_and_skipped(tmp_path):
    script = tmp_path / "exp.py"
    script.write_text(SCRIPT)
    req = TuneRequest([sys.executable, str(script)], str(script), False, [], 1,
                      time_limit_s=2.0, device_memory=2**30, say=lambda _: None)  # fmt: skip
    opts = AutotuningConfig(autotuning_results_dir=str(tmp_path / "r"),
                            autotuning_exps_dir=str(tmp_path / "e"))  # fmt: skip
    tuner = _ScriptTuner(req, opts, 1)
    tuner.prepare_dirs()
    modes = ["5", "fail", "oom", "hang", "7"]
    exps = [Experiment(f"x{i}_{m}", "z0", {"mode": m}) for i, m in enumerate(modes)]
    done = tuner.run_space(exps, tuner.device)
    assert [o.status for _, o in done] == ["ok", "failed", "oom", "timeout", "ok"]
    assert "this experiment fails" in done[1][1].error
    assert done[3][1].seconds < 2.0 + 10
    assert tuner.finish() == 0
    rows = (tmp_path / "r" / "results.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [e.name for e in exps]
    assert "x4_7" in (tmp_path / "r" / "cmd_optimal.txt").read_text()  # 7 beats 5
    assert "| global | 5 | 7 | x4_7 |" in (tmp_path / "r" / "summary.txt").read_text()
    assert (tmp_path / "r" / "metric.png").stat().st_size > 0


def test_classify_reads_the_exit_and_the_log():
    assert classify(0, False, "", {"throughput": 1.0}) == ("ok", "")
    assert classify(0, False, "", None)[0] == "no-metric"
    assert classify(1, False, "torch.OutOfMemoryError: CUDA out of memory", None)[0] == "oom"
    assert classify(None, True, "", None)[0] == "timeout"


def test_best_minimizes_latency_and_maximizes_throughput():
    a = (Experiment("a", "z0", {}), Outcome("ok", {"latency": 2.0, "throughput": 5.0}))
    b = (Experiment("b", "z0", {}), Outcome("ok", {"latency": 1.0, "throughput": 4.0}))
    assert results.best_record([a, b], "latency")[0].name == "b"
    assert results.best_record([a, b], "throughput")[0].name == "a"


def test_a_pretrain_experiment_measures_itself_at_its_point(tmp_path):
    req = _pretrain_request(2**40)
    req.script_args += ["--save", str(tmp_path / "ckpt"), "--save-interval", "50"]
    req.script_args += ["--recompute-activations"]
    tuner = PretrainTuner(req, 2)
    point = {"zero_stage": 1, "tp": 2, "pp": 1, "recompute": "full", "micro_batch_size": 2,
             "gradient_accumulation_steps": 8}  # fmt: skip
    exp, refused = tuner.candidate(point)
    assert refused is None
    tuner.prepare_experiment(exp, tmp_path, tmp_path / "m.json")
    assert exp.script_args[0] == "pretrain" and "--save" not in exp.script_args
    cfg = parse_megatron_args(exp.script_args[1:], world_size=2)
    assert (cfg.zero.zero_stage, cfg.parallel.tensor_model_parallel_size) == (1, 2)
    assert (cfg.training.micro_batch_size, cfg.training.num_micro_batches) == (2, 8)
    assert cfg.model.recompute_granularity == "full"
    a = cfg.autotuning
    assert a.autotuning_enabled and a.autotuning_metric_path == str(tmp_path / "m.json")
    assert cfg.training.train_iters == a.autotuning_end_profile_step + 1


def test_a_point_the_config_refuses_is_invalid_without_launching():
    tuner = PretrainTuner(_pretrain_request(2**40), 2)
    point = {"zero_stage": 3, "tp": 1, "pp": 2, "recompute": "none", "micro_batch_size": 1,
             "gradient_accumulation_steps": 16}  # fmt: skip
    assert tuner.candidate(point)[1]  # ZeRO-3 with a pipeline: refused, with the reason


def test_arg_mappings_pass_the_experiments_values_to_the_script(tmp_path):
    from zerotron.tuning.tune import DeepSpeedScriptTuner

    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto",
        "autotuning": {"arg_mappings": {"train_micro_batch_size_per_gpu": "--bs",
                                        "gradient_accumulation_steps": "--gas"}},
    }))  # fmt: skip
    args = ["--deepspeed_config", str(tmp_path / "ds.json"), "--bs", "1"]
    req = TuneRequest(["x"], "t.py", False, args, 2, device_memory=2**30)
    tuner = DeepSpeedScriptTuner(req, 2)
    exp = space.ds_experiments(tuner.user_config, 0, [4], 8, world=2)[0]
    got = tuner.script_args(tmp_path / "exp.json", exp)
    assert got == ["--deepspeed_config", str(tmp_path / "exp.json"), "--bs", "4", "--gas", "2"]


def test_early_stopping_is_deepspeeds(tmp_path):
    # best at index 1; with tuner_early_stopping 2 DeepSpeed stops when 1 + 2 experiments ran
    script = tmp_path / "exp.py"
    script.write_text(SCRIPT)
    req = TuneRequest([sys.executable, str(script)], str(script), False, [], 1,
                      device_memory=2**30, say=lambda _: None)  # fmt: skip
    opts = AutotuningConfig(autotuning_results_dir=str(tmp_path / "r"),
                            autotuning_exps_dir=str(tmp_path / "e"),
                            autotuning_tuner_early_stopping=2)  # fmt: skip
    tuner = _ScriptTuner(req, opts, 1)
    tuner.prepare_dirs()
    exps = [Experiment(f"x{m}", "z0", {"mode": m}) for m in ("3", "9", "4", "5", "6")]
    assert [e.name for e, _ in tuner.run_space(exps, None)] == ["x3", "x9", "x4"]
