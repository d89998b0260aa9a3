"""The Engine: the one object a training loop talks to.

It composes parts that live in their own modules — the model, master weights and loss scaling
(``precision.mixed``), the LR schedule (``optim``), checkpoints (``checkpoint``) — and gives them
DeepSpeed's engine API: ``engine(batch)``, ``backward(loss)``, ``step()``, ``train_batch()``,
``eval_batch()``, ``save_checkpoint()``, ``load_checkpoint()``. The loop never touches loss
scales, master weights or gradients: the Engine owns them.

Data parallelism plugs in as a part (:class:`~zerotron.parallel.data_parallel.DataParallel`): the
Engine tells it which micro-batch ends an accumulation (only that backward reduces gradients),
waits for its buckets before the optimizer step, and reports losses averaged over the
data-parallel group. :func:`grad_norm_hooks` gives the optimizer the ``reduce_fn`` and
``is_counted`` that make the gradient norm and the overflow check span the model-parallel ranks.
Checkpoints hold one file per model-parallel rank, written by data-parallel rank 0.

Pipeline parallelism plugs in as a
:class:`~zerotron.parallel.pipeline.PipelineRuntime` over this rank's model chunks (``model`` is
then the module holding them, e.g. ``training.build.StageModel``). Only whole batches make sense
there (:meth:`Engine.train_batch`, :meth:`Engine.eval_batch`): the runtime runs the step's
micro-batches on its schedule, with data-parallel reduction held back until all of them are done;
then the tied embedding's gradients are summed over the first and last stages, the sequence-
parallel ones over TP, and the optimizer steps. The loss, known on the last stage only, is
broadcast over the pipeline group so every rank returns the same value. Later parts (ZeRO
partitions) plug in here too, not in the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.checkpoint import (
    get_rng_state,
    load_file,
    load_model_state,
    model_file,
    read_metadata,
    repad_vocab,
    resolve_tag,
    save_checkpoint,
    set_rng_state,
)
from zerotron.checkpoint.layout import CHECKPOINT_VERSION
from zerotron.distributed import comm
from zerotron.distributed.rng import get_rng_tracker
from zerotron.distributed.state import ParallelState, state
from zerotron.errors import CheckpointError, UnsupportedError
from zerotron.parallel.data_parallel import DataParallel
from zerotron.parallel.pipeline import PipelineRuntime, allreduce_embedding_grads
from zerotron.precision.grads import IsCounted, ReduceFn, grad_of
from zerotron.precision.mixed import LOW_PRECISION, MixedPrecisionOptimizer, StepResult

LossFn = Callable[[nn.Module, Mapping[str, Any]], Tensor]
RNG_TRACKER_KEY = "rng_tracker_states"  # the tensor-parallel RNG streams, beside torch's


def grad_norm_hooks(ps: ParallelState | None = None) -> tuple[ReduceFn | None, IsCounted]:
    """``(reduce_fn, is_counted)`` for :class:`MixedPrecisionOptimizer` on this rank's layout.

    After the data-parallel all-reduce every DP rank holds the same gradients, so the norm and
    the overflow flag are combined over the model-parallel group (tp × pp) only. A parameter is
    counted once across it: tensor-parallel shards (``tensor_model_parallel=True``) on every TP
    rank, replicated ones (LayerNorm, biases of row-parallel layers) on TP rank 0 only, and a
    parameter marked ``shared`` (the last stage's copy of the tied embedding, when pp > 1) on the
    stage that does not own it not at all (Megatron's ``param_is_not_shared``).
    """
    ps = ps or state()
    mp = ps.mp
    reduce_fn = None if mp.size == 1 else (lambda t, op: comm.all_reduce(t, mp, op))
    tp_rank = ps.tp_rank

    def is_counted(param: Tensor) -> bool:
        if getattr(param, "shared", False):
            return False
        return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0

    return reduce_fn, is_counted


class _NullTimer:
    def start(self) -> None: ...

    def stop(self) -> None: ...


def _parallel_state() -> ParallelState:
    return state()


def _check_layout(meta: Mapping[str, Any], ps: ParallelState, where: str) -> None:
    """Refuse a checkpoint saved with another tensor/pipeline layout (it needs resharding)."""
    layout = meta.get("layout") or {}
    saved = (
        layout.get("tensor_model_parallel_size", 1),
        layout.get("pipeline_model_parallel_size", 1),
    )
    if saved != (ps.tp_size, ps.pp_size):
        raise CheckpointError(
            f"the checkpoint was saved with tensor parallel {saved[0]} and pipeline parallel "
            f"{saved[1]}; this run has {ps.tp_size} and {ps.pp_size}",
            where=where,
            fix=f"resume with --tensor-model-parallel-size {saved[0]} "
            f"--pipeline-model-parallel-size {saved[1]} (the data-parallel size may differ)",
        )


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class Engine:
    """Trains ``model`` with ``optimizer`` (a :class:`MixedPrecisionOptimizer`).

    Args:
        model: the module; its parameters already in the training dtype and on ``device``.
        optimizer: master weights, loss scaling, clipping.
        lr_scheduler: anything with ``step(increment)``, ``state_dict()``, ``load_state_dict()``.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``, used by :meth:`train_batch` and
            :meth:`eval_batch`; :meth:`__call__` just calls the module.
        micro_batch_size: samples per micro-batch on this rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        data_parallel_size: replicas; the global batch is micro × accumulation × this.
        lr_increment: what one step advances the scheduler by (Megatron counts samples: the
            global batch size); default 1.
        checkpoint_metadata: written to every checkpoint's metadata.json (model config, vocab
            sizes, tokenizer, layout), see ``checkpoint.build_metadata``.
        vocab_keys / orig_vocab_size: let checkpoints with another vocab padding load.
        compile: run the module's forward through ``torch.compile``.
        timers: optional ``timers(name).start()/stop()`` (``training.timers.Timers``).
        data_parallel: averages gradients over the data-parallel group (built before the
            optimizer, see :mod:`zerotron.parallel.data_parallel`); None for one replica.
        pipeline: runs ``model``'s pipeline chunks (``pipeline.modules``, all of them
            ``model``'s submodules) on the schedule; ``gradient_accumulation_steps`` must equal
            its ``num_microbatches``. None without pipeline parallelism.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: MixedPrecisionOptimizer,
        lr_scheduler: Any = None,
        *,
        loss_fn: LossFn | None = None,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
        data_parallel_size: int = 1,
        lr_increment: int = 1,
        checkpoint_metadata: Mapping[str, Any] | None = None,
        vocab_keys: Sequence[str] = (),
        orig_vocab_size: int | None = None,
        compile: bool = False,
        timers: Callable[[str], Any] | None = None,
        data_parallel: DataParallel | None = None,
        pipeline: PipelineRuntime | None = None,
    ):
        if pipeline is not None and pipeline.num_microbatches != gradient_accumulation_steps:
            raise UnsupportedError(
                f"the pipeline runs {pipeline.num_microbatches} micro-batches a step, but "
                f"gradient_accumulation_steps is {gradient_accumulation_steps}",
                where="Engine",
                fix="build PipelineRuntime with num_microbatches = gradient_accumulation_steps",
            )
        if pipeline is not None and compile:
            raise UnsupportedError(
                "torch.compile of pipeline stages", where="Engine", fix="drop --compile"
            )
        self.module = model
        self.pipeline = pipeline
        self.data_parallel = data_parallel
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_fn = loss_fn
        self._micro_batch_size = micro_batch_size
        self._gas = gradient_accumulation_steps
        if data_parallel is not None and data_parallel_size == 1:
            data_parallel_size = data_parallel.group.size
        self.data_parallel_size = data_parallel_size
        self.lr_increment = lr_increment
        self.checkpoint_metadata = dict(checkpoint_metadata or {})
        self.vocab_keys = tuple(vocab_keys)
        self.orig_vocab_size = orig_vocab_size
        self.timers = timers or (lambda name: _NullTimer())
        self.device = next(model.parameters()).device
        # Compile the call, not the module: state-dict keys and parameters stay the module's.
        self._forward = torch.compile(model) if compile else model

        self._sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.last_step: StepResult | None = None

    # ---- sizes (DeepSpeed's names) --------------------------------------------------------

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_batch_size(self) -> int:
        return self._micro_batch_size * self._gas * self.data_parallel_size

    def zero_optimization_stage(self) -> int:
        return 0

    # ---- state ----------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.num_skipped_steps

    @property
    def cur_scale(self) -> float:
        return self.optimizer.loss_scale

    loss_scale = cur_scale

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro_steps % self._gas == 0

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # ---- one micro-batch at a time (DeepSpeed's loop) ---------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_under_pipeline("engine(batch)")
        return self._forward(*args, **kwargs)

    forward = __call__

    def _refuse_under_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise UnsupportedError(
                f"{what} under pipeline parallelism: a stage sees no whole model",
                where="Engine",
                fix="use engine.train_batch(data_iter) / engine.eval_batch(data_iter)",
            )

    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-batch's loss: divided by the accumulation steps, then scaled.

        Under data parallelism only the micro-batch that ends an accumulation reduces gradients
        (its buckets overlap with its backward); this call returns once they are averaged.
        """
        self._refuse_under_pipeline("engine.backward(loss)")
        if self._gas > 1:
            loss = loss / self._gas
        dp = self.data_parallel
        boundary = (self.micro_steps + 1) % self._gas == 0
        if dp is not None:
            dp.sync = boundary
        self.optimizer.scale_loss(loss).backward()
        self.micro_steps += 1
        if boundary:
            if dp is not None:
                dp.finish_grad_sync()
            self._allreduce_sequence_parallel_grads()

    def _allreduce_sequence_parallel_grads(self) -> None:
        """Sum over TP the gradients of replicated parameters that ran on sequence shards.

        Once per step, after the data-parallel average (the two commute): LayerNorms, row-
        parallel biases and position embeddings under ``--sequence-parallel`` (marked
        ``sequence_parallel``). Their gradient lives in ``main_grad`` (data parallel, 16-bit
        params) or ``.grad``; all of one dtype go in one flat all-reduce.
        """
        tp = _parallel_state().tp
        if tp.size == 1 or not self._sp_params:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in self._sp_params:
            g = grad_of(p)
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), tp)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(parts, grads)])

    def _dp_mean(self, loss: Tensor) -> Tensor:
        """``loss`` averaged over the data-parallel ranks (the value every rank reports)."""
        if self.data_parallel is None:
            return loss
        return comm.all_reduce(loss.clone(), self.data_parallel.group, op="avg")

    def step(self) -> StepResult | None:
        """At an accumulation boundary: optimizer step (skipped on overflow), then scheduler."""
        if not self.is_gradient_accumulation_boundary():
            return None
        result = self.optimizer.step()
        if result.update_successful and self.lr_scheduler is not None:
            self.lr_scheduler.step(self.lr_increment)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.last_step = result
        return result

    # ---- whole batches (Megatron's loop, pipeline models) -----------------------------------

    def _next_batch(self, data_iter: Iterator) -> Any:
        timer = self.timers("batch-generator")
        timer.start()
        batch = _to_device(next(data_iter), self.device)
        timer.stop()
        return batch

    def train_batch(self, data_iter: Iterator) -> Tensor:
        """Forward and backward over one global batch's micro-batches, then step.

        Returns the mean loss over the micro-batches and data-parallel ranks (a detached scalar,
        the same on every rank).
        """
        if self.pipeline is not None:
            return self._train_batch_pipeline(data_iter)
        assert self.loss_fn is not None, "train_batch needs Engine(loss_fn=...)"
        self.module.train()
        losses = []
        fb = self.timers("forward-backward")
        for _ in range(self._gas):
            batch = self._next_batch(data_iter)
            fb.start()
            loss = self.loss_fn(self._forward, batch)
            self.backward(loss)
            fb.stop()
            losses.append(loss.detach())
        opt = self.timers("optimizer")
        opt.start()
        self.step()
        opt.stop()
        return self._dp_mean(torch.stack(losses).float().mean())

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator) -> Tensor:
        """Mean loss over one global batch's micro-batches (and data-parallel ranks), without
        gradients or dropout."""
        was_training = self.module.training
        if self.pipeline is not None:
            try:
                loss = self.pipeline.eval_step(self._batches(data_iter))
            finally:
                self.module.train(was_training)
            return self._dp_mean(self._from_last_stage(loss))
        assert self.loss_fn is not None, "eval_batch needs Engine(loss_fn=...)"
        self.module.eval()
        try:
            losses = [
                self.loss_fn(self._forward, self._next_batch(data_iter)) for _ in range(self._gas)
            ]
        finally:
            self.module.train(was_training)
        return self._dp_mean(torch.stack(losses).float().mean())

    # ---- pipeline parallelism -------------------------------------------------------------

    def _batches(self, data_iter: Iterator) -> Iterator:
        """``data_iter``'s micro-batches on this device, drawn one at a time by the runtime."""
        while True:
            try:
                yield self._next_batch(data_iter)
            except StopIteration:
                return

    def _train_batch_pipeline(self, data_iter: Iterator) -> Tensor:
        """One step of the pipeline schedule over the global batch's micro-batches, then step.

        The data-parallel buckets stay quiet through the schedule (they would otherwise reduce
        on every micro-batch's backward) and are reduced once, after the last backward.
        """
        pipe = self.pipeline
        dp = self.data_parallel
        fb = self.timers("forward-backward")
        fb.start()
        with dp.no_sync() if dp is not None else nullcontext():
            loss = pipe.train_step(self._batches(data_iter), grad_scale=self.optimizer.loss_scale)
        if dp is not None:
            dp.finish_grad_sync()
        allreduce_embedding_grads(pipe.modules)
        self._allreduce_sequence_parallel_grads()
        fb.stop()
        self.micro_steps += self._gas
        opt = self.timers("optimizer")
        opt.start()
        self.step()
        opt.stop()
        return self._dp_mean(self._from_last_stage(loss))

    def _from_last_stage(self, loss: Tensor | None) -> Tensor:
        """The last pipeline stage's ``loss``, broadcast to every stage of the pipeline group."""
        pp = _parallel_state().pp
        if pp.size == 1:
            assert loss is not None
            return loss
        value = torch.zeros((), device=self.device) if loss is None else loss.float().clone()
        return comm.broadcast(value, pp, pp.size - 1)

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        *,
        save_optimizer: bool = True,
        save_rng: bool = True,
    ) -> Path:
        """Write ``<save_dir>/<tag>/`` (default tag ``global_step{N}``, DeepSpeed's).

        ``client_state`` entries are stored beside the engine's own and come back from
        :meth:`load_checkpoint`.
        """
        tag = tag or f"global_step{self.global_steps}"
        state: dict[str, Any] = dict(client_state or {})
        state.update(
            model=self.module.state_dict(),
            checkpoint_version=CHECKPOINT_VERSION,
            global_steps=self.global_steps,
            global_samples=self.global_samples,
        )
        if save_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
            if self.lr_scheduler is not None:
                state["opt_param_scheduler"] = self.lr_scheduler.state_dict()
        if save_rng:
            tracker = get_rng_tracker().get_states()
            state["rng_state"] = [get_rng_state({RNG_TRACKER_KEY: tracker} if tracker else None)]
        ps = _parallel_state()
        # One file per model-parallel rank, from its data-parallel rank 0 (the replicas are
        # equal); every rank takes part in the save's barriers.
        files = {self._model_file(ps): state} if ps.dp_rank == 0 else {}
        return save_checkpoint(
            save_dir,
            tag,
            files,
            self.checkpoint_metadata,
            save_latest=save_latest,
            is_writer=ps.rank == 0,
            barrier=comm.barrier if ps.world_size > 1 else None,
        )

    @staticmethod
    def _model_file(ps: ParallelState) -> str:
        return model_file(ps.tp_rank, ps.pp_rank, ps.pp_size)

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        load_rng: bool = True,
    ) -> tuple[str, dict[str, Any]]:
        """Load a checkpoint; returns ``(path, client_state)`` as DeepSpeed does.

        ``load_module_only`` (Megatron's ``--finetune``) loads weights and nothing else: step
        counters stay at zero.
        """
        tag = resolve_tag(load_dir, tag)
        where = str(Path(load_dir) / tag)
        ps = _parallel_state()
        meta = read_metadata(load_dir, tag)
        _check_layout(meta, ps, where)
        state = load_file(load_dir, tag, self._model_file(ps))
        if "model" not in state:
            raise CheckpointError("no 'model' entry in the checkpoint", where=where)
        ckpt_vocab_size = meta.get("vocab", {}).get("size", self.orig_vocab_size)
        repadded = load_model_state(
            self.module,
            state["model"],
            vocab_keys=self.vocab_keys,
            orig_vocab_size=ckpt_vocab_size,
            vocab_size=self.orig_vocab_size,
            ckpt_config=meta.get("model"),
            model_config=self.checkpoint_metadata.get("model"),
            where=where,
        )
        if load_module_only:
            self.optimizer.reload_model_params()
            return where, {}
        if load_optimizer_states and "optimizer" in state:
            if repadded:
                self._repad_optimizer_state(state["optimizer"], repadded, ckpt_vocab_size)
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.optimizer.reload_model_params()
        scheduler_state = state.get("opt_param_scheduler")
        if load_lr_scheduler_states and self.lr_scheduler is not None and scheduler_state:
            self.lr_scheduler.load_state_dict(scheduler_state)
        if load_rng and state.get("rng_state"):
            extra = set_rng_state(state["rng_state"][0], where=where)
            if extra.get(RNG_TRACKER_KEY):
                get_rng_tracker().set_states(extra[RNG_TRACKER_KEY])
        self.global_steps = int(state.get("global_steps", 0))
        self.global_samples = int(state.get("global_samples", 0))
        own = {
            "model",
            "optimizer",
            "opt_param_scheduler",
            "rng_state",
            "checkpoint_version",
            "global_steps",
            "global_samples",
        }
        return where, {k: v for k, v in state.items() if k not in own}

    def _repad_optimizer_state(
        self, opt_state: dict[str, Any], repadded: Sequence[str], orig_vocab_size: int
    ) -> None:
        """Re-pad the optimizer's state of re-padded vocabulary tensors as their weights were.

        Adam's moments and the fp32 master of such a tensor have the checkpoint's padded rows;
        stepping them against the model's other row count would be wrong (fused kernels do not
        even check). Real rows are kept, padding rows start at zero.
        """
        names = {id(p): n for n, p in self.module.named_parameters()}
        per_param = opt_state["optimizer"]["state"]
        masters = opt_state.get("fp32_from_fp16_params") or []
        flat = 0  # torch numbers state entries over all groups in order, as model_params
        for g, group in enumerate(self.optimizer.param_groups):
            low = 0  # position among this group's 16-bit params (fp32_from_fp16_params[g])
            for _ in group["params"]:
                param = self.optimizer.model_params[flat]
                is_16bit = param.dtype in LOW_PRECISION
                if names.get(id(param)) in repadded:
                    rows = param.shape[0]
                    for key, value in per_param.get(flat, {}).items():
                        if isinstance(value, Tensor) and value.dim() == param.dim():
                            per_param[flat][key] = repad_vocab(value, orig_vocab_size, rows)
                    if is_16bit and g < len(masters) and low < len(masters[g]):
                        masters[g][low] = repad_vocab(masters[g][low], orig_vocab_size, rows)
                low += is_16bit
                flat += 1
