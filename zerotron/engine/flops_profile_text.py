"""The FLOPs profiler's printout, in DeepSpeed's layout: the summary (parameters, forward
MACs/FLOPs, latencies, FLOP/s), the top module types per depth, and the model's tree with every
module's parameters, MACs, latency, their shares of the total and its FLOP/s.

Numbers are written as DeepSpeed writes them (:func:`number_to_string`: ``12.5 M``,
``3.1 GMACs``, ``812.4 us``), so a profile reads the same from either tool. The counting is
:mod:`zerotron.engine.flops_profiler`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from zerotron.fileio import atomic_write_text

PRECISION = 2
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u"))
RULE = "-" * 78


class Profile(Protocol):
    """What the printout reads from a :class:`~zerotron.engine.flops_profiler.FlopsProfiler`."""

    model: nn.Module
    recompute_fwd_factor: float

    def module_params(self, module: nn.Module) -> int: ...
    def module_flops(self, module: nn.Module) -> int: ...
    def module_seconds(self, module: nn.Module) -> float: ...


# --------------------------------------------------------------------------------------------
# Numbers


def number_to_string(num: float, units: str | None = None, precision: int = PRECISION) -> str:
    """``num`` with a metric prefix: ``1234567`` -> ``"1.23 M"`` (``units`` forces one)."""
    if units is None:
        scale, units = 1.0, ""
        if num != 0:
            # the largest prefix not above the number (the smallest below a micro)
            fits = [(s, p) for s, p in _PREFIXES if abs(num) >= s]
            scale, units = fits[0] if fits else _PREFIXES[-1]
    else:
        scale = dict((p, s) for s, p in _PREFIXES).get(units, 1.0)
    return f"{round(num / scale, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = PRECISION) -> str:
    return number_to_string(macs, units, precision) + "MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = PRECISION) -> str:
    return number_to_string(flops, units, precision) + "FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = PRECISION) -> str:
    """Parameters: billions as ``B``, not ``G``."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = PRECISION) -> str:
    return number_to_string(seconds, units, precision) + "s"


def _share(part: float, whole: float) -> float:
    return round(100 * part / whole, PRECISION) if whole else 0


# --------------------------------------------------------------------------------------------
# The printout


def _line(label: str, value: Any) -> str:
    return f"{label:<70}  {value!s:<8}"


def summary(prof: Profile, profile_step: int, engine: dict[str, Any] | None) -> list[str]:
    """The summary block: layout (under the Engine), parameters, FLOPs, latencies, FLOP/s."""
    model = prof.model
    flops, seconds = prof.module_flops(model), prof.module_seconds(model)
    params = prof.module_params(model)
    mp = engine["mp_size"] if engine else 1
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "Notations:",
        "data parallel size (dp_size), model parallel size(mp_size),",
        "number of parameters (params), number of multiply-accumulate operations(MACs),",
        "number of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
        "",
    ]
    if engine:
        lines += [
            _line("world size: ", engine["world_size"]),
            _line("data parallel size: ", engine["dp_size"]),
            _line("model parallel size: ", mp),
            _line("batch size per GPU: ", engine["micro_batch"]),
        ]
    timings = (engine or {}).get("timings")
    fwd = timings["forward"] if timings else seconds
    lines += [
        _line("params per GPU: ", params_to_string(params)),
        _line("params of model = params per GPU * mp_size: ", params_to_string(params * mp)),
        _line("fwd MACs per GPU: ", macs_to_string(flops // 2)),
        _line("fwd flops per GPU: ", number_to_string(flops)),
        _line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)),
        _line("fwd latency: ", duration_to_string(fwd)),
        _line(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(flops / fwd if fwd else 0),
        ),
    ]
    if timings:
        bwd, step = timings["backward"], timings["step"]
        factor = 2 + prof.recompute_fwd_factor
        it = fwd + bwd + step
        lines += [
            _line("bwd latency: ", duration_to_string(bwd)),
            _line(
                f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                flops_to_string(factor * flops / bwd if bwd else 0),
            ),
            _line(
                f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                flops_to_string((factor + 1) * flops / (fwd + bwd) if fwd + bwd else 0),
            ),
            _line("step latency: ", duration_to_string(step)),
            _line("iter latency: ", duration_to_string(it)),
            _line(
                f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                flops_to_string((factor + 1) * flops / it if it else 0),
            ),
            _line(
                "samples/second: ",
                round(engine["micro_batch"] * engine["world_size"] / it, PRECISION) if it else 0,
            ),
        ]
    return lines


def aggregated_profile(prof: Profile, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """The ``top_modules`` module types at each depth by parameters, MACs and latency (summed
    over the modules of a type at that depth); depths 0 to ``module_depth`` - 1, every depth
    with -1."""
    by_depth: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(by_depth):
            by_depth.append({})
        row = by_depth[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += prof.module_flops(module) // 2
        row[1] += prof.module_params(module)
        row[2] += prof.module_seconds(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(prof.model, 0)
    depths = len(by_depth) if module_depth == -1 else min(module_depth, len(by_depth))
    lines = [
        f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model "
        "depths:"
    ]
    for d in range(depths):

        def top(i: int, fmt: Any, rows: dict[str, list[float]] = by_depth[d]) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {name: fmt(values[i]) for name, values in ranked}

        lines += [
            f"depth {d}:",
            f"    params      - {top(1, params_to_string)}",
            f"    MACs        - {top(0, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def _module_line(prof: Profile, module: nn.Module, totals: tuple[int, int, float]) -> str:
    """``params, share, MACs, share, latency, share, FLOP/s[, the module's own repr]``."""
    params, flops, seconds = (
        prof.module_params(module),
        prof.module_flops(module),
        prof.module_seconds(module),
    )
    items = [
        f"{params_to_string(params)} = {_share(params, totals[0]):g}% Params",
        f"{macs_to_string(flops // 2)} = {_share(flops, totals[1]):g}% MACs",
        f"{duration_to_string(seconds)} = {_share(seconds, totals[2]):g}% latency",
        flops_to_string(round(flops / seconds, PRECISION) if seconds else 0),
    ]
    own = module.extra_repr()
    return ", ".join(items + ([own] if own else []))


def detailed_profile(prof: Profile) -> list[str]:
    """The model's tree (as ``print(model)`` draws it), each module with its profile."""
    model = prof.model
    totals = (prof.module_params(model), prof.module_flops(model), prof.module_seconds(model))
    lines: list[str] = []

    def walk(module: nn.Module, name: str, pad: str) -> None:
        head = f"{pad}({name}): " if name else pad
        kind = type(module).__name__
        children = list(module.named_children())
        if not children:
            lines.append(f"{head}{kind}({_module_line(prof, module, totals)})")
            return
        lines.append(f"{head}{kind}(")
        lines.append(f"{pad}  {_module_line(prof, module, totals)}")
        for child_name, child in children:
            walk(child, child_name, pad + "  ")
        lines.append(f"{pad})")

    walk(model, "", "")
    return lines


def _banner(title: str, dashes: int) -> str:
    return f"{'-' * dashes} {title} {'-' * dashes}"


def model_profile(
    prof: Profile,
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
    engine: dict[str, Any] | None = None,
) -> str:
    """The whole printout."""
    lines = summary(prof, profile_step, engine)
    lines += ["", _banner("Aggregated Profile per GPU", 29)]
    lines += aggregated_profile(prof, module_depth, top_modules)
    if detailed:
        lines += [
            "",
            _banner("Detailed Profile per GPU", 30),
            "Each module profile is listed after its name in the following order: ",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            "",
            "Note: FLOPs are counted on matrix products and attention (MACs = FLOPs / 2); "
            "element-wise work (norms, activations, softmax, the loss) is not counted. A module's "
            "numbers include its children's and any work it does outside them.",
            "",
        ]
        lines += detailed_profile(prof)
    lines.append(RULE)
    return "\n".join(lines) + "\n"


def emit(profile: str, output_file: str | None) -> None:
    """Print ``profile``, or write it to ``output_file`` (crash-safe)."""
    if output_file:
        Path(output_file).resolve().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output_file, profile)
    else:
        sys.stdout.write(profile)
        sys.stdout.flush()
