"""GymEnv, the gymnasium adapter: bit for bit what gymnasium's own stepping gives (FrozenLake-v1, and a custom
environment registered here with vector observations, an offset action space and its own truncation), the
value-iteration oracle, the default source algorithms, and one typed error per unsupported input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium", minversion="1.1")

import _gym_envs  # noqa: E402  (needs gymnasium)
from gymnasium.envs.toy_text.frozen_lake import generate_random_map  # noqa: E402

from icrl_models.envs.gym_adapter import (  # noqa: E402
    GymEnv,
    GymEnvError,
    TaskConstructionError,
    UnknownEnvError,
    UnsupportedSpaceError,
    default_generator,
)
from icrl_models.envs.tasks import GymTask, TaskError  # noqa: E402
from icrl_models.generators import Agent, RandomAgent, collect_histories  # noqa: E402

_gym_envs.register()

FROZEN_LAKE_TASKS = [
    {"desc": generate_random_map(size=4, seed=1)},  # slippery (the default): the env's generator matters
    {"desc": generate_random_map(size=5, seed=2), "is_slippery": True},
    {"map_name": "8x8"},  # 64 observations where the others have 16 and 25
    GymTask({"map_name": "4x4", "is_slippery": True}, actions=(1, 2)),  # down and right only
]
CHAIN_TASKS = [
    {"length": 4, "slip": 0.0},
    {"length": 6, "slip": 0.3, "trap": 2},
    GymTask({"length": 5}, actions=(0, 2)),
]


def _observation(value, env: GymEnv, index: int):
    if env.observation_dim:
        return np.asarray(value, dtype=np.float32)
    return int(value) - int(env._observation_start[index])


def _compare_with_gymnasium(env_id: str, tasks, episode_length: int, steps: int, seed: int) -> int:
    """Step a GymEnv and, beside it, one ``gymnasium.make`` per task by hand (reset with the GymEnv's seeds, then
    unseeded, as gymnasium's loop does), with the same random actions; every observation, reward and flag must be
    equal. Returns the number of episodes that ended."""
    env = GymEnv(env_id, tasks, episode_length=episode_length, seed=seed)
    start = int(env.vector.single_action_space.start)
    plain = [GymTask(t) if isinstance(t, dict) else t for t in tasks]
    reference = [gymnasium.make(env_id, max_episode_steps=episode_length, **t.kwargs) for t in plain]
    observations = env.reset()
    for index, (sub, seed_i) in enumerate(zip(reference, env.env_seeds)):
        expected, _ = sub.reset(seed=int(seed_i))
        np.testing.assert_array_equal(observations[index], _observation(expected, env, index))
    rng = np.random.default_rng(seed)
    mask = env.action_mask()
    ended = 0
    for _ in range(steps):
        actions = np.array([rng.choice(np.flatnonzero(row)) for row in mask])
        result = env.step(actions)
        done = np.zeros(env.num_envs, dtype=bool)
        for index, sub in enumerate(reference):
            observation, reward, terminated, truncated, _ = sub.step(int(actions[index]) + start)
            np.testing.assert_array_equal(result.observations[index], _observation(observation, env, index))
            assert result.rewards[index] == np.float32(reward)
            assert result.terminated[index] == terminated
            assert result.truncated[index] == (truncated and not terminated)
            done[index] = terminated or truncated
        if done.any():
            observations = env.reset(np.flatnonzero(done))
            for index in np.flatnonzero(done):
                expected, _ = reference[index].reset()
                np.testing.assert_array_equal(observations[index], _observation(expected, env, index))
            ended += int(done.sum())
    return ended


def test_frozen_lake_steps_bit_for_bit_as_gymnasium():
    ended = _compare_with_gymnasium("FrozenLake-v1", FROZEN_LAKE_TASKS, episode_length=9, steps=120, seed=5)
    assert ended > 30  # holes, goals and the time limit all ended episodes


def test_a_custom_env_steps_bit_for_bit_as_gymnasium():
    """Vector observations, actions that start at 1, an action subset, and the environment's own truncation."""
    ended = _compare_with_gymnasium("icrl_test/Chain-v0", CHAIN_TASKS, episode_length=7, steps=80, seed=2)
    assert ended > 10
    env = GymEnv("icrl_test/Chain-v0", CHAIN_TASKS, seed=0)  # the registered limit
    assert (env.episode_length, env.observation_dim, env.num_actions, env.num_observations) == (12, 3, 3, 0)
    assert env.action_mask().tolist()[2] == [True, False, True]


def test_the_custom_env_own_truncation_ends_an_episode():
    env = GymEnv("icrl_test/Chain-v0", [{"length": 6, "slip": 0.0, "trap": 1}], episode_length=50, seed=0)
    env.reset()
    for _ in range(3):  # stepping right from cell 0 or 1 reaches the trap cell 1, or passes it
        result = env.step(np.array([2]))
        if result.truncated[0]:
            break
    assert result.truncated[0] and not result.terminated[0] and env.elapsed_steps[0] < 50
    with pytest.raises(ValueError, match="reset them first"):
        env.step(np.array([2]))


def test_seeds_come_from_the_run_seed():
    tasks = [{"desc": ["S" + "F" * 7] + ["F" * 8] * 6 + ["F" * 7 + "G"]}] * 6  # no holes; 14 moves to the goal

    def run(seed):
        env = GymEnv("FrozenLake-v1", tasks, episode_length=20, seed=seed)
        env.reset()
        return env.env_seeds, np.stack([env.step(np.full(6, 2)).observations for _ in range(8)])

    seeds, trajectory = run(3)
    again_seeds, again = run(3)
    other_seeds, other = run(4)
    assert np.array_equal(seeds, again_seeds) and np.array_equal(trajectory, again)
    assert len(set(seeds.tolist())) == 6 and not np.array_equal(seeds, other_seeds)
    assert not np.array_equal(trajectory, other)  # slippery: the seeds decide where the agent slides


@dataclasses.dataclass
class Oracle(Agent):
    """The environment's optimal policy, without exploration."""

    name = "oracle"

    def act(self, observations, progress):
        return self.env.optimal_actions()


def _first_episode_returns(env: GymEnv) -> np.ndarray:
    return collect_histories(env, Oracle(), 1, progress=False).episode_returns()[:, 0]


def test_the_oracle_is_exact_on_deterministic_frozen_lake():
    """The 4x4 map's shortest path to the goal is 6 moves (down, down, right, right, down, right)."""
    task = {"map_name": "4x4", "is_slippery": False}
    assert GymEnv("FrozenLake-v1", [task], episode_length=6).optimal_returns().tolist() == [1.0]
    assert GymEnv("FrozenLake-v1", [task], episode_length=5).optimal_returns().tolist() == [0.0]
    tasks = [GymTask(task, actions=(1, 2)), GymTask(task, actions=(0, 3)), GymTask(task, optimal_return=0.5)]
    env = GymEnv("FrozenLake-v1", tasks, episode_length=8, seed=0)
    assert env.optimal_returns().tolist() == [1.0, 0.0, 0.5]  # a given optimal_return wins
    assert env.reward_range == (0.0, 1.0)
    assert _first_episode_returns(env).tolist() == [1.0, 0.0, 1.0]  # the policy keeps to each task's actions


def test_the_oracle_matches_plain_value_iteration_and_its_policy_earns_it():
    """Slippery 4x4 FrozenLake over 100 steps: the optimal return by a plain loop over the model, and the mean
    return of the oracle's policy over 400 seeded episodes within 4 standard errors of it."""
    model = gymnasium.make("FrozenLake-v1").unwrapped.P
    value = np.zeros(16)
    for _ in range(100):
        value = np.array([max(sum(p * (r + (0.0 if done else value[nxt])) for p, nxt, r, done in model[s][a])
                              for a in range(4)) for s in range(16)])  # fmt: skip
    env = GymEnv("FrozenLake-v1", [{"map_name": "4x4"}] * 400, episode_length=100, seed=1)
    optimal = env.optimal_returns()
    np.testing.assert_allclose(optimal, value[0], rtol=1e-12)
    assert 0.7 < value[0] < 0.8
    returns = _first_episode_returns(env)
    assert abs(returns.mean() - value[0]) < 4 * returns.std() / np.sqrt(returns.size)
    random = collect_histories(GymEnv("FrozenLake-v1", [{"map_name": "4x4"}] * 400, episode_length=100, seed=1),
                               RandomAgent(), 1, progress=False).episode_returns()  # fmt: skip
    assert random.mean() < returns.mean() - 0.4


def test_a_one_state_task_is_a_bandit():
    tasks = [{"means": [0.2, 0.9, 0.5]}, GymTask({"means": [0.7, 0.1, 0.3]}, actions=(1, 2))]
    env = GymEnv("icrl_test/Bandit-v0", tasks)
    assert env.num_observations == 1 and default_generator(env) == "thompson"
    np.testing.assert_allclose(env.optimal_returns(), [20 * 0.9, 20 * 0.3])
    env.reset()
    assert env.optimal_actions().tolist() == [1, 2]


def test_environments_without_a_model_have_no_oracle():
    env = GymEnv("icrl_test/Chain-v0", [{"length": 4}, GymTask({"length": 5}, optimal_return=2.5)], seed=0)
    assert not env.has_model and env.reward_range == (-np.inf, np.inf)
    assert np.isnan(env.optimal_returns()[0]) and env.optimal_returns()[1] == 2.5
    env.reset()
    with pytest.raises(GymEnvError, match="no tabular model .* noise_distillation cannot run"):
        env.optimal_actions()


def test_default_generators_follow_the_spaces():
    assert default_generator(GymEnv("FrozenLake-v1", [{}])) == "q_learning"
    assert default_generator(GymEnv("icrl_test/Chain-v0", [{}])) == "linucb"
    no_model = GymEnv("icrl_test/Bandit-v0", [{}])
    no_model._model = None  # without a model the reward range is unbounded: UCB1, not Thompson sampling
    assert default_generator(no_model) == "ucb"


def test_mixed_observation_counts_share_the_largest():
    env = GymEnv("FrozenLake-v1", FROZEN_LAKE_TASKS, episode_length=9, seed=0)
    assert env.num_observations == env.num_learner_states == 64 and env.num_actions == 4
    assert env.config() == {"gym_id": "FrozenLake-v1", "episode_length": 9}
    assert env.task_ids().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "space"),
    [
        ({"observation": "multidiscrete"}, "MultiDiscrete"),
        ({"observation": "image"}, "image observation space Box(0, 255, (8, 8, 3), uint8)"),
        ({"observation": "dict"}, "observation space Dict("),
        ({"continuous": True}, "continuous action space Box(-1.0, 1.0, (2,), float32)"),
    ],
)
def test_unsupported_spaces_raise_one_error_naming_the_space(kwargs, space):
    with pytest.raises(UnsupportedSpaceError) as error:
        GymEnv("icrl_test/Spaces-v0", [{}, kwargs])
    assert space in str(error.value) and "task 1" in str(error.value) and "\n" not in str(error.value)
    assert type(error.value.space).__name__ in space or "Box" in space


def test_bad_environments_and_tasks_raise_typed_errors():
    with pytest.raises(UnknownEnvError, match="Did you mean: `FrozenLake`"):
        GymEnv("FrozenLak-v1", [{}])
    with pytest.raises(UnknownEnvError, match="cannot import 'no_such_module'"):
        GymEnv("no_such_module:Env-v0", [{}])
    with pytest.raises(UnknownEnvError, match="registers no id 'Nothing'"):
        GymEnv("_gym_envs:Nothing", [{}])
    with pytest.raises(
        TaskConstructionError, match=r"task 1 \(\{'map_name': '5x5'\}\) failed to construct: KeyError"
    ) as e:
        GymEnv("FrozenLake-v1", [{}, {"map_name": "5x5"}])
    assert e.value.task_index == 1
    with pytest.raises(TaskConstructionError, match="unexpected keyword argument 'size'"):
        GymEnv("FrozenLake-v1", [{"size": 4}])
    with pytest.raises(GymEnvError, match="has no time limit.*--episode-length"):
        GymEnv("icrl_test/NoLimit-v0", [{}])
    with pytest.raises(GymEnvError, match="task 1 has action space Discrete\\(4\\), task 0 Discrete\\(3\\)"):
        GymEnv("icrl_test/Spaces-v0", [{}, {"actions": 4}])
    with pytest.raises(GymEnvError, match="mix Discrete and Box"):
        GymEnv("icrl_test/Spaces-v0", [{}, {"observation": "vector"}])
    with pytest.raises(ValueError, match=r"task 0's actions must lie in \[0, 4\)"):
        GymEnv("FrozenLake-v1", [GymTask({}, actions=(4,))])
    with pytest.raises(TaskError, match="non-empty list"):
        GymEnv("FrozenLake-v1", [])
    with pytest.raises(ValueError, match="episode_length must be >= 1, got 0"):
        GymEnv("FrozenLake-v1", [{}], episode_length=0)


def test_an_entry_point_or_class_works_like_an_id():
    by_class = GymEnv(_gym_envs.Chain, [{"length": 4}], episode_length=5, seed=0)
    by_entry = GymEnv("_gym_envs:Chain", [{"length": 4}], episode_length=5, seed=0)
    assert by_class.env_id == by_entry.env_id == "_gym_envs:Chain"
    assert np.array_equal(by_class.reset(), by_entry.reset())
    assert np.array_equal(by_class.step(np.array([2])).rewards, by_entry.step(np.array([2])).rewards)
