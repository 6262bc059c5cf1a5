"""AD / N-Gram AD: incremental decoding equals recomputation, training learns, runs resume, checkpoints
are validated, and in-context evaluation respects the environment."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import icrl_models.lifecycle as lifecycle
import icrl_models.train as train_module
from icrl_models.checkpoint import CheckpointError, load_checkpoint
from icrl_models.data import GenerateConfig, HistoryWindows, generate_histories
from icrl_models.envs import CompositeDarkRoom, DarkRoom, composite_action_sets
from icrl_models.evaluate import rollout_in_context
from icrl_models.models import ADConfig, ADModel
from icrl_models.train import TrainConfig, learning_rate_at, train

MODEL_VARIANTS = {
    "ad": dict(ngram_sizes=()),
    "ngram-state": dict(ngram_sizes=(1, 2), ngram_tokens="state"),
    "ngram-transition": dict(ngram_sizes=(3,), ngram_tokens="transition", qk_norm=True),
    "ngram-post-norm": dict(ngram_sizes=(2,), pre_norm=False),
}


def _random_context(batch: int, length: int, generator: torch.Generator):
    states = torch.randint(0, 9, (batch, length), generator=generator)  # few states: many n-gram matches
    actions = torch.randint(0, 5, (batch, length), generator=generator)
    rewards = torch.randint(0, 2, (batch, length), generator=generator).float()
    prev_actions = torch.cat([torch.full((batch, 1), -1), actions[:, :-1]], dim=1)
    prev_rewards = torch.cat([torch.zeros(batch, 1), rewards[:, :-1]], dim=1)
    return states, prev_actions, prev_rewards


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_incremental_decoding_equals_recomputation(variant):
    """Stepping with the KV ring buffer and n-gram state gives the logits (and so the actions) of a full
    forward pass with a sliding window of seq_len, also well past seq_len."""
    torch.manual_seed(0)
    config = ADConfig(seq_len=13, d_model=24, num_heads=3, num_layers=2, backend="eager", **MODEL_VARIANTS[variant])
    model = ADModel(config).eval()
    states, prev_actions, prev_rewards = _random_context(3, 41, torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(states, prev_actions, prev_rewards, window=config.seq_len)
    state = model.init_decode_state(3, 41)
    stepped = torch.stack(
        [model.step(state, states[:, t], prev_actions[:, t], prev_rewards[:, t]) for t in range(41)], dim=1
    )
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


def test_window_none_equals_window_at_least_length():
    torch.manual_seed(0)
    model = ADModel(ADConfig(seq_len=16, d_model=16, num_heads=2, ngram_sizes=(1,), backend="eager")).eval()
    inputs = _random_context(2, 16, torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), model(*inputs, window=16))
        # a narrower window changes later rows only
        narrow = model(*inputs, window=4)
        full = model(*inputs)
    torch.testing.assert_close(narrow[:, :4], full[:, :4])
    assert not torch.allclose(narrow[:, 8:], full[:, 8:])


def test_reference_backend_matches_kernels_backend():
    torch.manual_seed(0)
    config = ADConfig(seq_len=32, d_model=16, num_heads=2, num_layers=1, ngram_sizes=(1, 2), backend="eager")
    fast = ADModel(config).eval()
    reference = ADModel(dataclasses.replace(config, backend="reference")).eval()
    reference.load_state_dict(fast.state_dict())
    inputs = _random_context(2, 32, torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), reference(*inputs), rtol=1e-5, atol=1e-5)


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads"):
        ADConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="ngram_tokens"):
        ADConfig(ngram_tokens="reward")
    with pytest.raises(ValueError, match="block"):
        ADConfig(num_layers=0)
    with pytest.raises(ValueError, match="env"):
        TrainConfig(env="atari")
    with pytest.raises(ValueError, match="ngram_sizes"):
        TrainConfig(ngram_sizes="1,x").ngram_tuple()


@pytest.fixture(scope="module")
def tiny_histories():
    config = GenerateConfig(env="dark_room", num_histories=24, num_episodes=30, seed=0)
    return generate_histories(config, progress=False)


@pytest.mark.parametrize("ngram_sizes", [(), (1, 2)], ids=["ad", "ngram_ad"])
def test_loss_decreases_on_a_tiny_dataset(tiny_histories, ngram_sizes):
    torch.manual_seed(0)
    windows = HistoryWindows(tiny_histories, 40, episode_subsample=3)
    # The eager backend: this checks learning, not kernels (the Triton interpreter would take a minute).
    config = ADConfig(seq_len=40, d_model=32, num_heads=2, num_layers=1, ngram_sizes=ngram_sizes, backend="eager")
    model = ADModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = windows.get_batch(np.arange(0, len(windows), max(1, len(windows) // 16)))
    with torch.no_grad():
        initial = model.loss(batch).item()
    for _ in range(60):
        loss = model.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert initial > 1.4  # about ln 5 at initialisation
    assert loss.item() < 0.75 * initial


def test_learning_rate_schedule():
    config = TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3)
    assert learning_rate_at(0, config) == pytest.approx(1e-4)
    assert learning_rate_at(9, config) == pytest.approx(1e-3)
    assert learning_rate_at(10, config) == pytest.approx(1e-3)
    assert learning_rate_at(55, config) == pytest.approx(5e-4)
    assert learning_rate_at(100, config) == pytest.approx(0.0, abs=1e-12)
    rates = [learning_rate_at(step, config) for step in range(10, 100)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_rollout_respects_action_sets_and_shapes():
    torch.manual_seed(0)
    action_set = composite_action_sets(0)["sliced_test"][:7]
    env = CompositeDarkRoom(np.array([3, 40, 77]), action_set=action_set, seed=0)
    model = ADModel(ADConfig(num_states=81, num_actions=125, seq_len=8, d_model=16, num_heads=2, num_layers=1))
    chosen = []
    original_step = env.step

    def recording_step(actions):
        chosen.append(actions.copy())
        return original_step(actions)

    env.step = recording_step
    returns = rollout_in_context(model, env, 3, sample=True, seed=0)
    assert returns.shape == (3, 3) and np.all((returns >= 0) & (returns <= 1))
    assert np.isin(np.concatenate(chosen), action_set).all()


def test_rollout_is_reproducible_and_greedy_mode_is_deterministic():
    torch.manual_seed(0)
    model = ADModel(ADConfig(seq_len=20, d_model=16, num_heads=2, num_layers=1, ngram_sizes=(1,), backend="eager"))
    goals = np.array([0, 10, 70, 80])
    first = rollout_in_context(model, DarkRoom(goals), 3, sample=True, seed=5)
    again = rollout_in_context(model, DarkRoom(goals), 3, sample=True, seed=5)
    np.testing.assert_array_equal(first, again)
    greedy = rollout_in_context(model, DarkRoom(goals), 2, sample=False)
    np.testing.assert_array_equal(greedy, rollout_in_context(model, DarkRoom(goals), 2, sample=False, seed=9))


def _tiny_train_config(tmp_path, **overrides) -> TrainConfig:
    settings = dict(
        num_histories=12, source_episodes=12, seq_len=24, d_model=16, num_heads=2, num_layers=1,
        episode_subsample=2, steps=6, batch_size=4, warmup_steps=2, checkpoint_every=3, log_every=1,
        eval_episodes=2, eval_envs_per_task=1, out_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    settings.update(overrides)
    return TrainConfig(**settings)


def test_training_run_writes_its_outputs(tmp_path):
    summary = train(_tiny_train_config(tmp_path))
    run = tmp_path / "run"
    assert {"train.icrl", "checkpoint.pt", "metrics.jsonl", "eval.json", "eval.png", "config.json"} <= {
        path.name for path in run.iterdir()
    }
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["eval"]["num_tasks"] == 21  # the held-out Dark Room goals
    report = json.loads((run / "eval.json").read_text())
    assert len(report["model_returns"]) == 2 and len(report["source_returns"]) == 12
    assert summary["fraction_of_optimal"] == pytest.approx(summary["final_return"] / report["optimal_return"])


def test_key_to_door_evaluation_reports_success_rates(monkeypatch):
    """Success = an episode that reached the door after the key (return 2); Dark Room has no such notion."""
    import icrl_models.evaluate as evaluation
    from icrl_models.envs import DarkRoom, KeyToDoor
    from icrl_models.generators import make_agent

    returns = np.array([[0.0, 2.0, 2.0], [1.0, 1.0, 2.0]])  # [envs, episodes]
    monkeypatch.setattr(evaluation, "rollout_in_context", lambda *args, **kwargs: returns)
    report = evaluation.evaluate(
        None, lambda seed: KeyToDoor.from_task_ids([0, 82], seed=seed), num_episodes=3,
        source=make_agent("random"), source_episodes=12, final_episodes=2,
    )  # fmt: skip
    assert report.summary["final_success_rate"] == 0.75  # last two episodes: [2, 2] and [1, 2]
    assert 0.0 <= report.summary["source_final_success_rate"] <= 1.0
    report = evaluation.evaluate(
        None, lambda seed: DarkRoom([3, 7], seed=seed), num_episodes=3, source=make_agent("random"),
        source_episodes=12, final_episodes=2,
    )  # fmt: skip
    assert "final_success_rate" not in report.summary


def test_killed_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    straight = _tiny_train_config(tmp_path / "straight", eval_episodes=1)
    train(straight)
    expected = load_checkpoint(tmp_path / "straight" / "run" / "checkpoint.pt")["model"]

    resumed = _tiny_train_config(tmp_path / "resumed", eval_episodes=1)
    original = lifecycle.save_run_checkpoint

    def checkpoint_then_die(path, step, *args, **kwargs):
        original(path, step, *args, **kwargs)
        if step == 3:
            raise KeyboardInterrupt  # a kill right after the step-3 checkpoint

    monkeypatch.setattr(lifecycle, "save_run_checkpoint", checkpoint_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(resumed)
    assert load_checkpoint(tmp_path / "resumed" / "run" / "checkpoint.pt")["step"] == 3
    monkeypatch.setattr(lifecycle, "save_run_checkpoint", original)
    train(resumed)
    final = load_checkpoint(tmp_path / "resumed" / "run" / "checkpoint.pt")
    assert final["step"] == 6
    for name, value in expected.items():
        torch.testing.assert_close(final["model"][name], value, rtol=0, atol=0, msg=name)


def test_corrupt_or_foreign_checkpoint_is_rejected(tmp_path, capsys):
    config = _tiny_train_config(tmp_path, eval_episodes=1)
    train(config)
    path = tmp_path / "run" / "checkpoint.pt"
    data = path.read_bytes()

    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        train(config)
    argv = ["--out-dir", config.out_dir, "--num-histories", "12", "--source-episodes", "12", "--no-progress"]
    assert train_module.main(argv) == 2
    assert "icrl-train: error" in capsys.readouterr().err

    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)

    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="another run configuration.*d_model"):
        train(dataclasses.replace(config, d_model=32))


def test_expected_max_performance():
    from icrl_models.experiments.ngram_ad import expected_max_performance

    scores = [0.2, 0.9, 0.5]
    emp = expected_max_performance(scores, max_assignments=50)
    assert emp[0] == pytest.approx(np.mean(scores))  # one draw: the mean
    # two draws with replacement: P(max = v_(i)) = (i/3)^2 - ((i-1)/3)^2
    assert emp[1] == pytest.approx(0.2 * 1 / 9 + 0.5 * 3 / 9 + 0.9 * 5 / 9)
    assert np.all(np.diff(emp) >= 0) and emp[-1] == pytest.approx(0.9, abs=1e-6)
    with pytest.raises(ValueError, match="scores"):
        expected_max_performance([])


def test_sample_assignment_stays_in_table_1():
    from icrl_models.experiments.ngram_ad import sample_assignment

    rng = np.random.default_rng(0)
    for _ in range(50):
        a = sample_assignment(rng)
        assert a["seq_len"] in (100, 150, 200, 250) and a["episode_subsample"] in (1, 2, 4, 8, 20)
        assert 1e-4 <= a["learning_rate"] <= 1e-2 and 1e-7 <= a["weight_decay"] <= 2e-2
        assert 0 <= a["label_smoothing"] <= 0.8 and 0 <= a["embedding_dropout"] <= 0.9
        TrainConfig(**a)  # every draw is a valid run configuration


def test_compare_command_end_to_end(tmp_path, capsys):
    from icrl_models.experiments.ngram_ad import main

    argv = ["--runs", "2", "--steps", "2", "--num-histories", "6", "--source-episodes", "20", "--eval-episodes", "2"]
    argv += ["--eval-envs-per-task", "1", "--backend", "eager", "--out-dir", str(tmp_path), "--no-progress"]
    argv += ["--scheduler", "local"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "compare.json").read_text())
    (setting,) = result["settings"]
    assert sorted(r["model"] for r in result["trials"]) == ["ad", "ad", "ngram_ad", "ngram_ad"]
    assert all(r["score"] is not None for r in result["trials"])
    assert len(setting["expected_max_performance"]["ngram_ad"]["mean"]) == 2
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 2 |" in capsys.readouterr().out
    assert result["command"] == "icrl-compare " + " ".join(argv) and result["machine"]
    assert not list(tmp_path.glob("*.md"))  # icrl-compare prints its table; it writes no .md


@pytest.mark.parametrize("ngram_sizes", [(), (1, 2)], ids=["ad", "ngram_ad"])
def test_cached_rollout_takes_the_actions_of_full_recomputation(ngram_sizes):
    """Greedy rollouts in Dark Room: the KV-cached, n-gram-incremental policy and a policy that reruns the
    whole context through the model at every step (sliding window of seq_len) act identically, also
    once the context is longer than seq_len."""
    torch.manual_seed(0)
    config = ADConfig(seq_len=12, d_model=16, num_heads=2, num_layers=2, ngram_sizes=ngram_sizes, backend="eager")
    model = ADModel(config).eval()
    goals = np.array([3, 40, 44, 80])
    episodes = 2  # 40 steps: more than three windows

    cached_actions = []
    env = DarkRoom(goals)
    original_step = env.step
    env.step = lambda actions: cached_actions.append(actions.copy()) or original_step(actions)
    cached_returns = rollout_in_context(model, env, episodes, sample=False)

    env = DarkRoom(goals)
    observations = env.reset()
    states, prev_actions, prev_rewards = [], [torch.full((4,), -1)], [torch.zeros(4)]
    returns = np.zeros((4, episodes))
    for t in range(episodes * env.episode_length):
        states.append(torch.from_numpy(observations))
        with torch.no_grad():
            logits = model(torch.stack(states, 1), torch.stack(prev_actions, 1), torch.stack(prev_rewards, 1),
                           window=config.seq_len)  # fmt: skip
        actions = logits[:, -1].argmax(-1)
        np.testing.assert_array_equal(actions.numpy(), cached_actions[t], err_msg=f"step {t}")
        result = env.step(actions.numpy())
        returns[:, t // env.episode_length] += result.rewards
        observations = env.reset() if result.truncated.any() else result.observations
        prev_actions.append(actions)
        prev_rewards.append(torch.from_numpy(result.rewards))
    np.testing.assert_array_equal(returns, cached_returns)
