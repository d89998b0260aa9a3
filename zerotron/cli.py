"""``zerotron <command>``: one entry point for every tool.

Each command lives in the module that owns its work and exposes ``main(argv) -> int``; this file
only dispatches, so ``zerotron --help`` stays fast (no torch import) and commands stay small.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from zerotron.errors import ZerotronError

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "preprocess": ("zerotron.data.preprocess", "tokenize loose JSON into Megatron .bin/.idx files"),
    "merge-datasets": ("zerotron.data.merge", "concatenate several .bin/.idx prefixes into one"),
    "dataset-info": ("zerotron.data.info", "statistics of a tokenized dataset and its splits"),
    "pretrain": ("zerotron.training.pretrain", "pretrain a GPT model (Megatron-LM flags)"),
    "generate": ("zerotron.inference.cli", "generate text from a checkpoint"),
    "kernels": (
        "zerotron.training.kernels_cli",
        "the CPU kernel choices for a model shape (measured once per machine, cached)",
    ),
    "convert": (
        "zerotron.checkpoint.convert",
        "import/export HuggingFace GPT-2 checkpoints; reshard between TP/PP layouts",
    ),
    "checkpoint": (
        "zerotron.checkpoint.checkpoint_cli",
        "verify a checkpoint (checksums, completeness) or describe it (info)",
    ),
    "zero-to-fp32": (
        "zerotron.checkpoint.zero_to_fp32",
        "consolidate a ZeRO checkpoint's fp32 weights (offline, streaming)",
    ),
    "launch": (
        "zerotron.launcher.launch",
        "start a multi-process / multi-node job (torch.distributed.run)",
    ),
    "estimate": (
        "zerotron.tuning.estimate_cli",
        "per-rank memory of a layout before launching: breakdown, fits --gpu-memory?",
    ),
    "tune": (
        "zerotron.launcher.autotune",
        "autotune ZeRO stage, micro-batch (and tp/pp/recompute) with short timed runs",
    ),
    "schedule": (
        "zerotron.pipeline.timeline",
        "simulate a pipeline schedule: bubble vs (p-1)/(v*m), timeline picture",
    ),
    "report": (
        "zerotron.training.report",
        "one offline HTML page of runs' metrics: loss, lr, loss scale, MFU, memory, restarts",
    ),
    "plan": (
        "zerotron.tuning.plan_cli",
        "rank the layouts of a model on a cluster by predicted step time (what fits, why)",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: zerotron <command> [--help] [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Set ZEROTRON_TRACEBACK=1 to see the traceback behind an error message."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"zerotron: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except ZerotronError as e:
        if os.environ.get("ZEROTRON_TRACEBACK"):
            traceback.print_exc()
        if e.where == f"zerotron {name}":  # already said by the prefix
            e.where = None
        print(f"zerotron {name}: error: {e.format()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"zerotron {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
