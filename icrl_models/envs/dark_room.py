"""Dark Room (Laskin et al., 2022; the N-gram AD paper, Appendix C).

A ``size x size`` grid (9 x 9), five actions (noop, up, right, down, left), the agent starts every
episode at the centre cell and observes only its own cell id (81 observations). The goal cell is
invisible: the reward is 1 on every step that *ends* on the goal, 0 otherwise. Episodes never
terminate; they are truncated after ``episode_length`` (20) steps. There are ``size**2`` tasks, one
per goal cell; the task id is the goal's cell id.
"""

from __future__ import annotations

import numpy as np

from .base import BatchedEnv, as_index_array, check_positive_int
from .grid import NUM_MOVES, centre_cell, greedy_moves, manhattan, move_table


class DarkRoom(BatchedEnv):
    """Batched Dark Room.

    Args:
        goals: ``[N]`` goal cell ids in ``[0, size**2)``, one per environment.
        size: grid side.
        episode_length: steps per episode.
        seed: seeds the environment's generator (Dark Room itself is deterministic).
    """

    name = "dark_room"

    def __init__(self, goals, *, size: int = 9, episode_length: int = 20, seed: int | None = None) -> None:
        self.size = check_positive_int(size, "size")
        goals = as_index_array(goals, "goals", low=0, high=self.size**2)
        if goals.ndim != 1 or goals.size == 0:
            raise ValueError(f"goals must be a non-empty 1-D array of cell ids, got shape {goals.shape}")
        super().__init__(goals.size, NUM_MOVES, episode_length, seed)
        self.goals = goals
        self.num_observations = self.size**2
        self.num_learner_states = self.num_observations
        self.positions = np.full(self.num_envs, centre_cell(self.size), dtype=np.int64)
        self._moves = move_table(self.size)

    def _reset(self, env_ids: np.ndarray) -> None:
        self.positions[env_ids] = centre_cell(self.size)

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.positions = self._moves[self.positions, actions]
        return (self.positions == self.goals).astype(np.float32), np.zeros(self.num_envs, dtype=bool)

    def observations(self) -> np.ndarray:
        return self.positions.copy()

    def optimal_returns(self) -> np.ndarray:
        """Walk straight to the goal (d moves), then stay: ``T - d + 1`` rewarded steps, ``T`` if d = 0."""
        distance = manhattan(centre_cell(self.size), self.goals, self.size)
        steps_on_goal = np.where(distance == 0, self.episode_length, self.episode_length - distance + 1)
        return np.maximum(steps_on_goal, 0).astype(np.float64)

    def optimal_actions(self) -> np.ndarray:
        return greedy_moves(self.positions, self.goals, self.size)

    def task_ids(self) -> np.ndarray:
        return self.goals.copy()

    def task_params(self) -> dict[str, np.ndarray]:
        return {"goal": self.goals.copy()}

    def config(self) -> dict:
        return {"size": self.size, "episode_length": self.episode_length}
