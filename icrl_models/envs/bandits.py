"""Bernoulli and contextual multi-armed bandits (Headless-AD, Sections 4.1-4.2 and Appendix A).

A bandit history is a single episode of ``episode_length`` (300) pulls. The number of arms may differ
between environments of one batch: arms are padded to the batch's largest count and
:meth:`~icrl_models.envs.base.BatchedEnv.action_mask` marks the real ones. Arm indices are 0-based;
"odd arms" are those with an odd index.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_finite, check_float
from .base import BatchedEnv, as_index_array, check_positive_int

BERNOULLI_DISTRIBUTIONS = ("train", "mirrored", "uniform")
#: Probability that a ``train`` bandit has its high means on the even arms instead of the odd ones.
TRAIN_MIRRORED_FRACTION = 0.05


def _arm_counts(rng: np.random.Generator, num_bandits: int, num_arms) -> np.ndarray:
    """``[num_bandits]`` arm counts: a fixed int, or uniform over an inclusive ``(low, high)`` range."""
    if isinstance(num_arms, (int, np.integer)):
        low = high = check_positive_int(num_arms, "num_arms")
    elif isinstance(num_arms, (tuple, list)) and len(num_arms) == 2:
        low, high = (check_positive_int(v, "num_arms") for v in num_arms)
        if low > high:
            raise ValueError(f"num_arms range must have low <= high, got {num_arms}")
    else:
        raise TypeError(f"num_arms must be an int or an inclusive (low, high) pair of ints, got {num_arms!r}")
    return rng.integers(low, high + 1, size=num_bandits)


def _seed_words(seed) -> list[int]:
    """A task-distribution seed (a non-negative int, or a list of them) as the words of a seed sequence."""
    from icrl_kernels.validation import check_int  # here: the environments import without torch (_checks.py)

    if isinstance(seed, (list, tuple)):
        return [check_int(word, "seed", min_value=0) for word in seed]
    return [check_int(seed, "seed", min_value=0)]


def bernoulli_arm_means(
    num_bandits: int, *, distribution: str = "train", num_arms=(4, 20), seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Sample Bernoulli bandit tasks; returns ``(means [N, max_arms] float64, num_arms [N] int64)``.

    Distributions (docs/models.md#environments): ``train``: in 95% of bandits the odd arms have means U[0.5, 1] and the
    even arms U[0, 0.5], in 5% the reverse; ``mirrored``: always the reverse (the high means on the even
    arms); ``uniform``: every mean U[0, 1]. ``num_arms`` is a fixed count or an inclusive range.
    Padding means (past an environment's arm count) are 0.
    """
    if distribution not in BERNOULLI_DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {BERNOULLI_DISTRIBUTIONS}, got {distribution!r}")
    num_bandits = check_positive_int(num_bandits, "num_bandits")
    rng = np.random.default_rng([*_seed_words(seed), BERNOULLI_DISTRIBUTIONS.index(distribution)])
    counts = _arm_counts(rng, num_bandits, num_arms)
    width = int(counts.max())
    uniform = rng.random((num_bandits, width))
    if distribution == "uniform":
        means = uniform
    else:
        odd_high = np.full(num_bandits, distribution == "train")
        if distribution == "train":
            odd_high &= rng.random(num_bandits) >= TRAIN_MIRRORED_FRACTION
        is_odd = (np.arange(width) % 2 == 1)[None, :]
        high = is_odd == odd_high[:, None]
        means = np.where(high, 0.5 + 0.5 * uniform, 0.5 * uniform)
    means = np.where(np.arange(width)[None, :] < counts[:, None], means, 0.0)
    return means, counts.astype(np.int64)


def contextual_bandit_arms(
    num_bandits: int, *, num_arms=(4, 20), dim: int = 2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Sample contextual bandit tasks: arm features ~ N(0, I/dim) (the official code's scaling).

    Returns ``(arms [N, max_arms, dim] float64, num_arms [N] int64)``; padding arms are 0.
    """
    num_bandits = check_positive_int(num_bandits, "num_bandits")
    dim = check_positive_int(dim, "dim")
    rng = np.random.default_rng([*_seed_words(seed), 7])
    counts = _arm_counts(rng, num_bandits, num_arms)
    arms = rng.normal(0.0, 1.0 / np.sqrt(dim), size=(num_bandits, int(counts.max()), dim))
    arms *= (np.arange(arms.shape[1])[None, :] < counts[:, None])[:, :, None]
    return arms, counts.astype(np.int64)


class _ArmedBandit(BatchedEnv):
    """Shared arm bookkeeping: padded arms, the availability mask, task ids."""

    def __init__(self, num_arms, width: int, num_envs: int, episode_length: int, seed, task_ids) -> None:
        super().__init__(num_envs, width, episode_length, seed)
        if num_arms is None:
            num_arms = np.full(num_envs, width)
        self.num_arms = as_index_array(num_arms, "num_arms", low=1, high=width + 1, shape=(num_envs,))
        self._available = np.arange(width)[None, :] < self.num_arms[:, None]
        if task_ids is None:
            task_ids = np.arange(num_envs)
        self._task_ids = as_index_array(task_ids, "task_ids", low=0, high=np.iinfo(np.int64).max, shape=(num_envs,))

    def task_ids(self) -> np.ndarray:
        return self._task_ids.copy()

    def config(self) -> dict:
        return {"episode_length": self.episode_length}


class BernoulliBandit(_ArmedBandit):
    """Batched Bernoulli bandit: pulling arm ``a`` pays 1 with probability ``means[a]``.

    Args:
        means: ``[N, max_arms]`` arm means in [0, 1].
        num_arms: ``[N]`` arms per environment (default: all ``max_arms``).
        episode_length: pulls per history (300).
        seed: seeds the rewards.
        task_ids: ``[N]`` ids to record in datasets (default ``0..N-1``).
    """

    name = "bernoulli_bandit"
    num_observations = 1  # stateless: the observation is always id 0

    def __init__(self, means, num_arms=None, *, episode_length: int = 300, seed: int | None = None, task_ids=None):
        means = np.asarray(means, dtype=np.float64)
        if means.ndim != 2 or means.size == 0:
            raise ValueError(f"means must be a non-empty [num_envs, max_arms] array, got shape {means.shape}")
        if not np.all((means >= 0) & (means <= 1)):  # False for NaN too
            raise ValueError("means must lie in [0, 1] (and not be NaN)")
        super().__init__(num_arms, means.shape[1], means.shape[0], episode_length, seed, task_ids)
        self.means = means

    def _reset(self, env_ids: np.ndarray) -> None:
        pass

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pulled = self.means[self._all, actions]
        return (self.rng.random(self.num_envs) < pulled).astype(np.float32), np.zeros(self.num_envs, dtype=bool)

    def observations(self) -> np.ndarray:
        return np.zeros(self.num_envs, dtype=np.int64)

    def best_means(self) -> np.ndarray:
        """``[N]`` mean of the best arm."""
        return np.where(self._available, self.means, -np.inf).max(axis=1)

    def regret(self, actions) -> np.ndarray:
        """Expected regret of pulling ``actions`` (``[N]``, or ``[T, N]`` for T steps): best minus pulled mean."""
        actions = as_index_array(actions, "actions", low=0, high=self.num_actions)
        if actions.shape[-1:] != (self.num_envs,):
            raise ValueError(f"actions must have shape [..., {self.num_envs}], got {actions.shape}")
        steps = actions.reshape(-1, self.num_envs).T  # [N, T]
        if not np.take_along_axis(self._available, steps, axis=1).all():
            raise ValueError("actions include arms past an environment's num_arms")
        pulled = np.take_along_axis(self.means, steps, axis=1).T.reshape(actions.shape)
        return self.best_means() - pulled

    def optimal_returns(self) -> np.ndarray:
        return self.best_means() * self.episode_length

    def optimal_actions(self) -> np.ndarray:
        return np.where(self._available, self.means, -np.inf).argmax(axis=1)

    def task_params(self) -> dict[str, np.ndarray]:
        return {"means": self.means.copy(), "num_arms": self.num_arms.copy()}


class ContextualBandit(_ArmedBandit):
    """Batched linear contextual bandit: each step shows a context ``s ~ N(0, I/dim)``; pulling arm ``a``
    pays ``N(<arms[a], s>, noise_std**2)``.

    Args:
        arms: ``[N, max_arms, dim]`` arm features.
        num_arms: ``[N]`` arms per environment (default: all).
        noise_std: reward noise (1.0).
        episode_length: pulls per history (300).
        seed: seeds contexts and reward noise.
        task_ids: ``[N]`` ids to record in datasets (default ``0..N-1``).
    """

    name = "contextual_bandit"
    reward_range = (-np.inf, np.inf)

    def __init__(
        self,
        arms,
        num_arms=None,
        *,
        noise_std: float = 1.0,
        episode_length: int = 300,
        seed: int | None = None,
        task_ids=None,
    ):
        arms = np.asarray(arms, dtype=np.float64)
        if arms.ndim != 3 or arms.size == 0:
            raise ValueError(f"arms must be a non-empty [num_envs, max_arms, dim] array, got shape {arms.shape}")
        check_finite(arms, "arms")
        noise_std = check_float(noise_std, "noise_std", low=0.0)
        super().__init__(num_arms, arms.shape[1], arms.shape[0], episode_length, seed, task_ids)
        self.arms = arms
        self.noise_std = float(noise_std)
        self.observation_dim = arms.shape[2]
        self.contexts = np.zeros((self.num_envs, self.observation_dim))

    def _new_contexts(self, env_ids: np.ndarray) -> None:
        scale = 1.0 / np.sqrt(self.observation_dim)
        self.contexts[env_ids] = self.rng.normal(0.0, scale, size=(env_ids.size, self.observation_dim))

    def _reset(self, env_ids: np.ndarray) -> None:
        self._new_contexts(env_ids)

    def expected_rewards(self) -> np.ndarray:
        """``[N, max_arms]`` mean reward of every arm in the current context (padding arms: -inf)."""
        values = np.einsum("nad,nd->na", self.arms, self.contexts)
        return np.where(self._available, values, -np.inf)

    def _step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mean = self.expected_rewards()[self._all, actions]
        rewards = mean + self.noise_std * self.rng.standard_normal(self.num_envs)
        self._new_contexts(self._all)
        return rewards, np.zeros(self.num_envs, dtype=bool)

    def observations(self) -> np.ndarray:
        return self.contexts.astype(np.float32)

    def optimal_actions(self) -> np.ndarray:
        return self.expected_rewards().argmax(axis=1)

    def optimal_returns(self, num_samples: int = 4096, seed: int = 0) -> np.ndarray:
        """Monte-Carlo estimate (``num_samples`` contexts from a fixed seed) of the expected return of
        always pulling the best arm for the context: ``episode_length * E_s[max_a <arms[a], s>]``."""
        rng = np.random.default_rng(seed)
        contexts = rng.normal(0.0, 1.0 / np.sqrt(self.observation_dim), size=(num_samples, self.observation_dim))
        best = np.empty(self.num_envs)
        block = max(1, (1 << 22) // (num_samples * self.num_actions))  # bounds the [block, A, S] temporary
        for first in range(0, self.num_envs, block):
            rows = slice(first, first + block)
            values = self.arms[rows] @ contexts.T  # [block, A, S]
            best[rows] = np.where(self._available[rows, :, None], values, -np.inf).max(axis=1).mean(axis=1)
        return self.episode_length * best

    def task_params(self) -> dict[str, np.ndarray]:
        return {"arms": self.arms.copy(), "num_arms": self.num_arms.copy()}

    def config(self) -> dict:
        return {"episode_length": self.episode_length, "noise_std": self.noise_std, "dim": self.observation_dim}
