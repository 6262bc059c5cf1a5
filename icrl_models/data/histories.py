"""Learning histories: what a source RL algorithm saw and did while it learned one task each.

:class:`LearningHistories` holds ``H`` histories of up to ``T`` steps as dense arrays (a history that
ends early, e.g. Key-to-Door episodes that terminate, is padded after ``lengths[h]``). Step ``t`` of
history ``h`` is the transition ``(states[h, t], actions[h, t], rewards[h, t])``: the observation the
action was chosen in, the action (a global action id), and the reward it earned; ``dones[h, t]`` marks
the last step of an episode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..envs.base import as_index_array

#: Version of the dataset layout (arrays and metadata keys); bump on an incompatible change.
FORMAT_VERSION = 1
ARRAY_FIELDS = ("states", "actions", "rewards", "dones", "lengths", "task_ids", "action_sets")
REQUIRED_METADATA = ("format_version", "env", "generator", "seed", "split", "num_episodes")
REQUIRED_ENV_METADATA = ("name", "config", "num_actions", "num_observations", "observation_dim", "reward_range")


class DatasetError(ValueError):
    """A learning-history file or object is malformed: truncated, corrupt, or not what was expected."""


@dataclasses.dataclass
class LearningHistories:
    """``H`` learning histories of up to ``T`` steps (see the module docstring).

    Attributes:
        states: ``[H, T]`` integer observation ids, or ``[H, T, observation_dim]`` float32 vectors.
        actions: ``[H, T]`` int16 global action ids.
        rewards: ``[H, T]`` float32.
        dones: ``[H, T]`` bool, True on the last step of every episode.
        lengths: ``[H]`` int64 number of recorded steps; later steps are padding (zeros).
        task_ids: ``[H]`` int64 task of each history (see :mod:`icrl_models.envs.splits`).
        action_sets: ``[H, A]`` int16 action ids available in each history, padded with -1.
        task_params: per-history task description, ``name -> [H, ...]`` (goal cells, arm means, ...).
        metadata: JSON-serialisable description: env, generator and their settings, seed, split, ...
    """

    states: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    lengths: np.ndarray
    task_ids: np.ndarray
    action_sets: np.ndarray
    task_params: dict[str, np.ndarray]
    metadata: dict[str, Any]

    @property
    def num_histories(self) -> int:
        return int(self.actions.shape[0])

    @property
    def max_length(self) -> int:
        return int(self.actions.shape[1])

    @property
    def num_transitions(self) -> int:
        return int(np.sum(self.lengths))

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array, task parameters under ``task/<name>``."""
        arrays = {name: getattr(self, name) for name in ARRAY_FIELDS}
        arrays.update({f"task/{name}": value for name, value in self.task_params.items()})
        return arrays

    def episode_returns(self) -> np.ndarray:
        """``[H, E]`` float64 return of every episode of every history, NaN after a history's last episode."""
        done = np.asarray(self.dones, dtype=bool)
        episode_of_step = np.cumsum(done, axis=1) - done  # episode index of each step
        valid = np.arange(self.max_length)[None, :] < np.asarray(self.lengths)[:, None]
        num_episodes = done.sum(axis=1)
        returns = np.zeros((self.num_histories, max(int(num_episodes.max(initial=0)), 1)))
        rows = np.broadcast_to(np.arange(self.num_histories)[:, None], done.shape)
        complete = valid & (episode_of_step < num_episodes[:, None])
        np.add.at(returns, (rows[complete], episode_of_step[complete]), np.asarray(self.rewards)[complete])
        returns[np.arange(returns.shape[1])[None, :] >= num_episodes[:, None]] = np.nan
        return returns

    def subset(self, indices) -> LearningHistories:
        """The histories ``indices`` (a copy), with the same metadata.

        ``indices``: 1-D integer history indices in ``[0, num_histories)`` (repeats allowed); others raise
        ``TypeError``/``ValueError`` naming ``indices``."""
        indices = as_index_array(indices, "indices", low=0, high=self.num_histories)
        if indices.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
        return dataclasses.replace(
            self,
            **{name: np.asarray(getattr(self, name))[indices] for name in ARRAY_FIELDS},
            task_params={name: np.asarray(value)[indices] for name, value in self.task_params.items()},
        )

    def validate(self) -> None:
        """Check shapes, dtypes, value ranges and metadata; raise :class:`DatasetError` naming the problem."""
        _validate(self)


def _fail(message: str) -> None:
    raise DatasetError(message)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _validate_metadata(meta: Any) -> None:
    """The metadata fields validation and loaders read, with their types (a header written by hand or by
    another tool could hold ``"num_actions": "5"``, which would otherwise fail as a bare ``int()`` error)."""
    if not isinstance(meta, dict):
        _fail(f"metadata must be a dict, got {type(meta).__name__}")
    missing = [key for key in REQUIRED_METADATA if key not in meta]
    if missing:
        _fail(f"metadata lacks {missing}")
    if meta["format_version"] != FORMAT_VERSION:
        _fail(f"format_version {meta['format_version']!r} is not supported (this library reads {FORMAT_VERSION})")
    env = meta["env"]
    if not isinstance(env, dict):
        _fail(f"metadata['env'] must be a dict, got {type(env).__name__}")
    missing = [key for key in REQUIRED_ENV_METADATA if key not in env]
    if missing:
        _fail(f"metadata['env'] lacks {missing}")
    if not isinstance(env["name"], str):
        _fail(f"metadata['env']['name'] must be a string, got {env['name']!r}")
    if not isinstance(env["config"], dict):
        _fail(f"metadata['env']['config'] must be a dict, got {env['config']!r}")
    for key, low in (("num_actions", 1), ("num_observations", 0), ("observation_dim", 0)):
        if not _is_int(env[key]) or env[key] < low:
            _fail(f"metadata['env'][{key!r}] must be an int >= {low}, got {env[key]!r}")
    reward_range = env["reward_range"]
    if (
        not isinstance(reward_range, (list, tuple))
        or len(reward_range) != 2
        or not all(_is_real(v) for v in reward_range)
        or not reward_range[0] <= reward_range[1]
    ):
        _fail(f"metadata['env']['reward_range'] must be [low, high] numbers with low <= high, got {reward_range!r}")
    generator = meta["generator"]
    if not isinstance(generator, dict) or not isinstance(generator.get("name"), str):
        _fail(f"metadata['generator'] must be a dict with a string 'name', got {generator!r}")
    if not isinstance(generator.get("config", {}), dict):
        _fail(f"metadata['generator']['config'] must be a dict, got {generator['config']!r}")
    if not _is_int(meta["num_episodes"]) or meta["num_episodes"] < 1:
        _fail(f"metadata['num_episodes'] must be an int >= 1, got {meta['num_episodes']!r}")
    if meta["split"] is not None and not isinstance(meta["split"], str):
        _fail(f"metadata['split'] must be a string or null, got {meta['split']!r}")


def _validate(histories: LearningHistories) -> None:
    meta = histories.metadata
    _validate_metadata(meta)
    env = meta["env"]

    actions = histories.actions
    if actions.ndim != 2:
        _fail(f"actions must be [H, T], got shape {actions.shape}")
    num_histories, length = actions.shape
    obs_dim = int(env["observation_dim"])
    state_shape = (num_histories, length, obs_dim) if obs_dim else (num_histories, length)
    expected_shapes = {
        "states": state_shape,
        "rewards": (num_histories, length),
        "dones": (num_histories, length),
        "lengths": (num_histories,),
        "task_ids": (num_histories,),
    }
    for name, shape in expected_shapes.items():
        if getattr(histories, name).shape != shape:
            _fail(f"{name} must have shape {shape}, got {getattr(histories, name).shape}")
    sets = histories.action_sets
    if sets.ndim != 2 or sets.shape[0] != num_histories or sets.shape[1] == 0:
        _fail(f"action_sets must be [{num_histories}, A] with A >= 1, got shape {sets.shape}")
    if "optimal_return" not in histories.task_params:
        _fail("task_params lacks 'optimal_return' (each history's optimal return, for normalised scores)")
    for name, value in histories.task_params.items():
        if value.shape[:1] != (num_histories,):
            _fail(f"task/{name} must have {num_histories} rows, got shape {value.shape}")

    expected_kinds = {
        "states": "f" if obs_dim else "iu",
        "actions": "iu",
        "rewards": "f",
        "dones": "b",
        "lengths": "iu",
        "task_ids": "iu",
        "action_sets": "iu",
    }
    for name, kinds in expected_kinds.items():
        if getattr(histories, name).dtype.kind not in kinds:
            _fail(f"{name} has dtype {getattr(histories, name).dtype}, expected kind {kinds!r}")

    lengths = np.asarray(histories.lengths)
    if lengths.size and (lengths.min() < 1 or lengths.max() > length):
        _fail(f"lengths must lie in [1, {length}], got [{lengths.min()}, {lengths.max()}]")
    num_actions = int(env["num_actions"])
    if sets.min() < -1 or sets.max() >= num_actions:
        _fail(f"action_sets must hold ids in [0, {num_actions}) or -1 padding")
    if np.any(sets[:, 0] < 0):
        _fail("every history needs at least one available action (its action_sets row is all padding)")

    # Contents, a block of histories at a time so that temporaries stay small for huge datasets.
    rows_per_block = max(1, _VALIDATION_BLOCK_ELEMENTS // max(length, 1))
    for first in range(0, num_histories, rows_per_block):
        rows = slice(first, min(first + rows_per_block, num_histories))
        _validate_block(histories, rows, first, env, int(meta["num_episodes"]))


#: Elements per array handled at once by validation (bounds its temporary memory).
_VALIDATION_BLOCK_ELEMENTS = 1 << 22


def _validate_block(histories: LearningHistories, rows: slice, first: int, env: dict, num_episodes: int) -> None:
    lengths = np.asarray(histories.lengths[rows])
    length = histories.max_length
    valid = np.arange(length)[None, :] < lengths[:, None]
    sets = np.asarray(histories.action_sets[rows])
    num_actions = int(env["num_actions"])

    available = np.zeros((sets.shape[0], num_actions + 1), dtype=bool)
    available[np.arange(sets.shape[0])[:, None], np.where(sets >= 0, sets, num_actions)] = True
    actions = np.asarray(histories.actions[rows])
    action_ids = np.where(valid, actions, 0).astype(np.int64)
    if action_ids.min() < 0 or action_ids.max() >= num_actions:
        _fail(f"actions must lie in [0, {num_actions}), got [{action_ids.min()}, {action_ids.max()}]")
    allowed = np.take_along_axis(available, action_ids, axis=1) | ~valid
    if not allowed.all():
        row, step = np.argwhere(~allowed)[0]
        _fail(f"history {first + row} step {step}: action {actions[row, step]} is not in its action set")

    states = np.asarray(histories.states[rows])
    if int(env["observation_dim"]):
        if not np.isfinite(states[valid]).all():
            _fail("states hold NaN or infinite values")
    else:
        num_obs = int(env["num_observations"])
        observed = states[valid]
        if observed.size and (observed.min() < 0 or observed.max() >= num_obs):
            _fail(f"states must lie in [0, {num_obs}), got [{observed.min()}, {observed.max()}]")

    rewards = np.asarray(histories.rewards[rows])[valid]
    low, high = (float(v) for v in env["reward_range"])
    if not np.isfinite(rewards).all():
        _fail("rewards hold NaN or infinite values")
    if rewards.size and (rewards.min() < low or rewards.max() > high):
        _fail(f"rewards must lie in [{low}, {high}], got [{rewards.min()}, {rewards.max()}]")

    dones = np.asarray(histories.dones[rows])
    if np.any(dones & ~valid):
        _fail("dones marks a step past a history's length")
    last = dones[np.arange(dones.shape[0]), lengths - 1]
    if not last.all():
        _fail(f"history {first + int(np.argmin(last))} does not end with a finished episode (dones at its last step)")
    episodes = dones.sum(axis=1)
    if np.any(episodes != num_episodes):
        _fail(f"every history must hold num_episodes={num_episodes} episodes, found {np.unique(episodes).tolist()}")
