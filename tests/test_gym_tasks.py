"""Task lists for gymnasium environments (icrl_models.envs.tasks): every source and form reads the same, seeded
splits are reproducible and disjoint, and every bad list is one TaskError naming the problem. Also: without
gymnasium, the gymnasium flags say how to install it. Nothing here needs gymnasium."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from icrl_models.data.cli import main as data_main
from icrl_models.envs.tasks import GymTask, TaskError, load_tasks, split_tasks
from icrl_models.train import main as train_main

MAPS = [{"desc": ["SF", f"{c}G"], "is_slippery": False} for c in "FH"] + [{"map_name": "4x4"}, {"map_name": "8x8"}]


def _kwargs(split, name):
    return [split.tasks[i].kwargs for i in split.indices(name)]


def test_a_seeded_split_is_reproducible_disjoint_and_three_quarters_by_default():
    tasks = [{"seed_of_map": i} for i in range(20)]
    split = load_tasks(tasks, seed=3)
    train, test = split.indices("train"), split.indices("test")
    assert train.size == 15 and test.size == 5 and not set(train) & set(test)
    assert set(train) | set(test) == set(range(20))
    assert np.array_equal(load_tasks(tasks, seed=3).indices("test"), test)  # same seed, same split
    assert not np.array_equal(load_tasks(tasks, seed=4).indices("test"), test)
    assert load_tasks(tasks, num_train=1).indices("train").size == 1
    assert load_tasks(tasks[:2]).indices("train").size == 1  # at least one of each part


def test_every_source_and_form_reads_the_same(tmp_path, monkeypatch):
    entries = [{"kwargs": kwargs, "split": "test" if i == 1 else "train"} for i, kwargs in enumerate(MAPS)]
    expected = load_tasks(entries).to_json()
    assert [t["split"] for t in expected] == ["train", "test", "train", "train"]
    (tmp_path / "tasks.json").write_text(json.dumps(entries))
    assert load_tasks(tmp_path / "tasks.json").to_json() == expected
    assert load_tasks(json.dumps(entries)).to_json() == expected  # a JSON string
    train = [entries[i]["kwargs"] for i in (0, 2, 3)]
    grouped = load_tasks({"train": train, "test": [MAPS[1]]}).to_json()  # {"train": [...], "test": [...]}
    assert sorted(json.dumps(t, sort_keys=True) for t in grouped) == sorted(
        json.dumps(t, sort_keys=True) for t in expected
    )
    (tmp_path / "my_tasks.py").write_text(f"def tasks():\n    return {entries!r}\n")
    monkeypatch.chdir(tmp_path)  # an entry point in the current folder, as `python -m` would import it
    assert load_tasks("my_tasks:tasks").to_json() == expected
    assert str(tmp_path) not in sys.path  # imported without leaving the folder on sys.path
    # The full form's other keys, and numpy values in kwargs (recorded as plain JSON).
    split = load_tasks([{"kwargs": {"n": np.int64(3), "xs": np.arange(2)}, "actions": [0, 2], "optimal_return": 1},
                        {"n": 4}], num_train=1, seed=0)  # fmt: skip
    task = next(t for t in split.tasks if t.kwargs.get("n") == 3)
    assert task == GymTask({"n": 3, "xs": [0, 1]}, task.split, (0, 2), 1.0)
    assert load_tasks(split.to_json()).to_json() == split.to_json()  # a recorded list reads back as is


def test_a_yaml_file_reads_like_json(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "tasks.yaml").write_text(textwrap.dedent("""\
        train:
          - {map_name: 4x4, is_slippery: false}
          - map_name: 8x8
        test:
          - kwargs: {map_name: 4x4, is_slippery: true}
            actions: [0, 1, 2]
        """))  # fmt: skip
    split = load_tasks(tmp_path / "tasks.yaml")
    assert _kwargs(split, "train") == [{"map_name": "4x4", "is_slippery": False}, {"map_name": "8x8"}]
    assert split.tasks[2].actions == (0, 1, 2) and split.tasks[2].split == "test"


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ([], "the task list is empty"),
        ({"train": [], "test": []}, "the task list is empty"),
        ([{"a": 1}, {"a": 1}], "is the same as training task"),  # duplicates: the seeded split puts one in each part
        ({"train": [{"a": 1}, {"a": 2}], "test": [{"a": 2}]}, "task 2 (held out) is the same as training task 1"),
        ([{"kwargs": {"a": 1}, "split": "train"}, {"a": 2}], "give 'split' on every task or on none"),
        ([{"kwargs": {"a": 1}, "split": "train"}], "no held-out tasks"),
        ([{"kwargs": {"a": 1}, "split": "validation"}], "'split' must be one of"),
        ([{"kwargs": {"a": 1}, "actions": [0, 0]}], "distinct action ids"),
        ([{"kwargs": {"a": 1}, "optimal_return": float("nan")}], "'optimal_return' must be a finite number"),
        ([{"kwargs": {"a": 1}, "seed": 3}], "unknown keys ['seed']"),
        ([{"kwargs": [1]}], "'kwargs' must be a dict"),
        ([{"f": object()}], "must be JSON values"),
        (["FrozenLake"], "task 0 must be a dict"),
        ({"training": []}, "must have the keys 'train' and 'test'"),
        ([{"a": 1}], "a seeded split needs at least 2 tasks"),
        ("{not json", "is not valid JSON"),
        ("tasks_module_that_does_not_exist:tasks", "cannot import 'tasks_module_that_does_not_exist'"),
    ],
)
def test_bad_task_lists_raise_task_error(tasks, message):
    with pytest.raises(TaskError) as error:
        load_tasks(tasks)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_files_and_split_sizes(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no tasks file"):
        load_tasks(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("[{]")
    with pytest.raises(TaskError, match="bad.json is not valid JSON"):
        load_tasks(tmp_path / "bad.json")
    with pytest.raises(TaskError, match=r"must be an int in \[1, 3\] \(4 tasks\), got 4"):
        load_tasks(MAPS, num_train=4)
    with pytest.raises(TaskError, match="carry their own 'split'"):
        split_tasks([GymTask({}, "train"), GymTask({"a": 1}, "test")], num_train=1)
    (tmp_path / "raising.py").write_text("def tasks():\n    raise RuntimeError('no maps today')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskError, match="raising:tasks raised RuntimeError: no maps today"):
        load_tasks("raising:tasks")
    with pytest.raises(TaskError, match="has no function 'other'"):
        load_tasks("raising:other")
    with pytest.raises(TypeError, match="tasks must be a file"):
        load_tasks(3)


def test_the_gymnasium_flags_say_how_to_install_it(tmp_path, monkeypatch, capsys):
    """``sys.modules["gymnasium"] = None`` makes ``import gymnasium`` fail as if it were not installed."""
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    tasks = json.dumps(MAPS)
    commands = [
        (data_main, ["generate", "--gym", "FrozenLake-v1", "--tasks", tasks, "-o", str(tmp_path / "d.icrl")]),
        (train_main, ["--env", "FrozenLake-v1", "--tasks", tasks, "--out-dir", str(tmp_path / "run")]),
        (
            train_main,
            ["--gym", "FrozenLake-v1", "--data", str(tmp_path / "d.icrl"), "--out-dir", str(tmp_path / "run")],
        ),
    ]
    for main, argv in commands:
        assert main(argv) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line and 'pip install "icrl-kernels[gym]"' in line, line
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
    # A typo of a built-in name, without --tasks, names the built-in environments.
    assert data_main(["generate", "--env", "dark_rom", "-o", str(tmp_path / "d.icrl")]) == 2
    assert "env must be one of ('dark_room'" in capsys.readouterr().err
    assert data_main(["generate", "--env", "dark_room", "--tasks", tasks, "-o", str(tmp_path / "d.icrl")]) == 2
    assert "'dark_room' is a built-in one (drop --tasks)" in capsys.readouterr().err
