"""Pipeline schedules checked on the data alone: no processes, no torch.

The sweep covers every valid (kind, p, m, v) with p <= 8, m <= 32, v <= 4. Each property is
checked directly on the action lists; the simulator (blocking, FIFO-matched p2p) adds the
deadlock check and the timings the bubble is measured on.
"""

import collections
import dataclasses
import functools
import itertools
import os
import random

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
    activations_in_flight,
    bubble,
    build_schedule,
    comm_ops,
    draw,
    idle_fraction,
    interleaved_1f1b,
    measure,
    one_f_one_b,
    partition_balanced,
    partition_uniform,
    simulate,
    stage_and_chunk,
    stage_layers,
    theoretical_bubble,
    virtual_stage,
    virtual_stages_from_layers,
)
from zerotron.pipeline.timeline import main as schedule_main

CONFIGS = [
    (kind, p, m, v)
    for p in range(1, 9)
    for m in range(1, 33)
    for kind, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3, 4]))
    for v in vs
    if kind != "interleaved" or (p > 1 and m % p == 0)
]


@functools.cache
def schedule_of(kind, p, m, v):
    return build_schedule(kind, p, m, v)


@functools.cache
def timeline_of(kind, p, m, v):
    return simulate(schedule_of(kind, p, m, v), 1, 2)


def test_sweep_size():
    # gpipe + 1f1b for every (p, m), interleaved where m % p == 0 and p > 1.
    assert len(CONFIGS) == 2 * 8 * 32 + 3 * sum(32 // p for p in range(2, 9))


def computes(stage_actions):
    return [a for a in stage_actions if isinstance(a, (Forward, Backward))]


def all_ops(stage_actions):
    """The stage's p2p ops in posting order (a batch's ops in their listed order)."""
    return [op for a in stage_actions for op in comm_ops(a)]


def test_each_forward_and_backward_exactly_once_forward_first():
    for kind, p, m, v in CONFIGS:
        want = sorted((mb, c) for mb in range(m) for c in range(v))
        for actions in schedule_of(kind, p, m, v):
            done = computes(actions)
            fwd = [(a.mb, a.chunk) for a in done if isinstance(a, Forward)]
            bwd = [(a.mb, a.chunk) for a in done if isinstance(a, Backward)]
            assert sorted(fwd) == want and sorted(bwd) == want, (kind, p, m, v)
            position = {(type(a), a.mb, a.chunk): i for i, a in enumerate(done)}
            assert all(position[(Forward, *k)] < position[(Backward, *k)] for k in want)


def message(op, stage, p):
    """(kind, mb, sending virtual stage, receiving virtual stage) of a p2p op."""
    vs = virtual_stage(stage, op.chunk, p)
    if isinstance(op, SendActivation):
        return ("act", op.mb, vs, vs + 1)
    if isinstance(op, RecvActivation):
        return ("act", op.mb, vs - 1, vs)
    if isinstance(op, SendGrad):
        return ("grad", op.mb, vs, vs - 1)
    return ("grad", op.mb, vs + 1, vs)


def test_every_send_has_its_receive_in_the_same_order():
    for kind, p, m, v in CONFIGS:
        schedule = schedule_of(kind, p, m, v)
        last = p * v - 1
        expected = {("act", mb, vs, vs + 1) for mb in range(m) for vs in range(last)}
        expected |= {("grad", mb, vs, vs - 1) for mb in range(m) for vs in range(1, last + 1)}
        sent, received = collections.defaultdict(list), collections.defaultdict(list)
        for stage, actions in enumerate(schedule):
            for op in all_ops(actions):
                msg = message(op, stage, p)
                # The peer is the stage holding the other end.
                other = msg[3] if isinstance(op, (SendActivation, SendGrad)) else msg[2]
                assert op.peer == other % p, (kind, p, m, v, stage, op)
                if isinstance(op, (SendActivation, SendGrad)):
                    sent[stage, op.peer].append(msg)
                else:
                    received[op.peer, stage].append(msg)
        assert sorted(m for ms in sent.values() for m in ms) == sorted(expected)
        # Messages between two stages are matched first in, first out: same order both ends.
        assert sent == received, (kind, p, m, v)


def test_data_is_there_before_it_is_used():
    for kind, p, m, v in CONFIGS:
        for stage, actions in enumerate(schedule_of(kind, p, m, v)):
            have = set()
            for a in actions:
                for op in comm_ops(a):
                    if isinstance(op, SendActivation):
                        assert ("F", op.mb, op.chunk) in have
                    elif isinstance(op, SendGrad):
                        assert ("B", op.mb, op.chunk) in have
                    else:
                        have.add((type(op).__name__, op.mb, op.chunk))
                if isinstance(a, (Forward, Backward)):
                    vs = virtual_stage(stage, a.chunk, p)
                    if isinstance(a, Forward) and vs > 0:
                        assert ("RecvActivation", a.mb, a.chunk) in have
                    if isinstance(a, Backward) and vs < p * v - 1:
                        assert ("RecvGrad", a.mb, a.chunk) in have
                    have.add(("F" if isinstance(a, Forward) else "B", a.mb, a.chunk))


def test_deadlock_free_for_all_p8_m32_v4():
    for config in CONFIGS:
        timeline = timeline_of(*config)  # raises ScheduleError on deadlock
        assert len(timeline.events) == config[1]


def in_flight(actions):
    held = peak = 0
    for a in actions:
        held += isinstance(a, Forward) - isinstance(a, Backward)
        peak = max(peak, held)
    return peak


def test_activations_in_flight():
    for kind, p, m, v in CONFIGS:
        schedule = schedule_of(kind, p, m, v)
        peaks = [in_flight(actions) for actions in schedule]
        assert activations_in_flight(schedule) == peaks
        for stage, peak in enumerate(peaks):
            if kind == "1f1b":
                assert peak <= min(p - stage, m)
                assert peak == min(p - stage, m)  # and no fewer: it is the warm-up + 1
            elif kind == "gpipe":
                assert peak == m
            else:
                assert peak <= min(p - stage + (v - 1) * p, m * v)


def test_bubble_is_exactly_theory():
    # With backward = 2 forwards, the measured bubble (idle / busy) equals (p-1)/(v*m).
    for kind, p, m, v in CONFIGS:
        timeline = timeline_of(kind, p, m, v)
        busy = sum(timeline.busy(s) for s in range(p))
        assert busy == p * m * v * 3
        measured = (p * timeline.makespan - busy) / busy
        assert measured == theoretical_bubble(p, m, v) == (p - 1) / (v * m), (kind, p, m, v)
        if kind != "interleaved":
            assert timeline.makespan == (m + p - 1) * 3  # the textbook (m + p - 1)(tf + tb)


@pytest.mark.parametrize("fwd,bwd", [(1, 1), (2, 3), (1, 4)])
def test_1f1b_and_gpipe_bubble_for_other_costs(fwd, bwd):
    for kind, p, m in itertools.product(["gpipe", "1f1b"], [2, 3, 5, 8], [1, 4, 7, 16]):
        timeline = simulate(schedule_of(kind, p, m, 1), fwd, bwd)
        assert timeline.makespan == (m + p - 1) * (fwd + bwd)
        assert bubble(kind, p, m, fwd_cost=fwd, bwd_cost=bwd) == (p - 1) / m


def test_bubble_api_and_idle_fraction():
    s = one_f_one_b(4, 8)
    assert bubble(s) == bubble("1f1b", 4, 8) == 3 / 8
    assert bubble("interleaved", 4, 8, 2) == 3 / 16
    assert idle_fraction(s) == 3 / 11  # (p-1) / (m+p-1)
    report = measure(interleaved_1f1b(4, 8, 2))
    assert (report.bubble, report.theory, report.makespan) == (3 / 16, 3 / 16, 57)


def test_simulated_times_by_hand():
    # 1F1B, p=2, m=2, forward 1, backward 2 (worked out on paper).
    timeline = simulate(one_f_one_b(2, 2), 1, 2)
    spans = [[(e.start, e.end, str(e.action)) for e in stage] for stage in timeline.events]
    assert spans == [
        [(0, 1, "F0"), (1, 2, "F1"), (4, 6, "B0"), (7, 9, "B1")],
        [(1, 2, "F0"), (2, 4, "B0"), (4, 5, "F1"), (5, 7, "B1")],
    ]
    assert timeline.makespan == 9


def test_exact_small_schedules():
    assert one_f_one_b(2, 2) == [
        [
            Forward(0),
            SendActivation(1, 0),
            Forward(1),
            SendActivation(1, 1),
            RecvGrad(1, 0),
            Backward(0),
            RecvGrad(1, 1),
            Backward(1),
        ],
        [
            RecvActivation(0, 0),
            Forward(0),
            RecvActivation(0, 1),
            Backward(0),
            SendGrad(0, 0),
            Forward(1),
            Backward(1),
            SendGrad(0, 1),
        ],
    ]
    assert build_schedule("gpipe", 1, 3) == [
        [Forward(0), Forward(1), Forward(2), Backward(0), Backward(1), Backward(2)]
    ]


def lazy_placement(schedule):
    """Same compute order, but each receive right before its use and each send right after
    its compute (paired into one batch in between, as naive 1F1B runtimes do)."""
    out = []
    for actions in schedule:
        ops_of = {}
        for op in all_ops(actions):
            ops_of.setdefault((type(op), op.mb, op.chunk), op)
        new, pending = [], []
        for a in computes(actions):
            recv = RecvActivation if isinstance(a, Forward) else RecvGrad
            ops = pending + [o for k, o in ops_of.items() if k == (recv, a.mb, a.chunk)]
            if ops:
                new.append(CommBatch(tuple(ops)))
            new.append(a)
            send = SendActivation if isinstance(a, Forward) else SendGrad
            pending = [o for k, o in ops_of.items() if k == (send, a.mb, a.chunk)]
        if pending:
            new.append(CommBatch(tuple(pending)))
        out.append(new)
    return out


def test_simulator_catches_deadlock():
    # Naive placement of the interleaved schedule: blocking sends wait on each other ...
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits at action \d+: \[send"):
        simulate(lazy_placement(interleaved_1f1b(4, 8, 2)))
    # ... and with two stages, activations and gradients cross in one channel out of order.
    with pytest.raises(ScheduleError, match="'send grad 0.1 -> 1' is matched by stage 1's"):
        simulate(lazy_placement(interleaved_1f1b(2, 4, 2)))
    # ... while the same naive placement is fine for 1F1B (Megatron's pairing).
    simulate(lazy_placement(one_f_one_b(4, 8)))
    # Both stages receive before they send.
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(
            [
                [Forward(0), RecvGrad(1, 0), SendActivation(1, 0), Backward(0)],
                [RecvActivation(0, 0), Forward(0), Backward(0), SendGrad(0, 0)],
            ]
        )


def test_simulator_catches_bad_schedules():
    good = one_f_one_b(2, 2)
    swapped = [list(good[0]), list(good[1])]
    swapped[0][1], swapped[0][3] = swapped[0][3], swapped[0][1]  # send act 1 before act 0
    with pytest.raises(ScheduleError):
        simulate(swapped)
    # Receives in the wrong order: FIFO hands act 0 to the receive of act 1.
    wrong_order = [
        [Forward(0), SendActivation(1, 0), Forward(1), SendActivation(1, 1), Backward(0)],
        [RecvActivation(0, 1), RecvActivation(0, 0), Forward(0), Forward(1), Backward(0)],
    ]
    with pytest.raises(ScheduleError, match="received in the order they are sent"):
        simulate(wrong_order)
    with pytest.raises(ScheduleError, match="runs before its forward"):
        simulate([[Backward(0), Forward(0)]])
    with pytest.raises(ScheduleError, match="never runs backward"):
        simulate([[Forward(0), Forward(1), Backward(1)]])
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate([[Forward(0), Backward(0), Backward(0)]])
    with pytest.raises(ScheduleError, match="names peer stage 2, expected 1"):
        simulate([[Forward(0), SendActivation(2, 0)], [], []])
    with pytest.raises(ScheduleError, match="input activation"):
        simulate([[Forward(0), SendActivation(1, 0), Backward(0)], [Forward(0), Backward(0)]])


def test_virtual_stage_mapping():
    p = 4
    for stage, chunk in itertools.product(range(p), range(3)):
        assert virtual_stage(stage, chunk, p) == chunk * p + stage
        assert stage_and_chunk(chunk * p + stage, p) == (stage, chunk)


def test_actions_are_small_frozen_values():
    a = SendActivation(peer=1, mb=3, chunk=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mb = 4
    assert {a, SendActivation(1, 3, 2)} == {a}
    assert comm_ops(a) == (a,) and comm_ops(Forward(0)) == ()
    assert comm_ops(CommBatch((a, RecvGrad(1, 0)))) == (a, RecvGrad(1, 0))
    assert str(Forward(3, 1)) == "F3.1" and str(Backward(2)) == "B2"


def test_schedule_errors():
    with pytest.raises(ConfigError) as e:
        interleaved_1f1b(4, 6, 2)
    msg = str(e.value)
    assert "(6)" in msg and "(4)" in msg and "use 4 or 8 micro-batches" in msg
    with pytest.raises(ConfigError, match="use 4 micro-batches"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ConfigError, match="at least 2 pipeline stages"):
        interleaved_1f1b(1, 4, 2)
    with pytest.raises(ConfigError, match="no virtual stages"):
        build_schedule("gpipe", 2, 4, 2)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ConfigError, match="micro-batches must be a positive integer"):
        one_f_one_b(2, 0)
    assert interleaved_1f1b(3, 5, 1) == one_f_one_b(3, 5)


# --------------------------------------------------------------------------------------------
# Picture and CLI


def test_draw_writes_png_atomically(tmp_path):
    out = tmp_path / "schedule.png"
    draw(interleaved_1f1b(4, 8, 2), out, title="interleaved")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["schedule.png"]


def test_schedule_main(tmp_path, capsys):
    out = tmp_path / "s.png"
    argv = ["--pp", "4", "--microbatches", "8", "--virtual", "2", "--out", str(out)]
    assert schedule_main(argv) == 0
    assert out.exists()
    text = capsys.readouterr().out
    assert "interleaved schedule" in text and "measured 0.1875" in text and "= 0.1875" in text
    assert schedule_main(["--pp", "4", "--microbatches", "8", "--kind", "gpipe"]) == 0
    assert "measured 0.3750" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="divisible"):
        schedule_main(["--pp", "4", "--microbatches", "6", "--virtual", "2"])


# --------------------------------------------------------------------------------------------
# Partitioning


def brute_force(weights, parts):
    """Most even optimal split by enumeration: (max, sum of squares, reversed boundaries)."""
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        sums = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = (max(sums), sum(s * s for s in sums), [-b for b in bounds])
        if best is None or key < best[0]:
            best = (key, bounds)
    return best[1]


def test_partition_balanced_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        weights = [rng.choice([0, 1, 2, 3, 5, 8, 13, 40]) for _ in range(n)]
        assert partition_balanced(weights, parts) == brute_force(weights, parts), weights


def test_partition_examples():
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(7, 2, virtual_stages=2) == [0, 2, 4, 6, 7]
    assert partition_balanced([1] * 10, 4) == partition_uniform(10, 4)
    # A heavy first layer (embedding) gets a stage of its own.
    assert partition_balanced([50, 10, 10, 10, 10, 10, 10, 5], 4) == [0, 1, 3, 5, 8]
    assert stage_layers([0, 2, 4, 6, 7], stage=1, num_stages=2, chunk=1) == range(6, 7)
    assert virtual_stages_from_layers(24, 4, 2) == 3


def test_partition_errors():
    with pytest.raises(ConfigError, match="3 layers cannot fill 4 pipeline stages"):
        partition_uniform(3, 4)
    with pytest.raises(ConfigError, match="= 6 parts"):
        partition_balanced([1] * 5, 3, virtual_stages=2)
    with pytest.raises(ConfigError, match=r"weights\[1\]"):
        partition_balanced([1, -1, 1], 2)
    with pytest.raises(ConfigError, match="--num-layers-per-virtual-pipeline-stage"):
        virtual_stages_from_layers(24, 4, 4)
