"""``icrl_models.analysis.reward_use``: teacher-forced loss with true and with shuffled rewards."""

from __future__ import annotations

import pytest
import torch

from icrl_models.analysis import reward_dependence, shuffle_rewards, step_losses
from icrl_models.models import ADConfig, ADModel
from icrl_models.models.headless_ad import HeadlessADConfig, HeadlessADModel


def _batch(batch: int = 5, length: int = 13, num_actions: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """A local_action_batch-shaped batch: row 0 starts its stream (no previous action at step 0), row 1 is
    padded after 9 steps, the others are windows from the middle of a stream."""
    generator = torch.Generator().manual_seed(seed)
    actions = torch.randint(0, num_actions, (batch, length + 1), generator=generator)
    prev_actions, targets = actions[:, :-1].clone(), actions[:, 1:].clone()
    prev_actions[0, 0] = -1
    rewards = torch.rand(batch, length, generator=generator)
    rewards[0, 0] = 0.0
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 9:] = False
    available = torch.ones(batch, num_actions, dtype=torch.bool)
    available[2, -2:] = False
    targets[2] = targets[2] % (num_actions - 2)
    prev_actions[2] = prev_actions[2] % (num_actions - 2)
    return {
        "states": torch.zeros(batch, length, dtype=torch.long),
        "local_prev_actions": prev_actions,
        "prev_rewards": rewards,
        "local_actions": targets,
        "mask": mask,
        "available": available,
    }


def _headless(**overrides) -> HeadlessADModel:
    settings = dict(num_states=1, embed_dim=16, seq_len=13, d_model=24, num_heads=3, num_layers=2, backend="eager")
    return HeadlessADModel(HeadlessADConfig(**{**settings, **overrides}))


def _ad() -> ADModel:
    config = ADConfig(num_states=1, num_actions=6, seq_len=13, d_model=24, num_heads=3, num_layers=2)
    return ADModel(config)


def test_shuffle_permutes_rewards_within_rows_and_keeps_the_rest():
    batch = _batch()
    shuffled = shuffle_rewards(batch, torch.Generator().manual_seed(3))
    eligible = batch["mask"] & (batch["local_prev_actions"] >= 0)
    rewards = batch["prev_rewards"]
    assert torch.equal(shuffled[~eligible], rewards[~eligible])  # first step and padding untouched
    for row in range(rewards.shape[0]):
        kept = eligible[row]
        assert torch.equal(shuffled[row, kept].sort().values, rewards[row, kept].sort().values)
    assert not torch.equal(shuffled, rewards)


def test_step_losses_average_to_the_training_loss():
    """The per-step losses are the quantity the model trains on: their mean is ``HeadlessADModel.loss``."""
    torch.manual_seed(0)
    model = _headless().eval()
    batch = _batch()
    losses = step_losses(model, batch, generator=torch.Generator().manual_seed(5))
    expected = model.loss(batch, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(losses.sum() / batch["mask"].sum(), expected)
    assert torch.all(losses[~batch["mask"]] == 0)


@pytest.mark.parametrize("build", [_headless, _ad], ids=["headless_ad", "ad"])
def test_a_model_blind_to_rewards_has_no_gap_and_one_that_reads_them_has_one(build):
    torch.manual_seed(1)
    model = build()
    batch = _batch()
    reading = reward_dependence(model, batch, generator=torch.Generator().manual_seed(2))
    assert reading.loss.shape == reading.shuffled_loss.shape == (13,)
    assert torch.equal(reading.steps, batch["mask"].sum(0))
    assert abs(reading.gap) > 1e-6  # random weights read the reward: shuffling changes the losses
    with torch.no_grad():  # the reward enters only through its embedding: zero it and the model cannot see it
        model.reward_embedding.weight.zero_()
        model.reward_embedding.bias.zero_()
    blind = reward_dependence(model, batch, generator=torch.Generator().manual_seed(2))
    assert blind.gap == 0.0
    torch.testing.assert_close(blind.loss, blind.shuffled_loss, rtol=0, atol=0)


def test_a_step_no_sequence_reaches_is_nan():
    torch.manual_seed(0)
    batch = _batch()
    batch["mask"][:, -1] = False
    reading = reward_dependence(_headless(), batch, generator=torch.Generator().manual_seed(0))
    assert torch.isnan(reading.loss[-1]) and torch.isfinite(reading.loss[:-1]).all()
    assert torch.isfinite(torch.tensor(reading.gap))


def test_bad_inputs_name_the_argument():
    model = _headless()
    batch = _batch()
    with pytest.raises(ValueError, match="local_action_batch"):
        step_losses(model, {k: v for k, v in batch.items() if k != "available"})
    with pytest.raises(TypeError, match="batch must be a dict"):
        reward_dependence(model, [batch])
    with pytest.raises(ValueError, match="prev_rewards must be"):
        step_losses(model, batch, prev_rewards=batch["prev_rewards"][:, :4])
    with pytest.raises(TypeError, match="generator"):
        reward_dependence(model, batch, generator=7)
    with pytest.raises(TypeError, match="ADModel or a HeadlessADModel"):
        step_losses(torch.nn.Linear(2, 2), batch)
    bad = {**batch, "mask": batch["mask"][:, :4]}
    with pytest.raises(ValueError, match="must all be"):
        shuffle_rewards(bad)
