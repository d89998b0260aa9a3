"""``zerotron.pipeline``: the public pipeline-schedule API under the name the docs use.

The implementation lives in :mod:`zerotron.parallel.pipeline` (schedules as data, simulator,
bubble and timeline picture, partitioning, runtime); this module only re-exports what a user
reaches for: build a schedule, measure its bubble, draw it.

    from zerotron.pipeline import bubble, build_schedule, draw, theoretical_bubble
    s = build_schedule("interleaved", 4, 8, 2)          # p=4 stages, m=8 micro-batches, v=2
    bubble(s), theoretical_bubble(4, 8, 2)              # measured vs (p - 1) / (v * m)
    draw(s, "schedule.png")                             # as `zerotron schedule` draws it

(Not to be confused with :mod:`zerotron.pipe`, DeepSpeed's ``PipelineModule`` API.)
"""

from zerotron.parallel.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    activations_in_flight,
    build_schedule,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)
from zerotron.parallel.pipeline.simulator import simulate
from zerotron.parallel.pipeline.timeline import (
    BubbleReport,
    bubble,
    draw,
    idle_fraction,
    measure,
    theoretical_bubble,
)

__all__ = [
    "SCHEDULES",
    "BubbleReport",
    "Schedule",
    "ScheduleError",
    "activations_in_flight",
    "bubble",
    "build_schedule",
    "draw",
    "format_schedule",
    "gpipe",
    "idle_fraction",
    "interleaved_1f1b",
    "measure",
    "one_f_one_b",
    "simulate",
    "theoretical_bubble",
]
