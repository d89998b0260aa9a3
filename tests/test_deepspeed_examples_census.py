"""Every DeepSpeed name that the training scripts of DeepSpeed's own examples use is served by
zerotron or refused with a reason (docs/deepspeed.md; ``zerotron.config.deepspeed_refused``).

The names come from tests/fixtures/deepspeed/examples_census.json, which
make_examples_census.py beside it reads out of a DeepSpeedExamples checkout (its commit is in
the file): ``training/``, ``applications/DeepSpeed-Chat/``, ``benchmarks/communication/``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from zerotron.config.deepspeed_refused import refusal

CENSUS = json.loads(
    (Path(__file__).parent / "fixtures" / "deepspeed" / "examples_census.json").read_text()
)


def served(name: str) -> bool:
    """Whether ``deepspeed.a.b`` is there as ``zerotron.a.b`` (a module, or attributes of the
    longest importable module prefix)."""
    parts = ["zerotron", *name.split(".")[1:]]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_the_census_covers_the_examples():
    assert CENSUS["source"].startswith("deepspeedai/DeepSpeedExamples@")
    assert len(CENSUS["names"]) > 50
    assert "deepspeed.initialize" in CENSUS["names"]


@pytest.mark.parametrize("name", sorted(CENSUS["names"]))
def test_each_name_is_served_or_refused_with_a_reason(name):
    assert served(name) or refusal(name) is not None, (name, CENSUS["names"][name][:3])
