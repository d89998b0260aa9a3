"""Offline layout conversion of a GPT-2 345M-shaped checkpoint: time and peak memory.

The source is written once (not timed): random fp32 weights with Adam state (``exp_avg``,
``exp_avg_sq``, ``step``) for GPT-2 medium's shape (24 layers, hidden 1024, 16 heads, seq 1024,
the GPT-2 vocabulary), as a tp1 pp1 ZeRO-0 checkpoint streamed tensor by tensor, then converted
to tp2 pp2 ZeRO-1 by ``zerotron convert`` itself. The measured conversion is the issue's
example, tp2 pp2 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3 (``zerotron.checkpoint.convert_layout``), in a
fresh process per round: wall time, and the growth of peak RSS (``ru_maxrss``) over the RSS the
process had before converting (torch imported).

The bound is the largest tensor (the word embedding in fp32, the source's padding). The peer,
alternating with zerotron round by round in its own fresh process, is the floor of any
converter that holds the source in memory: ``torch.load`` of every source file (no mmap), kept
alive together -- what converting without streaming needs before it has written a byte.

Run: ``.venv/bin/python bench/convert.py [--quick] [--repeat N] [--workdir DIR [--reuse]]``.
``--quick`` uses a 2-layer, hidden-64 model (seconds; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_model  # noqa: E402
from zerotron.checkpoint import build_metadata  # noqa: E402
from zerotron.checkpoint import layout as names
from zerotron.checkpoint.canonical import Layout, no_decay_names
from zerotron.checkpoint.convert_layout import convert_checkpoint, finish_tag, start_tag
from zerotron.checkpoint.stream_save import Pending, save_streaming
from zerotron.distributed.comm import Group
from zerotron.models.gpt import GPT, GPTConfig

TAG = "iter_0000100"
FULL = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024)
QUICK = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)


def gpt_config(quick: bool) -> GPTConfig:
    shape = QUICK if quick else FULL
    vocab = 1000 if quick else 50257
    padded = -(-vocab // 128) * 128
    return GPTConfig(
        **shape,
        max_position_embeddings=shape["seq_length"],
        vocab_size=padded,
        orig_vocab_size=vocab,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def random_leaf(shape: torch.Size, seed: int, scale: float = 0.02, positive: bool = False):
    def produce() -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(shape, generator=g) * scale
        return t.abs_() if positive else t

    return Pending(shape, torch.float32, produce)


def write_source(root: Path, cfg: GPTConfig) -> Path:
    """A tp1 pp1 ZeRO-0 fp32 checkpoint with Adam state, written one tensor at a time."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(cfg, tp_group=Group.single("tp")).state_dict().items()}
    decay, no_decay = no_decay_names(shapes)
    settings = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, amsgrad=False, maximize=False,
                    foreach=None, capturable=False, differentiable=False, fused=True,
                    decoupled_weight_decay=True, lr_mult=1.0)  # fmt: skip
    groups, state, idx = [], {}, 0
    for members, wd in ((decay, 0.1), (no_decay, 0.0)):
        ids = []
        for name in members:
            seed = 3 * idx
            state[idx] = {
                "step": torch.tensor(100.0),
                "exp_avg": random_leaf(shapes[name], seed + 1, 1e-3),
                "exp_avg_sq": random_leaf(shapes[name], seed + 2, 1e-6, positive=True),
            }
            ids.append(idx)
            idx += 1
        groups.append({"weight_decay": wd, "wd_mult": float(wd > 0), **settings, "params": ids})
    model = {k: random_leaf(s, 10**6 + i) for i, (k, s) in enumerate(shapes.items())}
    tree = {
        "iteration": 100,
        "consumed_train_samples": 51200,
        "consumed_valid_samples": 0,
        "model": model,
        "checkpoint_version": names.CHECKPOINT_VERSION,
        "global_steps": 100,
        "global_samples": 51200,
        "buffer_names": [],
        "optimizer": {
            "optimizer": {"state": state, "param_groups": groups},
            "fp32_from_fp16_params": [[] for _ in groups],
            "grad_scaler": None,
            "num_skipped_steps": 0,
        },
        "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 51200, "min_lr": 3e-5},
    }
    tmp = start_tag(root, TAG)
    (tmp / names.model_file()).parent.mkdir(parents=True)
    save_streaming(tree, tmp / names.model_file())
    meta = build_metadata(
        model_config=cfg.to_dict(),
        vocab_size=cfg.orig_vocab_size,
        padded_vocab_size=cfg.vocab_size,
        tokenizer={"type": "GPT2BPETokenizer"},
        params_dtype="fp32",
    )
    return finish_tag(root, TAG, tmp, meta)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(kind: str, src: str, dst: str) -> None:
    """One measured run in this fresh process; prints a JSON line."""
    before = rss_bytes()
    start = time.perf_counter()
    if kind == "zerotron":
        convert_checkpoint(src, dst, Layout(1, 1, 1, 2, 3))
    else:  # the in-memory floor: every source file loaded and kept
        tag_dir = Path(src) / TAG
        held = [
            torch.load(p, map_location="cpu", weights_only=True)
            for p in sorted(tag_dir.rglob("*.pt"))
        ]
        del held
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_growth": peak - before}))


def run_child(kind: str, src: Path, dst: Path) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(src), str(dst)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--workdir", help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="keep --workdir's source if it is there")
    p.add_argument("--child", nargs=3, metavar=("KIND", "SRC", "DST"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    torch.set_num_threads(1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zerotron-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = gpt_config(args.quick)
    print(f"CPU: {cpu_model()}; load: {os.getloadavg()}; torch {torch.__version__}")
    try:
        ref, src = work / "tp1pp1-z0", work / "tp2pp2-z1"
        if args.reuse and (src / TAG).is_dir():
            print(f"reusing {src} ({mb(dir_bytes(src / TAG))})")
        else:
            t0 = time.perf_counter()
            write_source(ref, cfg)
            t1 = time.perf_counter()
            shutil.rmtree(src, ignore_errors=True)
            convert_checkpoint(ref, src, Layout(2, 2, 1, 1, 1))
            t2 = time.perf_counter()
            print(f"source written in {t1 - t0:.1f} s ({mb(dir_bytes(ref / TAG))}), converted "
                  f"to tp2 pp2 ZeRO-1 in {t2 - t1:.1f} s ({mb(dir_bytes(src / TAG))})")  # fmt: skip
        largest = max(
            (t.numel() * 4 for t in torch.load(src / TAG / names.model_file(0, 0, 2),
                                               weights_only=True, mmap=True)["model"].values()),
        )  # fmt: skip
        largest *= 2  # the source's word embedding, both tensor-parallel halves (fp32)
        rounds: dict[str, list[dict]] = {"zerotron": [], "load-all": []}
        out_bytes = 0
        for r in range(args.repeat):
            for kind in ("zerotron", "load-all"):
                res = run_child(kind, src, work / "out")
                rounds[kind].append(res)
                if kind == "zerotron":
                    out_bytes = dir_bytes(work / "out")
                print(f"round {r + 1} {kind:9s}: {res['seconds']:7.1f} s, peak RSS growth "
                      f"{mb(res['peak_growth'])} ({res['peak_growth'] / largest:.2f}x the "
                      "largest tensor)")  # fmt: skip
        z, base = rounds["zerotron"], rounds["load-all"]
        zt = statistics.median(x["seconds"] for x in z)
        zpeak = max(x["peak_growth"] for x in z)
        bpeak = max(x["peak_growth"] for x in base)
        print(f"tp2 pp2 ZeRO-1 -> tp1 pp1 dp2 ZeRO-3: median {zt:.1f} s, "
              f"{out_bytes / zt / 2**20:.0f} MiB/s written; peak RSS growth {mb(zpeak)} = "
              f"{zpeak / largest:.2f}x the largest tensor ({mb(largest)}); loading the source "
              f"whole takes {mb(bpeak)} ({bpeak / max(zpeak, 1):.1f}x zerotron's)")  # fmt: skip
        print(f"load after: {os.getloadavg()}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
