"""``zerotron checkpoint verify|info``: check a checkpoint, or describe it.

zerotron checkpoint verify CKPT [--tag T]       # checksums + every rank file the layout implies
zerotron checkpoint info CKPT [--tag T] [--json]  # layout, model, progress, sizes, targets

``verify`` checks every tag under CKPT (or only ``--tag``), prints one line per tag and one per
bad file, and exits 1 if any tag is bad (0 when all are good).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zerotron.checkpoint.info import checkpoint_info, format_info
from zerotron.checkpoint.load import read_latest_tag
from zerotron.checkpoint.metadata import foreign_checkpoint
from zerotron.checkpoint.verify import has_checksums, tag_problems, tags_newest_first
from zerotron.config.args import ArgumentParser
from zerotron.errors import CheckpointError


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="zerotron checkpoint", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="action", required=True, metavar="{verify,info}")
    v = sub.add_parser("verify", help="check checksums and completeness; exit 1 naming bad files")
    v.add_argument("dir", metavar="CKPT", help="a checkpoint directory (the one given to --save)")
    v.add_argument("--tag", help="check only this tag (default: every tag there)")
    i = sub.add_parser("info", help="layout, model shape, progress, file sizes, convert targets")
    i.add_argument("dir", metavar="CKPT", help="a checkpoint directory (the one given to --save)")
    i.add_argument("--tag", help="describe this tag (default: the latest)")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def verify_main(load_dir: str, tag: str | None) -> int:
    """Print each tag's verdict and its bad files; 1 if any tag is bad."""
    tags = [tag] if tag else tags_newest_first(load_dir)
    if not tags:
        latest = read_latest_tag(load_dir)  # another tool's tracker, perhaps
        foreign = foreign_checkpoint(Path(load_dir) / latest) if latest else None
        raise foreign or CheckpointError(
            "no checkpoint here: no tag directory with a metadata.json",
            where=load_dir,
            fix="pass the directory given to --save",
        )
    bad = 0
    for t in tags:
        problems = tag_problems(load_dir, t)
        if problems:
            bad += 1
            print(f"{t}: BAD ({len(problems)} problem{'s' * (len(problems) > 1)})")
            for pr in problems:
                print(f"  {pr}")
        else:
            checked = "checksums and layout" if has_checksums(load_dir, t) else (
                "layout only: saved without checksums"
            )  # fmt: skip
            print(f"{t}: ok ({checked})")
    if bad:
        print(f"{bad} of {len(tags)} tag(s) bad", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "verify":
        return verify_main(args.dir, args.tag)
    info = checkpoint_info(args.dir, args.tag)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
