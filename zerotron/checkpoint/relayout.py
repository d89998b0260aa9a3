"""Loading a checkpoint into a layout other than the one that saved it: what may differ, and
the files one rank reads.

A layout (:class:`~zerotron.checkpoint.canonical.Layout`) is how a run is cut: tensor, pipeline
and virtual pipeline sizes, the data-parallel size and the ZeRO stage; the optimizer state may
also live elsewhere (offload). Any of these may differ between the run that saved a checkpoint
and the run that loads it: the conversion engine (:mod:`zerotron.checkpoint.target`) gives each
rank of the new layout exactly the files its own save would have written. What a layout change
cannot carry is another model: a different number of layers, hidden size, heads, FFN size,
position embeddings, biases or tokenizer vocabulary is refused by :func:`refuse_other_model`,
which lists every difference.

:class:`CheckpointFiles` is what the Engine reads a checkpoint's files through: from the tag
directory on disk, or from the mapping the conversion gave this rank in memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotron.checkpoint.layout import tag_dir
from zerotron.checkpoint.save_load import load_file
from zerotron.errors import CheckpointError

# Keys of a model config that a change of layout may change too, or that change no tensor:
# the padded vocabulary (re-padded), the sequence length (positions come from
# max_position_embeddings), activation recomputation and sequence parallelism (how the same
# weights are run). Floats (dropout, epsilon, init std) never shape a tensor either.
LAYOUT_FREE_KEYS = frozenset(
    {
        "vocab_size",
        "seq_length",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "sequence_parallel",
    }
)


def describe_layout(layout: Any, offload: str = "none") -> str:
    """``tp2 pp2 vpp2 dp1 zero1 offload cpu``: a :class:`~zerotron.checkpoint.canonical.Layout`
    and where its optimizer state lives (``offload``: none, cpu or nvme), for the log."""
    s = f"tp{layout.tensor_parallel} pp{layout.pipeline_parallel}"
    s += f" vpp{layout.virtual_stages}" if layout.virtual_stages > 1 else ""
    s += f" dp{layout.data_parallel} zero{layout.zero_stage}"
    return s + (f" offload {offload}" if offload not in ("none", "") else "")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


_ABSENT = object()


def model_differences(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    saved_vocab: int | None = None,
    vocab: int | None = None,
) -> list[tuple[str, Any, Any]]:
    """Every ``(key, in the checkpoint, now)`` on which the checkpoint's model config ``saved``
    and this run's ``current`` differ and that no layout change carries (see
    :data:`LAYOUT_FREE_KEYS`; a key one side lacks is :data:`_ABSENT` there). ``saved_vocab`` and
    ``vocab``, the tokenizers' vocabularies (metadata.json's ``vocab.size``), are the key
    ``vocabulary``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if key in LAYOUT_FREE_KEYS or isinstance(a, float) or isinstance(b, float) or a == b:
            continue
        out.append((key, a, b))
    known = saved_vocab is not None and vocab is not None
    # orig_vocab_size, when the configs have it, already says the same
    if known and saved_vocab != vocab and not any(k == "orig_vocab_size" for k, _, _ in out):
        out.append(("vocabulary", saved_vocab, vocab))
    return out


def _said(value: Any) -> str:
    return "absent" if value is _ABSENT else repr(value)


def refuse_other_model(
    meta: Mapping[str, Any],
    model_config: Mapping[str, Any] | None,
    vocab_size: int | None,
    where: str,
    saved_layout: str,
    layout: str,
    recorded_in: str = "the checkpoint's metadata.json has its model config and tokenizer",
) -> None:
    """Raise a :class:`CheckpointError` listing every difference between the model that saved
    the checkpoint (``meta``) and this run's (``model_config``, tokenizer ``vocab_size``); the
    layouts name the conversion that was asked for; ``recorded_in`` says where the checkpoint's
    model config is to be read."""
    saved_config = meta.get("model") or {}
    if not saved_config or model_config is None:
        return
    saved_vocab = (meta.get("vocab") or {}).get("size")
    diffs = model_differences(saved_config, model_config, saved_vocab, vocab_size)
    if not diffs:
        return
    lines = [
        f"{key}: {_said(a)} in the checkpoint vs {_said(b)} now"
        + ("" if key == "vocabulary" else f" ({_flag(key)})")
        for key, a, b in diffs
    ]
    flags = [
        f"{_flag(key)} {a}"
        for key, a, _ in diffs
        if key in saved_config and not isinstance(a, bool) and key != "orig_vocab_size"
    ]
    model = f"pass {' '.join(flags)}" if flags else "build the checkpoint's model"
    raise CheckpointError(
        f"the checkpoint holds another model than this run's ({len(diffs)} "
        f"difference{'s' if len(diffs) != 1 else ''}; a change of layout is carried over, "
        f"from {saved_layout} to {layout}, a change of model is not):\n    " + "\n    ".join(lines),
        where=where,
        fix=f"{model} ({recorded_in}), or start without --load",
    )


class CheckpointFiles:
    """The files of one checkpoint tag that this rank reads: from disk, or from the mapping
    ``{relative path: object}`` that a conversion gave it (``memory``)."""

    def __init__(
        self,
        load_dir: str | os.PathLike,
        tag: str,
        memory: Mapping[str, Any] | None = None,
        converted_from: str | None = None,
    ):
        self.load_dir = load_dir
        self.tag = tag
        self.memory = memory
        self.converted_from = converted_from
        """The saved layout the files were converted from, described (None: read as saved)."""

    @property
    def dir(self) -> Path:
        """The tag directory on disk."""
        return tag_dir(self.load_dir, self.tag)

    def read(self, relpath: str) -> Any:
        """One file's object (``relpath`` as the layout names it)."""
        if self.memory is None:
            return load_file(self.load_dir, self.tag, relpath)
        if relpath not in self.memory:
            raise CheckpointError(
                f"the conversion from {self.converted_from} gave this rank no {relpath}",
                where=str(self.dir),
                fix="this is a bug in the conversion: report it; meanwhile convert offline "
                "with `zerotron convert` and load the result",
            )
        return self.memory[relpath]
