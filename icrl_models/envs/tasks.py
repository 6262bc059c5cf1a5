"""Task lists for gymnasium environments: what each task passes to ``gymnasium.make``, and the train/held-out split.

A *task* is one set of keyword arguments for ``gymnasium.make`` (a FrozenLake map, a Taxi's rain probability).
Tasks come from a JSON or YAML file, a JSON string, a Python entry point ``module:function`` that returns them,
or a Python list. Each entry of the list is either a plain dict of keyword arguments or a dict with these keys:

=================== ==========================================================================================
``kwargs``          the keyword arguments for ``gymnasium.make`` (required in this form)
``split``           ``"train"`` or ``"test"`` (held out); give it on every entry or on none
``actions``         the task's available actions, a subset of the environment's ``Discrete`` action ids
``optimal_return``  the expected return of one episode under an optimal policy, where the environment has no
                    tabular model to compute it from (see :class:`~icrl_models.envs.gym_adapter.GymEnv`)
=================== ==========================================================================================

The file may also be an object ``{"train": [...], "test": [...]}`` of two such lists. Without ``split`` fields the
tasks are split by a seeded permutation (:func:`~icrl_models.envs.splits.task_split`): ``num_train`` training
tasks (default three quarters), the rest held out. A task that appears in both parts is an error, as is an empty
list. Every problem raises :class:`TaskError` (a ``ValueError``) naming the task and the source.

Task ids are positions in the full list (training and held-out tasks together), so a dataset's ``task_ids`` index
the task list its metadata records (:meth:`TaskSplit.to_json`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .splits import SPLITS, task_split

#: The keys of an entry in the full form (an entry with ``kwargs``).
TASK_KEYS = ("kwargs", "split", "actions", "optimal_return")
#: Fraction of the tasks used for training by a seeded split when ``num_train`` is not given.
DEFAULT_TRAIN_FRACTION = 0.75
_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
YAML_SUFFIXES = (".yaml", ".yml")


class TaskError(ValueError):
    """A task list that cannot be used: unreadable, empty, malformed, or with a task in both splits."""


@dataclass(frozen=True)
class GymTask:
    """One task: keyword arguments for ``gymnasium.make`` and what the library needs to know about them."""

    kwargs: dict[str, Any]
    split: str | None = None
    actions: tuple[int, ...] | None = None
    optimal_return: float | None = None

    def key(self) -> str:
        """The task's identity (its keyword arguments and action subset) as canonical JSON."""
        return json.dumps([self.kwargs, self.actions], sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        """The full form of the entry (the keys that are set)."""
        entry: dict[str, Any] = {"kwargs": self.kwargs}
        if self.split is not None:
            entry["split"] = self.split
        if self.actions is not None:
            entry["actions"] = list(self.actions)
        if self.optimal_return is not None:
            entry["optimal_return"] = self.optimal_return
        return entry


@dataclass(frozen=True)
class TaskSplit:
    """Every task of a list, each with its ``split`` set (``"train"`` or ``"test"``), in the list's order."""

    tasks: tuple[GymTask, ...]

    def indices(self, split: str) -> np.ndarray:
        """``[M]`` int64: the positions (task ids) of the tasks of ``split`` (``"train"`` or ``"test"``)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return np.array([i for i, task in enumerate(self.tasks) if task.split == split], dtype=np.int64)

    def to_json(self) -> list[dict[str, Any]]:
        """The list in the full form, each entry with its split: what :func:`load_tasks` reads back as is."""
        return [task.to_json() for task in self.tasks]


def load_tasks(source, *, num_train: int | None = None, seed: int = 0) -> TaskSplit:
    """Read a task list and split it (see the module docstring).

    Args:
        source: a ``.json`` / ``.yaml`` / ``.yml`` file, a JSON string (starting with ``[`` or ``{``), an entry
            point ``"module:function"`` (called without arguments; the current folder is importable), or the
            list (or ``{"train": ..., "test": ...}`` object) itself.
        num_train: training tasks of a seeded split (default: three quarters, at least one of each part); an
            error when the entries carry their own ``split``.
        seed: seed of the seeded split.

    Raises:
        TaskError: for every problem with the tasks; ``FileNotFoundError`` for a file that does not exist.
    """
    origin = _describe(source)
    entries = _read(source, origin)
    return split_tasks(parse_tasks(entries, origin), num_train=num_train, seed=seed, origin=origin)


def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        return "the tasks string" if text.lstrip()[:1] in ("[", "{") else str(source)
    return "the task list"


def _read(source, origin: str):
    if isinstance(source, (list, tuple, dict)):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"tasks must be a file, a JSON string, a module:function entry point or a list, got "
                        f"{type(source).__name__}")  # fmt: skip
    text = str(source)
    if text.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise TaskError(f"{origin} is not valid JSON: {error}") from None
    path = Path(text)
    if not path.exists() and _ENTRY_POINT.match(text):
        return _call_entry_point(text)
    if not path.is_file():
        raise FileNotFoundError(f"no tasks file at {path}")
    content = path.read_text(encoding="utf-8")
    if path.suffix.lower() in YAML_SUFFIXES:
        try:
            import yaml
        except ImportError:
            raise TaskError(f"reading {path} needs PyYAML: pip install pyyaml (or use a .json file)") from None
        try:
            return yaml.safe_load(content)
        except yaml.YAMLError as error:
            raise TaskError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    try:
        return json.loads(content)
    except json.JSONDecodeError as error:
        raise TaskError(f"{path} is not valid JSON (YAML files end in .yaml or .yml): {error}") from None


def import_from_cwd(module_name: str):
    """Import ``module_name`` with the current folder importable, as ``python -m`` has it (console scripts
    don't), without leaving it on ``sys.path``."""
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(os.getcwd())


def _call_entry_point(text: str):
    """``module:function()``, the current folder importable."""
    module_name, _, attribute = text.partition(":")
    try:
        module = import_from_cwd(module_name)
    except ImportError as error:
        raise TaskError(f"tasks entry point {text}: cannot import {module_name!r} ({error})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise TaskError(f"tasks entry point {text}: {module_name} has no function {attribute!r}")
    try:
        return function()
    except Exception as error:  # the user's code: say whose it is, in one line
        raise TaskError(f"tasks entry point {text} raised {type(error).__name__}: {error}") from None


def parse_tasks(entries, origin: str = "the task list") -> list[GymTask]:
    """The tasks of a parsed list (or ``{"train": [...], "test": [...]}`` object), checked; see the module docstring."""
    if isinstance(entries, dict):
        unknown = sorted(set(entries) - set(SPLITS))
        if unknown or not entries:
            raise TaskError(f"{origin}: an object of tasks must have the keys 'train' and 'test' (lists of tasks), "
                            f"got {sorted(entries)}")  # fmt: skip
        tasks = []
        for split in SPLITS:
            part = _parse_list(entries.get(split, []), f"{origin} ['{split}']")
            for task in part:
                if task.split not in (None, split):
                    raise TaskError(f"{origin}: a task under {split!r} says split {task.split!r}: {task.kwargs}")
            tasks += [GymTask(task.kwargs, split, task.actions, task.optimal_return) for task in part]
        if not tasks:
            raise TaskError(f"{origin}: the task list is empty")
        return tasks
    tasks = _parse_list(entries, origin)
    if not tasks:
        raise TaskError(f"{origin}: the task list is empty")
    return tasks


def _parse_list(entries, origin: str) -> list[GymTask]:
    if not isinstance(entries, (list, tuple)):
        raise TaskError(f"{origin} must hold a list of tasks (dicts of gymnasium.make keyword arguments), "
                        f"got {type(entries).__name__}")  # fmt: skip
    return [_parse_entry(entry, index, origin) for index, entry in enumerate(entries)]


def _parse_entry(entry, index: int, origin: str) -> GymTask:
    where = f"{origin}: task {index}"
    if isinstance(entry, GymTask):
        return entry
    if not isinstance(entry, dict):
        raise TaskError(f"{where} must be a dict of gymnasium.make keyword arguments, got {entry!r}")
    if "kwargs" not in entry:
        return GymTask(_json_kwargs(entry, where))
    unknown = sorted(set(entry) - set(TASK_KEYS))
    if unknown:
        raise TaskError(f"{where} has unknown keys {unknown}; an entry with 'kwargs' takes {list(TASK_KEYS)}")
    if not isinstance(entry["kwargs"], dict):
        raise TaskError(f"{where}: 'kwargs' must be a dict, got {entry['kwargs']!r}")
    split = entry.get("split")
    if split is not None and split not in SPLITS:
        raise TaskError(f"{where}: 'split' must be one of {SPLITS}, got {split!r}")
    actions = entry.get("actions")
    if actions is not None:
        if (
            not isinstance(actions, (list, tuple))
            or not actions
            or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in actions)
            or len(set(actions)) != len(actions)
        ):
            raise TaskError(f"{where}: 'actions' must be a non-empty list of distinct action ids >= 0, got {actions!r}")
        actions = tuple(actions)
    optimal = entry.get("optimal_return")
    if optimal is not None:
        if isinstance(optimal, bool) or not isinstance(optimal, (int, float)) or not math.isfinite(optimal):
            raise TaskError(f"{where}: 'optimal_return' must be a finite number, got {optimal!r}")
        optimal = float(optimal)
    return GymTask(_json_kwargs(entry["kwargs"], where), split, actions, optimal)


def _json_kwargs(kwargs: dict, where: str) -> dict[str, Any]:
    """``kwargs`` as plain JSON values (numpy scalars and arrays become numbers and lists): a dataset's metadata
    records them, and evaluation rebuilds the environments from that record."""
    if not all(isinstance(key, str) for key in kwargs):
        raise TaskError(f"{where}: keyword argument names must be strings, got {list(kwargs)}")

    def plain(value):
        if isinstance(value, (np.generic, np.ndarray)):
            return value.tolist()
        raise TypeError(f"{type(value).__name__} {value!r}")

    try:
        return json.loads(json.dumps(kwargs, default=plain, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TaskError(f"{where}: keyword arguments must be JSON values (numbers, strings, lists, dicts), "
                        f"got {error}") from None  # fmt: skip


def split_tasks(
    tasks: Sequence[GymTask], *, num_train: int | None = None, seed: int = 0, origin: str = "the task list"
) -> TaskSplit:
    """Give every task its split: the entries' own ``split`` fields, or a seeded split (see :func:`load_tasks`)."""
    given = [task.split is not None for task in tasks]
    if any(given) and not all(given):
        missing = given.index(False)
        raise TaskError(f"{origin}: give 'split' on every task or on none (task {missing} has none)")
    if all(given):
        if num_train is not None:
            raise TaskError(f"{origin}: the tasks carry their own 'split', so a number of training tasks "
                            f"({num_train}) does not apply")  # fmt: skip
        split = TaskSplit(tuple(tasks))
    else:
        total = len(tasks)
        if total < 2:
            raise TaskError(f"{origin}: a seeded split needs at least 2 tasks (one to train on, one held out), "
                            f"got {total}")  # fmt: skip
        if num_train is None:
            num_train = min(max(round(DEFAULT_TRAIN_FRACTION * total), 1), total - 1)
        if isinstance(num_train, bool) or not isinstance(num_train, (int, np.integer)) or not 0 < num_train < total:
            raise TaskError(f"{origin}: the number of training tasks (--num-train-tasks) must be an int in "
                            f"[1, {total - 1}] ({total} tasks), got {num_train!r}")  # fmt: skip
        parts = task_split(total, num_train, seed=seed)
        splits = np.empty(total, dtype=object)
        for name, ids in parts.items():
            splits[ids] = name
        split = TaskSplit(tuple(GymTask(t.kwargs, splits[i], t.actions, t.optimal_return) for i, t in enumerate(tasks)))
    for name in SPLITS:
        if split.indices(name).size == 0:
            raise TaskError(f"{origin}: no {'training' if name == 'train' else 'held-out'} tasks (split {name!r})")
    _check_disjoint(split, origin)
    return split


def _check_disjoint(split: TaskSplit, origin: str) -> None:
    first_train: dict[str, int] = {}
    for index in split.indices("train"):
        first_train.setdefault(split.tasks[index].key(), int(index))
    for index in split.indices("test"):
        task = split.tasks[index]
        if task.key() in first_train:
            raise TaskError(f"{origin}: task {index} (held out) is the same as training task "
                            f"{first_train[task.key()]}: {task.kwargs}")  # fmt: skip
