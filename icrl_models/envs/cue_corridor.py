"""Cue Corridor (a T-maze): a memory task whose memory need is one number, the corridor's length.

Every episode starts at the corridor's first cell with a random cue, left or right, drawn anew for each
episode. The agent walks ``corridor_length`` cells to a junction and turns into one of two dead ends; the
episode terminates there with reward 1 if the turn matches the cue, else 0 (it is truncated with 0 after
``episode_length`` steps). The cue is part of the observation only on the first ``cue_steps`` steps of an
episode; afterwards the observation is the cell alone. So:

* ``cue_steps=None`` (always shown): the observation alone determines an optimal action, a short-term task;
* ``cue_steps=1``: at the junction the agent must recall a cue seen ``corridor_length`` steps earlier, and
  nothing in between (cells, rewards, returns-to-go) carries it: the memory need is the corridor's length.

This is the long-term task of the Markov-head experiment (``icrl-markov``): unlike Key-to-Door, a Decision
Transformer's return-to-go does not change on the way, so it cannot stand in for memory.

Layout: cells ``0 .. C`` are the corridor (``C = corridor_length``, the junction is ``C``), ``C + 1`` the left
end, ``C + 2`` the right end. Actions: ``0`` forward, ``1`` left, ``2`` right; a turn in the corridor and
a forward move at the junction leave the agent in place. Observation ids: ``cell + (C + 3) * symbol`` with
``symbol`` 0 (no cue shown), 1 (cue left) or 2 (cue right): ``3 * (C + 3)`` observations, split with
``divmod(observation, C + 3)`` (:attr:`CueCorridor.observation_parts`).
"""

from __future__ import annotations

import numpy as np

from .base import BatchedEnv, check_positive_int

FORWARD, LEFT, RIGHT = 0, 1, 2


class CueCorridor(BatchedEnv):
    """Batched Cue Corridor (see the module docstring).

    Args:
        num_envs: environments stepped together (they share the layout; each episode draws its own cue).
        corridor_length: cells from the start to the junction, ``C >= 1``: the memory need in steps.
        cue_steps: steps at the start of each episode on which the cue is observed; ``None``: every step.
        episode_length: time limit (default ``C + 4``: the optimal path takes ``C + 1`` steps).
        seed: seeds the cue draws.
    """

    name = "cue_corridor"

    def __init__(
        self,
        num_envs: int,
        *,
        corridor_length: int = 4,
        cue_steps: int | None = 1,
        episode_length: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.corridor_length = check_positive_int(corridor_length, "corridor_length")
        self.cue_steps = None if cue_steps is None else check_positive_int(cue_steps, "cue_steps")
        length = self.corridor_length + 4 if episode_length is None else episode_length
        super().__init__(num_envs, 3, length, seed)
        if self.episode_length < self.corridor_length + 1:
            raise ValueError(
                f"episode_length must be >= corridor_length + 1 = {self.corridor_length + 1} (the shortest "
                f"path), got {self.episode_length}"
            )
        self.num_cells = self.corridor_length + 3
        self.num_observations = 3 * self.num_cells
        self.num_learner_states = self.num_observations
        self.positions = np.zeros(self.num_envs, dtype=np.int64)
        self.cues = np.zeros(self.num_envs, dtype=np.int64)  # 0: left, 1: right

    @property
    def observation_parts(self) -> tuple[int, int]:
        """Radices of the packed observation, least significant first: ``(cells, cue symbols)``."""
        return (self.num_cells, 3)

    def _reset(self, env_ids: np.ndarray) -> None:
        self.positions[env_ids] = 0
        self.cues[env_ids] = self.rng.integers(0, 2, size=env_ids.size)

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        junction = self.corridor_length
        in_corridor = self.positions < junction
        self.positions = np.where(in_corridor & (actions == FORWARD), self.positions + 1, self.positions)
        at_junction = (~in_corridor) & (actions != FORWARD)
        self.positions = np.where(at_junction, junction + actions, self.positions)  # LEFT -> C+1, RIGHT -> C+2
        terminated = self.positions > junction
        rewards = terminated & (self.positions - junction - 1 == self.cues)
        return rewards.astype(np.float32), terminated

    def observations(self) -> np.ndarray:
        shown = np.ones(self.num_envs, dtype=bool) if self.cue_steps is None else self.elapsed_steps < self.cue_steps
        return self.positions + self.num_cells * np.where(shown, 1 + self.cues, 0)

    def optimal_actions(self) -> np.ndarray:
        return np.where(self.positions < self.corridor_length, FORWARD, LEFT + self.cues)

    def optimal_returns(self) -> np.ndarray:
        return np.ones(self.num_envs, dtype=np.float64)

    def task_ids(self) -> np.ndarray:
        return np.zeros(self.num_envs, dtype=np.int64)  # one layout; the cue is drawn per episode

    def task_params(self) -> dict[str, np.ndarray]:
        return {"corridor_length": np.full(self.num_envs, self.corridor_length, dtype=np.int64)}

    def config(self) -> dict:
        return {
            "corridor_length": self.corridor_length,
            "cue_steps": self.cue_steps,
            "episode_length": self.episode_length,
        }
