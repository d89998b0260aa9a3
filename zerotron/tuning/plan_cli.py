"""``zerotron plan``: the fastest layouts of a model on a cluster, and why the others lose.

    zerotron plan --model 1.5B --gpu a100-80gb --nodes 1 --global-batch-size 512
    zerotron plan --num-layers 48 --hidden-size 1600 --num-attention-heads 25 \\
        --seq-length 1024 --nodes 2 --gpus-per-node 8 --gpu-memory 80GB \\
        --intra-node-bandwidth 300 --inter-node-bandwidth 25 --peak-tflops 312 \\
        --global-batch-size 512 --top 8 --json

The model comes from Megatron's flags, a GPT-2 size name (``--model 124M|355M|774M|1.5B``) or
``--config`` (a zerotron YAML/JSON); the cluster from a GPU preset (``--gpu``) with any field
overridden. The planner is :func:`zerotron.tuning.plan.plan`; see docs/planning.md.
"""

from __future__ import annotations

import json
import sys

from zerotron.errors import ConfigError
from zerotron.tuning.cost import GPUS, Cluster, cluster
from zerotron.tuning.estimate import GPT2_SIZES, GPT2_VOCAB, RECOMPUTE, ModelShape
from zerotron.tuning.estimate_cli import parse_size
from zerotron.tuning.plan import GB, Plan, SearchSpace, plan, recompute_label


def _csv(kind, allowed, flag: str):
    """A comma-separated list of ``allowed`` values (for the search-space flags)."""

    def parse(text: str):
        try:
            values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        bad = [v for v in values if v not in allowed] or ([] if values else [text])
        if bad:
            raise ConfigError(
                f"unknown value(s) {bad}",
                where=flag,
                fix=f"a comma-separated list of {list(allowed)}",
            )
        return values

    return parse


def build_parser():
    from zerotron.config.args import ArgumentParser

    p = ArgumentParser(
        prog="zerotron plan",
        description="Rank every layout (dp/tp/pp/virtual pp/ZeRO/micro-batch/recompute) of a "
        "model on a cluster by predicted step time; drop those that do not fit.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=sorted(GPT2_SIZES), help="a GPT-2 size")
    m.add_argument("--config", help="a zerotron YAML/JSON config: its model section")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-attention-heads", type=int)
    m.add_argument("--ffn-hidden-size", type=int)
    m.add_argument("--seq-length", type=int, help="default 1024")
    m.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, help="the tokenizer's")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", choices=sorted(GPUS), default="a100-80gb", help="preset")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB (GB = 2^30 bytes)")
    c.add_argument("--intra-node-bandwidth", type=float, help="GB/s per GPU (NVLink)")
    c.add_argument("--inter-node-bandwidth", type=float, help="GB/s per GPU (network)")
    c.add_argument("--hbm-bandwidth", type=float, help="GB/s of GPU memory")
    c.add_argument("--peak-tflops", type=float, help="16-bit dense peak per GPU")
    c.add_argument("--efficiency", type=float, help="achieved fraction of peak (calibrated)")
    s = p.add_argument_group("search")
    s.add_argument("--global-batch-size", type=int, required=True)
    s.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    s.add_argument(
        "--zero-stages", type=_csv(int, (0, 1, 2, 3), "--zero-stages"), default=(0, 1, 2, 3)
    )
    s.add_argument("--recompute", type=_csv(str, RECOMPUTE, "--recompute"), default=RECOMPUTE)
    s.add_argument(
        "--no-recompute-blocks",
        action="store_true",
        help="full recompute of every layer only (not also --recompute-method block)",
    )
    s.add_argument("--no-sequence-parallel", action="store_true")
    s.add_argument("--max-micro-batch-size", type=int, default=64)
    s.add_argument("--max-virtual-stages", type=int, default=8)
    s.add_argument("--tp-within-node", action="store_true", help="never span TP over nodes")
    s.add_argument(
        "--materialized-attention",
        action="store_true",
        help="attention keeps its s×s scores (no flash attention), as Megatron-LM in 2021",
    )
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to show")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def model_shape(args) -> ModelShape:
    """The model from ``--config``, ``--model`` or Megatron's flags (flags win)."""
    if args.config:
        base = _shape_from_file(args.config, args.vocab_size)
    elif args.model:
        base = ModelShape.gpt2(args.model, seq_length=args.seq_length or 1024)
    else:
        missing = [
            f"--{n.replace('_', '-')}"
            for n in ("num_layers", "hidden_size", "num_attention_heads")
            if getattr(args, n) is None
        ]
        if missing:
            raise ConfigError(
                f"no model given: {', '.join(missing)} missing",
                where="zerotron plan",
                fix="give --model 1.5B, --config FILE, or --num-layers, --hidden-size and "
                "--num-attention-heads",
            )
        base = ModelShape(
            args.num_layers,
            args.hidden_size,
            args.num_attention_heads,
            args.seq_length or 1024,
            args.vocab_size,
        )
    fields = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size,
        "seq_length": args.seq_length,
    }
    shape = ModelShape(**{**base.__dict__, **{k: v for k, v in fields.items() if v is not None}})
    if shape.hidden_size % shape.num_attention_heads:
        raise ConfigError(
            f"hidden size {shape.hidden_size} is not divisible by {shape.num_attention_heads} "
            "attention heads",
            where="--hidden-size",
        )
    return shape


def _shape_from_file(path: str, vocab_size: int) -> ModelShape:
    """The model section of a zerotron YAML/JSON config (the rest of the file is a run's, not
    the planner's: the planner chooses the layout and the batch split)."""
    from zerotron.config.files import read_config_file
    from zerotron.config.keys import nest_keys

    data, locate = read_config_file(path)
    model = nest_keys(data, where=locate).nested.get("model", {})
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    missing = [k for k in need if model.get(k) is None]
    if missing:
        raise ConfigError(
            f"the config's model section lacks {', '.join(missing)}",
            where=path,
            fix="add them to the file, or give them as flags (--num-layers ...)",
        )
    optional = ("ffn_hidden_size", "make_vocab_size_divisible_by", "max_position_embeddings")
    return ModelShape(
        **{k: model[k] for k in need},
        vocab_size=vocab_size,
        **{k: model[k] for k in optional if model.get(k) is not None},
    )


def cluster_of(args) -> Cluster:
    """The cluster: the ``--gpu`` preset with every given flag replacing its field."""
    for name in (
        "intra_node_bandwidth",
        "inter_node_bandwidth",
        "hbm_bandwidth",
        "peak_tflops",
        "efficiency",
    ):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be positive, got {value}", where="zerotron plan"
            )
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be at least 1", where="zerotron plan"
            )
    gbps = 1e9
    return cluster(
        args.gpu,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=parse_size(args.gpu_memory) if args.gpu_memory else None,
        intra_node_bandwidth=args.intra_node_bandwidth and args.intra_node_bandwidth * gbps,
        inter_node_bandwidth=args.inter_node_bandwidth and args.inter_node_bandwidth * gbps,
        hbm_bandwidth=args.hbm_bandwidth and args.hbm_bandwidth * gbps,
        peak_flops=args.peak_tflops and args.peak_tflops * 1e12,
        efficiency=args.efficiency,
    )


def _layout_name(lay) -> str:
    parts = [f"tp{lay.tp}", f"pp{lay.pp}", f"dp{lay.dp}"]
    if lay.vpp > 1:
        parts.append(f"v{lay.vpp}")
    if lay.sequence_parallel:
        parts.append("sp")
    return " ".join(parts)


def print_tables(result: Plan, top: int) -> None:
    """The top layouts, then the fastest that do not fit, as rich tables."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    shape, c = result.shape, result.cluster
    console.print(
        f"model: {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads, seq {shape.seq_length}, vocab {shape.vocab_size} "
        f"({shape.num_parameters() / 1e9:.2f}B parameters)"
    )
    console.print(
        f"cluster: {c.nodes} node(s) × {c.gpus_per_node} {c.name} ({c.gpu_memory / GB:.0f} GB, "
        f"{c.peak_flops / 1e12:.0f} TFLOP/s peak at efficiency {c.efficiency:.3f}; "
        f"{c.intra_node_bandwidth / 1e9:.0f} GB/s in a node, "
        f"{c.inter_node_bandwidth / 1e9:.0f} GB/s between); global batch {result.global_batch}"
    )
    n = len(result.ranked) + len(result.rejected) + result.skipped
    console.print(
        f"{n} valid layouts: {len(result.ranked)} fit, {len(result.rejected)} do not, "
        f"{result.skipped} not evaluated (their lower bound is slower than the top {top})"
    )
    table = Table(
        box=box.SIMPLE_HEAD,
        title="fastest layouts that fit (one per step time: the one using the least memory)",
    )
    for col in ("#", "layout", "ZeRO", "mbs×m", "recompute", "step s", "TFLOP/s/GPU"):
        table.add_column(col, justify="right" if col not in ("layout", "recompute") else "left")
    table.add_column("memory/rank", justify="right")
    table.add_column("bubble", justify="right")
    table.add_column("why it lost")
    for i, cand in enumerate(result.distinct()[:top], 1):
        table.add_row(*_row(i, cand))
    console.print(table)
    faster = result.faster_but_too_big()[:top]
    if faster:
        bad = Table(box=box.SIMPLE_HEAD, title="faster, but do not fit")
        for col in ("#", "layout", "ZeRO", "mbs×m", "recompute", "step s", "TFLOP/s/GPU"):
            bad.add_column(col)
        bad.add_column("memory/rank")
        bad.add_column("bubble")
        bad.add_column("why")
        for i, cand in enumerate(faster, 1):
            bad.add_row(*_row(i, cand))
        console.print(bad)


def _row(i: int, cand) -> list[str]:
    lay, cost = cand.layout, cand.cost
    return [
        str(i),
        _layout_name(lay),
        str(lay.zero_stage),
        f"{lay.micro_batch_size}×{lay.num_microbatches}",
        recompute_label(lay),
        f"{cost.step_time:.3f}",
        f"{cost.tflops_per_gpu:.1f}",
        f"{cand.memory.total / GB:.1f} GB",
        f"{cost.bubble_fraction:.1%}",
        cand.why + (f" (+{cand.ties} as fast, more memory)" if cand.ties else ""),
    ]


def main(argv: list[str] | None = None) -> int:
    """``zerotron plan``."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}", where="--top")
    shape = model_shape(args)
    c = cluster_of(args)
    space = SearchSpace(
        zero_stages=args.zero_stages,
        recompute=args.recompute,
        recompute_blocks=not args.no_recompute_blocks,
        sequence_parallel=(False,) if args.no_sequence_parallel else (False, True),
        max_micro_batch_size=args.max_micro_batch_size,
        max_virtual_stages=args.max_virtual_stages,
        precision=args.precision,
        tp_within_node=args.tp_within_node,
        flash_attention=not args.materialized_attention,
    )
    result = plan(shape, c, args.global_batch_size, space, top=args.top)
    if args.json:
        out = {
            "model": shape.__dict__,
            "cluster": c.__dict__,
            "global_batch_size": args.global_batch_size,
            "layouts_fit": len(result.ranked),
            "layouts_do_not_fit": len(result.rejected),
            "layouts_not_evaluated": result.skipped,
            "top": [k.as_dict() for k in result.distinct()[: args.top]],
            "faster_but_do_not_fit": [k.as_dict() for k in result.faster_but_too_big()[: args.top]],
        }
        print(json.dumps(out, indent=2))
    else:
        print_tables(result, args.top)
    if not result.ranked:
        raise result.no_fit_error()
    return 0


if __name__ == "__main__":
    sys.exit(main())
