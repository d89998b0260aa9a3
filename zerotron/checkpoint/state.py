"""Fit a loaded state dict to a model, or say exactly why it does not fit.

Two checkpoints of the same model may differ in vocabulary padding only (the embedding's rows
are the tokenizer's vocabulary rounded up to a multiple that grows with tensor parallelism:
50257 -> 50304 at TP 1, 50432 at TP 2). That is not a mismatch: the real rows are kept and the
padding is redone. Any other difference (a tensor's shape, a missing or unexpected tensor) is a
:class:`CheckpointError` listing every mismatching tensor with both shapes and the flags to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zerotron.errors import CheckpointError

MAX_LISTED = 50  # a different --num-layers makes hundreds of keys differ; the first ones suffice


def repad_vocab(tensor: torch.Tensor, orig_vocab_size: int, new_rows: int) -> torch.Tensor:
    """Keep the first ``orig_vocab_size`` rows of ``tensor`` and zero-pad it to ``new_rows``."""
    rows = tensor.shape[0]
    if not 0 < orig_vocab_size <= min(rows, new_rows):
        raise ValueError(
            f"cannot re-pad {rows} rows to {new_rows} keeping {orig_vocab_size} vocabulary rows"
        )
    out = tensor.new_zeros((new_rows, *tensor.shape[1:]))
    out[:orig_vocab_size] = tensor[:orig_vocab_size]
    return out


def _shape(t: Any) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _flag(key: str, value: Any) -> str:
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return name if value else f"no {name}"
    return f"{name} {value}"


def _shape_relevant(key: str, value: Any) -> bool:
    # Floats (dropout, eps, init std) never change a shape; the vocab is re-padded separately.
    return isinstance(value, (int, str, bool)) and "vocab" not in key


def _flag_advice(
    ckpt_config: Mapping[str, Any] | None, model_config: Mapping[str, Any] | None
) -> str:
    """What to change, from the checkpoint's model config and (if known) the current one."""
    generic = (
        "build the model with the checkpoint's shapes (its metadata.json has the model config) "
        "or start without --load"
    )
    if not ckpt_config:
        return generic
    if model_config is None:
        saved = [_flag(k, v) for k, v in ckpt_config.items() if _shape_relevant(k, v)]
        if not saved:
            return generic
        saved_with = " ".join(saved)
        return f"the checkpoint was saved with {saved_with}: pass those or start without --load"
    diffs = [
        (k, v, model_config[k])
        for k, v in ckpt_config.items()
        if _shape_relevant(k, v) and k in model_config and model_config[k] != v
    ]
    if not diffs:
        return generic
    said = "; ".join(f"{_flag(k, v)} in the checkpoint vs {m} now" for k, v, m in diffs)
    wanted = " ".join(_flag(k, v) for k, v, _ in diffs)
    return f"{said}: pass {wanted} or start without --load"


def load_model_state(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    vocab_keys: Sequence[str] = (),
    orig_vocab_size: int | None = None,
    vocab_size: int | None = None,
    ckpt_config: Mapping[str, Any] | None = None,
    model_config: Mapping[str, Any] | None = None,
    where: str = "",
) -> list[str]:
    """Load ``state`` into ``model``, re-padding the vocabulary; return the re-padded keys.

    ``vocab_keys`` name tensors whose dim 0 is the padded vocabulary; ``orig_vocab_size`` is the
    checkpoint's unpadded vocabulary (from its metadata). Such a tensor whose shape differs from
    the model's only in dim 0 is re-padded with :func:`repad_vocab`. ``vocab_size``, the current
    tokenizer's vocabulary, guards against loading into another tokenizer's model.
    ``ckpt_config`` (the checkpoint's model config) and ``model_config`` (this model's) turn a
    mismatch into flag advice. ``where`` (the file) prefixes the error.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes every key
    expected = model.state_dict()
    problems: list[str] = []
    if orig_vocab_size is not None and vocab_size is not None and orig_vocab_size != vocab_size:
        problems.append(
            f"vocabulary: checkpoint trained with {orig_vocab_size} tokens vs {vocab_size} "
            "in this tokenizer"
        )

    fitted: dict[str, torch.Tensor] = {}
    repadded: list[str] = []
    for key, want in expected.items():
        if key not in state:
            problems.append(f"{key}: missing in checkpoint (model {_shape(want)})")
            continue
        got = state[key]
        if not isinstance(got, torch.Tensor):
            problems.append(f"{key}: checkpoint holds a {type(got).__name__}, not a tensor")
        elif got.shape == want.shape:
            fitted[key] = got
        elif (
            key in vocab_keys
            and orig_vocab_size is not None
            and got.shape[1:] == want.shape[1:]
            and orig_vocab_size <= min(got.shape[0], want.shape[0])
        ):
            fitted[key] = repad_vocab(got, orig_vocab_size, want.shape[0])
            repadded.append(key)
        else:
            problems.append(f"{key}: checkpoint {_shape(got)} vs model {_shape(want)}")
    problems += [
        f"{key}: unexpected in checkpoint ({_shape(state[key])}), not in the model"
        for key in state
        if key not in expected
    ]

    if problems:
        listed = problems[:MAX_LISTED]
        if len(problems) > MAX_LISTED:
            listed.append(f"... and {len(problems) - MAX_LISTED} more")
        raise CheckpointError(
            f"the checkpoint does not fit the model ({len(problems)} "
            f"difference{'s' if len(problems) != 1 else ''}):\n    " + "\n    ".join(listed),
            where=where or None,
            fix=_flag_advice(ckpt_config, model_config),
        )
    model.load_state_dict(fitted, strict=True)
    return repadded


def refuse_non_finite(tree: Any, where: str, name: str = "") -> None:
    """Refuse a loaded state that holds NaN or Inf, naming the file (``where``) and the tensor.

    A flipped bit in an exponent turns a weight into Inf/NaN; loading it silently makes every
    later loss NaN. No trained weight or optimizer state is legitimately non-finite.
    """
    stack: list[tuple[str, Any]] = [(name, tree)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                raise CheckpointError(
                    f"tensor {path or '(top level)'} holds {bad} NaN/Inf value"
                    f"{'s' if bad != 1 else ''} (shape {list(value.shape)})",
                    where=where,
                    fix="the file is corrupt (a flipped bit) or was saved after training "
                    "diverged: load an earlier checkpoint (pass its tag, or point the "
                    "'latest' tracker at it)",
                )
        elif isinstance(value, Mapping):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
