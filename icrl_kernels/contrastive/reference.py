"""Readable fp32 references of contrastive action scoring (Headless-AD); they are the spec.

Conventions (docs/ops.md#contrastive-action-scoring):

* ``logits[..., a] = pred[...] . action_embeds[a] / tau``: the temperature divides the dot product
  before the exponential, as in the official code.
* Unavailable actions (``mask == False``) get logit ``-inf``: they are outside the softmax. The official
  code multiplies masked similarities by 0 instead, which leaves them in the denominator with logit 0;
  we deliberately do not copy that.
* ``action_embeds`` is one map ``[A, D]`` shared by every row, or one map per sequence ``[B, A, D]``
  (then ``pred`` is ``[B, D]`` or ``[B, T, D]``).

Each function checks its arguments as the public ops do (``checks.py``: the same messages, naming the
argument) before any arithmetic; the checks read shapes and dtypes only, value checks go through
``check_values``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation import FLOAT_DTYPES, check_choice, check_int, check_positive_float, check_tensor, check_values
from .checks import (
    IGNORE_INDEX,
    NAN_LOGIT_MESSAGE,
    REDUCTIONS,
    canonical,
    check_rows_have_actions,
    check_target_values,
    check_targets,
)


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

    Raises:
        ValueError/TypeError naming the argument, as :func:`infonce_loss` (shapes, dtypes, devices, tau).
    """
    canonical(pred, action_embeds, mask)
    tau = check_positive_float(tau, "tau")
    return _logits(pred, action_embeds, tau, mask)


def _logits(pred: torch.Tensor, action_embeds: torch.Tensor, tau: float, mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`action_logits_reference` on checked arguments."""
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

    Raises:
        ValueError/TypeError naming the argument, as :func:`infonce_loss`: shapes, dtypes, devices,
        ``tau``, ``reduction``, ``ignore_index``; targets out of range or unavailable and mask rows with
        no action through ``check_values`` (an asynchronous device assert on CUDA).
    """
    canon = canonical(pred, action_embeds, mask)
    check_targets(targets, pred)
    tau = check_positive_float(tau, "tau")
    check_choice(reduction, "reduction", REDUCTIONS)
    ignore_index = check_int(ignore_index, "ignore_index")
    targets = targets.long()  # before comparing with ignore_index: -100 would wrap around in uint8
    check_rows_have_actions(canon.mask)
    check_target_values(targets.reshape(canon.pred.shape[:2]), canon.mask, action_embeds.shape[-2], ignore_index)
    logits = _logits(pred, action_embeds, tau, mask)
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none", ignore_index=ignore_index
    ).reshape(targets.shape)
    return reduce_row_losses(losses, targets, reduction, ignore_index)


def reduce_row_losses(losses: torch.Tensor, targets: torch.Tensor, reduction: str, ignore_index: int) -> torch.Tensor:
    """``"none"``: the per-row losses; ``"sum"``; ``"mean"``: over the rows whose target is not ignored."""
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


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

    Raises:
        ValueError/TypeError naming the argument, as :func:`select_actions`; through ``check_values``: a
        mask row with no available action, and a NaN logit of an available action (NaN in ``pred`` or
        ``action_embeds``; NaN only in the embedding of an action no row may take is harmless).
    """
    canon = canonical(pred, action_embeds, mask)
    tau = check_positive_float(tau, "tau")
    check_rows_have_actions(canon.mask)
    if gumbel is not None:
        check_tensor(gumbel, "gumbel", dtypes=FLOAT_DTYPES)
        logits_shape = tuple(pred.shape[:-1]) + (action_embeds.shape[-2],)
        broadcasts = gumbel.dim() <= len(logits_shape) and all(
            size in (1, want) for size, want in zip(reversed(gumbel.shape), reversed(logits_shape))
        )
        if not broadcasts:
            raise ValueError(f"gumbel must broadcast to the logits' shape {logits_shape}, got {tuple(gumbel.shape)}")
    logits = _logits(pred, action_embeds, tau, mask)  # -inf on unavailable actions, so NaN only on available ones
    check_values(
        logits.isnan().any(),
        NAN_LOGIT_MESSAGE,  # the details as check_selection_status gives them
        lambda: f": NaN in pred: {bool(pred.isnan().any())}, in action_embeds: {bool(action_embeds.isnan().any())}",
    )
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
