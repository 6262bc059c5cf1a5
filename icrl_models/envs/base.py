"""The batched-environment interface shared by every environment of :mod:`icrl_models.envs`.

One object steps ``num_envs`` independent tasks at once with vectorised numpy, because learning-history
generation and in-context evaluation run thousands of environments in parallel. Conventions:

* Actions are integer ids into the environment's full action space ``[0, num_actions)``. Environments
  whose available actions vary per task (bandits with 4-20 arms, Darkroom with a chosen action set)
  say which are available with :meth:`BatchedEnv.action_mask`; an unavailable action is an error.
* Observations are integer ids in ``[0, num_observations)`` (``observation_dim == 0``) or float32
  vectors of ``observation_dim`` features (the contextual bandit).
* Every episode has a time limit, ``episode_length`` steps, after which it is *truncated*; an
  environment may also *terminate* earlier (gymnasium's convention). A finished environment must be
  reset (:meth:`BatchedEnv.reset` with its index) before it is stepped again.
* All randomness (start cells, stochastic rewards, contexts) comes from one ``numpy.random.Generator``
  seeded at construction, so a run is reproducible from its seed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._checks import check_seed


class StepResult(NamedTuple):
    """What :meth:`BatchedEnv.step` returns for all ``N`` environments."""

    observations: np.ndarray  #: ``[N]`` int64 ids, or ``[N, observation_dim]`` float32
    rewards: np.ndarray  #: ``[N]`` float32
    terminated: np.ndarray  #: ``[N]`` bool: the episode ended inside the task (goal, door)
    truncated: np.ndarray  #: ``[N]`` bool: the episode hit its time limit


def as_index_array(values, name: str, *, low: int, high: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """``values`` as an int64 array, checked to lie in ``[low, high)`` (and to have ``shape``)."""
    array = np.asarray(values)
    if array.size == 0 and array.dtype.kind == "f":
        array = array.astype(np.int64)  # an empty list has numpy's default float dtype
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if shape is not None and array.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
    if array.size and (array.min() < low or array.max() >= high):
        raise ValueError(f"{name} must lie in [{low}, {high}), got values in [{array.min()}, {array.max()}]")
    return array


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


class BatchedEnv:
    """Base class: ``num_envs`` tasks stepped together. Subclasses implement ``_reset`` and ``_step``.

    Attributes every environment sets: ``num_envs``, ``num_actions`` (the full action space),
    ``num_observations`` (ids) or ``observation_dim`` (> 0 for vector observations), ``episode_length``
    (the time limit) and ``reward_range`` (the smallest and largest possible reward of one step).
    """

    #: Name used in dataset metadata and on the command line.
    name: str = ""
    num_observations: int = 0
    observation_dim: int = 0
    reward_range: tuple[float, float] = (0.0, 1.0)
    #: An episode whose return reaches this counts as solved (success rates); ``None``: no such notion.
    success_return: float | None = None

    def __init__(self, num_envs: int, num_actions: int, episode_length: int, seed: int | None) -> None:
        self.num_envs = check_positive_int(num_envs, "num_envs")
        self.num_actions = check_positive_int(num_actions, "num_actions")
        self.episode_length = check_positive_int(episode_length, "episode_length")
        self.rng = np.random.default_rng(check_seed(seed))
        self.elapsed_steps = np.zeros(self.num_envs, dtype=np.int64)
        self._needs_reset = np.ones(self.num_envs, dtype=bool)
        self._all = np.arange(self.num_envs)
        self._available: np.ndarray | None = None  # [N, num_actions] bool; None: every action everywhere

    # -- the public API -------------------------------------------------------------------------
    def reset(self, env_ids=None) -> np.ndarray:
        """Start new episodes in ``env_ids`` (default: all) and return the observations of **all** envs."""
        ids = self._all if env_ids is None else as_index_array(env_ids, "env_ids", low=0, high=self.num_envs)
        if ids.ndim != 1:
            raise ValueError(f"env_ids must be 1-D, got shape {ids.shape}")
        self.elapsed_steps[ids] = 0
        self._needs_reset[ids] = False
        self._reset(ids)
        return self.observations()

    def step(self, actions) -> StepResult:
        """Apply one action per environment (``[N]`` ints); see :class:`StepResult`."""
        actions = as_index_array(actions, "actions", low=0, high=self.num_actions, shape=(self.num_envs,))
        if self._needs_reset.any():
            stale = np.flatnonzero(self._needs_reset)[:5].tolist()
            raise ValueError(f"environments {stale} finished their episode (or never started): reset them first")
        available = True if self._available is None else self._available[self._all, actions]
        if not np.all(available):
            bad = np.flatnonzero(~available)[:5]
            raise ValueError(
                f"actions {actions[bad].tolist()} are not available in environments {bad.tolist()} (see action_mask())"
            )
        rewards, terminated = self._step(actions)
        self.elapsed_steps += 1
        truncated = (self.elapsed_steps >= self.episode_length) & ~terminated
        self._needs_reset |= terminated | truncated
        return StepResult(self.observations(), rewards.astype(np.float32), terminated, truncated)

    def action_mask(self) -> np.ndarray:
        """``[N, num_actions]`` bool: which actions each environment accepts."""
        if self._available is None:
            return np.ones((self.num_envs, self.num_actions), dtype=bool)
        return self._available.copy()

    def action_sets(self) -> np.ndarray:
        """``[N, A]`` int64: the ids of each environment's available actions, padded with -1 (``A`` the
        largest count). The order is the environment's own (an action set's order), else ascending."""
        mask = self.action_mask()
        counts = mask.sum(axis=1)
        ids = np.full((self.num_envs, int(counts.max())), -1, dtype=np.int64)
        ids[np.arange(ids.shape[1])[None, :] < counts[:, None]] = np.nonzero(mask)[1]
        return ids

    def observations(self) -> np.ndarray:
        """The current observation of every environment (see :class:`StepResult`)."""
        raise NotImplementedError

    def optimal_returns(self) -> np.ndarray:
        """``[N]`` float64: the expected return of one episode under an optimal policy (the oracle)."""
        raise NotImplementedError

    def optimal_actions(self) -> np.ndarray:
        """``[N]`` int64: an optimal action in the current state (used by noise distillation)."""
        raise NotImplementedError

    def task_ids(self) -> np.ndarray:
        """``[N]`` int64: an id of each environment's task, unique within the environment family."""
        raise NotImplementedError

    def task_params(self) -> dict[str, np.ndarray]:
        """The arrays that define each environment's task (goal cells, arm means, ...), ``[N, ...]`` each."""
        raise NotImplementedError

    def config(self) -> dict:
        """The constructor settings other than the tasks (for dataset metadata)."""
        return {"episode_length": self.episode_length}

    # -- tabular learners (Q-learning) ------------------------------------------------------------
    #: Size of the state space a tabular learner indexes; 0 when the environment is not tabular.
    num_learner_states: int = 0

    def learner_states(self) -> np.ndarray:
        """``[N]`` int64: the state a tabular learner indexes. It may hold more than the observation
        (Key-to-Door adds whether the key is held, which the learner knows from its own rewards)."""
        return self.observations()

    # -- subclasses -------------------------------------------------------------------------------
    def _reset(self, env_ids: np.ndarray) -> None:
        raise NotImplementedError

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Advance every environment; return ``(rewards [N], terminated [N] bool)``."""
        raise NotImplementedError
