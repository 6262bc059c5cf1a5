"""Square-grid geometry shared by Dark Room, Key-to-Door and the composite-action Darkroom.

Cells are numbered row-major: ``cell = row * size + col``, row 0 at the top. The five atomic moves, in
action-id order, are ``noop, up, right, down, left``; a move into a wall leaves the agent in place.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .base import BatchedEnv, as_index_array, check_positive_int

MOVE_NAMES = ("noop", "up", "right", "down", "left")
#: (row, col) offset of each atomic move, in action-id order.
MOVE_OFFSETS = np.array([[0, 0], [-1, 0], [0, 1], [1, 0], [0, -1]], dtype=np.int64)
NUM_MOVES = len(MOVE_NAMES)


def centre_cell(size: int) -> int:
    return (size // 2) * size + size // 2


@lru_cache(maxsize=8)
def move_table(size: int) -> np.ndarray:
    """``[size*size, 5]`` int64: the cell reached from each cell by each atomic move (walls clip)."""
    rows, cols = np.divmod(np.arange(size * size), size)
    new_rows = np.clip(rows[:, None] + MOVE_OFFSETS[None, :, 0], 0, size - 1)
    new_cols = np.clip(cols[:, None] + MOVE_OFFSETS[None, :, 1], 0, size - 1)
    table = new_rows * size + new_cols
    table.setflags(write=False)
    return table


def manhattan(cells_a: np.ndarray, cells_b: np.ndarray, size: int) -> np.ndarray:
    """Grid (L1) distance between cells; the number of atomic moves from one to the other."""
    row_a, col_a = np.divmod(np.asarray(cells_a), size)
    row_b, col_b = np.divmod(np.asarray(cells_b), size)
    return np.abs(row_a - row_b) + np.abs(col_a - col_b)


def greedy_moves(cells: np.ndarray, targets: np.ndarray, size: int) -> np.ndarray:
    """An atomic move that brings each cell one step closer to its target (vertical first), noop on it."""
    row, col = np.divmod(np.asarray(cells), size)
    target_row, target_col = np.divmod(np.asarray(targets), size)
    moves = np.zeros(np.broadcast(row, target_row).shape, dtype=np.int64)
    moves = np.where(col < target_col, 2, moves)
    moves = np.where(col > target_col, 4, moves)
    moves = np.where(row < target_row, 3, moves)
    moves = np.where(row > target_row, 1, moves)
    return moves


class GoalGridEnv(BatchedEnv):
    """Shared by Dark Room and the composite Darkroom: a ``size x size`` grid, every episode starting at
    the centre cell, one invisible goal cell per environment (the task id), the cell id observed."""

    def __init__(self, goals, num_actions: int, *, size: int, episode_length: int, seed) -> None:
        self.size = check_positive_int(size, "size")
        goals = as_index_array(goals, "goals", low=0, high=self.size**2)
        if goals.ndim != 1 or goals.size == 0:
            raise ValueError(f"goals must be a non-empty 1-D array of cell ids, got shape {goals.shape}")
        super().__init__(goals.size, num_actions, episode_length, seed)
        self.goals = goals
        self.num_observations = self.size**2
        self.num_learner_states = self.num_observations
        self.positions = np.full(self.num_envs, centre_cell(self.size), dtype=np.int64)

    def _reset(self, env_ids: np.ndarray) -> None:
        self.positions[env_ids] = centre_cell(self.size)

    def observations(self) -> np.ndarray:
        return self.positions.copy()

    def task_ids(self) -> np.ndarray:
        return self.goals.copy()

    def task_params(self) -> dict[str, np.ndarray]:
        return {"goal": self.goals.copy()}

    def config(self) -> dict:
        return {"size": self.size, "episode_length": self.episode_length}
