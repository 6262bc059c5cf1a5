"""Build a dataset of learning histories from a :class:`GenerateConfig` (what ``icrl-data generate`` runs)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from .. import __version__
from ..envs import (
    BERNOULLI_DISTRIBUTIONS,
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
from ..envs.base import BatchedEnv
from ..envs.tasks import TaskSplit
from ..generators import collect_histories, make_agent
from .histories import LearningHistories

ENV_NAMES = ("dark_room", "key_to_door", "dark_room_composite", "bernoulli_bandit", "contextual_bandit")
DEFAULT_GENERATORS = {
    "dark_room": "q_learning",
    "key_to_door": "q_learning",
    "dark_room_composite": "q_learning",
    "bernoulli_bandit": "thompson",
    "contextual_bandit": "linucb",
}
BANDITS = ("bernoulli_bandit", "contextual_bandit")
ENV_HELP = f"one of {ENV_NAMES}, or a gymnasium id (FrozenLake-v1, module:MyEnv-v0) with --tasks"
TASKS_HELP = "gymnasium: the tasks, a .json/.yaml file, a JSON string or module:function (docs/data.md)"


def is_gym_env(name: str) -> bool:
    """Whether ``name`` (a config's ``env``) names a gymnasium environment rather than a built-in one."""
    return name not in ENV_NAMES


@dataclass
class GenerateConfig:
    """What to generate. Grid worlds draw tasks from a seeded train/test split; bandits draw every
    history's task from a named distribution (a different seed stream per split); a gymnasium environment
    (``env`` a gymnasium id) draws them from the split of its ``tasks`` (:mod:`icrl_models.envs.tasks`)."""

    env: str = dataclasses.field(default="dark_room", metadata={"help": ENV_HELP, "aliases": ("--gym",)})
    generator: str | None = dataclasses.field(
        default=None,
        metadata={"help": "source algorithm (default per env; gymnasium: from its spaces, docs/data.md)"},
    )
    split: str = dataclasses.field(default="train", metadata={"help": "train or test tasks"})
    num_histories: int = dataclasses.field(default=1000, metadata={"help": "learning histories to generate"})
    num_tasks: int | None = dataclasses.field(
        default=None, metadata={"help": "grid worlds: distinct tasks drawn from the split (default all)"}
    )
    num_episodes: int | None = dataclasses.field(
        default=None, metadata={"help": "episodes per history (default 200 grid worlds, 1 bandits)"}
    )
    episode_length: int | None = dataclasses.field(default=None, metadata={"help": "steps per episode (env default)"})
    num_train_tasks: int | None = dataclasses.field(
        default=None, metadata={"help": "grid worlds: size of the train split (default per env)"}
    )
    split_seed: int = dataclasses.field(default=0, metadata={"help": "seed of the task and action splits"})
    action_set: str = dataclasses.field(default="train", metadata={"help": "composite Darkroom: action set name"})
    distribution: str | None = dataclasses.field(
        default=None, metadata={"help": f"Bernoulli bandit: {BERNOULLI_DISTRIBUTIONS} (default train / uniform)"}
    )
    num_arms: str = dataclasses.field(default="4-20", metadata={"help": "bandits: arm count, N or LOW-HIGH"})
    learning_rate: float | None = dataclasses.field(default=None, metadata={"help": "q_learning step size"})
    discount: float | None = dataclasses.field(default=None, metadata={"help": "q_learning discount"})
    decay_fraction: float | None = dataclasses.field(
        default=None, metadata={"help": "q_learning / noise_distillation: epsilon reaches 0 at this fraction"}
    )
    alpha: float | None = dataclasses.field(default=None, metadata={"help": "linucb exploration bonus"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of task assignment, env and generator"})
    tasks: str | None = dataclasses.field(default=None, metadata={"help": TASKS_HELP})

    def __post_init__(self) -> None:
        check_env_and_tasks(self.env, self.tasks)
        if self.split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {self.split!r}")
        if self.generator is None and not is_gym_env(self.env):  # gymnasium: chosen from its spaces when built
            self.generator = DEFAULT_GENERATORS[self.env]
        if is_gym_env(self.env):
            self.task_split()  # an unreadable task list or a bad split fails here, before anything is built
        if self.num_episodes is None:
            self.num_episodes = 1 if self.env in BANDITS else 200
        if self.env == "bernoulli_bandit" and self.distribution is None:
            self.distribution = "train" if self.split == "train" else "uniform"
        for name in ("num_histories", "num_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seed", "split_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def as_metadata(self) -> dict:
        """The config as a dataset's metadata records it (``tasks`` only where set, so that the metadata of the
        built-in environments' datasets, and the checks of cached ones, stay as they were)."""
        values = dataclasses.asdict(self)
        if values["tasks"] is None:
            del values["tasks"]
        return values

    def task_split(self) -> TaskSplit:
        """A gymnasium config's tasks, split (:func:`~icrl_models.envs.tasks.load_tasks`)."""
        from ..envs.tasks import load_tasks

        return load_tasks(self.tasks, num_train=self.num_train_tasks, seed=self.split_seed)

    def arm_counts(self) -> int | tuple[int, int]:
        low, _, high = self.num_arms.partition("-")
        try:
            return (int(low), int(high)) if high else int(low)
        except ValueError:
            raise ValueError(f"num_arms must be N or LOW-HIGH, got {self.num_arms!r}") from None

    def generator_settings(self) -> dict:
        names = ("learning_rate", "discount", "decay_fraction", "alpha")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def _assign_tasks(pool: np.ndarray, config: GenerateConfig, rng: np.random.Generator) -> np.ndarray:
    """Task of every history: ``num_tasks`` tasks drawn from ``pool``, dealt round-robin in a shuffled
    order, so each task gets ``floor(num_histories / num_tasks)`` histories or one more."""
    num_tasks = pool.size if config.num_tasks is None else config.num_tasks
    if not 1 <= num_tasks <= pool.size:
        raise ValueError(f"num_tasks must lie in [1, {pool.size}] for the {config.split} split, got {num_tasks}")
    chosen = rng.choice(pool, size=num_tasks, replace=False)
    return np.resize(chosen, config.num_histories)[rng.permutation(config.num_histories)]


def check_env_and_tasks(env: str, tasks: str | None, *, needed: bool = True) -> None:
    """A config's ``env`` and ``tasks``: a built-in environment without tasks, or a gymnasium id with them (unless
    not ``needed``: a dataset brings them) and gymnasium installed (else
    :class:`~icrl_models.envs.gym_adapter.MissingGymnasiumError` says how to install it)."""
    if not isinstance(env, str) or not env:
        raise ValueError(f"env must be one of {ENV_NAMES} or a gymnasium id, got {env!r}")
    if not is_gym_env(env):
        if tasks is not None:
            raise ValueError(f"tasks are for gymnasium environments; {env!r} is a built-in one (drop --tasks)")
        return
    if tasks is None and needed:
        raise ValueError(f"env must be one of {ENV_NAMES}, or a gymnasium id given with its tasks (--tasks); "
                         f"got {env!r} without tasks")  # fmt: skip
    from ..envs.gym_adapter import UnknownEnvError, resolve_env  # here: gymnasium stays optional

    try:
        resolve_env(env)  # a typo fails here, before any data is generated
    except UnknownEnvError as error:
        raise UnknownEnvError(f"{error} (the built-in envs are {', '.join(ENV_NAMES)})") from None


def split_size(config: GenerateConfig) -> int:
    """The number of tasks in ``config.split`` of a grid world or a gymnasium environment."""
    if is_gym_env(config.env):
        return int(config.task_split().indices(config.split).size)
    return int(grid_task_split(config.env, num_train=config.num_train_tasks, seed=config.split_seed)[config.split].size)


def build_env(config: GenerateConfig) -> tuple[BatchedEnv, dict]:
    """The batched environment of all histories, and split details for the metadata."""
    rng = np.random.default_rng([config.seed, 2])
    env_seed = np.random.SeedSequence([config.seed, 1])
    limit = {} if config.episode_length is None else {"episode_length": config.episode_length}
    details: dict = {"split_seed": config.split_seed}
    if is_gym_env(config.env):
        from ..envs.gym_adapter import GymEnv, check_task_list

        split = config.task_split()
        # Every task of the list made once (a held-out task that fails, fails now), and their shared id range.
        num_observations = check_task_list(config.env, split.tasks, episode_length=config.episode_length)
        details["num_train_tasks"] = int(split.indices("train").size)
        task_ids = _assign_tasks(split.indices(config.split), config, rng)
        details["num_tasks"] = int(np.unique(task_ids).size)
        details["tasks"] = split.to_json()  # every task with its split: evaluation rebuilds the held-out ones
        tasks = [split.tasks[i] for i in task_ids]
        env = GymEnv(config.env, tasks, seed=env_seed, task_ids=task_ids, num_observations=num_observations, **limit)
        return env, details
    if config.env in ("dark_room", "key_to_door", "dark_room_composite"):
        split = grid_task_split(config.env, num_train=config.num_train_tasks, seed=config.split_seed)
        details["num_train_tasks"] = int(split["train"].size)
        tasks = _assign_tasks(split[config.split], config, rng)
        details["num_tasks"] = int(np.unique(tasks).size)
        if config.env == "dark_room":
            return DarkRoom(tasks, seed=env_seed, **limit), details
        if config.env == "key_to_door":
            return KeyToDoor.from_task_ids(tasks, seed=env_seed, **limit), details
        action_set = composite_action_sets(config.split_seed)[config.action_set]
        details["action_set"] = config.action_set
        return CompositeDarkRoom(tasks, action_set=action_set, seed=env_seed, **limit), details
    split_seed = [config.seed, ("train", "test").index(config.split)]
    details.update(num_arms=config.num_arms, num_tasks=config.num_histories)
    if config.env == "bernoulli_bandit":
        details["distribution"] = config.distribution
        means, counts = bernoulli_arm_means(
            config.num_histories, distribution=config.distribution, num_arms=config.arm_counts(), seed=split_seed
        )
        return BernoulliBandit(means, counts, seed=env_seed, **limit), details
    arms, counts = contextual_bandit_arms(config.num_histories, num_arms=config.arm_counts(), seed=split_seed)
    return ContextualBandit(arms, counts, seed=env_seed, **limit), details


def generate_histories(config: GenerateConfig, *, progress: bool = True) -> LearningHistories:
    """Run the configured generator on the configured tasks; the metadata records everything needed to
    regenerate the dataset (config, split details, library version)."""
    env, details = build_env(config)
    generator = config.generator
    if generator is None:  # a gymnasium environment: the source algorithm its spaces call for
        from ..envs.gym_adapter import default_generator

        generator = default_generator(env)
    agent = make_agent(generator, **config.generator_settings())
    start = time.perf_counter()
    histories = collect_histories(
        env,
        agent,
        config.num_episodes,
        seed=config.seed,
        progress=progress,
        metadata={"split": config.split, "config": config.as_metadata(), "version": __version__, **details},
    )
    histories.metadata["generation_seconds"] = round(time.perf_counter() - start, 3)
    return histories
