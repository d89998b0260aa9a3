"""Shared test setup: one thread per test process (pytest-xdist runs two on CI's two cores), the
Austen fixtures, and xdist groups that hold under pytest 9."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite runs the CPU kernels' default candidates, forced (zerotron.kernels.chooser): nothing
# measured, so results do not depend on the machine or its load (and what a test does measure
# is cached in a temporary directory: _kernel_cache). tests/test_kernel_chooser.py clears it to
# test the chooser itself.
os.environ.setdefault(
    "ZEROTRON_KERNELS", "linear=onednn,matmul16=native,attention=math16,loss_chunk=2048"
)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tests/cuda/ needs a GPU and runs under `make test-gpu` alone (which sets this variable): a plain
# `pytest tests` or `make test` never collects it.
collect_ignore = [] if os.environ.get("ZEROTRON_GPU_TESTS") == "1" else ["cuda"]
AUSTEN = os.path.join(REPO, "data", "austen.jsonl")


@pytest.fixture
def austen_path() -> str:
    return AUSTEN


@pytest.fixture
def fake_wandb(monkeypatch) -> list[tuple]:
    """A stand-in ``wandb`` module; returns the list of its calls: ``("init", kwargs)``,
    ``("log", data, step)``, ``("finish",)``."""
    import sys
    import types

    calls: list[tuple] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda data, step: calls.append(("log", data, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


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


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory) -> None:
    """Kernel choices a test measures (one whose spec leaves a choice out) are cached in the
    session's temporary directory, never in the user's ~/.cache; the processes tests start
    inherit it."""
    os.environ["ZEROTRON_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel-cache"))


@pytest.fixture(autouse=True)
def _default_kernel_choices():
    """Kernel choices are process-wide (zerotron.kernels.policy): a test that made some
    (``zerotron pretrain --kernels``, the chooser's tests) leaves the defaults to the next."""
    yield
    from zerotron.kernels.policy import KernelChoices, set_choices

    set_choices(KernelChoices())


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A test that ran DeepSpeed's entry points in this process (``initialize``,
    ``init_distributed``) leaves a one-process default group behind, as DeepSpeed does; destroy
    it after the test, so the next test starts, like a fresh program, without one."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        from zerotron.distributed.init import destroy

        destroy()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Make ``--dist loadgroup`` keep each ``xdist_group`` on one worker under pytest 9.

    Tests that read one module-scoped spawn share an xdist group so the spawn runs once. xdist
    3.8 groups them by renaming ``item._nodeid`` to ``<nodeid>@<group>``, which pytest 9 no
    longer reads (it derives ``nodeid`` from ``item._id``): without this the group's tests
    spread over both workers and each worker spawns again. Under pytest 8 xdist's own renaming
    works and this does nothing.
    """
    if not getattr(config.option, "loadgroup", False):  # set only in xdist's workers
        return
    for item in items:
        groups = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
        if groups and "@" not in item.nodeid.rpartition("]")[2]:
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(groups))}")
