"""Seeded fuzzing of DeepSpeed JSON configs and Megatron flags (issue 19, Proof: fuzz test).

A bad config must end in a ZerotronError that names a key path or the file, never in a raw
KeyError/TypeError/RecursionError. Plain ``random.Random(seed)`` (no new dependency): every
failure reproduces from its seed, and the seeds that found bugs are kept as named tests.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from zerotron.config import load_deepspeed_config, parse_megatron_args
from zerotron.config.megatron import build_parser
from zerotron.errors import ConfigError, ZerotronError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "deepspeed"
TEXTS = [p.read_bytes() for p in sorted(EXAMPLES.glob("*.json"))]
BASES = [json.loads(t) for t in TEXTS]
VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**70, -(2**70), 1e308, -0.5, 3.7, "", "auto", "x", "1e9",
    "nan", "-3", [], [1], [None], {}, {"a": 1}, {"auto": "auto"}, [[[]]], "AdamW", "cpu",
]  # fmt: skip
EXTRA_KEYS = ["zz", "stag", "enabled", "type", "params", "stage"]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path (dict keys and list indices) in a JSON value."""
    out: list[tuple] = []
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in items:
        out.append((*prefix, key))
        out.extend(_paths(value, (*prefix, key)))
    return out


def mutate(rng: random.Random, config: dict) -> dict:
    """1-3 edits: a value replaced by one of VALUES, a key deleted, or an unknown key added."""
    config = copy.deepcopy(config)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(_paths(config))
        parent: Any = config
        for key in path[:-1]:
            parent = parent[key]
        op = rng.random()
        if op < 0.7 or not isinstance(parent, dict):
            parent[path[-1]] = copy.deepcopy(rng.choice(VALUES))
        elif op < 0.85:
            del parent[path[-1]]
        else:
            parent[rng.choice(EXTRA_KEYS)] = copy.deepcopy(rng.choice(VALUES))
    return config


def mutate_text(rng: random.Random, text: bytes) -> bytes:
    """Byte-level damage: truncation, flipped bytes, random bytes, deep nesting, non-UTF-8."""
    op = rng.randrange(6)
    if op == 0:
        return text[: rng.randrange(len(text))]
    if op == 1:
        data = bytearray(text)
        for _ in range(rng.randint(1, 5)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if op == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if op == 3:
        depth = rng.randint(1, 5000)
        return b'{"zero_optimization": ' + b"[" * depth + b"]" * depth + b"}"
    if op == 4:
        depth = rng.randint(1, 5000)
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b"\xff\xfe" + text


def load_or_error(source: Any, world_size: int = 1) -> ZerotronError | None:
    """Load; None on success, the ZerotronError otherwise (anything else propagates: a bug)."""
    try:
        load_deepspeed_config(source, world_size=world_size)
    except ZerotronError as e:
        return e
    return None


def names_a_key(message: str, config: dict) -> bool:
    keys = {k for path in _paths(config) for k in path if isinstance(k, str)}
    return any(k in message for k in keys) or "." in message.split("\n")[0]


def check_mapping_seed(seed: int) -> None:
    rng = random.Random(seed)
    config = mutate(rng, rng.choice(BASES))
    error = load_or_error(config, world_size=rng.choice([1, 2, 3, 4]))
    if error is not None:
        assert names_a_key(str(error), config), (seed, str(error))


def check_file_seed(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    data = mutate_text(rng, rng.choice(TEXTS))
    path = tmp_path / "ds.json"
    path.write_bytes(data)
    error = load_or_error(str(path))
    if error is not None:
        assert str(path) in str(error) or "_size" in str(error), (seed, str(error))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    if text.lstrip().startswith("{"):
        load_or_error(text)  # a JSON string: the same rules


def test_fuzz_deepspeed_dicts():
    """3000 mutated configs: success or a ZerotronError naming a key (about 1 s)."""
    for seed in range(3000):
        check_mapping_seed(seed)


def test_fuzz_deepspeed_files(tmp_path):
    """25 damaged files (deep nesting is slow to parse): success or an error naming the file."""
    for seed in range(25):
        check_file_seed(seed, tmp_path)


def test_scheduler_type_that_is_an_object_is_a_config_error():
    """Seed 502: scheduler.type = {} raised TypeError (unhashable type: 'dict')."""
    check_mapping_seed(502)
    with pytest.raises(ConfigError, match="scheduler.type"):
        load_deepspeed_config({"train_batch_size": 2, "scheduler": {"type": {"a": 1}}})


@pytest.mark.parametrize(
    "text",
    [
        b'{"zero_optimization": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
    ],
)
def test_deeply_nested_config_file_is_a_config_error(text, tmp_path):
    """Thousands of nested [ or { gave RecursionError from yaml.compose and json.loads."""
    path = tmp_path / "ds.json"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_deepspeed_config(str(path))


def test_nested_500_deep_config_is_refused_before_deepcopy():
    """json parses 500 levels, copy.deepcopy then overflowed: refused with the depth check."""
    text = '{"train_batch_size": 2, "x": ' + "[" * 500 + "]" * 500 + "}"
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_deepspeed_config(text)


def test_auto_scheduler_param_error_names_the_file(tmp_path):
    """An unresolvable "auto" under scheduler.params now carries file:line like the others."""
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": 2,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
            },
            indent=1,
        )
    )
    with pytest.raises(ConfigError, match=f"{path}:"):
        load_deepspeed_config(str(path))


FLAGS = sorted(
    {
        o
        for a in build_parser()._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }
)
FLAG_VALUES = ["0", "-1", "1", "2", "8", "1e9", "-1e30", "nan", "inf", "auto", "", "x", "true",
               "3.5", "99999999999999999999", "/nonexistent", "\x00"]  # fmt: skip
BASE_ARGV = ["--micro-batch-size", "2", "--num-layers", "2", "--hidden-size", "8",
             "--num-attention-heads", "2", "--seq-length", "8",
             "--max-position-embeddings", "8"]  # fmt: skip


def test_fuzz_megatron_flags():
    """300 random flag lists from the real parser: success or ConfigError, never SystemExit."""
    for seed in range(300):
        rng = random.Random(seed)
        argv = list(BASE_ARGV)
        for _ in range(rng.randint(1, 4)):
            argv.append(rng.choice(FLAGS))
            if rng.random() < 0.8:
                argv.append(rng.choice(FLAG_VALUES))
        with contextlib.suppress(ZerotronError):
            parse_megatron_args(argv, world_size=rng.choice([1, 2, 4]))


def test_bad_flag_through_the_cli_is_exit_2_without_traceback(capsys):
    """The CLI turns a flag error into exit 2 and the message, no traceback."""
    import zerotron.cli

    assert zerotron.cli.main(["pretrain", "--micro-batch-size", "x"]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch-size" in err and "Traceback" not in err
