"""``zerotron pretrain``: Megatron-LM's pretrain_gpt.py, on one engine.

Flags -> Config -> tokenizer, model, Engine -> (resume) -> datasets -> the loop. The loop itself is
:mod:`zerotron.training.loop`; this module wires the parts and owns nothing else.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from zerotron.checkpoint import read_latest_tag
from zerotron.config import Config, parse_megatron_args
from zerotron.data.gpt_dataset import build_train_valid_test_datasets
from zerotron.data.samplers import build_pretraining_data_loader
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.models.gpt import print_num_parameters
from zerotron.training.build import Run, build_run
from zerotron.training.loop import TrainState, TrainSummary, train
from zerotron.training.timers import Timers


def main(argv: list[str]) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse_megatron_args(argv, world_size=world_size)
    pretrain(cfg)
    return 0


def _check_supported(cfg: Config) -> None:
    p = cfg.parallel
    if p.world_size > 1 or p.tensor_model_parallel_size > 1 or p.pipeline_model_parallel_size > 1:
        raise UnsupportedError(
            f"this build trains on one process (world size {p.world_size}, tensor parallel "
            f"{p.tensor_model_parallel_size}, pipeline parallel {p.pipeline_model_parallel_size})",
            where="zerotron pretrain",
            fix="run a single process without --tensor/--pipeline-model-parallel-size; "
            "multi-process training is being built (3D-parallelism issue)",
        )


def _resume(run: Run, state: TrainState) -> None:
    """Megatron's load: resume a run, or with --finetune take the weights only."""
    c = run.cfg.checkpoint
    if not c.load:
        return
    if read_latest_tag(c.load) is None:
        if c.exit_on_missing_checkpoint:
            raise CheckpointError(
                "no checkpoint to load (no latest_checkpointed_iteration.txt or latest)",
                where=c.load,
                fix="check --load, or drop --exit-on-missing-checkpoint to start from scratch",
            )
        print(f" WARNING: no checkpoint found in {c.load}; starting from random weights")
        return
    path, client = run.engine.load_checkpoint(
        c.load,
        load_optimizer_states=not (c.no_load_optim or c.finetune),
        load_lr_scheduler_states=not (c.no_load_optim or c.finetune),
        load_module_only=c.finetune,
        load_rng=not (c.no_load_rng or c.finetune),
    )
    if not c.finetune:
        state.iteration = int(client.get("iteration", run.engine.global_steps))
        state.consumed_train_samples = int(client.get("consumed_train_samples", 0))
        state.consumed_valid_samples = int(client.get("consumed_valid_samples", 0))
    else:
        run.engine.global_steps = run.engine.global_samples = 0
    print(f"  successfully loaded checkpoint from {path} at iteration {state.iteration}")


def _data_iterators(run: Run, state: TrainState):
    cfg = run.cfg
    d, t = cfg.data, cfg.training
    if not d.data_path:
        raise ConfigError(
            "no training data",
            where="--data-path",
            fix="pass --data-path PREFIX (made by `zerotron preprocess`), or --train-iters 0",
        )
    datasets = build_train_valid_test_datasets(
        d.data_path,
        d.split,
        cfg.train_valid_test_num_samples,
        cfg.model.seq_length,
        t.seed,
        eod_token=run.tokenizer.eod,
        eod_mask_loss=d.eod_mask_loss,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        cache_dir=d.data_cache_path,
    )
    consumed = (state.consumed_train_samples, state.consumed_valid_samples, 0)
    # A DataLoader draws its worker seed from the global RNG when iterated; keep that draw out of
    # the training RNG stream so a resumed run replays the same dropout masks.
    with torch.random.fork_rng(devices=[]):
        iters = []
        for ds, n in zip(datasets, consumed):
            loader = build_pretraining_data_loader(
                ds, n, t.micro_batch_size, 0, cfg.parallel.data_parallel_size, d.num_workers
            )
            iters.append(iter(loader) if loader is not None else None)
    return iters


def pretrain(cfg: Config) -> TrainSummary:
    """Run ``cfg`` to the end (or exit interval); return the losses and where things went."""
    _check_supported(cfg)
    for w in cfg.warnings:
        print(f" WARNING: {w}")
    start = time.time()
    timers = Timers()
    run = build_run(cfg, timers=timers)
    print_num_parameters(run.model)
    state = TrainState()
    if cfg.training.train_iters == 0:
        print(cfg.describe())
        print(" train-iters is 0: built everything, nothing to train")
        return TrainSummary(state=state, losses={})
    _resume(run, state)
    train_iter, valid_iter, test_iter = _data_iterators(run, state)
    print(f"[after dataloaders are built] elapsed (s): {time.time() - start:.1f}", flush=True)
    return train(run, state, train_iter, valid_iter, test_iter, timers)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
