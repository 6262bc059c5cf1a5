"""Argument checks of the contrastive ops, shared by the public functions and their checked references.

Shape, dtype and device checks read no tensor value; the value checks (targets in range, rows with an
available action) go through ``check_values`` or, from the per-row status a kernel wrote,
``check_status_codes`` (no host sync on CUDA).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .._backend import resolve_backend
from .._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_choice,
    check_int,
    check_positive_float,
    check_same_device,
    check_status_codes,
    check_tensor,
    check_values,
    device_side_value_checks,
    value_checks,
)
from .algorithms import (
    ALGORITHM_CHOICES,
    AUTO,
    EAGER,
    FUSED,
    SMALL,
    SMALL_MAX_ACTIONS,
    depends_on_matmul_precision,
    infonce_algorithm,
    select_algorithm,
)

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")
SELECTION_MODES = ("sample", "argmax")

#: Per-row status codes written by the InfoNCE forward and the selection (0: the row passes every value
#: check), in the order the checks report them: a mask row with no available action, a target out of
#: range, an unavailable target (InfoNCE), a NaN logit of an available action (selection).
ROW_NO_ACTION, ROW_TARGET_OUT_OF_RANGE, ROW_TARGET_UNAVAILABLE, ROW_NAN_LOGIT = 1, 2, 3, 4
NO_ACTION_MESSAGE = "mask leaves a row with no available action (every row needs at least one)"
UNAVAILABLE_TARGET_MESSAGE = "targets include actions that mask marks unavailable"
NAN_LOGIT_MESSAGE = "pred or action_embeds contains NaN (a logit of an available action is NaN)"


def _range_message(num_actions: int, ignore_index: int) -> str:
    return f"targets must lie in [0, {num_actions}) or equal ignore_index={ignore_index}"


class Plan(NamedTuple):
    """What the checks of one argument signature decided (:func:`infonce_plan`, :func:`select_plan`).

    ``impl``: ``"reference"``, an entry of ``algorithms.ALGORITHMS`` (``"eager"`` or a Triton algorithm), or
    ``"auto"`` where the Triton algorithm depends on torch's fp32 matmul precision at the call
    (``algorithms.depends_on_matmul_precision``). ``mask_shape``: the mask's canonical view
    ``[1 or B, 1 or T, A]`` (uint8; None without a mask). ``tau`` and ``ignore_index`` (0 for a selection) as a
    Python float and int."""

    impl: str
    num_actions: int
    mask_shape: tuple[int, ...] | None
    tau: float
    ignore_index: int


def infonce_plan(
    pred: object,
    action_embeds: object,
    targets: object,
    tau: object,
    mask: object,
    reduction: object,
    ignore_index: object,
    algorithm: object,
    backend: object,
) -> Plan:
    """The argument checks of :func:`~icrl_kernels.infonce_loss` (and, with ``backend="reference"``, its checked
    reference), reading no tensor value: the public functions run them once per argument signature
    (``function._infonce_plan``, :func:`icrl_kernels._library.checked_per_signature`; arguments positional).

    Raises:
        TypeError/ValueError naming the argument (see :func:`check_pred_and_map`); ``targets`` not an integer
        tensor of shape ``pred.shape[:-1]`` on ``pred``'s device; ``tau`` not > 0 and finite; an unknown
        ``reduction``, ``algorithm`` or ``backend``; a non-int ``ignore_index``; ``algorithm`` other than
        ``"auto"`` where the backend is not Triton, ``"small"`` beyond its action tile; a dtype the backend does
        not take.
    """
    mask_shape = check_pred_and_map(pred, action_embeds, mask)
    check_tensor(targets, "targets", dtypes=INT_DTYPES)
    if tuple(targets.shape) != tuple(pred.shape[:-1]):
        want = tuple(pred.shape[:-1])
        raise ValueError(f"targets must have shape pred.shape[:-1] = {want}, got {tuple(targets.shape)}")
    check_same_device(pred=pred, targets=targets)
    tau = check_positive_float(tau, "tau")
    check_choice(reduction, "reduction", REDUCTIONS)
    ignore_index = check_int(ignore_index, "ignore_index")
    num_actions = action_embeds.shape[-2]
    impl = _implementation(pred, num_actions, algorithm, backend, select=False)
    return Plan(impl, num_actions, mask_shape, tau, ignore_index)


def select_plan(
    pred: object, action_embeds: object, mode: object, tau: object, mask: object, algorithm: object, backend: object
) -> Plan:
    """The argument checks of :func:`~icrl_kernels.select_actions` but the generator's (the caller checks it: any
    generator object, not part of the signature), once per argument signature (``function._select_plan``, as
    :func:`infonce_plan`).

    Raises:
        TypeError/ValueError naming the argument (see :func:`check_pred_and_map`); an unknown ``mode``,
        ``algorithm`` or ``backend``, ``tau`` not > 0 and finite; ``algorithm`` other than ``"auto"`` where the
        backend is not Triton.
    """
    mask_shape = check_pred_and_map(pred, action_embeds, mask)
    check_choice(mode, "mode", SELECTION_MODES)
    tau = check_positive_float(tau, "tau")
    num_actions = action_embeds.shape[-2]
    impl = _implementation(pred, num_actions, algorithm, backend, select=True)
    return Plan(impl, num_actions, mask_shape, tau, 0)


def _implementation(pred: torch.Tensor, num_actions: int, algorithm: object, backend: object, *, select: bool) -> str:
    """``Plan.impl``: the backend (``resolve_backend``), then, on Triton, the algorithm (``algorithm`` checked)."""
    check_choice(algorithm, "algorithm", ALGORITHM_CHOICES)
    impl = resolve_backend(backend, pred.device, kernel_inputs={"pred": pred})  # action_embeds has pred's dtype
    if impl != "triton":
        if algorithm != AUTO:
            raise ValueError(
                f"algorithm={algorithm!r} runs on the Triton backend, but backend={backend!r} resolved to {impl!r}"
            )
        return EAGER if impl == "eager" else impl
    if algorithm == AUTO:
        if depends_on_matmul_precision(num_actions, pred.dtype):
            return AUTO
        return (select_algorithm if select else infonce_algorithm)(num_actions, pred.dtype)
    if algorithm == SMALL and select:
        return FUSED  # the fused selection kernel is the small algorithm's one-kernel path
    if algorithm == SMALL and num_actions > SMALL_MAX_ACTIONS:
        raise ValueError(f"algorithm={SMALL!r} holds at most {SMALL_MAX_ACTIONS} actions, got A = {num_actions}")
    return algorithm


def check_pred_and_map(pred: object, action_embeds: object, mask: object) -> tuple[int, ...] | None:
    """Validate the shapes, dtypes and devices of ``pred``, ``action_embeds`` and ``mask``; return the mask's
    canonical shape ``[1 or B, 1 or T, A]`` (None without a mask): ``[N, D]`` predictions are one sequence of
    ``N`` steps, per-sequence ``[B, D]`` ones ``B`` sequences of one step.

    Args:
        pred: ``[N, D]`` or ``[B, T, D]`` (``[B, D]`` with per-sequence maps), float, nonempty.
        action_embeds: ``[A, D]`` or ``[B, A, D]``, ``pred``'s dtype and device, nonempty.
        mask: bool ``[A]``, ``[B, A]`` (with ``[B, T, D]`` pred) or ``pred.shape[:-1] + (A,)``, or None.

    Raises:
        TypeError: a non-tensor, a non-float ``pred``/``action_embeds``, different dtypes, a non-bool mask.
        ValueError: a wrong rank, an empty ``pred``/``action_embeds``, a width, batch or mask shape that
            does not match, tensors on different devices.
    """
    check_tensor(pred, "pred", ndim=(2, 3), dtypes=FLOAT_DTYPES, nonempty=True)
    check_tensor(action_embeds, "action_embeds", ndim=(2, 3), dtypes=FLOAT_DTYPES, nonempty=True)
    check_same_device(pred=pred, action_embeds=action_embeds)
    if action_embeds.dtype != pred.dtype:
        raise TypeError(
            f"action_embeds must have pred's dtype ({pred.dtype}), got {action_embeds.dtype}; cast the map first"
        )
    if action_embeds.shape[-1] != pred.shape[-1]:
        raise ValueError(
            f"action_embeds width {action_embeds.shape[-1]} does not match pred width {pred.shape[-1]} "
            f"(shapes {tuple(action_embeds.shape)} and {tuple(pred.shape)})"
        )
    num_actions = action_embeds.shape[-2]
    per_sequence = action_embeds.dim() == 3
    if per_sequence and action_embeds.shape[0] != pred.shape[0]:
        raise ValueError(
            f"per-sequence action_embeds [B, A, D] must have pred's batch size {pred.shape[0]}, "
            f"got shape {tuple(action_embeds.shape)}"
        )
    if mask is None:
        return None
    check_tensor(mask, "mask", dtypes=(torch.bool,))
    check_same_device(pred=pred, mask=mask)
    rows = tuple(pred.shape[:-1])
    if pred.dim() == 3:
        batch, steps = rows
    else:
        batch, steps = (rows[0], 1) if per_sequence else (1, rows[0])
    if tuple(mask.shape) == (num_actions,):
        return (1, 1, num_actions)
    if tuple(mask.shape) == rows + (num_actions,):
        return (batch, steps, num_actions)
    if pred.dim() == 3 and tuple(mask.shape) == (pred.shape[0], num_actions):
        return (batch, 1, num_actions)
    per_seq = f", [B, A] = {(pred.shape[0], num_actions)}" if pred.dim() == 3 else ""
    raise ValueError(
        f"mask must have shape [A] = ({num_actions},){per_seq} or {rows + (num_actions,)}, got {tuple(mask.shape)}"
    )


def canonical_mask(mask: torch.Tensor | None, plan: Plan) -> torch.Tensor | None:
    """The checked ``mask`` as the ops take it: a uint8 view of shape ``plan.mask_shape`` (no copy)."""
    return None if mask is None else mask.view(torch.uint8).view(plan.mask_shape)


def check_gumbel(gumbel: object, pred: torch.Tensor, action_embeds: torch.Tensor) -> None:
    """``gumbel`` (of the reference selection): None, or float noise broadcastable to the logits
    ``pred.shape[:-1] + (A,)``."""
    if gumbel is None:
        return
    check_tensor(gumbel, "gumbel", dtypes=FLOAT_DTYPES)
    logits_shape = tuple(pred.shape[:-1]) + (action_embeds.shape[-2],)
    broadcasts = gumbel.dim() <= len(logits_shape) and all(
        size in (1, want) for size, want in zip(reversed(gumbel.shape), reversed(logits_shape))
    )
    if not broadcasts:
        raise ValueError(f"gumbel must broadcast to the logits' shape {logits_shape}, got {tuple(gumbel.shape)}")


def check_rows_have_actions(mask: torch.Tensor | None) -> None:
    """Every row of the canonical ``mask`` allows at least one action (a value check, no host sync on GPU)."""
    if mask is not None:
        check_values(mask.any(dim=-1).all().logical_not(), NO_ACTION_MESSAGE)


def check_target_values(targets: torch.Tensor, mask: torch.Tensor | None, num_actions: int, ignore_index: int):
    """Targets in ``[0, A)`` (or ``ignore_index``) and available, checked on the device (no host read on
    GPU; examples of bad targets are gathered only when a synchronous check fails).

    Args:
        targets: int64 ``[B, T]`` (the canonical rows).
        mask: the canonical uint8 mask ``[1 or B, 1 or T, A or more]``, or None.
    """
    used = targets != ignore_index
    out_of_range = used & ((targets < 0) | (targets >= num_actions))
    message = _range_message(num_actions, ignore_index)
    check_values(out_of_range.any(), message, lambda: f", got {targets[out_of_range][:5].tolist()}")
    if mask is not None:
        index = targets.clamp(0, num_actions - 1)
        allowed = mask[..., :num_actions].expand(targets.shape + (num_actions,)).gather(-1, index[..., None])[..., 0]
        unavailable = used & ~out_of_range & (allowed == 0)
        check_values(
            unavailable.any(), UNAVAILABLE_TARGET_MESSAGE, lambda: f", e.g. {targets[unavailable][:5].tolist()}"
        )


def check_row_status(
    status: torch.Tensor, targets: torch.Tensor, num_actions: int, ignore_index: int, has_mask: bool
) -> None:
    """The value checks of :func:`check_rows_have_actions` and :func:`check_target_values`, from the
    per-row status the fused forward wrote (``ROW_*`` codes) instead of from torch ops of their own:
    the same messages in the same order where checks are synchronous; one device assert on CUDA, so a
    call costs three small ops instead of 8 (22 with a mask)."""
    if value_checks() == "off":  # before building any message
        return
    range_message = _range_message(num_actions, ignore_index)
    with _traced_checks():
        check_status_codes(
            status,
            (
                (ROW_NO_ACTION, NO_ACTION_MESSAGE, None),
                # The same text as check_target_values: up to five offending targets.
                (ROW_TARGET_OUT_OF_RANGE, range_message, lambda bad: f", got {targets[bad][:5].tolist()}"),
                (ROW_TARGET_UNAVAILABLE, UNAVAILABLE_TARGET_MESSAGE, lambda bad: f", e.g. {targets[bad][:5].tolist()}"),
            ),
            range_message + (f"; {UNAVAILABLE_TARGET_MESSAGE} or {NO_ACTION_MESSAGE}" if has_mask else ""),
        )


def check_selection_status(status: torch.Tensor, pred: torch.Tensor, embeds: torch.Tensor, has_mask: bool) -> None:
    """The value checks of the selection, from the per-row status it wrote: a mask row with no available
    action (``ROW_NO_ACTION``), then a NaN logit of an available action (``ROW_NAN_LOGIT``); one device
    assert on CUDA (three ops, where a separate mask check and NaN check took eight)."""
    if value_checks() == "off":  # before building any message
        return
    with _traced_checks():
        check_status_codes(
            status,
            (
                (ROW_NO_ACTION, NO_ACTION_MESSAGE, None),
                (
                    ROW_NAN_LOGIT,
                    NAN_LOGIT_MESSAGE,
                    lambda _: (
                        f": NaN in pred: {bool(pred.isnan().any())}, in action_embeds: {bool(embeds.isnan().any())}"
                    ),
                ),
            ),
            NAN_LOGIT_MESSAGE + (f"; or {NO_ACTION_MESSAGE}" if has_mask else ""),
        )


def _traced_checks() -> contextlib.AbstractContextManager:
    """While torch traces an op's implementation into a graph (a ``triton_op``), the value checks' device
    assert whatever the mode: the graph reads nothing on the host."""
    return device_side_value_checks() if torch.compiler.is_compiling() else contextlib.nullcontext()
