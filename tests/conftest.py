"""Shared test setup: one thread per test process (pytest-xdist runs two on CI's two cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUSTEN = os.path.join(REPO, "data", "austen.jsonl")


@pytest.fixture
def austen_path() -> str:
    return AUSTEN
