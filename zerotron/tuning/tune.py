"""The autotuner: ``zerotron tune`` / ``zerotron launch --autotuning tune|run``.

    zerotron tune --nproc_per_node 8 train.py --deepspeed_config ds.json
    zerotron launch --autotuning run --nproc_per_node 8 -m zerotron pretrain --num-layers 24 ...

DeepSpeed's autotuner, on zerotron's launcher and estimator:

1. **Profile the model once.** A DeepSpeed script gets DeepSpeed's model-info run (ZeRO-3,
   micro-batch 1; the engine writes the parameter count and the activation memory of one
   forward, then ends) unless ``autotuning.model_info.num_params`` is given. For
   ``zerotron pretrain`` the estimator says both without running.
2. **Prune with the estimator.** Per ZeRO stage the largest micro-batch that fits the device
   (``--device_memory``, else the GPU's memory, else this host's RAM over the local ranks);
   what does not fit is recorded as pruned and not run.
3. **Run short timed experiments**, one launched job each (:mod:`zerotron.tuning.experiments`)
   with a time limit; the engine measures the steps after ``start_profile_step`` up to
   ``end_profile_step`` and ends. A failing, OOM-ing or hung experiment is recorded and the
   tuner goes on. Spaces are DeepSpeed's ``z0`` .. ``z3`` (ZeRO stage × micro-batch, and with
   ``fast: false`` ZeRO's knobs at the stage's best micro-batch); ``zerotron pretrain`` also
   searches tensor-parallel, pipeline-parallel and recompute, at the user's global batch.
   Per space at most ``tuner_num_trials`` experiments, stopping ``tuner_early_stopping``
   experiments after the best one (DeepSpeed's rule).
4. **Write the results** (:mod:`zerotron.tuning.results`) and, with ``run``, launch the best.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotron.config.sections import AutotuningConfig
from zerotron.errors import ConfigError, LaunchError
from zerotron.fileio import human_bytes
from zerotron.tuning import results, space
from zerotron.tuning.experiments import Experiment, Outcome, run_experiment

ZEROTRON_MODULES = ("zerotron", "zerotron.cli", "zerotron.__main__")
DS_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--deepspeed")


@dataclass
class TuneRequest:
    """What to tune: the launch command without its script arguments, and the search limits."""

    launch_cmd: list[str]  # python -m zerotron launch <flags> [-m] SCRIPT
    script: str
    module: bool
    script_args: list[str]
    world_size: int
    mode: str = "tune"  # "tune" | "run"
    time_limit_s: float = 600.0
    device_memory: int | None = None
    zero_stages: list[int] | None = None
    micro_batch_sizes: list[int] | None = None
    tensor_parallel_sizes: list[int] | None = None
    pipeline_parallel_sizes: list[int] | None = None
    recompute: list[str] | None = None
    env: dict[str, str] | None = None
    say: Any = field(default=None, repr=False)

    @property
    def is_pretrain(self) -> bool:
        return (
            self.module and self.script in ZEROTRON_MODULES and self.script_args[:1] == ["pretrain"]
        )


def device_bytes(given: int | None, nproc_per_node: int) -> int:
    """Memory one rank may use: ``given``, the GPU's, or this host's RAM over its ranks."""
    if given is not None:
        return given
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().total // max(nproc_per_node, 1)


class Tuner:
    """Runs the search for one request (see the module docstring)."""

    def __init__(self, req: TuneRequest, options: AutotuningConfig, nproc_per_node: int):
        self.req = req
        self.opts = options
        self.metric = options.autotuning_metric
        self.results_dir = Path(options.autotuning_results_dir).resolve()
        self.exps_dir = Path(options.autotuning_exps_dir).resolve()
        self.device = device_bytes(req.device_memory, nproc_per_node)
        self.records: list[results.Record] = []
        self.launched = 0  # experiments started so far (the progress count)
        self.header: list[str] = []
        self.started = time.perf_counter()

    def say(self, text: str) -> None:
        (self.req.say or _say)(text)

    def prepare_dirs(self) -> None:
        import shutil

        for d in (self.results_dir, self.exps_dir):
            if self.opts.autotuning_overwrite and d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True, exist_ok=True)

    # ---- one space: DeepSpeed's tuner loop

    def run_space(self, exps: list[Experiment], device: float | None) -> list[results.Record]:
        kept, pruned = space.prune(exps, device)
        done: list[results.Record] = []
        for exp in pruned:
            note = f"estimated {human_bytes(exp.estimated_bytes or 0)} > {human_bytes(device)}"
            done.append((exp, Outcome("pruned", error=note)))
            self.say(f"{exp.name}: pruned ({note})")
        best_i, best_value = 0, None
        ordered = space.order(kept, self.opts.autotuning_tuner_type)
        trials = ordered[: self.opts.autotuning_tuner_num_trials]
        stop = self.opts.autotuning_tuner_early_stopping
        for i, exp in enumerate(trials):
            outcome = self.run_one(exp)
            done.append((exp, outcome))
            value = results.metric_value(outcome, self.metric)
            if value is not None and results.better(value, best_value, self.metric):
                best_i, best_value = i, value
            # DeepSpeed's BaseTuner: stop once `stop` experiments ran since the best one's index
            if i + 1 >= best_i + stop and i + 1 < len(trials):
                self.say(f"{exp.space}: early stop, no better {self.metric} in {stop} experiments")
                break
        self.records.extend(done)
        return done

    def run_one(self, exp: Experiment) -> Outcome:
        result_dir = self.results_dir / exp.name
        metric_path = result_dir / "metrics.json"
        self.prepare_experiment(exp, result_dir, metric_path)
        (self.exps_dir / f"{exp.name}.json").write_text(
            json.dumps({"name": exp.name, "settings": exp.settings, "ds_config": exp.ds_config})
        )
        self.launched += 1
        n = self.launched
        self.say(f"[{n}] {exp.name}: running (limit {self.req.time_limit_s:g} s)")
        outcome = run_experiment(
            exp,
            self.req.launch_cmd,
            result_dir,
            time_limit_s=self.req.time_limit_s,
            metric_path=metric_path,
            env=self.req.env,
        )
        value = results.metric_value(outcome, self.metric)
        shown = f"{self.metric} {value:.4g} {results.UNITS[self.metric]}" if value else ""
        self.say(
            f"[{n}] {exp.name}: {outcome.status} {shown or outcome.error} ({outcome.seconds:.1f} s)"
        )
        return outcome

    def prepare_experiment(self, exp: Experiment, result_dir: Path, metric_path: Path) -> None:
        raise NotImplementedError

    def optimal(self, best: results.Record) -> tuple[dict[str, Any], list[str]]:
        raise NotImplementedError

    # ---- the end: results, best config, run

    def finish(self) -> int:
        header = [
            f"zerotron tune: {len(self.records)} experiments, metric {self.metric}, "
            f"{human_bytes(self.device)} per rank",
            *self.header,
            f"Tuning completed in {time.perf_counter() - self.started:.1f} s.",
        ]
        text = results.write_all(self.records, self.metric, self.results_dir, header)
        print(text, flush=True)
        best = results.best_record(self.records, self.metric)
        if best is None:
            self.say(f"no experiment ran to its metric; see {self.results_dir}/summary.txt")
            return 1
        config, cmd = self.optimal(best)
        config_path, cmd_path = results.write_optimal(best, config, cmd, self.results_dir)
        self.say(f"best: {best[0].name}; wrote {config_path} and {cmd_path}")
        if self.req.mode != "run":
            return 0
        self.say(f"running the best: {' '.join(cmd)}")
        return subprocess.call(cmd, env=self.req.env)


class DeepSpeedScriptTuner(Tuner):
    """A script started with ``--deepspeed_config ds.json`` (or HF's ``--deepspeed ds.json``)."""

    def __init__(self, req: TuneRequest, nproc_per_node: int):
        self.config_index = _config_arg(req.script_args)
        path = req.script_args[self.config_index + 1]
        from zerotron.config.deepspeed import read_deepspeed_config

        self.user_config, _ = read_deepspeed_config(path)
        options = autotuning_options(self.user_config.get("autotuning"), path)
        super().__init__(req, options, nproc_per_node)
        self.mp = options.autotuning_mp_size
        self.fp16 = bool((self.user_config.get("fp16") or {}).get("enabled", False))

    def script_args(self, ds_config_path: Path, exp: Experiment | None = None) -> list[str]:
        args = list(self.req.script_args)
        args[self.config_index + 1] = str(ds_config_path)
        for key, flag in (self.opts.autotuning_arg_mappings or {}).items():
            value = (exp.ds_config or {}).get(key) if exp is not None else None
            if value is None or value == "auto":
                continue
            if flag in args:
                args[args.index(flag) + 1] = str(value)
            else:
                args += [flag, str(value)]
        return args

    def prepare_experiment(self, exp: Experiment, result_dir: Path, metric_path: Path) -> None:
        exp.ds_config = dict(exp.ds_config or {})
        auto = {k: v for k, v in (self.user_config.get("autotuning") or {}).items()}
        for key in ("results_dir", "exps_dir", "model_info", "model_info_path"):
            auto.pop(key, None)
        auto.update(enabled=True, metric_path=str(metric_path))
        if exp.name == "profile_model_info":
            auto.update(model_info={"profile": True}, model_info_path=str(metric_path))
        exp.ds_config["autotuning"] = auto
        exp.script_args = self.script_args(result_dir / "ds_config.json", exp)

    def profile(self) -> dict[str, Any] | None:
        """DeepSpeed's model-info run: ZeRO-3, micro-batch 1, one forward measured."""
        o = self.opts
        if o.autotuning_model_info_num_params:
            return {"num_params": o.autotuning_model_info_num_params, "activation_mem_per_gpu": 0}
        config = {k: v for k, v in self.user_config.items() if k != "autotuning"}
        config.update(
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            train_batch_size=self.req.world_size // self.mp,
            zero_optimization={"stage": 3},
        )
        exp = Experiment("profile_model_info", "profile", {"zero_stage": 3}, ds_config=config)
        outcome = self.run_one(exp)
        if outcome.status != "ok":
            raise LaunchError(
                f"the model-info profiling run did not finish: {outcome.status}: {outcome.error}",
                where=str(self.results_dir / exp.name),
                fix="run the script once without --autotuning to see it work; its logs are there",
            )
        return outcome.metrics

    def tune(self) -> int:
        self.prepare_dirs()
        info = self.profile()
        num_params = int(info["num_params"])
        act = int(info.get("activation_mem_per_gpu") or 0)
        source = "model_info" if self.opts.autotuning_model_info_num_params else "profiled"
        self.header += [
            f"model: {num_params:,} parameters, activation memory per sample "
            f"{human_bytes(act)} ({source})"
        ]
        stages = self.req.zero_stages or space.zero_stages(
            (self.user_config.get("zero_optimization") or {}).get("stage")
        )
        user_mbs = self.user_config.get("train_micro_batch_size_per_gpu")
        gas = self.user_config.get("gradient_accumulation_steps")
        gas = gas if isinstance(gas, int) else 1
        o, world = self.opts, self.req.world_size
        cap = o.autotuning_max_train_micro_batch_size_per_gpu
        if o.autotuning_max_train_batch_size:
            cap = min(cap, o.autotuning_max_train_batch_size * self.mp // world)
        prev_max = 0
        for stage in stages:
            model = space.instantiation_bytes(num_params, stage, world, self.mp, self.fp16)
            calc_max = space.max_micro_batch(self.device, model, act, cap)
            if calc_max < max(prev_max, 1):
                self.say(f"z{stage}: skipped (largest micro-batch that fits: {calc_max})")
                continue
            given = self.req.micro_batch_sizes
            if not given and isinstance(user_mbs, list):
                given = user_mbs
            if given:
                mbs_list = sorted(m for m in given if isinstance(m, int))
                max_tb = max(mbs_list) * gas
            else:
                lo = (
                    user_mbs
                    if isinstance(user_mbs, int)
                    else o.autotuning_min_train_micro_batch_size_per_gpu
                )
                max_tb = (
                    o.autotuning_max_train_batch_size * self.mp // world
                    if o.autotuning_max_train_batch_size
                    else calc_max * gas // self.mp
                )
                mbs_list = space.micro_batch_list(
                    lo, calc_max, o.autotuning_num_tuning_micro_batch_sizes, max_tb
                )
            prev_max = max(prev_max, calc_max)

            def bytes_of(stage: int, mbs: int, model: float = model) -> float:
                return model + act * mbs

            exps = space.ds_experiments(
                self.user_config,
                stage,
                mbs_list,
                max_tb,
                world=world,
                mp_size=self.mp,
                bytes_of=bytes_of,
            )
            done = self.run_space(exps, self.device)
            best = results.best_record(done, self.metric)
            if o.autotuning_fast or stage == 0 or best is None:
                continue
            mbs = best[0].settings["micro_batch_size"]
            grid = [
                e
                for knobs in space.knob_grid(stage)
                for e in space.ds_experiments(
                    self.user_config,
                    stage,
                    [mbs],
                    max_tb,
                    world=world,
                    mp_size=self.mp,
                    knobs=knobs,
                    bytes_of=bytes_of,
                )
            ]
            self.run_space(grid, self.device)
        return self.finish()

    def optimal(self, best: results.Record) -> tuple[dict[str, Any], list[str]]:
        config = {k: v for k, v in (best[0].ds_config or {}).items() if k != "autotuning"}
        path = self.results_dir / "ds_config_optimal.json"
        exp = Experiment("optimal", "optimal", {}, ds_config=config)
        return config, [*self.req.launch_cmd, *self.script_args(path, exp)]


def _config_arg(args: list[str]) -> int:
    for flag in DS_CONFIG_FLAGS:
        if flag in args:
            i = args.index(flag)
            if i + 1 < len(args) and args[i + 1].endswith(".json"):
                return i
    raise ConfigError(
        "the script gets no DeepSpeed config: the autotuner reads its autotuning block and "
        "writes each experiment's config in its place",
        where="zerotron tune",
        fix="pass it as --deepspeed_config ds.json (or --deepspeed ds.json), or tune "
        "-m zerotron pretrain",
    )


def autotuning_options(block: Any, where: str | None = None) -> AutotuningConfig:
    """DeepSpeed's ``autotuning`` block checked against the config table (errors name the key
    path), with DeepSpeed's defaults."""
    from zerotron.config.deepspeed import load_deepspeed_config

    try:
        cfg, _ = load_deepspeed_config(
            {"train_micro_batch_size_per_gpu": 1, "autotuning": dict(block or {})}
        )
    except ConfigError as e:
        if where and not e.where:
            e.where = where  # the file the block is in
        raise
    return cfg.autotuning


def _say(text: str) -> None:
    print(f"zerotron tune: {text}", file=sys.stderr, flush=True)


def autotune(req: TuneRequest, nproc_per_node: int) -> int:
    """Tune ``req`` and (mode ``run``) launch the best; returns the exit code."""
    if req.is_pretrain:
        from zerotron.tuning.tune_pretrain import PretrainTuner

        return PretrainTuner(req, nproc_per_node).tune()
    return DeepSpeedScriptTuner(req, nproc_per_node).tune()
