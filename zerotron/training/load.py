"""What ``--load`` gives ``zerotron pretrain``: a zerotron checkpoint (resume, or the weights
alone with ``--finetune``), a checkpoint Megatron-LM or Megatron-DeepSpeed wrote (its weights,
from any layout into any layout), and the model shape ``--use-checkpoint-args`` reads from
either.

A Megatron-LM checkpoint is recognized by its files (``mp_rank_*`` without zerotron's
metadata.json, or megatron-core's ``torch_dist`` directory), a Megatron-DeepSpeed one by
DeepSpeed's model-states files with Megatron's args in them. Its weights are read and cut for
each rank as ``zerotron convert --from-megatron`` would convert them; Megatron's optimizer and
RNG states are not read, so the run says which of Megatron's ways to start from weights alone it
takes: ``--finetune`` (iteration 0) or ``--no-load-optim --no-load-rng`` (Megatron's iteration
and consumed samples, a fresh optimizer).
"""

from __future__ import annotations

from typing import Any

from zerotron.checkpoint import read_latest_tag, read_metadata, resolve_tag
from zerotron.checkpoint.megatron_args import (
    is_megatron_checkpoint,
    megatron_model_args,
    megatron_writer,
)
from zerotron.checkpoint.megatron_deepspeed_optim import optimizer_files
from zerotron.checkpoint.megatron_import import training_state
from zerotron.checkpoint.megatron_io import tag_dir
from zerotron.checkpoint.megatron_rank import megatron_weights_for
from zerotron.checkpoint.relayout import refuse_other_model
from zerotron.distributed.state import state as parallel_state
from zerotron.errors import CheckpointError
from zerotron.training.build import Run
from zerotron.training.loop import TrainState, print_rank_0

# What --use-checkpoint-args takes from a checkpoint's model config (metadata.json's "model"
# entry, or Megatron's args).
CHECKPOINT_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "max_position_embeddings",
    "layernorm_epsilon",
)


def checkpoint_args(load: str) -> dict[str, Any]:
    """``--use-checkpoint-args``: the model's shape (:data:`CHECKPOINT_ARGS`), tokenizer (type;
    ``NullTokenizer``'s vocabulary size) and tensor/pipeline sizes (which the config layer takes
    only with ``--use-mp-args-from-checkpoint-args``) recorded by the checkpoint ``--load``
    would load: zerotron's newest complete tag, or the args of Megatron-LM's."""
    if is_megatron_checkpoint(load):
        config, tokenizer, layout = megatron_model_args(load)
        model = config.to_dict()
    else:
        meta = read_metadata(load, resolve_tag(load))
        model, tokenizer = meta.get("model") or {}, meta.get("tokenizer") or {}
        layout = meta.get("layout") or {}
    out = {name: model[name] for name in CHECKPOINT_ARGS if model.get(name) is not None}
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if layout.get(name) is not None:  # taken with --use-mp-args-from-checkpoint-args
            out[name] = int(layout[name])
    if tokenizer.get("type"):
        out["tokenizer_type"] = tokenizer["type"]
        if tokenizer["type"] == "NullTokenizer" and tokenizer.get("vocab_size") is not None:
            out["vocab_size"] = tokenizer["vocab_size"]
    return out


def resume(run: Run, state: TrainState) -> None:
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
        print_rank_0(f" WARNING: no checkpoint found in {c.load}; starting from random weights")
        return
    if is_megatron_checkpoint(c.load):
        _load_megatron(run, state)
        return
    path, client = run.engine.load_checkpoint(
        c.load,
        load_optimizer_states=not (c.no_load_optim or c.finetune),
        load_lr_scheduler_states=not (c.no_load_optim or c.finetune),
        load_module_only=c.finetune,
        load_rng=not (c.no_load_rng or c.finetune),
    )
    if not c.finetune and not c.reset_iteration:
        state.iteration = int(client.get("iteration", run.engine.global_steps))
        state.consumed_train_samples = int(client.get("consumed_train_samples", 0))
        state.consumed_valid_samples = int(client.get("consumed_valid_samples", 0))
    else:
        run.engine.global_steps = run.engine.global_samples = 0
    print_rank_0(f"  successfully loaded checkpoint from {path} at iteration {state.iteration}")


def _load_training_state(run: Run, state: TrainState) -> None:
    """A Megatron-DeepSpeed checkpoint with DeepSpeed's optimizer partitions in ``--load``: its
    weights and training state (every rank reads it whole, then keeps its part), so the run
    goes on where it stopped, on this run's layout."""
    c = run.cfg.checkpoint
    found = training_state(c.load)
    assert found is not None  # it has optimizer files
    ckpt, info = found
    where, client = run.engine.load_imported(ckpt)
    if not c.reset_iteration:
        state.iteration = int(client.get("iteration", 0))
        state.consumed_train_samples = int(client.get("consumed_train_samples", 0))
        state.consumed_valid_samples = int(client.get("consumed_valid_samples", 0))
    else:
        run.engine.global_steps = run.engine.global_samples = 0
    print_rank_0(
        f"  loaded the weights and training state (fp32 masters, Adam moments and step, "
        f"schedule) of a {info['writer']} {info['format']} checkpoint (tensor parallel "
        f"{info['tensor_parallel']}, pipeline parallel {info['pipeline_parallel']}) from {where}; "
        f"going on from iteration {state.iteration} (consumed samples "
        f"{state.consumed_train_samples}); its RNG states are not carried"
    )


def _load_megatron(run: Run, state: TrainState) -> None:
    """Megatron-LM's checkpoint in ``--load``: its weights, cut for this rank; with
    ``--no-load-optim --no-load-rng`` also its iteration and consumed samples."""
    c = run.cfg.checkpoint
    if not (c.finetune or c.no_load_optim) and optimizer_files(tag_dir(c.load)):
        _load_training_state(run, state)  # Megatron-DeepSpeed's, from DeepSpeed's partitions
        return
    if not c.finetune and not (c.no_load_optim and c.no_load_rng):
        raise CheckpointError(
            f"the checkpoint was written by {megatron_writer(c.load)}: zerotron reads its "
            "weights (and a Megatron-DeepSpeed run's optimizer partitions), not its optimizer "
            "and RNG states",
            where=c.load,
            fix="add --finetune to start from its weights at iteration 0, or --no-load-optim "
            "--no-load-rng to go on from its iteration with a fresh optimizer",
        )
    ps = parallel_state()
    vocab = run.engine.checkpoint_metadata["vocab"]
    weights, meta, info = megatron_weights_for(
        c.load,
        ps.tp_rank,
        ps.tp_size,
        ps.pp_rank,
        ps.pp_size,
        padded_vocab_size=vocab["padded_size"],
        virtual_stages=ps.virtual_pipeline_size or 1,
    )
    where = f"{c.load}/{read_latest_tag(c.load)}"
    saved = f"{info['writer']}'s tp{info['tensor_parallel']} pp{info['pipeline_parallel']}"
    refuse_other_model(
        meta,
        run.engine.checkpoint_metadata.get("model"),
        vocab["size"],
        where,
        saved_layout=saved,
        layout=f"tp{ps.tp_size} pp{ps.pp_size}",
        recorded_in="Megatron's args in the checkpoint hold its model; --use-checkpoint-args "
        "takes it from them",
    )
    run.engine.load_weights(weights, meta, where)
    if not c.finetune and not c.reset_iteration:
        state.iteration = int(info["iteration"] or 0)  # a release checkpoint has none
        state.consumed_train_samples = info["consumed_train_samples"]
        state.consumed_valid_samples = info["consumed_valid_samples"]
    run.engine.global_steps = state.iteration
    run.engine.global_samples = state.consumed_train_samples
    print_rank_0(
        f"  loaded the weights of a {info['writer']} {info['format']} checkpoint (tensor parallel "
        f"{info['tensor_parallel']}, pipeline parallel {info['pipeline_parallel']}, iteration "
        f"{info['iteration']}) from {where}; "
        + (
            "starting at iteration 0 (--finetune)"
            if c.finetune
            else f"going on from iteration {state.iteration} (consumed samples "
            f"{state.consumed_train_samples}) with a fresh optimizer"
        )
    )
