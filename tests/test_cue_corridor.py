"""Cue Corridor: dynamics, when the cue is visible, the oracle, and histories from noise distillation."""

import numpy as np
import pytest

from icrl_models.envs import CueCorridor
from icrl_models.envs.cue_corridor import FORWARD, LEFT, RIGHT
from icrl_models.generators import NoiseDistillation, collect_histories


def run_oracle(env: CueCorridor):
    env.reset()
    total, steps = np.zeros(env.num_envs), 0
    done = np.zeros(env.num_envs, dtype=bool)
    while not done.all():
        result = env.step(env.optimal_actions())
        total += result.rewards
        steps += 1
        done |= result.terminated | result.truncated
    return total, steps


@pytest.mark.parametrize("corridor_length", [1, 3, 8])
def test_oracle_reaches_the_cued_end_in_corridor_length_plus_one_steps(corridor_length):
    env = CueCorridor(64, corridor_length=corridor_length, seed=3)
    total, steps = run_oracle(env)
    assert steps == corridor_length + 1
    np.testing.assert_array_equal(total, env.optimal_returns())


def test_wrong_turn_terminates_with_no_reward_and_right_turn_pays():
    env = CueCorridor(2, corridor_length=2, seed=0)
    env.reset()
    env.cues[:] = [0, 1]  # env 0: left is right, env 1: right is right
    for _ in range(2):
        result = env.step(np.full(2, FORWARD))
        assert not result.terminated.any()
    result = env.step(np.array([RIGHT, RIGHT]))
    np.testing.assert_array_equal(result.rewards, [0.0, 1.0])
    np.testing.assert_array_equal(result.terminated, [True, True])


def test_turns_in_the_corridor_and_forward_at_the_junction_stay_in_place():
    env = CueCorridor(1, corridor_length=2, seed=0)
    env.reset()
    env.step(np.array([LEFT]))
    assert env.positions[0] == 0
    env.step(np.array([FORWARD]))
    env.step(np.array([FORWARD]))
    env.step(np.array([FORWARD]))
    assert env.positions[0] == 2


def test_cue_is_observed_only_on_the_first_cue_steps():
    env = CueCorridor(32, corridor_length=4, cue_steps=2, seed=1)
    cells, radix = env.observation_parts
    obs = env.reset()
    symbols = [obs // cells]
    for _ in range(3):
        symbols.append(env.step(np.full(32, FORWARD)).observations // cells)
    np.testing.assert_array_equal(symbols[0], 1 + env.cues)
    np.testing.assert_array_equal(symbols[1], 1 + env.cues)
    assert (symbols[2] == 0).all() and (symbols[3] == 0).all()
    assert radix == 3 and env.num_observations == 3 * cells


def test_always_visible_cue_makes_the_observation_markov():
    env = CueCorridor(16, corridor_length=3, cue_steps=None, seed=2)
    env.reset()
    for _ in range(3):
        obs = env.step(np.full(16, FORWARD)).observations
    np.testing.assert_array_equal(obs // env.num_cells, 1 + env.cues)


def test_each_episode_draws_its_own_cue():
    env = CueCorridor(1, corridor_length=1, seed=4)
    cues = []
    for _ in range(64):
        env.reset()
        cues.append(int(env.cues[0]))
    assert 10 < sum(cues) < 54


def test_noise_distillation_histories_improve_to_the_oracle():
    env = CueCorridor(32, corridor_length=3, seed=0)
    histories = collect_histories(env, NoiseDistillation(), 40, seed=0, progress=False)
    returns = histories.episode_returns()
    assert returns[:, -4:].mean() == 1.0  # noise has decayed to 0 by the end
    assert returns[:, :4].mean() < 0.8  # near-random at the start: a wrong turn or a timeout


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"corridor_length": 0}, ValueError, "corridor_length"),
        ({"corridor_length": 2.5}, TypeError, "corridor_length"),
        ({"cue_steps": 0}, ValueError, "cue_steps"),
        ({"corridor_length": 5, "episode_length": 5}, ValueError, "episode_length"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        CueCorridor(4, **kwargs)
