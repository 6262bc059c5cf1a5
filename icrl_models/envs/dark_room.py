"""Dark Room (Laskin et al., 2022; the N-gram AD paper, Appendix C).

A ``size x size`` grid (9 x 9), five actions (noop, up, right, down, left), the agent starts every
episode at the centre cell and observes only its own cell id (81 observations). The goal cell is
invisible: the reward is 1 on every step that *ends* on the goal, 0 otherwise. Episodes never
terminate; they are truncated after ``episode_length`` (20) steps. There are ``size**2`` tasks, one
per goal cell; the task id is the goal's cell id.
"""

from __future__ import annotations

import numpy as np

from .grid import NUM_MOVES, GoalGridEnv, centre_cell, greedy_moves, manhattan, move_table


class DarkRoom(GoalGridEnv):
    """Batched Dark Room.

    Args:
        goals: ``[N]`` goal cell ids in ``[0, size**2)``, one per environment.
        size: grid side.
        episode_length: steps per episode.
        seed: seeds the environment's generator (Dark Room itself is deterministic).
    """

    name = "dark_room"

    def __init__(self, goals, *, size: int = 9, episode_length: int = 20, seed: int | None = None) -> None:
        super().__init__(goals, NUM_MOVES, size=size, episode_length=episode_length, seed=seed)
        self._moves = move_table(self.size)

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.positions = self._moves[self.positions, actions]
        return (self.positions == self.goals).astype(np.float32), np.zeros(self.num_envs, dtype=bool)

    def optimal_returns(self) -> np.ndarray:
        """Walk straight to the goal (d moves), then stay: ``T - d + 1`` rewarded steps, ``T`` if d = 0."""
        distance = manhattan(centre_cell(self.size), self.goals, self.size)
        steps_on_goal = np.where(distance == 0, self.episode_length, self.episode_length - distance + 1)
        return np.maximum(steps_on_goal, 0).astype(np.float64)

    def optimal_actions(self) -> np.ndarray:
        return greedy_moves(self.positions, self.goals, self.size)
