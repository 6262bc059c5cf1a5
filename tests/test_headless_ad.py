"""Headless-AD: incremental decoding equals recomputation, the model is equivariant to reordering the
action set, it learns, and it trains, evaluates and runs the paper's experiments end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from icrl_models.data.windows import local_action_batch, local_action_indices
from icrl_models.envs import BernoulliBandit, CompositeDarkRoom, composite_action_sets
from icrl_models.evaluate import rollout_in_context
from icrl_models.experiments.headless_ad import ABLATION_ARMS, ABLATIONS, HeadlessExperimentConfig, run_experiment
from icrl_models.experiments.headless_ad import main as headless_main
from icrl_models.models import ADConfig, ADModel
from icrl_models.models.headless_ad import HeadlessADConfig, HeadlessADModel, prompt_attention_mask
from icrl_models.train import TrainConfig, load_trained, train

VARIANTS = {
    "prompt": {},
    "post-norm": {"pre_norm": False, "qk_norm": True},
    "no-prompt": {"action_prompt": False},
    "vector-observations": {"observation_dim": 3},
    "separate-tokens": {"step_tokens": "separate"},
    "separate-tokens-no-prompt": {"step_tokens": "separate", "action_prompt": False},
}


def _model(**overrides) -> HeadlessADModel:
    settings = dict(num_states=9, embed_dim=16, seq_len=7, d_model=24, num_heads=3, num_layers=2, backend="eager")
    settings.update(overrides)
    return HeadlessADModel(HeadlessADConfig(**settings)).eval()


def _context(model: HeadlessADModel, batch: int, length: int, num_actions: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    if model.config.observation_dim:
        states = torch.randn(batch, length, model.config.observation_dim, generator=generator)
    else:
        states = torch.randint(0, model.config.num_states, (batch, length), generator=generator)
    available = torch.rand(batch, num_actions, generator=generator) < 0.7
    available[:, 1] = True
    actions = torch.multinomial(available.float(), length, replacement=True, generator=generator)
    prev_actions = torch.cat([torch.full((batch, 1), -1), actions[:, :-1]], dim=1)
    prev_rewards = torch.randn(batch, length, generator=generator)
    return states, prev_actions, prev_rewards, available, actions


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_incremental_decoding_equals_recomputation(variant):
    """Stepping with the prompt prefix and the step ring buffer equals a full forward pass with a sliding
    window of seq_len, also well past seq_len."""
    torch.manual_seed(0)
    model = _model(**VARIANTS[variant])
    states, prev_actions, prev_rewards, available, _ = _context(model, 3, 23, 6, seed=1)
    state = model.init_decode_state(3, 23, available=available, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(states, prev_actions, prev_rewards, available, window=model.config.seq_len)
    stepped = [model.step(state, states[:, t], prev_actions[:, t], prev_rewards[:, t]) for t in range(23)]
    stepped = torch.stack(stepped, dim=1)
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)


def test_reordering_the_action_set_permutes_nothing_but_the_ids():
    """Equivariance: permute the action set (and so the map rows and the local ids in the context); the
    predicted embedding, and therefore every action's probability, is unchanged."""
    torch.manual_seed(0)
    model = _model()
    states, prev_actions, prev_rewards, available, _ = _context(model, 2, 11, 6, seed=2)
    model.action_map.regenerate(num_actions=6, generator=torch.Generator().manual_seed(3))
    embeddings = model.action_map.embeddings.clone()
    with torch.no_grad():
        before = model(states, prev_actions, prev_rewards, available)
        permutation = torch.tensor([3, 0, 5, 1, 4, 2])  # new position i holds old action permutation[i]
        new_position = torch.argsort(permutation)
        model.action_map.embeddings = embeddings[permutation]
        moved = torch.where(prev_actions >= 0, new_position[prev_actions.clamp_min(0)], -1)
        after = model(states, moved, prev_rewards, available[:, permutation])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # Sanity: the model does depend on which embedding an action has.
    model.action_map.embeddings = embeddings[torch.tensor([1, 0, 2, 3, 4, 5])]
    with torch.no_grad():
        assert not torch.allclose(model(states, prev_actions, prev_rewards, available), before, atol=1e-4)


def test_prompt_mask_structure():
    valid = torch.tensor([[True, False, True]])
    mask = prompt_attention_mask(valid, 4, window=2)[0, 0]
    assert mask.shape == (7, 7)
    assert mask[:3, :3].tolist() == [[True, False, True]] * 3  # the prompt sees valid prompt tokens
    assert not mask[:3, 3:].any()  # ... and no step
    assert mask[3:, :3].tolist() == [[True, False, True]] * 4  # every step sees the valid prompt
    steps = mask[3:, 3:].int().tolist()
    assert steps == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]  # causal window of 2


def test_local_action_indices():
    action_set = torch.tensor([[7, 3, 9, -1], [0, 1, 2, 3]])
    actions = torch.tensor([[9, 7, -1], [3, 0, 1]])
    assert local_action_indices(actions, action_set).tolist() == [[2, 0, -1], [3, 0, 1]]
    with pytest.raises(ValueError, match="not in"):
        local_action_indices(torch.tensor([[4], [0]]), action_set)


def test_local_action_batch_ignores_window_padding():
    """Padding positions of a window hold action 0, which a composite Darkroom set need not contain (this
    stopped `icrl-headless --experiment darkroom` at its first batch): they become NO_ACTION."""
    batch = {"actions": torch.tensor([[9, 7, 0]]), "prev_actions": torch.tensor([[-1, 9, -1]]),
             "mask": torch.tensor([[True, True, False]]), "action_set": torch.tensor([[7, 3, 9, -1]])}  # fmt: skip
    local = local_action_batch(batch)
    assert local["local_actions"].tolist() == [[2, 0, -1]] and local["local_prev_actions"].tolist() == [[-1, 2, -1]]
    assert local["available"].tolist() == [[True, True, True, False]]
    with pytest.raises(ValueError, match="not in"):  # a real action outside the set is still an error
        local_action_batch({**batch, "actions": torch.tensor([[9, 4, 0]])})


def test_learns_through_random_maps_from_context():
    """The map is redrawn every step, so the only way to predict an action is from the context. Here every
    action repeats the previous one: the loss must fall far below chance (ln 6) within 150 steps."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batch_size, length, num_actions = 16, 24, 6
    actions = torch.randint(0, num_actions, (batch_size, 1), generator=generator).expand(batch_size, length)
    batch = {
        "states": torch.zeros(batch_size, length, dtype=torch.long),
        "local_actions": actions,
        "local_prev_actions": torch.cat([torch.full((batch_size, 1), -1), actions[:, :-1]], dim=1),
        "prev_rewards": torch.zeros(batch_size, length),
        "available": torch.ones(batch_size, num_actions, dtype=torch.bool),
        "mask": torch.ones(batch_size, length, dtype=torch.bool),
    }
    model = HeadlessADModel(HeadlessADConfig(num_states=1, embed_dim=8, seq_len=length, d_model=32, num_heads=2,
                                             num_layers=1, backend="eager"))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = model.loss(batch, generator=generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[:3]) > 1.5  # about ln 6 = 1.79 at initialisation
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:3])  # measured: about 0.35x at 150 steps


def test_ad_refuses_action_sets_wider_than_its_head():
    model = ADModel(ADConfig(num_states=81, num_actions=50, seq_len=8, d_model=16, num_heads=2, num_layers=1))
    env = CompositeDarkRoom(np.array([3, 40]), action_set=composite_action_sets(0)["test"], seed=0)
    with pytest.raises(ValueError, match="retrained"):
        rollout_in_context(model, env, 1)


def test_rollout_uses_only_the_offered_actions_and_records_them():
    model = _model(num_states=81, embed_dim=80)  # >= 75 actions: orthonormal rows
    action_set = composite_action_sets(0)["test"]  # 75 actions never seen in training
    env = CompositeDarkRoom(np.array([3, 40, 77]), action_set=action_set, seed=0)
    returns, actions = rollout_in_context(model, env, 2, seed=0, record=True)
    assert returns.shape == (3, 2) and actions.shape[0] == 3 and actions.shape[1] <= 40
    taken = actions >= 0  # -1 after an environment's last episode (goals end episodes early)
    assert taken[:, 0].all() and np.isin(actions[taken], action_set).all()
    again = rollout_in_context(model, CompositeDarkRoom(np.array([3, 40, 77]), action_set=action_set, seed=0), 2,
                               seed=0, record=True)[1]  # fmt: skip
    np.testing.assert_array_equal(actions, again)
    bandit = BernoulliBandit(np.array([[0.1, 0.9, 0.0], [0.5, 0.2, 0.7]]), num_arms=[2, 3], episode_length=9)
    _, pulls = rollout_in_context(_model(num_states=1), bandit, 1, seed=1, record=True)
    assert (pulls[0] < 2).all() and (pulls[1] < 3).all()


def test_train_and_reload_headless_on_composite_darkroom(tmp_path):
    config = TrainConfig(
        env="dark_room_composite", model="headless_ad", num_histories=8, source_episodes=6, seq_len=20,
        d_model=16, num_heads=2, num_layers=1, embed_dim=128, episode_subsample=2, steps=3, batch_size=4,
        warmup_steps=1, eval_episodes=2, eval_envs_per_task=1, eval_tasks=2, eval_action_set="all",
        out_dir=str(tmp_path / "run"), progress=False, backend="eager",
    )  # fmt: skip
    summary = train(config)
    assert 0.0 <= summary["final_return"] <= 1.0 and summary["num_envs"] == 2
    model, histories = load_trained(config)
    assert isinstance(model, HeadlessADModel) and histories.action_sets.shape[1] == 50
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["source_name"] == "q_learning"


def test_headless_experiment_end_to_end(tmp_path, capsys, monkeypatch):
    """The held-out protocol (tiny sizes): every model trains once per training seed, its temperature is the grid
    point with the best mean score on the selection seeds, the table reports it on the report seeds (mean ± sd
    over training seeds), AD is n/a on wider sets, and a rerun evaluates nothing."""
    out = tmp_path / "exp"
    argv = ["--experiment", "bernoulli", "--steps", "2", "--eval-tasks", "10", "--out-dir", str(out), "--no-progress",
            "--training-seeds", "0", "1", "--select-temperatures", "1", "0.25", "--selection-seeds", "5",
            "--report-seeds", "6", "7"]  # fmt: skip
    import icrl_models.experiments.headless_ad as experiments

    original = experiments._BANDIT_BASE.copy()
    experiments._BANDIT_BASE.update(num_histories=16, seq_len=30, episode_length=30)
    sets = {"uniform, 4-20 arms", "uniform, 20 arms", "uniform, 25 arms"}  # seen, seen at the edge, unseen
    monkeypatch.setitem(
        experiments.EVAL_SETS, "bernoulli", [s for s in experiments.EVAL_SETS["bernoulli"] if s[0] in sets]
    )
    try:
        assert headless_main(argv) == 0
    finally:
        experiments._BANDIT_BASE.clear()
        experiments._BANDIT_BASE.update(original)
    results = json.loads((out / "headless.json").read_text())
    assert set(results["models"]) == {"headless_ad", "ad"}
    assert (results["training_seeds"], results["selection_seeds"], results["report_seeds"]) == ([0, 1], [5], [6, 7])
    assert results["cpu_seconds"] > 0
    for name, entry in results["models"].items():
        selection = entry["selection"]
        assert set(selection) == {"1.0", "0.25"} and entry["temperature"] == max(
            (1.0, 0.25), key=lambda f: selection[str(f)]
        )
        assert set(entry["runs"]) == {"0", "1"}
        scores = entry["scores"]["uniform, 4-20 arms"]
        per_seed = [run["scores"]["uniform, 4-20 arms"] for run in entry["runs"].values()]
        assert [len(run["values"]) for run in per_seed] == [2, 2]  # one value per report seed
        assert scores["n"] == 2 and scores["mean"] == pytest.approx(np.mean([run["mean"] for run in per_seed]))
        use = entry["runs"]["0"]["reward_use"]  # both models' reward use, also for AD's head
        assert use["gap"] == pytest.approx(use["shuffled_loss"] - use["loss"])
        # The selection score is the mean over training seeds, selection seeds and sets of the stored evaluations.
        stored = [json.loads((out / f"seed{seed}" / name / "evaluations.json").read_text()) for seed in (0, 1)]
        at_chosen = [
            v["normalized_score"] for evaluations in stored for key, v in evaluations.items()
            if v is not None and json.loads(key)["seed"] == 5
            and json.loads(key)["select_tau"] == pytest.approx(entry["select_tau"])
        ]  # fmt: skip
        assert np.mean(at_chosen) == pytest.approx(selection[str(entry["temperature"])])
        # The temperature is chosen on the seen sets only: the unseen set never ran on the selection seed.
        unseen_at_selection = [
            key for evaluations in stored for key in evaluations
            if json.loads(key)["seed"] == 5 and json.loads(key)["eval_num_arms"] == "25"
        ]  # fmt: skip
        assert unseen_at_selection == []
    assert results["selection_sets"] == ["uniform, 4-20 arms", "uniform, 20 arms"]
    ad_scores = results["models"]["ad"]["scores"]
    assert ad_scores["uniform, 25 arms"] is None and ad_scores["uniform, 4-20 arms"] is not None
    assert all(v is not None for v in results["models"]["headless_ad"]["scores"].values())
    table = (out / "headless.md").read_text()
    assert (out / "headless.png").stat().st_size > 0 and "n/a" in table
    assert "| uniform, 20 arms | seen |" in table and "| uniform, 25 arms | unseen |" in table
    assert "normalised score" in capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0] == "Command: `icrl-headless " + " ".join(argv) + "`" and lines[2].startswith("Machine: ")
    assert results["command"] == "icrl-headless " + " ".join(argv)
    # A rerun trains and evaluates nothing: every evaluation is kept beside its run.
    original_evaluate = experiments.RunEvaluations._evaluate
    experiments.RunEvaluations._evaluate = None  # calling it would raise
    experiments._BANDIT_BASE.update(num_histories=16, seq_len=30, episode_length=30)
    try:
        assert headless_main(argv) == 0
    finally:
        experiments.RunEvaluations._evaluate = original_evaluate
        experiments._BANDIT_BASE.clear()
        experiments._BANDIT_BASE.update(original)
    rerun = json.loads((out / "headless.json").read_text())
    assert {name: entry["scores"] for name, entry in rerun["models"].items()} == {
        name: entry["scores"] for name, entry in results["models"].items()
    }


def test_experiment_config_errors():
    with pytest.raises(ValueError, match="experiment"):
        HeadlessExperimentConfig(experiment="atari")
    with pytest.raises(ValueError, match="preset"):
        HeadlessExperimentConfig(preset="huge")
    with pytest.raises(ValueError, match="ablations"):
        HeadlessExperimentConfig(ablations=("bigger",))
    with pytest.raises(ValueError, match="ablations"):
        HeadlessExperimentConfig(experiment="contextual", ablations=("preset",))
    with pytest.raises(ValueError, match="select_temperatures"):
        HeadlessExperimentConfig(ablations=("preset",), select_temperatures=(0.0,))
    assert HeadlessExperimentConfig(ablations=("all",)).ablations == tuple(ABLATIONS)
    with pytest.raises(ValueError, match="disjoint"):  # a reported score must not have chosen its temperature
        HeadlessExperimentConfig(selection_seeds=(1, 2), report_seeds=(2, 3))
    for name in ("training_seeds", "selection_seeds", "report_seeds"):
        with pytest.raises(ValueError, match=name):
            HeadlessExperimentConfig(**{name: ()})
    assert callable(run_experiment)


def test_every_ablation_name_survives_the_command_line():
    """List options also read comma-separated values (older command lines): a name with a comma would be split."""
    from icrl_models.config import add_config_arguments, config_from_args, make_parser

    parser = make_parser("icrl-headless", "")
    add_config_arguments(parser, HeadlessExperimentConfig)
    config = config_from_args(HeadlessExperimentConfig, parser.parse_args(["--ablations", *ABLATIONS]))
    assert config.ablations == tuple(ABLATIONS)


def test_step_tokens_and_select_tau_errors():
    with pytest.raises(ValueError, match="step_tokens"):
        HeadlessADConfig(step_tokens="interleaved")
    with pytest.raises(ValueError, match="select_tau"):
        HeadlessADConfig(select_tau=0.0)
    with pytest.raises(ValueError, match="select_tau"):
        TrainConfig(model="headless_ad", select_tau=-1.0)


def test_separate_tokens_read_each_step_at_its_state_token():
    """With separate tokens a step's prediction depends on its own action, reward and state and on earlier
    steps only: changing step t's inputs changes no earlier prediction and does change step t's."""
    torch.manual_seed(0)
    model = _model(step_tokens="separate", seq_len=16)
    states, prev_actions, prev_rewards, available, _ = _context(model, 2, 9, 5, seed=3)
    model.action_map.regenerate(num_actions=5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(states, prev_actions, prev_rewards, available)
        changed_rewards = prev_rewards.clone()
        changed_rewards[:, 4] += 3.0
        changed = model(states, prev_actions, changed_rewards, available)
    torch.testing.assert_close(changed[:, :4], base[:, :4])
    assert (changed[:, 4] - base[:, 4]).abs().max() > 1e-3
    assert model.token_projection is None and base.shape == (2, 9, model.config.embed_dim)


def _acted(model, state, states, prev_actions, prev_rewards, available, sample: bool) -> torch.Tensor:
    """``[T, B]``: the actions ``model.act`` takes step by step over a ``[B, T]`` context (draws seeded with 5)."""
    generator = torch.Generator().manual_seed(5)
    return torch.stack([
        model.act(state, states[:, t], prev_actions[:, t], prev_rewards[:, t], available=available, sample=sample,
                  generator=generator)
        for t in range(states.shape[1])
    ])  # fmt: skip


def test_cold_sampling_picks_the_most_similar_action():
    """``select_tau`` only changes sampling: near 0 it equals argmax; at the training tau it does not."""
    torch.manual_seed(0)
    model = _model(select_tau=1e-4)
    with torch.no_grad():  # similarity gaps of order 1, not an untrained model's tiny ones
        model.prediction_head.weight.mul_(20.0)
    states, prev_actions, prev_rewards, available, _ = _context(model, 64, 5, 6, seed=2)

    def picks(sample: bool) -> torch.Tensor:
        state = model.init_decode_state(64, 5, available=available, generator=torch.Generator().manual_seed(0))
        return _acted(model, state, states, prev_actions, prev_rewards, available, sample)

    argmax = picks(sample=False)
    torch.testing.assert_close(picks(sample=True), argmax)
    model.config.select_tau = None  # back to the training tau (1): sampling spreads over the actions
    assert (picks(sample=True) != argmax).float().mean() > 0.1


def test_ad_select_tau_changes_only_sampling():
    """AD's ``select_tau`` divides its logits before the draw: near 0 it equals argmax; ``None`` samples from the
    softmax it was trained with, the same draws as ``select_tau=1``; argmax ignores it."""
    torch.manual_seed(0)
    model = ADModel(ADConfig(num_states=9, num_actions=6, seq_len=7, d_model=24, num_heads=3, num_layers=2)).eval()
    with torch.no_grad():  # logit gaps of order 1, not an untrained model's tiny ones
        model.action_head.weight.mul_(30.0)
    generator = torch.Generator().manual_seed(2)
    states = torch.randint(0, 9, (64, 5), generator=generator)
    prev_actions = torch.randint(0, 6, (64, 5), generator=generator)
    prev_rewards = torch.randint(0, 2, (64, 5), generator=generator).float()
    available = torch.ones(64, 6, dtype=torch.bool)

    def picks(select_tau, sample: bool = True) -> torch.Tensor:
        model.config.select_tau = select_tau
        return _acted(model, model.init_decode_state(64, 5), states, prev_actions, prev_rewards, available, sample)

    argmax = picks(None, sample=False)
    torch.testing.assert_close(picks(1e-4), argmax)
    torch.testing.assert_close(picks(None), picks(1.0))
    assert (picks(None) != argmax).float().mean() > 0.1
    torch.testing.assert_close(picks(0.5, sample=False), argmax)
    with pytest.raises(ValueError, match="select_tau"):
        ADConfig(select_tau=0.0)
    with pytest.raises(ValueError, match="select_tau"):
        TrainConfig(model="ad", select_tau=float("nan"))


@pytest.mark.slow  # ~90 s; icrl-headless's default command runs in test_headless_experiment_end_to_end
def test_ablations_command_end_to_end(tmp_path, capsys):
    """``--ablations`` trains each variant on the same data and tabulates every temperature and arm count."""
    out = tmp_path / "abl"
    import icrl_models.experiments.headless_ad as experiments

    original = experiments._BANDIT_BASE.copy()
    experiments._BANDIT_BASE.update(num_histories=16, seq_len=30, episode_length=30)
    # --scheduler local: this process, since the test patches the module's presets.
    argv = ["--ablations", "preset", "no action-set prompt", "--select-temperatures", "1", "0.5", "--eval-seeds",
            "1", "2", "--steps", "2", "--eval-tasks", "3", "--out-dir", str(out), "--no-progress",
            "--scheduler", "local"]  # fmt: skip
    try:
        assert headless_main(argv) == 0
    finally:
        experiments._BANDIT_BASE.clear()
        experiments._BANDIT_BASE.update(original)
    results = json.loads((out / "headless-ablations.json").read_text())
    assert list(results["ablations"]) == ["preset", "no action-set prompt"]
    row = results["ablations"]["preset"]["scores"]["0.5"]
    assert set(row) == set(ABLATION_ARMS) and row["50"]["n"] == 2
    table = (out / "headless-ablations.md").read_text()
    assert table.startswith("Command: `icrl-headless --ablations preset")
    assert table.count("| no action-set prompt |") == 2 and "gap" in capsys.readouterr().out
    reward_use = results["ablations"]["preset"]["reward_use"]
    assert set(reward_use) == {"loss", "shuffled_loss", "gap"}
    assert reward_use["gap"] == pytest.approx(reward_use["shuffled_loss"] - reward_use["loss"])
    assert f"| {reward_use['gap']:+.3f} |" in table
    assert len(list((out / "ablations").iterdir())) == 2
    # A rerun trains nothing and evaluates nothing: the scores are kept beside each run.
    import icrl_models.experiments.headless_ad as experiments

    def no_scoring(*args, **kwargs):
        raise AssertionError("a finished ablation was scored again")

    original_score = experiments._score_ablation
    experiments._score_ablation = no_scoring
    experiments._BANDIT_BASE.update(num_histories=16, seq_len=30, episode_length=30)
    try:
        assert headless_main(argv) == 0
    finally:
        experiments._score_ablation = original_score
        experiments._BANDIT_BASE.clear()
        experiments._BANDIT_BASE.update(original)
    rerun = json.loads((out / "headless-ablations.json").read_text())["ablations"]
    assert {name: (entry["scores"], entry["reward_use"]) for name, entry in rerun.items()} == {
        name: (entry["scores"], entry["reward_use"]) for name, entry in results["ablations"].items()
    }


@pytest.mark.parametrize("model", ["headless_ad", "ad"])
def test_train_on_contextual_bandits_with_vector_observations(tmp_path, model):
    """Contextual bandits observe float contexts: both models embed them linearly, train and evaluate."""
    config = TrainConfig(
        env="contextual_bandit", model=model, num_histories=8, source_episodes=1, episode_length=15, seq_len=15,
        episode_subsample=1, d_model=16, num_heads=2, num_layers=1, steps=2, batch_size=4, warmup_steps=1,
        eval_episodes=1, eval_tasks=3, eval_num_arms="5", out_dir=str(tmp_path / model), progress=False,
        backend="eager",
    )  # fmt: skip
    summary = train(config)
    assert summary["num_envs"] == 3 and np.isfinite(summary["normalized_score"])
    trained, _ = load_trained(config)
    assert trained.config.observation_dim == 2
