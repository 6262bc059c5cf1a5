"""Experiment trials on Ray Tune (the ``sweep`` extra): a killed sweep resumes without rerunning what finished,
and gathers the same results as the sequential path. Without Ray the commands run trials one at a time."""

from __future__ import annotations

import json

import pytest

from icrl_models.experiments import sweep
from icrl_models.experiments.ngram_ad import CompareConfig, build_trials, compare, prepare_data, run_trial

# Two assignments x two models = 4 trials, each a few steps of a tiny model; one torch thread each.
TINY = dict(runs=2, steps=2, batch_size=4, d_model=16, num_heads=2, num_layers=1, num_histories=(6,),
            source_episodes=20, eval_tasks=2, eval_episodes=2, eval_envs_per_task=1, backend="eager",
            progress=False, threads=1)  # fmt: skip


def _without_provenance(trial: dict | None) -> dict | None:
    """A trial record without how and where it ran (its status, folder and timing)."""
    if trial is None:
        return None
    return {key: value for key, value in trial.items() if key not in ("status", "wall_seconds", "out_dir")}


def _comparable(result: dict) -> dict:
    """What a sweep computes, without how and where it ran (command, machine, scheduler, folders, timings)."""
    settings = [{**setting, "best": _without_provenance(setting["best"])} for setting in result["settings"]]
    return {"settings": settings, "trials": [_without_provenance(trial) for trial in result["trials"]],
            "scores": result["scores"], "expected_max_performance": result["expected_max_performance"]}  # fmt: skip


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.tune")
    if ray.is_initialized():  # started by an earlier test of this worker: restart with this test's limits
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_killed_ray_sweep_resumes_and_matches_the_sequential_run(tmp_path, local_ray):
    sequential = compare(CompareConfig(out_dir=str(tmp_path / "sequential"), scheduler="local", **TINY))
    sequential_on_disk = json.loads((tmp_path / "sequential" / "compare.json").read_text())

    config = CompareConfig(out_dir=str(tmp_path / "ray"), scheduler="ray", trial_cpus=1, **TINY)
    trials = build_trials(config)
    assert len(trials) == 4
    # A sweep killed after its first two trials finished: their runs are complete, the others never started.
    prepare_data(trials, progress=False)
    for trial in trials[:2]:
        run_trial(trial.config)
    resumed = compare(config)

    assert [trial["status"] for trial in resumed["trials"]] == ["reused", "reused", "trained", "trained"]
    assert _comparable(resumed) == _comparable(sequential)
    on_disk = json.loads((tmp_path / "ray" / "compare.json").read_text())
    assert _comparable(on_disk) == _comparable(sequential_on_disk)
    assert (tmp_path / "ray" / "ray").is_dir()  # Ray Tune's own records stay inside the sweep's folder


def test_without_ray_trials_run_in_order_with_a_hint(monkeypatch, capsys):
    monkeypatch.setattr(sweep, "ray_tune_available", lambda: False)
    options = sweep.SweepOptions()
    assert not options.uses_ray()
    seen = []
    outcomes = sweep.run_trials([3, 1, 2], lambda x: {"x": x}, options, name="n", storage="unused",
                                on_outcome=lambda index, outcome: seen.append(index))  # fmt: skip
    assert outcomes == [{"x": 3}, {"x": 1}, {"x": 2}] and seen == [0, 1, 2]
    assert capsys.readouterr().err.strip() == f"icrl: 3 trials {sweep.SWEEP_HINT}"
    with pytest.raises(ValueError, match="scheduler='ray' needs Ray Tune"):
        sweep.SweepOptions(scheduler="ray")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"scheduler": "slurm"}, "scheduler must be one of"), ({"trial_cpus": 0}, "trial_cpus must be > 0"),
     ({"trial_gpus": -1}, "trial_gpus must be >= 0")],
)  # fmt: skip
def test_bad_sweep_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompareConfig(**kwargs)
