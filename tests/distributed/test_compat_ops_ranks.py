"""zerotron.ops optimizers as the client optimizer of initialize() on 2 gloo ranks: ZeRO stages
1-3 with the optimizer offloaded to the CPU train with the same losses, bit for bit, as plain
data parallelism (stage 0) with the same optimizer. A tiny MLP; each rank trains on its own
micro-batches, one per step: with gradient accumulation, stages 2-3 sum the ranks' micro-batch
gradients in another order than stage 0 (reduce-scatter per micro-batch, as DeepSpeed), so the
losses could differ in the last bits."""

from __future__ import annotations

import pytest
import torch

from .spawn import run_ranks

CLASSES = ("DeepSpeedCPUAdam", "FusedAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedLion")
STAGES = (0, 1, 2, 3)


def _train_all(rank: int) -> dict[tuple[str, int], list[float]]:
    from torch import nn

    import zerotron
    from zerotron.ops import adagrad, adam, lion

    classes = {name: getattr(m, name) for m in (adam, adagrad, lion) for name in m.__all__}
    out = {}
    for name in CLASSES:
        for stage in STAGES:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
            opt = classes[name](model.parameters(), lr=1e-2, weight_decay=0.1)
            zero: dict = {"stage": stage}
            if stage:
                zero["offload_optimizer"] = {"device": "cpu"}
            config = {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "zero_optimization": zero,
            }
            engine, *_ = zerotron.initialize(model=model, optimizer=opt, config=config)
            g = torch.Generator().manual_seed(10 + rank)
            losses = []
            for _ in range(6):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
                loss = nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[(name, stage)] = losses
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_train_all, 2, timeout=600)


@pytest.mark.xdist_group("compat_ops_ranks")
@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_cpu_offload_equals_plain_data_parallel(runs, name, stage):
    for rank_losses in runs:
        assert rank_losses[(name, stage)] == rank_losses[(name, 0)]
