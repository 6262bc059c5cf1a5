"""Every experiment's presets build a valid configuration (CPU and paper sizes), without generating data."""

from __future__ import annotations

import pytest

from icrl_models.experiments import headless_ad, looped, markov_heads, ngram_ad


@pytest.mark.parametrize("experiment", headless_ad.EXPERIMENTS)
@pytest.mark.parametrize("preset", headless_ad.PRESETS)
def test_headless_presets_build(tmp_path, experiment, preset):
    configs = headless_ad.preset_configs(experiment, preset, tmp_path, str(tmp_path / "train.icrl"), seed=0)
    assert set(configs) == {"headless_ad", "ad"}
    headless = configs["headless_ad"]
    assert headless.model == "headless_ad" and configs["ad"].model == "ad"
    if preset == "paper":  # Table 3, sampled as the paper's code does (temperature 1, not tau)
        assert headless.d_model >= 512 and headless.select_tau == 1.0 and headless.steps == 30000


@pytest.mark.parametrize("preset", markov_heads.PRESETS)
def test_markov_presets_build(preset):
    config = markov_heads.MarkovConfig(preset=preset)
    assert config.runs() and len(config.seeds) >= 3


@pytest.mark.parametrize("preset", list(looped.PRESETS))
def test_looped_presets_build(preset):
    assert looped.LoopedExperimentConfig(preset=preset).preset == preset


@pytest.mark.parametrize("preset", list(ngram_ad.PRESETS))
def test_compare_presets_build(preset):
    config = ngram_ad.CompareConfig(preset=preset)
    trials = ngram_ad.build_trials(config)
    assert len(trials) == 2 * config.runs * len(config.seeds) * len(config.num_train_tasks) * len(config.num_histories)


def test_speed_flags_reach_every_run(tmp_path):
    """``--cuda-graph`` (and ``--compile``) of the experiment commands reach each run's ``TrainConfig``."""
    trials = ngram_ad.build_trials(ngram_ad.CompareConfig(cuda_graph=True, runs=1, seeds=(0,)))
    assert trials and all(trial.config.cuda_graph == "on" for trial in trials)
    config = headless_ad.HeadlessExperimentConfig(cuda_graph=True, out_dir=str(tmp_path))
    runs = headless_ad._train_configs(config, tmp_path)
    assert all(run.cuda_graph == "on" for run in runs.values())
    with pytest.raises(ValueError, match="cuda_graph and compile"):
        ngram_ad.build_trials(ngram_ad.CompareConfig(cuda_graph=True, compile=True, runs=1, seeds=(0,)))
