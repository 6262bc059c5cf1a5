"""Adds ``icrl_gymnasium.pth`` to the wheels; every other setting is in pyproject.toml.

Gymnasium >= 1.0 has no plugin mechanism, so ``gymnasium.make("icrl/DarkRoom-v0")`` in a fresh interpreter
needs the ids registered without anyone importing :mod:`icrl_models`. The ``.pth`` file (run by ``site`` at
start-up) installs the import hook of ``icrl_models/envs/_gymnasium_hook.py``; see that module. The file goes
into the regular wheel (``pip install .``) through ``build_py`` and into the editable one (``pip install -e .``)
through ``editable_wheel``, whose wheels hold only a path hook otherwise.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "icrl_gymnasium.pth"
HOOK_SOURCE = Path(__file__).parent / "icrl_models" / "envs" / "_gymnasium_hook.py"


def pth_content() -> str:
    """One ``import`` line (``site`` executes only lines that start with ``import``) that runs the hook's
    source in a namespace of its own and installs it. Embedding the source, rather than importing the module,
    keeps :mod:`icrl_models` unimported at start-up and works whatever order ``site`` reads ``.pth`` files in
    (an editable install's own path hook comes from another ``.pth`` file)."""
    source = _without_docstrings(HOOK_SOURCE.read_text(encoding="utf-8")) + "\ninstall()\n"
    return f"import sys; exec(compile({source!r}, {PTH_NAME!r}, 'exec'), {{'__name__': 'icrl_gymnasium_pth'}})\n"


def _without_docstrings(source: str) -> str:
    """The source without docstrings and comments (a third of the size: compiling it is the start-up cost)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the ``.pth`` file at the root of the wheel (site-packages)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib, PTH_NAME)
            target.write_text(pth_content(), encoding="utf-8")
            self._pth_outputs = [str(target)]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + list(getattr(self, "_pth_outputs", []))


class _StrategyWithPth:
    """Wraps setuptools' editable strategy (what writes the editable wheel's path hook) to add the file."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def __call__(self, wheel, files, mapping) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH_NAME, pth_content().encode("utf-8"))

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self.strategy.__exit__(*exc_info)


class EditableWheelWithPth(editable_wheel):
    """``editable_wheel`` whose wheel also carries the ``.pth`` file (``_select_strategy`` is setuptools'
    own hook for what goes into the editable wheel; tested in CI's main environment, an editable install)."""

    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


if __name__ == "__main__":  # also under setuptools' build backend; the tests import pth_content() only
    if not hasattr(editable_wheel, "_select_strategy"):
        warnings.warn(
            f"this setuptools has no editable_wheel._select_strategy: an editable install lacks {PTH_NAME}, so "
            'gymnasium >= 1.0 needs `import icrl_models.envs` before gymnasium.make("icrl/...")',
            stacklevel=1,
        )
    setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
