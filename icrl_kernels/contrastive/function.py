"""Public entry points of contrastive action scoring (Headless-AD) and their custom-op registration."""

from __future__ import annotations

from typing import Optional

import torch

from .._backend import resolve_backend
from .._library import differentiable_op, inference_op
from .._validation import check_positive_float, check_values
from . import reference
from .algorithm_ops import infonce_loss_by_algorithm, select_actions_by_algorithm_op
from .algorithms import FUSED, infonce_algorithm, select_algorithm
from .checks import (
    IGNORE_INDEX,
    NAN_LOGIT_MESSAGE,
    canonical,
    check_gumbel,
    check_infonce_args,
    check_row_status,
    check_rows_have_actions,
    check_select_actions_args,
    check_selection_status,
    check_target_values,
)
from .eager import (
    gumbel_noise,
    infonce_backward_eager,
    infonce_forward_eager,
    reduce_row_losses,
    select_actions_eager,
)


def _padded_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The canonical uint8 mask for the Triton kernels: ``[1 or B, 1 or T, A_pad]``, ``A_pad`` the next
    multiple of 16 (columns past ``A`` zero), contiguous along actions, rows 16-byte aligned.

    The kernels load mask rows in 16-byte vectors only where rows are aligned and the load bound is a
    multiple of 16; at A = 125 they went element by element and spilled ~2 KB per thread. One copy per
    call (the backward reuses the saved, padded mask), and none when the mask is already aligned.
    """
    if mask is None:
        return None
    num_actions = mask.shape[-1]
    aligned = (
        num_actions % 16 == 0
        and mask.stride(-1) == 1
        and all(mask.shape[i] == 1 or mask.stride(i) % 16 == 0 for i in range(mask.dim() - 1))
        and mask.data_ptr() % 16 == 0
    )
    if aligned:
        return mask
    padded = mask.new_zeros(mask.shape[:-1] + (-(-num_actions // 16) * 16,))
    padded[..., :num_actions] = mask
    return padded


# -- custom ops ------------------------------------------------------------------------------------
def _forward(
    pred: torch.Tensor,
    embeds: torch.Tensor,
    targets: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045 (torch.library parses the annotation)
    tau: float,
    ignore_index: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Checked here, inside the opaque op, so that compiled graphs (fullgraph) still raise on bad targets.
    if impl == "triton":
        from .kernels import infonce_forward_triton

        # The kernel reports each row's problems; checking its status costs 3 small ops, not 8 (22 with a mask).
        losses, lse, status = infonce_forward_triton(pred, embeds, targets, mask, tau, ignore_index)
        check_row_status(status, targets, embeds.shape[1], ignore_index, has_mask=mask is not None)
        return losses, lse
    check_rows_have_actions(mask)
    check_target_values(targets, mask, embeds.shape[1], ignore_index)
    return infonce_forward_eager(pred, embeds, targets, mask, tau, ignore_index)


def _forward_fake(pred, embeds, targets, mask, tau, ignore_index, impl):
    row = targets.new_empty(targets.shape, dtype=torch.float32)
    return row, torch.empty_like(row)


def _backward(
    grad_loss: torch.Tensor,
    pred: torch.Tensor,
    embeds: torch.Tensor,
    targets: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045
    lse: torch.Tensor,
    tau: float,
    ignore_index: int,
    impl: str,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    row_weights = torch.where(targets == ignore_index, 0.0, grad_loss.float())
    if impl == "triton":
        from .kernels import infonce_backward_triton as backward
    else:
        backward = infonce_backward_eager
    # A fixed random action map needs no gradient: skip its (full-cost) pass.
    return backward(row_weights, pred, embeds, targets, mask, lse, tau, want_embeds=needs_grad[1])


def _backward_fake(grad_loss, pred, embeds, targets, mask, lse, tau, ignore_index, impl, needs_grad):
    return torch.empty_like(pred), torch.empty_like(embeds) if needs_grad[1] else embeds.new_empty(0)


infonce_op, infonce_backward_op = differentiable_op(
    "infonce_loss",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    # (pred, embeds, targets, mask, lse, tau, ignore_index, impl)
    save=lambda inputs, output: (*inputs[:4], output[1], *inputs[4:]),
    grad_inputs=(0, 1),
    differentiable_outputs=1,
    pass_needs_grad=True,
)


def _select_actions(
    pred: torch.Tensor,
    embeds: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045
    tau: float,
    sample: bool,
    seed: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    """``seed``: int64 tensor of one element on ``pred``'s device (read by the kernel, never by the host)."""
    if impl == "triton":
        from .kernels import select_actions_triton

        actions, status = select_actions_triton(pred, embeds, mask, tau, sample, seed)
    else:
        actions, status = select_actions_eager(pred, embeds, mask, tau, sample, seed)
    # The choice is an available action whatever the values; an empty mask row and NaN inputs are still
    # errors to report, read from the per-row status the selection wrote (3 ops on CUDA, not 8 with a mask).
    check_selection_status(status, pred, embeds, has_mask=mask is not None)
    return actions


def _select_actions_fake(pred, embeds, mask, tau, sample, seed, impl):
    return pred.new_empty(pred.shape[:2], dtype=torch.int64)


select_actions_op = inference_op("select_actions", _select_actions, fake=_select_actions_fake)


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One int64 seed as a ``[1]`` tensor on ``device``, drawn from ``generator`` (torch's global CPU
    generator when None) on the generator's own device and copied without a host read. A CPU seed bound for
    a GPU is pinned first: CUDA documents that a copy from pageable memory may wait for the stream."""
    seed_device = generator.device if generator is not None else torch.device("cpu")
    seed = torch.randint(0, 2**62, (1,), generator=generator, device=seed_device)
    if seed.device.type == "cpu" and device.type == "cuda":
        seed = seed.pin_memory()
    return seed.to(device, non_blocking=True)


# -- public functions ------------------------------------------------------------------------------
def infonce_loss(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    targets: torch.Tensor,
    *,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = IGNORE_INDEX,
    backend: str = "auto",
) -> torch.Tensor:
    """Contrastive (InfoNCE) action loss of Headless-AD: cross-entropy of ``targets`` under
    ``softmax_a(pred . e_a / tau)`` over the available actions, fused (the ``N x A`` logits never reach
    memory; on the Triton backend the algorithm is chosen by ``A``: docs/ops.md, "Algorithms").

    Args:
        pred: predicted action embeddings ``[N, D]`` or ``[B, T, D]`` (``[B, D]`` or ``[B, T, D]`` with
            per-sequence maps); fp32/fp16/bf16 (fp64 on the eager and reference backends).
        action_embeds: the action map, ``[A, D]`` shared by all rows or ``[B, A, D]`` one per sequence;
            same dtype as ``pred``. ``A`` may be anything from 1 to millions.
        targets: ``pred.shape[:-1]`` integer action ids in ``[0, A)``; rows equal to ``ignore_index``
            (padding) contribute nothing and are left out of the mean.
        tau: temperature > 0; it divides the dot product before the exponential (official code).
        mask: bool availability, ``[A]``, ``[B, A]`` (per sequence, with ``[B, T, D]`` pred) or
            ``pred.shape[:-1] + (A,)``; False actions are excluded from the softmax (logit -inf). The
            official code instead zeroes masked logits, leaving them in the denominator; we do not.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (``pred.shape[:-1]``).
        ignore_index: target value of padded rows.
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager), ``"triton"``,
            ``"eager"`` (row chunks, logits recomputed in the backward) or ``"reference"``.

    Returns:
        float32 loss; differentiable w.r.t. ``pred`` and ``action_embeds``.

    Precision: the gradients are computed in fp32 (every scale, ``1 / tau``, the upstream gradient and the
    mean's ``1 / N``, applied in fp32) and rounded once to the input dtype, so fp16/bf16 gradients are as
    accurate as the fp32 gradient rounded to that dtype. (With ``"mean"``/``"sum"``, the Triton algorithms other
    than the fused kernels compute the gradients in the forward for an upstream gradient of 1 and multiply them
    by the actual one in the backward: exact for 1 or a power of two (as loss scaling uses) short of fp16's
    subnormal range, one more rounding otherwise.) fp16
    training still needs loss scaling, as
    anywhere: with ``reduction="mean"`` each row's gradient carries ``1 / N``, and at N = 65536 most of
    ``grad_pred`` lies in fp16's subnormal range (below 6.1e-5), where it keeps only a few bits.

    Raises:
        ValueError: shape/width mismatch, tau <= 0, a target out of range or unavailable, a row whose
            mask allows no action. TypeError: wrong dtypes. The value checks (targets, mask rows) run on
            the device: on CUDA they are asynchronous device asserts (see ``set_value_checks``).
    """
    canonical_inputs, targets, tau, ignore_index = check_infonce_args(
        pred, action_embeds, targets, tau=tau, mask=mask, reduction=reduction, ignore_index=ignore_index
    )
    # action_embeds has pred's dtype (checked): pred stands for both.
    impl = resolve_backend(backend, pred.device, kernel_inputs={"pred": pred})
    if impl == "reference":
        return _checked_infonce_reference(canonical_inputs, pred, action_embeds, targets, tau, mask, reduction,
                                          ignore_index)  # fmt: skip
    targets2 = targets.reshape(canonical_inputs.pred.shape[:2])
    # Triton: a padded copy of a misaligned mask, made once per call (the backward reuses the saved one).
    mask3 = _padded_mask(canonical_inputs.mask) if impl == "triton" else canonical_inputs.mask
    algorithm = infonce_algorithm(action_embeds.shape[-2], pred.dtype) if impl == "triton" else FUSED
    if algorithm != FUSED:  # chosen by the number of actions (algorithms.py)
        loss = infonce_loss_by_algorithm(
            canonical_inputs.pred.contiguous(), canonical_inputs.embeds.contiguous(), targets2.contiguous(), mask3,
            tau, ignore_index, reduction, algorithm,
        )  # fmt: skip
        return loss.reshape(targets.shape) if reduction == "none" else loss
    losses = infonce_op(
        canonical_inputs.pred.contiguous(), canonical_inputs.embeds.contiguous(), targets2.contiguous(), mask3,
        tau, ignore_index, impl,
    )[0].reshape(targets.shape)  # fmt: skip
    return reduce_row_losses(losses, targets, reduction, ignore_index)


def select_actions(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    *,
    mode: str = "sample",
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Pick one action per row from ``softmax_a(pred . e_a / tau)`` in one pass over the actions.

    ``mode="argmax"``: the most similar available action (the lowest id among exact ties), what
    ``torch.argmax`` of the reference logits gives. ``mode="sample"``: Gumbel-max sampling, exactly a
    draw from the softmax; one seed is drawn from ``generator`` (or torch's global CPU generator), so a
    seeded generator makes the draw reproducible (the seed stays a tensor: no host read, also with a
    CUDA generator). Unavailable actions are never chosen, whatever the values (NaN, overflowing
    logits); NaN in ``pred`` or ``action_embeds`` (in a logit of an available action) raises
    ``ValueError`` on CPU and is an asynchronous device assert on CUDA (see ``set_value_checks``).

    Args:
        pred, action_embeds, mask: as in :func:`infonce_loss`.
        mode: ``"sample"`` or ``"argmax"``.
        tau: temperature > 0 (irrelevant to argmax).
        generator: a ``torch.Generator`` for sampling.
        backend: as in :func:`infonce_loss`.

    Returns:
        int64 action ids of shape ``pred.shape[:-1]``.
    """
    canonical_inputs, tau = check_select_actions_args(
        pred, action_embeds, mode=mode, tau=tau, mask=mask, generator=generator
    )
    impl = resolve_backend(backend, pred.device, kernel_inputs={"pred": pred})
    sample = mode == "sample"
    if impl == "reference":
        gumbel = None
        if sample:
            shape = tuple(pred.shape[:-1]) + (action_embeds.shape[-2],)
            gumbel = gumbel_noise(shape, generator=generator, device=pred.device)
        # The checked spec: rows without an action, and NaN logits of available actions, raise there.
        return select_actions_reference(pred, action_embeds, tau=tau, mask=mask, gumbel=gumbel)
    # Argmax needs no seed: a constant placeholder, so that argmax consumes no random numbers.
    seed = _draw_seed(generator, pred.device) if sample else torch.zeros(1, dtype=torch.int64, device=pred.device)
    mask3 = _padded_mask(canonical_inputs.mask) if impl == "triton" else canonical_inputs.mask
    inputs = (canonical_inputs.pred.contiguous(), canonical_inputs.embeds.contiguous(), mask3, tau, sample, seed)
    algorithm = select_algorithm(action_embeds.shape[-2], pred.dtype) if impl == "triton" else FUSED
    if algorithm != FUSED:  # GEMM chunks (algorithms.py)
        actions = select_actions_by_algorithm_op(*inputs, algorithm)
    else:
        actions = select_actions_op(*inputs, impl)
    return actions.reshape(pred.shape[:-1])


# -- checked references ----------------------------------------------------------------------------
def _checked_infonce_reference(canonical_inputs, pred, action_embeds, targets, tau, mask, reduction, ignore_index):
    """:func:`.reference.infonce_loss_reference` on checked arguments, after the value checks the op runs."""
    check_rows_have_actions(canonical_inputs.mask)
    targets2 = targets.reshape(canonical_inputs.pred.shape[:2])
    check_target_values(targets2, canonical_inputs.mask, action_embeds.shape[-2], ignore_index)
    return reference.infonce_loss_reference(
        pred, action_embeds, targets, tau=tau, mask=mask, reduction=reduction, ignore_index=ignore_index
    )


def action_logits_reference(
    pred: torch.Tensor, action_embeds: torch.Tensor, *, tau: float = 1.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 logits ``pred . e_a / tau``, ``-inf`` where ``mask`` is False (:func:`.reference.action_logits_reference`),
    behind :func:`infonce_loss`'s checks of these arguments.

    Returns:
        ``pred.shape[:-1] + (A,)`` float32.

    Raises:
        ValueError/TypeError naming the argument, as :func:`infonce_loss` (shapes, dtypes, devices, tau).
    """
    canonical(pred, action_embeds, mask)
    tau = check_positive_float(tau, "tau")
    return reference.action_logits_reference(pred, action_embeds, tau=tau, mask=mask)


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
    """The readable fp32 reference of :func:`infonce_loss` (:func:`.reference.infonce_loss_reference`, the
    spec: dense logits and ``F.cross_entropy``) behind the same checks.

    Returns:
        float32: a scalar for ``"mean"`` / ``"sum"``, ``pred.shape[:-1]`` for ``"none"``.

    Raises:
        ValueError/TypeError naming the argument, as :func:`infonce_loss`: shapes, dtypes, devices,
        ``tau``, ``reduction``, ``ignore_index``; targets out of range or unavailable and mask rows with
        no action through ``check_values`` (an asynchronous device assert on CUDA).
    """
    canonical_inputs, targets, tau, ignore_index = check_infonce_args(
        pred, action_embeds, targets, tau=tau, mask=mask, reduction=reduction, ignore_index=ignore_index
    )
    return _checked_infonce_reference(canonical_inputs, pred, action_embeds, targets, tau, mask, reduction,
                                      ignore_index)  # fmt: skip


def select_actions_reference(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    *,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """``argmax_a (logits + gumbel)`` (:func:`.reference.select_actions_reference`, the spec of
    :func:`select_actions`; ``gumbel=None``: plain argmax, the lowest index among ties) behind its checks.

    Args:
        pred, action_embeds, tau, mask: as in :func:`infonce_loss`.
        gumbel: float noise broadcastable to the logits ``pred.shape[:-1] + (A,)``, or None.

    Returns:
        int64 action ids of shape ``pred.shape[:-1]``.

    Raises:
        ValueError/TypeError naming the argument, as :func:`select_actions`; through ``check_values``: a
        mask row with no available action, and a NaN logit of an available action (NaN in ``pred`` or
        ``action_embeds``; NaN only in the embedding of an action no row may take is harmless).
    """
    canonical_inputs = canonical(pred, action_embeds, mask)
    tau = check_positive_float(tau, "tau")
    check_rows_have_actions(canonical_inputs.mask)
    check_gumbel(gumbel, pred, action_embeds)
    logits = reference.action_logits_reference(pred, action_embeds, tau=tau, mask=mask)  # -inf where masked
    check_values(
        logits.isnan().any(),
        NAN_LOGIT_MESSAGE,  # the details as check_selection_status gives them
        lambda: f": NaN in pred: {bool(pred.isnan().any())}, in action_embeds: {bool(action_embeds.isnan().any())}",
    )
    return reference.select_actions_reference(pred, action_embeds, tau=tau, mask=mask, gumbel=gumbel)
