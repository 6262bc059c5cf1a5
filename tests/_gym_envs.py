"""Small gymnasium environments that the gymnasium-adapter tests register (needs gymnasium; imported by those
tests after their ``importorskip``).

* ``icrl_test/Chain-v0``: flat ``Box`` observations, ``Discrete(3, start=1)`` actions, random rewards and slips
  from the environment's own generator, termination at the chain's end, and its own truncation on a trap cell.
* ``icrl_test/Spaces-v0``: whatever spaces its keyword arguments ask for (the unsupported-space tests).
* ``icrl_test/NoLimit-v0``: Discrete observations, registered without ``max_episode_steps``.
* ``icrl_test/Bandit-v0``: a Bernoulli bandit (one state) with a toy-text model.
"""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces


class Chain(gymnasium.Env):
    """A chain of ``length`` cells; action 1 steps left, 2 stays, 3 steps right (a slip, with probability
    ``slip``, stays instead). Reward: the step's
    new cell index / length plus a small random bonus. Reaching the last cell terminates; the ``trap`` cell
    truncates (the environment's own truncation, not a time limit). Observation: the cell, the cell / length and
    a uniform noise feature (three features whatever the length)."""

    def __init__(self, length: int = 5, slip: float = 0.2, trap: int | None = None) -> None:
        self.length, self.slip, self.trap = length, slip, trap
        self.observation_space = spaces.Box(0.0, float(length), (3,), np.float32)
        self.action_space = spaces.Discrete(3, start=1)
        self.position = 0

    def _observation(self):
        return np.array([self.position, self.position / self.length, self.np_random.random()], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position = int(self.np_random.integers(0, 2))
        return self._observation(), {}

    def step(self, action):
        move = int(action) - 2
        if self.np_random.random() < self.slip:
            move = 0
        self.position = min(max(self.position + move, 0), self.length - 1)
        reward = self.position / self.length + 0.01 * self.np_random.random()
        terminated = self.position == self.length - 1
        truncated = self.trap is not None and self.position == self.trap
        return self._observation(), reward, terminated, truncated, {}


class Spaces(gymnasium.Env):
    """An environment with the spaces its arguments name (for the unsupported-space errors)."""

    OBSERVATIONS = {
        "discrete": lambda: spaces.Discrete(4),
        "vector": lambda: spaces.Box(0.0, 1.0, (3,), np.float32),
        "multidiscrete": lambda: spaces.MultiDiscrete([3, 3]),
        "image": lambda: spaces.Box(0, 255, (8, 8, 3), np.uint8),
        "dict": lambda: spaces.Dict({"cell": spaces.Discrete(4)}),
    }

    def __init__(self, observation: str = "discrete", actions: int = 3, continuous: bool = False) -> None:
        self.observation_space = self.OBSERVATIONS[observation]()
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32) if continuous else spaces.Discrete(actions)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


def register() -> None:
    """Register the test environments (idempotent)."""
    for env_id, entry_point, limit in (
        ("icrl_test/Chain-v0", Chain, 12),
        ("icrl_test/Spaces-v0", Spaces, 10),
        ("icrl_test/NoLimit-v0", Spaces, None),
        ("icrl_test/Bandit-v0", Bandit, 20),
    ):
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point, max_episode_steps=limit)


class Bandit(gymnasium.Env):
    """A Bernoulli bandit: one state (``Discrete(1)`` observations), arm ``a`` pays 1 with probability
    ``means[a]``; with the toy-text model (``P``, ``initial_state_distrib``) that gives it an oracle."""

    def __init__(self, means=(0.2, 0.8)) -> None:
        self.means = list(means)
        self.observation_space = spaces.Discrete(1)
        self.action_space = spaces.Discrete(len(self.means))
        self.P = {0: {a: [(p, 0, 1.0, False), (1.0 - p, 0, 0.0, False)] for a, p in enumerate(self.means)}}
        self.initial_state_distrib = np.ones(1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        return 0, float(self.np_random.random() < self.means[int(action)]), False, False, {}
