"""The shared experiment harness (icrl_models.experiments.harness): seed statistics against hand-worked
numbers, result files that start with their provenance, preset errors, and the cached dataset."""

from __future__ import annotations

import dataclasses
import json
import platform
import shlex
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from icrl_models.experiments import harness
from icrl_models.experiments.harness import (
    cached_dataset,
    check_preset,
    command_string,
    fill_from_preset,
    format_stats,
    machine_description,
    preset_help,
    seed_stats,
    warmup_then_constant,
    write_results,
)

# --- seeds -----------------------------------------------------------------------------------------


def test_seed_stats_hand_worked():
    # mean (1 + 2 + 6) / 3 = 3; squared deviations 4 + 1 + 9 = 14; sample variance 14 / 2 = 7.
    stats = seed_stats([1.0, 2.0, 6.0])
    assert stats == {"mean": 3.0, "std": pytest.approx(7**0.5), "min": 1.0, "max": 6.0, "n": 3,
                     "values": [1.0, 2.0, 6.0]}  # fmt: skip
    # Two seeds: deviations +-0.5, sample variance (0.25 + 0.25) / 1 = 0.5 (ddof=0 would give 0.25).
    assert seed_stats([4, 5])["std"] == pytest.approx(0.5**0.5)
    # numpy arrays and ints are read as floats; the result is JSON-ready (plain Python numbers).
    stats = seed_stats(np.array([2, 2], dtype=np.int64))
    assert stats["std"] == 0.0 and type(stats["mean"]) is float and type(stats["n"]) is int
    json.dumps(stats)


def test_seed_stats_one_seed_has_zero_spread():
    assert seed_stats([0.25]) == {"mean": 0.25, "std": 0.0, "min": 0.25, "max": 0.25, "n": 1, "values": [0.25]}


@pytest.mark.parametrize(
    "values, message",
    [([], "non-empty"), ([1.0, float("nan")], "NaN"), ([[1.0, 2.0]], "1-D"), (["a"], "numbers"), (None, "")],
)
def test_seed_stats_bad_input_names_values(values, message):
    with pytest.raises(ValueError, match=f"values must.*{message}"):
        seed_stats(values)


def test_format_stats_hand_worked():
    assert format_stats({"mean": 0.5, "std": 0.04, "n": 3, "values": [0.46, 0.5, 0.54]}) == "0.500 ± 0.040 (n=3)"
    assert format_stats(seed_stats([1.0, 2.0, 6.0]), digits=2) == "3.00 ± 2.65 (n=3)"  # sqrt(7) = 2.6458
    assert format_stats(seed_stats([0.123456]), digits=4) == "0.1235 (n=1)"
    # Summaries written before "n" existed (older markov.json files) count their values.
    assert format_stats({"mean": 1.0, "std": 0.5, "values": [0.5, 1.5]}, 1) == "1.0 ± 0.5 (n=2)"
    with pytest.raises(ValueError, match="digits"):
        format_stats(seed_stats([1.0]), digits=-1)


# --- presets ---------------------------------------------------------------------------------------


@dataclass
class _Config:
    preset: str = "cpu"
    steps: int | None = None
    width: int | None = None

    def __post_init__(self) -> None:
        fill_from_preset(self, _PRESETS)


_PRESETS = {"cpu": {"steps": 10, "width": 8}, "paper": {"steps": 1000, "width": 512}}


def test_presets_fill_only_unset_fields():
    assert (_Config().steps, _Config().width) == (10, 8)
    assert dataclasses.astuple(_Config(preset="paper", steps=3)) == ("paper", 3, 512)  # the explicit flag wins


@pytest.mark.parametrize("name", ["huge", "", None, "CPU"])
def test_unknown_preset_names_preset(name):
    with pytest.raises(ValueError, match=r"preset must be one of \('cpu', 'paper'\), got"):
        _Config(preset=name)
    with pytest.raises(ValueError, match="preset must be one of"):
        check_preset(name, ("cpu", "paper"))  # a tuple of names works as well as a dict


def test_preset_help_shows_every_preset_default():
    presets = {"cpu": {"seeds": (0, 1)}, "paper": {"seeds": (0, 1, 2)}}
    assert preset_help(presets, "seeds", "seeds") == "seeds (default: from --preset, cpu 0 1, paper 0 1 2)"


def test_warmup_then_constant():
    assert [warmup_then_constant(step, 1.0, 4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_then_constant(0, 3e-3, 0) == 3e-3


# --- result files ----------------------------------------------------------------------------------


def test_write_results_md_starts_with_command_and_machine(tmp_path):
    result = {"score": 0.5, "per_seed": [0.4, 0.6]}
    paths = write_results(tmp_path / "out", "exp", result, "| a | b |\n|---|---|\n", command="icrl-x --steps 3",
                          machine="Some CPU (2 cores); torch 9; Python 3")  # fmt: skip
    assert paths == {"json": tmp_path / "out" / "exp.json", "md": tmp_path / "out" / "exp.md"}
    lines = paths["md"].read_text().splitlines()
    assert lines[:5] == ["Command: `icrl-x --steps 3`", "", "Machine: Some CPU (2 cores); torch 9; Python 3", "",
                         "| a | b |"]  # fmt: skip
    assert paths["md"].read_text().endswith("|---|---|\n")
    written = json.loads(paths["json"].read_text())
    assert written == {"command": "icrl-x --steps 3", "machine": "Some CPU (2 cores); torch 9; Python 3", **result}
    assert result == {"score": 0.5, "per_seed": [0.4, 0.6]}  # the caller's dict is left alone


def test_write_results_defaults_to_this_process(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/icrl-demo", "--out-dir", "a b"])
    paths = write_results(tmp_path, "run", {"x": 1}, "text")
    first, _, machine = paths["md"].read_text().splitlines()[:3]
    assert first == "Command: `icrl-demo --out-dir 'a b'`"  # quoted as a shell would need it
    assert machine == f"Machine: {machine_description()}"
    assert json.loads(paths["json"].read_text())["machine"] == machine_description()


def test_write_results_without_markdown_writes_only_json(tmp_path):
    paths = write_results(tmp_path, "compare", {"x": 1}, None, command="icrl-compare")
    assert list(paths) == ["json"] and sorted(p.name for p in tmp_path.iterdir()) == ["compare.json"]


@pytest.mark.parametrize("stem", ["", "a/b", "../x"])
def test_write_results_bad_stem(tmp_path, stem):
    with pytest.raises(ValueError, match="stem must be"):
        write_results(tmp_path, stem, {}, "x", command="c")


def test_write_results_refuses_to_overwrite_result_keys(tmp_path):
    with pytest.raises(ValueError, match="result must not hold the keys \\['command'\\]"):
        write_results(tmp_path, "x", {"command": "mine"}, "x", command="c")
    with pytest.raises(TypeError, match="result must be a dict"):
        write_results(tmp_path, "x", [1, 2], "x", command="c")


def test_command_string_quotes_arguments(monkeypatch):
    assert command_string("icrl-markov", ["--tasks", "dark_room", "--out-dir", "my runs"]) == (
        "icrl-markov --tasks dark_room --out-dir 'my runs'"
    )
    monkeypatch.setattr(sys, "argv", ["/x/bin/icrl-looped", "--steps", "5"])
    assert command_string() == "icrl-looped --steps 5" and command_string("p") == "p --steps 5"
    assert shlex.split(command_string("p", ["a'b", ""]))[1:] == ["a'b", ""]


def test_machine_description_names_cpu_torch_and_python(monkeypatch):
    text = machine_description("cpu")
    assert text.endswith(f"; torch {torch.__version__}; Python {platform.python_version()}")
    monkeypatch.setattr(harness, "_cpu_model", lambda: "Test CPU 9000")
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 7)
    assert machine_description(torch.device("cpu")).startswith("Test CPU 9000 (7 cores); torch ")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device argument is checked to exist
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert machine_description("cuda").startswith("GPU NVIDIA H100 80GB HBM3; torch ")


# --- the cached dataset ----------------------------------------------------------------------------


def test_cached_dataset_generates_once_then_reuses(tmp_path, monkeypatch):
    from icrl_models.data import load_histories
    from icrl_models.train import TrainConfig

    config = TrainConfig(env="dark_room", num_histories=3, source_episodes=2, eval_episodes=1, progress=False)
    path = cached_dataset(tmp_path / "run" / "train.icrl", config, progress=False)
    assert path == tmp_path / "run" / "train.icrl"
    histories = load_histories(path)
    assert histories.lengths.shape[0] == 3
    before = path.read_bytes()

    def must_not_generate(*args, **kwargs):
        raise AssertionError("the cached file should have been reused")

    import icrl_models.data as data

    monkeypatch.setattr(data, "generate_histories", must_not_generate)
    assert cached_dataset(path, dataclasses.replace(config, num_histories=5), progress=False) == path
    assert path.read_bytes() == before
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".partial")]


# --- CPU time estimates and per-seed configs ------------------------------------------------------------


def test_step_cost_scales_with_steps_and_work():
    cost = harness.StepCost(seconds=0.5, work=100.0, source="a run")
    assert cost.estimate(10) == pytest.approx(5.0)  # 10 steps of the calibration run's size
    assert cost.estimate(10, work=300.0) == pytest.approx(15.0)  # 3x the work per step
    # batch x tokens x blocks x width^2
    assert harness.transformer_work(2, 3, 4, 5) == 2 * 3 * 4 * 25


def test_train_run_estimate_counts_steps_and_evaluations():
    """An icrl-train run: training steps at its model's calibrated cost, plus each evaluation's rollout steps."""
    from icrl_models.train import TrainConfig

    config = TrainConfig(model="ad", env="bernoulli_bandit", num_arms="4-20", seq_len=300, batch_size=16, steps=100,
                         eval_episodes=1, eval_tasks=10)  # fmt: skip
    train_only = harness.TRAIN_STEP_COSTS["ad"].estimate(100, harness.transformer_work(16, 300, 2, 64))
    one, three = harness.train_run_cpu_seconds(config), harness.train_run_cpu_seconds(config, evaluations=3)
    assert one > train_only and three - train_only == pytest.approx(3 * (one - train_only))
    longer = harness.train_run_cpu_seconds(dataclasses.replace(config, steps=200))
    assert longer - one == pytest.approx(train_only)


def test_print_cpu_estimate_says_it_is_an_estimate(capsys):
    harness.print_cpu_estimate("a run", 600.0)
    assert capsys.readouterr().err.startswith("icrl: a run: estimated CPU time ~10 min (an estimate")
    harness.print_cpu_estimate("a run", 30.0, device="cuda:0")
    assert "no CPU time estimate on cuda:0" in capsys.readouterr().err


def test_per_seed_configs_one_folder_per_seed():
    @dataclass
    class Config:
        seed: int = 0
        seeds: tuple[int, ...] = (3, 5)
        out_dir: str = "out"
        steps: int = 7

    configs = harness.per_seed_configs(Config())
    assert configs == {
        3: Config(seed=3, seeds=(), out_dir="out/seed3"),
        5: Config(seed=5, seeds=(), out_dir="out/seed5"),
    }
