"""Experiment trials on Ray Tune (the ``sweep`` extra) or in worker processes: a killed sweep resumes without
rerunning what finished, and gathers the same results as the sequential path. Without Ray the commands run
trials one at a time."""

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
    return {"settings": settings, "trials": [_without_provenance(trial) for trial in result["trials"]]}


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.tune")
    if ray.is_initialized():  # started by an earlier test of this worker: restart with this test's limits
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def sequential_sweep(tmp_path_factory):
    """The TINY sweep run one trial at a time: its result and its ``compare.json``."""
    out = tmp_path_factory.mktemp("sequential")
    result = compare(CompareConfig(out_dir=str(out), scheduler="local", **TINY))
    return result, json.loads((out / "compare.json").read_text())


def _resume_killed_sweep(config: CompareConfig) -> dict:
    """``compare(config)`` after a kill that left the first two of its four trials finished and the others
    never started."""
    trials = build_trials(config)
    assert len(trials) == 4
    prepare_data(trials, progress=False)
    for trial in trials[:2]:
        run_trial(trial.config)
    return compare(config)


@pytest.mark.parametrize(
    "scheduler",
    [pytest.param("ray", marks=pytest.mark.slow), "processes"],  # Ray: the slow tier (docs/testing.md)
)
def test_killed_sweep_resumes_and_matches_the_sequential_run(tmp_path, request, sequential_sweep, scheduler):
    if scheduler == "ray":
        request.getfixturevalue("local_ray")
    sequential, sequential_on_disk = sequential_sweep
    config = CompareConfig(out_dir=str(tmp_path / scheduler), scheduler=scheduler, trial_cpus=1, workers=2, **TINY)
    resumed = _resume_killed_sweep(config)

    assert [trial["status"] for trial in resumed["trials"]] == ["reused", "reused", "trained", "trained"]
    assert _comparable(resumed) == _comparable(sequential)
    on_disk = json.loads((tmp_path / scheduler / "compare.json").read_text())
    assert _comparable(on_disk) == _comparable(sequential_on_disk)
    # The scheduler's own records (Ray Tune's; the worker processes' trial logs) stay inside the sweep's folder.
    records = tmp_path / scheduler / "ray"
    assert records.is_dir()
    if scheduler == "processes":
        logs = sorted(path.name for path in (records / "compare").glob("*.log"))
        # Every trial goes to a worker; the two finished ones read their run folders back there.
        assert logs == [f"trial-000{index}.log" for index in range(4)]


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


def test_worker_processes_keep_the_trial_order_and_name_the_failures(tmp_path):
    # dict as the runner: a builtin, so the spawned workers need nothing of this test module.
    options = sweep.SweepOptions(scheduler="processes", workers=2)
    seen = []
    outcomes = sweep.run_trials([{"x": 3}, {"x": 1}, {"x": 2}], dict, options, name="n", storage=tmp_path,
                                on_outcome=lambda index, outcome: seen.append(index))  # fmt: skip
    assert outcomes == [{"x": 3}, {"x": 1}, {"x": 2}] and sorted(seen) == [0, 1, 2]
    with pytest.raises(sweep.TrialsFailed, match=r"trials failed in worker processes \(1: TypeError") as failure:
        sweep.run_trials([{"x": 3}, 5, {"x": 2}], dict, options, name="bad", storage=tmp_path)
    assert "trial-0001.log" in str(failure.value)
    assert "TypeError" in (tmp_path / "bad" / "trial-0001.log").read_text()  # the traceback is in the trial's log


def test_a_failed_trial_is_named_by_its_run_folder_or_its_index():
    """The trials of icrl-compare are run configs with a folder; those of icrl-markov and icrl-induction are
    not: a failure names them by their index instead of failing on a missing attribute."""
    config = CompareConfig()
    assert sweep._trial_label(config, 3) == str(config.out_dir)
    assert sweep._trial_label({"x": 1}, 3) == "trial 3"


@pytest.mark.slow  # starts Ray
def test_failed_ray_trials_raise_one_error_naming_them(local_ray, tmp_path):
    options = sweep.SweepOptions(scheduler="ray")
    with pytest.raises(sweep.TrialsFailed, match=r"(?s)Ray Tune trials failed .*\['trial 1'\]"):
        sweep.run_trials([{"x": 3}, 5], dict, options, name="bad", storage=tmp_path)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [({"scheduler": "slurm"}, ValueError, "scheduler must be one of"),
     ({"trial_cpus": 0}, ValueError, "trial_cpus must be > 0"),
     ({"trial_gpus": -1}, ValueError, "trial_gpus must be >= 0"),
     ({"workers": -1}, ValueError, "workers must be >= 0"), ({"workers": 1.5}, TypeError, "workers must be an int")],
)  # fmt: skip
def test_bad_sweep_options_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        CompareConfig(**kwargs)
