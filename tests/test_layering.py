"""DESIGN.md's layering, checked on the import graph: imports point downward only.

Every module under ``zerotron/`` is parsed (no import, so no torch needed) and each import of a
``zerotron`` module is checked against the layer order of DESIGN.md, top to bottom::

    cli > launcher > compat > tuning > training > inference > engine > zero > checkpoint
        > models > pipeline > parallel > kernels > precision > optim > data > distributed
        > config > errors/fileio

(Two places differ from the first DESIGN.md: pipeline/ sits below checkpoint/ and models/, which
use its stage partitioning while it knows no model; kernels/ sits below parallel/, whose TP=1
linear layers take the oneDNN path and which kernels/ never imports.)

An import may point to its own layer or any layer below it. Counted: top-level imports, lazy
imports inside functions, ``TYPE_CHECKING`` imports (a type-only import still says what a module
knows), and module names given to ``importlib.import_module`` as string constants (the CLI's
command table, lazy export tables). Not counted: ``zerotron/__init__.py``, the package root,
whose alias table names ``compat`` (``zerotron.pipe`` is ``zerotron.compat.pipe``, ...), and
``if __name__ == "__main__":`` blocks, a module's script entry point, which is a program on top
of everything (``python -m zerotron.launcher.launch`` goes through the CLI).

Also checked: the layers DESIGN.md calls model-agnostic (the Engine, ZeRO, the pipeline,
checkpoints: "read that declaration and never import a model") import no model, and the
package's top level shows the architecture (few loose modules).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import zerotron

PACKAGE = Path(zerotron.__file__).resolve().parent

# DESIGN.md's layers, top to bottom ("base" is errors.py, fileio.py and progress.py).
LAYERS = (
    "cli",
    "launcher",
    "compat",
    "tuning",
    "training",
    "inference",
    "engine",
    "zero",
    "checkpoint",
    "models",
    "pipeline",
    "parallel",
    "kernels",
    "precision",
    "optim",
    "data",
    "distributed",
    "config",
    "base",
)

# zerotron.<name> -> its layer: each layer's package, and the loose modules DESIGN.md places.
PLACES = {
    **{layer: layer for layer in LAYERS if layer != "base"},
    "__main__": "cli",
    "errors": "base",
    "fileio": "base",
    "progress": "base",
    # DeepSpeed's module names: zerotron.<name> is zerotron.compat.<name> (zerotron/__init__.py).
    **{name: "compat" for name in zerotron.COMPAT_MODULES},
}

# Upward imports allowed, (importer, imported module) -> why: none. An entry that no longer
# occurs fails the test, so the list cannot go stale.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

# Layers (and packages) that must not know the model: DESIGN.md, "Models declare, parallelism
# obeys". compat.pipe is DeepSpeed's generic PipelineModule, which knows no GPT either.
MODEL_AGNOSTIC = (
    "zerotron.engine",
    "zerotron.zero",
    "zerotron.pipeline",
    "zerotron.checkpoint",
    "zerotron.compat.pipe",
)
# Model modules: models/, and the GPT stage until the kernels helper moves it there.
MODEL_MODULES = ("zerotron.models",)

# Today's imports of a model from a model-agnostic module, each with who removes it (the
# coordinator empties this list after merging; entries that no longer occur fail the test).
ALLOWED_MODEL_IMPORTS: dict[tuple[str, str], str] = {
    # A checkpoint *format* of the GPT family is model-specific by nature: the Megatron-layout
    # GPT save/load (shapes, padded-vocabulary keys) and HF GPT-2 conversion read GPTConfig.
    # The generic checkpoint machinery (layout, save_load, reshard, state, zero_*) does not.
    ("zerotron.checkpoint.model", "zerotron.models.gpt"): "GPT's checkpoint format",
    ("zerotron.checkpoint.hf", "zerotron.models.gpt"): "HF GPT-2 conversion",
    ("zerotron.checkpoint.megatron", "zerotron.models.gpt"): "Megatron-LM GPT import",
    ("zerotron.checkpoint.megatron_args", "zerotron.models.gpt"): "Megatron-LM GPT args",
    ("zerotron.checkpoint.megatron_export", "zerotron.models.gpt"): "Megatron-LM GPT export",
}

# Loose modules at the top of zerotron/: the entry point, the CLI, and the bottom modules.
LOOSE_MODULES = {"__init__", "__main__", "cli", "errors", "fileio", "progress"}


@dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. "zerotron.engine"
    imported: str  # module (or module.attribute) name, e.g. "zerotron.models.gpt"
    where: str  # file:line


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer of ``zerotron.<top>...``, by its top-level name; None if DESIGN.md has none."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return PLACES.get(parts[1])


def imports_of(path: Path) -> list[Import]:
    """Every zerotron import in ``path``, wherever it sits (see the module docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    dynamic = "import_module" in path.read_text(encoding="utf-8")
    entry_point = {id(n) for block in _main_blocks(tree) for n in ast.walk(block)}
    found = {}
    for node in ast.walk(tree):
        if id(node) in entry_point:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from zerotron import checkpointing` imports the module zerotron.checkpointing
            names = [f"{base}.{a.name}" if base == "zerotron" else base for a in node.names]
        elif dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if re.fullmatch(r"zerotron(\.\w+)+", node.value) else []
        for name in names:
            if name == "zerotron" or name.startswith("zerotron."):
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                found[me, name, where] = Import(me, name, where)
    return list(found.values())


def _main_blocks(tree: ast.Module) -> list[ast.If]:
    """The module's ``if __name__ == "__main__":`` blocks."""
    return [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and [getattr(c, "value", None) for c in node.test.comparators] == ["__main__"]
    ]


def all_imports() -> list[Import]:
    return [i for p in sorted(PACKAGE.rglob("*.py")) for i in imports_of(p)]


def upward(imp: Import) -> bool:
    if imp.importer == "zerotron":
        return False  # the package root (module docstring)
    mine, theirs = layer_of(imp.importer), layer_of(imp.imported)
    if mine is None or theirs is None:
        return False  # reported by test_every_module_has_a_layer
    return LAYERS.index(theirs) < LAYERS.index(mine)


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def knows_a_model(imp: Import) -> bool:
    agnostic = within(imp.importer, MODEL_AGNOSTIC)
    return agnostic and within(imp.imported, MODEL_MODULES)


def check(matching, allowed: dict[tuple[str, str], str], title: str) -> None:
    """Fail listing each import ``matching`` accepts that ``allowed`` does not name, and each
    ``allowed`` entry that no longer occurs."""
    found: dict[tuple[str, str], list[str]] = {}
    for imp in all_imports():
        if matching(imp):
            found.setdefault((imp.importer, imp.imported), []).append(imp.where)
    lines = [
        f"{importer} ({layer_of(importer)}) imports {imported} ({layer_of(imported)}) at "
        + ", ".join(where)
        for (importer, imported), where in sorted(found.items())
        if (importer, imported) not in allowed
    ]
    assert not lines, f"{title}:\n  " + "\n  ".join(lines)
    stale = [f"{a} -> {b}" for a, b in sorted(allowed) if (a, b) not in found]
    assert not stale, "allow-listed imports that are gone (remove them):\n  " + "\n  ".join(stale)


def test_every_module_has_a_layer():
    missing = sorted(
        {
            f"{i.imported} ({i.where})"
            for i in all_imports()
            if i.imported != "zerotron" and layer_of(i.imported) is None
        }
        | {
            module_name(p)
            for p in PACKAGE.rglob("*.py")
            if module_name(p) != "zerotron" and layer_of(module_name(p)) is None
        }
    )
    assert not missing, (
        "modules with no layer in DESIGN.md (place them in PLACES, and in DESIGN.md):\n  "
        + "\n  ".join(missing)
    )


def test_imports_point_downward():
    check(upward, ALLOWED_UPWARD, "imports pointing upward (DESIGN.md, 'The layers')")


def test_model_agnostic_layers_import_no_model():
    check(knows_a_model, ALLOWED_MODEL_IMPORTS, "model imports where DESIGN.md allows none")


def test_few_loose_modules_at_the_top():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    extra = sorted(loose - LOOSE_MODULES)
    assert not extra, (
        f"loose modules at the top of zerotron/: {extra}; move each into the package of its "
        "layer (DESIGN.md)"
    )
