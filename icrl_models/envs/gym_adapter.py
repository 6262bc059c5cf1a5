"""Any discrete gymnasium environment as a :class:`~icrl_models.envs.base.BatchedEnv`: one environment per task.

:class:`GymEnv` makes one gymnasium environment per task (``gymnasium.make(env_id, max_episode_steps=L,
**task.kwargs)``) and steps them together through gymnasium's vector API (``SyncVectorEnv``), so that the
library's generators, datasets, training and in-context evaluation run on them as on the built-in environments.

* **Spaces.** Actions: ``Discrete(n, start)``; a task may restrict them to a subset (its ``actions``); every task
  must have the same action space (the vector API's rule). Observations: ``Discrete`` ids (their counts may
  differ between tasks: the batch uses the largest) or flat ``Box`` vectors (float32). Anything else
  (``MultiDiscrete``, image ``Box``, ``Dict``, ``Tuple``, continuous actions) raises :class:`UnsupportedSpaceError`
  naming the space.
* **Episodes.** The vector env runs with autoreset *disabled*: the library resets a finished environment itself
  (:meth:`BatchedEnv.reset` with its index becomes ``reset(options={"reset_mask": ...})``), so the observation
  returned with ``terminated`` / ``truncated`` is the episode's last one, as the library's generators expect.
  gymnasium's ``terminated`` is the library's; its ``truncated`` (the time limit, or the environment's own) joins
  the library's time limit. ``episode_length`` is the ``TimeLimit`` (default: the registered
  ``max_episode_steps``).
* **Seeds.** Each environment's first reset gets its own seed, drawn from the run seed (:attr:`GymEnv.env_seeds`);
  later resets continue its generator, as gymnasium's own loop does. So a run is reproducible from its seed, and
  stepping a :class:`GymEnv` matches stepping the same environments by hand with those seeds, bit for bit.
* **Oracle.** Where the environment has a tabular model in gymnasium's toy-text convention (``env.unwrapped.P[s][a]``
  = ``[(probability, next_state, reward, terminated), ...]`` and ``initial_state_distrib``, as FrozenLake, Taxi and
  CliffWalking have), value iteration over the ``episode_length``-step horizon gives the optimal return, an
  optimal (time-dependent) policy for noise distillation, and the reward range. Otherwise a task's
  ``optimal_return`` is what its entry says (NaN when it says nothing), noise distillation is unavailable, and the
  reward range is unbounded.

gymnasium is optional (``pip install "icrl-kernels[gym]"``); it is imported when a :class:`GymEnv` is made.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import BatchedEnv, StepResult, as_index_array, check_positive_int
from .tasks import GymTask, TaskError, import_from_cwd, parse_tasks

INSTALL_HINT = 'pip install "icrl-kernels[gym]"'
#: The first gymnasium with the vector API's autoreset modes (``AutoresetMode.DISABLED``), which the adapter uses.
MIN_GYMNASIUM = (1, 1)
#: The largest tabular model value iteration builds (states x actions x outcomes stay sparse; this bounds time).
MAX_MODEL_TRANSITIONS = 5_000_000


class MissingGymnasiumError(ImportError, ValueError):
    """gymnasium (>= 1.1) is not installed. An ``ImportError``, and a ``ValueError`` so that the command-line
    tools report it as one line saying how to install it."""


class GymEnvError(ValueError):
    """A gymnasium environment or task the adapter cannot use (the subclasses say which problem)."""


class UnknownEnvError(GymEnvError):
    """The id names no registered gymnasium environment (or importable entry point)."""


class UnsupportedSpaceError(GymEnvError):
    """An action or observation space the library cannot represent; ``space`` is the space."""

    def __init__(self, message: str, space: Any = None) -> None:
        super().__init__(message)
        self.space = space


class TaskConstructionError(GymEnvError):
    """``gymnasium.make`` failed for a task; ``task_index`` is its position in the task list given."""

    def __init__(self, message: str, task_index: int) -> None:
        super().__init__(message)
        self.task_index = task_index


def require_gymnasium():
    """The ``gymnasium`` module, or :class:`MissingGymnasiumError` saying how to install it."""
    try:
        import gymnasium
        import gymnasium.vector
    except ImportError:
        raise MissingGymnasiumError(f"gymnasium environments need gymnasium >= 1.1: {INSTALL_HINT}") from None
    version = tuple(int(part) for part in gymnasium.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_GYMNASIUM or not hasattr(gymnasium.vector, "AutoresetMode"):
        raise MissingGymnasiumError(
            f"gymnasium environments need gymnasium >= 1.1, found {gymnasium.__version__}: {INSTALL_HINT} --upgrade"
        )
    return gymnasium


def resolve_env(env) -> tuple[Any, str, int | None]:
    """``(what gymnasium.make takes, the id recorded in datasets, the registered max_episode_steps or None)``.

    ``env``: a registered id (``"FrozenLake-v1"``, ``"my_package.envs:MyEnv-v0"``, which imports ``my_package.envs``
    first, as ``gymnasium.make`` does), an entry point ``"module:attribute"`` (a class or function returning an
    environment), or the class / function itself (recorded as ``module:qualname``)."""
    gymnasium = require_gymnasium()
    from gymnasium.envs.registration import EnvSpec

    if callable(env) and not isinstance(env, str):
        name = f"{env.__module__}:{env.__qualname__}"
        return EnvSpec(id=name, entry_point=env), name, None
    if not isinstance(env, str) or not env:
        raise TypeError(f"env must be a gymnasium id, a module:attribute entry point or a class, got {env!r}")
    env_id = env
    if ":" in env:
        module_name, _, env_id = env.partition(":")
        try:
            module = import_from_cwd(module_name)
        except ImportError as error:
            raise UnknownEnvError(f"gymnasium env {env!r}: cannot import {module_name!r} ({error})") from None
        if env_id not in gymnasium.registry:
            entry = getattr(module, env_id, None)
            if not callable(entry):
                raise UnknownEnvError(f"gymnasium env {env!r}: {module_name} registers no id {env_id!r} and has "
                                      f"no class or function {env_id!r}")  # fmt: skip
            return EnvSpec(id=env, entry_point=entry), env, None
    try:
        spec = gymnasium.spec(env_id)
    except gymnasium.error.Error as error:
        raise UnknownEnvError(f"unknown gymnasium env {env!r}: {' '.join(str(error).split())}") from None
    return env_id, env, spec.max_episode_steps


def _space_error(space, where: str, what: str) -> UnsupportedSpaceError:
    return UnsupportedSpaceError(f"{where}: {what} {space} is not supported; the library takes Discrete actions and "
                                 "Discrete or flat Box observations", space)  # fmt: skip


def _check_spaces(gymnasium, env, where: str) -> None:
    spaces = gymnasium.spaces
    action, observation = env.action_space, env.observation_space
    if not isinstance(action, spaces.Discrete):
        what = "continuous action space" if isinstance(action, spaces.Box) else "action space"
        raise _space_error(action, where, what)
    if isinstance(observation, spaces.Discrete):
        return
    if isinstance(observation, spaces.Box) and len(observation.shape) == 1 and observation.shape[0] > 0:
        return
    what = "image observation space" if isinstance(observation, spaces.Box) else "observation space"
    raise _space_error(observation, where, what)


class GymEnv(BatchedEnv):
    """One gymnasium environment per task, stepped together (see the module docstring).

    Args:
        env: a gymnasium id, a ``module:attribute`` entry point, or an environment class or function.
        tasks: one task per environment: a :class:`~icrl_models.envs.tasks.GymTask` or a dict of
            ``gymnasium.make`` keyword arguments (repeat a task to run it in several environments).
        episode_length: the time limit (default: the id's registered ``max_episode_steps``; required without).
        seed: the run seed; each environment's first reset is seeded from it (:attr:`env_seeds`).
        task_ids: ``[N]`` ids to record in datasets (default ``0..N-1``): positions in the full task list.
        num_observations: ``Discrete`` observations: at least this many ids (default: the most of any task given),
            so that environments of other tasks of one list (held-out maps larger than the training ones) share
            one id range with these: see :func:`check_task_list`.

    Raises:
        MissingGymnasiumError, UnknownEnvError, TaskConstructionError, UnsupportedSpaceError, GymEnvError (no time
        limit; tasks with different action spaces or observation shapes; an action subset out of range).
    """

    def __init__(
        self, env, tasks, *, episode_length: int | None = None, seed=None, task_ids=None, num_observations: int = 0
    ) -> None:
        gymnasium = require_gymnasium()
        maker, self.env_id, registered_length = resolve_env(env)
        if isinstance(tasks, (str, bytes, dict)) or not isinstance(tasks, Sequence) or len(tasks) == 0:
            raise TaskError(f"tasks must be a non-empty list of tasks (one per environment), got {tasks!r}")
        self.tasks = [task if isinstance(task, GymTask) else GymTask(task) for task in tasks]
        if not all(isinstance(task.kwargs, dict) for task in self.tasks):
            raise TaskError("every task must be a GymTask or a dict of gymnasium.make keyword arguments")
        length = registered_length if episode_length is None else episode_length
        if length is None:
            raise GymEnvError(f"gymnasium env {self.env_id!r} has no time limit (max_episode_steps): give an "
                              "episode_length (--episode-length)")  # fmt: skip
        length = check_positive_int(length, "episode_length")  # before gymnasium's TimeLimit sees it
        self.name = self.env_id
        envs = [self._make(gymnasium, maker, task, index, length) for index, task in enumerate(self.tasks)]
        first = envs[0]
        for index, sub in enumerate(envs):
            if sub.action_space != first.action_space:
                raise GymEnvError(f"gymnasium env {self.env_id!r}: task {index} has action space {sub.action_space}, "
                                  f"task 0 {first.action_space}; the tasks must share one action space (restrict it "
                                  "per task with 'actions')")  # fmt: skip
        super().__init__(len(envs), int(first.action_space.n), length, seed)
        self._action_start = int(first.action_space.start)
        spaces = [sub.observation_space for sub in envs]
        self._discrete = isinstance(spaces[0], gymnasium.spaces.Discrete)
        if self._discrete:
            if not all(isinstance(space, gymnasium.spaces.Discrete) for space in spaces):
                raise GymEnvError(f"gymnasium env {self.env_id!r}: the tasks mix Discrete and Box observations")
            self._observation_start = np.array([space.start for space in spaces], dtype=np.int64)
            self.num_observations = int(max(num_observations, *(space.n for space in spaces)))
            self.num_learner_states = self.num_observations
        else:
            shapes = {space.shape for space in spaces}
            if len(shapes) != 1:
                raise GymEnvError(
                    f"gymnasium env {self.env_id!r}: the tasks' observation shapes differ: {sorted(shapes)}"
                )
            self.observation_dim = int(spaces[0].shape[0])
        self._available = np.zeros((self.num_envs, self.num_actions), dtype=bool)
        for index, task in enumerate(self.tasks):
            if task.actions is None:
                self._available[index] = True
            else:
                where = f"task {index}'s actions"
                self._available[index, as_index_array(list(task.actions), where, low=0, high=self.num_actions)] = True
        if task_ids is None:
            task_ids = np.arange(self.num_envs)
        high = np.iinfo(np.int64).max
        self._task_ids = as_index_array(task_ids, "task_ids", low=0, high=high, shape=(self.num_envs,))
        #: The seed of each environment's first reset (drawn from ``seed``).
        self.env_seeds = self.rng.integers(0, 2**31 - 1, size=self.num_envs)
        self._seeded = np.zeros(self.num_envs, dtype=bool)
        vector = gymnasium.vector
        self.vector = vector.SyncVectorEnv([functools.partial(_made, sub) for sub in envs], copy=False,
                                           observation_mode="different",
                                           autoreset_mode=vector.AutoresetMode.DISABLED)  # fmt: skip
        self._observations = (
            np.zeros(self.num_envs, dtype=np.int64)
            if self._discrete
            else np.zeros((self.num_envs, self.observation_dim), dtype=np.float32)
        )
        self._gym_truncated = np.zeros(self.num_envs, dtype=bool)
        self._model: _TabularOracle | None | bool = False  # False: not built yet; None: no model

    def _make(self, gymnasium, maker, task: GymTask, index: int, length: int):
        where = f"gymnasium env {self.env_id!r}, task {index} ({task.kwargs})"
        try:
            env = gymnasium.make(maker, max_episode_steps=length, **task.kwargs)
        except Exception as error:  # the environment's own code: any exception means this task cannot be made
            message = " ".join(str(error).split()) or type(error).__name__
            raise TaskConstructionError(f"{where} failed to construct: {type(error).__name__}: {message}",
                                        index) from None  # fmt: skip
        _check_spaces(gymnasium, env, where)
        return env

    # -- stepping ---------------------------------------------------------------------------------
    def step(self, actions) -> StepResult:
        result = super().step(actions)
        # gymnasium's truncation (its TimeLimit, which is the library's, or the environment's own) ends the episode.
        truncated = result.truncated | (self._gym_truncated & ~result.terminated)
        self._needs_reset |= truncated
        return result._replace(truncated=truncated)

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        observations, rewards, terminated, truncated, _ = self.vector.step(actions + self._action_start)
        self._store(observations)
        self._gym_truncated = np.asarray(truncated, dtype=bool)
        return np.asarray(rewards), np.asarray(terminated, dtype=bool)

    def _reset(self, env_ids: np.ndarray) -> None:
        if env_ids.size == 0:
            return
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[env_ids] = True
        first = mask & ~self._seeded
        seeds = [int(seed) if new else None for seed, new in zip(self.env_seeds, first)]
        observations, _ = self.vector.reset(seed=seeds, options={"reset_mask": mask})
        self._seeded |= mask
        self._gym_truncated[mask] = False
        self._store(observations)

    def _store(self, observations) -> None:
        if self._discrete:
            self._observations = np.asarray(observations, dtype=np.int64) - self._observation_start
        else:
            self._observations = np.asarray(observations, dtype=np.float32).reshape(self.num_envs, -1)

    def observations(self) -> np.ndarray:
        return self._observations.copy()

    def close(self) -> None:
        """Close the gymnasium environments."""
        self.vector.close()

    # -- tasks and the oracle ---------------------------------------------------------------------
    def task_ids(self) -> np.ndarray:
        return self._task_ids.copy()

    def task_params(self) -> dict[str, np.ndarray]:
        return {"task_index": self._task_ids.copy()}

    def config(self) -> dict:
        return {"gym_id": self.env_id, "episode_length": self.episode_length}

    def _oracle(self) -> _TabularOracle | None:
        if self._model is False:
            self._model = _TabularOracle.build(self) if self._discrete else None
        return self._model

    @property
    def has_model(self) -> bool:
        """Whether a tabular model gives the optimal policy and returns (see the module docstring)."""
        return self._oracle() is not None

    @property
    def reward_range(self) -> tuple[float, float]:  # type: ignore[override]
        oracle = self._oracle()
        return oracle.reward_range if oracle is not None else (-np.inf, np.inf)

    def optimal_returns(self) -> np.ndarray:
        given = np.array([np.nan if t.optimal_return is None else t.optimal_return for t in self.tasks])
        oracle = self._oracle()
        if oracle is None:
            return given
        return np.where(np.isnan(given), oracle.returns, given)

    def optimal_actions(self) -> np.ndarray:
        oracle = self._oracle()
        if oracle is None:
            raise GymEnvError(
                f"gymnasium env {self.env_id!r} has no tabular model (unwrapped.P) to give an optimal policy: "
                "noise_distillation cannot run on it; use q_learning or another generator"
            )
        return oracle.actions(self._observations, self.elapsed_steps)


def _made(env):
    return env


@functools.lru_cache(maxsize=16)
def _check_task_list(env: str, tasks_json: str, episode_length: int | None) -> int:
    probe = GymEnv(env, parse_tasks(json.loads(tasks_json)), episode_length=episode_length)
    probe.close()
    return probe.num_observations


def check_task_list(env: str, tasks: Sequence[GymTask], *, episode_length: int | None = None) -> int:
    """Make one environment of every task of a list (training and held-out tasks) and check that they share their
    spaces, so that a held-out task that cannot be made fails before training rather than at its evaluation.
    Returns the most ``Discrete`` observations of any task (0 for vector observations): the id range that
    every :class:`GymEnv` of the list's tasks then uses. Errors name the task's position in the list. Cached per
    list in this process (an evaluation builds its environments several times)."""
    tasks_json = json.dumps([task.to_json() | {"split": None} for task in tasks], sort_keys=True)
    return _check_task_list(env, tasks_json, episode_length)


@dataclass(frozen=True)
class _Model:
    """A task's toy-text model as outcome arrays (one entry per ``(state, action, outcome)``)."""

    pairs: np.ndarray  # [K] state * num_actions + action
    probability: np.ndarray  # [K]
    next_state: np.ndarray  # [K]
    reward: np.ndarray  # [K]
    terminated: np.ndarray  # [K] bool
    initial: np.ndarray  # [S] the initial state distribution


class _TabularOracle:
    """Finite-horizon value iteration on every distinct task's toy-text model (``unwrapped.P``)."""

    def __init__(self, policies: np.ndarray, returns: np.ndarray, slots: np.ndarray, reward_range) -> None:
        self.policies = policies  # [distinct tasks, H, S] int16: the optimal action with h + 1 steps left
        self.returns = returns  # [N] the optimal return of each environment's task
        self.slots = slots  # [N] each environment's row of ``policies``
        self.reward_range = reward_range
        self.horizon = policies.shape[1]

    @classmethod
    def build(cls, env: GymEnv) -> _TabularOracle | None:
        """The oracle of every task of ``env``, or None when a task's environment has no usable model."""
        if env._action_start or np.any(env._observation_start):
            return None  # the toy-text convention indexes P by ids that start at 0
        slots = np.zeros(env.num_envs, dtype=np.int64)
        distinct: dict[str, int] = {}
        policies, returns, rewards = [], [], []
        for index, sub in enumerate(env.vector.envs):
            key = env.tasks[index].key()
            if key not in distinct:
                model = _read_model(sub.unwrapped, env.num_observations, env.num_actions)
                if model is None:
                    return None
                policy, value = _value_iteration(model, env._available[index], env.num_observations, env.episode_length)
                distinct[key] = len(policies)
                policies.append(policy)
                returns.append(value)
                rewards.append((model.reward.min(), model.reward.max()))
            slots[index] = distinct[key]
        low, high = np.min([r[0] for r in rewards]), np.max([r[1] for r in rewards])
        return cls(np.stack(policies), np.asarray(returns)[slots], slots, (float(low), float(high)))

    def actions(self, observations: np.ndarray, elapsed: np.ndarray) -> np.ndarray:
        remaining = np.clip(self.horizon - elapsed, 1, self.horizon)
        return self.policies[self.slots, remaining - 1, observations].astype(np.int64)


def _read_model(unwrapped, num_states: int, num_actions: int) -> _Model | None:
    """The toy-text model of ``unwrapped`` (``P[s][a] = [(probability, next_state, reward, terminated), ...]``
    and ``initial_state_distrib``), or None where it has none that fits its spaces."""
    table = getattr(unwrapped, "P", None)
    initial = getattr(unwrapped, "initial_state_distrib", None)
    if table is None or initial is None:
        return None
    rows: list[tuple] = []
    try:
        if not 0 < len(table) <= num_states:
            return None
        for state in range(len(table)):
            for action in range(num_actions):
                for probability, next_state, reward, terminated in table[state][action]:
                    rows.append((state * num_actions + action, probability, next_state, reward, bool(terminated)))
            if len(rows) > MAX_MODEL_TRANSITIONS:
                return None
        initial = np.asarray(initial, dtype=np.float64).reshape(-1)
        columns = [np.asarray(column) for column in zip(*rows)]
    except (TypeError, KeyError, IndexError, ValueError):
        return None
    if not rows or initial.size > num_states:
        return None
    pairs, probability, next_state, reward, terminated = columns
    if next_state.dtype.kind not in "iu" or next_state.min() < 0 or next_state.max() >= num_states:
        return None
    reward = reward.astype(np.float64)
    if not np.all(np.isfinite(reward)):
        return None
    distribution = np.zeros(num_states)
    distribution[: initial.size] = initial
    return _Model(pairs.astype(np.int64), probability.astype(np.float64), next_state.astype(np.int64), reward,
                  terminated.astype(bool), distribution)  # fmt: skip


def _value_iteration(model: _Model, available: np.ndarray, num_states: int, horizon: int) -> tuple[np.ndarray, float]:
    """``(policy [horizon, S] int16, optimal return)``: ``policy[h, s]`` is an optimal action (the lowest id of
    the best, among ``available``) with ``h + 1`` steps left; the return is the expected undiscounted return of
    one ``horizon``-step episode from the initial state distribution."""
    num_actions = available.size
    value = np.zeros(num_states)
    policy = np.empty((horizon, num_states), dtype=np.int16)
    for steps_left in range(horizon):
        backup = model.probability * (model.reward + np.where(model.terminated, 0.0, value[model.next_state]))
        q = np.bincount(model.pairs, backup, minlength=num_states * num_actions).reshape(num_states, num_actions)
        q[:, ~available] = -np.inf
        policy[steps_left] = q.argmax(axis=1)
        value = q.max(axis=1)
    return policy, float(model.initial @ value)


def default_generator(env: BatchedEnv) -> str:
    """The source algorithm for a gymnasium environment's spaces: LinUCB for vector observations, Thompson
    sampling (rewards in [0, 1]) or UCB1 for a single state (a bandit), tabular Q-learning otherwise."""
    if env.observation_dim:
        return "linucb"
    if env.num_observations == 1:
        low, high = env.reward_range
        return "thompson" if 0.0 <= low and high <= 1.0 else "ucb"
    return "q_learning"
