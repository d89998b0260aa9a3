"""``zerotron.pipeline``: the public name of the pipeline-schedule API re-exports the real one."""

from __future__ import annotations

import zerotron.parallel.pipeline as real
import zerotron.pipeline as public
from zerotron.pipeline import bubble, build_schedule, theoretical_bubble


def test_bubble_from_zerotron_pipeline():
    # 1F1B and interleaved with unit F/B costs match (p - 1) / (v * m) exactly.
    assert bubble("1f1b", 4, 8) == theoretical_bubble(4, 8) == 3 / 8
    assert bubble(build_schedule("interleaved", 4, 8, 2)) == theoretical_bubble(4, 8, 2) == 3 / 16
    assert bubble("gpipe", 2, 4) == 1 / 4


def test_everything_exported_is_the_real_object():
    for name in public.__all__:
        assert getattr(public, name) is getattr(real, name), name
