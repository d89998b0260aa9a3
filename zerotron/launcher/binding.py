"""``--bind_cores_to_rank``: each local rank gets an even, disjoint share of the node's cores.

As DeepSpeed's launcher does, the cores (``--bind_core_list "1,3-5,7"``, or all the cores this
launcher may run on) are cut into ``nproc`` equal consecutive shares, the cores left over are not
used, ``OMP_NUM_THREADS`` is the share's size, and a rank whose cores lie in one NUMA node has
its memory bound there with ``numactl`` when it is installed. Differences:

- by default the cores are those of the launcher's CPU affinity (what ``taskset``, a cgroup or
  SLURM gave it), not ``0 .. physical cores - 1``; and a core is a *physical* core: its
  hyperthread siblings go to the same rank (two ranks never share a core), counted once;
- ``--bind_core_list`` is taken CPU by CPU, as given; a CPU the launcher may not use is an error.

The worker binds itself (:mod:`zerotron.launcher.bootstrap`, ``os.sched_setaffinity``) from the
table :func:`rank_cpus` computes here.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

from zerotron.errors import ConfigError

SYSFS_CPU = "/sys/devices/system/cpu"
SYSFS_NODE = "/sys/devices/system/node"
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")
_LIST_FIX = 'give CPU numbers and ranges separated by commas, e.g. --bind_core_list "0-7,16-23"'


def parse_cpu_list(text: str, what: str = "--bind_core_list") -> list[int]:
    """``"1,3-5,7"`` -> ``[1, 3, 4, 5, 7]`` (sorted); ConfigError naming ``what`` if malformed."""
    cpus: list[int] = []
    for item in text.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ConfigError(
                f"{what} {text!r}: {item.strip()!r} is not a CPU or a range", fix=_LIST_FIX
            )
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ConfigError(
                f"{what} {text!r}: range {item.strip()!r} runs backwards", fix=_LIST_FIX
            )
        cpus.extend(range(lo, hi + 1))
    seen: set[int] = set()
    for cpu in cpus:
        if cpu in seen:
            raise ConfigError(f"{what} {text!r}: CPU {cpu} is listed twice", fix=_LIST_FIX)
        seen.add(cpu)
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(cpu)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def physical_cores(cpus: Iterable[int], siblings: dict[int, frozenset[int]]) -> list[list[int]]:
    """``cpus`` grouped by physical core (``siblings[cpu]``: the CPUs sharing its core), ordered
    by their first CPU; a CPU without sibling information is a core of its own."""
    cores: dict[frozenset[int], list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(siblings.get(cpu, frozenset({cpu})), []).append(cpu)
    return sorted(cores.values())


def shares(cores: list[list[int]], nproc: int, source: str) -> list[list[int]]:
    """Local rank ``r``'s CPUs: cores ``r*k .. r*k+k-1`` with ``k = len(cores) // nproc``."""
    k = len(cores) // nproc
    if k < 1:
        raise ConfigError(
            f"--bind_cores_to_rank: {len(cores)} core(s) ({source}) cannot give each of "
            f"{nproc} local ranks a core of its own",
            fix="start fewer ranks per node, or give --bind_core_list with more cores",
        )
    return [sorted(c for core in cores[r * k : (r + 1) * k] for c in core) for r in range(nproc)]


@dataclass(frozen=True)
class Binding:
    """Each local rank's CPUs, and how many cores that is (its OMP_NUM_THREADS)."""

    cpus: list[list[int]]
    cores_per_rank: int

    def describe(self) -> str:
        """``"cores per local rank: 0-1 | 2-3"`` (local rank 0's CPUs, then rank 1's...)."""
        return "cores per local rank: " + " | ".join(format_cpu_list(c) for c in self.cpus)


def rank_cpus(nproc: int, core_list: str | None = None) -> Binding:
    """Each local rank's CPUs on this machine (see the module docstring)."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(
            "--bind_cores_to_rank needs Linux (os.sched_setaffinity)",
            fix="leave out --bind_cores_to_rank/--bind_core_list on this system",
        )
    allowed = sorted(os.sched_getaffinity(0))
    if core_list is None:
        cores = physical_cores(allowed, read_siblings(allowed))
        source = f"CPUs {format_cpu_list(allowed)} of this launcher"
        return Binding(shares(cores, nproc, source), len(cores) // nproc)
    cpus = parse_cpu_list(core_list)
    outside = [c for c in cpus if c not in set(allowed)]
    if outside:
        raise ConfigError(
            f"--bind_core_list {core_list!r}: CPU {outside[0]} is not one this launcher may use "
            f"(it may use {format_cpu_list(allowed)})",
            fix="list CPUs of the launcher's affinity (taskset, cgroup or SLURM allocation)",
        )
    return Binding(
        shares([[c] for c in cpus], nproc, f"--bind_core_list {core_list}"), len(cpus) // nproc
    )


def read_siblings(cpus: Iterable[int], root: str = SYSFS_CPU) -> dict[int, frozenset[int]]:
    """Each CPU's hyperthread siblings, from sysfs (missing: the CPU is left out)."""
    out = {}
    for cpu in cpus:
        path = os.path.join(root, f"cpu{cpu}", "topology", "thread_siblings_list")
        try:
            with open(path, encoding="ascii") as f:
                out[cpu] = frozenset(parse_cpu_list(f.read().strip(), path))
        except (OSError, ConfigError):
            continue
    return out


def numa_nodes(root: str = SYSFS_NODE) -> dict[int, frozenset[int]]:
    """NUMA node -> its CPUs, from sysfs (nodes without CPUs left out)."""
    nodes = {}
    for path in glob.glob(os.path.join(root, "node[0-9]*", "cpulist")):
        node = int(os.path.basename(os.path.dirname(path))[4:])
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            nodes[node] = frozenset(parse_cpu_list(text, path))
    return nodes


def memory_nodes(per_rank: list[list[int]], nodes: dict[int, frozenset[int]]) -> list[int | None]:
    """The NUMA node holding all of each rank's CPUs (None: they span nodes, or one node only)."""
    if len(nodes) < 2:
        return [None] * len(per_rank)  # one node: binding memory changes nothing
    return [
        next((n for n, c in sorted(nodes.items()) if set(cpus) <= c), None) for cpus in per_rank
    ]


def bootstrap_options(per_rank: list[list[int]]) -> list[str]:
    """The :mod:`zerotron.launcher.bootstrap` options that bind each local rank."""
    opts = ["--cpus", ";".join(",".join(map(str, cpus)) for cpus in per_rank)]
    mem = memory_nodes(per_rank, numa_nodes())
    numactl = shutil.which("numactl")
    if numactl and any(n is not None for n in mem):
        opts += ["--membind", ";".join("" if n is None else str(n) for n in mem)]
        opts += ["--numactl", numactl]
    return opts
