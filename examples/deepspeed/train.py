"""A DeepSpeed training script, run by zerotron: the only change is the import line.

    # one process
    cd examples/deepspeed
    python train.py --deepspeed --deepspeed_config ds_zero2.json
    # two processes (ZeRO partitions over them)
    zerotron launch --nproc_per_node 2 train.py --deepspeed --deepspeed_config ds_zero3.json

It trains a tiny zerotron GPT (``--model gpt``, default) or a small MLP (``--model mlp``) on a
synthetic next-token task (each token is a fixed function of the one before, so the loss falls
quickly), prints the loss of every step on rank 0, saves a checkpoint with ``client_state``,
loads it back and checks that the client state and the step count came back.

Everything below ``import zerotron as deepspeed`` is written against DeepSpeed's API:
``add_config_arguments``, ``initialize(args=..., model=..., model_parameters=...,
training_data=...)``, ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``,
``save_checkpoint(dir, client_state=...)``, ``load_checkpoint(dir)``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset

import zerotron as deepspeed

VOCAB, SEQ = 128, 16


class NextToken(Dataset):
    """Sequences where token[t + 1] = (5 * token[t] + 3) % VOCAB, from random first tokens."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(0, VOCAB, (n,), generator=g)
        rows = [first]
        for _ in range(SEQ):
            rows.append((5 * rows[-1] + 3) % VOCAB)
        self.data = torch.stack(rows, dim=1)  # [n, SEQ + 1]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class MLPLM(nn.Module):
    """A bigram model: embedding -> MLP -> vocabulary."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, hidden),
            nn.Linear(hidden, 4 * hidden),
            nn.GELU(),
            nn.Linear(4 * hidden, VOCAB),
        )

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.net(tokens)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class GPTLM(nn.Module):
    """zerotron's GPT with the loss averaged over tokens."""

    def __init__(self):
        super().__init__()
        from zerotron.models.gpt import GPT, GPTConfig

        config = GPTConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=SEQ,
            vocab_size=VOCAB,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        self.gpt = GPT(config)
        self.config = config

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens, labels=labels).mean()


def mean_over_ranks(value: float) -> float:
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed-style training on zerotron")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument("--train_iters", type=int, default=10, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="for 'auto' in the config")
    parser.add_argument("--warmup_steps", type=int, default=2, help="for 'auto' in the config")
    parser.add_argument("--batch_size", type=int, default=4, help="per rank, for 'auto'")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2, help="for 'auto'")
    parser.add_argument("--clip_grad", type=float, default=1.0, help="for 'auto' in the config")
    parser.add_argument("--save_dir", default="checkpoints/deepspeed_example")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPTLM() if args.model == "gpt" else MLPLM()
    dataset = NextToken(4096, args.seed)

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )

    batches = iter(loader)
    losses = []
    for _ in range(args.train_iters):
        step_loss = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            tokens, labels = next(batches)
            tokens, labels = tokens.to(engine.device), labels.to(engine.device)
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / engine.gradient_accumulation_steps()
        step_loss = mean_over_ranks(step_loss)  # every rank saves the same client_state
        losses.append(step_loss)
        if rank == 0:
            print(
                f"step {engine.global_steps} loss {step_loss:.4f} lr {engine.get_lr()[0]:.3e} "
                f"zero_stage {engine.zero_optimization_stage()}",
                flush=True,
            )

    client_state = {"step": engine.global_steps, "losses": losses, "note": "from train.py"}
    engine.save_checkpoint(args.save_dir, client_state=client_state)
    path, restored = engine.load_checkpoint(args.save_dir)
    assert restored == client_state, (restored, client_state)
    assert engine.global_steps == args.train_iters
    if rank == 0:
        print(f"client_state restored from {path}: step {restored['step']}", flush=True)


if __name__ == "__main__":
    main()
