"""The pretraining loop: train_batch, log, evaluate, save, exit — Megatron's ``train()``.

The loop talks only to the Engine (``train_batch``, ``eval_batch``, ``save_checkpoint``) and to
data iterators; it never sees loss scales, master weights or process groups. The losses it gets
are already averaged over data-parallel ranks (the Engine's), so every rank runs the same loop;
only rank 0 prints and writes TensorBoard.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import tag_for_iteration
from zerotron.distributed import comm
from zerotron.distributed.init import get_rank
from zerotron.engine import run_metrics
from zerotron.engine.timers import Timers
from zerotron.errors import ConfigError, TrainingError
from zerotron.progress import Progress
from zerotron.training import log
from zerotron.training.build import Run, lr_increment
from zerotron.training.memory_breakdown import MemoryBreakdownRecorder
from zerotron.training.preemption import Preemption
from zerotron.training.throughput import model_flops_per_token, tflops_per_second


def print_rank_0(*args: Any) -> None:
    """``print`` on global rank 0 only (flushed: launchers interleave ranks by line)."""
    if get_rank() == 0:
        print(*args, flush=True)


@dataclass
class TrainState:
    """Where a run is; saved in checkpoints as Megatron saves it."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


@dataclass
class TrainSummary:
    state: TrainState
    losses: dict[int, float]  # iteration -> lm loss of that iteration
    valid_loss: float | None = None
    test_loss: float | None = None
    last_checkpoint: Path | None = None
    interval_lines: list[str] = field(default_factory=list)
    exited_early: bool = False  # --exit-interval or --exit-duration-in-mins stopped the run
    preempted: str | None = None  # the signal --save-on-signal saved and stopped on


class _Interval:
    """Accumulates what one --log-interval reports."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.counted = 0
        self.skipped = 0
        self.nans = 0
        self.iterations = 0
        self.samples = 0
        self.start = time.perf_counter()


def _output(total: int, done: int) -> Progress:
    """Log lines on rank 0; on a terminal under a progress bar with ETA (gone when done)."""
    return Progress(
        "training",
        total=total,
        unit="iterations",
        completed=done,
        stream=sys.stdout,
        log_seconds=None,  # the iteration lines are the log
        enabled=get_rank() == 0,
        transient=True,
    )


def evaluate(run: Run, data_iter: Iterator, state: TrainState) -> float:
    """Mean lm loss over --eval-iters global batches of ``data_iter``."""
    t = run.cfg.training
    total = 0.0
    for _ in range(t.eval_iters):
        total += float(run.engine.eval_batch(data_iter))
        state.consumed_valid_samples += run.engine.train_batch_size()  # the current size
    return total / t.eval_iters


def save(run: Run, state: TrainState) -> Path:
    c = run.cfg.checkpoint
    client = {
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "args": run.cfg.to_dict(),
    }
    return run.engine.save_checkpoint(
        c.save,
        tag_for_iteration(state.iteration),
        client,
        save_optimizer=not c.no_save_optim,
        save_rng=not c.no_save_rng,
    )


def _tensorboard(run: Run):
    if not run.cfg.training.tensorboard_dir or get_rank() != 0:
        return None
    try:  # tensorboard is an extra: the core runs without it
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"TensorBoard logging is asked for but cannot be imported ({e})",
            where="--tensorboard-dir",
            fix="pip install 'zerotron[tensorboard]', or leave out --tensorboard-dir",
        ) from e

    return SummaryWriter(log_dir=run.cfg.training.tensorboard_dir, max_queue=1000)


def train(
    run: Run,
    state: TrainState,
    train_iter: Iterator,
    valid_iter: Iterator | None,
    test_iter: Iterator | None,
    timers: Timers,
    preemption: Preemption | None = None,
) -> TrainSummary:
    cfg, engine = run.cfg, run.engine
    t, c = cfg.training, cfg.checkpoint
    m = cfg.model
    ramp = cfg.batch_ramp  # None: every step trains on global_batch_size
    flops_per_token = model_flops_per_token(
        run.flops_params,
        m.num_layers,
        m.hidden_size,
        m.seq_length,
    )
    summary = TrainSummary(state=state, losses={})
    writer = _tensorboard(run)
    metrics = run_metrics.of(engine)  # the run's metrics file (zerotron report), or None
    interval = _Interval()
    breakdown = MemoryBreakdownRecorder(run, metrics)  # --memory-breakdown-step
    reported_memory = False
    saved_at = None
    async_writer = getattr(engine, "checkpoint_writer", None)  # --async-save
    started = time.perf_counter()
    with _output(t.train_iters, state.iteration) as out:
        out.print(" training ...")
        killed = _kill_switch(t.kill_switch_file)  # Megatron-DeepSpeed trains nothing then
        if killed:
            out.print(f" exiting program before training: found {t.kill_switch_file}")
            summary.exited_early, saved_at = True, state.iteration
        while not killed and state.iteration < t.train_iters:
            consumed = state.consumed_train_samples
            gbs = t.global_batch_size if ramp is None else ramp.size_at(consumed)
            if gbs != engine.train_batch_size():  # a step of the ramp (or a resume inside it)
                engine.set_train_batch_size(gbs)
                engine.lr_increment = lr_increment(cfg, gbs)
            with breakdown.around(state.iteration + 1):
                loss = float(engine.train_batch(train_iter))
            state.iteration += 1
            state.consumed_train_samples += gbs
            interval.samples += gbs
            if async_writer is not None:
                async_writer.poll()  # commits a background save once every rank wrote it
            step = engine.last_step
            summary.losses[state.iteration] = loss
            if t.check_for_nan_in_loss_and_grad:
                check_finite(loss, step, state.iteration)
            interval.iterations += 1
            if step is not None and not step.update_successful:
                interval.skipped += 1
            elif not math.isfinite(loss):
                interval.nans += 1
            else:
                interval.loss_sum += loss
                interval.counted += 1
            out.update(1)

            if state.iteration % t.log_interval == 0:
                elapsed = time.perf_counter() - interval.start
                per_iter = elapsed / interval.iterations
                # No finite loss in the interval is not a loss of 0: say nan, as the step did.
                lm = interval.loss_sum / interval.counted if interval.counted else math.nan
                tokens = interval.samples * m.seq_length
                if metrics is not None:
                    _write_step(metrics, engine, state, lm, interval, tokens / elapsed, per_iter)
                line = log.iteration_line(
                    iteration=state.iteration,
                    train_iters=t.train_iters,
                    consumed_samples=state.consumed_train_samples,
                    ms_per_iteration=per_iter * 1000.0,
                    learning_rate=engine.get_lr()[0],
                    global_batch_size=gbs,
                    losses={"lm loss": lm},
                    loss_scale=engine.cur_scale,
                    grad_norm=step.grad_norm if step is not None else None,
                    skipped_iterations=interval.skipped,
                    nan_iterations=interval.nans,
                    tokens_per_second=tokens / elapsed,
                    tflops=tflops_per_second(flops_per_token, tokens, elapsed),
                )
                out.print(line)
                summary.interval_lines.append(line)
                times = timers.log_line(
                    ["forward-backward", "optimizer", "batch-generator"], interval.iterations
                )
                out.print(times)
                if not reported_memory:
                    out.print(log.memory_line(engine.device, state.iteration))
                    reported_memory = True
                if writer is not None:
                    writer.add_scalar("lm loss", lm, state.iteration)
                    writer.add_scalar("learning-rate", engine.get_lr()[0], state.iteration)
                    writer.add_scalar("loss-scale", engine.cur_scale, state.iteration)
                    if step is not None and step.grad_norm is not None:
                        writer.add_scalar("grad-norm", step.grad_norm, state.iteration)
                interval = _Interval()

            if t.eval_interval and state.iteration % t.eval_interval == 0 and valid_iter:
                value = evaluate(run, valid_iter, state)
                line = log.eval_line(
                    f"validation loss at iteration {state.iteration}", {"lm loss": value}
                )
                out.print(log.RULE + "\n" + line + "\n" + log.RULE)
                if writer is not None:
                    writer.add_scalar("lm loss validation", value, state.iteration)
                    if t.log_validation_ppl_to_tensorboard:
                        ppl = log.perplexity(value)
                        writer.add_scalar("lm loss validation ppl", ppl, state.iteration)
                if metrics is not None:
                    _write_eval(metrics, state.iteration, value, "valid")
                interval.start = time.perf_counter()  # evaluation is not training time

            # Megatron's order: a signal's checkpoint comes before the interval's.
            signal_name = preemption.agreed() if preemption is not None else None
            if signal_name is not None:
                summary.last_checkpoint = save(run, state)
                saved_at = state.iteration
                out.print(
                    f" exiting program after receiving {signal_name}: saved checkpoint at "
                    f"iteration {state.iteration} to {c.save}"
                )
                summary.exited_early, summary.preempted = True, signal_name
                break

            if c.save and c.save_interval and state.iteration % c.save_interval == 0:
                summary.last_checkpoint = save(run, state)
                saved_at = state.iteration
                out.print(f"  saved checkpoint at iteration {state.iteration} to {c.save}")
                interval.start = time.perf_counter()

            if t.exit_interval and state.iteration % t.exit_interval == 0:
                out.print(f" exiting program at iteration {state.iteration}")
                summary.exited_early = True
                break
            minutes = (time.perf_counter() - started) / 60.0
            if t.exit_duration_in_mins and _any_rank(minutes > t.exit_duration_in_mins):
                out.print(f" exiting program after {minutes:.2f} minutes")
                summary.exited_early = True
                break
            if _kill_switch(t.kill_switch_file):
                out.print(
                    f" exiting program at iteration {state.iteration}: found {t.kill_switch_file}"
                )
                summary.exited_early = True
                break

    if c.save and saved_at != state.iteration:
        summary.last_checkpoint = save(run, state)
        print_rank_0(f"  saved checkpoint at iteration {state.iteration} to {c.save}")
    if summary.exited_early and state.iteration < t.train_iters:
        return summary  # Megatron skips the final evaluation when it exits early
    for name, it in (("val", valid_iter), ("test", test_iter)):
        if it is None:
            continue
        value = evaluate(run, it, state) if name == "val" else _evaluate_test(run, it)
        line = log.eval_line(
            f"validation loss at the end of training for {name} data", {"lm loss": value}
        )
        print_rank_0(log.RULE + "\n" + line + "\n" + log.RULE)
        if metrics is not None:
            _write_eval(metrics, state.iteration, value, "valid" if name == "val" else "test")
        if name == "val":
            summary.valid_loss = value
        else:
            summary.test_loss = value
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.close()
    return summary


def _write_step(
    metrics: run_metrics.RunMetrics,
    engine: Any,
    state: TrainState,
    loss: float,
    interval: _Interval,
    tokens_per_s: float,
    step_time_s: float,
) -> None:
    """The metrics file's ``step`` record of a log interval (the values its log line shows)."""
    step = engine.last_step
    mfu = None
    if metrics.peak_flops and metrics.flops_per_token:
        world = max(metrics.layout.get("world_size", 1), 1)
        mfu = tokens_per_s * metrics.flops_per_token / world / metrics.peak_flops
    metrics.write(
        "step",
        iteration=state.iteration,
        consumed_samples=state.consumed_train_samples,
        loss=run_metrics.finite(loss),
        lr=run_metrics.finite(engine.get_lr()[0]),
        loss_scale=run_metrics.finite(engine.cur_scale),
        skipped=step is not None and not step.update_successful,
        skipped_iterations=interval.skipped,
        nan_iterations=interval.nans,
        grad_norm=run_metrics.finite(step.grad_norm if step is not None else None),
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        step_time_s=step_time_s,
        **run_metrics.memory_fields(engine.device),
    )


def _write_eval(metrics: run_metrics.RunMetrics, iteration: int, loss: float, split: str) -> None:
    ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else None  # the log line's PPL
    metrics.write("eval", iteration=iteration, loss=run_metrics.finite(loss), ppl=ppl, split=split)


def check_finite(loss: float, step: Any, iteration: int) -> None:
    """Megatron's --check-for-nan-in-loss-and-grad: a NaN/Inf loss or gradient norm of a step
    that was applied stops the run (a step skipped on an fp16 overflow is the scaler's business:
    counted as skipped, not an error).

    Every rank sees the same (data-parallel averaged) loss and global norm, so all stop here.
    """
    if step is not None and not step.update_successful:
        return  # an fp16 overflow: the loss scaler skipped the step, as it should
    norm = getattr(step, "grad_norm", None)
    if math.isfinite(loss) and (norm is None or math.isfinite(norm)):
        return
    what = f"lm loss {loss}" if not math.isfinite(loss) else f"grad norm {norm}"
    raise TrainingError(
        f"{what} at iteration {iteration}: training diverged or the weights are corrupt",
        where=f"iteration {iteration}",
        fix="resume from an earlier checkpoint (a corrupt one is refused at load), lower --lr "
        "or use --clip-grad; --no-check-for-nan-in-loss-and-grad goes on and counts such "
        "iterations instead",
    )


def _kill_switch(path: str | None) -> bool:
    """Whether ``--kill-switch-file`` exists (seen by any rank: all stop together)."""
    return path is not None and _any_rank(os.path.exists(path))


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: ranks with different clocks must stop together."""
    if comm.world_group().size == 1:
        return flag
    return bool(comm.all_reduce(torch.tensor([int(flag)]), comm.world_group(), op="max").item())


def _evaluate_test(run: Run, data_iter: Iterator) -> float:
    t = run.cfg.training
    return sum(float(run.engine.eval_batch(data_iter)) for _ in range(t.eval_iters)) / t.eval_iters
