"""Shared test setup: one thread per test process (pytest-xdist runs two on CI's two cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUSTEN = os.path.join(REPO, "data", "austen.jsonl")


@pytest.fixture
def austen_path() -> str:
    return AUSTEN


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    """The first 20 documents of data/austen.jsonl, tokenized with end-of-document tokens.

    Module-scoped: each test module gets its own directory (and so its own index caches).
    """
    import contextlib
    import io

    from zerotron.data.preprocess import main as preprocess_main

    d = tmp_path_factory.mktemp("austen20")
    with open(AUSTEN, encoding="utf-8") as f:
        lines = f.read().splitlines(True)[:20]
    (d / "austen20.jsonl").write_text("".join(lines), encoding="utf-8")
    with contextlib.redirect_stdout(io.StringIO()):
        preprocess_main(
            ["--input", str(d / "austen20.jsonl"), "--output-prefix", str(d / "austen20")]
            + ["--append-eod", "--workers", "1"]
        )
    return str(d / "austen20_text_document")
