"""Seeded fuzzing of hostfiles and --include/--exclude/--num_nodes/--num_gpus (issue 19, Proof:
fuzz test; issue 15: "Hostfile fuzz").

A malformed hostfile must end in a ConfigError naming the file and the offending line (or the
file, when it has no hosts or cannot be read); a bad selection in a ConfigError naming the flag.
Anything else must be a valid resource map, and the commands built from it must split back into
their words. Never another exception. Plain ``random.Random(seed)``: every failure reproduces
from its seed; each test stops after a few seconds.
"""

from __future__ import annotations

import random
import re
import shlex
import time

import pytest

from zerotron.errors import ConfigError
from zerotron.launcher import launch, multinode
from zerotron.launcher.flags import LAUNCHERS
from zerotron.launcher.hostfile import MAX_SLOTS, read_hostfile, select_resources

SEEDS = range(3)
BUDGET_S = 0.5  # per seed
HOSTS = ["w0", "w1", "node-2.example", "_x", "10.0.0.7", "W0"]
BAD_HOSTS = ["-oProxyCommand=x", "a;b", "$(x)", "w@1", "w:1", "ä", ".hidden", "'q'", "a\\b"]
SLOT_VALUES = ["1", "2", "8", "0", "-1", "01", "1.5", "", "x", "٣", "99999999999999", "65536"]
KEYS = ["slots", "slots", "slots", "max_slots", "Slots", "gpus", ""]
JUNK = ["#", "# c", "\t", "  ", "=", "slots", "==", "\x00", "\u00a0", "\\"]
LINE_ERRORS = re.compile(r"(.+):(\d+)\Z")


def _field(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.6:
        return f"{rng.choice(KEYS)}={rng.choice(SLOT_VALUES)}"
    return rng.choice(JUNK + SLOT_VALUES)


def _line(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.55:
        host = rng.choice(HOSTS) if rng.random() < 0.85 else rng.choice(BAD_HOSTS)
        fields = [f"slots={rng.randint(1, 9)}"] if rng.random() < 0.7 else []
        fields += [_field(rng) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
        sep = rng.choice([" ", "  ", "\t"])
        tail = rng.choice(["", "", " # comment", "#x"])
        return sep.join([host, *fields]) + tail
    if roll < 0.75:
        return rng.choice(["", "   ", "# comment", "  # indented"])
    return " ".join(rng.choice(JUNK + HOSTS + BAD_HOSTS) for _ in range(rng.randint(1, 3)))


def _hostfile(rng: random.Random) -> bytes:
    text = rng.choice(["\n", "\r\n"]).join(_line(rng) for _ in range(rng.randint(0, 6)))
    data = text.encode()
    if rng.random() < 0.05:  # not UTF-8
        data += b"\xff\xfe"
    return data


def _spec(rng: random.Random, hosts: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(1, 3)):
        host = rng.choice(hosts + ["nope", "", "w0 "]) if hosts else "w0"
        if rng.random() < 0.5:
            slots = [rng.choice(["0", "1", "2", "3", "9", "", "x", "-1", " 1"]) for _ in range(2)]
            host += ":" + ",".join(slots[: rng.randint(1, 2)])
        parts.append(host)
    return rng.choice(["@", "@", "@@", ","]).join(parts)


def _check_pool(pool: dict[str, int], data: bytes) -> None:
    assert pool and all(1 <= n <= MAX_SLOTS for n in pool.values())
    hosts = [
        line.split("#", 1)[0].split()[0]
        for line in data.decode().splitlines()
        if line.split("#", 1)[0].strip()
    ]
    assert list(pool) == hosts  # every host line, in file order, once


def _check_line_error(e: ConfigError, path: str, data: bytes) -> None:
    if e.where == path:  # about the whole file
        assert e.what.startswith(("the hostfile lists no hosts", "cannot read the hostfile"))
        return
    m = LINE_ERRORS.match(e.where or "")
    assert m and m.group(1) == path, e
    lines = data.decode().splitlines()
    number = int(m.group(2))
    assert 1 <= number <= len(lines) and lines[number - 1].split("#", 1)[0].strip()


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_hostfiles_give_a_map_or_an_error_naming_the_line(seed, tmp_path):
    rng = random.Random(seed)
    path = str(tmp_path / "hosts")
    deadline, cases, errors = time.monotonic() + BUDGET_S, 0, 0
    while time.monotonic() < deadline:
        data = _hostfile(rng)
        with open(path, "wb") as f:
            f.write(data)
        try:
            pool = read_hostfile(path)
        except ConfigError as e:
            _check_line_error(e, path, data)
            errors += 1
        else:
            _check_pool(pool, data)
        cases += 1
    assert cases >= 20 and 0 < errors < cases  # both outcomes were exercised


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_selections_give_a_valid_map_or_an_error_naming_the_flag(seed):
    rng = random.Random(1000 + seed)
    deadline, cases, errors = time.monotonic() + BUDGET_S, 0, 0
    while time.monotonic() < deadline:
        pool = {h: rng.randint(1, 4) for h in rng.sample(HOSTS, rng.randint(1, 4))}
        include = _spec(rng, list(pool)) if rng.random() < 0.4 else ""
        exclude = _spec(rng, list(pool)) if rng.random() < 0.4 else ""
        num_nodes = rng.choice([None, None, None, -1, 0, 1, 2, 5])
        num_gpus = rng.choice([None, None, None, -1, 0, 1, 3, 9])
        try:
            chosen = select_resources(pool, include, exclude, num_nodes, num_gpus)
        except ConfigError as e:
            assert e.where in (None, "--include", "--exclude") and e.fix, e
            errors += 1
        else:
            order = [h for h in pool if h in chosen]
            assert list(chosen) == order and chosen
            for host, slots in chosen.items():
                assert slots and slots == sorted(set(slots))
                assert all(0 <= s < pool[host] for s in slots)
            if num_nodes is not None:
                assert len(chosen) == num_nodes
            if num_gpus is not None:
                assert all(len(s) == num_gpus for s in chosen.values())
        cases += 1
    assert cases >= 20 and 0 < errors < cases


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_jobs_print_commands_that_split_back(seed, tmp_path, monkeypatch):
    """Through the flags: a plan, or a ConfigError; each command line splits into its argv."""
    rng = random.Random(2000 + seed)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.py").write_text("")
    deadline, cases = time.monotonic() + BUDGET_S, 0
    while time.monotonic() < deadline:
        (tmp_path / "hosts").write_bytes(_hostfile(rng))
        argv = ["--hostfile", "hosts", "--launcher", rng.choice(LAUNCHERS)]
        if rng.random() < 0.5:
            argv += [rng.choice(["-i", "-e"]), _spec(rng, HOSTS[:3])]
        program = ["t.py", *rng.sample(["a b", "$(x)", "'", '"', ";", "-e", "%n"], 3)]
        try:
            plan = multinode.plan(launch._parse(argv + program))
        except ConfigError as e:
            assert e.where or str(e).startswith("--"), e  # names the file:line or the flag
        else:
            for command in plan.commands:
                line = shlex.split(command.line())
                assert line[line.index(command.argv[0]) :] == command.argv
                assert command.argv[-3:] == program[1:] or command.argv[-1].endswith(
                    " ".join(shlex.quote(w) for w in program)
                )
        cases += 1
    assert cases >= 10
