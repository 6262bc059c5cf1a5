"""Dark Key-to-Door (Laskin et al., 2022; the N-gram AD paper, Appendix C).

A ``size x size`` grid with an invisible key cell and an invisible door cell (they may coincide: 81 x
81 = 6561 tasks, task id ``key * size**2 + door``). Every episode starts on a uniformly random cell.
The first step that ends on the key gives +1 and the agent holds the key; a step that ends on the door
while holding the key (the key may be picked up on that same step) gives +1 and terminates the episode.
The agent observes only its cell id. Episodes are truncated after ``episode_length`` steps: 50 in the
original AD setup (the default), 40 in the N-gram paper's appendix.
"""

from __future__ import annotations

import numpy as np

from .base import BatchedEnv, as_index_array, check_positive_int
from .grid import NUM_MOVES, greedy_moves, manhattan, move_table


class KeyToDoor(BatchedEnv):
    """Batched Key-to-Door.

    Args:
        keys, doors: ``[N]`` cell ids of each environment's key and door.
        size: grid side.
        episode_length: maximum steps per episode.
        seed: seeds the random start cells.
    """

    name = "key_to_door"
    success_return = 2.0  # the key, then the door
    reward_range = (0.0, 2.0)

    def __init__(self, keys, doors, *, size: int = 9, episode_length: int = 50, seed: int | None = None) -> None:
        self.size = check_positive_int(size, "size")
        cells = self.size**2
        keys = as_index_array(keys, "keys", low=0, high=cells)
        if keys.ndim != 1 or keys.size == 0:
            raise ValueError(f"keys must be a non-empty 1-D array of cell ids, got shape {keys.shape}")
        doors = as_index_array(doors, "doors", low=0, high=cells, shape=keys.shape)
        super().__init__(keys.size, NUM_MOVES, episode_length, seed)
        self.keys, self.doors = keys, doors
        self.num_observations = cells
        self.num_learner_states = 2 * cells
        self.positions = np.zeros(self.num_envs, dtype=np.int64)
        self.has_key = np.zeros(self.num_envs, dtype=bool)
        self._moves = move_table(self.size)

    @classmethod
    def from_task_ids(cls, task_ids, **kwargs) -> KeyToDoor:
        size = kwargs.get("size", 9)
        keys, doors = np.divmod(as_index_array(task_ids, "task_ids", low=0, high=size**4), size**2)
        return cls(keys, doors, **kwargs)

    def _reset(self, env_ids: np.ndarray) -> None:
        self.positions[env_ids] = self.rng.integers(0, self.size**2, size=env_ids.size)
        self.has_key[env_ids] = False

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.positions = self._moves[self.positions, actions]
        picked_key = ~self.has_key & (self.positions == self.keys)
        self.has_key |= picked_key
        opened = self.has_key & (self.positions == self.doors)
        return picked_key.astype(np.float32) + opened.astype(np.float32), opened

    def observations(self) -> np.ndarray:
        return self.positions.copy()

    def learner_states(self) -> np.ndarray:
        return self.positions + self.num_observations * self.has_key

    def optimal_returns_from(self, starts) -> np.ndarray:
        """``[N]`` optimal return of an episode that starts on ``starts`` (``[N]`` cells).

        The key takes ``max(1, d(start, key))`` steps (standing on it still takes one step to collect),
        the door ``d(key, door)`` more; each reward counts if reached within the time limit.
        """
        starts = as_index_array(starts, "starts", low=0, high=self.size**2, shape=(self.num_envs,))
        key_step = np.maximum(1, manhattan(starts, self.keys, self.size))
        door_step = key_step + manhattan(self.keys, self.doors, self.size)
        return (key_step <= self.episode_length).astype(np.float64) + (door_step <= self.episode_length)

    def optimal_returns(self) -> np.ndarray:
        """Expected optimal return over the uniformly random start cell."""
        total = np.zeros(self.num_envs)
        for start in range(self.size**2):
            total += self.optimal_returns_from(np.full(self.num_envs, start))
        return total / self.size**2

    def optimal_actions(self) -> np.ndarray:
        return greedy_moves(self.positions, np.where(self.has_key, self.doors, self.keys), self.size)

    def task_ids(self) -> np.ndarray:
        return self.keys * self.size**2 + self.doors

    def task_params(self) -> dict[str, np.ndarray]:
        return {"key": self.keys.copy(), "door": self.doors.copy()}

    def config(self) -> dict:
        return {"size": self.size, "episode_length": self.episode_length}
