"""The ``data`` section: tokenized data, its split and blend, the tokenizer, the data loader;
and the parsers of Megatron's --data-path and --split that the data layer uses too."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from zerotron.config.sections.base import Int, Section, check_choice
from zerotron.errors import ConfigError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "NullTokenizer")
"""Tokenizers zerotron implements."""

UNSUPPORTED_TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
)
"""Megatron-LM tokenizer types zerotron knows about but does not implement."""


PER_SPLIT_FIELDS = ("train_data_path", "valid_data_path", "test_data_path")
"""Megatron's per-split data paths, in split order."""
PATH_FIELDS = ("data_path", *PER_SPLIT_FIELDS)


class DataConfig(Section):
    """Tokenized data, its split, the tokenizer, the data loader."""

    data_path: list[str] | None = Field(
        None,
        description="Dataset prefix, or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...', or several "
        "prefixes weighted by their size.",
    )
    train_data_path: list[str] | None = Field(
        None,
        description="The training data alone, a prefix or a blend as --data-path, all its "
        "documents; with --valid-data-path and --test-data-path in place of --data-path and "
        "--split (Megatron's).",
    )
    valid_data_path: list[str] | None = Field(
        None,
        description="The validation data alone (see --train-data-path); none: no validation.",
    )
    test_data_path: list[str] | None = Field(
        None, description="The test data alone (see --train-data-path); none: no test."
    )
    data_args_path: str | None = Field(
        None, description="A text file holding --data-path's value (Megatron's)."
    )
    per_split_data_args_path: str | None = Field(
        None,
        description='A JSON file {"train": ..., "valid": ..., "test": ...} holding the three '
        "per-split paths, each a string or a list as --data-path (Megatron's).",
    )
    mock_data: bool = Field(
        False,
        description="Train on synthetic documents (zerotron.data.mock) instead of --data-path: "
        "deterministic by --seed, the same samples for every layout (Megatron's --mock-data).",
    )
    split: str = Field(
        "969,30,1", description="Train,valid,test proportions of the documents (Megatron's)."
    )
    tokenizer_type: str = Field("GPT2BPETokenizer", description="Tokenizer.")
    vocab_size: Int | None = Field(
        None,
        ge=1,
        description="NullTokenizer's vocabulary: ids 0..N-1 and the end-of-document id N "
        "(Megatron's --vocab-size).",
    )
    vocab_file: str | None = Field(
        None, description="GPT-2 encoder.json (Megatron's --vocab-file); default: the bundled one."
    )
    merge_file: str | None = Field(
        None, description="GPT-2 vocab.bpe merges; the bundled one if not given."
    )
    num_workers: Int = Field(2, ge=0, description="Data loader worker processes.")
    eod_mask_loss: bool = Field(False, description="Mask the loss on end-of-document tokens.")
    reset_position_ids: bool = Field(False, description="Restart position ids after each EOD.")
    reset_attention_mask: bool = Field(
        False, description="Do not attend across documents (EOD) inside a sample."
    )
    data_cache_path: str | None = Field(
        None, description="Directory for index caches; next to the data when not given."
    )

    @field_validator(*PATH_FIELDS, mode="before")
    @classmethod
    def _split_blend_string(cls, value: Any) -> Any:
        # A file may give the blend as one string "0.3 A 0.7 B", or numbers in a YAML list.
        if isinstance(value, str):
            return value.split()
        if isinstance(value, list):
            return [str(v) for v in value]
        return value

    @field_validator(*PATH_FIELDS)
    @classmethod
    def _check_blend(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is not None:
            parse_data_path(value, where=f"data.{info.field_name}")
        return value

    @field_validator("split")
    @classmethod
    def _check_split(cls, value: str) -> str:
        parse_split(value)
        return value

    @field_validator("tokenizer_type")
    @classmethod
    def _check_tokenizer(cls, value: str) -> str:
        check_choice("data.tokenizer_type", value, TOKENIZER_TYPES, UNSUPPORTED_TOKENIZER_TYPES)
        return value

    @model_validator(mode="after")
    def _check_vocab_size(self) -> DataConfig:
        null = self.tokenizer_type == "NullTokenizer"
        if null and self.vocab_size is None:
            raise ConfigError(
                "NullTokenizer needs a vocabulary size",
                where="data.vocab_size",
                fix="pass --vocab-size N (ids 0..N-1, end-of-document N)",
            )
        if not null and self.vocab_size is not None:
            raise ConfigError(
                f"--vocab-size is NullTokenizer's; {self.tokenizer_type} takes its vocabulary "
                "from its files",
                where="data.vocab_size",
                fix="drop --vocab-size, or use --tokenizer-type NullTokenizer",
            )
        return self

    @property
    def per_split(self) -> bool:
        """The splits come from --train/valid/test-data-path (not --data-path and --split)."""
        return any(getattr(self, f) is not None for f in PER_SPLIT_FIELDS)

    @property
    def blend(self) -> tuple[list[str], list[float] | None] | None:
        """``(prefixes, weights)`` from data_path; weights None means 'by dataset size'."""
        return None if self.data_path is None else parse_data_path(self.data_path)

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        """The split normalized to fractions summing to 1 (train, valid, test)."""
        return parse_split(self.split)


def parse_data_path(
    items: list[str], where: str = "data.data_path"
) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path: ``[P]``, ``[W1, P1, W2, P2, ...]`` or ``[P1, P2, ...]``.

    Returns ``(prefixes, weights)``; weights is None when they are to come from dataset sizes.
    """
    if not items:
        flag = "--" + where.split(".")[-1].replace("_", "-")
        raise ConfigError("no dataset prefix given", where=where, fix=f"{flag} PREFIX")

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    weights = [number(s) for s in items[0::2]]
    if len(items) % 2 == 1 or all(w is None for w in weights):
        if any(number(s) is not None for s in items):
            raise ConfigError(
                f"a blend needs a weight before every prefix: {' '.join(items)!r}",
                where=where,
                fix="write 'W1 PREFIX1 W2 PREFIX2 ...', or only prefixes",
            )
        return list(items), None
    if any(w is None for w in weights) or any(number(p) is not None for p in items[1::2]):
        raise ConfigError(
            f"a blend alternates weights and prefixes: {' '.join(items)!r}",
            where=where,
            fix="write 'W1 PREFIX1 W2 PREFIX2 ...'",
        )
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ConfigError(
            f"blend weights must be positive numbers, got {weights}",
            where=where,
            fix="give each prefix a weight > 0 (leave out a prefix you do not want)",
        )
    return list(items[1::2]), weights


def parse_split(split: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``969/30/1``) -> fractions; missing parts are 0, as in Megatron."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise ConfigError(
            f"split {split!r} is not up to three non-negative numbers",
            where="data.split",
            fix="write train,valid,test proportions, e.g. --split 969,30,1",
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(
            f"split {split!r} sums to 0", where="data.split", fix="give the train part a weight"
        )
    return values[0] / total, values[1] / total, values[2] / total
