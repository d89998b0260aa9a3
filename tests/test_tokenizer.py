"""GPT-2 tokenizer: ids equal two independent references on hard text.

References: a small GPT-2 BPE written here from OpenAI's description (regex pre-tokens, byte to
unicode table, merge the lowest-ranked pair until none is left), and HuggingFace ``tokenizers``
built from the same local encoder.json / vocab.bpe (Rust, a third implementation).
"""

import json
import random
from pathlib import Path

import pytest
import regex
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from zerotron.data.tokenizer import GPT2BPETokenizer, build_tokenizer, vocab_size_with_padding
from zerotron.errors import ConfigError, TokenizerError, UnsupportedError

GPT2 = Path(__file__).resolve().parents[1] / "zerotron" / "data" / "gpt2"
VOCAB, MERGES = GPT2 / "encoder.json", GPT2 / "vocab.bpe"


class ReferenceBPE:
    """GPT-2's encoder as the paper's code describes it, written independently for the tests."""

    SPLIT = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def __init__(self, vocab: dict, merges: list):
        self.vocab = vocab
        self.rank = {tuple(m): r for r, m in enumerate(merges)}
        keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
        moved = [b for b in range(256) if b not in keep]
        self.char = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(moved)}
        self.byte = {c: b for b, c in self.char.items()}

    def word(self, symbols: list) -> list:
        # One merge at a time, at the leftmost occurrence of the lowest-ranked pair.
        while len(symbols) > 1:
            ranks = [self.rank.get(p, float("inf")) for p in zip(symbols, symbols[1:])]
            best = min(ranks)
            if best == float("inf"):
                break
            i = ranks.index(best)
            symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
        return symbols

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.SPLIT.findall(text):
            chars = [self.char[b] for b in piece.encode("utf-8")]
            ids += [self.vocab[s] for s in self.word(chars)]
        return ids

    def decode(self, ids) -> str:
        inv = {i: s for s, i in self.vocab.items()}
        return bytes(self.byte[c] for i in ids for c in inv[i]).decode("utf-8", "replace")


def load_pair(vocab=VOCAB, merges=MERGES):
    encoder = json.loads(Path(vocab).read_text(encoding="utf-8"))
    lines = Path(merges).read_text(encoding="utf-8").split("\n")[1:]
    return encoder, [tuple(line.split(" ")) for line in lines if line]


@pytest.fixture(scope="module")
def ref():
    return ReferenceBPE(*load_pair())


@pytest.fixture(scope="module")
def hf():
    tok = Tokenizer(models.BPE.from_file(str(VOCAB), str(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def tok():
    return GPT2BPETokenizer()


HARD = [
    "Hello, world! This is GPT-2.",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\t \t mixed \u00a0non-breaking\u2009thin\u3000ideographic",
    "line\r\nbreaks\r\n\r\n\n\n\rold mac\r",
    "NUL\x00inside\x00\x00 and controls \x01\x07\x1b[0m \x1c\x1d\x1e\x1f \x85 \u2028\u2029",
    "numbers 12345678901234567890 3.14159 1,000,000 ٣٤٥ ⅷ ² ½",
    "contractions: don't won't I'm we've they'll she'd it's Y'ALL'RE 'S 's's ''",
    "emoji 🤖🚀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣ ❤️",
    "mixed scripts: 日本語のテキスト 中文 한국어 العربية עברית हिन्दी ภาษาไทย Ελληνικά Кириллица",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0364\u036b",
    "math ∑∫√∞≠≤ arrows →⇒ box ┌─┐ currency €£¥₹ ₿",
    "code: def f(x):\n    return x**2  # comment\n\tif a != b: pass",
    "<|endoftext|> written in the text is plain text<|endoftext|>",
    "          ",
    "\n",
    "",
    "a",
    "x" * 300 + " " + "ab" * 200,
    "URLs https://example.com/a?b=c&d=e#f and e-mail a.b@c.de",
    "private use \ue000 and planes 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 \U0001f9ea \U000e0041 \U0010fffd",
]


@pytest.mark.parametrize("text", HARD)
def test_ids_equal_references(tok, ref, hf, text):
    ids = tok.tokenize(text)
    assert ids == ref.encode(text)
    assert ids == hf.encode(text).ids
    assert tok.detokenize(ids) == text
    assert tok.encode(text) == ids and tok.decode(ids) == text  # the aliases


def test_random_unicode_fuzz(tok, hf):
    rng = random.Random(1234)
    ranges = [(0, 0x80), (0x80, 0x800), (0x800, 0x3000), (0x3000, 0xD800), (0xE000, 0x10000),
              (0x10000, 0x20000), (0x1F300, 0x1FAFF)]  # fmt: skip
    alphabet = " \t\n\r'sdmtlvre0123456789.,!?-"
    texts = []
    for _ in range(400):
        chars = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.5:
                chars.append(rng.choice(alphabet))
            else:
                lo, hi = rng.choice(ranges)
                chars.append(chr(rng.randrange(lo, hi)))
        texts.append("".join(chars))
    assert [tok.tokenize(t) for t in texts] == [e.ids for e in hf.encode_batch(texts)]
    assert tok.tokenize_batch(texts, num_threads=2) == [tok.tokenize(t) for t in texts]
    assert [tok.detokenize(tok.tokenize(t)) for t in texts] == texts


def test_corpus_text_equals_reference(tok, hf, austen_path):
    with open(austen_path, encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(3)]
    assert [tok.tokenize(t) for t in texts] == [e.ids for e in hf.encode_batch(texts)]


def test_endoftext_is_ordinary_text_and_eod_is_50256(tok, ref):
    ids = tok.tokenize("<|endoftext|>")
    assert ids == ref.encode("<|endoftext|>") and len(ids) == 7 and 50256 not in ids
    assert tok.eod == tok.eod_id == ref.vocab["<|endoftext|>"] == 50256
    assert tok.vocab_size == len(ref.vocab) == 50257
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"
    assert tok.vocab == ref.vocab


def test_decode_of_split_utf8_uses_replacement(tok):
    ids = tok.tokenize("🤖")
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    assert tok.detokenize(ids[:1]) == "\ufffd"
    assert tok.decode_bytes(ids) == "🤖".encode()
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        tok.detokenize([50257])


def test_lone_surrogate_encodes_as_replacement_char(tok):
    assert tok.tokenize("a\ud800b") == tok.tokenize("a\ufffdb")


def test_vocab_and_merge_files_give_same_tokenizer(tok):
    pair = GPT2BPETokenizer(VOCAB, MERGES)
    assert pair.uses_tiktoken
    texts = HARD[:8]
    assert [pair.tokenize(t) for t in texts] == [tok.tokenize(t) for t in texts]
    assert pair.eod == 50256 and pair.vocab_size == 50257


def test_tokenizer_json_from_huggingface(tmp_path, tok, hf):
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    loaded = GPT2BPETokenizer.from_tokenizer_json(path)
    assert (loaded.vocab_size, loaded.eod) == (50257, 50256)
    for text in HARD:
        assert loaded.tokenize(text) == hf.encode(text).ids
    assert build_tokenizer(tokenizer_json=path).tokenize(HARD[0]) == tok.tokenize(HARD[0])


def test_tokenizer_json_that_is_not_gpt2_style_is_rejected(tmp_path, hf):
    spec = json.loads(hf.to_str())
    spec["pre_tokenizer"]["add_prefix_space"] = True
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match="add_prefix_space"):
        GPT2BPETokenizer.from_tokenizer_json(path)
    spec = {"model": {"type": "WordPiece", "vocab": {}}}
    path.write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match="WordPiece"):
        GPT2BPETokenizer.from_tokenizer_json(path)


def _small_vocab(tmp_path, merges, shuffle_seed):
    """A byte-level vocab over ``merges`` with ids in a shuffled order."""
    ref = ReferenceBPE({}, [])
    tokens = [ref.char[b] for b in range(256)] + [a + b for a, b in merges] + ["<|endoftext|>"]
    ids = list(range(len(tokens)))
    random.Random(shuffle_seed).shuffle(ids)
    vocab = dict(zip(tokens, ids))
    (tmp_path / "v.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (tmp_path / "m.bpe").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vocab, tmp_path / "v.json", tmp_path / "m.bpe"


def test_custom_pair_with_ids_out_of_merge_order(tmp_path):
    _, merges = load_pair()
    vocab, v, m = _small_vocab(tmp_path, merges[:3000], shuffle_seed=7)
    tok = GPT2BPETokenizer(v, m)
    assert tok.uses_tiktoken  # ranks derived from merge order, ids mapped back
    ref = ReferenceBPE(vocab, merges[:3000])
    for text in HARD:
        assert tok.tokenize(text) == ref.encode(text)
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == vocab["<|endoftext|>"] and tok.vocab_size == len(vocab)


def test_custom_pair_that_tiktoken_cannot_express_falls_back(tmp_path, capsys):
    # "abc" is in the vocab via (ab, c), but "b c" merges first: pair-rank BPE must stop at
    # [a, bc] while ranking by merged token would produce "abc".
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    vocab, v, m = _small_vocab(tmp_path, merges, shuffle_seed=3)
    tok = GPT2BPETokenizer(v, m)
    assert not tok.uses_tiktoken
    assert "pure-Python BPE" in capsys.readouterr().err
    ref = ReferenceBPE(vocab, merges)
    assert tok.tokenize("abc") == ref.encode("abc") == [vocab["a"], vocab["bc"]]
    for text in ["abcabc ab c abcc", *HARD[:6]]:
        assert tok.tokenize(text) == ref.encode(text)


def test_file_errors(tmp_path):
    with pytest.raises(TokenizerError, match="together"):
        GPT2BPETokenizer(VOCAB, None)
    with pytest.raises(TokenizerError, match="cannot read the vocab file"):
        GPT2BPETokenizer(tmp_path / "missing.json", MERGES)
    bad = tmp_path / "bad.bpe"
    bad.write_text("#version: 0.2\nĠ t\nthree parts here\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"bad\.bpe:3"):
        GPT2BPETokenizer(VOCAB, bad)


def test_build_tokenizer_types():
    assert build_tokenizer("GPT2BPETokenizer").vocab_size == 50257
    with pytest.raises(ConfigError, match="supported: GPT2BPETokenizer"):
        build_tokenizer("GPT3Tokenizer")
    with pytest.raises(UnsupportedError, match="SentencePieceTokenizer"):
        build_tokenizer("SentencePieceTokenizer")


def _pad_by_counting(n, multiple):
    while n % multiple:
        n += 1
    return n


@pytest.mark.parametrize("size,div,tp", [(50257, 128, 1), (50257, 128, 2), (50257, 128, 8),
                                         (50304, 128, 1), (1, 1, 1), (32000, 64, 3)])  # fmt: skip
def test_vocab_padding_arithmetic(size, div, tp):
    assert vocab_size_with_padding(size, div, tp, log=False) == _pad_by_counting(size, div * tp)


def test_vocab_padding_prints_megatrons_line(capsys):
    assert vocab_size_with_padding(50257) == 50304
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    out = capsys.readouterr().out
    assert out == (
        " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)\n"
        " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n"
    )
    vocab_size_with_padding(50257, log=False)
    assert capsys.readouterr().out == ""


def test_null_tokenizer_reads_ids_and_adds_eod_after_vocab_size():
    """Megatron's NullTokenizer: --vocab-size N gives N + 1 ids, EOD = N; text is ids."""
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eod) == (101, 100)
    assert null.tokenize("12 7  3\n100") == [12, 7, 3, 100]
    assert null.detokenize([12, 7, 3]) == "12 7 3"
    with pytest.raises(TokenizerError, match="integers only"):
        null.tokenize("12 seven")
    with pytest.raises(TokenizerError, match="not below the vocabulary 101"):
        null.tokenize("101")
    with pytest.raises(ConfigError, match="NullTokenizer takes --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ConfigError, match="--vocab-size is NullTokenizer's"):
        build_tokenizer("GPT2BPETokenizer", vocab_size=100)
