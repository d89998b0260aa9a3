"""Train a causal language model with Hugging Face's Trainer, in the style of HF's run_clm.py.

The Trainer's own flags (``TrainingArguments``) are all accepted, ``--deepspeed ds_config.json``
included. With zerotron serving DeepSpeed's API to transformers and accelerate::

    zerotron launch --as-deepspeed --nproc_per_node 2 examples/huggingface/run_clm.py \\
        --deepspeed examples/huggingface/ds_zero2.json --output_dir work/clm --max_steps 20

and without DeepSpeed (plain torch DDP, same launcher)::

    zerotron launch --nproc_per_node 2 examples/huggingface/run_clm.py --output_dir work/clm ...

The model is a GPT-2 built from a config (no download); the data is a synthetic token stream
from a fixed seed, so two runs see the same batches. ``--losses_file`` writes the logged
training losses as JSON lines (``{"step": N, "loss": X}``) from rank 0, for comparisons.
``--do_eval`` evaluates on the same data after training, or instead of it without
``--do_train`` (under DeepSpeed the Trainer then builds an engine without an optimizer).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)


@dataclass
class ModelArguments:
    """What run_clm.py calls model and data arguments, for a model built from a config."""

    n_layer: int = field(default=2, metadata={"help": "transformer layers"})
    n_embd: int = field(default=64, metadata={"help": "hidden size"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    vocab_size: int = field(default=96, metadata={"help": "vocabulary size"})
    block_size: int = field(default=16, metadata={"help": "tokens per sample"})
    num_samples: int = field(default=64, metadata={"help": "training samples"})
    losses_file: str | None = field(default=None, metadata={"help": "write losses here"})


class SyntheticText(torch.utils.data.Dataset):
    """Fixed random token blocks with a learnable pattern: each token predicts the next."""

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
        step = torch.randint(1, 4, (num_samples, 1), generator=g)
        self.blocks = (start + step * torch.arange(block_size)) % vocab_size

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class LossRecorder(TrainerCallback):
    """Appends every logged training loss to a JSON-lines file (the main process only)."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102 (HF's hook)
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


def main() -> None:
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = GPT2Config(
        n_layer=model_args.n_layer,
        n_embd=model_args.n_embd,
        n_head=model_args.n_head,
        vocab_size=model_args.vocab_size,
        n_positions=model_args.block_size,
        resid_pdrop=0.0,  # no dropout: runs are compared step by step
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    dataset = SyntheticText(model_args.num_samples, model_args.block_size, model_args.vocab_size)
    callbacks = [LossRecorder(model_args.losses_file)] if model_args.losses_file else []
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=dataset,
        callbacks=callbacks,
    )
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if training_args.do_train or not training_args.do_eval:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        if rank0:
            print(f"train_loss {result.training_loss:.6f} steps {result.global_step}", flush=True)
    if training_args.do_eval:
        metrics = trainer.evaluate()
        if rank0:
            print(f"eval_loss {metrics['eval_loss']:.6f}", flush=True)
    # Gloo's worker threads free a finished collective's tensors themselves, which takes the
    # interpreter lock. The Trainer's last all-gather (its flop count) ends moments before this
    # line; unless the lock is let go first, the rank aborts at exit ("terminate called without
    # an active exception") or deadlocks in the process group's destructor, torch issue 190489
    # (1 run in 6-12 here). A barrier does not help: it holds the gather until it is freed.
    time.sleep(0.2)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
