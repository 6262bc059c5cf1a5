"""``icrl-compare``'s sweep over settings and seeds (the N-gram paper's Figures 2 and 3): presets, the trial
list, Expected Max Performance over seeds, the result files, and that finished trials are not trained again."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from icrl_models.config import add_config_arguments, config_from_args, make_parser
from icrl_models.experiments.ngram_ad import (
    PRESETS,
    CompareConfig,
    _best_run_success,
    build_trials,
    compare,
    emp_over_seeds,
    expected_max_performance,
    sample_assignment,
)
from icrl_models.train import TrainConfig

# A tiny model and evaluation: every trial trains a few steps and rolls out 2 episodes on 2 held-out tasks,
# one trial after another in this process (Ray Tune sweeps have their own test, test_sweep.py).
TINY = dict(runs=2, steps=2, batch_size=4, d_model=16, num_heads=2, num_layers=1, source_episodes=20,
            eval_tasks=2, eval_episodes=2, eval_envs_per_task=1, backend="eager", progress=False,
            scheduler="local")  # fmt: skip


def test_goals_preset_builds_every_setting_seed_assignment_and_model():
    config = CompareConfig(preset="goals")
    assert config.env == "dark_room" and config.settings() == [(10, 1000), (20, 1000), (30, 1000)]
    assert config.seeds == (0, 1, 2) and config.result_stem() == "ngram-ad-goals"
    trials = build_trials(config)
    assert len(trials) == 3 * 3 * config.runs * 2
    for trial in trials:
        run = trial.config
        assert (run.num_train_tasks, run.num_histories) == trial.setting and run.seed == trial.seed
        assert run.model == trial.model and run.steps == config.steps and run.eval_tasks == config.eval_tasks
        assert run.episode_length is None  # Dark Room's own 20 steps
        assert all(getattr(run, name) == value for name, value in trial.assignment.items())
    # One dataset per (setting, seed), shared by both models and every assignment; one folder per trial.
    assert len({t.config.data for t in trials}) == 9 and len({t.config.out_dir for t in trials}) == len(trials)
    # A seed draws the same assignments in every setting and for both models; other seeds draw others.
    by_seed = {}
    for t in trials:
        by_seed.setdefault((t.seed, t.index), []).append(t.assignment)
    assert all(len(a) == 6 and all(x == a[0] for x in a) for a in by_seed.values())
    assert by_seed[(0, 0)][0] != by_seed[(1, 0)][0]


def test_key_to_door_and_paper_presets():
    config = CompareConfig(preset="key-to-door")
    assert config.env == "key_to_door" and config.settings() == [(100, 500), (100, 750), (100, 1000)]
    assert config.result_stem() == "key-to-door"
    assert {t.config.episode_length for t in build_trials(config)} == {40}  # the paper's Appendix C
    assert config.steps == 10_000, "at 2500 steps N-Gram AD led on Key-to-Door; at 10k the two tie"
    for name, runs in (("goals-paper", 500), ("key-to-door-paper", 400)):
        paper = CompareConfig(preset=name)
        assert (
            paper.runs == runs
            and paper.steps == 10_000
            and paper.settings() == CompareConfig(preset=name.removesuffix("-paper")).settings()
        )
    assert CompareConfig(preset="goals-paper").result_stem() == "ngram-ad-goals"
    assert CompareConfig().result_stem() == "compare"


def test_flags_win_over_the_preset_and_no_preset_keeps_one_setting_one_seed():
    parser = make_parser("icrl-compare", None)
    add_config_arguments(parser, CompareConfig)
    args = parser.parse_args(["--preset", "key-to-door", "--num-histories", "600", "--seed", "4", "--steps", "7"])
    config = config_from_args(CompareConfig, args)
    assert config.settings() == [(100, 600)] and config.seeds == (4,) and config.steps == 7
    assert config.runs == PRESETS["key-to-door"]["runs"] and config.episode_length == 40
    default = config_from_args(CompareConfig, parser.parse_args([]))
    assert default.preset is None and default.settings() == [(None, 1000)] and default.seeds == (0,)
    trials = build_trials(default)
    assert len(trials) == 2 * default.runs
    assert trials[0].config.out_dir.endswith("compare/goalsdefault-histories1000/seed0/ad-000")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(preset="goal"), "preset must be one of"),
        (dict(seeds=(0, 0)), "seeds must be distinct ints >= 0"),
        (dict(num_histories=(0,)), "num_histories must be distinct ints >= 1"),
        (dict(num_train_tasks=()), "num_train_tasks must be distinct ints >= 1"),
        (dict(eval_tasks=-1), "eval_tasks must be >= 0"),
        (dict(hyperparameters="grid"), "hyperparameters must be one of"),
        (dict(preset="goals", steps=0), "steps must be >= 1"),
        (dict(models=("ad", "dt")), "models must be distinct names from"),
        (dict(models=("ad", "ad")), "models must be distinct names from"),
        (dict(models=()), "models must be distinct names from"),
    ],
)
def test_bad_sweep_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompareConfig(**kwargs)


def test_emp_over_seeds_hand_worked():
    # Seed 0 scores {0, 1}: E[max of 1] = 0.5, E[max of 2] = 1 - P(both draws are 0) = 0.75.
    # Seed 1 scores {1} (its NaN and None scores are left out): 1 and 1.
    result = emp_over_seeds({0: [0.0, 1.0], 1: [1.0, None, float("nan")]}, 2)
    assert result["per_seed"] == {"0": [0.5, 0.75], "1": [1.0, 1.0]} and result["seeds"] == [0, 1]
    np.testing.assert_allclose(result["mean"], [0.75, 0.875])
    # Sample sd of two values a, b is |a - b| / sqrt(2).
    np.testing.assert_allclose(result["std"], [0.5 / np.sqrt(2), 0.25 / np.sqrt(2)])
    one = emp_over_seeds({3: [0.2, 0.4, 0.9]}, 3)
    np.testing.assert_allclose(one["mean"], expected_max_performance([0.2, 0.4, 0.9]))
    assert one["std"] == [0.0, 0.0, 0.0]
    assert emp_over_seeds({0: [None], 1: []}, 2) is None


def test_goals_sweep_end_to_end_writes_the_files(tmp_path, capsys):
    config = CompareConfig(preset="goals", num_train_tasks=(10, 20), num_histories=(6,), seeds=(0, 1),
                           out_dir=str(tmp_path), **TINY)  # fmt: skip
    result = compare(config, command="icrl-compare --preset goals (test)")
    assert sorted(p.name for p in tmp_path.glob("ngram-ad-goals.*")) == [
        "ngram-ad-goals.json", "ngram-ad-goals.md", "ngram-ad-goals.png"
    ]  # fmt: skip
    assert (tmp_path / "ngram-ad-goals.png").read_bytes()[:4] == b"\x89PNG"
    stored = json.loads((tmp_path / "ngram-ad-goals.json").read_text())
    assert stored["command"] == "icrl-compare --preset goals (test)" and stored["machine"]
    assert len(stored["trials"]) == 2 * 2 * 2 * 2 and {t["status"] for t in stored["trials"]} == {"trained"}
    assert [(s["num_train_tasks"], s["seeds"]) for s in stored["settings"]] == [(10, [0, 1]), (20, [0, 1])]
    for setting in result["settings"]:
        for model in ("ad", "ngram_ad"):
            emp = setting["expected_max_performance"][model]
            scores = {seed: [t["score"] for t in result["trials"] if (t["seed"], t["model"]) == (seed, model)
                             and t["num_train_tasks"] == setting["num_train_tasks"]] for seed in (0, 1)}  # fmt: skip
            assert emp == emp_over_seeds(scores, 2)
    markdown = (tmp_path / "ngram-ad-goals.md").read_text()
    assert markdown.startswith("Command: `icrl-compare --preset goals (test)`")
    assert "## Dark Room: 10 training goals, 6 histories (seeds 0, 1)" in markdown
    assert "## Dark Room: 20 training goals, 6 histories (seeds 0, 1)" in markdown
    assert "| 2 | " in markdown and "(n=2)" in markdown and "Best single run" in markdown
    for setting in result["settings"]:  # the random policy's level: every trial's, averaged per seed, then over seeds
        per_seed = [np.mean([t["random_score"] for t in result["trials"] if t["seed"] == seed
                             and t["num_train_tasks"] == setting["num_train_tasks"]]) for seed in (0, 1)]  # fmt: skip
        assert setting["source"]["random_score"]["mean"] == pytest.approx(np.mean(per_seed))
    assert "The random policy there: " in markdown
    trial_rows = markdown.split("## Trials")[1].strip().splitlines()[2:]
    assert len(trial_rows) == 16 and all(row.endswith("| trained |") for row in trial_rows)
    assert "## Dark Room: 10 training goals" in capsys.readouterr().out


def test_default_hyperparameters_train_once_per_model_setting_and_seed(tmp_path):
    config = CompareConfig(preset="goals", num_train_tasks=(10, 20), num_histories=(6,), seeds=(0, 1),
                           out_dir=str(tmp_path), hyperparameters="defaults", **TINY)  # fmt: skip
    assert config.runs == 1, "one fixed assignment: more runs would repeat the same training"
    trials = build_trials(config)
    assert len(trials) == 2 * 2 * 2 and all(t.assignment == {} for t in trials)
    table1_fields = sample_assignment(np.random.default_rng(0))
    for trial in trials:  # every Table 1 field keeps icrl-train's default
        assert {name: getattr(trial.config, name) for name in table1_fields} == {
            name: getattr(TrainConfig(), name) for name in table1_fields
        }
    result = compare(config, command="icrl-compare --preset goals --hyperparameters defaults (test)")
    assert sorted(p.name for p in tmp_path.glob("ngram-ad-goals*")) == [
        "ngram-ad-goals-defaults.json", "ngram-ad-goals-defaults.md", "ngram-ad-goals-defaults.png"
    ]  # fmt: skip
    assert (tmp_path / "ngram-ad-goals-defaults.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (tmp_path / "ngram-ad-goals-defaults.md").read_text()
    assert "with icrl-train's default hyperparameters" in markdown and "| icrl-train defaults |" in markdown
    for setting in result["settings"]:
        for model in ("ad", "ngram_ad"):
            scores = [t["score"] for t in result["trials"]
                      if t["model"] == model and t["num_train_tasks"] == setting["num_train_tasks"]]  # fmt: skip
            assert setting["expected_max_performance"][model]["mean"] == [pytest.approx(np.mean(scores))]


def test_one_model_trains_alone_and_the_files_show_only_it(tmp_path):
    parser = make_parser("icrl-compare", "")
    add_config_arguments(parser, CompareConfig)
    both = config_from_args(CompareConfig, parser.parse_args(["--models", "ngram_ad", "ad"]))
    assert both.models == ("ad", "ngram_ad"), "AD first, as in every table"
    config = CompareConfig(preset="key-to-door", num_histories=(4, 6), seeds=(0,), out_dir=str(tmp_path),
                           hyperparameters="defaults", models=("ad",), **{**TINY, "eval_episodes": 1})  # fmt: skip
    assert [t.model for t in build_trials(config)] == ["ad", "ad"]
    result = compare(config, command="icrl-compare --preset key-to-door --hyperparameters defaults --models ad")
    assert [t["model"] for t in result["trials"]] == ["ad", "ad"]
    for setting in result["settings"]:
        assert set(setting["expected_max_performance"]) == set(setting["success_rate"]) == {"ad"}
    markdown = (tmp_path / "key-to-door-defaults.md").read_text()
    assert "| assignments | AD |" in markdown and "N-Gram AD" not in markdown
    assert (tmp_path / "key-to-door-defaults.png").read_bytes()[:4] == b"\x89PNG"


def test_success_rate_is_each_seeds_best_run_hand_worked():
    def row(seed, model, score, success):
        return {"seed": seed, "model": model, "score": score, "success_rate": success}

    rows = [row(0, "ad", 0.2, 0.1), row(0, "ad", 0.5, 0.3),  # seed 0: the 0.5 run is best, success 0.3
            row(1, "ad", 0.4, 0.0), row(1, "ad", None, 1.0),  # seed 1: an unscored run never counts
            row(0, "ngram_ad", 0.9, None), row(1, "ngram_ad", 0.8, None)]  # fmt: skip
    stats = _best_run_success(rows, (0, 1), "ad")
    assert stats["values"] == [0.3, 0.0] and stats["mean"] == pytest.approx(0.15)
    assert stats["std"] == pytest.approx(0.3 / np.sqrt(2))
    assert _best_run_success(rows, (0, 1), "ngram_ad") is None, "Dark Room has no success rate"
    assert _best_run_success(rows, (2,), "ad") is None


def test_key_to_door_with_default_hyperparameters_reports_success_rates(tmp_path):
    config = CompareConfig(preset="key-to-door", num_histories=(4, 6), seeds=(0, 1), out_dir=str(tmp_path),
                           hyperparameters="defaults", **{**TINY, "eval_episodes": 1})  # fmt: skip
    result = compare(config, command="icrl-compare --preset key-to-door --hyperparameters defaults (test)")
    for setting in result["settings"]:
        for model in ("ad", "ngram_ad"):
            per_run = [t["success_rate"] for t in result["trials"]
                       if t["model"] == model and t["num_histories"] == setting["num_histories"]]  # fmt: skip
            assert len(per_run) == 2 and setting["success_rate"][model]["values"] == per_run
    markdown = (tmp_path / "key-to-door-defaults.md").read_text()
    assert markdown.count("Success rate (final episodes that solve the task) of each run") == 2
    assert (tmp_path / "key-to-door-defaults.png").read_bytes()[:4] == b"\x89PNG"


def test_finished_trials_are_not_trained_again(tmp_path, monkeypatch):
    import icrl_models.data
    import icrl_models.train

    calls = {"batches": 0, "evaluations": 0, "generations": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    windows = icrl_models.train.HistoryWindows
    monkeypatch.setattr(windows, "get_batch", counting("batches", windows.get_batch))
    monkeypatch.setattr(icrl_models.train, "run_evaluation", counting("evaluations", icrl_models.train.run_evaluation))
    monkeypatch.setattr(
        icrl_models.data, "generate_histories", counting("generations", icrl_models.data.generate_histories)
    )

    config = CompareConfig(preset="key-to-door", num_histories=(4,), seeds=(1,), out_dir=str(tmp_path),
                           **{**TINY, "runs": 1, "eval_episodes": 1})  # fmt: skip
    first = compare(config, command="first")
    assert calls == {"batches": 2 * config.steps, "evaluations": 2, "generations": 1}
    assert [t["status"] for t in first["trials"]] == ["trained", "trained"]
    assert (tmp_path / "key-to-door.md").exists() and (tmp_path / "key-to-door.png").exists()
    metrics = sorted(tmp_path.rglob("metrics.jsonl"))
    before = [path.read_text() for path in metrics]

    calls.update(batches=0, evaluations=0, generations=0)
    second = compare(config, command="second")
    assert calls == {"batches": 0, "evaluations": 0, "generations": 0}  # nothing trained, evaluated or generated
    assert [t["status"] for t in second["trials"]] == ["reused", "reused"]
    assert [t["score"] for t in second["trials"]] == [t["score"] for t in first["trials"]]
    assert [path.read_text() for path in metrics] == before  # no second evaluation row


def test_trials_of_earlier_result_files_are_reused_where_every_run_setting_matches(tmp_path, monkeypatch, capsys):
    import icrl_models.experiments.ngram_ad as ngram_ad

    first = compare(CompareConfig(preset="goals", num_train_tasks=(10,), num_histories=(6,), seeds=(0,),
                                  out_dir=str(tmp_path / "first"), **TINY), command="first")  # fmt: skip
    stored = tmp_path / "first" / "ngram-ad-goals.json"
    trained = []
    real_run_trial = ngram_ad.run_trial
    monkeypatch.setattr(ngram_ad, "run_trial", lambda config: trained.append(config.out_dir) or real_run_trial(config))

    # A second setting added to a sweep whose run folders are gone: only its trials train.
    merged = compare(CompareConfig(preset="goals", num_train_tasks=(10, 20), num_histories=(6,), seeds=(0,),
                                   out_dir=str(tmp_path / "second"), reuse_results=(str(stored),), **TINY),
                     command="second")  # fmt: skip
    assert len(trained) == 4 and all("goals20-" in path for path in trained)
    ten = [t for t in merged["trials"] if t["num_train_tasks"] == 10]
    assert [t["status"] for t in ten] == ["reused"] * 4 and {t["reused_from"] for t in ten} == {str(stored)}
    assert [t["out_dir"] for t in ten] == [t["out_dir"] for t in first["trials"]]  # where they trained
    assert [t["score"] for t in ten] == [t["score"] for t in first["trials"]]
    assert merged["settings"][0]["expected_max_performance"] == first["settings"][0]["expected_max_performance"]
    assert {t["status"] for t in merged["trials"] if t["num_train_tasks"] == 20} == {"trained"}
    assert "4 of 8 trials reused from" in capsys.readouterr().err

    # A file whose runs trained or were scored otherwise stands in for nothing.
    trained.clear()
    compare(CompareConfig(preset="goals", num_train_tasks=(10,), num_histories=(6,), seeds=(0,),
                          out_dir=str(tmp_path / "third"), reuse_results=(str(stored),),
                          **{**TINY, "steps": 3, "eval_episodes": 3}), command="third")  # fmt: skip
    assert len(trained) == 4
    assert "nothing reused from" in (err := capsys.readouterr().err) and "steps, eval_episodes differ" in err


def test_report_only_trains_nothing_and_keeps_only_complete_seeds(tmp_path, monkeypatch):
    import icrl_models.experiments.ngram_ad as ngram_ad

    first = compare(CompareConfig(preset="goals", num_train_tasks=(10,), num_histories=(6,), seeds=(0, 1),
                                  out_dir=str(tmp_path / "first"), **TINY), command="first")  # fmt: skip
    stored = json.loads((tmp_path / "first" / "ngram-ad-goals.json").read_text())
    # Seed 1 lost one of its four trials.
    stored["trials"] = [t for t in stored["trials"] if (t["seed"], t["model"], t["index"]) != (1, "ngram_ad", 1)]
    (partial := tmp_path / "partial.json").write_text(json.dumps(stored))
    read_back = []
    real_run_trial = ngram_ad.run_trial
    monkeypatch.setattr(ngram_ad, "run_trial", lambda cfg: read_back.append(cfg.out_dir) or real_run_trial(cfg))

    config = CompareConfig(preset="goals", num_train_tasks=(10, 20), num_histories=(6,), seeds=(0, 1),
                           out_dir=str(tmp_path / "report"), reuse_results=(str(partial),), report_only=True,
                           **TINY)  # fmt: skip
    report = compare(config, command="report")
    assert read_back == [] and not list((tmp_path / "report").rglob("train.icrl")), "nothing trains or generates"
    statuses = [(t["num_train_tasks"], t["seed"], t["status"]) for t in report["trials"]]
    assert statuses.count((10, 0, "reused")) == 4 and statuses.count((10, 1, "reused")) == 3
    assert statuses.count((10, 1, "not run")) == 1 and statuses.count((20, 0, "not run")) == 4
    ten, twenty = report["settings"]
    assert (ten["seeds"], ten["seeds_not_run"], twenty["seeds"], twenty["seeds_not_run"]) == ([0], [1], [], [0, 1])
    emp_seed0 = first["settings"][0]["expected_max_performance"]["ngram_ad"]["per_seed"]["0"]
    assert ten["expected_max_performance"]["ngram_ad"] == {"per_seed": {"0": emp_seed0}, "mean": emp_seed0,
                                                           "std": [0.0] * len(emp_seed0), "seeds": [0]}  # fmt: skip
    assert twenty["expected_max_performance"] == {"ad": None, "ngram_ad": None} and twenty["best"] is None
    markdown = (tmp_path / "report" / "ngram-ad-goals.md").read_text()
    assert "(seeds 0; not run: 1)" in markdown and "(seeds none; not run: 0, 1)" in markdown
    assert "nothing to report" in markdown and markdown.count("| not run |") == 9

    # Trials listed as not run stand in for nothing when the report is reused; finished run folders are read.
    again = compare(dataclasses.replace(config, out_dir=str(tmp_path / "first"), num_train_tasks=(10,),
                                        reuse_results=(str(tmp_path / "report" / "ngram-ad-goals.json"),)),
                    command="again")  # fmt: skip
    assert len(read_back) == 1 and read_back[0].endswith("seed1/ngram_ad-001")
    assert again["settings"][0]["seeds"] == [0, 1]
    assert again["settings"][0]["expected_max_performance"] == first["settings"][0]["expected_max_performance"]


def test_reuse_results_must_be_result_files(tmp_path):
    with pytest.raises(ValueError, match="reuse_results: no such file"):
        CompareConfig(preset="goals", reuse_results=(str(tmp_path / "missing.json"),))
    (bad := tmp_path / "bad.json").write_text('{"trials": 3}')
    config = CompareConfig(preset="goals", out_dir=str(tmp_path), reuse_results=(str(bad),), **TINY)
    with pytest.raises(ValueError, match="reuse_results: .*bad.json is not a result file of icrl-compare"):
        compare(config)
