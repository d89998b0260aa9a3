"""``zerotron.pipeline``: the pipeline-schedule API at its one home exports the real objects."""

from __future__ import annotations

import zerotron.pipeline as public
from zerotron.pipeline import bubble, build_schedule, theoretical_bubble


def test_bubble_from_zerotron_pipeline():
    # 1F1B and interleaved with unit F/B costs match (p - 1) / (v * m) exactly.
    assert bubble("1f1b", 4, 8) == theoretical_bubble(4, 8) == 3 / 8
    assert bubble(build_schedule("interleaved", 4, 8, 2)) == theoretical_bubble(4, 8, 2) == 3 / 16
    assert bubble("gpipe", 2, 4) == 1 / 4


def test_everything_exported_is_the_real_object():
    # The package re-exports its submodules' objects (schedules, simulator, timeline, ...).
    import zerotron.pipeline.check
    import zerotron.pipeline.partition
    import zerotron.pipeline.runtime
    import zerotron.pipeline.schedules
    import zerotron.pipeline.simulator
    import zerotron.pipeline.timeline

    homes = [
        zerotron.pipeline.check,
        zerotron.pipeline.partition,
        zerotron.pipeline.runtime,
        zerotron.pipeline.schedules,
        zerotron.pipeline.simulator,
        zerotron.pipeline.timeline,
    ]
    for name in public.__all__:
        assert any(getattr(m, name, None) is getattr(public, name) for m in homes), name
