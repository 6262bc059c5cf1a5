"""A gymnasium environment from the command line: ``icrl-data generate --gym ID --tasks FILE`` writes a checked
dataset that records the id and the tasks, ``icrl-train`` trains on it (or generates it in its run folder) and
evaluates in context on the held-out tasks with the built-in environments' table, plot and eval.json; every bad
input is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium", minversion="1.1")

import _gym_envs  # noqa: E402  (needs gymnasium)

from icrl_models.data import load_histories  # noqa: E402
from icrl_models.data.cli import main as data_main  # noqa: E402
from icrl_models.evaluate import EvalReport  # noqa: E402
from icrl_models.train import TrainConfig, make_eval_env_factory  # noqa: E402
from icrl_models.train import main as train_main  # noqa: E402

_gym_envs.register()

MAPS = [["SFF", "FHF", "FFG"], ["SFF", "FFH", "FFG"], ["SHF", "FFF", "HFG"], ["SFH", "FFF", "FFG"],
        ["SFF", "HFF", "FFG"], ["SFF", "FFF", "HFG"]]  # fmt: skip
TINY_TRAIN = ["--steps", "4", "--batch-size", "4", "--seq-len", "16", "--d-model", "16", "--num-heads", "2",
              "--num-layers", "1", "--episode-subsample", "2", "--eval-episodes", "2", "--eval-envs-per-task", "2",
              "--warmup-steps", "1", "--checkpoint-every", "2", "--log-every", "2", "--backend", "eager",
              "--threads", "1", "--no-progress"]  # fmt: skip
TINY_DATA = ["--num-histories", "8", "--num-episodes", "6", "--episode-length", "8"]
#: What every evaluation summary holds, built-in environments or not (icrl_models.evaluate.make_report).
SUMMARY_KEYS = {"final_return", "source_final_return", "fraction_of_source", "fraction_of_optimal",
                "random_final_return", "normalized_score", "num_tasks", "num_envs", "wall_seconds"}  # fmt: skip


@pytest.fixture
def tasks_file(tmp_path) -> Path:
    path = tmp_path / "tasks.json"
    tasks = [{"desc": desc, "is_slippery": False} for desc in MAPS]
    path.write_text(json.dumps({"train": tasks[:4], "test": tasks[4:]}))
    return path


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"{prog}: error: "), err
    return err


def test_generate_train_and_evaluate_a_gymnasium_env(tmp_path, tasks_file, capsys):
    data = tmp_path / "frozen.icrl"
    argv = ["generate", "--gym", "FrozenLake-v1", "--tasks", str(tasks_file), *TINY_DATA, "-o", str(data)]
    assert data_main([*argv, "--no-progress"]) == 0
    histories = load_histories(data)  # validated on load
    meta = histories.metadata
    assert meta["env"]["name"] == meta["env"]["config"]["gym_id"] == "FrozenLake-v1"
    assert meta["env"]["num_observations"] == 9 and meta["env"]["reward_range"] == [0.0, 1.0]
    assert [task["split"] for task in meta["tasks"]] == ["train"] * 4 + ["test"] * 2
    assert meta["tasks"][5]["kwargs"] == {"desc": MAPS[5], "is_slippery": False}
    assert meta["generator"]["name"] == "q_learning" and meta["config"]["tasks"] == str(tasks_file)
    assert set(histories.task_ids.tolist()) == {0, 1, 2, 3}
    assert np.all(np.asarray(histories.task_params["optimal_return"]) == 1.0)  # every map has a path
    assert data_main(["info", str(data)]) == 0
    assert "tasks        4 training, 2 held out" in capsys.readouterr().out

    run = tmp_path / "run"
    assert train_main(["--gym", "FrozenLake-v1", "--data", str(data), "--out-dir", str(run), *TINY_TRAIN]) == 0
    out = capsys.readouterr().out
    assert "| in-context episodes | model | random | model / optimal |" in out and "of optimal" in out
    report = json.loads((run / "eval.json").read_text())
    assert set(report) == set(EvalReport.__dataclass_fields__) and (run / "eval.png").stat().st_size > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]["eval"]
    assert set(summary) == SUMMARY_KEYS and summary["num_tasks"] == 2 and summary["num_envs"] == 4
    assert report["optimal_return"] == 1.0 and report["source_name"] == "q_learning"
    # The evaluation runs on the held-out tasks the dataset recorded, with its time limit.
    config = TrainConfig(**{**json.loads((run / "config.json").read_text()), "track": ()})
    env = make_eval_env_factory(config, histories)(0)
    assert sorted(set(env.task_ids().tolist())) == [4, 5] and env.episode_length == 8


def test_icrl_train_generates_gymnasium_data_in_its_run_folder(tmp_path, tasks_file, capsys):
    run = tmp_path / "run"
    argv = ["--env", "FrozenLake-v1", "--tasks", str(tasks_file), "--num-histories", "8", "--source-episodes", "6",
            "--episode-length", "8", "--out-dir", str(run), *TINY_TRAIN]  # fmt: skip
    assert train_main(argv) == 0
    histories = load_histories(run / "train.icrl")
    assert histories.metadata["env"]["name"] == "FrozenLake-v1" and len(histories.metadata["tasks"]) == 6
    assert json.loads((run / "config.json").read_text())["tasks"] == str(tasks_file)
    capsys.readouterr()
    assert train_main(argv) == 0  # a finished run: its cached data and checkpoint match, nothing runs again
    assert "is already finished" in capsys.readouterr().err
    tasks = json.loads(tasks_file.read_text())
    tasks["test"][0]["is_slippery"] = True  # the same file, other tasks: the cached data no longer fits
    tasks_file.write_text(json.dumps(tasks))
    assert train_main(argv) == 2
    assert "was generated from other tasks than" in _one_line(capsys, "icrl-train")


def test_noise_distillation_runs_where_the_env_has_a_model(tmp_path, tasks_file, capsys):
    base = ["generate", "--tasks", str(tasks_file), *TINY_DATA, "--generator", "noise_distillation", "--no-progress"]
    assert data_main([*base, "--gym", "FrozenLake-v1", "-o", str(tmp_path / "a.icrl")]) == 0
    assert load_histories(tmp_path / "a.icrl").metadata["generator"]["name"] == "noise_distillation"
    chain = json.dumps([{"length": 4}, {"length": 5}])
    argv = ["generate", "--gym", "icrl_test/Chain-v0", "--tasks", chain, "--generator", "noise_distillation",
            "--no-progress", "-o", str(tmp_path / "b.icrl")]  # fmt: skip
    assert data_main(argv) == 2
    assert "no tabular model (unwrapped.P)" in _one_line(capsys, "icrl-data")
    assert not (tmp_path / "b.icrl").exists()


BAD_INPUTS = [
    ("FrozenLak-v1", None, "unknown gymnasium env 'FrozenLak-v1'"),
    ("icrl_test/Spaces-v0", [{}, {"observation": "image"}], "image observation space Box(0, 255, (8, 8, 3), uint8)"),
    ("icrl_test/Spaces-v0", [{"continuous": True}, {}], "continuous action space Box(-1.0, 1.0, (2,), float32)"),
    ("icrl_test/Spaces-v0", [{"observation": "multidiscrete"}, {}], "observation space MultiDiscrete([3 3])"),
    ("FrozenLake-v1", [{}, {"map_name": "5x5"}], "failed to construct: KeyError: '5x5'"),
    ("FrozenLake-v1", [], "the task list is empty"),
    ("FrozenLake-v1", {"train": [{}, {"map_name": "8x8"}], "test": [{"map_name": "8x8"}]}, "is the same as training"),
    ("icrl_test/NoLimit-v0", [{}, {"observation": "discrete"}], "has no time limit (max_episode_steps)"),
]


@pytest.mark.parametrize(("env_id", "tasks", "message"), BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_are_one_line_from_both_commands(tmp_path, tasks_file, capsys, env_id, tasks, message):
    tasks = str(tasks_file) if tasks is None else json.dumps(tasks)
    argv = ["generate", "--gym", env_id, "--tasks", tasks, "--num-histories", "4", "--num-episodes", "2",
            "--no-progress", "-o", str(tmp_path / "d.icrl")]  # fmt: skip
    assert data_main(argv) == 2
    assert message in _one_line(capsys, "icrl-data")
    argv = ["--gym", env_id, "--tasks", tasks, "--num-histories", "4", "--source-episodes", "2",
            "--out-dir", str(tmp_path / "run"), *TINY_TRAIN]  # fmt: skip
    assert train_main(argv) == 2
    assert message in _one_line(capsys, "icrl-train")
    assert not (tmp_path / "d.icrl").exists() and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_dataset_and_the_env_flag_must_agree(tmp_path, tasks_file, capsys):
    data = tmp_path / "frozen.icrl"
    argv = ["generate", "--gym", "FrozenLake-v1", "--tasks", str(tasks_file), *TINY_DATA, "--no-progress"]
    assert data_main([*argv, "-o", str(data)]) == 0
    capsys.readouterr()
    assert train_main(["--data", str(data), "--out-dir", str(tmp_path / "run"), *TINY_TRAIN]) == 2
    assert "holds learning histories of 'FrozenLake-v1', not of env 'dark_room': pass --env FrozenLake-v1" in (
        _one_line(capsys, "icrl-train")
    )
    argv = ["--gym", "FrozenLake-v1", "--data", str(data), "--tasks", str(tasks_file), "--out-dir", str(tmp_path)]
    assert train_main(argv) == 2
    assert "a dataset (--data) records its own" in _one_line(capsys, "icrl-train")


def test_held_out_tasks_are_made_and_sized_when_the_training_data_is(tmp_path, capsys):
    """A held-out map larger than every training map widens the dataset's observation ids (the model's state
    embedding must cover it); a held-out task that cannot be made fails the training data's generation."""
    train = [{"desc": desc, "is_slippery": False} for desc in MAPS[:2]]
    tasks = json.dumps({"train": train, "test": [{"map_name": "8x8"}]})
    argv = ["generate", "--gym", "FrozenLake-v1", "--tasks", tasks, *TINY_DATA, "--no-progress"]
    assert data_main([*argv, "-o", str(tmp_path / "a.icrl")]) == 0
    assert load_histories(tmp_path / "a.icrl").metadata["env"]["num_observations"] == 64
    tasks = json.dumps({"train": train, "test": [{"map_name": "9x9"}]})
    argv = ["generate", "--gym", "FrozenLake-v1", "--tasks", tasks, *TINY_DATA, "--no-progress"]
    assert data_main([*argv, "-o", str(tmp_path / "b.icrl")]) == 2
    assert "task 2 ({'map_name': '9x9'}) failed to construct" in _one_line(capsys, "icrl-data")
