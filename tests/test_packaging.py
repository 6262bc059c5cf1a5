"""Packaging: Triton is an optional extra, the package works without it, and the ``icrl_gymnasium.pth`` hook
registers the bare gymnasium ids (gymnasium >= 1.0 has no plugins) without importing anything at start-up.

The installed-wheel checks (a venv without Triton, console scripts, ``py.typed``, mypy) are in ``.ci/run``;
these tests cover the same mechanisms in fresh subprocesses of the current interpreter.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from icrl_models.envs import _gymnasium_hook
from icrl_models.envs.gym import GYM_IDS

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, *, cwd: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter (with this repository importable); return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=300,
    )
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def load_setup_module():
    """``setup.py`` as a module (its ``setup()`` call runs only as ``__main__``)."""
    spec = importlib.util.spec_from_file_location("icrl_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- Triton is optional -----------------------------------------------------------------------------------------


def test_triton_is_an_extra_that_the_test_extra_includes():
    project = pyproject()["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"]), project["dependencies"]
    extras = project["optional-dependencies"]
    assert any(dep.startswith("triton>=") for dep in extras["triton"])
    assert "icrl-kernels[triton]" in extras["test"]  # the interpreter tests run the kernels


def test_gymnasium_0_29_entry_point_is_kept():
    entry_points = pyproject()["project"]["entry-points"]["gymnasium.envs"]
    assert entry_points == {"icrl": "icrl_models.envs.gym:register_gymnasium_envs"}


def test_everything_but_the_kernels_works_without_triton():
    """``sys.modules["triton"] = None`` makes ``import triton`` fail as if it were not installed."""
    out = run_python(
        """
        import sys
        sys.modules["triton"] = None
        import importlib, pkgutil, torch
        import icrl_kernels, icrl_models
        from icrl_kernels import ngram_attention, ngram_attention_reference

        h = torch.randn(2, 9, 4, requires_grad=True)
        ids = torch.randint(0, 3, (2, 9))
        out = ngram_attention(h, ids, 2)  # auto -> eager, even under TRITON_INTERPRET=1
        torch.testing.assert_close(out, ngram_attention_reference(h, ids, 2))
        out.sum().backward()
        assert h.grad is not None
        try:
            ngram_attention(h, ids, 2, backend="triton")
        except ValueError as error:
            assert "triton package" in str(error), error
        else:
            raise AssertionError("backend='triton' without triton must raise ValueError")
        try:
            import icrl_kernels._triton
        except ImportError as error:
            assert "icrl-kernels[triton]" in str(error), error
        else:
            raise AssertionError("icrl_kernels._triton must raise ImportError without triton")
        # Every module but the Triton ones imports (the CLIs, models, envs, analysis, testing helpers).
        failed = []
        for package in (icrl_kernels, icrl_models):
            for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
                leaf = info.name.rsplit(".", 1)[-1]
                if leaf == "_triton" or leaf.endswith("kernels"):
                    continue
                try:
                    importlib.import_module(info.name)
                except ImportError as error:
                    failed.append(f"{info.name}: {error}")
        assert not failed, failed
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


# --- the gymnasium hook -----------------------------------------------------------------------------------------


def test_hook_table_matches_gym_ids():
    assert _gymnasium_hook.ENTRY_POINTS == {
        env_id: f"icrl_models.envs.gym:{factory.__name__}" for env_id, factory in GYM_IDS.items()
    }


def test_pth_file_is_one_import_line_with_the_hook_source():
    setup = load_setup_module()
    content = setup.pth_content()
    assert content.startswith("import ") and content.count("\n") == 1  # site runs only `import` lines
    for env_id in GYM_IDS:
        assert env_id in content
    assert "Registers the" not in content  # docstrings stripped: less to compile at every start-up


@pytest.mark.parametrize("gymnasium_first", [False, True], ids=["hook-then-gymnasium", "gymnasium-then-hook"])
def test_pth_file_registers_bare_ids_in_a_fresh_process(tmp_path, gymnasium_first):
    """``site`` processes the generated ``.pth`` file; nothing heavy is imported until gymnasium is, the
    finder removes itself, and ``gymnasium.make("icrl/...")`` works with no icrl import by the user."""
    pytest.importorskip("gymnasium")
    (tmp_path / "icrl_gymnasium.pth").write_text(load_setup_module().pth_content())
    out = run_python(
        f"""
        import sys
        if {gymnasium_first}:
            import gymnasium
        import site
        site.addsitedir({str(tmp_path)!r})
        hooks = [f for f in sys.meta_path if type(f).__name__ == "GymnasiumRegistrationFinder"]
        if not {gymnasium_first}:
            assert len(hooks) == 1, sys.meta_path
            heavy = [name for name in ("torch", "numpy", "gymnasium", "icrl_models", "icrl_kernels")
                     if name in sys.modules]
            assert not heavy, heavy
            site.addsitedir({str(tmp_path)!r})  # a second install is a no-op
            assert len([f for f in sys.meta_path if type(f).__name__ == "GymnasiumRegistrationFinder"]) == 1
        import gymnasium
        assert not [f for f in sys.meta_path if type(f).__name__ == "GymnasiumRegistrationFinder"]
        assert "icrl_models" not in sys.modules  # string entry points: imported when an env is made
        env = gymnasium.make("icrl/DarkRoom-v0", goal=10)
        observation, info = env.reset(seed=0)
        assert env.step(0)[0] in range(81)
        assert sorted(i for i in gymnasium.registry if i.startswith("icrl/")) == {sorted(GYM_IDS)!r}
        print("ok")
        """,
        cwd=tmp_path,  # not the repository: icrl_models comes from the installed package or PYTHONPATH
    )
    assert out.strip().endswith("ok")


def test_hook_leaves_other_imports_alone():
    finder = _gymnasium_hook.GymnasiumRegistrationFinder()
    assert finder.find_spec("gymnasium") is None
    assert finder.find_spec("gymnasium.envs") is None
    assert finder.find_spec("json") is None
