"""``zerotron tune`` and ``zerotron launch --autotuning tune|run``: the launcher's side of the
autotuner (:mod:`zerotron.tuning.tune` does the search).

    zerotron tune --nproc_per_node 2 train.py --deepspeed_config ds.json
    zerotron launch --autotuning run --nproc_per_node 2 -m zerotron pretrain ...

``zerotron tune ARGS`` is ``zerotron launch --autotuning tune ARGS``. The launcher's own flags
(less the autotuning ones) start every experiment: each is ``python -m zerotron launch <those
flags> SCRIPT <the experiment's arguments>``, in its own process group.
"""

from __future__ import annotations

import argparse
import sys

from zerotron.errors import ConfigError

# Flags of the autotuning group: (spellings, takes a value); they do not reach experiments.
_TUNE_FLAGS = {
    "--autotuning": True,
    "--zero_stages": True,
    "--zero-stages": True,
    "--micro_batch_sizes": True,
    "--micro-batch-sizes": True,
    "--tensor_parallel_sizes": True,
    "--tensor-parallel-sizes": True,
    "--pipeline_parallel_sizes": True,
    "--pipeline-parallel-sizes": True,
    "--recompute": True,
    "--experiment_time_limit": True,
    "--experiment-time-limit": True,
    "--device_memory": True,
    "--device-memory": True,
}


def launch_flags(argv: list[str], script_args: list[str]) -> list[str]:
    """The launcher flags of ``argv`` (up to and with the script) minus the autotuning ones."""
    head = argv[: len(argv) - len(script_args)]
    out, i = [], 0
    while i < len(head):
        name = head[i].split("=", 1)[0]
        if name in _TUNE_FLAGS:
            i += 1 if "=" in head[i] or not _TUNE_FLAGS[name] else 2
            continue
        out.append(head[i])
        i += 1
    return out


def run_autotuning(args: argparse.Namespace, argv: list[str]) -> int:
    """The tuner for parsed ``zerotron launch`` flags ``args`` (from ``argv``)."""
    from zerotron.launcher.launch import _default_nproc
    from zerotron.tuning.estimate_cli import parse_size
    from zerotron.tuning.tune import TuneRequest, autotune

    if args.dry_run:
        raise ConfigError(
            "--dry-run with --autotuning: the tuner's experiments are real runs",
            where="--autotuning",
            fix="drop --dry-run; each experiment's command is in <results_dir>/<name>/cmd.txt",
        )
    if args.hostfile is not None or (args.nnodes or 1) > 1:
        raise ConfigError(
            "the autotuner runs its experiments on this node only",
            where="--autotuning",
            fix="tune on one node (--nproc_per_node N), then launch the best on many",
        )
    nproc = args.nproc_per_node if args.nproc_per_node is not None else _default_nproc()
    flags = launch_flags(argv, args.script_args)
    req = TuneRequest(
        launch_cmd=[sys.executable, "-m", "zerotron", "launch", *flags],
        script=args.script,
        module=args.module,
        script_args=list(args.script_args),
        world_size=nproc,
        mode=args.autotuning,
        time_limit_s=args.experiment_time_limit,
        device_memory=(
            None
            if args.device_memory is None
            else parse_size(args.device_memory, "--device_memory")
        ),
        zero_stages=args.zero_stages,
        micro_batch_sizes=args.micro_batch_sizes,
        tensor_parallel_sizes=args.tensor_parallel_sizes,
        pipeline_parallel_sizes=args.pipeline_parallel_sizes,
        recompute=args.recompute,
    )
    return autotune(req, nproc)


def main(argv: list[str] | None = None) -> int:
    """``zerotron tune [launch flags] SCRIPT ARGS``: ``zerotron launch --autotuning tune``."""
    from zerotron.launcher import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--autotuning" or a.startswith("--autotuning=") for a in argv):
        argv = ["--autotuning", "tune", *argv]
    return launch.main(argv)
