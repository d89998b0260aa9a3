"""The ``deepspeed`` alias of ``zerotron launch --as-deepspeed`` / ``python -m
zerotron.compat.as_deepspeed``: what transformers and accelerate check, seen from a child process
(the alias must never leak into the test process itself)."""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerotron.checkpoint.utils import clone_tensors_for_torch_save
from zerotron.compat import as_deepspeed, hf

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.metadata, importlib.util, json, sys
from packaging.version import Version
import deepspeed, zerotron, zerotron.pipe
import deepspeed.pipe, deepspeed.zero
out = {
    "found": importlib.util.find_spec("deepspeed") is not None,
    "metadata_name": importlib.metadata.metadata("deepspeed")["Name"],
    "version": importlib.metadata.version("deepspeed"),
    "module_version": deepspeed.__version__,
    "accepted": Version(importlib.metadata.version("deepspeed")) >= Version("0.15.2"),
    "initialize_is_zerotron": deepspeed.initialize is zerotron.initialize,
    "zero_is_zerotron": deepspeed.zero is zerotron.zero,
    "pipe_is_zerotron": deepspeed.pipe is zerotron.pipe,
}
print(json.dumps(out))
"""


def _run(args: list[str], tmp_path: Path) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, *args, str(script)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(["-m", "zerotron.compat.as_deepspeed"], tmp_path_factory.mktemp("probe"))


def test_find_spec_and_metadata_see_deepspeed(probed: dict) -> None:
    assert (probed["found"], probed["metadata_name"]) == (True, "deepspeed")


def test_version_is_the_served_deepspeed_release(probed: dict) -> None:
    assert (probed["version"], probed["module_version"]) == (as_deepspeed.DEEPSPEED_VERSION,) * 2


def test_version_passes_accelerates_floor(probed: dict) -> None:
    assert probed["accepted"] is True


def test_top_level_names_are_zerotrons(probed: dict) -> None:
    assert probed["initialize_is_zerotron"] is True


def test_submodules_are_zerotrons_modules(probed: dict) -> None:
    assert (probed["zero_is_zerotron"], probed["pipe_is_zerotron"]) == (True, True)


def test_dist_info_names_the_same_version() -> None:
    infos = sorted(p.name for p in Path(as_deepspeed.ALIAS_PATH).glob("*.dist-info"))
    assert infos == [f"deepspeed-{as_deepspeed.DEEPSPEED_VERSION}.dist-info"]


def test_environ_puts_alias_first_once() -> None:
    env = as_deepspeed.environ({"PYTHONPATH": os.pathsep.join(["a", as_deepspeed.ALIAS_PATH])})
    assert env["PYTHONPATH"] == os.pathsep.join([as_deepspeed.ALIAS_PATH, "a"])


def test_launcher_flag_runs_workers_through_the_alias() -> None:
    from zerotron.launcher.launch import worker_args

    assert worker_args("train.py", ["--x"], False, True, as_deepspeed=True) == [
        "-u",
        "-m",
        "zerotron.compat.as_deepspeed",
        "train.py",
        "--x",
    ]


def test_plain_python_has_no_alias(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "import importlib.util; print(importlib.util.find_spec('deepspeed'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "None"


class _Kind(enum.Enum):  # stands in for accelerate's DistributedType
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"


@pytest.mark.parametrize(
    "env,cpu,want",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true", "LOCAL_RANK": "0"}, False, ("gloo", "MULTI_CPU")),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "LOCAL_RANK": "0"}, True, (None, "NO")),
        ({"LOCAL_RANK": "0"}, False, (None, "NO")),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, False, (None, "NO")),
    ],
)
def test_accelerate_gets_gloo_only_for_launched_deepspeed_without_device(
    monkeypatch: pytest.MonkeyPatch, env: dict, cpu: bool, want: tuple
) -> None:
    for key in ("ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    patched = hf._cpu_backend(lambda self, cpu, dp, backend: (None, _Kind.NO))
    backend, kind = patched(None, cpu)
    assert (backend, kind.value) == want


def test_clone_tensors_for_torch_save_copies_views_alone() -> None:
    flat = torch.arange(6.0)
    out = clone_tensors_for_torch_save({"a": [flat[:2]], "b": (flat[2:],), "c": 3})
    assert out["a"][0].untyped_storage().nbytes() == 2 * 4 and out["c"] == 3
    assert torch.equal(out["b"][0], flat[2:]) and out["b"][0].data_ptr() != flat.data_ptr()


def test_alias_wins_over_an_installed_deepspeed_and_leaves_it_alone(tmp_path: Path) -> None:
    real = tmp_path / "site"  # a stand-in for a real DeepSpeed installed in the environment
    (real / "deepspeed").mkdir(parents=True)
    (real / "deepspeed" / "__init__.py").write_text("__version__ = '0.9.0'\n")
    (real / "deepspeed-0.9.0.dist-info").mkdir()
    (real / "deepspeed-0.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.9.0\n"
    )
    script = tmp_path / "which.py"
    script.write_text(
        "import importlib.metadata as m, deepspeed\n"
        "print(deepspeed.__version__, m.version('deepspeed'))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(real)]))
    seen = []
    for args in (["-m", "zerotron.compat.as_deepspeed", str(script)], [str(script)]):
        out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
        seen.append(out.stdout.strip())
    assert seen == [
        f"{as_deepspeed.DEEPSPEED_VERSION} {as_deepspeed.DEEPSPEED_VERSION}",
        "0.9.0 0.9.0",
    ]
