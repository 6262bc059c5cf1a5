"""Learning-history generators: source RL algorithms run on many tasks at once (vectorised numpy).

Every generator is an :class:`Agent` (act, then learn from the transition) run by
:func:`collect_histories`, which records what the agent saw and did into :class:`LearningHistories`.
Settings follow docs/models.md#learning-histories:

=========================== ================================================================= ================
generator                   what it is                                                        environments
=========================== ================================================================= ================
``q_learning``              tabular Q-learning, epsilon 1 -> 0 over 90% of the episodes       grid worlds
``thompson``                Thompson sampling with Beta(1, 1) priors                          Bernoulli bandit
``linucb``                  disjoint LinUCB, alpha 0.3                                        contextual bandit
``ucb``                     UCB1 (a baseline)                                                 Bernoulli bandit
``noise_distillation``      an optimal policy with epsilon decaying 1 -> 0 (Zisman et al.)   all
``random``                  uniform over the available actions (a baseline)                  all
=========================== ================================================================= ================

Schedules run over a history's *progress*: its episode index for multi-episode histories, its step
index for single-episode histories (bandits).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ._checks import check_seed
from .data.histories import FORMAT_VERSION, LearningHistories
from .envs.base import BatchedEnv


def random_argmax(values: np.ndarray, available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Row-wise argmax over ``available`` entries of ``values`` (``[N, A]``), ties broken uniformly."""
    masked = np.where(available, values, -np.inf)
    best = available & (masked == masked.max(axis=1, keepdims=True))
    return np.argmax(best * rng.random(values.shape), axis=1)


def random_available(available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One uniformly random available action per row of ``available`` (``[N, A]`` bool)."""
    return np.argmax(available * rng.random(available.shape), axis=1)


def linear_decay(progress: np.ndarray, decay_fraction: float) -> np.ndarray:
    """Epsilon that falls linearly from 1 at progress 0 to 0 at progress ``decay_fraction`` (then stays 0)."""
    return np.clip(1.0 - progress / decay_fraction, 0.0, 1.0)


@dataclasses.dataclass
class Agent:
    """A learner acting in all environments of a batch. Subclasses are dataclasses of their settings."""

    name = ""

    def begin(self, env: BatchedEnv, num_episodes: int, rng: np.random.Generator) -> None:
        """Allocate per-environment state before the first step."""
        self.env, self.rng, self.num_episodes = env, rng, num_episodes
        self.available = env.action_mask()

    def progress(self, episode: np.ndarray, step: np.ndarray) -> np.ndarray:
        """``[N]`` in [0, 1): how far each history has gone (episodes, or steps for one-episode histories)."""
        if self.num_episodes > 1:
            return episode / self.num_episodes
        return step / self.env.episode_length

    def act(self, observations: np.ndarray, progress: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def learn(self, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray) -> None:
        """Update from the step just taken (the env has not been reset yet)."""

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RandomAgent(Agent):
    name = "random"

    def act(self, observations, progress):
        return random_available(self.available, self.rng)


@dataclasses.dataclass
class QLearning(Agent):
    """Tabular Q-learning with an epsilon-greedy behaviour policy.

    Args:
        learning_rate: step size of the TD update.
        discount: gamma. A truncated episode bootstraps (the time limit is not part of the state);
            a terminated one does not.
        decay_fraction: epsilon falls linearly from 1 to 0 over this fraction of the episodes.
    """

    learning_rate: float = 0.5
    discount: float = 0.9
    decay_fraction: float = 0.9
    name = "q_learning"

    def begin(self, env, num_episodes, rng):
        super().begin(env, num_episodes, rng)
        if not env.num_learner_states:
            raise ValueError(f"q_learning needs a tabular environment, {env.name} is not")
        self.q = np.zeros((env.num_envs, env.num_learner_states, env.num_actions), dtype=np.float64)
        self.rows = np.arange(env.num_envs)

    def act(self, observations, progress):
        self.state = self.env.learner_states()
        greedy = random_argmax(self.q[self.rows, self.state], self.available, self.rng)
        explore = self.rng.random(self.env.num_envs) < linear_decay(progress, self.decay_fraction)
        return np.where(explore, random_available(self.available, self.rng), greedy)

    def learn(self, actions, rewards, terminated):
        next_values = np.where(self.available, self.q[self.rows, self.env.learner_states()], -np.inf).max(axis=1)
        target = rewards + self.discount * np.where(terminated, 0.0, next_values)
        current = self.q[self.rows, self.state, actions]
        self.q[self.rows, self.state, actions] = current + self.learning_rate * (target - current)


@dataclasses.dataclass
class ThompsonSampling(Agent):
    """Thompson sampling for Bernoulli arms with Beta(prior_alpha, prior_beta) priors."""

    prior_alpha: float = 1.0
    prior_beta: float = 1.0
    name = "thompson"

    def begin(self, env, num_episodes, rng):
        super().begin(env, num_episodes, rng)
        self.successes = np.full((env.num_envs, env.num_actions), self.prior_alpha)
        self.failures = np.full((env.num_envs, env.num_actions), self.prior_beta)
        self.rows = np.arange(env.num_envs)

    def act(self, observations, progress):
        return random_argmax(self.rng.beta(self.successes, self.failures), self.available, self.rng)

    def learn(self, actions, rewards, terminated):
        self.successes[self.rows, actions] += rewards
        self.failures[self.rows, actions] += 1.0 - rewards


@dataclasses.dataclass
class UCB1(Agent):
    """UCB1: every arm once, then the highest ``mean + exploration * sqrt(2 ln t / n)``."""

    exploration: float = 1.0
    name = "ucb"

    def begin(self, env, num_episodes, rng):
        super().begin(env, num_episodes, rng)
        self.counts = np.zeros((env.num_envs, env.num_actions))
        self.sums = np.zeros((env.num_envs, env.num_actions))
        self.rows = np.arange(env.num_envs)

    def act(self, observations, progress):
        total = self.counts.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            scores = self.sums / self.counts + self.exploration * np.sqrt(
                2.0 * np.log(np.maximum(total, 1)) / self.counts
            )
        scores = np.where(self.counts == 0, np.inf, scores)
        return random_argmax(scores, self.available, self.rng)

    def learn(self, actions, rewards, terminated):
        self.counts[self.rows, actions] += 1
        self.sums[self.rows, actions] += rewards


@dataclasses.dataclass
class LinUCB(Agent):
    """Disjoint LinUCB (Li et al., 2010): a ridge regression of reward on context per arm; pull the arm
    with the highest ``theta_a . s + alpha * sqrt(s^T A_a^-1 s)``.

    Args:
        alpha: exploration bonus scale (0.3, docs/models.md#learning-histories).
        ridge: prior precision, ``A_a = ridge * I`` before any data.
    """

    alpha: float = 0.3
    ridge: float = 1.0
    name = "linucb"

    def begin(self, env, num_episodes, rng):
        super().begin(env, num_episodes, rng)
        if not env.observation_dim:
            raise ValueError(f"linucb needs vector observations (a contextual bandit), {env.name} has none")
        dim = env.observation_dim
        self.precision_inv = np.broadcast_to(np.eye(dim) / self.ridge, (env.num_envs, env.num_actions, dim, dim)).copy()
        self.reward_sums = np.zeros((env.num_envs, env.num_actions, dim))
        self.rows = np.arange(env.num_envs)

    def act(self, observations, progress):
        self.context = observations.astype(np.float64)
        # A^-1 is symmetric, so theta . s = b . (A^-1 s) and s^T A^-1 s = s . (A^-1 s): one product.
        inv_s = (self.precision_inv @ self.context[:, None, :, None])[..., 0]  # [N, A, d]
        mean = np.sum(self.reward_sums * inv_s, axis=-1)
        width = np.sum(self.context[:, None, :] * inv_s, axis=-1)
        return random_argmax(mean + self.alpha * np.sqrt(np.maximum(width, 0.0)), self.available, self.rng)

    def learn(self, actions, rewards, terminated):
        inv = self.precision_inv[self.rows, actions]  # [N, d, d]
        inv_s = (inv @ self.context[:, :, None])[..., 0]
        # Sherman-Morrison: (A + s s^T)^-1 = A^-1 - A^-1 s s^T A^-1 / (1 + s^T A^-1 s)
        denom = 1.0 + np.sum(self.context * inv_s, axis=-1)
        self.precision_inv[self.rows, actions] = inv - inv_s[:, :, None] * inv_s[:, None, :] / denom[:, None, None]
        self.reward_sums[self.rows, actions] += rewards[:, None] * self.context


@dataclasses.dataclass
class NoiseDistillation(Agent):
    """An optimal policy whose actions are replaced by uniformly random ones with probability epsilon,
    falling linearly from 1 to 0 over ``decay_fraction`` of a history (Zisman et al., 2024)."""

    decay_fraction: float = 0.9
    name = "noise_distillation"

    def act(self, observations, progress):
        explore = self.rng.random(self.env.num_envs) < linear_decay(progress, self.decay_fraction)
        return np.where(explore, random_available(self.available, self.rng), self.env.optimal_actions())


GENERATORS: dict[str, type[Agent]] = {
    cls.name: cls for cls in (QLearning, ThompsonSampling, LinUCB, UCB1, NoiseDistillation, RandomAgent)
}


def make_agent(name: str, **settings) -> Agent:
    if not isinstance(name, str) or name not in GENERATORS:
        raise ValueError(f"generator must be one of {tuple(GENERATORS)}, got {name!r}")
    fields = {field.name for field in dataclasses.fields(GENERATORS[name])}
    unknown = set(settings) - fields
    if unknown:
        raise ValueError(f"generator {name!r} has no setting(s) {sorted(unknown)}; it takes {sorted(fields)}")
    return GENERATORS[name](**settings)


def _state_dtype(env: BatchedEnv) -> np.dtype:
    if env.observation_dim:
        return np.dtype(np.float32)
    return np.dtype(np.uint8 if env.num_observations <= 256 else np.int32)


def env_metadata(env: BatchedEnv) -> dict[str, Any]:
    """What a dataset records about its environment (validated on load)."""
    return {
        "name": env.name,
        "config": env.config(),
        "num_actions": env.num_actions,
        "num_observations": env.num_observations,
        "observation_dim": env.observation_dim,
        "reward_range": [float(v) for v in env.reward_range],
    }


def collect_histories(
    env: BatchedEnv,
    agent: Agent,
    num_episodes: int,
    *,
    seed: int = 0,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
) -> LearningHistories:
    """Run ``agent`` on every environment of ``env`` for ``num_episodes`` episodes and record it all.

    Environments whose episodes end early (Key-to-Door) start their next episode at once; a history is
    complete after ``num_episodes`` episodes and padded after that. ``seed`` seeds the agent's generator
    (the environment has its own). Returns :class:`LearningHistories` with one history per environment.
    """
    if isinstance(num_episodes, bool) or not isinstance(num_episodes, (int, np.integer)) or num_episodes < 1:
        raise ValueError(f"num_episodes must be an int >= 1, got {num_episodes}")
    if not isinstance(env, BatchedEnv):
        raise TypeError(f"env must be a BatchedEnv, got {type(env).__name__}")
    if not isinstance(agent, Agent):
        raise TypeError(f"agent must be an Agent (see make_agent), got {type(agent).__name__}")
    num_envs, capacity = env.num_envs, num_episodes * env.episode_length
    state_shape = (num_envs, capacity, env.observation_dim) if env.observation_dim else (num_envs, capacity)
    states = np.zeros(state_shape, dtype=_state_dtype(env))
    actions = np.zeros((num_envs, capacity), dtype=np.int16)
    rewards = np.zeros((num_envs, capacity), dtype=np.float32)
    dones = np.zeros((num_envs, capacity), dtype=bool)
    lengths = np.zeros(num_envs, dtype=np.int64)
    episode = np.zeros(num_envs, dtype=np.int64)

    agent.begin(env, num_episodes, np.random.default_rng(check_seed(seed)))
    observations = env.reset()
    active = np.ones(num_envs, dtype=bool)
    bar = tqdm(total=num_episodes, desc=f"{agent.name} on {env.name}", unit="episode", disable=not progress)
    while active.any():
        chosen = agent.act(observations, agent.progress(episode, env.elapsed_steps))
        result = env.step(chosen)
        agent.learn(chosen, result.rewards, result.terminated)
        finished = result.terminated | result.truncated

        rows, cols = np.flatnonzero(active), lengths[active]
        states[rows, cols] = observations[rows]
        actions[rows, cols] = chosen[rows]
        rewards[rows, cols] = result.rewards[rows]
        dones[rows, cols] = finished[rows]
        lengths[rows] += 1

        episode += finished & active
        active &= episode < num_episodes
        bar.update(int(episode.min()) - bar.n)
        observations = env.reset(np.flatnonzero(finished)) if finished.any() else result.observations
    bar.close()

    meta = {
        "format_version": FORMAT_VERSION,
        "env": env_metadata(env),
        "generator": {"name": agent.name, "config": agent.settings()},
        "seed": seed,
        "split": None,
        "num_episodes": num_episodes,
    }
    meta.update(metadata or {})
    return LearningHistories(
        states=states,
        actions=actions,
        rewards=rewards,
        dones=dones,
        lengths=lengths,
        task_ids=env.task_ids(),
        action_sets=env.action_sets().astype(np.int16),
        task_params={**env.task_params(), "optimal_return": env.optimal_returns()},
        metadata=meta,
    )
