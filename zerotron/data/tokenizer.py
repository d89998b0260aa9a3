"""GPT-2's byte-level BPE tokenizer (Megatron's ``GPT2BPETokenizer``), byte-identical to OpenAI's.

The algorithm (Radford et al. 2019, OpenAI's ``encoder.py``): split the text with a regex into
pre-tokens (words, numbers, punctuation runs, whitespace), map each pre-token's UTF-8 bytes to
printable characters (``bytes_to_unicode``), then repeatedly merge the adjacent pair with the
lowest rank in ``vocab.bpe`` until none is left; ``encoder.json`` maps the pieces to ids.

The fast path runs that algorithm in tiktoken (Rust), built offline from the local files: its
merge ranks are the rank of the merged token, which for a byte-level vocabulary trained by BPE
gives the same ids as merging by pair rank. For the packaged GPT-2 files this was checked against
the pure-Python algorithm and HuggingFace ``tokenizers`` on every Unicode code point; for other
files it is checked on every vocabulary entry when the tokenizer is built, and a pure-Python BPE
takes over if the check fails.

``<|endoftext|>`` written in the input text is ordinary text (7 tokens), as in Megatron-LM,
whose ``GPT2BPETokenizer.tokenize`` never looks for special tokens; the EOD id (50256) only
enters the data through ``--append-eod``. That way a document cannot forge a document boundary.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import regex
import tiktoken

from zerotron.config.sections.data import TOKENIZER_TYPES, UNSUPPORTED_TOKENIZER_TYPES
from zerotron.data.null_tokenizer import NullTokenizer
from zerotron.errors import ConfigError, TokenizerError, UnsupportedError

GPT2_DIR = Path(__file__).with_name("gpt2")
EOD_TOKEN = "<|endoftext|>"
# OpenAI's pre-tokenizer: contractions, letters, numbers, other symbols (each optionally led by
# one space), then whitespace that is not followed by a non-space, then any whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Bytes that are already printable (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to
    themselves; the other 68 map to code points 256, 257, ... in byte order, so no byte
    becomes whitespace or a control character inside ``vocab.bpe``.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in mapping)
    for n, b in enumerate(others):
        mapping[b] = chr(256 + n)
    return mapping


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """The raw bytes a vocabulary entry stands for (entries outside the byte alphabet as UTF-8)."""
    table = _unicode_to_bytes()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _without_surrogates(text: str) -> str:
    # A JSON "\ud800" escape yields a lone surrogate, which UTF-8 cannot encode; tiktoken turns
    # it into U+FFFD and the pure-Python path must do the same to give the same ids.
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# --------------------------------------------------------------------------- vocabulary files


def read_vocab_pair(
    vocab_file: str | os.PathLike, merge_file: str | os.PathLike
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """``encoder.json`` (token -> id) and ``vocab.bpe`` (merges, highest priority first)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(
            f"cannot read the vocab file: {e}",
            where=str(vocab_file),
            fix="pass GPT-2's encoder.json (gpt2-vocab.json) with --vocab-file",
        ) from e
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise TokenizerError(
            "the vocab file is not a JSON object of token -> id",
            where=str(vocab_file),
            fix="pass GPT-2's encoder.json (gpt2-vocab.json) with --vocab-file",
        )
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(
            f"cannot read the merge file: {e}",
            where=str(merge_file),
            fix="pass GPT-2's vocab.bpe (gpt2-merges.txt) with --merge-file",
        ) from e
    merges = []
    for n, line in enumerate(lines, 1):
        if not line or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(
                f"expected two space-separated symbols, got {line!r}",
                where=f"{merge_file}:{n}",
                fix="pass GPT-2's vocab.bpe (gpt2-merges.txt) with --merge-file",
            )
        merges.append((parts[0], parts[1]))
    return encoder, merges


def read_tokenizer_json(path: str | os.PathLike) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a HuggingFace ``tokenizer.json`` for a GPT-2-style byte BPE.

    Only files that tokenize exactly like GPT-2's are accepted: a BPE model with no
    dropout, prefixes or byte fallback, and a ByteLevel pre-tokenizer with the GPT-2 regex and
    no added prefix space. Anything else would silently give different ids, so it is an error.
    """
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read tokenizer.json: {e}", where=str(path)) from e

    def reject(what: str) -> TokenizerError:
        return TokenizerError(
            what,
            where=str(path),
            fix="only GPT-2-style byte-level BPE tokenizers are supported; "
            "use --vocab-file/--merge-file for GPT-2's own files",
        )

    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        raise reject(f"model type {model.get('type') if isinstance(model, dict) else None!r}")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "unk_token"):
        if model.get(key):
            raise reject(f"model.{key} = {model[key]!r} is not GPT-2 byte-level BPE")
    if model.get("byte_fallback"):
        raise reject("model.byte_fallback is set")
    if spec.get("normalizer"):
        raise reject(f"normalizer {spec['normalizer'].get('type')!r} is not supported")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if len(steps) != 1 or steps[0].get("type") != "ByteLevel":
        raise reject(f"pre_tokenizer {[s.get('type') for s in steps]} is not GPT-2's ByteLevel")
    if steps[0].get("add_prefix_space") or not steps[0].get("use_regex", True):
        raise reject("ByteLevel pre_tokenizer with add_prefix_space or without the GPT-2 regex")

    encoder = dict(model.get("vocab") or {})
    merges = []
    for m in model.get("merges") or []:
        pair = m.split(" ") if isinstance(m, str) else m
        if len(pair) != 2:
            raise reject(f"malformed merge {m!r}")
        merges.append((pair[0], pair[1]))
    for added in spec.get("added_tokens") or []:
        encoder.setdefault(added["content"], int(added["id"]))
    return encoder, merges


# --------------------------------------------------------------------------- BPE engines


class PythonBPE:
    """The reference algorithm in plain Python (OpenAI's ``encoder.py``), with a word cache.

    Used when the vocabulary cannot be run through tiktoken exactly; slow but always right.
    """

    def __init__(self, encoder: dict[str, int], merges: Sequence[tuple[str, str]]):
        self.encoder = encoder
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.byte_encoder = bytes_to_unicode()
        self.cache: dict[str, list[str]] = {}

    def bpe(self, word: str) -> list[str]:
        """Merge the characters of one byte-mapped pre-token, lowest pair rank first."""
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best = min(zip(parts, parts[1:]), key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            first, second = best
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        if len(self.cache) < 100_000:
            self.cache[word] = parts
        return parts

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pattern.findall(_without_surrogates(text)):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            try:
                ids.extend(self.encoder[t] for t in self.bpe(word))
            except KeyError as e:
                raise TokenizerError(
                    f"BPE produced {e.args[0]!r}, which is not in the vocab file",
                    fix="the vocab and merge files do not belong together",
                ) from None
        return ids


def _tiktoken_ranks(
    encoder: dict[str, int], merges: Sequence[tuple[str, str]]
) -> tuple[dict[bytes, int], list[int] | None] | None:
    """tiktoken's mergeable ranks for a byte-level vocab/merges pair, if they can be derived.

    The rank of a token must follow the order of the merge that makes it; the 256 single bytes
    are never the result of a merge, so their ranks only need to be distinct. If the vocab ids
    already follow merge order (GPT-2's do: id = 256 + merge index) the ranks are the ids;
    otherwise ranks are 0..255 for bytes then 256 + merge index, and the second value maps a
    rank back to its id. None when the pair cannot be expressed this way.
    """
    byte_chars = bytes_to_unicode()
    if not all(c in encoder for c in byte_chars.values()):
        return None  # not a byte-level vocabulary
    products = [a + b for a, b in merges]
    if len(set(products)) != len(products) or set(products) & set(byte_chars.values()):
        return None  # one token made by two different merges: ranks by token cannot express it
    missing = [p for p in products if p not in encoder]
    if missing:
        raise TokenizerError(
            f"merge result {missing[0]!r} is not in the vocab file ({len(missing)} such merges)",
            fix="the vocab and merge files do not belong together",
        )
    ids = [encoder[p] for p in products]
    byte_ids = {b: encoder[c] for b, c in byte_chars.items()}
    if all(x < y for x, y in zip(ids, ids[1:])):
        ranks = {bytes([b]): i for b, i in byte_ids.items()}
        ranks.update((token_bytes(p), i) for p, i in zip(products, ids))
        return ranks, None
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update((token_bytes(p), 256 + n) for n, p in enumerate(products))
    id_of_rank = [byte_ids[b] for b in range(256)] + ids
    return ranks, id_of_rank


def _read_tiktoken_file(path: Path) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


# --------------------------------------------------------------------------- the tokenizer


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE: ``tokenize(text) -> ids`` and ``detokenize(ids) -> text``.

    With no arguments it loads the packaged GPT-2 files (vocab 50257, EOD 50256), offline.
    ``vocab_file``/``merge_file`` are ``encoder.json``/``vocab.bpe`` as Megatron's
    ``--vocab-file``/``--merge-file`` take them.
    """

    def __init__(
        self,
        vocab_file: str | os.PathLike | None = None,
        merge_file: str | os.PathLike | None = None,
    ):
        if (vocab_file is None) != (merge_file is None):
            raise TokenizerError(
                "--vocab-file and --merge-file must be given together",
                fix="pass both, or neither to use the packaged GPT-2 files",
            )
        if vocab_file is None:
            self._init_packaged()
        else:
            self._init_from(*read_vocab_pair(vocab_file, merge_file), source=str(vocab_file))

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> GPT2BPETokenizer:
        """Build from a HuggingFace ``tokenizer.json`` (read here; no ``tokenizers`` needed)."""
        self = cls.__new__(cls)
        self._init_from(*read_tokenizer_json(path), source=str(path))
        return self

    def _init_packaged(self) -> None:
        ranks = _read_tiktoken_file(GPT2_DIR / "gpt2.tiktoken")
        eod = len(ranks)  # GPT-2's EOD is the one id after the 50256 mergeable ranks
        self._set(ranks, None, {eod: EOD_TOKEN.encode()}, eod, len(ranks) + 1, None)
        self._encoder: dict[str, int] | None = None

    def _init_from(
        self, encoder: dict[str, int], merges: list[tuple[str, str]], *, source: str
    ) -> None:
        if EOD_TOKEN not in encoder:
            raise TokenizerError(
                f"the vocabulary has no {EOD_TOKEN} token, which GPT2BPETokenizer uses as EOD",
                where=source,
            )
        derived = _tiktoken_ranks(encoder, merges)
        python_bpe = None
        if derived is not None:
            ranks, id_of_rank = derived
            if id_of_rank is None and ranks == _packaged_ranks():
                pass  # GPT-2's own vocabulary: checked once and for all by the tests
            elif not _agrees_with_python(ranks, encoder, merges):
                derived = None
        if derived is None:
            python_bpe = PythonBPE(encoder, merges)
            ranks, id_of_rank = {}, None
            print(
                f"zerotron: {source}: merges cannot run through tiktoken exactly; "
                "using the (slower) pure-Python BPE",
                file=sys.stderr,
            )
        merged = set(ranks.values()) if id_of_rank is None else set(id_of_rank)
        extra = {i: token_bytes(t) for t, i in encoder.items() if i not in merged}
        self._set(ranks, id_of_rank, extra, encoder[EOD_TOKEN], len(encoder), python_bpe)
        self._encoder = dict(encoder)

    def _set(self, ranks, id_of_rank, extra, eod, vocab_size, python_bpe) -> None:
        self._ranks = ranks
        self._id_of_rank = id_of_rank
        self._eod = eod
        self._vocab_size = vocab_size
        self._python_bpe = python_bpe
        # id -> bytes for decoding: every BPE token, plus entries no merge produces (EOD).
        if id_of_rank is None:
            self._id_bytes = {i: b for b, i in ranks.items()}
        else:
            self._id_bytes = {id_of_rank[r]: b for b, r in ranks.items()}
        self._id_bytes.update(extra)
        self._encoding = (
            tiktoken.Encoding(
                "zerotron-gpt2-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
            )
            if ranks
            else None
        )

    # Megatron's tokenizer interface --------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Entries in the vocabulary (50257 for GPT-2), before padding."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The end-of-document id (``<|endoftext|>``, 50256 for GPT-2)."""
        return self._eod

    eod_id = eod

    @property
    def vocab(self) -> dict[str, int]:
        """Token string (byte-mapped, as in ``encoder.json``) -> id."""
        if self._encoder is None:
            enc = bytes_to_unicode()
            self._encoder = {"".join(enc[b] for b in t): i for i, t in self._id_bytes.items()}
            self._encoder[EOD_TOKEN] = self._eod
        return self._encoder

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def uses_tiktoken(self) -> bool:
        """True when encoding runs in tiktoken (False: pure-Python fallback)."""
        return self._python_bpe is None

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text``; ``<|endoftext|>`` inside it is ordinary text (see module doc)."""
        if self._python_bpe is not None:
            return self._python_bpe.encode(text)
        ranks = self._encoding.encode_ordinary(text)
        if self._id_of_rank is None:
            return ranks
        return [self._id_of_rank[r] for r in ranks]

    encode = tokenize

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """:meth:`tokenize` for many texts (tiktoken releases the GIL across ``num_threads``)."""
        if self._python_bpe is not None or self._id_of_rank is not None or num_threads <= 1:
            return [self.tokenize(t) for t in texts]
        return self._encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD (as GPT-2 does)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    decode = detokenize

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        try:
            return b"".join([self._id_bytes[int(i)] for i in ids])
        except KeyError as e:
            raise TokenizerError(
                f"token id {e.args[0]} is not in the vocabulary (size {self.vocab_size})"
            ) from None

    def __repr__(self) -> str:
        engine = "tiktoken" if self.uses_tiktoken else "python"
        return f"GPT2BPETokenizer(vocab_size={self.vocab_size}, eod={self.eod}, engine={engine})"


@functools.lru_cache(maxsize=1)
def _packaged_ranks() -> dict[bytes, int]:
    return _read_tiktoken_file(GPT2_DIR / "gpt2.tiktoken")


def _agrees_with_python(
    ranks: dict[bytes, int], encoder: dict[str, int], merges: list[tuple[str, str]]
) -> bool:
    """Does tiktoken with ``ranks`` split every vocabulary entry as the merge-by-pair BPE does?

    Ranks by merged token differ from ranks by pair only when a token can be reached by two
    different splits; encoding each entry on its own exposes such a token.
    """
    encoding = tiktoken.Encoding(
        "check", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    python = PythonBPE(encoder, merges)
    rank_of = {tok: ranks[token_bytes(tok)] for tok in encoder if token_bytes(tok) in ranks}
    for tok in rank_of:
        expect = [rank_of[t] for t in python.bpe(tok)]
        if encoding._encode_single_piece(token_bytes(tok)) != expect:
            return False
    return True


# --------------------------------------------------------------------------- Megatron helpers


def build_tokenizer(
    tokenizer_type: str = "GPT2BPETokenizer",
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    tokenizer_json: str | os.PathLike | None = None,
    *,
    vocab_size: int | None = None,
) -> GPT2BPETokenizer | NullTokenizer:
    """The tokenizer Megatron's ``--tokenizer-type`` names: GPT-2 BPE, or ``NullTokenizer``
    (with ``vocab_size``, Megatron's ``--vocab-size``)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        cls = UnsupportedError if tokenizer_type in UNSUPPORTED_TOKENIZER_TYPES else ConfigError
        raise cls(
            f"tokenizer type {tokenizer_type!r} is not supported",
            where="--tokenizer-type",
            fix=f"supported: {', '.join(TOKENIZER_TYPES)}",
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or any(
            f is not None for f in (vocab_file, merge_file, tokenizer_json)
        ):
            raise ConfigError(
                "NullTokenizer takes --vocab-size N and no vocabulary files",
                where="--tokenizer-type NullTokenizer",
                fix="pass --vocab-size N (ids 0..N-1, EOD N) and drop --vocab-file/--merge-file",
            )
        return NullTokenizer(vocab_size)
    if vocab_size is not None:
        raise ConfigError(
            f"--vocab-size is NullTokenizer's; {tokenizer_type} has its vocabulary from its files",
            where="--vocab-size",
            fix="drop --vocab-size, or use --tokenizer-type NullTokenizer",
        )
    if tokenizer_json is not None:
        if vocab_file is not None or merge_file is not None:
            raise ConfigError(
                "give either a tokenizer.json or --vocab-file/--merge-file, not both",
                where="--tokenizer-json",
            )
        return GPT2BPETokenizer.from_tokenizer_json(tokenizer_json)
    return GPT2BPETokenizer(vocab_file, merge_file)


def vocab_size_with_padding(
    orig_vocab_size: int,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
    log: bool = True,
) -> int:
    """Round the vocabulary up so the embedding splits evenly over tensor-parallel ranks.

    Padded to a multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size``
    (GPT-2: 50257 -> 50304 at TP 1, 50432 at TP 2), with Megatron's log line on rank 0.
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple <= 0:
        raise ConfigError(
            f"make_vocab_size_divisible_by x tensor_model_parallel_size = {multiple}",
            where="--make-vocab-size-divisible-by",
            fix="use positive values",
        )
    padded = -(-orig_vocab_size // multiple) * multiple
    if log and _is_rank_zero():
        print(
            f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} "
            f"dummy tokens (new size: {padded})",
            flush=True,
        )
    return padded


def _is_rank_zero() -> bool:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == 0
