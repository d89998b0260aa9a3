"""docs/deepspeed.md stays true: every DeepSpeed name its tables mark *supported* or *different*
is importable from zerotron under the same path (``deepspeed.a.b.c`` is ``zerotron.a.b.c``), and
every *refused* row says why and is the table behind the refusal errors. And every DeepSpeed
name the training scripts of DeepSpeed's own examples use is served or refused with a reason:
the names are tests/fixtures/deepspeed/examples_census.json, which make_examples_census.py beside
it reads out of a DeepSpeedExamples checkout (``training/``, ``applications/DeepSpeed-Chat/``,
``benchmarks/communication/``; its commit is in the file).

A table row is ``| `deepspeed.x.y`, `deepspeed.x.z` | status | how or why |``: the first cell's
backticked names, the status one of the three words.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from zerotron.config.deepspeed_refused import REFUSED, refusal

DOC = Path(__file__).resolve().parent.parent / "docs" / "deepspeed.md"
CENSUS = json.loads(
    (Path(__file__).parent / "fixtures" / "deepspeed" / "examples_census.json").read_text()
)
ROW = re.compile(r"^\|\s*(?P<names>`deepspeed[^|]*)\|\s*(?P<status>[a-z]+)\s*\|(?P<note>[^|]*)\|")
STATUSES = ("supported", "different", "refused")


def _rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            for name in re.findall(r"`(deepspeed(?:\.\w+)*)`", m["names"]):
                rows.append((name, m["status"], m["note"].strip()))
    return rows


ROWS = _rows()


def resolve(name: str) -> object:
    """The zerotron object at DeepSpeed's path ``name`` (the longest importable module prefix,
    then attributes)."""
    parts = ["zerotron", *name.split(".")[1:]]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_doc_has_a_row_for_each_area_and_only_known_statuses():
    assert len(ROWS) > 100
    assert {status for _, status, _ in ROWS} == set(STATUSES)
    areas = {name.split(".")[1] for name, _, _ in ROWS if "." in name}
    for area in ("comm", "accelerator", "utils", "ops", "runtime", "zero", "pipe", "moe"):
        assert area in areas


@pytest.mark.parametrize("name", sorted({n for n, s, _ in ROWS if s in ("supported", "different")}))
def test_a_supported_name_is_importable_from_zerotron(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("name", sorted({n for n, s, _ in ROWS if s == "refused"}))
def test_a_refused_name_says_why(name):
    notes = [note for n, s, note in ROWS if n == name and s == "refused"]
    assert all(len(note) > 20 for note in notes), notes


def test_refused_rows_are_the_table_behind_the_errors():
    rows = {(name, note) for name, status, note in ROWS if status == "refused"}
    assert rows == set(REFUSED.items())


def test_the_census_covers_the_examples():
    assert CENSUS["source"].startswith("deepspeedai/DeepSpeedExamples@")
    assert len(CENSUS["names"]) > 50 and "deepspeed.initialize" in CENSUS["names"]


def _served(name: str) -> bool:
    try:
        resolve(name)
    except (AttributeError, ModuleNotFoundError):
        return False
    return True


@pytest.mark.parametrize("name", sorted(CENSUS["names"]))
def test_each_name_the_examples_use_is_served_or_refused_with_a_reason(name):
    assert _served(name) or refusal(name) is not None, (name, CENSUS["names"][name][:3])
