"""The schedule check a pipeline runs before any process waits (zerotron.pipeline.check).

Pure functions on the action lists: every schedule passes on a small (p, m, v) grid, including
p >= 4 with fewer micro-batches than stages; broken schedules (messages out of order, one
missing, a cycle of blocking waits) are errors naming the stages; the interleaved schedule with
fewer micro-batches than stages is refused with what to use instead.
"""

import pytest

from zerotron.errors import ConfigError
from zerotron.pipeline import (
    Backward,
    CommBatch,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    build_schedule,
    check_pairwise,
    check_schedule,
    one_f_one_b,
)

GRID = [
    (kind, p, m, v)
    for p in range(1, 6)
    for m in range(1, 7)
    for kind, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3]))
    for v in vs
    if kind != "interleaved" or (p > 1 and m % p == 0)
]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_every_schedule_on_a_small_grid_passes(kind):
    configs = [c for c in GRID if c[0] == kind]
    assert configs
    for _, p, m, v in configs:
        check_schedule(build_schedule(kind, p, m, v))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_four_stages_with_fewer_micro_batches_pass(kind):
    for p, m in ((4, 1), (4, 2), (4, 3), (5, 2)):
        check_schedule(build_schedule(kind, p, m))


def test_interleaved_with_fewer_micro_batches_than_stages_says_what_to_use():
    with pytest.raises(ConfigError) as info:
        build_schedule("interleaved", 4, 2, 2)
    text = str(info.value)
    assert "micro-batches (2) to be divisible by the pipeline-parallel size (4)" in text
    assert "use 4 micro-batches" in text


def _swap(schedule, stage, i, j):
    out = [list(actions) for actions in schedule]
    out[stage][i], out[stage][j] = out[stage][j], out[stage][i]
    return out


def test_sends_out_of_order_are_caught_before_running():
    good = one_f_one_b(2, 2)
    # Stage 0's actions: F0, send act 0, F1, send act 1, ...: send act 1 first.
    assert str(good[0][1]) == "send act 0.0 -> 1" and str(good[0][3]) == "send act 1.0 -> 1"
    bad = _swap(good, 0, 1, 3)
    with pytest.raises(ScheduleError) as info:
        check_pairwise(bad)
    assert str(info.value).startswith(
        "message 1 from stage 0 to stage 1 does not match: stage 0 sends 'send act 1.0 -> 1' "
        "where stage 1 receives 'recv act 0.0 <- 0'"
    )


def test_a_missing_receive_is_caught():
    good = one_f_one_b(2, 2)
    bad = [list(good[0]), [a for a in good[1] if str(a) != "recv act 1.0 <- 0"]]
    assert len(bad[1]) == len(good[1]) - 1
    with pytest.raises(ScheduleError, match=r"stage 0 posts 2 sends to stage 1, which posts 1 "
                       r"receives from it: the last 1 sends have no match"):  # fmt: skip
        check_pairwise(bad)


def test_a_gradient_received_as_an_activation_is_caught():
    bad = [
        [Forward(0), SendActivation(1, 0), RecvGrad(1, 0), Backward(0)],
        [RecvActivation(0, 0), Forward(0), Backward(0), CommBatch((SendActivation(0, 0),))],
    ]
    with pytest.raises(ScheduleError, match="from stage 1 to stage 0 does not match"):
        check_pairwise(bad)


def test_a_peer_outside_the_pipeline_is_caught():
    with pytest.raises(ScheduleError, match="names stage 2, not another of 0..1"):
        check_pairwise([[Forward(0), SendActivation(2, 0), Backward(0)], [Forward(0)]])


def test_matching_messages_that_wait_on_each_other_are_a_deadlock():
    # Each channel matches in order, but both stages receive before they send.
    cycle = [
        [Forward(0), RecvGrad(1, 0), SendActivation(1, 0), Backward(0)],
        [RecvActivation(0, 0), Forward(0), Backward(0), SendGrad(0, 0)],
    ]
    check_pairwise(cycle)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(cycle)


def test_the_runtime_checks_its_schedule_before_its_first_step(monkeypatch):
    from torch import nn

    from zerotron.pipeline import PipelineRuntime, runtime

    bad = _swap(one_f_one_b(2, 2), 0, 1, 3)
    monkeypatch.setattr(runtime, "build_schedule", lambda *args: bad)
    with pytest.raises(ScheduleError, match="message 1 from stage 0 to stage 1 does not match"):
        PipelineRuntime([nn.Linear(2, 2)], "1f1b", 2)
