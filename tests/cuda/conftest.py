"""tests/cuda: the essential checks on a CUDA device, run by ``make test-gpu`` only.

``make test`` never collects this directory (tests/conftest.py leaves it out unless
``ZEROTRON_GPU_TESTS=1``, which ``make test-gpu`` sets). Without a CUDA device the run fails
with a message saying so instead of skipping: a green ``make test-gpu`` means the checks ran on
a GPU. ``ZEROTRON_CUDA_TESTS_ON_CPU=1`` runs the same tests on the CPU (gloo instead of nccl,
the CPU's fast paths switched off so that the plain kernels run as they do on CUDA): that
checks the tests themselves on a machine without a GPU, nothing about CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("ZEROTRON_CUDA_TESTS_ON_CPU") == "1"

if ON_CPU:
    # The CPU's fast paths off (kernels/policy.py's switches): the plain path CUDA takes.
    from zerotron.kernels.policy import ENV_SWITCHES

    for _env in ENV_SWITCHES.values():
        os.environ[_env] = "0"


def pytest_collection_modifyitems(config, items) -> None:
    if ON_CPU or torch.cuda.is_available():
        return
    raise pytest.UsageError(
        "tests/cuda need a CUDA device, and torch.cuda.is_available() is False here "
        f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'no: a CPU build'}). "
        "Run `make test-gpu` on a machine with an NVIDIA GPU and a CUDA build of torch; "
        "ZEROTRON_CUDA_TESTS_ON_CPU=1 runs these tests on the CPU to check the tests alone."
    )


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device under test: this process's GPU (the CPU under ZEROTRON_CUDA_TESTS_ON_CPU)."""
    if ON_CPU:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def backend() -> str:
    """The process-group backend for tensors on :func:`device`."""
    return "gloo" if ON_CPU else "nccl"
