"""ZeRO stage 3 starts from rank 0's weights, as DeepSpeed's does: 2 gloo ranks seed differently
(rank r: seed 100 + r), build a tiny MLP either under ``zero.Init`` or plainly (then
``initialize()`` with a stage-3 config partitions it), and train a few steps on the same batches.
Every rank's gathered model equals one process seeded like rank 0 trained on those batches with
torch's AdamW, exactly (fp32; the two ranks' identical gradients average exactly). Without the
broadcast each rank would keep its chunk of its own model: a mix of two models.

Persistence threshold 40: the weights (256 and 128 elements) are partitioned, the biases stay
whole, so both kinds are checked.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotron
from zerotron.zero import Init
from zerotron.zero.stage3 import gathered_state_dict

from .spawn import run_ranks

DP = 2
STEPS = 3
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
RANK0 = pytest.mark.xdist_group("zero3_rank0")
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": ADAMW},
    "gradient_clipping": 0,  # the reference is torch's AdamW alone
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40},
}


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS)]


def one_process() -> dict[str, torch.Tensor]:
    """The model rank 0 seeds, trained alone with torch (fused AdamW: the engine's pick)."""
    torch.manual_seed(100)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    for x, y in batches():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, how: str) -> dict:
    want = one_process()
    torch.manual_seed(100 + rank)  # a script seeding per rank
    if how == "zero.Init":
        with Init(config_dict_or_path=CONFIG):
            model = mlp()
    else:
        model = mlp()
    engine, *_ = zerotron.initialize(model=model, config=CONFIG)
    for x, y in batches():
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    got = gathered_state_dict(engine.module, rank0_only=False)
    return {k: float((got[k] - want[k]).abs().max()) for k in want}


@pytest.fixture(scope="module", params=["zero.Init", "plain"])
def diffs(request) -> list[dict]:
    return run_ranks(_train, DP, request.param, timeout=120)


@RANK0
def test_every_rank_ends_with_rank0s_model_trained(diffs):
    for rank_diffs in diffs:
        assert rank_diffs == dict.fromkeys(["0.weight", "0.bias", "2.weight", "2.bias"], 0.0)
