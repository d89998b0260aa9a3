"""``zerotron estimate``: per-rank memory of a run, before launching it.

    zerotron estimate --num-layers 48 --hidden-size 1600 --num-attention-heads 25 \\
        --seq-length 1024 --micro-batch-size 4 --global-batch-size 512 --bf16 \\
        --zero-stage 1 --num-gpus 8 --gpu-memory 80GB
    zerotron estimate --deepspeed_config ds.json --num-layers 24 ... --num-gpus 16 --json
    zerotron estimate --config run.yaml --world-size 8 --layout tp=2 --layout tp=2,pp=2 --plot m.png

The model and the base layout come from the flags ``zerotron pretrain`` takes (Megatron's), a
DeepSpeed JSON (``--deepspeed_config``) or ``--config FILE``, read by the same loaders
(:mod:`zerotron.config`); ``--train-iters`` and ``--lr`` are not needed. The world size
(``--world-size``, ``--num-gpus`` or ``--nodes`` × ``--gpus-per-node``) gives the data-parallel
size. Each ``--layout k=v,...`` adds a layout derived from the base one (keys: tp, pp, dp, vpp,
sp, zero, mbs, recompute, precision, offload_optimizer, offload_param; dp and the micro-batches
per step follow from the world size and the global batch unless given); without ``--layout``
the base layout is estimated. With ``--device cpu`` the fast paths' buffers follow the kernel
choices ``zerotron pretrain`` would take on this machine (its ``--kernels``, else the ones
cached here by an earlier run or ``zerotron kernels``, else the defaults), printed first.

``--compare RUN_DIR`` estimates instead each rank of a run that measured a step
(``zerotron pretrain --memory-breakdown-step N``) and prints estimate and measurement side by
side, per term, with their ratio (:mod:`zerotron.tuning.estimate_compare`).

Output: a table of the terms per layout (GiB), and with ``--gpu-memory`` whether each fits and
by how much (the exit status is 0 either way); ``--json`` prints the same as JSON, ``--plot
FILE.png`` draws stacked bars per layout. Sizes: ``80GB`` and ``80GiB`` both mean 80 × 2³⁰ bytes
(what nvidia-smi and DeepSpeed's estimators call GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import TYPE_CHECKING, Any

from zerotron.errors import ConfigError
from zerotron.training.memory_figure import ORDER
from zerotron.tuning.estimate import Layout, MemoryBreakdown, ModelShape, estimate

if TYPE_CHECKING:
    from zerotron.kernels import Chosen

GIB = 2**30
UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
TERMS = ORDER  # the breakdown's rows, in the figures' order
# --layout keys -> Layout fields
KEYS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "vpp": "vpp",
    "sp": "sequence_parallel",
    "zero": "zero_stage",
    "mbs": "micro_batch_size",
    "recompute": "recompute",
    "partition_activations": "partition_activations",
    "cpu_checkpointing": "cpu_checkpointing",
    "precision": "precision",
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_param",
}


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes of ``"80GB"``, ``"80GiB"``, ``"40G"``, ``"512MiB"`` or a plain byte count (binary
    units: see the module docstring)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if m is None:
        raise ConfigError(
            f"{text!r} is not a size", where=flag, fix="write e.g. 80GB, 40GiB or 512MB"
        )
    return int(float(m.group(1)) * UNITS[m.group(2)])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zerotron estimate",
        allow_abbrev=False,
        description="Per-rank memory (parameters, gradients, masters, optimizer states, "
        "activations, buffers) of a run, from its flags. Other flags are zerotron pretrain's.",
    )
    p.add_argument("--world-size", "--num-gpus", dest="world_size", type=int, default=None)
    p.add_argument("--nodes", type=int, default=None, help="with --gpus-per-node")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=50257, help="the tokenizer's (GPT-2's)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="kernels to assume")
    p.add_argument("--gpu-memory", default=None, help="device memory, e.g. 80GB: fits or not")
    p.add_argument("--layout", action="append", default=[], metavar="K=V,...")
    p.add_argument("--pipeline-rank", type=int, default=None, help="default: the fullest stage")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw stacked bars")
    p.add_argument(
        "--compare",
        default=None,
        metavar="RUN_DIR",
        help="beside what a run measured (zerotron pretrain --memory-breakdown-step), per rank",
    )
    return p


def cpu_kernels(cfg: Any, vocab_size: int) -> Chosen:
    """The CPU kernel choices ``zerotron pretrain`` would take on this machine for ``cfg``, whose
    buffers differ: its ``--kernels``, else the ones cached here (:mod:`zerotron.kernels.chooser`),
    else the defaults; nothing is measured (``zerotron kernels`` measures)."""
    from zerotron.kernels import KernelShape, choose_kernels

    shape = KernelShape.from_config(cfg, vocab_size)
    return choose_kernels(shape, "cpu", cfg.model.kernels, measure=False, apply=False)


def world_size(args: argparse.Namespace) -> int:
    """``--world-size`` / ``--num-gpus``, or ``--nodes × --gpus-per-node``; 1 if none."""
    if args.nodes is not None or args.gpus_per_node is not None:
        if args.world_size is not None:
            raise ConfigError(
                "give --world-size/--num-gpus or --nodes × --gpus-per-node, not both",
                where="--world-size",
            )
        return (args.nodes or 1) * (args.gpus_per_node or 1)
    return args.world_size or 1


def load(rest: list[str], world: int) -> Any:
    """The Config of ``zerotron pretrain``'s flags (``--train-iters 0`` when no length given:
    nothing runs, so neither it nor ``--lr`` matters)."""
    from zerotron.config import parse_megatron_args

    if not any(a.split("=")[0] in ("--train-iters", "--train-samples") for a in rest):
        rest = [*rest, "--train-iters", "0"]
    return parse_megatron_args(rest, world_size=world)


def derive(base: Layout, spec: str, world: int, global_batch: int | None) -> Layout:
    """``base`` with the ``--layout`` overrides of ``spec`` (see the module docstring)."""
    changes: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS:
            raise ConfigError(
                f"bad --layout item {item!r}", where="--layout", fix=f"keys: {', '.join(KEYS)}"
            )
        field = KEYS[key]
        kind = type(getattr(base, field))
        if kind is bool:
            changes[field] = value.lower() in ("1", "true", "yes", "on")
        elif kind is int:
            try:
                changes[field] = int(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r} is not an integer", where="--layout") from None
        else:
            changes[field] = value
    layout = dataclasses.replace(base, **changes)
    if "dp" not in changes:
        mp = layout.tp * layout.pp
        if world % mp:
            raise ConfigError(
                f"world size {world} is not divisible by tp × pp = {mp} (layout {spec!r})",
                where="--layout",
                fix="choose tp and pp whose product divides the world size",
            )
        layout = dataclasses.replace(layout, dp=world // mp)
    if global_batch:
        per_step = layout.micro_batch_size * layout.dp
        if global_batch % per_step:
            raise ConfigError(
                f"global batch {global_batch} is not divisible by micro-batch × dp = {per_step} "
                f"(layout {spec!r})",
                where="--layout",
                fix="change mbs or the parallel sizes",
            )
        layout = dataclasses.replace(layout, num_microbatches=global_batch // per_step)
    return layout


def main(argv: list[str]) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.compare:
        return compare_main(args, rest)
    world = world_size(args)
    cfg = load(rest, world)
    shape = ModelShape.from_config(cfg, vocab_size=args.vocab_size)
    kernels = None
    if args.device == "cpu":
        chosen = cpu_kernels(cfg, args.vocab_size)
        kernels = chosen.choices
        if not args.json:
            print(f"CPU {chosen.line()}")
            if "default" in chosen.how.values():
                print("  (none cached for this shape here: `zerotron kernels` measures them)")
    base = Layout.from_config(cfg, device=args.device, kernels=kernels)
    specs = args.layout or [""]
    layouts = [
        (
            spec or "base",
            derive(base, spec, world, cfg.training.global_batch_size) if spec else base,
        )
        for spec in specs
    ]
    results = [(name, lay, estimate(shape, lay, args.pipeline_rank)) for name, lay in layouts]
    device = parse_size(args.gpu_memory) if args.gpu_memory else None
    if args.json:
        print(json.dumps(as_json(shape, results, device), indent=1))
    else:
        print_table(shape, results, device)
    if args.plot:
        plot(results, args.plot, device)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def compare_main(args: argparse.Namespace, rest: list[str]) -> int:
    """``--compare RUN_DIR``: :mod:`zerotron.tuning.estimate_compare`, printed (or ``--json``),
    and its figure drawn into RUN_DIR/figures (or ``--plot FILE``)."""
    from pathlib import Path

    from zerotron.tuning import estimate_compare as ec

    flags_cfg = None
    if rest:  # the run's flags, for a run that wrote no run record
        explicit = args.world_size is not None or args.nodes or args.gpus_per_node
        ranks = len(list((Path(args.compare) / "metrics").glob("rank*.jsonl")))
        flags_cfg = load(rest, world_size(args) if explicit else max(1, ranks))
    results = ec.compare(args.compare, flags_cfg)
    if args.json:
        print(json.dumps(ec.as_json(results), indent=1))
    else:
        ec.print_comparison(results)
    path = args.plot or str(Path(args.compare) / ec.FIGURE)
    try:
        ec.draw(results, path)
    except ConfigError as e:
        if args.plot:
            raise
        print(f"WARNING: no figure: {e.what}", file=sys.stderr)
    else:
        if not args.json:
            print(f"wrote {path}")
    return 0


def as_json(shape: ModelShape, results: list, device: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": dataclasses.asdict(shape), "layouts": []}
    out["model"]["parameters"] = shape.num_parameters()
    for name, layout, mem in results:
        entry: dict[str, Any] = {
            "name": name,
            "layout": dataclasses.asdict(layout),
            "memory": mem.as_dict(),
        }
        if device is not None:
            entry["gpu_memory"] = device
            entry["fits"] = mem.fits(device)
            entry["headroom"] = device - mem.total
        out["layouts"].append(entry)
    return out


def _describe(layout: Layout, lines: bool = False) -> Any:
    """A short description of ``layout`` (its parts as a list with ``lines``)."""
    parts = [f"tp{layout.tp} pp{layout.pp} dp{layout.dp}"]
    if layout.vpp > 1:
        parts.append(f"vpp{layout.vpp}")
    if layout.sequence_parallel:
        parts.append("sp")
    parts.append(f"zero{layout.zero_stage} {layout.precision}")
    parts.append(f"mbs{layout.micro_batch_size}×{layout.num_microbatches}")
    if layout.recompute != "none":
        unit = layout.recompute_num_layers
        block = layout.recompute_method == "block"
        if layout.recompute == "full" and (block or unit not in (None, 1)):
            parts.append(f"full recompute ({layout.recompute_method} {unit or 'all'})")
        else:
            parts.append(f"{layout.recompute} recompute")
        if layout.recompute == "full" and layout.partition_activations:
            parts.append("partitioned")
        if layout.recompute == "full" and layout.cpu_checkpointing:
            parts.append("inputs on host")
    if layout.offload_optimizer != "none" or layout.offload_param != "none":
        parts.append(f"offload {layout.offload_optimizer}/{layout.offload_param}")
    return parts if lines else " ".join(parts)


def print_table(shape: ModelShape, results: list, device: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"per-rank memory, GiB ({shape.num_parameters() / 1e6:.1f}M parameters)",
        title_justify="left",
    )
    table.add_column("term")
    for name, layout, _ in results:
        table.add_column(f"{name}\n{_describe(layout)}", justify="right")
    for term in TERMS:
        table.add_row(
            term.replace("_", " "), *(f"{getattr(m, term) / GIB:.2f}" for *_, m in results)
        )
    table.add_row("total", *(f"{m.total / GIB:.2f}" for *_, m in results), style="bold")
    host = [m.host for *_, m in results]
    if any(host):
        table.add_row("host (offload)", *(f"{h / GIB:.2f}" for h in host))
    if device is not None:
        table.add_row(f"fits {device / GIB:.0f} GiB?", *(_verdict(m, device) for *_, m in results))
    Console(file=sys.stdout, width=max(100, 28 + 30 * len(results))).print(table)


def _verdict(mem: MemoryBreakdown, device: int) -> str:
    room = device - mem.total
    if room >= 0:
        return f"yes, {room / GIB:.2f} GiB free"
    return f"NO, {-room / GIB:.2f} GiB over"


def plot(results: list, path: str, device: int | None) -> None:
    """Stacked bars of the terms, one bar per layout (PNG, written crash-safe)."""
    from zerotron.training.memory_figure import draw_stacked

    bars = [
        (
            "\n".join([name if len(name) <= 18 else f"layout {i + 1}", *_describe(lay, True)]),
            {t: getattr(m, t) for t in TERMS},
        )
        for i, (name, lay, m) in enumerate(results)
    ]
    line = ("device", device) if device is not None else None
    draw_stacked(bars, path, "zerotron estimate: per-rank memory", line=line)
