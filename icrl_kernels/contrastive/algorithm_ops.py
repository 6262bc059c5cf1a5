"""Custom ops of the InfoNCE and selection algorithms other than the fused kernels (:mod:`.algorithms`).

``icrl::infonce_loss_by_algorithm`` returns the *reduced* loss, so that with ``reduction="mean"`` or
``"sum"`` the forward knows each row's weight (``1 / count`` of the non-ignored rows, or 1; 0 on ignored
rows) and computes the gradients with it: they are those of the loss for an upstream gradient of 1, each
rounded once to the inputs' dtype, and the backward multiplies them by the upstream scalar (exact when it
is 1, as for ``loss.backward()``, or a power of two, as under loss scaling, short of fp16's subnormal range;
one more rounding otherwise). With ``reduction="none"`` the upstream gradient differs per row: the forward
computes the losses only and the backward runs the algorithm again with those weights (rounded once). Only
the gradients wanted at the call (inputs that require grad, grad mode on) are computed; for
``"mean"``/``"sum"`` the op keeps no input for its backward, only those gradients.

Both ops read no tensor value on the host (capturable in a CUDA graph); the value checks come from the
per-row status the kernels write (:func:`.checks.check_row_status`, :func:`.checks.check_selection_status`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._library import differentiable_op, inference_op
from .algorithms import SMALL
from .checks import check_row_status, check_selection_status


def _run(pred, embeds, targets, mask, tau, ignore_index, algorithm, *, weights, count, want_pred, want_embeds):
    """``(losses, lse, status, grad_pred or None, grad_embeds or None)`` of ``algorithm`` on canonical inputs.

    Row weights of the gradients: ``weights`` (float32 ``[B, T]``, 0 on ignored rows) if given, else
    ``1 / count`` (``count``: the non-ignored rows, a device scalar) if given, else 1, on non-ignored rows.
    """
    if weights is None and (want_embeds or algorithm != SMALL):  # the small kernel folds them itself
        used = targets != ignore_index
        # 1 / count is inf where every row is ignored: no row takes it (the reference's gradients are then 0).
        weights = used.float() if count is None else torch.where(used, 1.0 / count, 0.0)
    if algorithm == SMALL:
        from .small_kernels import infonce_small_triton

        losses, lse, status, grad_pred = infonce_small_triton(
            pred, embeds, targets, mask, tau, ignore_index, write_grad=want_pred, weights=weights, count=count
        )  # fmt: skip
        grad_embeds = None
        if want_embeds:  # a reduction over every row: the fused kernel's, from the log-sum-exp just written
            from .kernels import infonce_grad_embeds_triton

            grad_embeds = infonce_grad_embeds_triton(weights, pred, embeds, targets, mask, lse, tau)
        return losses, lse, status, grad_pred, grad_embeds
    from .chunked import infonce_chunked

    return infonce_chunked(
        pred, embeds, targets, mask, tau, ignore_index, algorithm,
        weights=weights if want_pred or want_embeds else None, want_pred=want_pred, want_embeds=want_embeds,
    )  # fmt: skip


def _forward(
    pred: torch.Tensor,
    embeds: torch.Tensor,
    targets: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045 (torch.library parses the annotation)
    tau: float,
    ignore_index: int,
    reduction: str,
    want_pred: bool,
    want_embeds: bool,
    algorithm: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_pred, grad_embeds)``: the reduced float32 loss and, for ``"mean"``/``"sum"``, the
    gradients wanted for an upstream gradient of 1 (empty tensors otherwise)."""
    reduced = reduction != "none"
    count = (targets != ignore_index).sum() if reduction == "mean" else None
    losses, _, status, grad_pred, grad_embeds = _run(
        pred, embeds, targets, mask, tau, ignore_index, algorithm, weights=None, count=count,
        want_pred=reduced and want_pred, want_embeds=reduced and want_embeds,
    )  # fmt: skip
    check_row_status(status, targets, embeds.shape[1], ignore_index, has_mask=mask is not None)
    loss = losses if not reduced else losses.sum() if count is None else losses.sum() / count
    return (
        loss,
        pred.new_empty(0) if grad_pred is None else grad_pred,
        embeds.new_empty(0) if grad_embeds is None else grad_embeds,
    )


def _forward_fake(pred, embeds, targets, mask, tau, ignore_index, reduction, want_pred, want_embeds, algorithm):
    reduced = reduction != "none"
    loss = pred.new_empty(targets.shape if not reduced else (), dtype=torch.float32)
    grad_pred = torch.empty_like(pred) if reduced and want_pred else pred.new_empty(0)
    return loss, grad_pred, torch.empty_like(embeds) if reduced and want_embeds else embeds.new_empty(0)


def _backward(
    grad_loss: torch.Tensor,
    pred: Optional[torch.Tensor],  # noqa: UP045
    embeds: Optional[torch.Tensor],  # noqa: UP045
    targets: Optional[torch.Tensor],  # noqa: UP045
    mask: Optional[torch.Tensor],  # noqa: UP045
    grad_pred: torch.Tensor,
    grad_embeds: torch.Tensor,
    tau: float,
    ignore_index: int,
    reduction: str,
    algorithm: str,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    if reduction != "none":  # the forward's gradients, times the upstream scalar (0-dim: keeps their dtype)
        return (
            grad_pred * grad_loss if needs_grad[0] else grad_loss.new_empty(0),
            grad_embeds * grad_loss if needs_grad[1] else grad_loss.new_empty(0),
        )
    weights = torch.where(targets == ignore_index, 0.0, grad_loss.float())
    _, _, _, grad_pred, grad_embeds = _run(
        pred, embeds, targets, mask, tau, ignore_index, algorithm, weights=weights, count=None,
        want_pred=needs_grad[0], want_embeds=needs_grad[1],
    )  # fmt: skip
    return (
        grad_pred if grad_pred is not None else grad_loss.new_empty(0),
        grad_embeds if grad_embeds is not None else grad_loss.new_empty(0),
    )


def _backward_fake(
    grad_loss, pred, embeds, targets, mask, grad_pred, grad_embeds, tau, ignore_index, reduction, algorithm, needs_grad
):
    if reduction != "none":
        return tuple(
            torch.empty_like(grad) if needed else grad_loss.new_empty(0)
            for grad, needed in zip((grad_pred, grad_embeds), needs_grad)
        )
    return (
        torch.empty_like(pred) if needs_grad[0] else grad_loss.new_empty(0),
        torch.empty_like(embeds) if needs_grad[1] else grad_loss.new_empty(0),
    )


def _save(inputs: tuple, output: tuple) -> tuple:
    """What the backward needs: the inputs only for ``reduction="none"`` (it recomputes), else the gradients
    (so that a prediction nothing else keeps is not held until the backward)."""
    pred, embeds, targets, mask, tau, ignore_index, reduction, _, _, algorithm = inputs
    kept = (pred, embeds, targets, mask) if reduction == "none" else (None,) * 4
    return (*kept, output[1], output[2], tau, ignore_index, reduction, algorithm)


infonce_by_algorithm_op, infonce_by_algorithm_backward_op = differentiable_op(
    "infonce_loss_by_algorithm",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    grad_inputs=(0, 1),
    differentiable_outputs=1,
    pass_needs_grad=True,
    materialize_grads=False,  # no zero-filled gradients for the saved gradients, outputs as large as the inputs
)


def infonce_loss_by_algorithm(pred, embeds, targets, mask, tau: float, ignore_index: int, reduction: str, algorithm):
    """The reduced InfoNCE loss of canonical inputs (contiguous ``pred [B, T, D]``, ``embeds [1 or B, A, D]``,
    int64 ``targets [B, T]``, the padded uint8 mask or None) by ``algorithm``: a scalar, or ``[B, T]`` for
    ``reduction="none"``. The gradients the forward computes are the ones autograd will ask for."""
    grad_mode = torch.is_grad_enabled()
    want_pred, want_embeds = grad_mode and pred.requires_grad, grad_mode and embeds.requires_grad
    return infonce_by_algorithm_op(
        pred, embeds, targets, mask, tau, ignore_index, reduction, want_pred, want_embeds, algorithm
    )[0]


def _select_actions_by_algorithm(
    pred: torch.Tensor,
    embeds: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045
    tau: float,
    sample: bool,
    seed: torch.Tensor,
    algorithm: str,
) -> torch.Tensor:
    """The chunked selection (``seed``: int64 tensor of one element on ``pred``'s device)."""
    from .chunked import select_chunked

    actions, status = select_chunked(pred, embeds, mask, tau, sample, seed, algorithm)
    check_selection_status(status, pred, embeds, has_mask=mask is not None)
    return actions


def _select_actions_by_algorithm_fake(pred, embeds, mask, tau, sample, seed, algorithm):
    return pred.new_empty(pred.shape[:2], dtype=torch.int64)


select_actions_by_algorithm_op = inference_op(
    "select_actions_by_algorithm", _select_actions_by_algorithm, fake=_select_actions_by_algorithm_fake
)
