"""Registers the ``icrl/*`` gymnasium ids as soon as gymnasium's registry is imported, in any process.

Gymnasium 1.0 removed the ``gymnasium.envs`` entry-point plugins through which gymnasium 0.26-0.29 registered
third-party ids on ``import gymnasium``, and offers no replacement: a bare ``gymnasium.make("icrl/DarkRoom-v0")``
in a fresh interpreter would fail unless something had imported :mod:`icrl_models.envs` first.

This module is the source of the one-line ``icrl_gymnasium.pth`` file that ``setup.py`` adds to both the regular
and the editable wheel; Python runs it at start-up (``site``). :func:`install` only puts a finder at the front of
``sys.meta_path``: nothing is imported then (no gymnasium, torch, numpy or :mod:`icrl_models`). When a program
imports ``gymnasium.envs.registration``, the finder lets the module load as usual and then registers the ids
below with *string* entry points, so :mod:`icrl_models` is imported only when one of them is made. The finder
removes itself after that one import. Per import until then it costs one string comparison.

Standard library only, and no top-level side effects: the tests import this module directly. After changing
it, reinstall the package (the ``.pth`` file holds a copy of this source).
"""

from __future__ import annotations

import sys

#: id -> entry point, the same table as :data:`icrl_models.envs.gym.GYM_IDS` (a test keeps them equal).
ENTRY_POINTS = {
    "icrl/DarkRoom-v0": "icrl_models.envs.gym:make_dark_room",
    "icrl/KeyToDoor-v0": "icrl_models.envs.gym:make_key_to_door",
    "icrl/DarkRoomComposite-v0": "icrl_models.envs.gym:make_composite_dark_room",
    "icrl/BernoulliBandit-v0": "icrl_models.envs.gym:make_bernoulli_bandit",
    "icrl/ContextualBandit-v0": "icrl_models.envs.gym:make_contextual_bandit",
}

TARGET = "gymnasium.envs.registration"


def register(registration) -> None:
    """Register every id of :data:`ENTRY_POINTS` that ``registration`` (gymnasium's module) lacks."""
    for env_id, entry_point in ENTRY_POINTS.items():
        if env_id not in registration.registry:
            registration.register(id=env_id, entry_point=entry_point)


class GymnasiumRegistrationFinder:
    """A ``sys.meta_path`` finder that never finds anything itself: for :data:`TARGET` it asks the finders
    behind it for the spec and wraps that spec's ``exec_module`` so that :func:`register` runs right after
    gymnasium's registry module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        self.uninstall()  # one-shot, and the finders below must not see this one again
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(name, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                register(module)
            except Exception as error:  # never break `import gymnasium` over the icrl ids
                import warnings

                warnings.warn(f"icrl-kernels could not register its gymnasium ids: {error!r}", stacklevel=2)

        # An attribute of this loader object only (file loaders are one per module), so that module.__loader__
        # and module.__spec__ stay gymnasium's own.
        loader.exec_module = exec_then_register
        return spec

    def uninstall(self) -> None:
        sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self]


def install() -> None:
    """Put the finder at the front of ``sys.meta_path``, or register at once where gymnasium's registry is
    already imported. Idempotent."""
    registration = sys.modules.get(TARGET)
    if registration is not None and hasattr(registration, "registry"):
        register(registration)
        return
    if not any(type(finder).__name__ == GymnasiumRegistrationFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, GymnasiumRegistrationFinder())
