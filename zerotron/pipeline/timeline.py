"""The pipeline bubble, measured on a simulated timeline, and the timeline picture.

``zerotron schedule --pp 4 --microbatches 8 [--virtual 2] [--kind 1f1b] --out schedule.png``
prints the bubble measured against theory and draws each stage's forwards and backwards.

What is measured. :func:`~zerotron.pipeline.simulator.simulate` runs the schedule with
a fixed cost per forward and per backward of one model chunk (1 and 2 by default: a backward
costs about two forwards) and free communication. Every stage starts at time 0 and the step
ends at the makespan T, when the last stage finishes. A stage's idle time is T minus its busy
time, and::

    bubble = sum of idle times / sum of busy times

which is Megatron-LM's bubble time fraction (bubble time / ideal time): every stage does the
same work, so it equals (T - t_ideal) / t_ideal. Theory (Narayanan et al. 2021) gives
(p - 1) / m for GPipe and 1F1B and (p - 1) / (v m) for the interleaved schedule; the schedules
here reach it exactly under these costs. :func:`idle_fraction` is the other common reading,
idle / (idle + busy), the share of the devices' time wasted: (p - 1) / (m + p - 1) for 1F1B.

A measured timeline (:mod:`~zerotron.pipeline.measured`, from ``--profile-steps``) is measured
by :func:`report` and drawn by :func:`draw_timeline` the same way.
"""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass

from zerotron.errors import ConfigError
from zerotron.fileio import atomic_write_bytes
from zerotron.pipeline.schedules import (
    SCHEDULES,
    Backward,
    Schedule,
    activations_in_flight,
    build_schedule,
    schedule_shape,
)
from zerotron.pipeline.simulator import Timeline, simulate


@dataclass(frozen=True)
class BubbleReport:
    """The measured bubble of one schedule and what theory says it should be."""

    num_stages: int
    num_microbatches: int
    virtual_stages: int
    makespan: float
    busy: float  # summed over stages
    bubble: float  # idle / busy, Megatron's definition
    idle_fraction: float  # idle / (idle + busy)
    theory: float  # (p - 1) / (v m)


def theoretical_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Megatron's bubble time fraction: (p - 1) / (v · m)."""
    return (num_stages - 1) / (virtual_stages * num_microbatches)


def measure(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> BubbleReport:
    """Simulate ``schedule`` and measure its bubble (see the module docstring)."""
    return report(simulate(schedule, fwd_cost, bwd_cost))


def report(timeline: Timeline) -> BubbleReport:
    """The bubble of a timeline, simulated or measured (:mod:`~zerotron.pipeline.measured`)."""
    p, m, v = timeline.num_stages, timeline.num_microbatches, timeline.virtual_stages
    busy = sum(timeline.busy(s) for s in range(p))
    idle = p * timeline.makespan - busy
    return BubbleReport(
        num_stages=p,
        num_microbatches=m,
        virtual_stages=v,
        makespan=timeline.makespan,
        busy=busy,
        bubble=idle / busy,
        idle_fraction=idle / (idle + busy),
        theory=theoretical_bubble(p, m, v),
    )


def bubble(
    schedule: Schedule | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    virtual_stages: int = 1,
    *,
    fwd_cost: float = 1.0,
    bwd_cost: float = 2.0,
) -> float:
    """Measured bubble (idle / busy) of a schedule, or of ``bubble("1f1b", p, m[, v])``."""
    if isinstance(schedule, str):
        if num_stages is None or num_microbatches is None:
            raise TypeError("bubble(kind, num_stages, num_microbatches[, virtual_stages])")
        schedule = build_schedule(schedule, num_stages, num_microbatches, virtual_stages)
    return measure(schedule, fwd_cost, bwd_cost).bubble


def idle_fraction(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> float:
    """Share of the stages' time spent idle: idle / (idle + busy)."""
    return measure(schedule, fwd_cost, bwd_cost).idle_fraction


# --------------------------------------------------------------------------------------------
# Picture


def draw(
    schedule: Schedule,
    out_path: str | os.PathLike,
    *,
    fwd_cost: float = 1.0,
    bwd_cost: float = 2.0,
    title: str | None = None,
) -> None:
    """Write a PNG of the simulated timeline: one row per stage, stage 0 on top.

    Boxes are coloured by micro-batch and labelled F or B with the micro-batch number (and the
    chunk as a subscript with virtual stages; later chunks are drawn lighter). Grey is idle.
    Time is in units of one full-stage forward, so schedules with different v compare directly.
    """
    timeline = simulate(schedule, fwd_cost, bwd_cost)
    v = timeline.virtual_stages
    xlabel = (
        f"time (one stage's forward = 1, backward = {bwd_cost / fwd_cost:g});  "
        "F forward, B backward (hatched), colour = micro-batch"
        + (", subscript = model chunk (later chunks lighter)" if v > 1 else "")
        + ", grey = idle"
    )
    # Time in units of one full-stage forward (v chunks), so schedules with different v compare.
    draw_timeline(timeline, out_path, unit=v * fwd_cost, xlabel=xlabel, title=title)


def draw_timeline(
    timeline: Timeline,
    out_path: str | os.PathLike,
    *,
    unit: float,
    xlabel: str,
    title: str | None = None,
    measured: str = "measured",
    width: float | None = None,
) -> None:
    """Write a PNG of ``timeline`` (simulated, or measured by
    :mod:`~zerotron.pipeline.measured`): one row per stage, stage 0 on top, time divided by
    ``unit``; the title gives the bubble against (p-1)/(v·m) (``measured`` names the bubble).
    ``width`` in inches (default: from the time span, 8 to 60)."""
    try:  # lazy: keeps the CLI fast; matplotlib is an extra
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ConfigError(
            f"drawing the timeline needs matplotlib, which cannot be imported ({e})",
            where="--out",
            fix="pip install 'zerotron[plot]', or leave out --out",
        ) from e

    p, m, v = timeline.num_stages, timeline.num_microbatches, timeline.virtual_stages
    span = timeline.makespan / unit
    # Layout in inches: 1.0 left for stage names, 0.3 right; rows 0.55 high; 0.75 below for
    # the axis and caption, 0.6 above for the title.
    width = width or min(max(8.0, 0.5 * span + 1.3), 60.0)
    height = 0.55 * p + 1.35
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((1.0 / width, 0.75 / height, 1 - 1.3 / width, 0.55 * p / height))
    points_per_unit = (1 - 1.3 / width) * width * 72 / span
    _draw_rows(ax, timeline, unit, points_per_unit)
    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlabel(xlabel, fontsize=9)
    ax.tick_params(length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    bubble = report(timeline)
    ax.set_title(
        (title + "\n" if title else "")
        + f"p={p}, m={m}, v={v}: bubble {bubble.bubble:.4f} {measured}, "
        f"{bubble.theory:.4f} = (p-1)/(v·m) theory",
        fontsize=10,
        loc="left",
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(out_path, buf.getvalue())


def _draw_rows(ax, timeline: Timeline, unit: float, points_per_unit: float) -> None:
    import matplotlib

    colors = matplotlib.colormaps["tab10" if timeline.num_microbatches <= 10 else "tab20"]
    v = timeline.virtual_stages
    for stage, events in enumerate(timeline.events):
        ax.barh(stage, timeline.makespan / unit, left=0, height=0.8, color="#e6e6e6", zorder=0)
        for e in events:
            start, length = e.start / unit, (e.end - e.start) / unit
            a = e.action
            backward = isinstance(a, Backward)
            color = colors(a.mb % colors.N)
            alpha = 1.0 - 0.45 * a.chunk / max(v - 1, 1) if v > 1 else 1.0
            ax.barh(
                stage,
                length,
                left=start,
                height=0.8,
                color=color,
                alpha=alpha,
                edgecolor="black",
                linewidth=0.6,
                hatch="///" if backward else None,
                zorder=1,
            )
            label = ("B" if backward else "F") + str(a.mb)
            if v > 1:
                label += f"$_{{{a.chunk}}}$"
            size = min(9.0, length * points_per_unit / (0.62 * (len(str(a.mb)) + 1.6)))
            if size >= 4:
                ax.text(
                    start + length / 2,
                    stage,
                    label,
                    ha="center",
                    va="center",
                    fontsize=size,
                    zorder=2,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7}
                    if backward
                    else None,
                )


# --------------------------------------------------------------------------------------------
# zerotron schedule


def main(argv: list[str] | None = None) -> int:
    """``zerotron schedule``: print a schedule's bubble (measured vs theory), draw it."""
    from zerotron.config.args import ArgumentParser

    parser = ArgumentParser(
        prog="zerotron schedule",
        description="Simulate a pipeline schedule: bubble measured against (p-1)/(v·m), and "
        "a timeline picture.",
    )
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per stage v")
    parser.add_argument(
        "--kind",
        choices=sorted(SCHEDULES),
        default=None,
        help="schedule (default: interleaved when --virtual > 1, else 1f1b)",
    )
    parser.add_argument("--fwd-cost", type=float, default=1.0, help="time of one forward")
    parser.add_argument("--bwd-cost", type=float, default=2.0, help="time of one backward")
    parser.add_argument("--out", default=None, help="write the timeline picture here (PNG)")
    parser.add_argument("--print", action="store_true", help="print every stage's actions")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    kind = args.kind or ("interleaved" if args.virtual > 1 else "1f1b")
    schedule = build_schedule(kind, args.pp, args.microbatches, args.virtual)
    p, m, v = schedule_shape(schedule)
    report = measure(schedule, args.fwd_cost, args.bwd_cost)
    if args.print:
        from zerotron.pipeline.schedules import format_schedule

        print(format_schedule(schedule))
    print(f"{kind} schedule: {p} stages, {m} micro-batches, {v} model chunk(s) per stage")
    print(
        f"bubble (idle / busy):  measured {report.bubble:.4f}   "
        f"theory (p-1)/(v*m) = {report.theory:.4f}"
    )
    step = report.makespan / (v * args.fwd_cost)
    print(f"idle share of the run: {report.idle_fraction:.4f}   step time {step:g} stage forwards")
    peaks = " ".join(map(str, activations_in_flight(schedule)))
    print(f"most activations in flight per stage: {peaks}")
    if args.out:
        draw(schedule, args.out, fwd_cost=args.fwd_cost, bwd_cost=args.bwd_cost, title=f"{kind}")
        print(f"wrote {args.out}")
    return 0
