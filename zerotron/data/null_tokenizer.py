"""Megatron-LM's ``NullTokenizer`` (``--tokenizer-type NullTokenizer --vocab-size N``).

For data that is tokenized already (each document's text is its ids written out) and for
``--mock-data`` at any vocabulary size. :func:`zerotron.data.tokenizer.build_tokenizer` builds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zerotron.errors import ConfigError, TokenizerError


class NullTokenizer:
    """Megatron's ``NullTokenizer``: text is ids written out (``"12 7 3"``), for data that is
    tokenized already and for ``--mock-data``. ``--vocab-size N`` gives ``N + 1`` ids, the last
    (``N``) the end-of-document id, as in Megatron-LM."""

    def __init__(self, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(
                f"NullTokenizer needs a positive --vocab-size, got {vocab_size!r}",
                where="--vocab-size",
            )
        self._eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        """``--vocab-size`` ids plus the EOD id."""
        return self._eod + 1

    @property
    def eod(self) -> int:
        return self._eod

    eod_id = eod

    def tokenize(self, text: str) -> list[int]:
        """The whitespace-separated integers of ``text``."""
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as e:
            raise TokenizerError(f"NullTokenizer reads integers only: {e}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is not below the vocabulary {self.vocab_size}")
        return ids

    encode = tokenize

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    decode = detokenize

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
