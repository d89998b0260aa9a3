"""DeepSpeed's printed tables of model-states memory (the numbers are
:mod:`zerotron.tuning.zero_memory`'s); ``stage_1_and_2`` and ``stage3`` print with these."""

from __future__ import annotations

from zerotron.tuning.zero_memory import MemoryEstimate

GiB = 2**30


def header(num_nodes: int, num_gpus_per_node: int, model_line: str) -> str:
    """The hardware and model lines and the table's column titles."""
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"SW: Model with {model_line}\n"
        "  per CPU  |  per GPU |   Options"
    )


def row(estimate: MemoryEstimate, options: dict[str, str]) -> str:
    """One table row: GiB per CPU and per GPU, and the options it assumes."""
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    return f" {estimate.cpu_bytes / GiB:7.2f}GB | {estimate.gpu_bytes / GiB:6.2f}GB | {opts}"


def device(offloaded: bool) -> str:
    """An offload option's value as DeepSpeed's table shows it (``cpu`` padded to 4)."""
    return f"{'cpu':4}" if offloaded else "none"
