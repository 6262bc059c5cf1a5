"""Single-environment API with gymnasium's ``reset`` / ``step`` conventions.

Each registered id wraps one environment of the batched implementation, so both APIs share dynamics:

=============================== ====================================================
``icrl/DarkRoom-v0``            ``goal`` (cell id), ``size``, ``episode_length``
``icrl/KeyToDoor-v0``           ``key``, ``door``, ``size``, ``episode_length``
``icrl/DarkRoomComposite-v0``   ``goal``, ``action_set`` (a set name or global ids), ``split_seed``
``icrl/BernoulliBandit-v0``     ``means`` (one per arm), ``episode_length``
``icrl/ContextualBandit-v0``    ``arms`` (``[num_arms, dim]``), ``noise_std``, ``episode_length``
=============================== ====================================================

``reset(seed=...)`` reseeds the environment's generator; ``step`` returns ``(observation, reward,
terminated, truncated, info)``. Actions are indices into the environment's own action list: for
composite Darkroom ``info["action_ids"]`` at reset maps them to global ids.

Registration: a plain ``gymnasium.make("icrl/DarkRoom-v0")`` works from a fresh interpreter, with no icrl
import, after ``pip install icrl-kernels[gym]`` (regular or editable):

* gymnasium >= 1.0 removed third-party plugins; there the ``icrl_gymnasium.pth`` file that ``setup.py`` adds
  to the wheel installs a start-up import hook (:mod:`icrl_models.envs._gymnasium_hook`) that registers the ids
  with string entry points right after gymnasium's registry module loads. It imports nothing at start-up
  (about half a millisecond to compile); this module is imported only when an environment is made.
* gymnasium 0.26-0.29 also runs the package's ``gymnasium.envs`` entry point (:func:`register_gymnasium_envs`)
  on ``import gymnasium``.
* Importing :mod:`icrl_models.envs` registers them too (idempotent), which covers ``python -S``, a ``--target``
  install or a source checkout on ``PYTHONPATH`` (no ``.pth`` file processed); so does naming the module in the
  id, ``gymnasium.make("icrl_models.envs:icrl/DarkRoom-v0", goal=10)``.

Without gymnasium the classes still work, without ``action_space`` / ``observation_space``.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_seed, is_integer
from .bandits import BernoulliBandit, ContextualBandit
from .base import BatchedEnv, as_index_array
from .composite_dark_room import ACTION_SET_NAMES, CompositeDarkRoom, composite_action_sets
from .dark_room import DarkRoom
from .key_to_door import KeyToDoor

try:
    import gymnasium
    from gymnasium import spaces
except ImportError:  # gymnasium is optional
    gymnasium = None

_Base = gymnasium.Env if gymnasium is not None else object


class SingleEnv(_Base):
    """One environment of a batched env (``num_envs == 1``) behind gymnasium's API.

    Args:
        batched: the environment, with exactly one task.
        action_ids: the global action id of each local action index (default: every action of
            ``batched`` that its action mask allows, in id order).
    """

    metadata = {"render_modes": []}

    def __init__(self, batched: BatchedEnv, action_ids=None) -> None:
        if not isinstance(batched, BatchedEnv):
            raise TypeError(f"batched must be a BatchedEnv, got {type(batched).__name__}")
        if batched.num_envs != 1:
            raise ValueError(f"SingleEnv wraps a batched env with num_envs == 1, got {batched.num_envs}")
        self.batched = batched
        if action_ids is None:
            action_ids = np.flatnonzero(batched.action_mask()[0])
        self.action_ids = as_index_array(action_ids, "action_ids", low=0, high=batched.num_actions)
        if self.action_ids.ndim != 1 or self.action_ids.size == 0:
            raise ValueError(f"action_ids must be a non-empty 1-D array, got shape {self.action_ids.shape}")
        if gymnasium is not None:
            self.action_space = spaces.Discrete(self.action_ids.size)
            if batched.observation_dim:
                self.observation_space = spaces.Box(-np.inf, np.inf, (batched.observation_dim,), np.float32)
            else:
                self.observation_space = spaces.Discrete(batched.num_observations)

    def _observation(self, observations: np.ndarray):
        return observations[0] if self.batched.observation_dim else int(observations[0])

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None and not is_integer(seed):  # gymnasium's reset seeds with ints only
            raise TypeError(f"seed must be None or a non-negative int, got {type(seed).__name__} {seed!r}")
        seed = check_seed(seed)
        if gymnasium is not None:
            super().reset(seed=seed)
        if seed is not None:
            self.batched.rng = np.random.default_rng(seed)
        observations = self.batched.reset()
        return self._observation(observations), {"action_ids": self.action_ids.copy()}

    def step(self, action):
        # int(1.7) would silently act as action 1: accept integers only (int, numpy integer, 0-d tensor).
        if not is_integer(action):
            raise TypeError(
                f"action must be an int in [0, {self.action_ids.size}), got {type(action).__name__} {action!r}"
            )
        index = int(action)
        if not 0 <= index < self.action_ids.size:
            raise ValueError(f"action must lie in [0, {self.action_ids.size}), got {index}")
        result = self.batched.step(self.action_ids[index : index + 1])
        return (
            self._observation(result.observations),
            float(result.rewards[0]),
            bool(result.terminated[0]),
            bool(result.truncated[0]),
            {},
        )


def make_dark_room(goal: int = 0, *, size: int = 9, episode_length: int = 20) -> SingleEnv:
    return SingleEnv(DarkRoom([goal], size=size, episode_length=episode_length))


def make_key_to_door(key: int = 0, door: int = 80, *, size: int = 9, episode_length: int = 50) -> SingleEnv:
    return SingleEnv(KeyToDoor([key], [door], size=size, episode_length=episode_length))


def make_composite_dark_room(
    goal: int = 0, *, action_set="train", split_seed: int = 0, size: int = 9, episode_length: int = 20
) -> SingleEnv:
    if isinstance(action_set, str):
        if action_set not in ACTION_SET_NAMES:
            raise ValueError(f"action_set must be one of {ACTION_SET_NAMES} or a list of ids, got {action_set!r}")
        action_set = composite_action_sets(split_seed)[action_set]
    env = CompositeDarkRoom([goal], action_set=action_set, size=size, episode_length=episode_length)
    return SingleEnv(env, action_ids=env.action_set[0])


def make_bernoulli_bandit(means=(0.2, 0.8), *, episode_length: int = 300) -> SingleEnv:
    return SingleEnv(BernoulliBandit(np.asarray(means, dtype=np.float64)[None], episode_length=episode_length))


def make_contextual_bandit(arms=((1.0, 0.0), (0.0, 1.0)), *, noise_std: float = 1.0, episode_length: int = 300):
    arms = np.asarray(arms, dtype=np.float64)[None]
    return SingleEnv(ContextualBandit(arms, noise_std=noise_std, episode_length=episode_length))


GYM_IDS = {
    "icrl/DarkRoom-v0": make_dark_room,
    "icrl/KeyToDoor-v0": make_key_to_door,
    "icrl/DarkRoomComposite-v0": make_composite_dark_room,
    "icrl/BernoulliBandit-v0": make_bernoulli_bandit,
    "icrl/ContextualBandit-v0": make_contextual_bandit,
}


def register_gymnasium_envs() -> bool:
    """Register :data:`GYM_IDS` with gymnasium (idempotent); False when gymnasium is not installed.

    Also the ``gymnasium.envs`` entry point of this package (``pyproject.toml``): gymnasium 0.29 calls it
    while ``import gymnasium`` is still running, inside ``namespace("icrl")``. The registry is therefore
    taken from ``gymnasium.envs.registration`` (the ``gymnasium.registry`` attribute does not exist yet
    then), and the entry points are strings, so nothing is imported until an environment is made.
    """
    if gymnasium is None:
        return False
    from gymnasium.envs.registration import register, registry

    for env_id, factory in GYM_IDS.items():
        if env_id not in registry:
            register(id=env_id, entry_point=f"{__name__}:{factory.__name__}")
    return True
