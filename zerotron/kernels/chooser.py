"""Kernel choices made by measuring the candidates on this machine, cached, like cuDNN's benchmark.

Which CPU fast path wins is not a property of the CPU's vendor: oneDNN's fp32 GEMM beats
torch.mm's MKL one on an AVX-512 AMD EPYC and loses to it on an AVX2 one; SDPA's MATH kernel
kept in 16 bits beats flash where 16-bit matmuls are native and loses where they are emulated
(bench/README.md). So at the first run of a model shape on a machine, :func:`choose_kernels`
times each applicable choice's candidates on the model's own shapes and keeps the fastest:

- ``linear`` (fp32, oneDNN built in): ``onednn`` or ``torch``, a forward and backward of the
  block's four linear layers (``[tokens, h]`` by ``3h``, ``h``, ``4h`` and ``4h -> h``);
- ``matmul16`` (16-bit): ``native`` (torch's 16-bit GEMM) or ``fp32`` (the fp32 GEMM on upcast
  copies, :mod:`~zerotron.kernels.upcast`), the same four linear layers in the model's dtype;
- ``attention`` (16-bit): ``math16``, ``sdpa`` or ``fp32`` (SDPA on fp32 copies), forward and
  backward of causal attention on ``[micro batch, heads, seq, head dim]``;
- ``loss_chunk`` (fp32 with ``linear=onednn``): 1,024 to 8,192 vocabulary columns per oneDNN
  slice of the fused loss, forward and backward on up to 256 tokens and 16,384 columns.

Each candidate runs once untimed, then up to ``reps`` times; its time is the fastest rep (the
least disturbed by other processes); a candidate slower than twice the best after a rep is not
repeated, and a choice stops repeating once it has spent ``budget_s``. The whole measurement takes
a few seconds on one CPU core for GPT-2-small shapes (the line :meth:`Chosen.line` prints says
how long).

The result is cached in ``kernels.json`` under ``$ZEROTRON_CACHE_DIR`` (default
``~/.cache/zerotron``), one entry per machine (CPU model and a hash of its flags), torch version
and shape class (:meth:`KernelShape.key`: dtype, hidden size, heads, and powers of two of the
sequence, tokens per micro-batch and vocabulary, threads), written whole and crash-safely; a
cached entry is used without measuring again, unless it was measured before a candidate was
added to its choice (a newer zerotron): that choice alone is measured again. A file that
cannot be read is reported with a warning, ignored, and rewritten.

Forcing: ``ZEROTRON_KERNELS=linear=torch,attention=sdpa,loss_chunk=4096`` (or ``zerotron
pretrain --kernels ...``, which wins over the variable) sets those choices without measuring.
The off switches of :mod:`~zerotron.kernels.policy` keep working: ``ZEROTRON_ONEDNN=0`` and
``ZEROTRON_MATH_ATTENTION=0`` count as forcing the plain twin (``linear=torch``,
``attention=sdpa``), and with ``ZEROTRON_FUSED_LOSS=0`` ``loss_chunk`` has nothing to choose.
Each candidate computes exactly what its path computes when forced (tests/test_kernel_chooser.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotron.distributed import comm
from zerotron.errors import ConfigError
from zerotron.fileio import atomic_write_text
from zerotron.kernels.policy import ENV_SWITCHES, KernelChoices, set_choices

if TYPE_CHECKING:
    from zerotron.config import Config

ENV = "ZEROTRON_KERNELS"
CACHE_ENV = "ZEROTRON_CACHE_DIR"
CACHE_FILE = "kernels.json"
CACHE_VERSION = 1

CANDIDATES: dict[str, tuple[Any, ...]] = {
    "linear": ("onednn", "torch"),
    "matmul16": ("native", "fp32"),
    "attention": ("math16", "sdpa", "fp32"),
    "loss_chunk": (1024, 2048, 4096, 8192),
}
"""Each choice's candidates; the first is the default where nothing is measured."""

# the plain twin an off switch (policy.ENV_SWITCHES) forces
_OFF_SWITCH = {
    "onednn_linear": ("linear", "torch"),
    "upcast_16bit": ("matmul16", "native"),
    "attention_16bit": ("attention", "sdpa"),
}

Runner = Callable[[], None]
"""One timed call of a candidate (a forward and backward on the model's shapes)."""


@dataclass(frozen=True)
class KernelShape:
    """The model shapes a choice is measured on (one micro-batch on one process).

    ``hidden``, ``heads`` and ``vocab`` are the whole model's; with ``tp`` > 1 the candidates
    run on one tensor-parallel rank's shards (``3h/tp`` QKV and ``4h/tp`` MLP columns, ``heads/tp``
    heads, ``vocab/tp`` output columns), which is what that rank multiplies.
    """

    hidden: int
    heads: int
    seq: int
    micro_batch: int
    vocab: int
    dtype: str  # "fp32", "bf16" or "fp16"
    threads: int = field(default_factory=torch.get_num_threads)
    tp: int = 1

    def key(self) -> str:
        """The shape class of the cache: choices measured on one shape hold for its class."""
        return (
            f"{self.dtype} h{self.hidden} a{self.heads} s~{_pow2(self.seq)} "
            f"t~{_pow2(self.seq * self.micro_batch)} v~{_pow2(self.vocab)} threads{self.threads}"
            + (f" tp{self.tp}" if self.tp > 1 else "")
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @classmethod
    def from_config(cls, cfg: Config, vocab_size: int) -> KernelShape:
        """The shapes of ``zerotron pretrain``'s GPT for ``cfg`` (the tokenizer's
        ``vocab_size``) on one of its tensor-parallel ranks, with torch's thread count."""
        m = cfg.model
        return cls(
            hidden=m.hidden_size,
            heads=m.num_attention_heads,
            seq=m.seq_length,
            micro_batch=cfg.training.micro_batch_size,
            vocab=vocab_size,
            dtype=cfg.precision.params_dtype,
            tp=cfg.parallel.tensor_model_parallel_size,
        )


@dataclass
class Chosen:
    """What :func:`choose_kernels` chose and how: ``how[name]`` is ``measured``, ``cached``,
    ``forced``, ``default`` (not cached, and measuring was not allowed) or ``n/a`` (the path does
    not run for this dtype or device)."""

    choices: KernelChoices
    how: dict[str, str]
    seconds: float = 0.0
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    cache: Path | None = None

    def line(self) -> str:
        """One line for the log: each choice, how it was made, and the measurement's time."""
        parts = []
        for name in CANDIDATES:
            how = self.how.get(name, "n/a")
            value = "-" if how == "n/a" else getattr(self.choices, name)
            parts.append(f"{name}={value} ({how})")
        tail = ""
        if "measured" in self.how.values():
            tail = f"; measured in {self.seconds:.1f} s, cached in {self.cache}"
        elif "cached" in self.how.values():
            tail = f"; from {self.cache}"
        return "kernels: " + ", ".join(parts) + tail

    def to_text(self) -> str:
        """JSON of everything here (what one rank sends the others)."""
        data = {
            "choices": dataclasses.asdict(self.choices),
            "how": self.how,
            "seconds": self.seconds,
            "timings_ms": self.timings_ms,
            "cache": None if self.cache is None else str(self.cache),
        }
        return json.dumps(data)

    @classmethod
    def from_text(cls, text: str) -> Chosen:
        """The :class:`Chosen` that :meth:`to_text` wrote."""
        data = json.loads(text)
        cache = data["cache"]
        return cls(
            KernelChoices(**data["choices"]),
            data["how"],
            data["seconds"],
            data["timings_ms"],
            None if cache is None else Path(cache),
        )


# ---- the machine and the cache ---------------------------------------------------------------


def machine_key() -> str:
    """This CPU's model name and a hash of its feature flags (Linux: /proc/cpuinfo)."""
    model, flags = "", ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = (s.strip() for s in line.partition(":"))
        if name == "model name" and not model:
            model = value
        elif name in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    model = model or platform.processor() or platform.machine()
    digest = hashlib.sha1(flags.encode()).hexdigest()[:12]
    return f"{model} [flags {digest}]"


def cache_path() -> Path:
    """``$ZEROTRON_CACHE_DIR/kernels.json``, default ``~/.cache/zerotron/kernels.json``."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "zerotron"
    return Path(root) / CACHE_FILE


def _entry_key(shape: KernelShape) -> str:
    return f"{machine_key()} | torch {torch.__version__} | {shape.key()}"


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; a missing file is empty, an unreadable one too (with a warning)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"not a version-{CACHE_VERSION} kernel cache")
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise ValueError("'entries' is not a mapping")
        return entries
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError) as e:
        warnings.warn(
            f"{path}: kernel choice cache unreadable ({e}); ignoring it, measuring again and "
            "rewriting it",
            stacklevel=3,
        )
        return {}


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` under ``key``: read, merge, and write the file whole, crash-safely (a
    concurrent writer's entry may be lost, never a half-written file left)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # already reported by the read before measuring
        entries = _read_cache(path)
    entries[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1, sort_keys=True)
        atomic_write_text(path, text + "\n")
    except OSError as e:  # a read-only home must not stop training: the next run measures again
        warnings.warn(f"{path}: kernel choices not cached ({e})", stacklevel=3)


# ---- forcing ---------------------------------------------------------------------------------


def parse_forced(spec: str | None, where: str = ENV) -> dict[str, Any]:
    """``"linear=torch,attention=sdpa,loss_chunk=4096"`` as ``{name: candidate}``."""
    forced: dict[str, Any] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, sep, value = (s.strip() for s in item.partition("="))
        options = CANDIDATES.get(name)
        if not sep or options is None:
            raise ConfigError(
                f"{item.strip()!r} is not NAME=CANDIDATE with NAME one of {', '.join(CANDIDATES)}",
                where=where,
                fix="e.g. linear=torch,attention=sdpa,loss_chunk=4096",
            )
        if isinstance(options[0], int):
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"{name}={value!r}: a positive number of columns is expected",
                    where=where,
                    fix=f"e.g. {name}={options[1]}",
                )
            forced[name] = int(value)
        elif value not in options:
            raise ConfigError(
                f"{name}={value!r}: unknown candidate",
                where=where,
                fix=f"use one of {', '.join(options)}",
            )
        else:
            forced[name] = value
    return forced


def _forced(spec: str | None) -> dict[str, Any]:
    """The flag's spec, else the environment's, then the policy's off switches on top."""
    forced = parse_forced(spec, "--kernels") if spec else parse_forced(os.environ.get(ENV))
    for policy_field, (name, plain) in _OFF_SWITCH.items():
        if os.environ.get(ENV_SWITCHES[policy_field], "1") == "0":
            forced[name] = plain
    return forced


# ---- measuring -------------------------------------------------------------------------------


def applicable(shape: KernelShape, device: torch.device | str, linear: str) -> list[str]:
    """The choices that change what runs for ``shape`` on ``device`` (``linear``: the linear
    backend in effect, on which ``loss_chunk`` depends)."""
    from zerotron.kernels.onednn import ONEDNN_AVAILABLE

    if torch.device(device).type != "cpu":
        return []
    if shape.dtype != "fp32":
        return ["matmul16", "attention"]
    names = ["linear"] if ONEDNN_AVAILABLE else []
    fused = os.environ.get(ENV_SWITCHES["fused_loss"], "1") != "0"
    if ONEDNN_AVAILABLE and linear == "onednn" and fused:
        names.append("loss_chunk")
    return names


def time_candidates(
    runners: Mapping[Any, Runner],
    clock: Callable[[], float] = time.perf_counter,
    reps: int = 3,
    budget_s: float = 2.0,
) -> tuple[Any, dict[Any, float]]:
    """The fastest of ``runners`` (ties: the first listed) and each one's best time in seconds.

    Each runs once untimed (warm-up: first-call allocations, kernel selection), then up to
    ``reps`` timed calls; one slower than twice the best is dropped after a rep, and reps stop
    once ``budget_s`` has been spent on them.
    """
    best: dict[Any, float] = {}
    for run in runners.values():
        run()
    start = clock()
    for rep in range(reps):
        for name, run in runners.items():
            if rep and best[name] > 2 * min(best.values()):
                continue
            t0 = clock()
            run()
            best[name] = min(best.get(name, float("inf")), clock() - t0)
        if clock() - start > budget_s:
            break
    winner = min(best, key=lambda n: (best[n], list(runners).index(n)))
    return winner, best


def runners_for(name: str, shape: KernelShape) -> dict[Any, Runner]:
    """The candidates of choice ``name`` as calls on ``shape`` (see the module docstring)."""
    from zerotron.kernels import measure

    return measure.RUNNERS[name](shape)


def choose_kernels(
    shape: KernelShape,
    device: torch.device | str = "cpu",
    forced: str | None = None,
    *,
    measure: bool = True,
    group: comm.Group | None = None,
    path: Path | None = None,
    runners: Callable[[str, KernelShape], Mapping[Any, Runner]] = runners_for,
    clock: Callable[[], float] = time.perf_counter,
    apply: bool = True,
) -> Chosen:
    """This process's kernel choices for ``shape`` on ``device``, made active (``apply``).

    ``forced``: a ``--kernels`` spec (else ``$ZEROTRON_KERNELS``). Choices not forced come from
    the cache, else are measured (unless ``measure`` is False: the defaults then) and cached.
    ``group``: the job's processes. With more than one on the CPU, its first member decides,
    from its cache or by measuring while the others wait in a barrier, and every member takes
    those choices: ranks neither time each other nor run different kernels. ``runners`` and
    ``clock`` are the measurement's (tests give fakes).
    """
    pinned = _forced(forced)  # every rank checks the spec: a bad one stops all of them alike
    if group is not None and group.size > 1 and torch.device(device).type == "cpu":
        comm.barrier(group)  # nobody computes while the first member times the candidates
        text = None
        if group.rank == 0:
            mine = choose_kernels(
                shape,
                device,
                forced,
                measure=measure,
                path=path,
                runners=runners,
                clock=clock,
                apply=False,
            )
            text = mine.to_text()
        chosen = Chosen.from_text(comm.broadcast_text(text, group) or "")
        if apply:
            set_choices(chosen.choices)
        return chosen
    path = path or cache_path()
    values = {f.name: f.default for f in dataclasses.fields(KernelChoices)}
    values.update(pinned)
    how = {name: "forced" for name in pinned}
    key = _entry_key(shape)
    names = applicable(shape, device, values["linear"])
    todo = [n for n in names if n not in pinned]
    entry: dict[str, Any] = {}
    if todo:
        entry = _read_cache(path).get(key, {})
    cached = entry.get("choices", {}) if isinstance(entry, dict) else {}
    chosen = Chosen(KernelChoices(), how, cache=path)
    measured_any = False
    t0 = time.perf_counter()
    for name in CANDIDATES:
        if name not in applicable(shape, device, values["linear"]):
            how.setdefault(name, "n/a")
            continue
        if name in pinned:
            continue
        if cached.get(name) in CANDIDATES[name] and _timed_all(entry, name):
            values[name], how[name] = cached[name], "cached"
        elif measure:
            winner, times = time_candidates(runners(name, shape), clock=clock)
            values[name], how[name] = winner, "measured"
            chosen.timings_ms[name] = {str(c): round(1e3 * t, 3) for c, t in times.items()}
            measured_any = True
        else:
            how[name] = "default"
    chosen.seconds = time.perf_counter() - t0
    chosen.choices = KernelChoices(**values)
    if measured_any:
        merged = {**cached, **{n: values[n] for n in how if how[n] == "measured"}}
        timings = {**entry.get("timings_ms", {}), **chosen.timings_ms}
        _write_cache(path, key, {"choices": merged, "timings_ms": timings})
    if apply:
        set_choices(chosen.choices)
    return chosen


PRECISIONS = ("bf16", "fp32")
"""Training precisions :func:`choose_precision` compares (a tie keeps bf16: half the memory)."""


def choose_precision(
    shape: KernelShape,
    device: torch.device | str = "cpu",
    *,
    path: Path | None = None,
    runners: Callable[[str, KernelShape], Mapping[Any, Runner]] = runners_for,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str, str]:
    """The faster training precision for ``shape`` on ``device`` and how it was found.

    bf16 everywhere but on a CPU, where the block's linear layers are timed in bf16 and in fp32
    (a CPU without native 16-bit matmuls runs bf16 several times slower than fp32); cached as
    the kernel choices are (``shape.dtype`` is not part of the key). Returns ``(precision,
    "measured" | "cached" | "n/a")``.
    """
    if torch.device(device).type != "cpu":
        return "bf16", "n/a"
    path = path or cache_path()
    key = _entry_key(dataclasses.replace(shape, dtype="any"))
    entry = _read_cache(path).get(key, {})
    cached = entry.get("choices", {}).get("precision") if isinstance(entry, dict) else None
    if cached in PRECISIONS:
        return cached, "cached"
    winner, times = time_candidates(runners("precision", shape), clock=clock)
    timings = {"precision": {c: round(1e3 * t, 3) for c, t in times.items()}}
    _write_cache(path, key, {"choices": {"precision": winner}, "timings_ms": timings})
    return winner, "measured"


def _timed_all(entry: dict[str, Any], name: str) -> bool:
    """Whether the cached ``entry`` timed every current candidate of ``name``: a choice made
    before a release added a candidate is measured again, so the new one gets its chance."""
    timed = entry.get("timings_ms", {}).get(name, {})
    return isinstance(timed, dict) and {str(c) for c in CANDIDATES[name]} <= set(timed)


def _pow2(n: int) -> int:
    """The power of two nearest ``n`` from below (the shape-class bucket)."""
    return 1 << max(0, int(n).bit_length() - 1)
