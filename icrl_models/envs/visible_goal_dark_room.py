"""Dark Room with the goal in the observation: a short-term (Markov) control task.

The dynamics, rewards and tasks are exactly :class:`~icrl_models.envs.DarkRoom`'s (``size x size``
grid, start at the centre, reward 1 on every step that ends on the goal, no termination, truncated
after ``episode_length`` steps); only the observation differs. It is the pair ``(cell, goal)``
packed into one id, ``observation = cell + size**2 * goal`` (``size**4`` observations), so the
current observation alone determines an optimal action: no memory is needed. This is the short-term
counterpart of hidden-goal Dark Room and Key-to-Door in the Markov-head experiment
(:mod:`icrl_models.experiments.markov_heads`). Models that embed the two parts separately split the id with
``divmod(observation, size**2)`` (:attr:`VisibleGoalDarkRoom.observation_parts`).
"""

from __future__ import annotations

import numpy as np

from .dark_room import DarkRoom


class VisibleGoalDarkRoom(DarkRoom):
    """Batched Dark Room whose observation also names the goal cell (see the module docstring).

    Args:
        goals: ``[N]`` goal cell ids in ``[0, size**2)``, one per environment.
        size: grid side.
        episode_length: steps per episode.
        seed: seeds the environment's generator (the environment itself is deterministic).
    """

    name = "dark_room_visible_goal"

    def __init__(self, goals, *, size: int = 9, episode_length: int = 20, seed: int | None = None) -> None:
        super().__init__(goals, size=size, episode_length=episode_length, seed=seed)
        self.num_observations = self.size**4
        # A tabular learner needs only the cell: the goal is fixed within each environment.
        self.num_learner_states = self.size**2

    @property
    def observation_parts(self) -> tuple[int, int]:
        """Radices of the packed observation, least significant first: ``(cells, goals)``."""
        return (self.size**2, self.size**2)

    def observations(self) -> np.ndarray:
        return self.positions + self.size**2 * self.goals

    def learner_states(self) -> np.ndarray:
        return self.positions.copy()
