"""A tiny DeepSpeed-style training script for the autotuner's tests (tests/test_tune*.py,
tests/distributed/test_tune_e2e.py): a 2-layer MLP of width 64 trained with
``zerotron.initialize`` from ``--deepspeed_config``, as DeepSpeed's autotuning examples are.

``--fail-at-mbs N`` raises at micro-batch N, ``--hang-at-mbs N`` sleeps instead of training:
the experiments a tuner must record and step over.
"""

import argparse
import time

import torch
from torch import nn

import zerotron as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--fail-at-mbs", type=int, default=None)
parser.add_argument("--hang-at-mbs", type=int, default=None)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=args.deepspeed_config
)
mbs = engine.train_micro_batch_size_per_gpu()
if mbs == args.fail_at_mbs:
    raise RuntimeError(f"this script refuses micro-batch {mbs}")
if mbs == args.hang_at_mbs:
    time.sleep(3600)
for _ in range(args.steps):
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randn(mbs, 64)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
if engine.global_rank == 0:  # what the best run reports (an experiment ends before this)
    stage = engine.zero_optimization_stage()
    print(f"tune_train: trained {args.steps} steps, micro-batch {mbs}, ZeRO stage {stage}")
