"""The FLOPs profiler: parameters, FLOPs/MACs and latency of each module of one forward, printed
as DeepSpeed's flops profiler prints them.

One way of counting: torch's ``FlopCounterMode``, taught the operations of zerotron's CPU paths
that it does not know (:func:`flop_formulas`: the oneDNN GEMMs of
:mod:`zerotron.kernels.onednn` and the CPU flash attention), counts the whole forward; forward
hooks on every module read its running total at the module's entry and exit, so each module
gets the FLOPs of the operations run inside it (children included) and the wall-clock time
between the two hooks. The counter counts matrix products and attention, the operations the
closed-form transformer counts (``24·B·s·l·h²·(1 + s/6h + V/16lh)``) are made of: every one is a
multiply-add, so MACs are half the FLOPs. Element-wise work (layer norms, GeLU, softmax, the
loss) is not counted — DeepSpeed adds a few of those, which makes its totals slightly larger.

Used three ways, with DeepSpeed's names:

- :class:`FlopsProfiler` (``start_profile`` / ``stop_profile`` / ``get_total_flops`` /
  ``print_model_profile`` / ``end_profile``) around any forward;
- :func:`get_model_profile`: one call profiles a model on given inputs;
- the Engine, with the config's ``flops_profiler`` block: :func:`attach` at build time,
  :func:`after_step` (one line in the Engine's step). Rank 0 profiles the forward of step
  ``profile_step`` (its last micro-batch, as DeepSpeed) and prints the profile when the step
  ends; with ``wall_clock_breakdown`` the summary adds that step's backward and step latency
  from the Engine's timers. Under pipeline parallelism the forward is the stage's chunk's (one
  chunk per stage; interleaved stages are not profiled).

The printing is :mod:`zerotron.engine.flops_profile_text`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from zerotron.engine import flops_profile_text as text

# --------------------------------------------------------------------------------------------
# Counting: FlopCounterMode and the formulas it lacks


def _mm_t_flops(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """``a @ b^T``: 2·M·N·K."""
    return 2 * a_shape[0] * b_shape[0] * a_shape[1]


def _sdpa_cpu_flops(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    """SDPA's CPU flash kernel: QKᵀ and the weighted sum, every query against every key."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward_flops(grad: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    """Its backward: the four products of attention's gradient (twice the forward)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad, q, k, v)


def flop_formulas() -> dict[Any, Any]:
    """FLOP formulas for the operations of zerotron's CPU paths that torch's counter does not
    know: the oneDNN GEMMs (zerotron.kernels.onednn) and SDPA's CPU flash kernel."""
    pairs = (
        (("zerotron", "onednn_mm_t"), _mm_t_flops),
        (("mkldnn", "_linear_pointwise"), _mm_t_flops),
        (("aten", "_scaled_dot_product_flash_attention_for_cpu"), _sdpa_cpu_flops),
        (
            ("aten", "_scaled_dot_product_flash_attention_for_cpu_backward"),
            _sdpa_cpu_backward_flops,
        ),
    )
    ops = {}
    for (namespace, name), formula in pairs:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops[packet] = formula  # the counter looks ops up by their packet
    return ops


def flop_counter() -> Any:
    """A ``torch.utils.flop_counter.FlopCounterMode`` that knows zerotron's operations."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=flop_formulas())


def _rank() -> int:
    from zerotron.distributed.state import state

    return state().rank


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # asynchronous kernels count in the module that launched them


# --------------------------------------------------------------------------------------------
# The profiler


class _Stats:
    """One module's profile: its parameters, and FLOPs and seconds summed over its calls."""

    __slots__ = ("params", "flops", "seconds", "calls", "_open")

    def __init__(self, params: int):
        self.params = params
        self.flops = 0
        self.seconds = 0.0
        self.calls = 0
        self._open: list[tuple[int, float]] = []  # (counter total, clock) at each open call


def _numel(p: nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 partition counts whole


class FlopsProfiler:
    """Measures each module's parameters, forward FLOPs/MACs and latency (DeepSpeed's class).

    ``prof.start_profile()``, then the forward(s) to profile, then ``prof.stop_profile()`` (or
    straight on to the getters and ``print_model_profile``), then ``prof.end_profile()``.
    ``ds_engine``: the Engine, whose layout and timers the printed summary adds;
    ``recompute_fwd_factor``: forwards recomputed in backward (the backward counts
    2 + this many forwards).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._stats: dict[nn.Module, _Stats] = {}
        self._hooks: list[Any] = []
        self._counter: Any = None
        self.step_timings: dict[str, float] | None = None  # set by the Engine's StepProfile

    # ---- DeepSpeed's API

    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Reset the profile and count from here: every module but those whose type is in
        ``ignore_list`` (their work counts in their parent) gets timing hooks."""
        self.stop_profile()
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._exit))
        self._counter = flop_counter()
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the profile so far stays readable."""
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def reset_profile(self) -> None:
        """Zero every module's profile."""
        self._stats = {
            m: _Stats(sum(_numel(p) for p in m.parameters())) for m in self.model.modules()
        }

    def end_profile(self) -> None:
        """Stop and forget the profile."""
        self.stop_profile()
        self._stats = {}
        self.started = False

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the profiled forward(s) of the model."""
        flops = self.module_flops(self.model)
        return text.number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the profiled forward(s): half the FLOPs."""
        macs = self.module_flops(self.model) // 2
        return text.macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds in the model's profiled forward(s)."""
        seconds = self.module_seconds(self.model)
        return text.duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model on this rank."""
        params = self._stat(self.model).params
        return text.params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the profile (summary, the top modules per depth, and with ``detailed`` every
        module in the model's tree), or write it to ``output_file``."""
        if not self.started:
            return
        profile = text.model_profile(
            self, profile_step, module_depth, top_modules, detailed, self._engine_summary()
        )
        text.emit(profile, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the ``top_modules`` module types by parameters, MACs and latency per depth."""
        print("\n".join(text.aggregated_profile(self, module_depth, top_modules)))

    # ---- per module (for the printing)

    def _stat(self, module: nn.Module) -> _Stats:
        stat = self._stats.get(module)
        if stat is None:  # a module added after the reset
            stat = self._stats[module] = _Stats(sum(_numel(p) for p in module.parameters()))
        return stat

    def module_params(self, module: nn.Module) -> int:
        return self._stat(module).params

    def module_flops(self, module: nn.Module) -> int:
        """FLOPs inside ``module``'s calls; a module never called (a ModuleList): its children's."""
        stat = self._stat(module)
        if stat.calls:
            return stat.flops
        return sum(self.module_flops(child) for child in module.children())

    def module_seconds(self, module: nn.Module) -> float:
        stat = self._stat(module)
        if stat.calls:
            return stat.seconds
        return sum(self.module_seconds(child) for child in module.children())

    # ---- hooks

    def _total(self) -> int:
        return int(self._counter.get_total_flops()) if self._counter is not None else 0

    def _enter(self, module: nn.Module, args: Any) -> None:
        _sync()
        self._stat(module)._open.append((self._total(), time.perf_counter()))

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        _sync()
        stat = self._stat(module)
        if not stat._open:  # the profile started inside this module's call
            return
        flops, start = stat._open.pop()
        stat.flops += self._total() - flops
        stat.seconds += time.perf_counter() - start
        stat.calls += 1

    def _engine_summary(self) -> dict[str, Any] | None:
        engine = self.ds_engine
        if engine is None:
            return None
        return engine_layout(engine) | {"timings": self.step_timings}


def engine_layout(engine: Any) -> dict[str, Any]:
    """World, data- and model-parallel sizes and the micro-batch of the Engine's run."""
    from zerotron.distributed.state import state

    ps = state()
    return {
        "world_size": ps.world_size,
        "dp_size": ps.dp_size,
        "mp_size": ps.tp_size,
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
    }


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: list[Any] | tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """``(flops, macs, params)`` of one forward of ``model`` (DeepSpeed's function).

    The model is called ``warm_up`` times, then once profiled, with ``args``/``kwargs`` or, with
    ``input_shape``, one uninitialized tensor of the parameters' dtype and device (as
    DeepSpeed; a model taking token ids wants ``args=[tokens]``). ``mode="generate"`` calls
    ``model.generate`` instead. The model is left in eval mode. ``print_profile`` prints the
    profile (or writes it to ``output_file``); ``as_string``: the numbers as text
    (``"1.2 G"``, ``"600 MMACs"``, ``"4.2 M"``).
    """
    from zerotron.errors import ConfigError

    if not isinstance(model, nn.Module):
        raise ConfigError("get_model_profile wants a torch.nn.Module", where="get_model_profile")
    if mode not in ("forward", "generate"):
        raise ConfigError(
            f"mode {mode!r}", where="get_model_profile", fix="use 'forward' or 'generate'"
        )
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        first = next(model.parameters(), None)
        like = first if first is not None else torch.empty(())
        args = [torch.empty(tuple(input_shape), dtype=like.dtype, device=like.device)]
    if not args and not kwargs:
        raise ConfigError(
            "nothing to call the model with",
            where="get_model_profile",
            fix="give input_shape, args or kwargs",
        )
    call = model.generate if mode == "generate" else model
    model.eval()
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        call(*args, **kwargs)
        prof.stop_profile()
        flops, macs, params = (
            prof.get_total_flops(),
            prof.get_total_macs(),
            prof.get_total_params(),
        )
        if print_profile:
            prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    finally:
        prof.end_profile()
    if as_string:
        return (
            text.number_to_string(flops),
            text.macs_to_string(macs),
            text.params_to_string(params),
        )
    return flops, macs, params


# --------------------------------------------------------------------------------------------
# The Engine's profiled step (the config's ``flops_profiler`` block)

_PHASES = ("forward", "backward", "step")


class StepProfile:
    """Profiles one step of an Engine as DeepSpeed's engine does (see the module docstring)."""

    def __init__(self, engine: Any, options: Any):
        self.engine = engine
        self.options = options
        self.profiler = FlopsProfiler(
            engine.module, engine, options.flops_profiler_recompute_fwd_factor
        )
        self._timers_before: dict[str, float] | None = None
        self._forwards = 0
        # What a forward calls: the model, or under pipeline parallelism this stage's chunk
        # (it calls the model, or holds the model's part: either way the model's tree is summed)
        chunks = list(getattr(engine.pipeline, "modules", None) or [engine.module])
        self._hooks = []
        if len(chunks) > 1:
            if _rank() == 0:
                print(
                    "flops_profiler: not with interleaved pipeline stages (several chunks per "
                    "stage); nothing is profiled",
                    flush=True,
                )
            return
        self._hooks = [
            chunks[0].register_forward_pre_hook(self._before_forward),
            chunks[0].register_forward_hook(self._after_forward),
        ]

    def _active(self) -> bool:
        step = self.options.flops_profiler_profile_step
        return self.engine.global_steps == step and _rank() == 0

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self._active():
            return
        if self._timers_before is None:
            self._timers_before = self._timers()
        self._forwards += 1
        # Each micro-batch starts afresh: the step's last one is printed (DeepSpeed's choice).
        # This call's pre-hooks are already chosen, so the model's own entry is opened here.
        self.profiler.start_profile()
        self.profiler._enter(module, args)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.profiler._counter is not None:
            self.profiler._exit(module, args, output)
            self.profiler.stop_profile()

    def _timers(self) -> dict[str, float]:
        return {name: self.engine.timers(name).elapsed(reset=False) for name in _PHASES}

    def after_step(self) -> None:
        """At the end of the profiled step (``global_steps`` just counted it): print, finish."""
        engine = self.engine
        printed_at = self.options.flops_profiler_profile_step + 1
        if engine.global_steps < printed_at:
            return
        if engine.global_steps == printed_at and self.profiler.started:
            if engine.wall_clock_breakdown() and self._timers_before is not None:
                now, before, n = self._timers(), self._timers_before, max(self._forwards, 1)
                # per micro-batch, as the FLOPs are one micro-batch's
                self.profiler.step_timings = {
                    "forward": (now["forward"] - before["forward"]) / n,
                    "backward": (now["backward"] - before["backward"]) / n,
                    "step": now["step"] - before["step"],
                }
            o = self.options
            self.profiler.print_model_profile(
                profile_step=engine.global_steps,
                module_depth=o.flops_profiler_module_depth,
                top_modules=o.flops_profiler_top_modules,
                detailed=o.flops_profiler_detailed,
                output_file=o.flops_profiler_output_file,
            )
            self.profiler.end_profile()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def attach(engine: Any, options: Any) -> None:
    """Give ``engine`` a :class:`StepProfile` when ``options`` (the config's
    :class:`~zerotron.config.sections.FlopsProfilerConfig`) enable the profiler."""
    if options is not None and options.flops_profiler_enabled:
        engine._flops_profile = StepProfile(engine, options)


def after_step(engine: Any) -> None:
    """The Engine's one-line hook after an optimizer step."""
    profile = getattr(engine, "_flops_profile", None)
    if profile is not None:
        profile.after_step()
