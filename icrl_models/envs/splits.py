"""Deterministic, seeded train/test task splits (the tasks a model trains on never appear in its test).

Task ids: Dark Room and composite Darkroom: the goal cell; Key-to-Door: ``key * size**2 + door``.
Bandit tasks are continuous and are drawn instead from named distributions with split-specific seeds
(:func:`~icrl_models.envs.bandits.bernoulli_arm_means`, :func:`~icrl_models.envs.bandits.contextual_bandit_arms`).
"""

from __future__ import annotations

import numpy as np

from .base import check_positive_int

#: Training-task counts used when none is given: Dark Room as the N-gram paper's main runs (60 of 81
#: goals), Key-to-Door its low-data setting (100 of 6561), composite Darkroom Headless-AD's 68 / 13.
DEFAULT_NUM_TRAIN_TASKS = {"dark_room": 60, "key_to_door": 100, "dark_room_composite": 68}
SPLITS = ("train", "test")


def num_grid_tasks(env_name: str, size: int = 9) -> int:
    if env_name in ("dark_room", "dark_room_composite"):
        return size**2
    if env_name == "key_to_door":
        return size**4
    raise ValueError(f"env_name must be one of {tuple(DEFAULT_NUM_TRAIN_TASKS)}, got {env_name!r}")


def task_split(num_tasks: int, num_train: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Split task ids ``0..num_tasks-1`` into disjoint ``train`` (``num_train`` ids) and ``test`` (the rest).

    The split is a seeded permutation, the same on every machine for the same arguments; each part is
    returned sorted.
    """
    from icrl_kernels.validation import check_int  # here: the environments import without torch (_checks.py)

    num_tasks = check_positive_int(num_tasks, "num_tasks")
    if isinstance(num_train, bool) or not isinstance(num_train, (int, np.integer)) or not 0 < num_train < num_tasks:
        raise ValueError(f"num_train must be an int in [1, {num_tasks - 1}], got {num_train}")
    order = np.random.default_rng([check_int(seed, "seed", min_value=0), num_tasks]).permutation(num_tasks)
    return {"train": np.sort(order[:num_train]), "test": np.sort(order[num_train:])}


def grid_task_split(
    env_name: str, *, num_train: int | None = None, size: int = 9, seed: int = 0
) -> dict[str, np.ndarray]:
    """The train/test split of a grid environment's tasks (see the module docstring for task ids)."""
    total = num_grid_tasks(env_name, check_positive_int(size, "size"))
    if num_train is None:
        num_train = round(DEFAULT_NUM_TRAIN_TASKS[env_name] * total / num_grid_tasks(env_name))
    return task_split(total, num_train, seed=seed)
