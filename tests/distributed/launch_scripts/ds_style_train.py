"""A DeepSpeed training script written the way DeepSpeed users write them, with only its imports
changed (``import deepspeed`` -> ``import zerotron as deepspeed``, ``from deepspeed.X`` ->
``from zerotron.X``). Worker for tests/distributed/test_ds_style_script.py.

It touches the DeepSpeed surface a script meets — comm, accelerator, utils, ops, runtime,
zero.Init, the engine's attributes, checkpoints, zero_to_fp32, 16-bit saving — and asserts what
each answer means as it goes (an AssertionError fails the run). Every rank seeds torch with its
own rank before building the model, as careless scripts do: initialize()/zero.Init broadcast
rank 0's weights. The global batch is the same for every world size (8 samples: micro-batch 4,
accumulation 8 / (4 x world)), so every run trains the same model; rank 0 writes the final fp32
weights (read back with zero_to_fp32) to ``--out``.
"""

import argparse
import logging
import os

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils.data import TensorDataset

import zerotron as deepspeed
import zerotron.comm as dist
from zerotron.accelerator import get_accelerator
from zerotron.compression.helper import recursive_getattr, recursive_setattr
from zerotron.moe.layer import MoE  # noqa: F401  (an optional MoE path imports it)
from zerotron.ops.adagrad import DeepSpeedCPUAdagrad
from zerotron.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerotron.ops.lion import DeepSpeedCPULion, FusedLion
from zerotron.runtime.engine import DeepSpeedEngine
from zerotron.runtime.lr_schedules import VALID_LR_SCHEDULES
from zerotron.runtime.utils import set_random_seed
from zerotron.runtime.zero.partition_parameters import ZeroParamStatus
from zerotron.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zerotron.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
from zerotron.utils import (
    RepeatingLoader,
    groups,
    log_dist,
    logger,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    set_z3_leaf_modules,
)
from zerotron.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

VOCAB, WIDTH, SEQ, SAMPLES, MICRO, GLOBAL = 50, 16, 6, 32, 4, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Linear(32, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.tag = "net"  # read through the engine

    def forward(self, x, y):
        h = self.body(self.embed(x)).mean(1)
        return nn.functional.cross_entropy(self.head(h), y)


def check_comm(rank: int, world: int) -> None:
    """deepspeed.comm as scripts use it; torch.distributed works beside it."""
    assert dist.is_initialized() and torch_dist.is_initialized()
    assert torch_dist.get_rank() == rank and torch_dist.get_world_size() == world
    assert dist.get_local_rank() == int(os.environ.get("LOCAL_RANK", "0"))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    assert t.item() == world * (world + 1) / 2
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)  # torch's enum is accepted too
    assert t.item() == world - 1
    out = torch.empty(world * 2)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, torch.ones(2 * world))
    assert shard.tolist() == [float(world)] * 2
    b = torch.tensor([7.0]) if rank == 0 else torch.zeros(1)
    dist.broadcast(b, src=0)
    assert b.item() == 7.0
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.full((world,), float(rank)))
    assert a2a.tolist() == [float(r) for r in range(world)]
    group = dist.new_group(list(range(world)))
    assert dist.get_global_rank(group, 0) == 0 and dist.get_world_size(group) == world
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    if world == 2:
        if rank == 0:
            dist.send(torch.tensor([3.0]), dst=1)
            dist.isend(torch.tensor([4.0]), dst=1).wait()
        else:
            got = torch.zeros(1)
            dist.recv(got, src=0)
            again = torch.zeros(1)
            dist.irecv(again, src=0).wait()
            assert (got.item(), again.item()) == (3.0, 4.0)
    dist.barrier()


def check_accelerator() -> torch.device:
    acc = deepspeed.get_accelerator()
    assert acc is get_accelerator() and acc.is_available()
    assert acc.communication_backend_name() == ("nccl" if acc.device_name() == "cuda" else "gloo")
    acc.set_device(acc.current_device())
    assert acc.device_count() >= 1
    acc.manual_seed(5)
    acc.synchronize()
    acc.empty_cache()
    assert acc.memory_allocated() >= 0 and acc.total_memory() > 0
    assert acc.is_fp16_supported() in (True, False) and acc.is_bf16_supported() in (True, False)
    pinned = acc.pin_memory(torch.ones(3))
    assert torch.equal(pinned, torch.ones(3))
    return torch.device(acc.current_device_name())


def config_for(args: argparse.Namespace, world: int) -> dict:
    zero: dict = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if args.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


def client_optimizer(name: str, model: nn.Module):
    """None (the config's Adam), or DeepSpeed's ops: the same AdamW math."""
    if name == "cpu_adam":
        return DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01, adamw_mode=True)
    if name == "fused_adam":
        return FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, adam_w_mode=True)
    return None


def check_ops() -> None:
    """DeepSpeed's other optimizers step a parameter like any torch optimizer."""
    for cls in (DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion):
        p = nn.Parameter(torch.ones(4))
        opt = cls([p], lr=0.1)
        p.grad = torch.full((4,), 0.5)
        opt.step()
        assert (p.detach() < 1).all(), cls.__name__


def full_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole fp32 value (a collective: every rank calls it)."""
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--optimizer", choices=["config", "cpu_adam", "fused_adam"])
    parser.add_argument("--backward", choices=["engine", "loss"], default="engine")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--zero-init", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    set_random_seed(1234)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    check_comm(rank, world)
    device = check_accelerator()
    assert "WarmupLR" in VALID_LR_SCHEDULES
    check_ops()

    config = config_for(args, world)
    torch.manual_seed(100 + rank)  # each rank builds a different model: rank 0's must win
    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Net()
        p = model.body[0].weight
        assert hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
        assert tuple(p.ds_shape) == (32, WIDTH) and p.ds_numel == 32 * WIDTH
        with deepspeed.zero.GatheredParameters([p]):
            assert p.shape == (32, WIDTH) and p.ds_status == ZeroParamStatus.AVAILABLE
    else:
        model = Net()
    assert recursive_getattr(model, "body.0") is model.body[0]
    recursive_setattr(model, "body.1", nn.GELU())
    total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    if rank == 0:
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=world)
        estimate_zero3_model_states_mem_needs_all_cold(total, WIDTH * VOCAB, world)
        if not args.zero_init:
            estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=world)
            estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=world)
    if args.stage == 3:
        set_z3_leaf_modules(model, [nn.Sequential])  # body gathers as one

    g = torch.Generator().manual_seed(0)  # the same data everywhere
    data = TensorDataset(
        torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g),
        torch.randint(0, VOCAB, (SAMPLES,), generator=g),
    )
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=model.parameters(),
        optimizer=client_optimizer(args.optimizer, model),
        training_data=data,
        config=config,
    )
    gas = GLOBAL // (MICRO * world)
    assert isinstance(engine, DeepSpeedEngine) and isinstance(engine, nn.Module)
    assert engine.module is model and engine.tag == "net"  # falls through to the model
    assert (engine.global_rank, engine.world_size, engine.dp_world_size) == (rank, world, world)
    assert engine.local_rank == dist.get_local_rank() and engine.device == device
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.zero_optimization_stage() == args.stage
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (GLOBAL, gas)
    assert groups._get_data_parallel_world_size() == world
    assert engine.config["gradient_accumulation_steps"] == gas  # "auto", resolved

    start = full_weights(engine)  # every rank holds rank 0's model now
    for name, value in start.items():
        seen = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(seen, value)
        assert all(torch.equal(s, value) for s in seen), f"{name} differs between ranks"

    batches = iter(RepeatingLoader(loader))
    for step in range(1, args.steps + 1):
        for micro in range(gas):
            x, y = next(batches)
            engine.set_gradient_accumulation_boundary(micro == gas - 1)  # as accelerate does
            assert engine.is_gradient_accumulation_boundary() == (micro == gas - 1)
            loss = engine(x.to(engine.device), y.to(engine.device))
            if args.backward == "loss":
                loss.backward()
            else:
                engine.backward(loss)
            if micro == gas - 1:  # the reduced gradient, before the step frees it
                grad = safe_get_full_grad(engine.module.head.weight)
                assert grad is not None and grad.shape == (VOCAB, WIDTH) and grad.abs().sum() > 0
            engine.step()
        assert engine.was_step_applied() and engine.global_steps == step
        assert engine.get_global_grad_norm() > 0
        log_dist(f"step {step} loss {loss.item():.6f}", ranks=[0], level=logging.WARNING)
    exp_avg = safe_get_full_optimizer_state(engine.module.head.weight, "exp_avg")
    assert exp_avg.shape == (VOCAB, WIDTH) and exp_avg.abs().sum() > 0
    assert engine.tput_timer.avg_samples_per_sec() > 0
    logger.info("trained %d steps", args.steps)

    trained = full_weights(engine)
    engine.save_checkpoint(
        args.save_dir, client_state={"step": args.steps}, exclude_frozen_parameters=False
    )
    # A round trip through a changed weight and state and back: the checkpoint restores them.
    head = engine.module.head.weight
    safe_set_full_fp32_param(head, torch.zeros_like(trained["head.weight"]))
    assert safe_get_full_fp32_param(head).abs().sum() == 0
    safe_set_full_optimizer_state(head, torch.ones_like(exp_avg), "exp_avg")
    assert torch.equal(safe_get_full_optimizer_state(head, "exp_avg"), torch.ones_like(exp_avg))
    path, client = engine.load_checkpoint(
        args.save_dir, load_module_strict=True, load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )  # fmt: skip
    assert path is not None and client["step"] == args.steps
    reloaded = full_weights(engine)
    assert all(torch.equal(reloaded[n], trained[n]) for n in trained)
    assert torch.equal(safe_get_full_optimizer_state(head, "exp_avg"), exp_avg)
    assert engine.zero_gather_16bit_weights_on_model_save() == (args.stage == 3)
    if args.stage == 3:  # a collective; DeepSpeed refuses it below stage 3 too
        consolidated = engine._zero3_consolidated_16bit_state_dict()
        assert set(consolidated) == set(trained) if rank == 0 else consolidated is None
    assert engine.save_16bit_model(args.save_dir, "model16.bin")
    dist.barrier()

    if rank == 0:
        if args.stage > 0:  # zero_to_fp32 reads ZeRO partitions (stage 0 saves whole weights)
            fp32 = get_fp32_state_dict_from_zero_checkpoint(args.save_dir)
            assert set(fp32) == set(trained)
            assert all(torch.equal(fp32[n], trained[n]) for n in trained)
            fresh = load_state_dict_from_zero_checkpoint(Net(), args.save_dir)
            assert torch.equal(fresh.head.weight, trained["head.weight"])
            out_dir = os.path.join(args.save_dir, "hf")
            convert_zero_checkpoint_to_fp32_state_dict(args.save_dir, out_dir)
            saved = torch.load(os.path.join(out_dir, "pytorch_model.bin"), weights_only=True)
            assert all(torch.equal(saved[n], trained[n]) for n in trained)
        assert os.path.isfile(os.path.join(args.save_dir, "model16.bin"))
        torch.save(trained, args.out)
    engine.destroy()


if __name__ == "__main__":
    main()
