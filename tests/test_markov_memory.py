"""``icrl-markov``'s memory experiment (issue 19): the Cue Corridor tasks, the memory preset's run list,
the paired visible-minus-hidden differences, NaN-tolerant summaries, and a tiny end-to-end run."""

import json
import math

import numpy as np
import pytest

from icrl_models.experiments import harness, markov_report
from icrl_models.experiments import markov_heads as mh
from icrl_models.experiments.markov_heads import MarkovConfig
from icrl_models.models.dt_moa import TrajectoryWindows

# --- the run list --------------------------------------------------------------------------------------


def test_memory_preset_runs_the_memory_axis_and_the_k_axis_not_the_product():
    config = MarkovConfig(preset="memory")
    assert config.tasks == ("cue_visible", "cue_hidden")
    assert (config.n_layer, config.n_head, config.n_embd) == (2, 4, 64)  # cpu's model
    assert config.seeds == (0, 1, 2, 3, 4)
    memory_axis = [(task, c, 10) for c in (2, 4, 8) for task in ("cue_visible", "cue_hidden")]
    k_axis = [(task, 4, k) for k in (3, 5) for task in ("cue_visible", "cue_hidden")]  # (4, 10) is on both axes
    assert config.runs() == memory_axis + k_axis
    assert len(config.runs()) * len(config.seeds) == 50  # not 2 x 3 x 3 x 5 = 90
    paper = MarkovConfig(preset="paper-memory")
    assert (paper.n_layer, paper.n_head, paper.n_embd) == (12, 12, 768)
    assert [(c, k) for _, c, k in paper.runs()[::2]] == [(2, 20), (4, 20), (8, 20), (16, 20), (8, 5), (8, 9)]


def test_runs_of_the_other_designs():
    # The grid-world presets are unchanged: their tasks at every k, no cue task.
    grid = [("dark_room_visible", None, 10), ("key_to_door", None, 10), ("dark_room", None, 10)]
    assert MarkovConfig().runs() == grid
    # Neither axis set: every corridor length at every k, after the grid-world tasks.
    mixed = MarkovConfig(tasks=("cue_hidden", "dark_room"), corridor_lengths=(2, 3), context_lens=(4, 5))
    assert mixed.runs() == [("dark_room", None, 4), ("dark_room", None, 5), ("cue_hidden", 2, 4),
                            ("cue_hidden", 2, 5), ("cue_hidden", 3, 4), ("cue_hidden", 3, 5)]  # fmt: skip
    # Only the memory-need axis.
    only_memory = MarkovConfig(tasks=("cue_visible",), corridor_lengths=(2, 3), context_lens=(4, 5), memory_k=6)
    assert only_memory.runs() == [("cue_visible", 2, 6), ("cue_visible", 3, 6)]
    assert mh.output_stem(only_memory) == "markov-memory" and mh.output_stem(mixed) == "markov"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(corridor_lengths=(0,)), "corridor_lengths must be one or more ints >= 1"),
        (dict(corridor_lengths=()), "corridor_lengths must be one or more ints >= 1"),
        (dict(memory_k=0), "memory_k must be an int >= 1"),
        (dict(corridor_lengths=(2, 4), k_sweep_corridor=3), "k_sweep_corridor must be one of corridor_lengths"),
        (dict(tasks=("cue",)), "tasks must be one or more of"),
        (dict(windows="random"), "windows must be one of"),
    ],
)
def test_bad_memory_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MarkovConfig(**kwargs)


def test_cue_tasks_share_trajectories_and_state_sizes():
    config = MarkovConfig(preset="memory")
    visible, hidden = (mh.make_task(name, config, 4) for name in ("cue_visible", "cue_hidden"))
    assert visible.state_sizes == hidden.state_sizes == (7, 3) and visible.num_actions == 3
    assert visible.episode_length == 8 and (visible.memory_need, hidden.memory_need) == (0, 4)
    assert (hidden.row, hidden.label) == ("cue_hidden_C4", "cue_hidden C=4")
    assert visible.data_seed(1) == hidden.data_seed(1) != mh.make_task("cue_hidden", config, 2).data_seed(1)
    # Same data seed, same trajectories: only the observation after the first step differs.
    small = MarkovConfig(preset="memory", num_histories=3, episodes_per_history=4, progress=False)
    data = [mh.task_data(task, small, task.data_seed(0))[0] for task in (visible, hidden)]
    np.testing.assert_array_equal(data[0].actions, data[1].actions)
    np.testing.assert_array_equal(data[0].rewards, data[1].rewards)
    cells = 7
    np.testing.assert_array_equal(np.asarray(data[0].states) % cells, np.asarray(data[1].states) % cells)
    steps = [TrajectoryWindows(histories, 1) for histories in data]  # the recorded steps, padding dropped
    assert (steps[0].states // cells > 0).all()  # cue_visible: the cue on every step
    np.testing.assert_array_equal(steps[1].states // cells > 0, steps[1].timesteps == 0)  # cue_hidden: first only
    with pytest.raises(ValueError, match="corridor_length is needed"):
        mh.make_task("cue_hidden", config)


def test_rollout_windows_are_the_contexts_a_rollout_sees():
    config = MarkovConfig(preset="memory", num_histories=8, episodes_per_history=6, progress=False)
    assert config.windows == "rollout" and MarkovConfig().windows == "uniform"
    task = mh.make_task("cue_hidden", config, 4)
    histories = mh.task_data(task, config, 0)[0]
    short = TrajectoryWindows(histories, 3)
    batch = mh.rollout_windows(short, 400, np.random.default_rng(0))
    from_start, full = batch["timesteps"][:, 0] == 0, batch["mask"].all(1)
    assert (from_start | full).all() and from_start.any() and (~from_start).any()
    # Uniform starts give windows a rollout never has: started mid-episode yet cut short by its end.
    uniform = short.sample(400, np.random.default_rng(0))
    assert not ((uniform["timesteps"][:, 0] == 0) | uniform["mask"].all(1)).all()
    # A context as long as the episode: every window starts at its episode's start (the cue in view).
    long = mh.rollout_windows(TrajectoryWindows(histories, 10), 400, np.random.default_rng(0))
    assert (long["timesteps"][:, 0] == 0).all() and (long["states"][:, 0] // 7 > 0).all()


# --- paired differences and NaN ------------------------------------------------------------------------


def _fake(task, seed, g, g_state, corridor_length=4, k=10):
    return {"task": task, "seed": seed, "corridor_length": corridor_length, "k": k,
            "g_markov_init_heads": {"0": g}, "g_markov_init_heads_state_tokens": {"0": g_state}}  # fmt: skip


def test_paired_differences_by_hand():
    results = [
        _fake("cue_visible", 0, 0.60, 0.5), _fake("cue_hidden", 0, 0.40, 0.5),
        _fake("cue_visible", 1, 0.50, 0.5), _fake("cue_hidden", 1, 0.55, 0.6),
        _fake("cue_visible", 2, 0.55, 0.5), _fake("cue_hidden", 2, 0.45, 0.3),
        _fake("cue_visible", 3, 0.70, 0.7),  # no cue_hidden of seed 3: not paired
        _fake("cue_visible", 0, 0.9, 0.9, corridor_length=8), _fake("cue_hidden", 0, 0.1, 0.1, corridor_length=8),
    ]  # fmt: skip
    results[0]["g_markov_init_heads"] = {"0": 0.35, "1": 0.25}  # summed over the gated layers: 0.60
    pairs = markov_report.paired_differences(results)
    assert [(p["corridor_length"], p["k"], p["seeds"]) for p in pairs] == [(4, 10, [0, 1, 2]), (8, 10, [0])]
    # Differences 0.20, -0.05, 0.10 = (12, -3, 6) / 60: mean 5/60, deviations (7, -8, 1) / 60,
    # sample variance (49 + 64 + 1) / 2 / 60^2 = 57 / 3600.
    first = pairs[0]
    np.testing.assert_allclose(first["differences"], [0.20, -0.05, 0.10], atol=1e-12)
    assert first["stats"]["mean"] == pytest.approx(5 / 60)
    assert first["stats"]["std"] == pytest.approx(math.sqrt(57) / 60)
    assert first["paper_sign"] == 2 and first["stats"]["n"] == 3
    state = markov_report.paired_differences(results, "g_markov_state_tokens")[0]
    np.testing.assert_allclose(state["differences"], [0.0, -0.1, 0.2], atol=1e-12)
    assert state["paper_sign"] == 1  # a zero difference is not the paper's sign
    merged = markov_report.memory_pairs(results)[0]
    assert merged["g_markov"]["paper_sign"] == 2 and merged["g_markov_state_tokens"]["mean"] == pytest.approx(0.1 / 3)
    table = "\n".join(markov_report._pair_table({(4, 10): merged}, [(4, 10)]))
    assert "| 4 | 10 | 0.083 ± 0.126 (n=3) | +0.200, -0.050, +0.100 | 2/3 |" in table


def test_nan_tolerant_stats_leave_nan_out_and_count_it():
    stats = markov_report.nan_tolerant_stats([1.0, math.nan, 3.0])
    assert (stats["mean"], stats["n"], stats["nan"]) == (2.0, 2, 1)
    assert stats["std"] == pytest.approx(math.sqrt(2)) and math.isnan(stats["values"][1])
    assert markov_report._fmt(stats) == "2.000 ± 1.414 (n=2, 1 NaN)"
    none = markov_report.nan_tolerant_stats([math.nan, math.inf])
    assert none["n"] == 0 and none["nan"] == 2 and math.isnan(none["mean"])
    assert markov_report._fmt(none) == "NaN (n=0, 2 NaN)"
    expected = harness.format_stats(harness.seed_stats([0.5, 0.7]))
    assert markov_report._fmt(markov_report.nan_tolerant_stats([0.5, 0.7])) == expected
    with pytest.raises(ValueError, match="values must not contain NaN"):  # the strict path is unchanged
        harness.seed_stats([1.0, math.nan])


# --- end to end ----------------------------------------------------------------------------------------

TINY = ["--seeds", "0", "--steps", "4", "--eval-every", "2", "--num-histories", "4", "--episodes-per-history", "3",
        "--analysis-windows", "8", "--eval-envs", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--markov-heads", "0", "--corridor-lengths", "2", "3", "--memory-k", "5", "--k-sweep-corridor", "2",
        "--context-lens", "2", "5", "--backend", "eager", "--no-progress", "--scheduler", "local"]  # fmt: skip


def test_memory_preset_tiny_end_to_end(tmp_path, monkeypatch):
    original = mh.run_task

    def run_task(task, k, seed, *args, **kwargs):  # one diverged run: its held-out loss is NaN
        result = original(task, k, seed, *args, **kwargs)
        if task.row == "cue_hidden_C3":
            result["held_out_loss"] = math.nan
        return result

    monkeypatch.setattr(mh, "run_task", run_task)
    out = tmp_path / "memory"
    assert mh.main(["--preset", "memory", *TINY, "--out-dir", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["markov-memory.json", "markov-memory.md",
                                                           "markov-memory.png", "runs"]  # fmt: skip
    assert len(list((out / "runs").glob("*.json"))) == 6  # one stored result per run
    report = json.loads((out / "markov-memory.json").read_text())
    runs = [(task, c, k) for c, k in ((2, 5), (3, 5), (2, 2)) for task in ("cue_visible", "cue_hidden")]
    assert [(r["task"], r["corridor_length"], r["k"]) for r in report["results"]] == runs
    assert report["complete"] and report["files"][0] == "markov-memory.json"
    for r in report["results"]:
        assert 0.0 <= r["success_rate"] <= 1.0 and 0.0 <= r["success_rate_random"] <= 1.0
        assert r["memory_need"] == (0 if r["task"] == "cue_visible" else r["corridor_length"])
        assert all(math.isfinite(r[key]["0"]) for key in ("g_markov_init_heads", "g_markov_init_heads_state_tokens"))
    hidden = report["summary"]["cue_hidden_C3"]["5"]
    assert hidden["held_out_loss"]["nan"] == 1 and hidden["held_out_loss"]["n"] == 0
    assert [(p["corridor_length"], p["k"]) for p in report["memory_pairs"]] == [(2, 5), (3, 5), (2, 2)]
    table = (out / "markov-memory.md").read_text()
    assert "### Against memory need (k = 5)" in table and "### Against context length k (C = 2" in table
    for row in ("| cue_visible | 2 | 0 | 5 |", "| cue_hidden | 2 | 2 | 5 |", "| cue_visible | 3 | 0 | 5 |",
                "| cue_hidden | 3 | 3 | 5 |", "| cue_visible | 2 | 0 | 2 |", "| cue_hidden | 2 | 2 | 2 |",
                "| 2 | 5 | ", "| 3 | 5 | ", "| 2 | 2 | "):  # fmt: skip
        assert row in table, row
    assert table.count("| cue_hidden | 2 | 2 | 5 |") == 2  # on both axes
    assert "NaN (n=0, 1 NaN)" in table and "came out NaN" in table
    assert "## Returns and G_Markov" not in table  # no grid-world task ran

    # A rerun (a resumed sweep) trains nothing: every run's stored result is reused, with the same report.
    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(mh, "run_task", no_training)
    assert mh.main(["--preset", "memory", *TINY, "--out-dir", str(out)]) == 0
    assert json.loads((out / "markov-memory.json").read_text())["results"] == report["results"]


def test_raw_results_are_written_before_the_summary(tmp_path, monkeypatch):
    def broken_summary(results):
        raise RuntimeError("summary failed")

    monkeypatch.setattr(mh, "summarize", broken_summary)
    out = tmp_path / "memory"
    config = mh.config_from_args(MarkovConfig, mh.build_parser().parse_args([*TINY, "--tasks", "cue_hidden",
                                                                            "--out-dir", str(out)]))  # fmt: skip
    with pytest.raises(RuntimeError, match="summary failed"):
        mh.run_experiment(config)
    report = json.loads((out / "markov-memory.json").read_text())
    assert report["complete"] is False and "summary" not in report
    assert [(r["corridor_length"], r["k"]) for r in report["results"]] == [(2, 5), (3, 5), (2, 2)]


def test_a_runs_key_does_not_depend_on_the_seed_list():
    """A sweep split over seeds (``--seeds 5 6 7`` beside ``--seeds 8 9``, then ``--seeds 0 ... 9`` for the report)
    reuses every finished run: the seed list only says which trials run; the run's own seed, task, corridor
    length and k are in its key."""

    def trial(seeds, seed=4, k=10):
        return mh.MarkovTrial(MarkovConfig(preset="memory", seeds=seeds), seed, "cue_hidden", 8, k)

    assert trial((4, 8, 9)).key() == trial(tuple(range(10))).key() == trial((4,)).key()
    assert trial((4, 5)).key() != trial((4, 5), seed=5).key()
    assert trial((4,)).key() != trial((4,), k=20).key()
