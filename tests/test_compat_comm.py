"""deepspeed.comm (``zerotron.comm``) in one process: init_distributed and initialize leave a
default process group of one (plain process, or a launcher's WORLD_SIZE=1), every function
then gives torch.distributed's result with nothing in the ledger, DeepSpeed's ReduceOp, and
the errors for what cannot work. (Two ranks: tests/distributed/test_compat_comm_ranks.py.)

tests/conftest.py destroys the group of one after each test.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import zerotron
from zerotron import comm as ds
from zerotron.distributed import comm, init
from zerotron.distributed.comm import ledger
from zerotron.distributed.state import initialize_model_parallel, state
from zerotron.errors import DistributedError, UnsupportedError

LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def plain(monkeypatch):
    """A plain ``python script.py``: no launcher environment."""
    for var in (*LAUNCH_VARS, "DEEPSPEED_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)


def _group_of_one() -> tuple:
    return (
        dist.is_initialized(),
        dist.get_rank(),
        dist.get_world_size(),
        dist.get_backend(),
        list(DistributedSampler(range(5), shuffle=False)),
        dist.barrier(),
    )


GROUP_OF_ONE = (True, 0, 1, "gloo", [0, 1, 2, 3, 4], None)


def test_modules_are_deepspeeds_names():
    import zerotron.comm.comm
    import zerotron.comm.reduce_op

    assert zerotron.comm is zerotron.compat.comm
    assert zerotron.comm.comm is zerotron.compat.comm.comm
    assert zerotron.comm.reduce_op.ReduceOp is ds.ReduceOp
    # one implementation: the top level's init_distributed is deepspeed.comm's
    assert zerotron.init_distributed is ds.init_distributed


def test_reduce_op_is_deepspeeds_enum():
    assert [(op.name, op.value) for op in ds.ReduceOp] == [
        ("SUM", 0),
        ("PRODUCT", 1),
        ("MIN", 2),
        ("MAX", 3),
        ("BAND", 4),
        ("BOR", 5),
        ("BXOR", 6),
        ("AVG", 7),
        ("UNUSED", 8),
    ]


def test_init_distributed_in_a_plain_process_makes_a_group_of_one(plain):
    assert not dist.is_initialized()
    assert zerotron.init_distributed() is None
    assert _group_of_one() == GROUP_OF_ONE
    assert (ds.get_rank(), ds.get_world_size(), ds.get_local_rank()) == (0, 1, 0)
    assert ds.is_initialized() and ds.get_world_group() is dist.group.WORLD
    assert ds.get_all_ranks_from_group() == [0] and ds.get_global_rank() == 0


def test_under_a_launcher_with_one_process(plain, monkeypatch):
    # WORLD_SIZE=1 with an address nothing listens on: the group of one connects to nothing
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for var, value in {**env, "MASTER_PORT": "9"}.items():
        monkeypatch.setenv(var, value)
    ds.init_distributed(dist_backend="gloo")
    assert _group_of_one() == GROUP_OF_ONE


def test_initialize_makes_a_group_of_one(plain):
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {}}}
    zerotron.initialize(model=model, config=config)
    assert _group_of_one() == GROUP_OF_ONE


def test_a_group_the_script_made_is_kept(plain):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.group.WORLD
    ds.init_distributed()
    ds.init_distributed(dist_init_required=False)
    assert dist.group.WORLD is world


def test_timeout_is_deepspeeds(plain, monkeypatch):
    ds.init_distributed()
    assert init.timeout() == timedelta(minutes=10)
    ds.destroy_process_group()
    assert not dist.is_initialized()
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "3")
    ds.init_distributed()
    assert init.timeout() == timedelta(minutes=3)
    ds.destroy_process_group()
    ds.init_distributed(timeout=timedelta(seconds=90))
    assert init.timeout() == timedelta(seconds=90)


def _one_process_cases() -> dict:
    """{case: (zerotron.comm's result, torch.distributed's result)} on the group of one."""
    x = torch.arange(12.0).reshape(3, 4) + 1
    out = {}
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        ours, theirs = x.clone(), x.clone()
        ds.all_reduce(ours, getattr(ds.ReduceOp, op))
        dist.all_reduce(theirs, getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = (ours, theirs)
    ours = x.clone()
    ds.all_reduce(ours, dist.ReduceOp.SUM, async_op=True).wait()
    out["all_reduce_torch_op_async"] = (ours, x)
    ours, theirs = [torch.zeros(3, 4)], [torch.zeros(3, 4)]
    ds.all_gather(ours, x)
    dist.all_gather(theirs, x)
    out["all_gather"] = (ours, theirs)
    ours = torch.zeros(1, 3, 4)
    ds.all_gather_into_tensor(ours, x)
    out["all_gather_into_tensor"] = (ours, x.reshape(1, 3, 4))
    ours = torch.zeros(3, 4)
    ds.reduce_scatter_tensor(ours, x, ds.ReduceOp.SUM)
    out["reduce_scatter_tensor"] = (ours, x)
    ours = x.clone()
    ds.broadcast(ours, 0)
    out["broadcast"] = (ours, x)
    ours, theirs = torch.zeros(3, 4), torch.zeros(3, 4)
    ds.all_to_all_single(ours, x)
    dist.all_to_all_single(theirs, x)
    out["all_to_all_single"] = (ours, theirs)
    out["barrier"] = (ds.barrier(async_op=True).wait(), True)
    return out


def test_one_process_collectives_are_torchs_with_no_ledger_entry(plain):
    ds.init_distributed()
    with ledger.capture() as cap:
        cases = _one_process_cases()
    assert len(cases) == 12
    for case, (ours, theirs) in cases.items():
        if isinstance(ours, list):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), case
        elif isinstance(ours, torch.Tensor):
            assert torch.equal(ours, theirs), case
        else:
            assert ours == theirs, case
    assert cap.entries == []


def test_zerotrons_layers_with_a_group_of_one(plain):
    ds.init_distributed()
    s = state()
    assert (s.world_size, s.dp_size, s.world.size, s.dp.pg) == (1, 1, 1, None)
    initialize_model_parallel(1, 1)
    with ledger.capture() as cap:
        t = torch.ones(4)
        comm.all_reduce(t, state().dp)
        comm.barrier()
        comm.broadcast(t, state().world)
    assert cap.entries == [] and torch.equal(t, torch.ones(4))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: ds.get_rank(), "no process group exists"),
        (lambda: ds.all_reduce(torch.ones(1)), "no process group exists"),
        (lambda: ds.init_distributed(dist_init_required=False), "dist_init_required=False"),
        (lambda: ds.init_distributed(init_method="tcp://10.0.0.1:23456"), "init_method"),
    ],
)
def test_without_a_group_the_error_says_what_to_do(plain, call, message):
    with pytest.raises(DistributedError, match=message):
        call()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: ds.all_reduce(torch.ones(1), ds.ReduceOp.UNUSED), "unsupported reduce op"),
        (lambda: ds.all_reduce(torch.ones(1), dist.ReduceOp.PREMUL_SUM), "unsupported reduce"),
        (lambda: ds.recv(torch.ones(1)), "from any source is not supported"),
        (lambda: ds.send(torch.ones(1), 0), "not another rank"),
        (lambda: ds.all_gather([torch.ones(1)] * 2, torch.ones(1)), "list of 2 tensors"),
        (lambda: ds.broadcast(torch.ones(1), 1), "rank 1, which is not in the group"),
        (lambda: ds.reduce(torch.ones(1), 1), "reduce rooted at rank 1"),
        (lambda: ds.gather(torch.ones(1), None, dst=0), "gather on rank 0 into no list"),
        (lambda: ds.scatter(torch.ones(1), None, src=0), "without one part per member"),
        (lambda: ds.reduce_scatter(torch.ones(1), [torch.ones(2)]), "sizes \\[2\\] into 1"),
        (lambda: ds.all_to_all([torch.ones(1)] * 2, [torch.ones(1)]), "2 output tensors"),
        (
            lambda: ds.all_reduce_coalesced([torch.ones(1), torch.ones(1, dtype=torch.int64)]),
            "several dtypes",
        ),
        (lambda: ds.P2POp(ds.all_reduce, torch.ones(1), 0), "P2POp with op"),
        (lambda: ds.P2POp(ds.isend, torch.ones(1), 0, tag=2), "P2POp with tag 2"),
    ],
)
def test_wrong_arguments_are_named(plain, call, message):
    ds.init_distributed()
    with pytest.raises(DistributedError, match=message):
        call()


def test_torch_backend_gives_deepspeed_comms_functions_and_is_not_built():
    assert ds.TorchBackend.get_all_gather_function() is ds.all_gather_into_tensor
    assert ds.TorchBackend.get_reduce_scatter_function() is ds.reduce_scatter_tensor
    assert ds.TorchBackend.has_all_gather_into_tensor()
    import zerotron.comm.torch

    assert zerotron.comm.torch.TorchBackend is ds.TorchBackend
    with pytest.raises(UnsupportedError, match="zerotron's comm layer takes their place"):
        ds.TorchBackend("gloo", timedelta(minutes=1), "env://")
