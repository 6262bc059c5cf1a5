"""Readable fp32 references of contrastive action scoring (Headless-AD); they are the spec.

Conventions (docs/ops.md#contrastive-action-scoring):

* ``logits[..., a] = pred[...] . action_embeds[a] / tau``: the temperature divides the dot product
  before the exponential, as in the official code.
* Unavailable actions (``mask == False``) get logit ``-inf``: they are outside the softmax. The official
  code multiplies masked similarities by 0 instead, which leaves them in the denominator with logit 0;
  we deliberately do not copy that.
* ``action_embeds`` is one map ``[A, D]`` shared by every row, or one map per sequence ``[B, A, D]``
  (then ``pred`` is ``[B, D]`` or ``[B, T, D]``).

The functions here take checked arguments (:mod:`.checks`); the public, checked references are
:func:`icrl_kernels.infonce_loss_reference`, :func:`icrl_kernels.select_actions_reference` and
:func:`icrl_kernels.contrastive.action_logits_reference`, which run the public ops' checks first (the
value checks included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import IGNORE_INDEX


def action_logits_reference(
    pred: torch.Tensor, action_embeds: torch.Tensor, *, tau: float = 1.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 logits ``pred . e_a / tau``, ``-inf`` where ``mask`` is False.

    Args:
        pred: ``[N, D]`` or ``[B, T, D]`` (or ``[B, D]`` with per-sequence maps).
        action_embeds: ``[A, D]`` shared, or ``[B, A, D]`` per sequence.
        mask: bool ``[A]``, ``[B, A]`` (with ``[B, T, D]`` pred) or ``pred.shape[:-1] + (A,)``, or ``None``.

    Returns:
        ``pred.shape[:-1] + (A,)`` float32.
    """
    pred32, embeds32 = pred.float(), action_embeds.float()
    if embeds32.dim() == 2:
        logits = pred32 @ embeds32.T
    elif pred32.dim() == 2:  # [B, D] against [B, A, D]: one row per sequence
        logits = torch.einsum("bd,bad->ba", pred32, embeds32)
    else:
        logits = torch.einsum("btd,bad->bta", pred32, embeds32)
    logits = logits / tau
    if mask is not None:
        logits = logits.masked_fill(~_mask_like(mask, logits), float("-inf"))
    return logits


def _mask_like(mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A checked ``mask`` as a view that broadcasts against ``logits``."""
    if mask.dim() == 2 and logits.dim() == 3:  # [B, A] per-sequence mask against [B, T, A]
        return mask[:, None, :]
    return mask


def infonce_loss_reference(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    targets: torch.Tensor,
    *,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """InfoNCE / cross-entropy of ``targets`` under ``softmax(pred . E^T / tau)`` over available actions.

    Rows whose target is ``ignore_index`` contribute 0 and are left out of the mean. Returns float32:
    a scalar for ``"mean"`` / ``"sum"``, ``pred.shape[:-1]`` for ``"none"``.
    """
    logits = action_logits_reference(pred, action_embeds, tau=tau, mask=mask)
    targets = targets.long()
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction, ignore_index=ignore_index
    )
    return losses.reshape(targets.shape) if reduction == "none" else losses


def select_actions_reference(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    *,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """``argmax_a (logits + gumbel)`` over the available actions (``gumbel=None``: plain argmax), the
    lowest available id among ties.

    Never an unavailable action, whatever the values: where every available score is ``-inf`` (finite
    scores overflow at a tiny ``tau``), the tie at ``-inf`` goes to the row's first available action, not
    to a masked one of the same ``-inf``.

    Args:
        pred, action_embeds, tau, mask: as in :func:`infonce_loss_reference`.
        gumbel: float noise broadcastable to the logits ``pred.shape[:-1] + (A,)``, or None.

    Returns:
        int64 action ids of shape ``pred.shape[:-1]``.
    """
    logits = action_logits_reference(pred, action_embeds, tau=tau, mask=mask)
    if gumbel is not None:
        logits = logits + gumbel
    # NaN ranks lowest (it can only remain with value checks off); then the lowest available action of
    # the best score: with a mask, a tie at -inf must not go to a masked action of the same -inf.
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
    best = logits.max(dim=-1, keepdim=True).values
    candidates = logits == best
    if mask is not None:
        candidates &= _mask_like(mask, logits)
    return candidates.to(torch.uint8).argmax(dim=-1)  # argmax takes the first of equal maxima
