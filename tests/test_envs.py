"""Environments of :mod:`icrl_models.envs` (docs/models.md#environments), checked against independent references.

Every expected value comes from plain-Python simulators, brute-force dynamic programming / BFS and
hand-worked examples written here, never from the library's own helpers.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

from icrl_models.envs import (
    ACTION_SET_NAMES,
    GYM_IDS,
    NUM_COMPOSITE_ACTIONS,
    BernoulliBandit,
    CompositeDarkRoom,
    ContextualBandit,
    DarkRoom,
    KeyToDoor,
    SingleEnv,
    action_moves,
    action_name,
    bernoulli_arm_means,
    composite_action_sets,
    contextual_bandit_arms,
    grid_task_split,
    task_split,
)

try:  # optional: the single-environment tests at the end skip without it (e.g. on the GPU image)
    import gymnasium
    from gymnasium.utils.env_checker import check_env
except ImportError:
    gymnasium = None

requires_gymnasium = pytest.mark.skipif(gymnasium is None, reason="gymnasium is not installed (pip install gymnasium)")

SIZE = 9
CELLS = SIZE * SIZE
CENTRE = 40  # row 4, col 4
NOOP, UP, RIGHT, DOWN, LEFT = range(5)
#: (row, col) offsets written out independently of the library.
OFFSETS = {NOOP: (0, 0), UP: (-1, 0), RIGHT: (0, 1), DOWN: (1, 0), LEFT: (0, -1)}


def cell(row: int, col: int) -> int:
    return row * SIZE + col


def move(c: int, m: int) -> int:
    """Reference atomic move: a move into a wall stays in place."""
    row, col = divmod(c, SIZE)
    dr, dc = OFFSETS[m]
    if 0 <= row + dr < SIZE and 0 <= col + dc < SIZE:
        return cell(row + dr, col + dc)
    return c


TRANS = [[move(c, m) for m in range(5)] for c in range(CELLS)]
TRANS_NP = np.array(TRANS)
#: Composite action id -> its three atomic moves, built by enumeration (m0 most significant).
COMPOSITE_MOVES = {m0 * 25 + m1 * 5 + m2: (m0, m1, m2) for m0 in range(5) for m1 in range(5) for m2 in range(5)}


def composite_path(c: int, a: int) -> list[int]:
    path = []
    for m in COMPOSITE_MOVES[a]:
        c = move(c, m)
        path.append(c)
    return path


def run_policy(env, steps: int):
    """Roll out ``env.optimal_actions()`` for ``steps`` steps from a reset; return per-env first-episode
    (start observation, return, length, terminated) with finished envs reset and then ignored."""
    starts = env.reset().copy()
    n = env.num_envs
    totals = np.zeros(n)
    lengths = np.zeros(n, dtype=np.int64)
    terminated = np.zeros(n, dtype=bool)
    active = np.ones(n, dtype=bool)
    for t in range(1, steps + 1):
        result = env.step(env.optimal_actions())
        totals += np.where(active, result.rewards, 0.0)
        done = result.terminated | result.truncated
        newly = active & done
        lengths[newly] = t
        terminated |= newly & result.terminated
        active &= ~done
        if not active.any():
            break
        if done.any():
            env.reset(np.flatnonzero(done))
    assert not active.any()
    return starts, totals, lengths, terminated


# =================================================================================================
# Dark Room
# =================================================================================================


def dark_room_brute_force(goals, episode_length: int) -> np.ndarray:
    """Optimal return from the centre by dynamic programming over (cell, time), for every goal."""
    goals = np.asarray(goals)
    value = np.zeros((goals.size, CELLS))  # value-to-go with 0 steps left
    for _ in range(episode_length):
        reward = (TRANS_NP[None, :, :] == goals[:, None, None]).astype(float)  # [G, cells, 5]
        value = (reward + value[:, TRANS_NP]).max(axis=2)
    return value[:, CENTRE]


def test_dark_room_geometry_hand_worked():
    env = DarkRoom([80, 0])
    assert env.num_actions == 5 and env.num_observations == 81 and env.episode_length == 20
    np.testing.assert_array_equal(env.reset(), [CENTRE, CENTRE])
    # up, right, down, left from the centre (4, 4)
    for action, expected in [(UP, cell(3, 4)), (DOWN, cell(4, 4)), (RIGHT, cell(4, 5)), (LEFT, cell(4, 4))]:
        result = env.step([action, action])
        np.testing.assert_array_equal(result.observations, [expected, expected])
    # walk into the top-left corner, then push into both walls
    for _ in range(4):
        env.step([UP, UP])
    for _ in range(4):
        env.step([LEFT, LEFT])
    assert env.observations().tolist() == [0, 0]
    for action in (UP, LEFT, NOOP):
        result = env.step([action, action])
        assert result.observations.tolist() == [0, 0]
        assert result.rewards.tolist() == [0.0, 1.0]  # goal 0 rewarded on every step spent on it


def test_dark_room_matches_reference_simulator_on_random_actions():
    rng = np.random.default_rng(11)
    goals = rng.integers(0, CELLS, size=16)
    goals[:2] = [CENTRE, 0]
    env = DarkRoom(goals)
    env.reset()
    positions = [CENTRE] * goals.size
    actions = rng.integers(0, 5, size=(20, goals.size))
    for t in range(20):
        result = env.step(actions[t])
        positions = [move(p, a) for p, a in zip(positions, actions[t].tolist())]
        assert result.observations.dtype == np.int64
        assert result.observations.tolist() == positions
        assert result.rewards.dtype == np.float32
        assert result.rewards.tolist() == [float(p == g) for p, g in zip(positions, goals.tolist())]
        assert not result.terminated.any()
        assert result.truncated.tolist() == [t == 19] * goals.size


def test_dark_room_reward_every_step_on_goal_never_terminates_truncated_at_episode_length():
    env = DarkRoom([CENTRE], episode_length=20)
    env.reset()
    for t in range(1, 21):
        result = env.step([NOOP])
        assert result.rewards.tolist() == [1.0]
        assert not result.terminated[0]
        assert bool(result.truncated[0]) == (t == 20)
    with pytest.raises(ValueError, match="reset"):
        env.step([NOOP])
    assert env.reset().tolist() == [CENTRE]
    env.step([UP])  # usable again after a reset


@pytest.mark.parametrize("episode_length", [1, 7])
def test_dark_room_custom_episode_length(episode_length):
    env = DarkRoom([3], episode_length=episode_length)
    env.reset()
    for t in range(1, episode_length + 1):
        result = env.step([RIGHT])
        assert bool(result.truncated[0]) == (t == episode_length)


def test_dark_room_step_before_reset_and_partial_reset():
    env = DarkRoom([1, 2], episode_length=2)
    with pytest.raises(ValueError, match="reset"):
        env.step([0, 0])
    env.reset()
    env.step([UP, DOWN])
    result = env.step([UP, DOWN])
    assert result.truncated.all()
    obs = env.reset([0])
    assert obs.tolist() == [CENTRE, cell(6, 4)]  # only env 0 restarted
    with pytest.raises(ValueError, match="reset"):
        env.step([0, 0])  # env 1 still finished
    env.reset(np.array([1]))
    env.step([0, 0])


@pytest.mark.parametrize("episode_length", [20, 7, 3])
def test_dark_room_optimal_returns_brute_force(episode_length):
    goals = np.arange(CELLS)
    env = DarkRoom(goals, episode_length=episode_length)
    expected = dark_room_brute_force(goals, episode_length)
    np.testing.assert_array_equal(env.optimal_returns(), expected)
    assert env.optimal_returns().dtype == np.float64
    # hand-worked values: centre T, neighbour T, corner T-7
    assert expected[CENTRE] == episode_length
    assert expected[cell(4, 5)] == episode_length
    assert expected[0] == max(episode_length - 7, 0)
    if episode_length == 7:
        assert (expected[[0, 8, 72, 80]] == 0).all()  # 8 moves away: unreachable in 7 steps
        assert expected[cell(0, 1)] == 1


@pytest.mark.parametrize("episode_length", [20, 7])
def test_dark_room_optimal_actions_achieve_optimal_returns(episode_length):
    env = DarkRoom(np.arange(CELLS), episode_length=episode_length)
    _, totals, lengths, terminated = run_policy(env, episode_length)
    np.testing.assert_array_equal(totals, dark_room_brute_force(np.arange(CELLS), episode_length))
    np.testing.assert_array_equal(totals, env.optimal_returns())
    assert (lengths == episode_length).all() and not terminated.any()


def test_dark_room_task_metadata():
    env = DarkRoom([5, 7])
    assert env.task_ids().tolist() == [5, 7]
    assert env.task_params()["goal"].tolist() == [5, 7]
    assert env.config() == {"size": 9, "episode_length": 20}
    env.reset()
    np.testing.assert_array_equal(env.learner_states(), env.observations())


# =================================================================================================
# Key-to-Door
# =================================================================================================


def key_to_door_brute_force(key: int, door: int, episode_length: int) -> np.ndarray:
    """Optimal return from every start cell (without the key) by DP over (cell, has_key, time)."""
    value = [[0.0, 0.0] for _ in range(CELLS)]
    for _ in range(episode_length):
        new = [[0.0, 0.0] for _ in range(CELLS)]
        for c in range(CELLS):
            for has in (0, 1):
                best = 0.0
                for n in TRANS[c]:
                    reward, held = 0.0, has
                    if not held and n == key:
                        reward, held = 1.0, 1
                    if held and n == door:
                        total = reward + 1.0  # the episode ends
                    else:
                        total = reward + value[n][held]
                    best = max(best, total)
                new[c][has] = best
        value = new
    return np.array([v[0] for v in value])


def test_key_to_door_defaults_and_observation_is_position_only():
    env = KeyToDoor([cell(4, 5)], [cell(4, 7)], seed=0)
    assert env.episode_length == 50 and env.num_actions == 5 and env.num_observations == 81
    assert env.num_learner_states == 162
    env.reset()
    env.positions[:] = CENTRE
    result = env.step([RIGHT])  # onto the key
    assert result.observations.tolist() == [cell(4, 5)] and result.rewards.tolist() == [1.0]
    assert env.learner_states().tolist() == [cell(4, 5) + 81]
    result = env.step([LEFT])
    assert result.observations.tolist() == [CENTRE]  # the same id as before the key was held
    assert env.learner_states().tolist() == [CENTRE + 81]


def test_key_to_door_hand_worked_episode():
    key, door = CENTRE, cell(4, 6)
    env = KeyToDoor([key], [door], seed=1)
    env.reset()
    env.positions[:] = cell(4, 3)
    rewards, terms = [], []
    for action in (RIGHT, RIGHT, LEFT, RIGHT, RIGHT):
        result = env.step([action])
        rewards.append(float(result.rewards[0]))
        terms.append(bool(result.terminated[0]))
        assert not result.truncated[0]
    # key (+1), off, back on the key (only once: 0), off, door with key (+1, ends)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert terms == [False, False, False, False, True]
    with pytest.raises(ValueError, match="reset"):
        env.step([NOOP])


def test_key_to_door_door_without_key_and_key_equals_door():
    env = KeyToDoor([0, cell(4, 5), CENTRE], [cell(4, 5), cell(4, 5), 80], seed=2)
    env.reset()
    env.positions[:] = CENTRE
    result = env.step([RIGHT, RIGHT, NOOP])
    # env 0: the door without the key: nothing; env 1: key == door: 2 and done; env 2: standing on the key
    assert result.rewards.tolist() == [0.0, 2.0, 1.0]
    assert result.terminated.tolist() == [False, True, False]


def test_key_to_door_truncation_at_episode_length():
    for episode_length in (50, 40):
        env = KeyToDoor([0], [80], episode_length=episode_length, seed=3)
        env.reset()
        env.positions[:] = CENTRE
        for t in range(1, episode_length + 1):
            result = env.step([NOOP])
            assert result.rewards[0] == 0 and not result.terminated[0]
            assert bool(result.truncated[0]) == (t == episode_length)


def test_key_to_door_matches_reference_simulator_on_random_actions():
    rng = np.random.default_rng(5)
    n, episode_length = 64, 30
    keys = rng.integers(0, CELLS, size=n)
    doors = rng.integers(0, CELLS, size=n)
    doors[:8] = keys[:8]
    doors[8:16] = TRANS_NP[keys[8:16], RIGHT]  # the door next to the key
    env = KeyToDoor(keys, doors, episode_length=episode_length, seed=6)
    positions = env.reset().tolist()
    held = [False] * n
    elapsed = [0] * n
    num_terminated = 0
    for _ in range(45):
        actions = rng.integers(0, 5, size=n)
        result = env.step(actions)
        for i in range(n):
            p = move(positions[i], int(actions[i]))
            reward, term = 0.0, False
            if not held[i] and p == keys[i]:
                held[i], reward = True, 1.0
            if held[i] and p == doors[i]:
                reward, term = reward + 1.0, True
            elapsed[i] += 1
            assert result.observations[i] == p
            assert result.rewards[i] == reward
            assert bool(result.terminated[i]) == term
            assert bool(result.truncated[i]) == (elapsed[i] == episode_length and not term)
            assert env.learner_states()[i] == p + 81 * held[i]
            positions[i] = p
            num_terminated += term
        done = np.flatnonzero(result.terminated | result.truncated)
        if done.size:
            obs = env.reset(done)
            for i in done.tolist():
                positions[i], held[i], elapsed[i] = int(obs[i]), False, 0
    assert num_terminated > 0


def test_key_to_door_random_starts_are_seeded():
    keys, doors = np.zeros(200, dtype=np.int64), np.full(200, 80)
    a = KeyToDoor(keys, doors, seed=7).reset()
    b = KeyToDoor(keys, doors, seed=7).reset()
    c = KeyToDoor(keys, doors, seed=8).reset()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < CELLS
    assert np.unique(a).size > 60  # spread over the grid, not a fixed start
    env = KeyToDoor(keys, doors, seed=7)
    first, second = env.reset().copy(), env.reset()
    assert not np.array_equal(first, second)  # a new start each episode


@pytest.mark.parametrize("episode_length", [50, 6])
def test_key_to_door_optimal_returns_from_brute_force(episode_length):
    rng = np.random.default_rng(episode_length)
    tasks = [(0, 80), (CENTRE, CENTRE), (cell(2, 3), cell(2, 3) + 1)] + [
        tuple(rng.integers(0, CELLS, size=2).tolist()) for _ in range(3)
    ]
    keys = np.repeat([k for k, _ in tasks], CELLS)
    doors = np.repeat([d for _, d in tasks], CELLS)
    starts = np.tile(np.arange(CELLS), len(tasks))
    env = KeyToDoor(keys, doors, episode_length=episode_length)
    got = env.optimal_returns_from(starts)
    expected = np.concatenate([key_to_door_brute_force(k, d, episode_length) for k, d in tasks])
    np.testing.assert_array_equal(got, expected)
    means = expected.reshape(len(tasks), CELLS).mean(axis=1)
    np.testing.assert_allclose(env.optimal_returns(), np.repeat(means, CELLS), rtol=1e-12)
    if episode_length == 6:
        # key (0) to door (80) is 16 moves: at most the key is collected
        assert expected[:CELLS].max() == 1 and expected[0] == 1 and expected[80] == 0
        # start on key == door: 2 in one step
        assert expected[CELLS + CENTRE] == 2


def test_key_to_door_optimal_actions_achieve_optimal_returns():
    rng = np.random.default_rng(9)
    n = 300
    keys, doors = rng.integers(0, CELLS, size=n), rng.integers(0, CELLS, size=n)
    doors[:20] = keys[:20]
    for episode_length in (50, 8):
        env = KeyToDoor(keys, doors, episode_length=episode_length, seed=10)
        starts, totals, lengths, terminated = run_policy(env, episode_length)
        np.testing.assert_array_equal(totals, env.optimal_returns_from(starts))
        # brute-force on a few of them
        for i in range(0, n, 60):
            assert totals[i] == key_to_door_brute_force(int(keys[i]), int(doors[i]), episode_length)[starts[i]]
        np.testing.assert_array_equal(terminated, totals == 2)


def test_key_to_door_task_ids_round_trip():
    rng = np.random.default_rng(12)
    task_ids = rng.integers(0, CELLS**2, size=50)
    task_ids[:2] = [0, 6560]
    env = KeyToDoor.from_task_ids(task_ids, episode_length=40)
    assert env.keys.tolist() == [t // 81 for t in task_ids.tolist()]
    assert env.doors.tolist() == [t % 81 for t in task_ids.tolist()]
    np.testing.assert_array_equal(env.task_ids(), task_ids)
    assert env.episode_length == 40
    params = env.task_params()
    np.testing.assert_array_equal(params["key"] * 81 + params["door"], task_ids)
    assert env.config() == {"size": 9, "episode_length": 40}


# =================================================================================================
# Composite-action Dark Room
# =================================================================================================


def composite_bfs(action_set, episode_length: int) -> np.ndarray:
    """``[goal, cell]`` fewest actions of ``action_set`` that cross each goal from each cell
    (``episode_length + 1`` when not within an episode), by a reverse multi-source BFS per goal."""
    action_set = [int(a) for a in action_set]
    paths = {(c, a): composite_path(c, a) for c in range(CELLS) for a in action_set}
    predecessors = collections.defaultdict(list)
    crossing = collections.defaultdict(set)  # goal -> cells with an action passing over it
    for (c, _), path in paths.items():
        predecessors[path[-1]].append(c)
        for g in path:
            crossing[g].add(c)
    table = np.full((CELLS, CELLS), episode_length + 1, dtype=np.int64)
    for goal in range(CELLS):
        dist = {c: 1 for c in crossing[goal]}
        queue = collections.deque(sorted(dist))
        while queue:
            c = queue.popleft()
            if dist[c] >= episode_length:
                continue
            for p in predecessors[c]:
                if p not in dist:
                    dist[p] = dist[c] + 1
                    queue.append(p)
        for c, d in dist.items():
            table[goal, c] = d
    return table


def test_action_moves_and_names():
    ids = np.arange(NUM_COMPOSITE_ACTIONS)
    moves = action_moves(ids)
    assert moves.shape == (125, 3)
    assert [tuple(row) for row in moves.tolist()] == [COMPOSITE_MOVES[a] for a in range(125)]
    assert action_moves(np.array([[32, 124]])).shape == (1, 2, 3)
    assert action_name(32) == "up-up-right"
    assert action_name(0) == "noop-noop-noop"
    assert action_name(124) == "left-left-left"
    assert action_name(3) == "noop-noop-down"  # the last digit is the last move


def test_composite_hand_worked_up_up_right():
    up_up_right = 1 * 25 + 1 * 5 + 2
    # goals: on the 1st / 2nd / 3rd sub-step, the start cell (not landed on), elsewhere
    goals = [cell(3, 4), cell(2, 4), cell(2, 5), CENTRE, 80]
    env = CompositeDarkRoom(goals)
    assert env.num_actions == 125 and env.episode_length == 20
    env.reset()
    result = env.step([up_up_right] * 5)
    assert result.observations.tolist() == [cell(2, 5)] * 5
    assert result.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert result.terminated.tolist() == [True, True, True, False, False]
    assert not result.truncated.any()
    # order matters: right-up-up ends on the same cell but passes (4, 5), (3, 5)
    env = CompositeDarkRoom([cell(4, 5), cell(3, 4)])
    env.reset()
    result = env.step([2 * 25 + 1 * 5 + 1] * 2)
    assert result.observations.tolist() == [cell(2, 5)] * 2
    assert result.rewards.tolist() == [1.0, 0.0]


def test_composite_goal_at_start_needs_a_sub_step_landing_on_it():
    up_down_noop = 1 * 25 + 3 * 5 + 0
    env = CompositeDarkRoom([CENTRE, CENTRE, CENTRE])
    env.reset()
    result = env.step([up_down_noop, 0, 1 * 25 + 1 * 5 + 1])
    assert result.rewards.tolist() == [1.0, 1.0, 0.0]
    assert result.terminated.tolist() == [True, True, False]


def test_composite_matches_reference_simulator_on_random_actions():
    rng = np.random.default_rng(13)
    n = 40
    goals = rng.integers(0, CELLS, size=n)
    env = CompositeDarkRoom(goals)
    positions = env.reset().tolist()
    assert positions == [CENTRE] * n
    elapsed = [0] * n
    for _ in range(30):
        actions = rng.integers(0, 125, size=n)
        result = env.step(actions)
        for i in range(n):
            path = composite_path(positions[i], int(actions[i]))
            hit = goals[i] in path
            elapsed[i] += 1
            assert result.observations[i] == path[-1]
            assert result.rewards[i] == float(hit)
            assert bool(result.terminated[i]) == hit
            assert bool(result.truncated[i]) == (elapsed[i] == 20 and not hit)
            positions[i] = path[-1]
        done = np.flatnonzero(result.terminated | result.truncated)
        if done.size:
            env.reset(done)
            for i in done.tolist():
                positions[i], elapsed[i] = CENTRE, 0


def test_composite_truncation_and_unavailable_actions():
    env = CompositeDarkRoom([0], action_set=[0, 62])  # noop-noop-noop, right-right-right
    assert env.action_mask().sum() == 2 and env.action_mask()[0, [0, 62]].all()
    env.reset()
    for t in range(1, 21):
        result = env.step([0])
        assert result.rewards[0] == 0 and not result.terminated[0]
        assert bool(result.truncated[0]) == (t == 20)
    env.reset()
    with pytest.raises(ValueError, match="not available"):
        env.step([1])


def test_composite_per_env_action_sets():
    sets = np.array([[0, 1, 2], [3, 4, 5]])
    env = CompositeDarkRoom([10, 20], action_set=sets)
    mask = env.action_mask()
    assert mask.shape == (2, 125)
    assert np.flatnonzero(mask[0]).tolist() == [0, 1, 2]
    assert np.flatnonzero(mask[1]).tolist() == [3, 4, 5]
    env.reset()
    env.step([1, 4])
    with pytest.raises(ValueError, match="not available"):
        env.step([1, 1])
    shared = CompositeDarkRoom([10, 20], action_set=[7, 9])
    assert (shared.action_mask().sum(axis=1) == 2).all()
    assert CompositeDarkRoom([10]).action_mask().all()


def test_composite_action_sets_structure():
    sets = composite_action_sets(0)
    assert tuple(sets) == ACTION_SET_NAMES
    assert {name: len(v) for name, v in sets.items()} == {
        "train": 50,
        "permuted_train": 50,
        "sliced_test": 50,
        "test": 75,
        "all": 125,
    }
    train, test = sets["train"].tolist(), sets["test"].tolist()
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(125))
    assert sorted(sets["permuted_train"].tolist()) == sorted(train)
    assert sets["permuted_train"].tolist() != train
    assert sets["sliced_test"].tolist() == test[:50]
    assert sets["all"].tolist() == train + test
    assert train != sorted(train)  # a random split, not the first 50 ids
    again = composite_action_sets(0)
    other = composite_action_sets(1)
    for name in ACTION_SET_NAMES:
        np.testing.assert_array_equal(sets[name], again[name])
    assert set(other["train"].tolist()) != set(train)


@pytest.mark.parametrize(
    "action_set,episode_length",
    [
        ([62, 25], 20),  # right-right-right, up-noop-noop: down/left goals unreachable
        ([1], 3),  # noop-noop-up only, three steps
        ([3 * 25 + 4 * 5 + 0, 4], 20),  # down-left-noop, noop-noop-left
        ("random3", 20),
        ("random5", 5),
        ("train", 20),
    ],
)
def test_composite_optimal_returns_and_steps_match_bfs(action_set, episode_length):
    if action_set == "train":
        action_set = composite_action_sets(4)["train"]
    elif isinstance(action_set, str):
        size = int(action_set[-1])
        action_set = np.random.default_rng(size).choice(125, size=size, replace=False)
    goals = np.arange(CELLS)
    env = CompositeDarkRoom(goals, action_set=action_set, episode_length=episode_length)
    expected = composite_bfs(action_set, episode_length)
    np.testing.assert_array_equal(env.steps_to_goal(), expected)
    reachable = expected[:, CENTRE] <= episode_length
    np.testing.assert_array_equal(env.optimal_returns(), reachable.astype(float))
    if list(action_set) == [62, 25]:
        assert not reachable[cell(5, 4)] and not reachable[cell(4, 3)] and not reachable[80]
        assert reachable[cell(3, 4)] and reachable[cell(4, 8)] and reachable[8]
        assert expected[cell(0, 8), CENTRE] == 4 + 2  # four ups, two right-right-rights
    if list(action_set) == [1]:
        # noop-noop-up: the first sub-step lands on the centre itself, then (3, 4), (2, 4), (1, 4)
        assert np.flatnonzero(reachable).tolist() == [cell(1, 4), cell(2, 4), cell(3, 4), CENTRE]
    # the greedy oracle reaches every reachable goal in the BFS-optimal number of steps
    _, totals, lengths, terminated = run_policy(env, episode_length)
    np.testing.assert_array_equal(terminated, reachable)
    np.testing.assert_array_equal(totals, reachable.astype(float))
    np.testing.assert_array_equal(lengths, np.where(reachable, expected[:, CENTRE], episode_length))
    assert 0 < reachable.sum()


# =================================================================================================
# Bernoulli bandits
# =================================================================================================


def _high_on(means, counts):
    """Per bandit: 'odd' if every odd arm >= 0.5 and every even arm < 0.5, 'even' for the reverse."""
    labels = []
    for row, k in zip(means, counts):
        odd, even = row[1:k:2], row[0:k:2]
        if (odd >= 0.5).all() and (even < 0.5).all():
            labels.append("odd")
        elif (even >= 0.5).all() and (odd < 0.5).all():
            labels.append("even")
        else:
            labels.append("mixed")
    return np.array(labels)


def test_bernoulli_train_distribution_fraction():
    n = 4000
    means, counts = bernoulli_arm_means(n, distribution="train", seed=3)
    assert means.shape == (n, counts.max()) and means.dtype == np.float64 and counts.dtype == np.int64
    labels = _high_on(means, counts)
    assert (labels != "mixed").all()
    frac_even = (labels == "even").mean()
    std = np.sqrt(0.05 * 0.95 / n)
    assert abs(frac_even - 0.05) < 5 * std, frac_even
    valid = np.arange(means.shape[1])[None, :] < counts[:, None]
    high = valid & (means >= 0.5)
    low = valid & (means < 0.5)
    assert abs(means[high].mean() - 0.75) < 0.01 and abs(means[low].mean() - 0.25) < 0.01
    assert means[valid].max() <= 1 and means[valid].min() >= 0


def test_bernoulli_mirrored_and_uniform():
    means, counts = bernoulli_arm_means(2000, distribution="mirrored", seed=4)
    assert (_high_on(means, counts) == "even").all()
    means, counts = bernoulli_arm_means(3000, distribution="uniform", seed=4)
    valid = np.arange(means.shape[1])[None, :] < counts[:, None]
    values = means[valid]
    assert values.min() >= 0 and values.max() <= 1
    m = values.size
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):  # empirical CDF of U[0, 1]
        assert abs((values < q).mean() - q) < 5 * np.sqrt(q * (1 - q) / m)
    odd_values = means[:, 1::2][valid[:, 1::2]]
    assert abs((odd_values >= 0.5).mean() - 0.5) < 0.02  # no odd/even structure
    labels = _high_on(means, counts)
    assert (labels == "mixed").mean() > 0.9


def test_bernoulli_arm_counts_padding_and_mask():
    means, counts = bernoulli_arm_means(2000, num_arms=(4, 20), seed=5)
    assert counts.min() == 4 and counts.max() == 20
    assert set(np.unique(counts).tolist()) == set(range(4, 21))
    for row, k in zip(means, counts):
        assert (row[k:] == 0).all()
    env = BernoulliBandit(means, counts)
    mask = env.action_mask()
    for row, k in zip(mask, counts):
        assert row[:k].all() and not row[k:].any()
    fixed, fixed_counts = bernoulli_arm_means(50, num_arms=20, distribution="mirrored", seed=5)
    assert fixed.shape == (50, 20) and (fixed_counts == 20).all()
    wide, wide_counts = bernoulli_arm_means(500, num_arms=(20, 50), distribution="uniform", seed=5)
    assert wide_counts.min() >= 20 and wide_counts.max() <= 50 and wide.shape[1] == wide_counts.max()
    assert {20, 50} <= set(wide_counts.tolist())
    single, single_counts = bernoulli_arm_means(5, num_arms=(7, 7))
    assert single.shape == (5, 7) and (single_counts == 7).all()


def test_bernoulli_arm_means_seeded():
    for distribution in ("train", "mirrored", "uniform"):
        a = bernoulli_arm_means(30, distribution=distribution, seed=1)
        b = bernoulli_arm_means(30, distribution=distribution, seed=1)
        c = bernoulli_arm_means(30, distribution=distribution, seed=2)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        assert a[0].shape != c[0].shape or not np.array_equal(a[0], c[0])


def test_bernoulli_pull_beyond_num_arms_raises():
    env = BernoulliBandit([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.9, 0.8, 0.7, 0.6, 0.0, 0.0]], [6, 4])
    env.reset()
    env.step([5, 3])
    with pytest.raises(ValueError, match="not available"):
        env.step([5, 4])
    with pytest.raises(ValueError, match="actions"):
        env.step([6, 0])


def test_bernoulli_reward_frequencies_and_truncation():
    true_means = np.array([0.1, 0.35, 0.5, 0.9])
    n = 400
    env = BernoulliBandit(np.tile(true_means, (n, 1)), seed=0)
    assert env.episode_length == 300 and env.num_actions == 4
    obs = env.reset()
    assert obs.tolist() == [0] * n
    arms = np.arange(n) % 4
    totals = np.zeros(n)
    for t in range(1, 301):
        result = env.step(arms)
        assert set(np.unique(result.rewards).tolist()) <= {0.0, 1.0}
        assert not result.terminated.any()
        assert result.truncated.all() == (t == 300) and result.truncated.any() == (t == 300)
        totals += result.rewards
    for arm, p in enumerate(true_means):
        samples = 300 * (n // 4)
        freq = totals[arms == arm].sum() / samples
        assert abs(freq - p) < 5 * np.sqrt(p * (1 - p) / samples), (arm, freq)
    with pytest.raises(ValueError, match="reset"):
        env.step(arms)


def test_bernoulli_seeded_rewards():
    means = np.full((64, 3), 0.5)

    def rewards(seed):
        env = BernoulliBandit(means, seed=seed)
        env.reset()
        return np.stack([env.step(np.zeros(64, dtype=np.int64)).rewards for _ in range(5)])

    np.testing.assert_array_equal(rewards(1), rewards(1))
    assert not np.array_equal(rewards(1), rewards(2))


def test_bernoulli_regret_best_means_and_oracle():
    means = np.array([[0.2, 0.7, 0.5, 0.0], [0.9, 0.1, 0.95, 0.99]])
    env = BernoulliBandit(means, [3, 2], episode_length=10)  # env 1: arms 2, 3 are padding
    np.testing.assert_allclose(env.best_means(), [0.7, 0.9])
    np.testing.assert_allclose(env.regret([0, 1]), [0.5, 0.8])
    np.testing.assert_allclose(env.regret(np.array([1, 0])), [0.0, 0.0])
    actions = np.array([[0, 0], [1, 1], [2, 0]])
    expected = [[0.7 - 0.2, 0.9 - 0.9], [0.7 - 0.7, 0.9 - 0.1], [0.7 - 0.5, 0.0]]
    got = env.regret(actions)
    assert got.shape == (3, 2)
    np.testing.assert_allclose(got, expected, atol=1e-12)
    deep = env.regret(np.stack([actions, actions[::-1]]))
    assert deep.shape == (2, 3, 2)
    np.testing.assert_allclose(deep[1], np.array(expected)[::-1], atol=1e-12)
    assert env.optimal_actions().tolist() == [1, 0]
    np.testing.assert_allclose(env.optimal_returns(), [7.0, 9.0])
    with pytest.raises(ValueError, match="actions"):
        env.regret([0, 1, 2])
    params = env.task_params()
    np.testing.assert_array_equal(params["means"], means)
    assert params["num_arms"].tolist() == [3, 2]
    assert env.task_ids().tolist() == [0, 1]
    assert BernoulliBandit(means, task_ids=[5, 9]).task_ids().tolist() == [5, 9]


# =================================================================================================
# Contextual bandits
# =================================================================================================


def test_contextual_bandit_arms_distribution():
    arms, counts = contextual_bandit_arms(3000, num_arms=(4, 20), dim=3, seed=2)
    assert arms.shape == (3000, counts.max(), 3) and counts.min() >= 4 and counts.max() <= 20
    valid = np.arange(arms.shape[1])[None, :] < counts[:, None]
    assert (arms[~valid] == 0).all()
    features = arms[valid]
    np.testing.assert_allclose(np.cov(features.T), np.eye(3) / 3, atol=0.01)
    np.testing.assert_allclose(features.mean(axis=0), 0, atol=0.01)
    again, _ = contextual_bandit_arms(3000, num_arms=(4, 20), dim=3, seed=2)
    np.testing.assert_array_equal(arms, again)


def test_contextual_contexts_distribution():
    dim, n = 3, 2000
    arms, counts = contextual_bandit_arms(n, num_arms=5, dim=dim, seed=0)
    env = ContextualBandit(arms, counts, seed=1)
    assert env.observation_dim == dim
    contexts = [env.reset()]
    for _ in range(9):
        contexts.append(env.step(np.zeros(n, dtype=np.int64)).observations)
    contexts = np.concatenate(contexts)
    assert contexts.dtype == np.float32 and contexts.shape == (10 * n, dim)
    np.testing.assert_allclose(np.cov(contexts.T.astype(np.float64)), np.eye(dim) / dim, atol=0.015)
    np.testing.assert_allclose(contexts.mean(axis=0), 0, atol=0.015)


def test_contextual_rewards_are_inner_products():
    rng = np.random.default_rng(3)
    n, k, dim = 16, 6, 2
    arms = rng.normal(size=(n, k, dim))
    counts = rng.integers(2, k + 1, size=n)
    env = ContextualBandit(arms, counts, noise_std=0.0, episode_length=12, seed=4)
    obs = env.reset()
    for t in range(1, 13):
        best = [int(np.argmax([float(np.dot(arms[i, a], obs[i])) for a in range(counts[i])])) for i in range(n)]
        assert env.optimal_actions().tolist() == best
        actions = rng.integers(0, counts)
        result = env.step(actions)
        expected = [float(np.dot(arms[i, actions[i]], obs[i].astype(np.float64))) for i in range(n)]
        np.testing.assert_allclose(result.rewards, expected, rtol=1e-5, atol=1e-5)
        assert not np.allclose(result.observations, obs)  # a fresh context every step
        assert bool(result.truncated.all()) == (t == 12)
        obs = result.observations


def test_contextual_reward_noise():
    n = 2000
    arms = np.tile(np.array([[[1.0, 0.0], [0.0, 1.0]]]), (n, 1, 1))
    env = ContextualBandit(arms, noise_std=1.0, seed=5)
    residuals = []
    obs = env.reset()
    for _ in range(5):
        result = env.step(np.zeros(n, dtype=np.int64))
        residuals.append(result.rewards - obs[:, 0])
        obs = result.observations
    residuals = np.concatenate(residuals)
    assert abs(residuals.mean()) < 0.05 and abs(residuals.std() - 1.0) < 0.05


def test_contextual_optimal_returns():
    dim = 2
    arms, counts = contextual_bandit_arms(6, num_arms=(2, 8), dim=dim, seed=6)
    env = ContextualBandit(arms, counts, episode_length=300)
    rng = np.random.default_rng(99)
    contexts = rng.normal(0.0, 1.0 / np.sqrt(dim), size=(100_000, dim))
    got = env.optimal_returns()
    assert got.shape == (6,)
    for i in range(6):
        best = (contexts @ arms[i, : counts[i]].T).max(axis=1)
        standard_error = best.std() / np.sqrt(4096)
        assert abs(got[i] / 300 - best.mean()) < 5 * standard_error + 1e-3, i


# =================================================================================================
# Task splits
# =================================================================================================


@pytest.mark.parametrize(
    "env_name,total,num_train", [("dark_room", 81, 60), ("key_to_door", 6561, 100), ("dark_room_composite", 81, 68)]
)
def test_grid_task_split_defaults(env_name, total, num_train):
    split = grid_task_split(env_name)
    train, test = split["train"].tolist(), split["test"].tolist()
    assert len(train) == num_train and len(test) == total - num_train
    assert not set(train) & set(test)
    assert sorted(train + test) == list(range(total))
    assert train == sorted(train) and test == sorted(test)
    again = grid_task_split(env_name)
    np.testing.assert_array_equal(split["train"], again["train"])
    other = grid_task_split(env_name, seed=1)
    assert other["train"].tolist() != train
    custom = grid_task_split(env_name, num_train=10, seed=3)
    assert len(custom["train"]) == 10 and len(custom["test"]) == total - 10


def test_task_split_and_bad_num_train():
    split = task_split(10, 3, seed=7)
    assert len(split["train"]) == 3 and sorted(split["train"].tolist() + split["test"].tolist()) == list(range(10))
    np.testing.assert_array_equal(split["train"], task_split(10, 3, seed=7)["train"])
    assert {tuple(task_split(10, 3, seed=s)["train"].tolist()) for s in range(6)} != {tuple(split["train"].tolist())}
    for bad in (0, 10, 11, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_train"):
            task_split(10, bad)
    with pytest.raises(ValueError, match="num_train"):
        grid_task_split("dark_room", num_train=81)
    with pytest.raises(ValueError, match="env_name"):
        grid_task_split("mountain_car")


# =================================================================================================
# Input validation
# =================================================================================================


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda: DarkRoom([81]), ValueError, "goals must lie in"),
        (lambda: DarkRoom([-1]), ValueError, "goals must lie in"),
        (lambda: DarkRoom([1.0]), TypeError, "goals must hold integers"),
        (lambda: DarkRoom([True]), TypeError, "goals must hold integers"),
        (lambda: DarkRoom([[1, 2]]), ValueError, "goals must be a non-empty 1-D"),
        (lambda: DarkRoom(5), ValueError, "goals must be a non-empty 1-D"),
        (lambda: DarkRoom(np.zeros(0, dtype=np.int64)), ValueError, "goals must be a non-empty 1-D"),
        (lambda: DarkRoom([1], episode_length=0), ValueError, "episode_length must be >= 1"),
        (lambda: DarkRoom([1], episode_length=2.0), TypeError, "episode_length must be an int"),
        (lambda: DarkRoom([1], size=0), ValueError, "size must be >= 1"),
        (lambda: KeyToDoor([81], [0]), ValueError, "keys must lie in"),
        (lambda: KeyToDoor([0], [81]), ValueError, "doors must lie in"),
        (lambda: KeyToDoor([0, 1], [2]), ValueError, "doors must have shape"),
        (lambda: KeyToDoor([0], [2.0]), TypeError, "doors must hold integers"),
        (lambda: KeyToDoor([[0]], [[2]]), ValueError, "keys must be a non-empty 1-D"),
        (lambda: KeyToDoor.from_task_ids([6561]), ValueError, "task_ids must lie in"),
        (lambda: KeyToDoor([0], [1]).optimal_returns_from([0, 1]), ValueError, "starts must have shape"),
        (lambda: KeyToDoor([0], [1]).optimal_returns_from([81]), ValueError, "starts must lie in"),
        (lambda: CompositeDarkRoom([81]), ValueError, "goals must lie in"),
        (lambda: CompositeDarkRoom([0], action_set=[125]), ValueError, "action_set must lie in"),
        (lambda: CompositeDarkRoom([0], action_set=[1.0]), TypeError, "action_set must hold integers"),
        (lambda: CompositeDarkRoom([0], action_set=[3, 3]), ValueError, "action_set must not repeat"),
        (lambda: CompositeDarkRoom([0, 1], action_set=[[1], [2], [3]]), ValueError, "action_set must be"),
        (lambda: CompositeDarkRoom([0], action_set=np.zeros((1, 0), np.int64)), ValueError, "action_set must be"),
        (lambda: BernoulliBandit([0.5, 0.5]), ValueError, "means must be a non-empty"),
        (lambda: BernoulliBandit([[0.5, 1.5]]), ValueError, "means must lie in"),
        (lambda: BernoulliBandit([[0.5, 0.5]], [3]), ValueError, "num_arms must lie in"),
        (lambda: BernoulliBandit([[0.5, 0.5]], [0]), ValueError, "num_arms must lie in"),
        (lambda: BernoulliBandit([[0.5, 0.5]], [1, 2]), ValueError, "num_arms must have shape"),
        (lambda: BernoulliBandit([[0.5, 0.5]], task_ids=[-1]), ValueError, "task_ids must lie in"),
        (lambda: ContextualBandit(np.ones((2, 3))), ValueError, "arms must be a non-empty"),
        (lambda: ContextualBandit(np.ones((1, 2, 2)), noise_std=-1.0), ValueError, "noise_std must be >= 0"),
        (lambda: ContextualBandit(np.ones((1, 2, 2)), noise_std=float("nan")), ValueError, "noise_std"),
        (lambda: bernoulli_arm_means(3, distribution="gaussian"), ValueError, "distribution must be one of"),
        (lambda: bernoulli_arm_means(0), ValueError, "num_bandits must be >= 1"),
        (lambda: bernoulli_arm_means(3, num_arms=(5, 3)), ValueError, "num_arms range"),
        (lambda: bernoulli_arm_means(3, num_arms=0), ValueError, "num_arms must be >= 1"),
        (lambda: contextual_bandit_arms(3, dim=0), ValueError, "dim must be >= 1"),
    ],
)
def test_constructor_validation_names_the_argument(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda env: env.step([0]), ValueError, r"actions must have shape \(2,\)"),
        (lambda env: env.step([[0, 0]]), ValueError, "actions must have shape"),
        (lambda env: env.step([0, 5]), ValueError, "actions must lie in"),
        (lambda env: env.step([0, -1]), ValueError, "actions must lie in"),
        (lambda env: env.step([0.0, 1.0]), TypeError, "actions must hold integers"),
        (lambda env: env.step(np.array([True, False])), TypeError, "actions must hold integers"),
        (lambda env: env.reset([2]), ValueError, "env_ids must lie in"),
        (lambda env: env.reset([[0]]), ValueError, "env_ids must be 1-D"),
        (lambda env: env.reset([0.0]), TypeError, "env_ids must hold integers"),
    ],
)
def test_step_and_reset_validation_names_the_argument(call, error, match):
    env = DarkRoom([3, 4])
    env.reset()
    with pytest.raises(error, match=match):
        call(env)


def test_reset_with_no_env_ids_is_a_no_op():
    env = DarkRoom([3, 4])
    env.reset()
    env.step([UP, DOWN])
    np.testing.assert_array_equal(env.reset([]), [cell(3, 4), cell(5, 4)])


def test_bandit_regret_rejects_padding_arms():
    env = BernoulliBandit(np.array([[0.2, 0.9, 0.0], [0.5, 0.1, 0.3]]), num_arms=[2, 3])
    with pytest.raises(ValueError, match="num_arms"):
        env.regret([2, 0])


def test_action_name_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="action"):
        action_name(NUM_COMPOSITE_ACTIONS)


# =================================================================================================
# gymnasium
# =================================================================================================


@requires_gymnasium
@pytest.mark.parametrize("env_id", sorted(GYM_IDS))
def test_gymnasium_make_and_check_env(env_id):
    env = gymnasium.make(env_id)
    assert isinstance(env.unwrapped, SingleEnv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert "action_ids" in info
    env.close()


@requires_gymnasium
def test_gymnasium_make_with_module_prefix():
    env = gymnasium.make("icrl_models.envs:icrl/DarkRoom-v0", goal=10)
    assert env.unwrapped.batched.goals.tolist() == [10]


@requires_gymnasium
def test_gymnasium_dark_room_episode_matches_batched():
    rng = np.random.default_rng(21)
    goal = cell(3, 5)
    actions = [UP, RIGHT, NOOP] + rng.integers(0, 5, size=17).tolist()
    env = gymnasium.make("icrl/DarkRoom-v0", goal=goal)
    obs, _ = env.reset(seed=0)
    batched = DarkRoom([goal])
    assert obs == batched.reset()[0] == CENTRE
    assert env.action_space.n == 5 and env.observation_space.n == 81
    for t, action in enumerate(actions, start=1):
        obs, reward, terminated, truncated, _ = env.step(action)
        result = batched.step([action])
        assert isinstance(obs, int) and isinstance(reward, float)
        assert obs == result.observations[0]
        assert reward == result.rewards[0]
        assert terminated is False
        assert truncated == bool(result.truncated[0]) == (t == 20)
    with pytest.raises(ValueError, match="reset"):
        env.step(0)
    env.close()
    # UP, RIGHT lands on the goal at step 2, NOOP stays
    single = SingleEnv(DarkRoom([goal]))
    single.reset()
    rewards = [single.step(a)[1] for a in (UP, RIGHT, NOOP)]
    assert rewards == [0.0, 1.0, 1.0]


@requires_gymnasium
def test_gymnasium_key_to_door_seeded_reset():
    env = gymnasium.make("icrl/KeyToDoor-v0", key=0, door=80, episode_length=40)
    starts = {}
    for seed in range(8):
        first, _ = env.reset(seed=seed)
        second, _ = env.reset(seed=seed)
        assert first == second
        starts[seed] = first
    assert len(set(starts.values())) > 1
    assert env.unwrapped.batched.episode_length == 40
    env.close()


@requires_gymnasium
def test_gymnasium_composite_local_action_indices():
    split = composite_action_sets(3)
    goal = cell(2, 5)
    env = gymnasium.make("icrl/DarkRoomComposite-v0", goal=goal, action_set="test", split_seed=3)
    obs, info = env.reset(seed=0)
    assert obs == CENTRE
    np.testing.assert_array_equal(info["action_ids"], split["test"])
    assert env.action_space.n == 75
    rng = np.random.default_rng(0)
    position = CENTRE
    for _ in range(20):
        index = int(rng.integers(0, 75))
        global_id = int(info["action_ids"][index])
        path = composite_path(position, global_id)
        obs, reward, terminated, truncated, _ = env.step(index)
        assert obs == path[-1] and reward == float(goal in path) and terminated == (goal in path)
        position = path[-1]
        if terminated or truncated:
            break
    env.close()
    # explicit global ids: local 0 -> right-right-right, local 1 -> up-up-right
    single = gymnasium.make("icrl/DarkRoomComposite-v0", goal=cell(2, 5), action_set=[62, 32]).unwrapped
    _, info = single.reset()
    assert info["action_ids"].tolist() == [62, 32]
    obs, reward, terminated, _, _ = single.step(0)
    assert obs == cell(4, 7) and reward == 0.0 and not terminated
    single.reset()
    obs, reward, terminated, _, _ = single.step(1)
    assert obs == cell(2, 5) and reward == 1.0 and terminated
    single.reset()
    with pytest.raises(ValueError, match="action must lie in"):
        single.step(2)
    with pytest.raises(ValueError, match="action_set must be one of"):
        gymnasium.make("icrl/DarkRoomComposite-v0", action_set="bogus")


@requires_gymnasium
def test_single_env_requires_one_env_and_bandit_gym():
    with pytest.raises(ValueError, match="num_envs == 1"):
        SingleEnv(DarkRoom([1, 2]))
    env = gymnasium.make("icrl/BernoulliBandit-v0", means=(0.0, 1.0, 0.0), episode_length=5)
    env.reset(seed=0)
    assert env.action_space.n == 3
    rewards = [env.step(1)[1] for _ in range(4)]
    assert rewards == [1.0] * 4
    *_, truncated, _ = env.step(0)
    assert truncated
    ctx = gymnasium.make("icrl/ContextualBandit-v0", arms=((1.0, 0.0), (0.0, 1.0)), noise_std=0.0)
    obs, _ = ctx.reset(seed=1)
    assert obs.shape == (2,) and obs.dtype == np.float32
    _, reward, *_ = ctx.step(1)
    assert reward == pytest.approx(float(obs[1]), abs=1e-6)


def test_action_sets_list_available_ids_in_the_envs_order():
    means = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])
    np.testing.assert_array_equal(BernoulliBandit(means, num_arms=[3, 2]).action_sets(), [[0, 1, 2], [0, 1, -1]])
    np.testing.assert_array_equal(DarkRoom([0]).action_sets(), [[0, 1, 2, 3, 4]])
    composite = CompositeDarkRoom([1, 2], action_set=[[7, 3, 9], [4, 8, 1]])
    np.testing.assert_array_equal(composite.action_sets(), [[7, 3, 9], [4, 8, 1]])
