"""SLURM allocations: the hosts and slots of the job ``salloc``/``sbatch`` gave, and each node's
rank under ``srun``, read from SLURM's environment.

Without a hostfile, ``zerotron launch --launcher slurm`` (and ``--no_ssh`` inside an allocation)
takes its pool of ``{host: slots}`` from:

- the nodes: ``SLURM_STEP_NODELIST`` (inside ``srun``), else ``SLURM_JOB_NODELIST``, else
  ``SLURM_NODELIST``, in SLURM's compressed form (``gpu[01-03,07],cpu5``), checked against
  ``SLURM_STEP_NUM_NODES`` / ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES`` when set;
- the slots of every node: the GPUs (``SLURM_GPUS_PER_NODE``, e.g. ``8`` or ``a100:8``, else
  ``SLURM_GPUS_ON_NODE``), else the tasks (``SLURM_NTASKS_PER_NODE``, else
  ``SLURM_TASKS_PER_NODE``, e.g. ``2(x3),1``), else 1;
- the default ``--master_port``: ``20000 + SLURM_JOB_ID % 10000``, so that jobs sharing a node
  do not meet on the same port.

Under ``srun``, a ``--no_ssh`` launcher without ``--node_rank`` is node ``SLURM_NODEID``. Every
malformed value is a ConfigError naming its variable.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Mapping

from zerotron.errors import ConfigError
from zerotron.launcher.hostfile import MAX_SLOTS, valid_host

NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
MAX_NODES = 65536  # a longer expansion is a typo, not a cluster
PORT_BASE, PORT_SPAN = 20000, 10000
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")
_REPEAT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?\Z")


def in_allocation(environ: Mapping[str, str]) -> bool:
    """Whether this process runs inside a SLURM job (``salloc``, ``sbatch`` or ``srun``)."""
    return "SLURM_JOB_ID" in environ or any(v in environ for v in NODELIST_VARS)


def expand_nodelist(text: str, var: str = "SLURM_JOB_NODELIST") -> list[str]:
    """``"gpu[01-03,07],cpu5"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]``.

    Ranges keep the zero padding of their first number; several bracket groups in one name
    expand to every combination, in order. ConfigError naming ``var`` when malformed.
    """
    hosts: list[str] = []
    for item in _split_top(text, var):
        parts: list[list[str]] = []
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            parts.append([literal])
            if group:
                parts.append(_expand_group(group, text, var))
        for combo in itertools.product(*parts):
            hosts.append("".join(combo))
            if len(hosts) > MAX_NODES:
                raise _bad(var, text, f"expands to more than {MAX_NODES} nodes")
    for host in hosts:
        if not valid_host(host):
            raise _bad(var, text, f"{host!r} is not a host name")
    if len(set(hosts)) != len(hosts):
        twice = next(h for h in hosts if hosts.count(h) > 1)
        raise _bad(var, text, f"names {twice!r} twice")
    return hosts


def _split_top(text: str, var: str) -> list[str]:
    """The comma-separated items of ``text`` outside brackets (brackets checked to pair up)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise _bad(var, text, "brackets do not pair up")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(var, text, "brackets do not pair up")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise _bad(var, text, "an empty node name")
    if "[]" in text:
        raise _bad(var, text, "empty brackets")
    return [item.strip() for item in items]


def _expand_group(group: str, text: str, var: str) -> list[str]:
    out = []
    for piece in group.split(","):
        m = _RANGE.match(piece.strip())
        if not m:
            raise _bad(var, text, f"[{group}]: {piece!r} is not a number or a range N-M")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise _bad(var, text, f"[{group}]: range {piece!r} runs backwards")
        if hi - lo >= MAX_NODES:
            raise _bad(var, text, f"expands to more than {MAX_NODES} nodes")
        out += [str(n).zfill(len(lo_text)) for n in range(lo, hi + 1)]
    return out


def _bad(var: str, text: str, what: str) -> ConfigError:
    return ConfigError(
        f"{var}={text!r}: {what}",
        where=var,
        fix="SLURM sets it as a compressed node list such as gpu[01-03,07],cpu5; run inside "
        "salloc/sbatch without changing it, or give --hostfile",
    )


def allocation(environ: Mapping[str, str]) -> dict[str, int]:
    """The allocation's ``{host: slots}``, in SLURM's node order (see the module docstring)."""
    var = next((v for v in NODELIST_VARS if environ.get(v)), None)
    if var is None:
        raise ConfigError(
            "not inside a SLURM allocation: SLURM_JOB_NODELIST is not set",
            where="--launcher slurm",
            fix="run `zerotron launch --launcher slurm` inside salloc or an sbatch script, or "
            "give --hostfile",
        )
    hosts = expand_nodelist(environ[var], var)
    counts = NNODES_VARS[:1] if var == "SLURM_STEP_NODELIST" else NNODES_VARS[1:]
    count_var = next((v for v in counts if environ.get(v)), None)
    if count_var is not None and _number(environ, count_var) != len(hosts):
        raise ConfigError(
            f"{var} names {len(hosts)} node(s) but {count_var}={environ[count_var]}",
            where=var,
            fix="run inside the allocation SLURM made, without changing its SLURM_* variables",
        )
    slots = _slots(environ, len(hosts))
    return dict(zip(hosts, slots, strict=True))


def _slots(environ: Mapping[str, str], nodes: int) -> list[int]:
    if environ.get("SLURM_GPUS_PER_NODE"):
        return [_gpus(environ["SLURM_GPUS_PER_NODE"])] * nodes
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(var):
            return [_number(environ, var)] * nodes
    if environ.get("SLURM_TASKS_PER_NODE"):
        per_node = _repeats(environ["SLURM_TASKS_PER_NODE"])
        if len(per_node) != nodes:
            raise ConfigError(
                f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']} gives "
                f"{len(per_node)} node(s), the node list {nodes}",
                where="SLURM_TASKS_PER_NODE",
            )
        return per_node
    return [1] * nodes


def _gpus(text: str) -> int:
    """``"8"``, ``"a100:8"`` or ``"a100:4,v100:2"`` -> the number of GPUs (summed)."""
    total = 0
    for item in text.split(","):
        count = item.rsplit(":", 1)[-1].strip()
        if not count.isdigit():
            raise ConfigError(
                f"SLURM_GPUS_PER_NODE={text!r}: {item!r} is not COUNT or TYPE:COUNT",
                where="SLURM_GPUS_PER_NODE",
                fix="request GPUs as sbatch --gpus-per-node=8 (or TYPE:8)",
            )
        total += int(count)
    return _checked(total, "SLURM_GPUS_PER_NODE", text)


def _repeats(text: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (SLURM_TASKS_PER_NODE)."""
    out: list[int] = []
    for item in text.split(","):
        m = _REPEAT.match(item.strip())
        if not m:
            raise ConfigError(
                f"SLURM_TASKS_PER_NODE={text!r}: {item!r} is not N or N(xK)",
                where="SLURM_TASKS_PER_NODE",
            )
        out += [_checked(int(m.group(1)), "SLURM_TASKS_PER_NODE", text)] * int(m.group(2) or 1)
    return out


def _number(environ: Mapping[str, str], var: str) -> int:
    text = environ[var].strip()
    if not text.isdigit():
        raise ConfigError(f"{var}={environ[var]!r} is not a whole number", where=var)
    return _checked(int(text), var, text)


def _checked(n: int, var: str, text: str) -> int:
    if not 1 <= n <= MAX_SLOTS:
        raise ConfigError(f"{var}={text!r}: {n} is not in 1 .. {MAX_SLOTS}", where=var)
    return n


def node_rank(environ: Mapping[str, str]) -> int | None:
    """This node's rank under ``srun`` (``SLURM_NODEID``), None outside SLURM.

    Two launchers on one node (``srun`` with more than one task per node) would both claim it:
    refused, naming ``SLURM_LOCALID``.
    """
    if "SLURM_NODEID" not in environ:
        return None
    if environ.get("SLURM_LOCALID", "0") != "0":
        raise ConfigError(
            f"this is task {environ['SLURM_LOCALID']} of its node (SLURM_LOCALID): "
            "zerotron launch starts all the ranks of a node itself",
            where="SLURM_LOCALID",
            fix="start one launcher per node: srun --ntasks-per-node=1 zerotron launch --no_ssh",
        )
    text = environ["SLURM_NODEID"].strip()
    if not text.isdigit():
        raise ConfigError(
            f"SLURM_NODEID={environ['SLURM_NODEID']!r} is not a node number", where="SLURM_NODEID"
        )
    return int(text)


def default_port(environ: Mapping[str, str]) -> int | None:
    """``20000 + SLURM_JOB_ID % 10000`` (None without a job id)."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    return PORT_BASE + int(job) % PORT_SPAN if job.isdigit() else None


def fill_in(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Take what ``args`` leave open from the SLURM allocation: without a hostfile, the hosts and
    slots of ``--launcher slurm`` or of ``--no_ssh`` inside an allocation (``args.allocation``),
    with its default port; the node rank of ``--no_ssh`` under ``srun``."""
    if args.hostfile is not None:
        return
    if args.launcher != "slurm" and not (args.no_ssh and in_allocation(environ)):
        return
    args.allocation = allocation(environ)
    if args.master_port is None and len(args.allocation) > 1:
        args.master_port = default_port(environ)
    if args.no_ssh and args.node_rank is None:
        args.node_rank = node_rank(environ)
