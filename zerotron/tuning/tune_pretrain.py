"""The autotuner for ``zerotron pretrain``: ZeRO stage × tensor-parallel × pipeline-parallel ×
recompute × micro-batch at the user's global batch, each point's memory from the estimator.

Every experiment is the user's command line with the point's flags appended (the last flag
wins) and the autotuning flags that make the run measure itself and end:
``--autotuning-enabled --autotuning-metric-path ... --train-iters <end_profile_step>``; the
user's ``--save`` is dropped so no experiment writes checkpoints. A point the config refuses
(say, ZeRO-3 with a pipeline) is recorded as invalid without launching.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from zerotron.errors import ConfigError
from zerotron.fileio import human_bytes
from zerotron.tuning import results, space
from zerotron.tuning.experiments import Experiment, Outcome
from zerotron.tuning.tune import Tuner, TuneRequest

# The user's flags an experiment replaces: (flag, takes a value).
_DROPPED = {
    "--save": True,
    "--recompute-granularity": True,
    "--recompute-activations": False,
    "--recompute-method": True,
    "--recompute-num-layers": True,
    "--checkpoint-activations": False,  # Megatron-DeepSpeed's spelling of full recompute
    "--checkpoint-num-layers": True,
}


def strip_flags(args: list[str]) -> list[str]:
    """``args`` without the flags an experiment sets itself (see :data:`_DROPPED`)."""
    out, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0].replace("_", "-")
        if name in _DROPPED:
            i += 1 if "=" in args[i] or not _DROPPED[name] else 2
            continue
        out.append(args[i])
        i += 1
    return out


def point_flags(s: dict[str, Any]) -> list[str]:
    """The flags of one point of the search."""
    flags = [
        "--zero-stage", str(s["zero_stage"]),
        "--tensor-model-parallel-size", str(s["tp"]),
        "--pipeline-model-parallel-size", str(s["pp"]),
        "--micro-batch-size", str(s["micro_batch_size"]),
    ]  # fmt: skip
    if s["recompute"] == "block":
        flags += ["--recompute-granularity", "full", "--recompute-method", "block",
                  "--recompute-num-layers", str(s["recompute_num_layers"])]  # fmt: skip
    elif s["recompute"] != "none":
        flags += ["--recompute-granularity", s["recompute"]]
    return flags


def estimated_bytes(cfg: Any) -> int | None:
    """The estimator's per-rank total for a resolved config (None where it cannot say)."""
    from zerotron.tuning.estimate import Layout, ModelShape, estimate

    try:
        return estimate(ModelShape.from_config(cfg), Layout.from_config(cfg)).total
    except NotImplementedError:
        return None


def pretrain_points(
    cfg: Any,
    world: int,
    opts: Any,
    *,
    zero_stages: list[int] | None = None,
    tp_sizes: list[int] | None = None,
    pp_sizes: list[int] | None = None,
    recompute: list[str] | None = None,
    micro_batch_sizes: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Every point of the space for the user's config ``cfg`` (a resolved Config)."""
    m, t = cfg.model, cfg.training
    unknown = sorted(set(recompute or ()) - set(space.RECOMPUTE))
    if unknown:
        raise ConfigError(
            f"unknown recompute choice {', '.join(unknown)}",
            where="--recompute",
            fix=f"choose from {', '.join(space.RECOMPUTE)}",
        )
    stages = zero_stages or [cfg.zero.zero_stage]
    layouts = space.parallel_layouts(world, m.num_layers, m.num_attention_heads, tp_sizes, pp_sizes)
    points = []
    for stage in stages:
        for tp, pp in layouts:
            dp = world // (tp * pp)
            mbs_list = space.pretrain_micro_batches(
                t.global_batch_size,
                dp,
                opts.autotuning_min_train_micro_batch_size_per_gpu,
                opts.autotuning_max_train_micro_batch_size_per_gpu,
                opts.autotuning_num_tuning_micro_batch_sizes,
                micro_batch_sizes,
            )
            for rc in recompute or list(space.RECOMPUTE):
                for mbs in mbs_list:
                    gas = t.global_batch_size // (mbs * dp)
                    points.append(
                        {
                            "zero_stage": stage,
                            "tp": tp,
                            "pp": pp,
                            "recompute": rc,
                            "micro_batch_size": mbs,
                            "gradient_accumulation_steps": gas,
                        }
                    )
                    if rc == "block":  # PretrainTuner.candidate finds how many layers fit
                        points[-1]["recompute_num_layers"] = None
    return points


def point_name(s: dict[str, Any]) -> str:
    rc = {"none": "", "selective": "_rcsel", "full": "_rcfull", "block": "_rcblk"}[s["recompute"]]
    if s["recompute"] == "block":
        rc += str(s["recompute_num_layers"])
    return (
        f"z{s['zero_stage']}_tp{s['tp']}_pp{s['pp']}{rc}"
        f"_gas{s['gradient_accumulation_steps']}_tmbspg{s['micro_batch_size']}"
    )


class PretrainTuner(Tuner):
    """``zerotron launch --autotuning tune -m zerotron pretrain <flags>``."""

    def __init__(self, req: TuneRequest, nproc_per_node: int):
        from zerotron.config import parse_megatron_args

        self.base_args = strip_flags(req.script_args[1:])
        self.cfg = parse_megatron_args(req.script_args[1:], world_size=req.world_size)
        super().__init__(req, self.cfg.autotuning, nproc_per_node)

    def candidate(self, s: dict[str, Any]) -> tuple[Experiment, str | None]:
        """The experiment of point ``s`` and, if its config is refused, why. A ``block``
        point recomputes the fewest layers per chunk that fit (:meth:`_fewest_blocks`)."""
        if s["recompute"] == "block":
            s = {**s, "recompute_num_layers": 1}
            chunk = self.cfg.model.num_layers // (s["pp"] * self._virtual_stages())
            if chunk < 2:
                exp = Experiment(point_name(s), f"z{s['zero_stage']}", s)
                return exp, f"block recompute needs 2 or more layers per chunk, not {chunk}"
            s["recompute_num_layers"] = self._fewest_blocks(s, chunk)
        args = [*self.base_args, *point_flags(s)]
        exp = Experiment(point_name(s), f"z{s['zero_stage']}", dict(s), script_args=args)
        try:
            cfg = self._parse(args)
        except (ConfigError, SystemExit) as e:
            return exp, str(e).splitlines()[0] if str(e) else "refused by the config"
        exp.estimated_bytes = estimated_bytes(cfg)
        return exp, None

    def _parse(self, args: list[str]) -> Any:
        from zerotron.config import parse_megatron_args

        return parse_megatron_args(args, world_size=self.req.world_size)

    def _virtual_stages(self) -> int:
        return self.cfg.parallel.virtual_pipeline_model_parallel_size or 1

    def _fewest_blocks(self, s: dict[str, Any], chunk: int) -> int:
        """The fewest recomputed layers per chunk (1 .. chunk - 1) whose estimate fits the
        device (memory falls as they grow); ``chunk - 1`` when none does, for the pruner to
        report. Recomputing all of them is the ``full`` point."""
        lo, hi, found = 1, chunk - 1, chunk - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                need = estimated_bytes(
                    self._parse([*self.base_args, *point_flags({**s, "recompute_num_layers": mid})])
                )
            except (ConfigError, SystemExit):
                return found  # candidate() reports the refusal
            if need is None or need <= self.device:
                found, hi = mid, mid - 1
            else:
                lo = mid + 1
        return found

    def prepare_experiment(self, exp: Experiment, result_dir: Path, metric_path: Path) -> None:
        o = self.opts
        exp.script_args = [
            "pretrain",
            *exp.script_args,
            "--train-iters", str(o.autotuning_end_profile_step + 1),
            "--autotuning-enabled",
            "--autotuning-metric-path", str(metric_path),
            "--autotuning-start-profile-step", str(o.autotuning_start_profile_step),
            "--autotuning-end-profile-step", str(o.autotuning_end_profile_step),
        ]  # fmt: skip

    def tune(self) -> int:
        self.prepare_dirs()
        self.profile_header()
        points = pretrain_points(
            self.cfg,
            self.req.world_size,
            self.opts,
            zero_stages=self.req.zero_stages,
            tp_sizes=self.req.tensor_parallel_sizes,
            pp_sizes=self.req.pipeline_parallel_sizes,
            recompute=self.req.recompute,
            micro_batch_sizes=self.req.micro_batch_sizes,
        )
        by_space: dict[str, list[Experiment]] = {}
        for s in points:
            exp, refused = self.candidate(s)
            if refused is not None:
                self.records.append((exp, Outcome("invalid", error=refused)))
                self.say(f"{exp.name}: invalid ({refused})")
                continue
            by_space.setdefault(exp.space, []).append(exp)
        for exps in by_space.values():
            self.run_space(exps, self.device)
        return self.finish()

    def profile_header(self) -> None:
        """What DeepSpeed's profiling run measures, from the estimator."""
        from zerotron.tuning.estimate import Layout, ModelShape, estimate

        shape = ModelShape.from_config(self.cfg)
        line = f"model: {shape.num_parameters():,} parameters (estimator)"
        try:
            one = dataclasses.replace(Layout(), precision=Layout.from_config(self.cfg).precision)
            act = estimate(shape, one).activations  # one sample, no parallelism
            line += f", activation memory per sample {human_bytes(act)}"
        except NotImplementedError:
            pass
        self.header.append(line)
        self.say(line)

    def optimal(self, best: results.Record) -> tuple[dict[str, Any], list[str]]:
        s = best[0].settings
        config = {
            "train_batch_size": self.cfg.training.global_batch_size,
            "train_micro_batch_size_per_gpu": s["micro_batch_size"],
            "gradient_accumulation_steps": s["gradient_accumulation_steps"],
            "zero_optimization": {"stage": s["zero_stage"]},
        }
        args = [*strip_flags(self.req.script_args[1:]), *point_flags(s)]
        if "--save" in self.req.script_args:  # the real run saves where the user said
            i = self.req.script_args.index("--save")
            args += self.req.script_args[i : i + 2]
        return config, [*self.req.launch_cmd, "pretrain", *args]
