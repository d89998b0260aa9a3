"""zerotron.checkpointing's partition_activations on two gloo ranks (tp=2): each rank keeps half
the bytes of a block input, one all-gather per block in backward, gradients unchanged (equal to
the run without checkpointing), with zerotron's mpu or a foreign Megatron-style one."""

import torch

import zerotron.checkpointing as ck
from tests.test_checkpointing import _blocks, _same, run_blocks
from zerotron.distributed import mpu
from zerotron.distributed.comm import ledger
from zerotron.distributed.state import initialize_model_parallel

from .spawn import run_ranks


class ForeignMpu:
    """A Megatron-style mpu object that is not zerotron's module (its groups are torch's)."""

    def get_tensor_model_parallel_group(self):
        return mpu.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self):
        return mpu.get_tensor_model_parallel_rank()


def _partition_rank(rank):
    initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    for name, kw in {
        "plain": {},
        "partition": {"partition_activations": True},
        "partition-foreign-mpu": {"partition_activations": True, "mpu_": ForeignMpu()},
        "partition+cpu+contiguous": {
            "partition_activations": True,
            "checkpoint_in_cpu": True,
            "contiguous_checkpointing": True,
            "num_checkpoints": 3,
        },
    }.items():
        ck.configure(kw.pop("mpu_", mpu), **kw)
        # Partitioning assumes block inputs equal on the TP ranks (Megatron's replicated
        # residual stream): dropout here draws from the default stream, seeded alike.
        blocks = _blocks()
        x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(5))
        with ledger.capture() as cap:
            got = run_blocks(blocks, x, 1.0, True)
        out[name] = {"result": got[:5], "kept": got[5], "ledger": cap.summary()}
    ref = run_blocks(_blocks(), x, 1.0, False)
    out["reference"] = ref[:5]
    return out


def test_partition_activations_on_two_tensor_parallel_ranks():
    results = run_ranks(_partition_rank, 2, timeout=60)
    full = 4 * 6 * 16 * 4  # bytes of one block input
    for rank, r in enumerate(results):
        ref = r["reference"]
        for name in ("plain", "partition", "partition-foreign-mpu", "partition+cpu+contiguous"):
            assert _same(r[name]["result"], ref), f"rank {rank} {name}"
        assert r["plain"]["ledger"] == {}
        assert r["plain"]["kept"] == full
        assert r["partition"]["kept"] == full // 2  # each rank keeps its half
        assert r["partition+cpu+contiguous"]["kept"] == full // 2
        # One all-gather of the half per checkpointed block in backward.
        assert r["partition"]["ledger"] == {("tp", "all_gather"): (3 * full // 2, 3)}
        assert r["partition-foreign-mpu"]["ledger"] == r["partition"]["ledger"]
        assert r["partition-foreign-mpu"]["kept"] == full // 2
    # Gathered from both halves: the ranks' gradients agree with each other as well.
    assert _same(results[0]["partition"]["result"], results[1]["partition"]["result"])
