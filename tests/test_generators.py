"""Learning-history generators (docs/models.md#learning-histories):
the source algorithms learn, and collect_histories records
exactly what they saw and did."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from icrl_models.data import FORMAT_VERSION, GenerateConfig, generate_histories
from icrl_models.envs import (
    BernoulliBandit,
    CompositeDarkRoom,
    ContextualBandit,
    DarkRoom,
    KeyToDoor,
    bernoulli_arm_means,
    composite_action_sets,
    contextual_bandit_arms,
    grid_task_split,
)
from icrl_models.envs.composite_dark_room import composite_paths
from icrl_models.envs.grid import manhattan, move_table
from icrl_models.generators import (
    GENERATORS,
    collect_histories,
    linear_decay,
    make_agent,
    random_argmax,
    random_available,
)

ARRAYS = ("states", "actions", "rewards", "dones", "lengths", "task_ids", "action_sets")


def _collect(env, name, num_episodes, seed=0, **settings):
    return collect_histories(env, make_agent(name, **settings), num_episodes, seed=seed, progress=False)


def _assert_same_histories(a, b):
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.task_params.keys() == b.task_params.keys()
    for name in a.task_params:
        np.testing.assert_array_equal(a.task_params[name], b.task_params[name], err_msg=name)


# -- the package can be imported module by module -----------------------------------------------------------


def test_generators_import_standalone():
    # a fresh interpreter: icrl_models.generators and icrl_models.data import each other
    code = "import icrl_models.generators; from icrl_models.data import generate_histories"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -- helpers ----------------------------------------------------------------------------------------------


def test_random_argmax_breaks_ties_uniformly():
    rng = np.random.default_rng(0)
    n = 30_000
    values = np.tile([1.0, 3.0, 3.0, 0.0, 3.0], (n, 1))
    available = np.ones_like(values, dtype=bool)
    counts = np.bincount(random_argmax(values, available, rng), minlength=5) / n
    assert counts[0] == counts[3] == 0
    np.testing.assert_allclose(counts[[1, 2, 4]], 1 / 3, atol=0.015)


def test_random_argmax_respects_availability():
    rng = np.random.default_rng(1)
    n = 30_000
    values = np.tile([9.0, 2.0, 2.0, 9.0, 1.0], (n, 1))
    available = np.tile([False, True, True, False, True], (n, 1))
    counts = np.bincount(random_argmax(values, available, rng), minlength=5) / n
    assert counts[0] == counts[3] == counts[4] == 0
    np.testing.assert_allclose(counts[[1, 2]], 0.5, atol=0.015)

    # random rows and masks: always an available maximiser
    values = rng.integers(0, 4, size=(5000, 7)).astype(float)
    available = rng.random((5000, 7)) < 0.5
    available[np.arange(5000), rng.integers(0, 7, 5000)] = True
    chosen = random_argmax(values, available, rng)
    assert available[np.arange(5000), chosen].all()
    best = np.where(available, values, -np.inf).max(axis=1)
    np.testing.assert_array_equal(values[np.arange(5000), chosen], best)


def test_random_argmax_all_minus_inf_stays_available():
    rng = np.random.default_rng(0)
    values = np.full((1000, 3), -np.inf)
    available = np.tile([True, False, True], (1000, 1))
    chosen = random_argmax(values, available, rng)
    assert available[np.arange(1000), chosen].all()


def test_random_available_uniform_over_available():
    rng = np.random.default_rng(2)
    n = 40_000
    available = np.tile([True, False, True, True, False], (n, 1))
    counts = np.bincount(random_available(available, rng), minlength=5) / n
    assert counts[1] == counts[4] == 0
    np.testing.assert_allclose(counts[[0, 2, 3]], 1 / 3, atol=0.015)


def test_linear_decay():
    progress = np.array([0.0, 0.25, 0.45, 0.9, 0.95, 1.0])
    np.testing.assert_allclose(linear_decay(progress, 0.9), [1.0, 1 - 0.25 / 0.9, 0.5, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(linear_decay(np.array([0.0, 0.5, 1.0]), 1.0), [1.0, 0.5, 0.0])
    out = linear_decay(np.linspace(0, 1, 101), 0.5)
    assert np.all(np.diff(out) <= 0) and out.min() == 0.0 and out.max() == 1.0


def test_make_agent_and_errors():
    assert set(GENERATORS) == {"q_learning", "thompson", "linucb", "ucb", "noise_distillation", "random"}
    agent = make_agent("q_learning", learning_rate=0.1, discount=0.5)
    assert (agent.learning_rate, agent.discount, agent.decay_fraction) == (0.1, 0.5, 0.9)
    assert make_agent("linucb").alpha == 0.3
    thompson = make_agent("thompson")
    assert (thompson.prior_alpha, thompson.prior_beta) == (1.0, 1.0)
    with pytest.raises(ValueError, match="generator must be one of"):
        make_agent("sarsa")
    with pytest.raises(ValueError, match=r"no setting\(s\) \['alpha'\]"):
        make_agent("q_learning", alpha=0.3)
    with pytest.raises(ValueError, match="no setting"):
        make_agent("thompson", learning_rate=0.1)


def test_generators_refuse_wrong_environments():
    means, counts = bernoulli_arm_means(3, seed=0)
    with pytest.raises(ValueError, match="tabular"):
        _collect(BernoulliBandit(means, counts, seed=0), "q_learning", 1)
    with pytest.raises(ValueError, match="vector observations"):
        _collect(DarkRoom([3, 4], seed=0), "linucb", 2)
    with pytest.raises(ValueError, match="vector observations"):
        _collect(BernoulliBandit(means, counts, seed=0), "linucb", 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_collect_histories_rejects_bad_num_episodes(bad):
    with pytest.raises(ValueError, match="num_episodes"):
        _collect(DarkRoom([3], seed=0), "random", bad)


# -- the source algorithms learn ----------------------------------------------------------------------------


def test_q_learning_dark_room_reaches_optimal():
    env = DarkRoom(np.resize(np.arange(81), 200), seed=1)
    optimal = env.optimal_returns()
    histories = _collect(env, "q_learning", 200, seed=0)
    returns = histories.episode_returns()
    assert returns.shape == (200, 200) and not np.isnan(returns).any()
    first, last = returns[:, :10].mean(axis=1), returns[:, -10:].mean(axis=1)
    assert last.mean() >= 0.9 * optimal.mean()
    assert (last / optimal).mean() >= 0.9
    assert first.mean() <= 0.3 * optimal.mean()  # learning happened
    np.testing.assert_array_equal(histories.task_params["optimal_return"], optimal)
    assert np.all(returns <= optimal[:, None])


def test_q_learning_key_to_door_improves():
    tasks = np.resize(grid_task_split("key_to_door")["train"], 60)
    env = KeyToDoor.from_task_ids(tasks, seed=1)
    optimal = env.optimal_returns()
    returns = _collect(env, "q_learning", 150, seed=0).episode_returns()
    first, last = returns[:, :15].mean(), returns[:, -15:].mean()
    assert last >= first + 1.0
    assert last >= 0.8 * optimal.mean()


def test_q_learning_composite_dark_room_improves():
    env = CompositeDarkRoom(np.resize(np.arange(81), 60), action_set=composite_action_sets(0)["train"], seed=1)
    optimal = env.optimal_returns()
    returns = _collect(env, "q_learning", 100, seed=0).episode_returns()
    first, last = returns[:, :10].mean(), returns[:, -10:].mean()
    assert last >= first + 0.4
    assert last >= 0.9 * optimal.mean()


def _bandit_regret(name, means, counts, seed=0):
    env = BernoulliBandit(means, counts, seed=1)
    histories = _collect(env, name, 1, seed=seed)
    assert histories.actions.shape == (means.shape[0], 300)
    return env.regret(histories.actions.T.astype(np.int64)).T  # [N, 300]


def test_thompson_regret_sublinear_and_below_random():
    means, counts = bernoulli_arm_means(400, seed=0)
    thompson = _bandit_regret("thompson", means, counts)
    random = _bandit_regret("random", means, counts)
    assert np.all(thompson >= 0)
    early, late = thompson[:, :100].sum(axis=1).mean(), thompson[:, -100:].sum(axis=1).mean()
    assert late < 0.4 * early
    assert thompson.sum(axis=1).mean() < 0.4 * random.sum(axis=1).mean()
    # random regret is linear: no improvement
    assert random[:, -100:].sum(axis=1).mean() > 0.8 * random[:, :100].sum(axis=1).mean()


def test_ucb_beats_random():
    means, counts = bernoulli_arm_means(300, seed=3)
    ucb = _bandit_regret("ucb", means, counts).sum(axis=1).mean()
    random = _bandit_regret("random", means, counts).sum(axis=1).mean()
    assert ucb < 0.75 * random


def _contextual_run(name, arms, counts):
    env = ContextualBandit(arms, counts, seed=1)
    histories = _collect(env, name, 1)
    contexts = histories.states.astype(np.float64)  # [N, T, d]: the states are the contexts
    values = np.einsum("nad,ntd->nta", arms, contexts)
    values = np.where((np.arange(arms.shape[1]) < counts[:, None])[:, None, :], values, -np.inf)
    pulled = np.take_along_axis(values, histories.actions.astype(np.int64)[:, :, None], axis=2)[..., 0]
    return histories, values.max(axis=2) - pulled  # regret [N, T]


def test_linucb_beats_random():
    arms, counts = contextual_bandit_arms(200, seed=0)
    linucb, linucb_regret = _contextual_run("linucb", arms, counts)
    random, random_regret = _contextual_run("random", arms, counts)
    assert np.isfinite(linucb_regret).all() and np.all(linucb_regret >= -1e-5)
    assert linucb.rewards.mean() > random.rewards.mean() + 0.3
    assert linucb_regret.sum(axis=1).mean() < 0.5 * random_regret.sum(axis=1).mean()
    assert linucb_regret[:, -100:].sum(axis=1).mean() < 0.6 * linucb_regret[:, :100].sum(axis=1).mean()


def test_noise_distillation_late_actions_optimal_dark_room():
    env = DarkRoom(np.resize(np.arange(81), 40), seed=0)
    histories = _collect(env, "noise_distillation", 20)
    goals = histories.task_params["goal"]
    states, actions = histories.states.astype(np.int64), histories.actions.astype(np.int64)
    after = move_table(9)[states, actions]
    before_distance = manhattan(states, goals[:, None], 9)
    after_distance = manhattan(after, goals[:, None], 9)
    optimal = np.where(before_distance == 0, after_distance == 0, after_distance < before_distance)
    steps_per_episode = 20
    late = optimal[:, -2 * steps_per_episode :].mean()  # episodes 18, 19: epsilon 0
    early = optimal[:, : 2 * steps_per_episode].mean()
    assert late >= 0.99
    assert early < 0.7
    returns = histories.episode_returns()
    np.testing.assert_allclose(returns[:, -1], env.optimal_returns())


def test_noise_distillation_late_actions_optimal_bandit():
    means, counts = bernoulli_arm_means(200, seed=5)
    env = BernoulliBandit(means, counts, seed=0)
    histories = _collect(env, "noise_distillation", 1)
    best = np.where(np.arange(means.shape[1]) < counts[:, None], means, -np.inf).argmax(axis=1)
    is_best = histories.actions == best[:, None]
    assert is_best[:, -30:].mean() >= 0.99  # progress >= 0.9: no noise left
    assert is_best[:, :30].mean() < 0.4


# -- determinism ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env_name", ["dark_room", "key_to_door", "bernoulli_bandit", "contextual_bandit"])
def test_same_seed_same_histories(env_name):
    episodes = None if "bandit" in env_name else 6
    length = 30 if "bandit" in env_name else None

    def run(seed):
        config = GenerateConfig(env=env_name, num_histories=12, num_episodes=episodes, episode_length=length, seed=seed)
        return generate_histories(config, progress=False)

    a, b, c = run(4), run(4), run(5)
    _assert_same_histories(a, b)
    assert not np.array_equal(a.actions, c.actions) or not np.array_equal(a.states, c.states)


def test_agent_seed_changes_actions_env_seed_fixed():
    goals = np.arange(0, 81, 7)
    a = _collect(DarkRoom(goals, seed=3), "q_learning", 5, seed=0)
    b = _collect(DarkRoom(goals, seed=3), "q_learning", 5, seed=0)
    c = _collect(DarkRoom(goals, seed=3), "q_learning", 5, seed=1)
    _assert_same_histories(a, b)
    assert not np.array_equal(a.actions, c.actions)
    assert a.metadata["seed"] == 0 and c.metadata["seed"] == 1


# -- collect_histories bookkeeping ---------------------------------------------------------------------------


def test_dark_room_histories_replay_exactly():
    goals = np.array([0, 10, 40, 44, 80, 17, 62])
    histories = _collect(DarkRoom(goals, seed=0), "q_learning", 6, seed=2)
    num_envs, capacity = histories.actions.shape
    assert capacity == 6 * 20
    np.testing.assert_array_equal(histories.lengths, capacity)
    assert histories.states.dtype == np.uint8 and histories.actions.dtype == np.int16
    assert histories.rewards.dtype == np.float32 and histories.dones.dtype == bool

    env = DarkRoom(goals, seed=0)
    observations = env.reset()
    for t in range(capacity):
        np.testing.assert_array_equal(histories.states[:, t], observations, err_msg=f"step {t}")
        result = env.step(histories.actions[:, t].astype(np.int64))
        np.testing.assert_array_equal(histories.rewards[:, t], result.rewards, err_msg=f"step {t}")
        finished = result.terminated | result.truncated
        np.testing.assert_array_equal(histories.dones[:, t], finished, err_msg=f"step {t}")
        observations = env.reset(np.flatnonzero(finished)) if finished.any() else result.observations
    # dones exactly every 20 steps
    expected_dones = np.zeros(capacity, dtype=bool)
    expected_dones[19::20] = True
    np.testing.assert_array_equal(histories.dones, np.broadcast_to(expected_dones, histories.dones.shape))
    # and the move rule, independently of the env
    moved = move_table(9)[histories.states[:, :-1].astype(np.int64), histories.actions[:, :-1].astype(np.int64)]
    continuing = ~histories.dones[:, :-1]
    np.testing.assert_array_equal(histories.states[:, 1:][continuing], moved[continuing])
    assert np.all(histories.states[:, 0] == 40) and np.all(histories.states[:, 20::20] == 40)
    after = move_table(9)[histories.states.astype(np.int64), histories.actions.astype(np.int64)]
    np.testing.assert_array_equal(histories.rewards, after == goals[:, None])


def test_key_to_door_bookkeeping():
    rng = np.random.default_rng(0)
    keys, doors = rng.integers(0, 81, 30), rng.integers(0, 81, 30)
    keys[:3] = doors[:3]  # key on the door
    env = KeyToDoor(keys, doors, episode_length=12, seed=3)
    num_episodes = 8
    histories = _collect(env, "q_learning", num_episodes, seed=1)
    histories.validate()
    lengths = histories.lengths
    assert histories.max_length == num_episodes * 12
    assert np.unique(lengths).size > 1  # episodes end early
    assert lengths.max() <= histories.max_length and lengths.min() >= num_episodes
    np.testing.assert_array_equal(histories.dones.sum(axis=1), num_episodes)
    valid = np.arange(histories.max_length)[None, :] < lengths[:, None]
    assert not histories.dones[~valid].any()
    assert not histories.states[~valid].any() and not histories.actions[~valid].any()
    assert not histories.rewards[~valid].any()
    assert histories.dones[np.arange(30), lengths - 1].all()

    moves = move_table(9)
    for h in range(30):
        t = 0
        for _episode in range(num_episodes):
            position, has_key, steps = int(histories.states[h, t]), False, 0
            while True:
                assert histories.states[h, t] == position, (h, t)
                position = int(moves[position, histories.actions[h, t]])
                steps += 1
                picked = not has_key and position == keys[h]
                has_key = has_key or picked
                opened = has_key and position == doors[h]
                assert histories.rewards[h, t] == float(picked) + float(opened), (h, t)
                done = opened or steps == 12
                assert histories.dones[h, t] == done, (h, t)
                t += 1
                if done:
                    break
        assert t == lengths[h]

    np.testing.assert_array_equal(histories.task_ids, keys * 81 + doors)
    np.testing.assert_array_equal(histories.task_params["key"], keys)
    np.testing.assert_array_equal(histories.task_params["door"], doors)
    np.testing.assert_array_equal(histories.task_params["optimal_return"], env.optimal_returns())
    np.testing.assert_array_equal(histories.action_sets, np.tile(np.arange(5), (30, 1)))
    meta = histories.metadata
    assert meta["format_version"] == FORMAT_VERSION and meta["num_episodes"] == num_episodes
    assert meta["seed"] == 1 and meta["split"] is None
    assert meta["generator"] == {"name": "q_learning", "config": make_agent("q_learning").settings()}
    assert meta["env"] == {
        "name": "key_to_door",
        "config": {"size": 9, "episode_length": 12},
        "num_actions": 5,
        "num_observations": 81,
        "observation_dim": 0,
        "reward_range": [0.0, 2.0],
    }


def test_composite_dark_room_histories_replay():
    action_set = composite_action_sets(0)["train"]
    goals = np.array([0, 8, 30, 40, 72, 80, 13, 55])
    histories = _collect(CompositeDarkRoom(goals, action_set=action_set, seed=0), "q_learning", 6)
    histories.validate()
    np.testing.assert_array_equal(histories.action_sets, np.tile(action_set, (len(goals), 1)))
    paths = composite_paths(9)
    for h, goal in enumerate(goals):
        length = int(histories.lengths[h])
        assert np.isin(histories.actions[h, :length], action_set).all()
        env = CompositeDarkRoom([goal], action_set=action_set)
        observation = env.reset()
        for t in range(length):
            assert histories.states[h, t] == observation[0]
            path = paths[histories.states[h, t], histories.actions[h, t]]
            result = env.step(histories.actions[h, t : t + 1].astype(np.int64))
            assert histories.rewards[h, t] == result.rewards[0] == float((path == goal).any())
            finished = bool(result.terminated[0] or result.truncated[0])
            assert histories.dones[h, t] == finished
            observation = env.reset() if finished else result.observations
        assert not histories.dones[h, length:].any() and not histories.actions[h, length:].any()


def test_bernoulli_bookkeeping_and_rewards():
    means = np.array([[0.0, 1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    counts = np.array([5, 3, 2])
    histories = _collect(BernoulliBandit(means, counts, episode_length=40, seed=0), "thompson", 1)
    histories.validate()
    assert histories.states.shape == (3, 40) and not histories.states.any()
    np.testing.assert_array_equal(histories.lengths, 40)
    np.testing.assert_array_equal(histories.dones.sum(axis=1), 1)
    assert histories.dones[:, -1].all()
    assert np.all(histories.actions < counts[:, None])
    np.testing.assert_array_equal(histories.rewards, means[np.arange(3)[:, None], histories.actions])
    np.testing.assert_array_equal(histories.action_sets, [[0, 1, 2, 3, 4], [0, 1, 2, -1, -1], [0, 1, -1, -1, -1]])
    np.testing.assert_array_equal(histories.task_params["num_arms"], counts)
    np.testing.assert_array_equal(histories.task_params["optimal_return"], [40.0, 40.0, 0.0])


def test_contextual_states_are_the_contexts_of_the_actions():
    arms, counts = contextual_bandit_arms(20, seed=1)
    env = ContextualBandit(arms, counts, noise_std=0.0, episode_length=50, seed=2)
    histories = _collect(env, "linucb", 1)
    histories.validate()
    assert histories.states.shape == (20, 50, 2) and histories.states.dtype == np.float32
    expected = np.einsum("ntd,ntd->nt", arms[np.arange(20)[:, None], histories.actions], histories.states)
    np.testing.assert_allclose(histories.rewards, expected, atol=1e-5)
    assert histories.metadata["env"]["observation_dim"] == 2
    assert histories.metadata["env"]["reward_range"] == [-np.inf, np.inf]
