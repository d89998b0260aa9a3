"""``zerotron.<name>`` is ``zerotron.compat.<name>`` for DeepSpeed's module names.

The alias (a meta-path finder in ``zerotron/__init__.py``) must give the same module objects,
submodules included, whichever name is imported first, in every import form a DeepSpeed script
uses; and it must leave every other name alone.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import zerotron


@pytest.mark.parametrize("name", zerotron.COMPAT_MODULES)
def test_alias_is_the_compat_module_object(name):
    alias = importlib.import_module(f"zerotron.{name}")
    assert alias is importlib.import_module(f"zerotron.compat.{name}")
    assert getattr(zerotron, name) is alias
    assert alias.__name__ == f"zerotron.compat.{name}"
    assert alias.__spec__.name == f"zerotron.compat.{name}"  # the import did not rename it


def test_deepspeed_import_forms():
    import zerotron as deepspeed
    import zerotron.checkpointing
    from zerotron import checkpointing
    from zerotron.compat.pipe.module import LayerSpec as RealLayerSpec
    from zerotron.compat.pipe.module import PipelineModule as RealPipelineModule
    from zerotron.parallel.recompute import checkpoint
    from zerotron.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    assert deepspeed.pipe.PipelineModule is PipelineModule is RealPipelineModule
    assert LayerSpec is RealLayerSpec and issubclass(TiedLayerSpec, LayerSpec)
    assert deepspeed.checkpointing is checkpointing is zerotron.checkpointing
    assert deepspeed.checkpointing.checkpoint is checkpoint


def test_submodules_are_the_same_objects():
    import zerotron.compat.pipe.module
    import zerotron.compat.pipe.stage
    import zerotron.pipe.module
    import zerotron.pipe.stage

    assert sys.modules["zerotron.pipe.stage"] is sys.modules["zerotron.compat.pipe.stage"]
    assert zerotron.pipe.module is zerotron.compat.pipe.module
    assert zerotron.pipe.stage.PipelineModuleRuntime is zerotron.compat.pipe.PipelineModuleRuntime


def test_missing_submodule_is_an_ordinary_import_error():
    with pytest.raises(ModuleNotFoundError, match="zerotron.pipe.no_such_module"):
        importlib.import_module("zerotron.pipe.no_such_module")


def test_other_names_are_not_aliased():
    assert zerotron.compat_target("zerotron.pipeline") is None
    assert zerotron.compat_target("zerotron.pipeline.schedules") is None
    assert zerotron.compat_target("zerotron.zero") is None
    assert zerotron.compat_target("pipe") is None
    assert zerotron.compat_target("zerotron.pipe.stage") == "zerotron.compat.pipe.stage"
    assert importlib.import_module("zerotron.pipeline").__name__ == "zerotron.pipeline"


@pytest.mark.parametrize(
    "code",
    [
        # a submodule by its alias first, in a fresh interpreter
        "import zerotron.pipe.stage as s, zerotron.compat.pipe.stage as c; assert s is c",
        # the compat name first, then the alias
        "import zerotron.compat.checkpointing as c, zerotron.checkpointing as a; assert a is c",
        # DeepSpeed's spelling, attribute access only
        "import zerotron as deepspeed; deepspeed.checkpointing.checkpoint; "
        "deepspeed.pipe.PipelineModule",
    ],
    ids=["alias-submodule-first", "compat-first", "attribute-access"],
)
def test_fresh_interpreter(code):
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_submodules_are_attributes_after_only_import_zerotron():
    # accelerate reads deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES after `import deepspeed`
    code = (
        "import zerotron as deepspeed\n"
        "print(len(deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES),"
        " deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.AVAILABLE.value,"
        " deepspeed.utils.zero_to_fp32.__name__)\n"
        "try:\n    deepspeed.runtime.no_such_module\nexcept AttributeError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == [
        "5 1 zerotron.compat.utils.zero_to_fp32",
        "module 'zerotron.compat.runtime' has no attribute 'no_such_module'",
    ]


REFUSED_READS = [
    ("zerotron", "init_inference", "deepspeed.init_inference", "zerotron generate"),
    ("zerotron.comm", "log_summary", "deepspeed.comm.log_summary", "ledger"),
    ("zerotron.zero", "MiCS_Init", "deepspeed.zero.MiCS_Init", "zero.Init"),
    ("zerotron.runtime.zero", "MiCS_Init", "deepspeed.runtime.zero.MiCS_Init", None),
    ("zerotron.ops", "sparse_attention", "deepspeed.ops.sparse_attention", "dense attention"),
]


@pytest.mark.parametrize("module,attr,name,hint", REFUSED_READS, ids=[r[2] for r in REFUSED_READS])
def test_reading_a_refused_name_says_why(module, attr, name, hint):
    mod = importlib.import_module(module)
    assert not hasattr(mod, attr) and getattr(mod, attr, "default") == "default"
    with pytest.raises(AttributeError) as e:
        getattr(mod, attr)
    if hint is None:  # not refused (runtime.zero serves no MiCS_Init row): the plain message
        assert str(e.value) == f"module 'zerotron.compat.runtime.zero' has no attribute '{attr}'"
    else:
        assert str(e.value).startswith(f"{name} is not served by zerotron: ")
        assert hint in str(e.value) and str(e.value).endswith("(docs/deepspeed.md)")


def test_importing_a_refused_module_says_why_and_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError, match="deepspeed.runtime.data_pipeline is not served"):
        importlib.import_module("zerotron.runtime.data_pipeline.data_routing.helper")
    try:  # a script's optional import falls back as before
        import zerotron.ops.sparse_attention  # noqa: F401
    except ImportError as e:
        assert "block-sparse attention" in str(e)
    else:
        raise AssertionError("imported a refused module")


def test_the_deepspeed_alias_says_why_too():
    from zerotron.compat.as_deepspeed import ALIAS_PATH

    code = (
        f"import sys; sys.path.insert(0, {ALIAS_PATH!r})\n"
        "import deepspeed\n"
        "for stmt in ('deepspeed.tp_model_init', 'import deepspeed.runtime.domino',\n"
        "             'deepspeed.no_such_name'):\n"
        "    try:\n        exec(stmt)\n    except Exception as e:\n"
        "        print(type(e).__name__, *str(e).split()[:5])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == [
        "AttributeError deepspeed.tp_model_init is not served by",
        "ModuleNotFoundError deepspeed.runtime.domino is not served by",
        "AttributeError module 'deepspeed' (zerotron's DeepSpeed API)",
    ]
