"""Monitors and checkpoint tag validation through ``zerotron.initialize`` on two gloo ranks.

Two ranks as two pipeline stages: rank 0 alone writes, and logs the loss ``train_batch``
returns. Two data-parallel ranks: saving under different tags warns (``Warn``) or raises
CheckpointError (``Fail``) naming the ranks; the same tag, or ``Ignore``, does neither.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import zerotron
from tests.test_monitor import GAS, MICRO, STEPS, _config, _mlp, _read_csv
from zerotron.errors import CheckpointError

from .spawn import run_ranks


def _tags_rank(rank: int, tmp: str) -> dict:
    config = _config(checkpoint={"tag_validation": "Warn"})
    engine, _, _, _ = zerotron.initialize(model=_mlp(), config=config)
    out: dict = {}
    for mode, tag in (("Warn", "same"), ("Ignore", f"t{rank}"), ("Warn", f"t{rank}")):
        engine.checkpoint_tag_validation = mode
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.save_checkpoint(tmp, tag=tag)
        out[(mode, tag == "same")] = [str(w.message) for w in caught if "tag" in str(w.message)]
    engine.checkpoint_tag_validation = "Fail"
    try:
        engine.save_checkpoint(tmp, tag=f"t{rank}")
        out["fail"] = None
    except CheckpointError as e:
        out["fail"] = str(e)
    return out


def test_tag_validation_names_the_ranks(tmp_path):
    results = run_ranks(_tags_rank, 2, str(tmp_path), timeout=60)
    for rank, out in enumerate(results):
        assert out[("Warn", True)] == [] and out[("Ignore", False)] == []
        (warning,) = out[("Warn", False)]
        assert "ranks [0]; ranks [1]" in warning and f"'t{rank}'" in warning
        assert "ranks [0]; ranks [1]" in out["fail"] and "tag_validation" in out["fail"]


def _pipeline_rank(rank: int, tmp: str) -> list[float]:
    import torch.nn.functional as F

    from zerotron.distributed.state import initialize_model_parallel
    from zerotron.pipe import LayerSpec, PipelineModule

    initialize_model_parallel(pipeline_model_parallel_size=2)
    specs = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Tanh)] * 2
    module = PipelineModule(specs, num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")
    config = _config(csv_monitor={"enabled": True, "output_path": tmp, "job_name": "pipe"})
    engine, _, _, _ = zerotron.initialize(model=module, config=config)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(STEPS):
        data = [(torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 8, generator=g))] * GAS
        losses.append(engine.train_batch(iter(data)).item())
    engine.destroy()
    return losses


def test_pipeline_train_batch_logs_the_last_stage_loss_from_rank_0(tmp_path):
    """pp=2: rank 0 (the first stage, which computes no loss) logs the loss train_batch
    returns (one data-parallel replica: no averaging), and it alone writes."""
    losses, other = run_ranks(_pipeline_rank, 2, str(tmp_path), timeout=60)
    assert losses == other
    header, rows = _read_csv(tmp_path / "pipe" / "Train_Samples_train_loss.csv")
    assert rows == [(MICRO * GAS * (i + 1), loss) for i, loss in enumerate(losses)]
    assert sorted(p.name for p in (tmp_path / "pipe").iterdir()) == [
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
