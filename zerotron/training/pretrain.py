"""``zerotron pretrain``: Megatron-LM's pretrain_gpt.py, on one engine.

Flags -> Config -> process groups -> tokenizer, model, Engine -> (resume) -> datasets -> the
loop. The loop itself is :mod:`zerotron.training.loop`; this module wires the parts and owns
nothing else.

Under ``zerotron launch`` (or torchrun) every rank runs this: the default process group is
created with ``--distributed-timeout-minutes``, then the tensor/pipeline/data-parallel groups.
Rank 0 builds the dataset index caches (next to the data, so the file system must be shared
between nodes) while the others wait at a barrier; each data-parallel rank reads its own slice of
every global batch (every pipeline stage of a replica reads the same micro-batches: the first
stage takes the tokens, the last the labels). Logs come from rank 0 (Megatron prints losses from
the last rank, which holds them under pipeline parallelism; here the Engine broadcasts the loss to
every rank). The parameter count is printed by data-parallel rank 0 of every (tensor, pipeline)
rank, as Megatron does.

Pipeline parallelism (``--pipeline-model-parallel-size P``) runs 1F1B by default, the interleaved
schedule with ``--num-layers-per-virtual-pipeline-stage``, GPipe with ``--pipeline-schedule
gpipe``; each step runs the config's ``num_micro_batches`` (global batch / (micro batch × dp)).

ZeRO (``--zero-stage N``, ``--use-distributed-optimizer``, or ``--deepspeed --deepspeed_config
ds.json`` as in DeepSpeed's Megatron tutorial): :func:`~zerotron.engine.builder.wrap_optimizer`
builds a :class:`~zerotron.zero.ZeroOptimizer` instead of DataParallel + MixedPrecisionOptimizer;
the loop does not change.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from zerotron.config import Config, parse_megatron_args
from zerotron.data.gpt_dataset import build_train_valid_test_datasets
from zerotron.data.mock import build_mock_datasets
from zerotron.data.samplers import build_pretraining_data_loader
from zerotron.distributed import comm
from zerotron.distributed.init import get_rank, get_world_size, init_distributed
from zerotron.distributed.state import ParallelState, initialize_model_parallel, state
from zerotron.engine import run_metrics
from zerotron.engine.timers import Timers
from zerotron.errors import ConfigError, DistributedError
from zerotron.fileio import check_writable_dir
from zerotron.kernels import KernelShape, choose_kernels
from zerotron.kernels.chooser import parse_forced
from zerotron.models.gpt import print_num_parameters
from zerotron.training import preemption
from zerotron.training.build import Run, build_run
from zerotron.training.load import checkpoint_args, resume
from zerotron.training.loop import TrainState, TrainSummary, print_rank_0, train
from zerotron.training.metrics import for_pretrain
from zerotron.training.throughput import model_flops_per_token


def main(argv: list[str]) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_megatron_args(argv, world_size=world_size, checkpoint_args=checkpoint_args)
    summary = pretrain(cfg)
    if summary.preempted is None:
        return 0
    if get_rank() == 0:
        print(
            f"zerotron pretrain: stopped on {summary.preempted} at iteration "
            f"{summary.state.iteration} with a checkpoint in {cfg.checkpoint.save}; resume with "
            f"--load {cfg.checkpoint.save} (exit code {preemption.EXIT_CODE})",
            file=sys.stderr,
            flush=True,
        )
    return preemption.EXIT_CODE


def _check_output_dirs(cfg: Config) -> None:
    """--save and --tensorboard-dir must be writable directories: found now, not at the first
    save after hours of training."""
    if cfg.checkpoint.save_on_signal and not cfg.checkpoint.save:
        raise ConfigError(
            "--save-on-signal saves a checkpoint before exiting, but there is nowhere to save it",
            where="--save-on-signal",
            fix="add --save DIR (and --load DIR to resume from it)",
        )
    if cfg.checkpoint.save:
        check_writable_dir(cfg.checkpoint.save, "--save")
    if cfg.training.tensorboard_dir:
        check_writable_dir(cfg.training.tensorboard_dir, "--tensorboard-dir")
    if cfg.training.metrics_dir:
        check_writable_dir(cfg.training.metrics_dir, "--metrics-dir")


def _init_parallel(cfg: Config) -> ParallelState:
    """The default process group (multi-process runs) and the model-parallel groups."""
    p = cfg.parallel
    if p.world_size > 1:
        init_distributed(timeout_minutes=p.distributed_timeout_minutes)
    world = get_world_size()
    if world != p.world_size:
        raise DistributedError(
            f"the config is for {p.world_size} process(es) but {world} are running",
            where="parallel.world_size",
            fix="parse the flags with the launcher's WORLD_SIZE (zerotron pretrain does)",
        )
    if world == 1:
        return state()
    return initialize_model_parallel(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.virtual_pipeline_model_parallel_size,
    )


def _print_num_parameters(run: Run, ps: ParallelState) -> None:
    if ps.world_size == 1:
        print_num_parameters(run.model)
    elif ps.dp_rank == 0:  # one line per (tensor, pipeline) rank, as Megatron prints it
        n = run.model.num_parameters()
        print(
            f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({ps.tp_rank}, {ps.pp_rank}): {n}",
            flush=True,
        )


def _choose_kernels(run: Run) -> None:
    """The CPU kernel choices for this model (:mod:`zerotron.kernels.chooser`), printed once:
    rank 0's cached ones, else measured by rank 0 on one tensor-parallel rank's shapes while
    the other ranks wait, and taken by all."""
    shape = KernelShape.from_config(run.cfg, run.tokenizer.vocab_size)
    chosen = choose_kernels(
        shape, run.engine.device, run.cfg.model.kernels, group=comm.world_group()
    )
    print_rank_0(f" {chosen.line()}")


def _data_iterators(run: Run, state: TrainState, ps: ParallelState):
    cfg = run.cfg
    d, t = cfg.data, cfg.training
    if not (d.data_path or d.train_data_path or d.mock_data):
        raise ConfigError(
            "no training data",
            where="--train-data-path" if d.per_split else "--data-path",
            fix="pass --data-path PREFIX (made by `zerotron preprocess`) or --train-data-path "
            "PREFIX, --mock-data to train on synthetic tokens, or --train-iters 0",
        )
    masks = dict(
        eod_token=run.tokenizer.eod,
        eod_mask_loss=d.eod_mask_loss,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
    )
    if d.mock_data:
        # Megatron-LM builds the mock datasets and ignores the paths too
        for given, flags in ((d.data_path, "--data-path is"), (d.per_split, "--*-data-path are")):
            if given:
                print_rank_0(f" WARNING: {flags} ignored with --mock-data")
        datasets = build_mock_datasets(
            d.split,
            cfg.train_valid_test_num_samples,
            cfg.model.seq_length,
            t.seed,
            vocab_size=run.tokenizer.vocab_size,
            **masks,
        )
    else:
        per_split = [d.train_data_path, d.valid_data_path, d.test_data_path]
        for name, path in zip(("validation", "test"), per_split[1:]):
            if d.per_split and path is None:
                print_rank_0(f" > no --{name[:5]}-data-path: no {name} data")
        datasets = build_train_valid_test_datasets(
            d.data_path,
            d.split,
            cfg.train_valid_test_num_samples,
            cfg.model.seq_length,
            t.seed,
            per_split_paths=per_split if d.per_split else None,
            **masks,
            cache_dir=d.data_cache_path,
            vocab_size=run.tokenizer.vocab_size,  # an id past it would fail in the embedding
            is_builder=ps.rank == 0,
            barrier=comm.barrier if ps.world_size > 1 else None,
        )
    consumed = (state.consumed_train_samples, state.consumed_valid_samples, 0)
    # A DataLoader draws its worker seed from the global RNG when iterated; keep that draw out of
    # the training RNG stream so a resumed run replays the same dropout masks.
    with torch.random.fork_rng(devices=[]):
        iters = []
        for split, ds, n in zip(("train", "validation", "test"), datasets, consumed):
            try:
                loader = build_pretraining_data_loader(
                    ds, n, t.micro_batch_size, ps.dp_rank, ps.dp_size, d.num_workers
                )
            except ConfigError as e:  # name the split that ran out, not just the numbers
                raise ConfigError(
                    f"{split} split: {e.what}", where=e.where or "--split", fix=_SPLIT_FIX[split]
                ) from None
            iters.append(iter(loader) if loader is not None else None)
    return iters


_SPLIT_FIX = {
    "train": "the training split is smaller than the checkpoint's progress: request at least as "
    "many training samples (iterations x global batch size) as before",
    "validation": "the checkpoint's evaluations consumed more validation samples than this run's "
    "validation split holds: give validation a larger share of --split, or evaluate less often "
    "(--eval-interval, --eval-iters)",
    "test": "the test split holds fewer samples than asked for: give it a larger share of --split",
}


def pretrain(cfg: Config) -> TrainSummary:
    """Run ``cfg`` to the end (or exit interval); return the losses and where things went."""
    _check_output_dirs(cfg)
    ps = _init_parallel(cfg)
    for w in cfg.warnings:
        print_rank_0(f" WARNING: {w}")
    start = time.time()
    timers = Timers()
    parse_forced(cfg.model.kernels, "--kernels")  # a typo stops the run before anything is built
    run = build_run(cfg, timers=timers)
    _print_num_parameters(run, ps)
    _choose_kernels(run)
    state = TrainState()
    if cfg.training.train_iters == 0:
        print_rank_0(cfg.describe())
        print_rank_0(" train-iters is 0: built everything, nothing to train")
        return TrainSummary(state=state, losses={})
    metrics = _metrics(run, ps)
    finished = False
    try:
        resume(run, state)
        train_iter, valid_iter, test_iter = _data_iterators(run, state, ps)
        print_rank_0(f"[after dataloaders are built] elapsed (s): {time.time() - start:.1f}")
        if not cfg.checkpoint.save_on_signal:
            summary = train(run, state, train_iter, valid_iter, test_iter, timers)
        else:
            with preemption.Preemption() as signals:
                summary = train(run, state, train_iter, valid_iter, test_iter, timers, signals)
        if metrics is not None:
            metrics.write(
                "end",
                iteration=state.iteration,
                exited_early=summary.exited_early,
                preempted=summary.preempted,
            )
        finished = True
        return summary
    finally:
        writer = getattr(run.engine, "checkpoint_writer", None)
        if writer is not None:  # --async-save: no exit before the background write is done
            writer.close(commit=finished or ps.world_size == 1)
        if metrics is not None:
            metrics.close()
        run.engine.destroy()  # closes the monitor section's writers (W&B finishes its run)


def _metrics(run: Run, ps: ParallelState) -> run_metrics.RunMetrics | None:
    """This rank's metrics file (``--metrics-dir``, else ``--save``), given to the Engine."""
    m = run.cfg.model
    per_token = model_flops_per_token(run.flops_params, m.num_layers, m.hidden_size, m.seq_length)
    metrics = for_pretrain(run.cfg, ps.rank, run.engine.device, per_token)
    run_metrics.attach(run.engine, metrics)
    return metrics


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
