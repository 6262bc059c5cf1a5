"""The packages' structure (docs/architecture.md): every module imports, no import cycle, and icrl_models uses
only icrl_kernels' public API.

The import graph is read statically from the source (``ast``): every ``import`` statement counts, at
module level, inside a function (the kernel modules are imported inside the ops, so a cycle through
such an import is still a cycle of the design, even when it does not fail at import time) or under
``if TYPE_CHECKING:`` (an annotation that needs the other module is a dependency too: two modules that each
need the other are one piece of code). The files of an op folder import what docs/architecture.md's table
says they do.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("icrl_kernels", "icrl_models")

#: The public modules of icrl_kernels that icrl_models may import from, each by the names in its ``__all__``.
PUBLIC_KERNEL_MODULES = ("icrl_kernels", "icrl_kernels.modules", "icrl_kernels.testing", "icrl_kernels.validation")


class Import(NamedTuple):
    """One imported name: ``from <module> import <name>`` (``name`` is None for ``import <module>``)."""

    importer: str
    module: str
    name: str | None
    line: int


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of ``packages`` under ``root``."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _statements(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree``, in source order."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def imports(root: Path, packages: tuple[str, ...], *, module_level: bool = False) -> Iterator[Import]:
    """Every name imported by a module of ``packages`` (all ``import`` statements, at any depth, ``if
    TYPE_CHECKING:`` blocks included; only those outside functions with ``module_level``), with relative imports
    resolved to absolute module names."""
    for module, path in module_files(root, packages).items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        nodes = _module_level(tree) if module_level else _statements(tree)
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(module, alias.name, None, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    yield Import(module, source, alias.name, node.lineno)


def _module_level(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``tree`` that run when the module is imported: everything outside function bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (``from package import submodule`` is an edge to the
    submodule)."""
    known = set(module_files(root, packages))
    graph: dict[str, set[str]] = {module: set() for module in known}
    for item in imports(root, packages):
        target = f"{item.module}.{item.name}" if f"{item.module}.{item.name}" in known else item.module
        if target in known and target != item.importer:
            graph[item.importer].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search, no recursion)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            target = next(stack[-1], None)
            if target is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(target) == 1:
                return path[path.index(target) :] + [target]
            elif target not in state:
                state[target] = 1
                path.append(target)
                stack.append(iter(sorted(graph[target])))
    return None


@pytest.mark.parametrize("module", sorted(module_files(ROOT, PACKAGES)))
def test_every_module_imports(module):
    if "." in module and module.rsplit(".", 1)[-1].endswith("kernels") or module == "icrl_kernels._triton":
        pytest.importorskip("triton")  # the kernel modules need it; everything else imports without
    importlib.import_module(module)


def test_no_import_cycle():
    cycle = find_cycle(import_graph(ROOT, PACKAGES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle(tmp_path):
    """The check above can fail: a two-module cycle through a function-level import, and a three-module one."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import f\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (package / "sub" / "b.py").write_text("from .. import c\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    # An import for annotations only still makes the two modules one piece of code.
    (package / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import a\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None


def test_walk_finds_every_module():
    """``module_files`` sees the same modules as the import system (nothing missed by the static graph)."""
    for package in PACKAGES:
        walked = {info.name for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")}
        assert walked | {package} == {name for name in module_files(ROOT, PACKAGES) if name.split(".")[0] == package}


def private_kernel_imports(root: Path) -> list[str]:
    """``icrl_models`` imports of ``icrl_kernels`` that are not public: a module outside
    :data:`PUBLIC_KERNEL_MODULES`, or a name missing from that module's ``__all__``."""
    public = {name: set(importlib.import_module(name).__all__) for name in PUBLIC_KERNEL_MODULES}
    found = []
    for item in imports(root, ("icrl_models",)):
        if item.module.split(".")[0] != "icrl_kernels":
            continue
        if item.module not in public or (item.name is not None and item.name not in public[item.module]):
            name = item.module if item.name is None else f"{item.module}.{item.name}"
            found.append(f"{item.importer}:{item.line} imports {name}")
    return found


def test_icrl_models_uses_only_public_kernel_names():
    assert private_kernel_imports(ROOT) == []


def test_private_import_check_can_fail(tmp_path):
    """The check above flags a private module, a private name and an unexported name."""
    models = tmp_path / "icrl_models"
    models.mkdir()
    (models / "__init__.py").write_text(
        "from icrl_kernels._validation import check_values\n"
        "from icrl_kernels import _library\n"
        "from icrl_kernels.ngram.reference import ngram_match_matrix\n"
        "from icrl_kernels import ngram_attention\n"
    )
    assert private_kernel_imports(tmp_path) == [
        "icrl_models:1 imports icrl_kernels._validation.check_values",
        "icrl_models:2 imports icrl_kernels._library",
        "icrl_models:3 imports icrl_kernels.ngram.reference.ngram_match_matrix",
    ]


def test_environments_import_without_torch():
    """``icrl_models.envs`` (what gymnasium's plugin loading imports) pulls in neither torch nor icrl_kernels."""
    code = "import sys, icrl_models.envs; print(sorted({'torch', 'icrl_kernels'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_no_test_file_imports_another():
    """Test files share helpers through tests/_helpers.py and conftest.py, never by importing each other."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno} imports {name}" for name in names if name.startswith("test_")]
    assert found == []


# -- the files of an op folder ---------------------------------------------------------------------------------------
#: The op folders of icrl_kernels.
OP_FOLDERS = ("attention", "contrastive", "looped", "moa", "ngram", "smeared")
#: The files every op folder has; any other file of a folder is one of its extras (docs/architecture.md).
STANDARD_FILES = ("reference", "checks", "eager", "kernels", "function", "__init__")
#: What each file of an op folder may import from icrl_kernels (docs/architecture.md, "An op folder"): a shared
#: module (``_library``...), ``own:<file>`` (a file of its folder; ``own:extra``: any of its extras, ``own:*``:
#: any file) or ``other:<file>`` (that file of another op folder).
IMPORT_TABLE = {
    "reference": {"_library", "own:checks", "other:reference"},
    "checks": {"_validation", "_backend", "own:extra", "other:checks"},
    "eager": {"_library", "own:reference", "own:checks", "own:extra", "other:function"},
    "kernels": {"_triton", "_library", "_backend", "own:checks", "own:extra", "other:kernels", "other:checks"},
    "function": {"_backend", "_library", "_validation", "own:*"},
    "__init__": {"own:function", "own:checks", "own:reference", "own:extra"},
    "extra": {"_backend", "_library", "_triton", "_validation", "own:*"},
}


def _kind(folder: str, file: str) -> str:
    """``reference`` ... ``__init__`` for a standard file, ``extra`` for any other."""
    return file if file in STANDARD_FILES else "extra"


def op_folder_violations(root: Path) -> list[str]:
    """Imports of an op folder's files that :data:`IMPORT_TABLE` does not allow, and ``kernels`` imported by a
    ``function.py`` at module level (Triton is optional: the kernels are imported inside the functions)."""
    known = set(module_files(root, ("icrl_kernels",)))
    found = []

    def target_of(item: Import) -> str:
        candidate = f"{item.module}.{item.name}"
        return candidate if candidate in known else item.module

    for item in imports(root, ("icrl_kernels",)):
        parts = item.importer.split(".")
        if len(parts) < 2 or parts[1] not in OP_FOLDERS:
            continue
        folder, file = parts[1], parts[2] if len(parts) > 2 else "__init__"
        target = target_of(item).split(".")
        if target[0] != "icrl_kernels" or target == ["icrl_kernels", folder]:  # its own package: a name of a file
            continue
        if len(target) == 2 and target[1] not in OP_FOLDERS:
            allowed_as = target[1]  # a shared module
        elif target[1] == folder:
            other = target[2] if len(target) > 2 else "__init__"
            allowed_as = f"own:{other}" if other in STANDARD_FILES else "own:extra"
        else:
            allowed_as = f"other:{target[2] if len(target) > 2 else '__init__'}"
        rules = IMPORT_TABLE[_kind(folder, file)]
        if allowed_as not in rules and not (allowed_as.startswith("own:") and "own:*" in rules):
            found.append(f"{item.importer}:{item.line} imports {'.'.join(target)} ({allowed_as})")
    for item in imports(root, ("icrl_kernels",), module_level=True):
        parts = item.importer.split(".")
        if len(parts) == 3 and parts[1] in OP_FOLDERS and parts[2] == "function":
            if target_of(item).endswith("kernels"):
                found.append(f"{item.importer}:{item.line} imports {target_of(item)} at module level")
    return found


def test_op_folders_import_what_the_table_says():
    assert op_folder_violations(ROOT) == []


def test_op_folder_check_can_fail(tmp_path):
    """The check above flags a reference importing an eager path, checks importing another op's function, and a
    function.py importing its kernels at module level."""
    for name in ("_library", "_validation", "_triton", "_backend"):
        (tmp_path / "icrl_kernels").mkdir(exist_ok=True)
        (tmp_path / "icrl_kernels" / f"{name}.py").write_text("")
    (tmp_path / "icrl_kernels" / "__init__.py").write_text("")
    for folder in ("moa", "smeared"):
        (tmp_path / "icrl_kernels" / folder).mkdir()
        for file in STANDARD_FILES:
            (tmp_path / "icrl_kernels" / folder / f"{file}.py").write_text("")
    moa = tmp_path / "icrl_kernels" / "moa"
    (moa / "reference.py").write_text("from .eager import x\nfrom .._library import compute_dtype\n")
    (moa / "checks.py").write_text("from ..smeared.function import smeared_keys\n")
    (moa / "function.py").write_text("from .kernels import k\n\n\ndef f():\n    from .kernels import g\n")
    assert op_folder_violations(tmp_path) == [
        "icrl_kernels.moa.checks:1 imports icrl_kernels.smeared.function (other:function)",
        "icrl_kernels.moa.reference:1 imports icrl_kernels.moa.eager (own:eager)",
        "icrl_kernels.moa.function:1 imports icrl_kernels.moa.kernels at module level",
    ]
