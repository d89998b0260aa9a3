"""Hostfiles and resource selection: which hosts a multi-node job runs on, and which slots.

A hostfile (DeepSpeed's and MPI's format) lists one host per line with its number of slots
(GPUs, or processes on a CPU host)::

    # two GPU boxes
    worker-0 slots=8
    worker-1 slots=8   # a comment may end a line

From that pool, ``--include``/``--exclude`` (``NODE_SPEC[@NODE_SPEC...]`` with ``NODE_SPEC =
HOST[:SLOT[,SLOT...]]``) or ``--num_nodes``/``--num_gpus`` pick the resources, with DeepSpeed's
meaning: ``-i "w0@w1:0,2"`` is every slot of ``w0`` and slots 0 and 2 of ``w1``; ``-e "w1:0"`` is
everything but slot 0 of ``w1``; ``--num_nodes N`` keeps the first N hosts, ``--num_gpus G`` the
first G slots of each. The result is an ordered ``{host: [slot, ...]}`` map, in hostfile order
(node ``i`` of the job is its ``i``-th host).

Unlike DeepSpeed, every mistake is an error naming the file and line (or the flag) and what to do:
a missing hostfile, a bad line, a duplicate host, slots that are not a positive integer, an
unknown key, an unknown host or slot in ``--include``, asking for more nodes or slots than exist.
Host names are restricted to letters, digits, ``.``, ``-`` and ``_`` so that no hostfile text
can be read as a command-line option or shell syntax on the way to ``ssh``.
"""

from __future__ import annotations

import re

from zerotron.errors import ConfigError

MAX_SLOTS = 65536  # more is a typo, not a machine
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
_SLOTS = re.compile(r"[0-9]+\Z")
_LINE_FIX = "write one host per line as 'HOST slots=N' (N >= 1); '#' starts a comment"


def valid_host(name: str) -> bool:
    """Whether ``name`` is a host name zerotron accepts (nothing a shell or ssh could misread)."""
    return bool(_HOST.match(name))


def read_hostfile(path: str) -> dict[str, int]:
    """The hosts of a hostfile and their slot counts, in file order; ConfigError if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ConfigError(
            f"cannot read the hostfile: {reason}",
            where=path,
            fix="give --hostfile the path of a readable text file of 'HOST slots=N' lines",
        ) from None
    return parse_hostfile(text, path)


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile ``text`` (``source`` names it in errors) into ``{host: slots}``."""
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        host, *fields = line.split()
        if not _HOST.match(host):
            raise ConfigError(
                f"bad host name {host!r}",
                where=where,
                fix="host names may hold letters, digits, '.', '-' and '_' and start with a "
                "letter, digit or '_'; " + _LINE_FIX,
            )
        if host in pool:
            raise ConfigError(
                f"host {host!r} is listed twice (first on line {first_line[host]})",
                where=where,
                fix="list each host once, with all its slots",
            )
        pool[host] = _slots(fields, where)
        first_line[host] = number
    if not pool:
        raise ConfigError("the hostfile lists no hosts", where=source, fix=_LINE_FIX)
    return pool


def _slots(fields: list[str], where: str) -> int:
    """The N of the line's single ``slots=N`` field."""
    slots = None
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq:
            raise ConfigError(f"unexpected {field!r} (not KEY=VALUE)", where=where, fix=_LINE_FIX)
        if key != "slots":
            raise ConfigError(
                f"unknown key {key!r}",
                where=where,
                fix="the only key zerotron reads is slots=N; " + _LINE_FIX,
            )
        if slots is not None:
            raise ConfigError("slots= is given twice", where=where, fix=_LINE_FIX)
        if not _SLOTS.match(value) or not 1 <= int(value) <= MAX_SLOTS:
            raise ConfigError(
                f"slots={value} is not a whole number in 1 .. {MAX_SLOTS}",
                where=where,
                fix="give the number of GPUs (or processes) of the host, e.g. slots=8",
            )
        slots = int(value)
    if slots is None:
        raise ConfigError("no slots=N", where=where, fix=_LINE_FIX)
    return slots


def parse_node_specs(text: str, flag: str) -> dict[str, list[int] | None]:
    """``"w0@w1:0,2"`` -> ``{"w0": None, "w1": [0, 2]}`` (None: every slot).

    A host named twice gets the union of its slots (all of them if it is once named bare).
    """
    specs: dict[str, list[int] | None] = {}
    fix = f'write {flag} as HOST[:SLOT[,SLOT...]][@HOST...], e.g. {flag} "w0@w1:0,2"'
    for spec in text.split("@"):
        host, colon, slot_text = spec.strip().partition(":")
        if not _HOST.match(host):
            what = "an empty host name" if not host else f"bad host name {host!r}"
            raise ConfigError(f"{what} in {text!r}", where=flag, fix=fix)
        slots: list[int] | None = None
        if colon:
            items = [s.strip() for s in slot_text.split(",")]
            bad = [s for s in items if not _SLOTS.match(s) or int(s) >= MAX_SLOTS]
            if bad:
                raise ConfigError(
                    f"slot {bad[0]!r} of host {host!r} is not a slot number", where=flag, fix=fix
                )
            slots = [int(s) for s in items]
        if host in specs:
            before = specs[host]
            slots = None if before is None or slots is None else before + slots
        specs[host] = None if slots is None else sorted(set(slots))
    return specs


def select_resources(
    pool: dict[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> dict[str, list[int]]:
    """The hosts and slots the job runs on: ``pool`` filtered as DeepSpeed's launcher does.

    ``include`` and ``exclude`` are mutually exclusive, and neither goes with ``num_nodes`` /
    ``num_gpus``. Hosts keep the pool's order; every host in the result has at least one slot.
    """
    if include and exclude:
        raise ConfigError(
            "--include and --exclude cannot be used together",
            fix="name what to use with --include, or what to leave out with --exclude",
        )
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise ConfigError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude",
            fix="select hosts and slots either by name (--include/--exclude) or by count",
        )
    chosen = {host: list(range(n)) for host, n in pool.items()}
    if include or exclude:
        flag = "--include" if include else "--exclude"
        specs = parse_node_specs(include or exclude, flag)
        _check_known(specs, pool, flag)
        if include:
            chosen = {
                h: s if specs[h] is None else specs[h] for h, s in chosen.items() if h in specs
            }
        for host, slots in specs.items() if exclude else ():
            chosen[host] = [] if slots is None else [s for s in chosen[host] if s not in slots]
        chosen = {host: slots for host, slots in chosen.items() if slots}
        if not chosen:
            raise ConfigError(
                f"{flag} {include or exclude!r} leaves no host to run on",
                fix="keep at least one slot of one host",
            )
    if num_nodes is not None:
        chosen = _first_nodes(chosen, num_nodes)
    if num_gpus is not None:
        chosen = _first_slots(chosen, num_gpus)
    return chosen


def _check_known(specs: dict[str, list[int] | None], pool: dict[str, int], flag: str) -> None:
    for host, slots in specs.items():
        if host not in pool:
            raise ConfigError(
                f"host {host!r} is not in the hostfile",
                where=flag,
                fix="name hosts of the hostfile: " + ", ".join(pool),
            )
        missing = [s for s in slots or () if s >= pool[host]]
        if missing:
            raise ConfigError(
                f"host {host!r} has no slot {missing[0]} (it has slots=" + f"{pool[host]})",
                where=flag,
                fix=f"its slots are numbered 0 .. {pool[host] - 1}",
            )


def _first_nodes(chosen: dict[str, list[int]], num_nodes: int) -> dict[str, list[int]]:
    if not 1 <= num_nodes <= len(chosen):
        raise ConfigError(
            f"--num_nodes {num_nodes}: the hostfile has {len(chosen)} host(s)",
            fix=f"give --num_nodes in 1 .. {len(chosen)}, or add hosts to the hostfile",
        )
    return dict(list(chosen.items())[:num_nodes])


def _first_slots(chosen: dict[str, list[int]], num_gpus: int) -> dict[str, list[int]]:
    short = [host for host, slots in chosen.items() if len(slots) < num_gpus]
    if num_gpus < 1 or short:
        fewest = min(len(slots) for slots in chosen.values())
        raise ConfigError(
            f"--num_gpus {num_gpus}: "
            + (f"host {short[0]!r} has {len(chosen[short[0]])} slot(s)" if short else "not >= 1"),
            fix=f"give --num_gpus in 1 .. {fewest} (the fewest slots of a selected host)",
        )
    return {host: slots[:num_gpus] for host, slots in chosen.items()}
