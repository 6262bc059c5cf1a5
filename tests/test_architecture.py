"""The packages' structure (docs/architecture.md): every module imports, no import cycle, and icrl_models uses
only icrl_kernels' public API.

The import graph is read statically from the source (``ast``): every ``import`` statement counts, at
module level or inside a function (the kernel modules are imported inside the ops, so a cycle through
such an import is still a cycle of the design, even when it does not fail at import time), except those
under ``if TYPE_CHECKING:`` (annotations only: they never run).
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


def _type_checking_block(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports that exist for annotations only."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return isinstance(test, (ast.Name, ast.Attribute)) and getattr(test, "id", getattr(test, "attr", "")) == (
        "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks (never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        children = node.orelse if _type_checking_block(node) else list(ast.iter_child_nodes(node))
        stack.extend(reversed(children))  # source order


def imports(root: Path, packages: tuple[str, ...]) -> Iterator[Import]:
    """Every name imported by a module of ``packages`` (all ``import`` statements, at any depth, except those
    under ``if TYPE_CHECKING:``, which never run), with relative imports resolved to absolute module names."""
    for module, path in module_files(root, packages).items():
        is_package = path.name == "__init__.py"
        for node in _statements(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
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
    (package / "c.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import a\n")
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
