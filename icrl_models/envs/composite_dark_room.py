"""Darkroom with 125 composite actions (Headless-AD, Section 4.3).

A 9 x 9 grid; the agent starts at the centre and observes its cell id. Every action is a sequence of
three atomic moves (noop, up, right, down, left), so there are ``5**3 = 125`` actions; action id
``a`` applies the moves ``a // 25``, ``(a // 5) % 5`` and ``a % 5`` in that order (base-5 digits, most
significant first). The reward is 1, and the episode terminates, when any of the three sub-steps
lands on the (invisible) goal; episodes are truncated after 20 steps. Only a chosen *action set* is
available in an environment: see :func:`composite_action_sets` for the five sets of the paper.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .base import as_index_array
from .grid import MOVE_NAMES, NUM_MOVES, GoalGridEnv, centre_cell, move_table

MOVES_PER_ACTION = 3
NUM_COMPOSITE_ACTIONS = NUM_MOVES**MOVES_PER_ACTION
ACTION_SET_NAMES = ("train", "permuted_train", "sliced_test", "test", "all")
NUM_TRAIN_ACTIONS = 50


def action_moves(actions) -> np.ndarray:
    """``[..., 3]`` atomic move ids of composite action ids ``[...]`` (integers in ``[0, 125)``)."""
    actions = as_index_array(actions, "actions", low=0, high=NUM_COMPOSITE_ACTIONS)
    return np.stack([actions // NUM_MOVES**2, (actions // NUM_MOVES) % NUM_MOVES, actions % NUM_MOVES], axis=-1)


def action_name(action: int) -> str:
    """``"up-up-right"`` for a composite action id."""
    from icrl_kernels.validation import check_int  # here: the environments import without torch (_checks.py)

    action = check_int(action, "action", min_value=0, max_value=NUM_COMPOSITE_ACTIONS - 1)
    return "-".join(MOVE_NAMES[m] for m in action_moves(action))


@lru_cache(maxsize=8)
def composite_paths(size: int) -> np.ndarray:
    """``[size*size, 125, 3]`` int64: the cell after each sub-step of each composite action."""
    moves = move_table(size)
    atomic = action_moves(np.arange(NUM_COMPOSITE_ACTIONS))
    paths = np.empty((size * size, NUM_COMPOSITE_ACTIONS, MOVES_PER_ACTION), dtype=np.int64)
    cells = np.broadcast_to(np.arange(size * size)[:, None], (size * size, NUM_COMPOSITE_ACTIONS))
    for sub_step in range(MOVES_PER_ACTION):
        cells = moves[cells, atomic[None, :, sub_step]]
        paths[:, :, sub_step] = cells
    paths.setflags(write=False)
    return paths


def composite_action_sets(seed: int = 0) -> dict[str, np.ndarray]:
    """The five action sets of Headless-AD's Darkroom, from a seeded random 50 / 75 split of the 125.

    * ``train``: the 50 training actions; ``permuted_train``: the same actions in a shuffled order;
    * ``test``: the other 75; ``sliced_test``: the first 50 of ``test`` (the training set's size);
    * ``all``: ``train`` followed by ``test`` (125 actions).
    """
    from icrl_kernels.validation import check_int  # here: the environments import without torch (_checks.py)

    rng = np.random.default_rng([check_int(seed, "seed", min_value=0), 125])
    order = rng.permutation(NUM_COMPOSITE_ACTIONS)
    train, test = order[:NUM_TRAIN_ACTIONS], order[NUM_TRAIN_ACTIONS:]
    return {
        "train": train,
        "permuted_train": rng.permutation(train),
        "sliced_test": test[:NUM_TRAIN_ACTIONS],
        "test": test,
        "all": np.concatenate([train, test]),
    }


class CompositeDarkRoom(GoalGridEnv):
    """Batched composite-action Darkroom.

    Args:
        goals: ``[N]`` goal cell ids.
        action_set: the available composite action ids, ``[A]`` shared by all environments or
            ``[N, A]`` per environment; default all 125. Actions are always given as global ids.
        size: grid side.
        episode_length: maximum steps per episode.
        seed: seeds the environment's generator (the dynamics are deterministic).
    """

    name = "dark_room_composite"

    def __init__(
        self, goals, *, action_set=None, size: int = 9, episode_length: int = 20, seed: int | None = None
    ) -> None:
        super().__init__(goals, NUM_COMPOSITE_ACTIONS, size=size, episode_length=episode_length, seed=seed)
        if action_set is None:
            action_set = np.arange(NUM_COMPOSITE_ACTIONS)
        action_set = as_index_array(action_set, "action_set", low=0, high=NUM_COMPOSITE_ACTIONS)
        if action_set.ndim == 1:
            action_set = np.broadcast_to(action_set, (self.num_envs, action_set.size))
        if action_set.ndim != 2 or action_set.shape[0] != self.num_envs or action_set.shape[1] == 0:
            raise ValueError(f"action_set must be [A] or [num_envs, A] with A >= 1, got shape {action_set.shape}")
        if any(np.unique(row).size != row.size for row in action_set):
            raise ValueError("action_set must not repeat an action")
        self.action_set = np.ascontiguousarray(action_set)
        self._available = np.zeros((self.num_envs, NUM_COMPOSITE_ACTIONS), dtype=bool)
        self._available[np.arange(self.num_envs)[:, None], self.action_set] = True
        self._paths = composite_paths(self.size)
        self._tables: tuple[np.ndarray, np.ndarray] | None = None

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        path = self._paths[self.positions, actions]  # [N, 3]
        reached = (path == self.goals[:, None]).any(axis=1)
        self.positions = path[:, -1]
        return reached.astype(np.float32), reached

    def action_sets(self) -> np.ndarray:
        return self.action_set.copy()

    def _goal_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Cached ``(hits [N, cells, 125] bool, steps [N, cells] int64)``: which available actions cross
        the goal from each cell, and the fewest actions from each cell to the goal
        (``episode_length + 1`` where it cannot be reached within an episode)."""
        if self._tables is None:
            hits = (self._paths[None] == self.goals[:, None, None, None]).any(axis=3) & self._available[:, None, :]
            unreachable = self.episode_length + 1
            ends = self._paths[:, :, -1]  # [cells, 125]
            steps = np.where(hits.any(axis=2), 1, unreachable)
            for _ in range(self.episode_length):  # Bellman iterations: exact up to episode_length
                via_move = 1 + np.where(self._available[:, None, :], steps[:, ends], unreachable).min(axis=2)
                steps = np.minimum(steps, np.minimum(via_move, unreachable))
            self._tables = (hits, steps)
        return self._tables

    def steps_to_goal(self) -> np.ndarray:
        """``[N, size*size]``: fewest actions of the environment's action set that reach the goal from each
        cell; ``episode_length + 1`` where it cannot be reached within an episode."""
        return self._goal_tables()[1].copy()

    def optimal_returns(self) -> np.ndarray:
        """1 when the goal is reachable from the centre within an episode with the action set, else 0."""
        steps = self._goal_tables()[1][:, centre_cell(self.size)]
        return (steps <= self.episode_length).astype(np.float64)

    def optimal_actions(self) -> np.ndarray:
        hits, steps = self._goal_tables()
        rows = np.arange(self.num_envs)
        remaining = steps[rows[:, None], self._paths[self.positions, :, -1]]  # [N, 125] after each action
        remaining = np.where(hits[rows, self.positions], 0, remaining)
        return np.where(self._available, remaining, np.iinfo(np.int64).max).argmin(axis=1)
