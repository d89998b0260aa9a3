"""Pipeline parallelism: schedules as data, their simulator and bubble, stage partitioning.

- :mod:`~zerotron.parallel.pipeline.schedules`: actions and the GPipe, 1F1B and interleaved
  1F1B schedules, pure functions ``(p, m, v) -> per-stage action lists``.
- :mod:`~zerotron.parallel.pipeline.simulator`: runs a schedule without processes (blocking,
  FIFO-matched p2p): deadlock and validity check, per-stage timeline.
- :mod:`~zerotron.parallel.pipeline.timeline`: the bubble (measured vs (p-1)/(v·m)), the
  timeline picture, and ``zerotron schedule``.
- :mod:`~zerotron.parallel.pipeline.partition`: which layers each (virtual) stage holds.
- :mod:`~zerotron.parallel.pipeline.runtime`: :class:`PipelineRuntime`, which executes a
  stage's actions on the pipeline group (batched p2p, shape headers, freed sent outputs).
"""

from zerotron.parallel.pipeline.partition import (
    partition_balanced,
    partition_uniform,
    stage_layers,
    virtual_stages_from_layers,
)
from zerotron.parallel.pipeline.runtime import (
    HEADER_BYTES,
    PipelineRuntime,
    masked_mean_loss,
)
from zerotron.parallel.pipeline.schedules import (
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
from zerotron.parallel.pipeline.simulator import Event, Timeline, simulate
from zerotron.parallel.pipeline.timeline import (
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
