"""Pipeline parallelism: schedules as data, the runtime that runs them, partitioning, timelines.

    from zerotron.pipeline import bubble, build_schedule, draw, theoretical_bubble
    s = build_schedule("interleaved", 4, 8, 2)          # p=4 stages, m=8 micro-batches, v=2
    bubble(s), theoretical_bubble(4, 8, 2)              # measured vs (p - 1) / (v * m)
    draw(s, "schedule.png")                             # as `zerotron schedule` draws it

- :mod:`~zerotron.pipeline.schedules`: actions and the GPipe, 1F1B and interleaved
  1F1B schedules, pure functions ``(p, m, v) -> per-stage action lists``.
- :mod:`~zerotron.pipeline.simulator`: runs a schedule without processes (blocking,
  FIFO-matched p2p): deadlock and validity check, per-stage timeline.
- :mod:`~zerotron.pipeline.check`: the check every runtime runs before its first step: sends
  and receives match pairwise, in order, between stages, and nothing deadlocks.
- :mod:`~zerotron.pipeline.timeline`: the bubble (measured vs (p-1)/(v·m)), the
  timeline picture, and ``zerotron schedule``.
- :mod:`~zerotron.pipeline.measured`: the runtime's recorded actions back as a schedule and
  as a measured timeline (drawn and measured like a simulated one).
- :mod:`~zerotron.pipeline.profile`: ``--profile-steps A:B``: record those steps on every rank,
  write the Chrome trace, the measured timeline picture and the bubble.
- :mod:`~zerotron.pipeline.partition`: which layers each (virtual) stage holds.
- :mod:`~zerotron.pipeline.runtime`: :class:`PipelineRuntime`, which executes a
  stage's actions on the pipeline group (batched p2p whose sends drain in the background,
  shape headers at the first step, freed sent outputs).

The pipeline knows no model: a stage's model chunk is any module following the runtime's chunk
protocol (see :mod:`~zerotron.pipeline.runtime`). DeepSpeed's ``PipelineModule`` API is
:mod:`zerotron.compat.pipe` (``zerotron.pipe``).
"""

from zerotron.pipeline.check import check_pairwise, check_schedule
from zerotron.pipeline.partition import (
    partition_balanced,
    partition_uniform,
    stage_layers,
    virtual_stages_from_layers,
)
from zerotron.pipeline.runtime import (
    HEADER_BYTES,
    PipelineRuntime,
    masked_mean_loss,
)
from zerotron.pipeline.schedules import (
    SCHEDULES,
    Action,
    Backward,
    CommBatch,
    Forward,
    P2POp,
    RecvActivation,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendActivation,
    SendGrad,
    activations_in_flight,
    build_schedule,
    comm_ops,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    schedule_shape,
    stage_and_chunk,
    virtual_stage,
)
from zerotron.pipeline.simulator import Event, Timeline, simulate
from zerotron.pipeline.timeline import (
    BubbleReport,
    bubble,
    draw,
    idle_fraction,
    measure,
    theoretical_bubble,
)

__all__ = [
    "Action",
    "Backward",
    "BubbleReport",
    "CommBatch",
    "Event",
    "Forward",
    "HEADER_BYTES",
    "P2POp",
    "PipelineRuntime",
    "RecvActivation",
    "RecvGrad",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "Timeline",
    "activations_in_flight",
    "bubble",
    "build_schedule",
    "check_pairwise",
    "check_schedule",
    "comm_ops",
    "draw",
    "format_schedule",
    "gpipe",
    "idle_fraction",
    "interleaved_1f1b",
    "masked_mean_loss",
    "measure",
    "one_f_one_b",
    "partition_balanced",
    "partition_uniform",
    "schedule_shape",
    "simulate",
    "stage_and_chunk",
    "stage_layers",
    "theoretical_bubble",
    "virtual_stage",
    "virtual_stages_from_layers",
]
