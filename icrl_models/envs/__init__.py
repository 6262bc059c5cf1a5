"""Environments for in-context RL, batched (numpy, many tasks per object) and single (gymnasium API).

=================================== ===================================================================
:class:`DarkRoom`                   9x9 grid, invisible goal, reward on every step on it (AD)
:class:`VisibleGoalDarkRoom`        Dark Room with the goal in the observation (a Markov, short-term task)
:class:`KeyToDoor`                  9x9 grid, invisible key then door, random start (AD)
:class:`CueCorridor`                T-maze: a cue seen once decides the turn (a memory task)
:class:`CompositeDarkRoom`          Darkroom with 125 three-move actions and action sets (Headless-AD)
:class:`BernoulliBandit`            Bernoulli arms, 300 pulls, variable arm counts (Headless-AD)
:class:`ContextualBandit`           linear contextual bandit with Gaussian rewards (Headless-AD)
=================================== ===================================================================

Task splits: :func:`grid_task_split`, :func:`composite_action_sets`, :func:`bernoulli_arm_means`,
:func:`contextual_bandit_arms`. Oracles: ``optimal_returns()`` and ``optimal_actions()`` on every env.

Any discrete gymnasium environment: :class:`GymEnv` (one environment per task, a task being keyword arguments
for ``gymnasium.make``) and its task lists, :func:`load_tasks` (docs/gymnasium.md). gymnasium is imported only
when a :class:`GymEnv` is made.
"""

from .bandits import (
    BERNOULLI_DISTRIBUTIONS,
    BernoulliBandit,
    ContextualBandit,
    bernoulli_arm_means,
    contextual_bandit_arms,
)
from .base import BatchedEnv, StepResult
from .composite_dark_room import (
    ACTION_SET_NAMES,
    NUM_COMPOSITE_ACTIONS,
    CompositeDarkRoom,
    action_moves,
    action_name,
    composite_action_sets,
)
from .cue_corridor import CueCorridor
from .dark_room import DarkRoom
from .grid import MOVE_NAMES, centre_cell
from .gym import GYM_IDS, SingleEnv, register_gymnasium_envs
from .gym_adapter import (
    GymEnv,
    GymEnvError,
    MissingGymnasiumError,
    TaskConstructionError,
    UnknownEnvError,
    UnsupportedSpaceError,
)
from .key_to_door import KeyToDoor
from .splits import DEFAULT_NUM_TRAIN_TASKS, grid_task_split, task_split
from .tasks import GymTask, TaskError, TaskSplit, load_tasks
from .visible_goal_dark_room import VisibleGoalDarkRoom

register_gymnasium_envs()

__all__ = [
    "ACTION_SET_NAMES",
    "BERNOULLI_DISTRIBUTIONS",
    "DEFAULT_NUM_TRAIN_TASKS",
    "GYM_IDS",
    "MOVE_NAMES",
    "NUM_COMPOSITE_ACTIONS",
    "BatchedEnv",
    "BernoulliBandit",
    "CompositeDarkRoom",
    "ContextualBandit",
    "CueCorridor",
    "DarkRoom",
    "GymEnv",
    "GymEnvError",
    "GymTask",
    "KeyToDoor",
    "MissingGymnasiumError",
    "SingleEnv",
    "StepResult",
    "TaskConstructionError",
    "TaskError",
    "TaskSplit",
    "UnknownEnvError",
    "UnsupportedSpaceError",
    "VisibleGoalDarkRoom",
    "action_moves",
    "action_name",
    "bernoulli_arm_means",
    "centre_cell",
    "composite_action_sets",
    "contextual_bandit_arms",
    "grid_task_split",
    "load_tasks",
    "register_gymnasium_envs",
    "task_split",
]
