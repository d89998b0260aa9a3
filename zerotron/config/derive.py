"""Every value a Config derives, in one place: the batch geometry, the data-parallel size, the
schedule lengths, the pipeline layout, ZeRO's rules — Megatron's ``validate_args`` with messages
that show the numbers.

:func:`derive` runs once per validation of a :class:`~zerotron.config.schema.Config` and fills in
what the inputs left empty:

* ``ffn_hidden_size`` (4h), ``max_position_embeddings`` (seq_length),
  ``recompute_method`` / ``recompute_num_layers`` (uniform, 1), ``kernels`` (``attention=sdpa``
  added by ``use_flash_attn`` or ``attention_backend`` flash);
* ``data_parallel_size`` (world / (tp·pp)), ``virtual_pipeline_model_parallel_size``,
  ``pipeline_schedule`` (1f1b, or interleaved with virtual stages);
* ``global_batch_size`` / ``micro_batch_size`` / ``num_micro_batches`` (any two give the third,
  :func:`batch_geometry`);
* ``train_iters`` from ``train_samples`` and back, ``lr_decay_iters`` (train_iters),
  ``lr_decay_samples``, ``lr_warmup_samples``, ``start/end_weight_decay`` (weight_decay);
  ``train_iters`` cut by ``train_tokens`` (:mod:`zerotron.config.token_schedule`);
  ``recompute_*`` from Megatron-DeepSpeed's ``checkpoint_activations``;
* ``data_path`` or the per-split paths from the files that name them
  (:mod:`zerotron.config.data_paths`);
* ``overlap_comm`` (on at ZeRO stage 3), and the offload rules (a stage that partitions what
  is offloaded, a path for NVMe).

The DeepSpeed loader calls :func:`data_parallel_size` and :func:`batch_geometry` too (with
DeepSpeed's key names in the messages), so a batch size means the same on every path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerotron.config import batch_ramp
from zerotron.config.data_paths import resolve_data_paths
from zerotron.config.sections import ModelConfig, SchedulerConfig, Section, flag
from zerotron.config.token_schedule import check_tokens, limit_by_tokens, token_steps
from zerotron.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from zerotron.config.schema import Config


def derive(cfg: Config) -> None:
    """Check the inputs of ``cfg`` together and fill in every derived value (in place: only
    validation may write to a frozen Config)."""
    _check_precision(cfg)
    resolve_data_paths(cfg.data, _fill)
    _resolve_model(cfg)
    _resolve_parallel(cfg)
    _resolve_batch(cfg)
    check_tokens(cfg)
    _resolve_length(cfg)
    limit_by_tokens(cfg, _fill)
    _check_checkpoint(cfg)
    _resolve_zero(cfg)


def _fill(section: Section, **values: Any) -> None:
    """Set derived values on a frozen section; only validation may do this."""
    for name, value in values.items():
        object.__setattr__(section, name, value)


def _warn(cfg: Config, message: str) -> None:
    cfg._warnings.append(message)


# --------------------------------------------------------------------------------------------
# The process grid and the batch geometry (shared with the DeepSpeed loader)


def data_parallel_size(world: int, tp: int, pp: int) -> int:
    """world / (tp · pp), or a ConfigError when it does not divide."""
    if world % (tp * pp):
        raise ConfigError(
            f"world_size {world} is not divisible by tensor_model_parallel_size {tp} × "
            f"pipeline_model_parallel_size {pp} = {tp * pp}",
            where="parallel.world_size",
            fix=f"launch a multiple of {tp * pp} processes, or change "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size",
        )
    return world // (tp * pp)


@dataclass(frozen=True)
class BatchNames:
    """How a loader names the three batch sizes in errors (Megatron's or DeepSpeed's keys)."""

    global_batch: str
    micro_batch: str
    accumulation: str
    data_parallel: Callable[[int], str]
    """dp -> its words, e.g. ``data_parallel_size 2``"""
    where: str | None
    missing: tuple[str, str | None, str]
    """(what, where, fix) when neither the global nor the micro batch size is given"""
    micro_multiple_fix: Callable[[int, int], str]
    """(global, micro × dp) -> the fix when the global batch does not divide"""
    accumulation_multiple_fix: Callable[[int, int], str]
    """(global, accumulation × dp) -> the fix when the global batch does not divide"""
    accumulation_before_dp: bool = False
    """the product reads micro × accumulation × DP (DeepSpeed) or micro × DP × accumulation"""


def _multiples(value: int, unit: int) -> str:
    lower = value // unit * unit
    return f"{lower} or {lower + unit}" if lower else f"{unit}"


MEGATRON_BATCH = BatchNames(
    global_batch="global_batch_size",
    micro_batch="micro_batch_size",
    accumulation="num_micro_batches",
    data_parallel=lambda dp: f"data_parallel_size {dp}",
    where="training.global_batch_size",
    missing=(
        "no batch size given",
        "training.micro_batch_size",
        "set --micro-batch-size (and --global-batch-size for gradient accumulation)",
    ),
    micro_multiple_fix=lambda gbs, unit: (
        f"set --global-batch-size to a multiple of {unit} (e.g. {_multiples(gbs, unit)}), or "
        "change --micro-batch-size"
    ),
    accumulation_multiple_fix=lambda gbs, unit: (
        f"set the global batch size to a multiple of {unit}"
    ),
)
"""The schema's (Megatron's) names."""


def batch_geometry(
    micro: int | None, global_: int | None, accumulation: int | None, dp: int, names: BatchNames
) -> tuple[int, int, int]:
    """``(micro, global, accumulation)`` with global = micro × dp × accumulation: any two give
    the third; the micro size alone means no accumulation (Megatron's and DeepSpeed's rule).
    Three that disagree, or a global size that does not divide, raise a ConfigError showing the
    arithmetic in ``names``' words."""
    mbs, gbs, nmb = micro, global_, accumulation
    n = names
    if mbs is None and gbs is None:
        what, where, fix = n.missing
        raise ConfigError(what, where=where, fix=fix)
    if mbs is not None and gbs is not None and nmb is not None:
        if gbs != mbs * dp * nmb:
            terms = [f"{n.micro_batch} {mbs}", n.data_parallel(dp), f"{n.accumulation} {nmb}"]
            if n.accumulation_before_dp:
                terms[1:] = terms[2], terms[1]
            raise ConfigError(
                f"{n.global_batch} {gbs} != {' × '.join(terms)} = {mbs * dp * nmb}",
                where=n.where,
                fix="give only two of the three; the third is derived",
            )
    elif mbs is not None and gbs is not None:
        if gbs % (mbs * dp):
            raise ConfigError(
                f"{n.global_batch} {gbs} is not divisible by {n.micro_batch} {mbs} × "
                f"{n.data_parallel(dp)} = {mbs * dp}",
                where=n.where,
                fix=n.micro_multiple_fix(gbs, mbs * dp),
            )
        nmb = gbs // (mbs * dp)
    elif mbs is not None:
        nmb = nmb or 1  # no global batch size means no accumulation
        gbs = mbs * dp * nmb
    else:
        nmb = nmb or 1
        if gbs % (dp * nmb):
            parts = [n.data_parallel(dp), f"{n.accumulation} {nmb}"]
            if n.accumulation_before_dp:
                parts.reverse()
            raise ConfigError(
                f"{n.global_batch} {gbs} is not divisible by {' × '.join(parts)} = {dp * nmb}",
                where=n.where,
                fix=n.accumulation_multiple_fix(gbs, dp * nmb),
            )
        mbs = gbs // (dp * nmb)
    return mbs, gbs, nmb


# --------------------------------------------------------------------------------------------
# The sections' rules, in the order derive() runs them


def _check_precision(cfg: Config) -> None:
    p = cfg.precision
    if p.fp16 and p.bf16:
        raise ConfigError(
            "fp16 and bf16 are both set",
            where="precision",
            fix="choose one of --fp16 / --bf16",
        )
    if p.min_loss_scale > p.initial_loss_scale:
        raise ConfigError(
            f"min_loss_scale {p.min_loss_scale} is above initial_loss_scale {p.initial_loss_scale}",
            where="precision.min_loss_scale",
            fix="lower --min-loss-scale or raise --initial-loss-scale",
        )
    if p.loss_scale is not None and not p.fp16:
        _warn(cfg, "loss_scale is used only with fp16; ignored")


def _resolve_model(cfg: Config) -> None:
    m = cfg.model
    if m.hidden_size and m.num_attention_heads and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"hidden_size {m.hidden_size} is not divisible by num_attention_heads "
            f"{m.num_attention_heads}",
            where="model.hidden_size",
            fix="choose --num-attention-heads dividing --hidden-size, e.g. "
            f"{_divisors_near(m.hidden_size, m.num_attention_heads)}",
        )
    if m.ffn_hidden_size is None and m.hidden_size is not None:
        _fill(m, ffn_hidden_size=4 * m.hidden_size)
    if m.max_position_embeddings is None and m.seq_length is not None:
        _fill(m, max_position_embeddings=m.seq_length)
    if (
        m.max_position_embeddings is not None
        and m.seq_length is not None
        and m.max_position_embeddings < m.seq_length
    ):
        raise ConfigError(
            f"max_position_embeddings {m.max_position_embeddings} is less than seq_length "
            f"{m.seq_length}",
            where="model.max_position_embeddings",
            fix=f"set --max-position-embeddings to at least {m.seq_length}, or shorten "
            "--seq-length",
        )
    if m.use_flash_attn or m.attention_backend == "flash":
        _force_sdpa_attention(m)
    elif m.attention_backend != "auto":
        _warn(
            cfg,
            f"attention_backend {m.attention_backend!r} has no effect in zerotron (attention is "
            "SDPA or the kernel the chooser picks, docs/kernels.md); ignored",
        )
    heads = m.num_attention_heads
    if m.kv_channels is not None and m.hidden_size is not None and heads:
        width = m.hidden_size // heads
        if m.kv_channels != width:
            raise UnsupportedError(
                f"kv_channels {m.kv_channels} differs from hidden_size / num_attention_heads = "
                f"{width}: attention heads other than that wide are not implemented",
                where="model.kv_channels",
                fix=f"drop --kv-channels, or set it to {width}",
            )
    if m.checkpoint_activations:  # Megatron-DeepSpeed's spelling of uniform full recompute
        if m.recompute_granularity not in (None, "full"):
            raise ConfigError(
                f"checkpoint_activations asks for full recompute, recompute_granularity "
                f"for {m.recompute_granularity!r}",
                where="model.checkpoint_activations",
                fix="give one of --checkpoint-activations and --recompute-granularity",
            )
        _fill(
            m,
            recompute_granularity="full",
            recompute_num_layers=m.recompute_num_layers or m.checkpoint_num_layers,
        )
    if m.recompute_granularity != "full":
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(m, name) is not None:
                raise ConfigError(
                    f"{name} is set but recompute_granularity is {m.recompute_granularity!r}",
                    where=f"model.{name}",
                    fix=f"{name} applies only with --recompute-granularity full",
                )
        return
    _fill(m, recompute_method=m.recompute_method or "uniform")
    _fill(m, recompute_num_layers=m.recompute_num_layers or 1)
    if m.num_layers is not None and m.recompute_num_layers > m.num_layers:
        raise ConfigError(
            f"recompute_num_layers {m.recompute_num_layers} exceeds num_layers {m.num_layers}",
            where="model.recompute_num_layers",
            fix=f"set --recompute-num-layers to at most {m.num_layers}",
        )


def _force_sdpa_attention(m: ModelConfig) -> None:
    """``--use-flash-attn`` (Megatron-LM's flash-attn package) as the kernel choice
    ``attention=sdpa``: SDPA runs its FlashAttention kernels wherever it has them."""
    items = [item.strip() for item in (m.kernels or "").split(",") if item.strip()]
    attention = [item for item in items if item.partition("=")[0].strip() == "attention"]
    other = [item for item in attention if item.partition("=")[2].strip() != "sdpa"]
    if other:
        raise ConfigError(
            f"use_flash_attn (or attention_backend flash) asks for SDPA's attention kernels, "
            f"but kernels forces {other[0]}",
            where="model.use_flash_attn",
            fix="drop --use-flash-attn / --attention-backend flash, or the attention choice "
            "from --kernels",
        )
    if not attention:
        _fill(m, kernels=",".join([*items, "attention=sdpa"]))


def _resolve_parallel(cfg: Config) -> None:
    par, m = cfg.parallel, cfg.model
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    world = par.world_size
    dp = data_parallel_size(world, tp, pp)
    if par.data_parallel_size not in (None, dp):
        raise ConfigError(
            f"data_parallel_size {par.data_parallel_size} != world_size {world} / "
            f"(tensor_model_parallel_size {tp} × pipeline_model_parallel_size {pp}) = {dp}",
            where="parallel.data_parallel_size",
            fix="leave data_parallel_size out: it is derived",
        )
    _fill(par, data_parallel_size=dp)
    if par.no_pipeline_parallel and pp > 1:
        raise ConfigError(
            f"no_pipeline_parallel is set with pipeline_model_parallel_size {pp}",
            where="parallel.no_pipeline_parallel",
            fix="drop --no-pipeline-parallel, or set --pipeline-model-parallel-size 1",
        )
    for name in ("num_attention_heads", "ffn_hidden_size"):
        value = getattr(m, name)
        if value is not None and value % tp:
            raise ConfigError(
                f"{name} {value} is not divisible by tensor_model_parallel_size {tp}",
                where=f"model.{name}",
                fix=f"choose {flag(name)} and --tensor-model-parallel-size so that it is",
            )
    if par.sequence_parallel and tp == 1:
        _fill(par, sequence_parallel=False)
        _warn(cfg, "sequence_parallel disabled: it needs tensor_model_parallel_size > 1")
    ac = cfg.activation_checkpointing
    if par.sequence_parallel and ac.partition_activations:
        # DeepSpeed's partitioning splits an input every TP rank holds whole and gathers the
        # pieces back; under SP each rank's layer input is its own part of the sequence, so the
        # gather would assemble other ranks' parts (wrong gradients). The input is 1/tp already.
        _fill(ac, partition_activations=False, contiguous_memory_optimization=False)
        _warn(
            cfg,
            "partition_activations turned off under sequence_parallel: each tensor-parallel "
            "rank's checkpointed layer input is already its 1/tp of the sequence",
        )
    if par.sequence_parallel and m.seq_length is not None and m.seq_length % tp:
        raise ConfigError(
            f"seq_length {m.seq_length} is not divisible by tensor_model_parallel_size {tp}, "
            "which sequence_parallel needs",
            where="model.seq_length",
            fix=f"use a --seq-length that is a multiple of {tp}",
        )
    if pp > 1 and m.num_layers is not None and m.num_layers % pp:
        raise ConfigError(
            f"num_layers {m.num_layers} is not divisible by pipeline_model_parallel_size {pp}",
            where="model.num_layers",
            fix=f"use a multiple of {pp} layers, or another --pipeline-model-parallel-size",
        )
    _resolve_virtual_pipeline(cfg)
    _resolve_pipeline_schedule(cfg)


def _resolve_pipeline_schedule(cfg: Config) -> None:
    """Interleaved exactly when there are virtual stages; 1F1B unless GPipe is asked for."""
    par = cfg.parallel
    kind, vpp = par.pipeline_schedule, par.virtual_pipeline_model_parallel_size
    where = "parallel.pipeline_schedule"
    if vpp is not None and kind not in (None, "interleaved"):
        raise ConfigError(
            f"pipeline_schedule {kind!r} has one model chunk per stage, but "
            f"num_layers_per_virtual_pipeline_stage gives {vpp} virtual stages per rank",
            where=where,
            fix="drop --pipeline-schedule (virtual stages run the interleaved schedule), or "
            "drop --num-layers-per-virtual-pipeline-stage",
        )
    if vpp is None and kind == "interleaved":
        raise ConfigError(
            "the interleaved schedule needs virtual pipeline stages",
            where=where,
            fix="set --num-layers-per-virtual-pipeline-stage (fewer than the layers per "
            "stage), or use --pipeline-schedule 1f1b",
        )
    if kind is None and par.pipeline_model_parallel_size > 1:
        _fill(par, pipeline_schedule="interleaved" if vpp is not None else "1f1b")


def _resolve_virtual_pipeline(cfg: Config) -> None:
    par, m = cfg.parallel, cfg.model
    per_stage_layers = par.num_layers_per_virtual_pipeline_stage
    vpp = par.virtual_pipeline_model_parallel_size
    if per_stage_layers is None and vpp is None:
        return
    pp = par.pipeline_model_parallel_size
    if pp < 2:
        raise ConfigError(
            f"virtual pipeline stages need pipeline_model_parallel_size > 1, got {pp}",
            where="parallel.num_layers_per_virtual_pipeline_stage",
            fix="set --pipeline-model-parallel-size, or drop "
            "--num-layers-per-virtual-pipeline-stage",
        )
    if m.num_layers is None:
        raise ConfigError(
            "virtual pipeline stages need num_layers",
            where="model.num_layers",
            fix="set --num-layers",
        )
    layers = m.num_layers // pp
    if per_stage_layers is None:
        if layers % vpp:
            raise ConfigError(
                f"{layers} layers per pipeline stage do not split into "
                f"virtual_pipeline_model_parallel_size {vpp} stages",
                where="parallel.virtual_pipeline_model_parallel_size",
                fix="choose a divisor of the layers per stage",
            )
        per_stage_layers = layers // vpp
    if layers % per_stage_layers:
        raise ConfigError(
            f"num_layers {m.num_layers} / pipeline_model_parallel_size {pp} = {layers} "
            f"layers per stage is not divisible by num_layers_per_virtual_pipeline_stage "
            f"{per_stage_layers}",
            where="parallel.num_layers_per_virtual_pipeline_stage",
            fix=f"use a divisor of {layers}",
        )
    derived = layers // per_stage_layers
    if vpp is not None and vpp != derived:
        raise ConfigError(
            f"virtual_pipeline_model_parallel_size {vpp} != {layers} layers per stage / "
            f"num_layers_per_virtual_pipeline_stage {per_stage_layers} = {derived}",
            where="parallel.virtual_pipeline_model_parallel_size",
            fix="give only one of them",
        )
    # One virtual stage per rank is the plain (non-interleaved) schedule, as in Megatron.
    _fill(
        par,
        num_layers_per_virtual_pipeline_stage=per_stage_layers,
        virtual_pipeline_model_parallel_size=derived if derived > 1 else None,
    )


def _resolve_batch(cfg: Config) -> None:
    """global = micro × data-parallel × accumulation; any two give the third."""
    t = cfg.training
    dp = cfg.parallel.data_parallel_size
    gbs_given = t.global_batch_size
    if t.step_batch_size_schedule is not None:
        if t.rampup_batch_size is not None:
            raise ConfigError(
                "rampup_batch_size and step_batch_size_schedule are both set",
                where="training.rampup_batch_size",
                fix="give the batch-size ramp once",
            )
        final = batch_ramp.step_schedule(t.step_batch_size_schedule, cfg.model.seq_length).final
        if gbs_given not in (None, final):
            raise ConfigError(
                f"global_batch_size {gbs_given} is not the last size {final} of "
                "step_batch_size_schedule",
                where="training.global_batch_size",
                fix=f"drop --global-batch-size or set it to {final}",
            )
        gbs_given = final
    mbs, gbs, nmb = batch_geometry(
        t.micro_batch_size, gbs_given, t.num_micro_batches, dp, MEGATRON_BATCH
    )
    _fill(t, micro_batch_size=mbs, global_batch_size=gbs, num_micro_batches=nmb)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    ramp = cfg.batch_ramp
    if ramp is not None:
        unit = f"micro_batch_size {mbs} × data_parallel_size {dp}"
        batch_ramp.check_divisible(ramp, mbs * dp, unit, pp if vpp is not None else 1)
    if vpp is not None and nmb % pp:
        raise ConfigError(
            f"the interleaved schedule needs num_micro_batches {nmb} (global_batch_size "
            f"{gbs} / (micro_batch_size {mbs} × data_parallel_size {dp})) to be divisible "
            f"by pipeline_model_parallel_size {pp}",
            where="training.global_batch_size",
            fix=f"use a global batch size giving a multiple of {pp} micro-batches, or drop "
            "--num-layers-per-virtual-pipeline-stage",
        )


def _resolve_length(cfg: Config) -> None:
    """train_iters / train_samples and the LR schedule lengths, as Megatron resolves them."""
    t, s, o = cfg.training, cfg.scheduler, cfg.optimizer
    gbs = t.global_batch_size
    if o.lr is not None and o.min_lr > o.lr:
        raise ConfigError(
            f"min_lr {o.min_lr} is above lr {o.lr}",
            where="optimizer.min_lr",
            fix="set --min-lr at or below --lr",
        )
    _resolve_weight_decay(cfg)
    if s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set",
            where="scheduler",
            fix="choose where the schedule comes from on resume: flags or checkpoint",
        )
    if t.train_iters is not None and t.train_samples is not None:
        raise ConfigError(
            f"train_iters {t.train_iters} and train_samples {t.train_samples} are both set",
            where="training.train_iters",
            fix="give the length of training once: --train-iters or --train-samples",
        )
    ramp = cfg.batch_ramp
    if t.train_samples is not None:
        _check_unused(cfg, "sample-based", lr_decay_iters=None, lr_warmup_iters=0)
        if s.lr_warmup_fraction is not None and s.lr_warmup_samples:
            raise _both_warmups("lr_warmup_samples", s.lr_warmup_samples, s)
        if ramp is not None:  # Megatron steps the ramp until the samples are reached
            _fill(t, train_iters=ramp.iterations_for(t.train_samples))
            _fill(s, lr_decay_samples=s.lr_decay_samples or t.train_samples)
            return _check_schedule_lengths(cfg)
        iters = t.train_samples // gbs  # Megatron rounds down
        if iters == 0:
            raise ConfigError(
                f"train_samples {t.train_samples} is less than one global batch ({gbs} samples)",
                where="training.train_samples",
                fix=f"train for at least {gbs} samples",
            )
        tokens_first = (token_steps(cfg) or iters) < iters  # train_tokens ends it earlier
        if t.train_samples % gbs and not tokens_first:
            _warn(
                cfg,
                f"train_samples {t.train_samples} is not a multiple of global_batch_size "
                f"{gbs}: training runs {iters} iterations ({iters * gbs} samples)",
            )
        _fill(t, train_iters=iters)
        _fill(s, lr_decay_samples=s.lr_decay_samples or t.train_samples)
    elif t.train_iters is not None:
        _check_unused(cfg, "iteration-based", lr_decay_samples=None, lr_warmup_samples=0)
        if s.lr_warmup_fraction is not None and s.lr_warmup_iters:
            raise _both_warmups("lr_warmup_iters", s.lr_warmup_iters, s)
        samples = t.train_iters * gbs if ramp is None else ramp.samples_after(t.train_iters)
        _fill(t, train_samples=samples)
        decay_iters = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters
        _fill(
            s,
            lr_decay_iters=decay_iters,
            lr_decay_samples=decay_iters * gbs,
            lr_warmup_samples=s.lr_warmup_iters * gbs,
        )
    else:
        return
    _check_schedule_lengths(cfg)


def _check_schedule_lengths(cfg: Config) -> None:
    t, s = cfg.training, cfg.scheduler
    decay, warmup = cfg.lr_decay_steps, cfg.lr_warmup_steps
    if t.train_iters and s.lr_decay_style != "constant" and decay == 0:
        raise ConfigError(
            "the learning rate decays over 0 samples",
            where="scheduler.lr_decay_iters",
            fix="set --lr-decay-iters > 0, or --lr-decay-style constant",
        )
    if t.train_iters and decay and warmup >= decay:
        raise ConfigError(
            f"the warmup ({warmup:g} samples) is not shorter than the decay ({decay} samples)",
            where="scheduler",
            fix="shorten --lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction, or "
            "lengthen --lr-decay-iters / --lr-decay-samples",
        )


def _resolve_weight_decay(cfg: Config) -> None:
    """Megatron: a constant style takes weight_decay; the others need start and end."""
    o = cfg.optimizer
    given = [n for n in ("start_weight_decay", "end_weight_decay") if getattr(o, n) is not None]
    if o.weight_decay_incr_style == "constant":
        if given:
            raise ConfigError(
                f"{given[0]} is set but weight_decay_incr_style is 'constant'",
                where=f"optimizer.{given[0]}",
                fix="use --weight-decay, or set --weight-decay-incr-style linear/cosine",
            )
        _fill(o, start_weight_decay=o.weight_decay, end_weight_decay=o.weight_decay)
    elif len(given) < 2:
        raise ConfigError(
            f"weight_decay_incr_style {o.weight_decay_incr_style!r} needs "
            "start_weight_decay and end_weight_decay",
            where="optimizer.weight_decay_incr_style",
            fix="set --start-weight-decay and --end-weight-decay",
        )


def _check_unused(cfg: Config, mode: str, **expected: Any) -> None:
    """In one mode (iteration- or sample-based) the other mode's knobs must stay unset."""
    for name, default in expected.items():
        value = cfg._inputs["scheduler"][name]
        if value != default:
            other = "--train-samples" if mode == "sample-based" else "--train-iters"
            raise ConfigError(
                f"{name} {value} is set, but training is {mode} ({other})",
                where=f"scheduler.{name}",
                fix=f"use the {mode} counterpart of {flag(name)}",
            )


def _check_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    if c.save is not None and c.save_interval is None:
        raise ConfigError(
            f"save {c.save!r} is set without save_interval",
            where="checkpoint.save_interval",
            fix="set --save-interval N (a checkpoint is also written at the end)",
        )


def _resolve_zero(cfg: Config) -> None:
    """DeepSpeed's rules for ZeRO: what each stage allows, overlap_comm's default."""
    z, pp = cfg.zero, cfg.parallel.pipeline_model_parallel_size
    stage = z.zero_stage
    if stage >= 2 and pp > 1:
        raise UnsupportedError(
            f"ZeRO stage {stage} with pipeline parallelism (pipeline_model_parallel_size "
            f"{pp}): gradients and parameters partitioned across data-parallel ranks do not "
            "compose with the pipeline's micro-batch gradient accumulation (DeepSpeed refuses "
            "it too)",
            where="zero.zero_stage",
            fix="use ZeRO stage 1 (or 0) with pipeline parallelism",
        )
    if z.offload_optimizer and stage == 0:
        raise ConfigError(
            f"offload_optimizer.device {z.offload_optimizer_device!r} needs ZeRO stage 1, 2 "
            "or 3 (stage 0 keeps no partitioned optimizer state to offload)",
            where="zero.offload_optimizer_device",
            fix="set zero_optimization.stage >= 1, or offload_optimizer.device none",
        )
    if z.offload_param and stage != 3:
        # DeepSpeed reads offload_param only at stage 3 and ignores it below; so does zerotron,
        # saying so (a config tuned for stage 3 and run at stage 2 is a common sight).
        _warn(
            cfg,
            f"zero.offload_param_device: offload_param.device {z.offload_param_device!r} is "
            f"ignored at ZeRO stage {stage} (only stage 3 partitions parameters, so only it "
            "offloads them)",
        )
        _fill(z, offload_param_device="none", offload_param_nvme_path=None)
    for kind in ("optimizer", "param"):
        device = getattr(z, f"offload_{kind}_device")
        if device == "nvme" and not getattr(z, f"offload_{kind}_nvme_path"):
            raise ConfigError(
                f"offload_{kind}.device 'nvme' needs nvme_path",
                where=f"zero.offload_{kind}_nvme_path",
                fix=f"set zero_optimization.offload_{kind}.nvme_path to a directory on a "
                "fast local disk",
            )
    if z.overlap_comm is None:
        _fill(z, overlap_comm=stage == 3)
    if stage >= 1 and cfg.optimizer.optimizer == "lamb":
        raise UnsupportedError(
            "Lamb under ZeRO: its trust ratio needs each whole tensor's norm, but ZeRO steps "
            "flat partitions that cut tensors apart",
            where="optimizer.optimizer",
            fix="use Lamb with zero_optimization.stage 0, or Adam/AdamW with ZeRO",
        )


def _both_warmups(name: str, value: int, s: SchedulerConfig) -> ConfigError:
    return ConfigError(
        f"lr_warmup_fraction {s.lr_warmup_fraction} and {name} {value} are both set",
        where="scheduler.lr_warmup_fraction",
        fix=f"give one of --lr-warmup-fraction / {flag(name)}",
    )


def _divisors_near(n: int, target: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    divisors.sort(key=lambda d: (abs(d - target), d))
    return " or ".join(str(d) for d in sorted(divisors[:2]))
