"""Does a trained AD / Headless-AD model use the rewards in its context?

An in-context RL model distils a learning algorithm only if its next action depends on the rewards it has
seen. Teacher-forced loss alone cannot show this: the source algorithm's own actions already encode what
its rewards told it (Thompson sampling pulls the good arm more and more often), so a model that ignores
every reward and imitates the action frequencies of its context reaches nearly the same loss. In a rollout
that model reinforces its own first, random choices and scores at the random level.

:func:`reward_dependence` measures it directly: the per-step loss of the recorded actions with the recorded
previous rewards, and again with those rewards shuffled along time within each sequence (the same reward
values, now paired with the wrong actions). A model that uses rewards loses accuracy; a reward-blind model
does not (gap ~0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from icrl_kernels.validation import check_generator

from ..models.ad import ADModel
from ..models.headless_ad import HeadlessADModel

_BATCH_KEYS = ("states", "local_prev_actions", "prev_rewards", "local_actions", "mask", "available")


@dataclass
class RewardDependence:
    """Per-step mean losses ``[L]`` (float64, NaN where no sequence has a step) of the recorded actions with
    the true previous rewards (``loss``) and with them shuffled within each sequence (``shuffled_loss``);
    ``steps [L]``: how many sequences have a step there."""

    loss: torch.Tensor
    shuffled_loss: torch.Tensor
    steps: torch.Tensor

    def _mean(self, per_step: torch.Tensor) -> float:
        """Mean of a per-step quantity over every step of every sequence (steps no sequence has weigh 0)."""
        weights = self.steps.double()
        return float((torch.nan_to_num(per_step) * weights).sum() / weights.sum())

    @property
    def mean_loss(self) -> float:
        """Loss with the true rewards, averaged over every step of every sequence."""
        return self._mean(self.loss)

    @property
    def mean_shuffled_loss(self) -> float:
        """Loss with the shuffled rewards, averaged over every step of every sequence."""
        return self._mean(self.shuffled_loss)

    @property
    def gap(self) -> float:
        """Mean over all steps of (shuffled - true) loss, in nats: ~0 for a model that ignores rewards."""
        return self._mean(self.shuffled_loss - self.loss)


def _check_batch(batch) -> None:
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict of tensors (local_action_batch's), got {type(batch).__name__}")
    missing = [key for key in _BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}: pass data.local_action_batch(windows.get_batch(...))")
    shape = batch["local_actions"].shape
    if len(shape) != 2 or batch["prev_rewards"].shape != shape or batch["mask"].shape != shape:
        raise ValueError(
            "batch's local_actions, prev_rewards and mask must all be [B, L], got "
            f"{tuple(shape)}, {tuple(batch['prev_rewards'].shape)} and {tuple(batch['mask'].shape)}"
        )


@torch.no_grad()
def step_losses(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    prev_rewards: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Cross-entropy ``[B, L]`` (float32; 0 on padding) of each recorded action under ``model``, teacher-forced.

    Args:
        model: an :class:`~icrl_models.models.ADModel` (its head over action-set positions) or a
            :class:`~icrl_models.models.HeadlessADModel` (InfoNCE over the available actions, at its tau).
        batch: a :func:`~icrl_models.data.local_action_batch` batch (``[B, L]`` steps).
        prev_rewards: ``[B, L]`` rewards to read instead of ``batch["prev_rewards"]``.
        generator: draws Headless-AD's action map (one map for the whole batch, as in a rollout).
    """
    _check_batch(batch)
    check_generator(generator)
    rewards = batch["prev_rewards"] if prev_rewards is None else prev_rewards
    if rewards.shape != batch["prev_rewards"].shape:
        raise ValueError(f"prev_rewards must be {tuple(batch['prev_rewards'].shape)}, got {tuple(rewards.shape)}")
    targets = batch["local_actions"].masked_fill(~batch["mask"], -100)
    was_training = model.training
    model.eval()
    try:
        if isinstance(model, HeadlessADModel):
            available = batch["available"]
            model.action_map.regenerate(num_actions=available.shape[1], generator=generator, device=model.device)
            pred = model(batch["states"], batch["local_prev_actions"], rewards, available)
            losses = model.action_map.loss(pred, targets, mask=available, reduction="none")
        elif isinstance(model, ADModel):
            logits = model(batch["states"], batch["local_prev_actions"], rewards).float()
            losses = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        else:
            raise TypeError(f"model must be an ADModel or a HeadlessADModel, got {type(model).__name__}")
    finally:
        model.train(was_training)
    return losses.float().masked_fill(~batch["mask"], 0.0)


def shuffle_rewards(batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
    """``batch["prev_rewards"]`` permuted at random within each sequence, among the steps that have a previous
    step (``local_prev_actions >= 0``) and are not padding; every other entry unchanged. ``[B, L]``."""
    _check_batch(batch)
    check_generator(generator)
    rewards = batch["prev_rewards"]
    eligible = batch["mask"] & (batch["local_prev_actions"] >= 0)
    keys = torch.rand(rewards.shape, generator=generator, device=rewards.device)
    # Sorting random keys (ineligible steps last) draws the permutation; sorting positions lists the
    # eligible steps in order. Their first k entries (k eligible steps) pair up; the rest are discarded.
    source = torch.where(eligible, keys, torch.inf).argsort(dim=1, stable=True)
    positions = torch.arange(rewards.shape[1], device=rewards.device, dtype=keys.dtype).expand_as(keys)
    target = torch.where(eligible, positions, torch.inf).argsort(dim=1, stable=True)
    shuffled = rewards.scatter(1, target, rewards.gather(1, source))
    return torch.where(eligible, shuffled, rewards)


def reward_dependence(
    model: nn.Module, batch: dict[str, torch.Tensor], *, generator: torch.Generator | None = None
) -> RewardDependence:
    """Teacher-forced loss per step with the true and with shuffled previous rewards; see the module docstring.

    ``batch``: a :func:`~icrl_models.data.local_action_batch` batch of held-out histories. ``generator``
    seeds the shuffle and Headless-AD's action map; both passes use the same map."""
    _check_batch(batch)
    check_generator(generator)
    seed_device = "cpu" if generator is None else generator.device
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=seed_device))
    shuffled = shuffle_rewards(batch, torch.Generator(batch["prev_rewards"].device).manual_seed(seed))
    device = getattr(model, "device", batch["prev_rewards"].device)

    def per_step(rewards):
        map_generator = torch.Generator(device).manual_seed(seed + 1)
        losses = step_losses(model, batch, prev_rewards=rewards, generator=map_generator).double()
        counts = batch["mask"].sum(0)
        return losses.sum(0) / counts.clamp_min(1).double().where(counts > 0, torch.nan), counts

    loss, steps = per_step(batch["prev_rewards"])
    shuffled_loss, _ = per_step(shuffled)
    return RewardDependence(loss=loss.cpu(), shuffled_loss=shuffled_loss.cpu(), steps=steps.cpu())


__all__ = ["RewardDependence", "reward_dependence", "shuffle_rewards", "step_losses"]
