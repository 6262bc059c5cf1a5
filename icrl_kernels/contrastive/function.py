"""Public entry points of contrastive action scoring (Headless-AD): their custom ops and ``vmap`` rules.

Two ops, ``icrl::infonce_loss`` (with ``icrl::infonce_loss_backward``) and ``icrl::select_actions``, each
running the algorithm its ``impl`` argument names, an entry of ``algorithms.ALGORITHMS`` (one table: the four
Triton algorithms and the eager path). The public functions check their arguments once per signature
(``checks.infonce_plan``, cached), choose the algorithm and call the op: the op's forward calls the entry, whose
launcher launches.

``icrl::infonce_loss`` returns the *reduced* loss, so that with ``reduction="mean"`` or ``"sum"`` the forward
knows each row's weight (``1 / count`` of the non-ignored rows, or 1; 0 on ignored rows): the algorithms that
compute the gradients in the forward (``Algorithm.gradients_in_forward``) compute those of the loss for an
upstream gradient of 1, each rounded once to the inputs' dtype, and the backward multiplies them by the upstream
scalar (exact when it is 1, as for ``loss.backward()``, or a power of two, as under loss scaling, short of fp16's
subnormal range; one more rounding otherwise); they keep no input for the backward, only those gradients. The
others (``fused``, ``eager``) keep the inputs and each row's log-sum-exp and compute the gradients in the backward,
as every algorithm does with ``reduction="none"`` (the upstream gradient differs per row). Only the gradients
wanted at the call (inputs that require grad, grad mode on) are computed.

``runs``: the reduction is taken over each of ``runs`` equal slices of the flat rows (the loss is then
``[runs]``): how ``torch.func.vmap`` over ``K`` runs folds them into one call (:func:`_infonce_vmap`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._library import checked_per_signature, differentiable_op, inference_op
from .._validation import check_generator, check_positive_float, check_values
from . import reference
from .algorithms import (
    AUTO,
    EAGER,
    INFONCE_ALGORITHMS,
    algorithm_entry,
    canonical_views,
    count_rows,
    infonce_algorithm,
    row_weights,
    select_algorithm,
)
from .checks import (
    IGNORE_INDEX,
    NAN_LOGIT_MESSAGE,
    Plan,
    canonical_mask,
    check_gumbel,
    check_pred_and_map,
    check_row_status,
    check_rows_have_actions,
    check_selection_status,
    check_target_values,
    infonce_plan,
    select_plan,
)
from .eager import gumbel_noise

#: The algorithms whose forward computes the gradients of a reduced loss (``Algorithm.gradients_in_forward``),
#: known without importing their (Triton) modules: the fake implementations need it.
_GRADIENTS_IN_FORWARD = frozenset(("small", "row_chunks", "action_chunks"))


def padded_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The canonical uint8 mask for the Triton kernels: ``[1 or B, 1 or T, A_pad]``, ``A_pad`` the next
    multiple of 16 (columns past ``A`` zero), contiguous along actions, rows 16-byte aligned.

    The kernels load mask rows in 16-byte vectors only where rows are aligned and the load bound is a
    multiple of 16; at A = 125 they went element by element and spilled ~2 KB per thread. One copy per
    call, and none when the mask is already aligned. Alignment is read from the storage offset (every
    allocation of torch's allocators is at least 16-byte aligned; a tensor from foreign memory that is not
    only loses the vector loads): no pointer is read, so this traces under ``torch.compile``.
    """
    if mask is None:
        return None
    num_actions = mask.shape[-1]
    aligned = (
        num_actions % 16 == 0
        and mask.stride(-1) == 1
        and all(mask.shape[i] == 1 or mask.stride(i) % 16 == 0 for i in range(mask.dim() - 1))
        and mask.storage_offset() % 16 == 0
    )
    if aligned:
        return mask
    padded = mask.new_zeros(mask.shape[:-1] + (-(-num_actions // 16) * 16,))
    padded[..., :num_actions] = mask
    return padded


# -- InfoNCE ---------------------------------------------------------------------------------------
def _forward(
    pred: torch.Tensor,
    embeds: torch.Tensor,
    targets: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045 (torch.library parses the annotation)
    tau: float,
    ignore_index: int,
    reduction: str,
    runs: int,
    want_pred: bool,
    want_embeds: bool,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, grad_pred, grad_embeds)``: the reduced float32 loss (``[]``, ``[runs]`` or per row), each
    row's log-sum-exp where the backward needs it, and the gradients the forward computed (empty tensors where
    none)."""
    # int64 before comparing with ignore_index: -100 would wrap around in uint8.
    targets = targets.long().contiguous()
    loss, lse, status, grad_pred, grad_embeds = algorithm_entry(impl).infonce_forward(
        pred.contiguous(), embeds.contiguous(), targets, mask if impl == EAGER else padded_mask(mask), tau,
        ignore_index, reduction, runs, want_pred, want_embeds,
    )  # fmt: skip
    if status is not None:  # the value checks the kernels reported per row (checked here, in the op: compiled too)
        check_row_status(status, targets, embeds.shape[-2], ignore_index, mask is not None)
    return (
        loss,
        pred.new_empty(0, dtype=torch.float32) if lse is None else lse,
        pred.new_empty(0) if grad_pred is None else grad_pred,
        embeds.new_empty(0) if grad_embeds is None else grad_embeds,
    )


def _keeps_lse(impl: str) -> bool:
    """Whether the algorithm's backward reads the forward's log-sum-exps (the others compute their gradients
    in the forward, or again in the backward)."""
    return impl not in _GRADIENTS_IN_FORWARD


def _forward_fake(pred, embeds, targets, mask, tau, ignore_index, reduction, runs, want_pred, want_embeds, impl):
    reduced = reduction != "none"
    loss_shape = targets.shape if not reduced else (() if runs == 1 else (runs,))
    precompute = reduced and impl in _GRADIENTS_IN_FORWARD
    return (
        pred.new_empty(loss_shape, dtype=torch.float32),
        pred.new_empty(targets.shape if _keeps_lse(impl) else (0,), dtype=torch.float32),
        pred.new_empty(pred.shape if precompute and want_pred else (0,)),
        embeds.new_empty(embeds.shape if precompute and want_embeds else (0,)),
    )


def _backward(
    grad_loss: torch.Tensor,
    pred: Optional[torch.Tensor],  # noqa: UP045
    embeds: Optional[torch.Tensor],  # noqa: UP045
    targets: Optional[torch.Tensor],  # noqa: UP045
    mask: Optional[torch.Tensor],  # noqa: UP045
    lse: Optional[torch.Tensor],  # noqa: UP045
    grad_pred: Optional[torch.Tensor],  # noqa: UP045
    grad_embeds: Optional[torch.Tensor],  # noqa: UP045
    tau: float,
    ignore_index: int,
    reduction: str,
    runs: int,
    impl: str,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    # None for a gradient nobody asked for (the registered op returns an empty tensor there: differentiable_op).
    if pred is None:  # the forward's gradients, times the upstream scalar of each run (0-dim: keeps their dtype)
        return (
            _scaled(grad_pred, grad_loss, runs) if needs_grad[0] else None,
            _scaled(grad_embeds, grad_loss, runs) if needs_grad[1] else None,
        )
    targets = targets.long().contiguous()
    if reduction == "none":
        weights = torch.where(targets == ignore_index, 0.0, grad_loss.float())
    else:  # the reduction's weights (row_weights) times each run's upstream gradient
        count = count_rows(targets, ignore_index, runs) if reduction == "mean" else None
        upstream = grad_loss.float()
        if runs > 1:
            upstream = upstream.repeat_interleave(targets.numel() // runs).view(targets.shape)
        weights = row_weights(targets, ignore_index, count) * upstream
    return algorithm_entry(impl).infonce_backward(
        weights, pred.contiguous(), embeds.contiguous(), targets, mask if impl == EAGER else padded_mask(mask), lse,
        tau, ignore_index, needs_grad[0], needs_grad[1],
    )  # fmt: skip


def _scaled(grad: torch.Tensor, grad_loss: torch.Tensor, runs: int) -> torch.Tensor:
    """``grad`` (computed for an upstream gradient of 1 per run) times each run's upstream gradient; the runs are
    equal slices of ``grad``'s first dimension."""
    if runs == 1:
        return grad * grad_loss
    return (grad.view(runs, -1) * grad_loss.view(runs, 1)).view(grad.shape)


def _backward_fake(
    grad_loss, pred, embeds, targets, mask, lse, grad_pred, grad_embeds, tau, ignore_index, reduction, runs, impl,
    needs_grad,
):  # fmt: skip
    if pred is None:
        return tuple(
            torch.empty_like(grad) if needed else grad_loss.new_empty(0)
            for grad, needed in zip((grad_pred, grad_embeds), needs_grad)
        )
    return (
        pred.new_empty(pred.shape) if needs_grad[0] else grad_loss.new_empty(0),
        embeds.new_empty(embeds.shape) if needs_grad[1] else grad_loss.new_empty(0),
    )


def _save(inputs: tuple, output: tuple) -> tuple:
    """What the backward needs: the forward's gradients where it computed them (a prediction nothing else keeps is
    then not held until the backward); else the inputs and, for the algorithms that keep them, the log-sum-exps."""
    pred, embeds, targets, mask, tau, ignore_index, reduction, runs, _, _, impl = inputs
    _, lse, grad_pred, grad_embeds = output
    if reduction != "none" and impl in _GRADIENTS_IN_FORWARD:
        return (None,) * 5 + (grad_pred, grad_embeds, tau, ignore_index, reduction, runs, impl)
    return (pred, embeds, targets, mask, lse if _keeps_lse(impl) else None, None, None, tau, ignore_index,
            reduction, runs, impl)  # fmt: skip


infonce_op, infonce_backward_op = differentiable_op(
    "infonce_loss",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    saved_tensors=7,  # pred, embeds, targets, mask, lse, grad_pred, grad_embeds (each or None); then constants
    grad_inputs=(0, 1),
    differentiable_outputs=1,
    pass_needs_grad=True,
    traceable=INFONCE_ALGORITHMS,  # the Triton algorithms: torch.compile traces into their kernels (triton_op)
    materialize_grads=False,  # no zero-filled gradients for the side outputs, as large as the inputs
)


# -- selection -------------------------------------------------------------------------------------
def _select(
    pred: torch.Tensor,
    embeds: torch.Tensor,
    mask: Optional[torch.Tensor],  # noqa: UP045
    tau: float,
    sample: bool,
    seed: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    """``seed``: int64 seeds on ``pred``'s device, read by the kernels, never by the host; flat row ``r`` draws from
    ``seed[r // (rows / seed.numel())]`` (one seed per run under ``vmap``)."""
    actions, status = algorithm_entry(impl).select(
        pred.contiguous(), embeds.contiguous(), mask if impl == EAGER else padded_mask(mask), tau, sample, seed,
        max(1, pred.numel() // pred.shape[-1] // seed.numel()),
    )  # fmt: skip
    # The choice is an available action whatever the values; an empty mask row and NaN inputs are still
    # errors to report, read from the per-row status the selection wrote (3 ops on CUDA, not 8 with a mask).
    check_selection_status(status, pred, embeds, has_mask=mask is not None)
    return actions


def _select_fake(pred, embeds, mask, tau, sample, seed, impl):
    return pred.new_empty(pred.shape[:-1], dtype=torch.int64)


select_actions_op = inference_op("select_actions", _select, fake=_select_fake, traceable=INFONCE_ALGORITHMS)


# -- vmap: runs folded into one call ---------------------------------------------------------------
def _runs_first(tensor: torch.Tensor, dim: int | None, runs: int) -> torch.Tensor:
    """``tensor`` with its vmapped dimension first (``[K, ...]``); expanded (a stride-0 view) where not vmapped."""
    return tensor.movedim(dim, 0) if dim is not None else tensor.expand(runs, *tensor.shape)


def _per_run_shape(tensor: torch.Tensor, dim: int | None) -> tuple[int, ...]:
    shape = tuple(tensor.shape)
    return shape if dim is None else shape[:dim] + shape[dim + 1 :]


def _fold_runs(runs: int, in_dims: tuple, pred, embeds, targets, mask):
    """The op's arguments of ``runs`` vmapped calls as the arguments of one call whose rows are the runs' rows,
    run after run (so that run ``k``'s rows are the ``k``-th of ``runs`` equal slices of the flat rows):

    * one map per run, or one map for every run (``embeds [A, D]`` per run): each run is one sequence of its
      ``B T`` rows, ``pred [K, B T, D]``, against ``embeds [K, A, D]`` (one per run) or the shared ``[A, D]``;
    * one map per sequence (``embeds [B, A, D]`` per run): the runs' sequences are the batch,
      ``pred [K B, T, D]`` against ``embeds [K B, A, D]``.

    Views where the strides allow (the usual case: inputs stacked along a new first dimension); copies of what
    is not vmapped but has to differ per sequence (a per-sequence map or mask shared by the runs) or cannot be
    viewed so. ``targets`` (None for a selection) and ``mask`` (canonical ``[1 or B, 1 or T, A]``, or None)
    follow ``pred``'s rows."""
    pred_dim, embeds_dim, targets_dim, mask_dim = in_dims
    per_sequence = embeds.dim() - (embeds_dim is not None) == 3
    pred = _runs_first(pred, pred_dim, runs)
    pred4 = pred if pred.dim() == 4 else (pred[:, :, None] if per_sequence else pred[:, None])
    _, batch, steps, dim = pred4.shape
    if mask is not None:
        mask = mask.movedim(mask_dim, 0) if mask_dim is not None else mask[None]  # [K or 1, mB, mT, A]
    if per_sequence:
        rows = (runs * batch, steps)
        embeds = _runs_first(embeds, embeds_dim, runs).reshape(runs * batch, *embeds.shape[-2:])
        if mask is not None and (mask.shape[0] > 1 or mask.shape[1] > 1):
            mask = mask.expand(runs, batch, *mask.shape[2:]).reshape(runs * batch, *mask.shape[2:])
        elif mask is not None:
            mask = mask[0]
    else:
        rows = (runs, batch * steps)
        if embeds_dim is not None:
            embeds = embeds.movedim(embeds_dim, 0)
        if mask is not None and (mask.shape[1] > 1 or mask.shape[2] > 1):
            mask = mask.expand(mask.shape[0], batch, steps, mask.shape[-1]).reshape(mask.shape[0], batch * steps, -1)
        elif mask is not None:
            mask = mask.reshape(mask.shape[0], 1, mask.shape[-1])
    pred = pred4.reshape(*rows, dim)
    if targets is not None:
        targets = _runs_first(targets, targets_dim, runs).reshape(rows)
    return pred, embeds, targets, mask


def _infonce_vmap(info, in_dims, pred, embeds, targets, mask, tau, ignore_index, reduction, runs, want_pred,
                  want_embeds, impl):  # fmt: skip
    """``torch.func.vmap`` over ``K`` runs of :data:`infonce_op`: one call, the runs folded into its rows
    (:func:`_fold_runs`), its reduction taken per run (``runs``). Only the forward op needs the rule: the backward
    runs outside ``vmap``, on the folded tensors autograd saved."""
    size = info.batch_size
    # The public function read requires_grad of vmap's wrappers, which do not carry it: the tensors' own.
    grad = torch.is_grad_enabled()
    want_pred, want_embeds = grad and pred.requires_grad, grad and embeds.requires_grad
    pred_shape, targets_shape = _per_run_shape(pred, in_dims[0]), _per_run_shape(targets, in_dims[2])
    embeds_shape = _per_run_shape(embeds, in_dims[1])
    folded = _fold_runs(size, in_dims[:4], pred, embeds, targets, mask)
    shared_map = len(embeds_shape) == 2 and in_dims[1] is None
    if reduction != "none" and want_embeds and shared_map and impl in _GRADIENTS_IN_FORWARD:
        # The forward's gradient for a map every run shares would mix the runs, whose upstream gradients differ:
        # per-row losses, reduced here per run (autograd takes the reductions' gradients).
        loss, lse, grad_pred, grad_embeds = infonce_op(*folded, tau, ignore_index, "none", 1, want_pred, want_embeds,
                                                       impl)  # fmt: skip
        losses = loss.view(size * runs, -1)
        loss = losses.sum(1)
        if reduction == "mean":
            loss = loss / (folded[2] != ignore_index).view(size * runs, -1).sum(1)
    else:
        loss, lse, grad_pred, grad_embeds = infonce_op(*folded, tau, ignore_index, reduction, size * runs, want_pred,
                                                       want_embeds, impl)  # fmt: skip
    loss_shape = targets_shape if reduction == "none" else (() if runs == 1 else (runs,))
    # Each output per run (an empty one, nothing computed, stays unbatched).
    shapes = (loss_shape, targets_shape, pred_shape, embeds_shape)
    outputs = [(output, None) if output.numel() == 0 else (output.view(size, *shape), 0)
               for output, shape in zip((loss, lse, grad_pred, grad_embeds), shapes)]  # fmt: skip
    return tuple(output for output, _ in outputs), tuple(dim for _, dim in outputs)


def _select_vmap(info, in_dims, pred, embeds, mask, tau, sample, seed, impl):
    """``torch.func.vmap`` over ``K`` runs of :data:`select_actions_op`: one call, the runs folded into its rows,
    each run drawing from its own seed (a seed every run shares is each run's: the draws a run makes alone)."""
    size = info.batch_size
    rows_shape = _per_run_shape(pred, in_dims[0])[:-1]
    pred, embeds, _, mask = _fold_runs(size, (in_dims[0], in_dims[1], None, in_dims[2]), pred, embeds, None, mask)
    seed = _runs_first(seed, in_dims[5], size).reshape(-1).contiguous()  # one seed per run, in the runs' order
    actions = select_actions_op(pred, embeds, mask, tau, sample, seed, impl)
    return actions.view(size, *rows_shape), 0


infonce_op.register_vmap(_infonce_vmap)
select_actions_op.register_vmap(_select_vmap)


# -- public functions ------------------------------------------------------------------------------
#: The argument checks (the backend and the algorithm decided there), once per argument signature.
_infonce_plan = checked_per_signature(infonce_plan)
_select_plan = checked_per_signature(select_plan)


def infonce_loss(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    targets: torch.Tensor,
    *,
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = IGNORE_INDEX,
    algorithm: str = "auto",
    backend: str = "auto",
) -> torch.Tensor:
    """Contrastive (InfoNCE) action loss of Headless-AD: cross-entropy of ``targets`` under
    ``softmax_a(pred . e_a / tau)`` over the available actions, fused (the ``N x A`` logits never reach
    memory).

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
        algorithm: the Triton backend's algorithm (docs/ops.md, "Algorithms"): ``"auto"`` (chosen by ``A``),
            ``"small"`` (``A <= 128``), ``"fused"``, ``"row_chunks"`` or ``"action_chunks"``; any but ``"auto"``
            needs the Triton backend. Thread-safe: it is an argument, not a setting.
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager), ``"triton"``,
            ``"eager"`` (row chunks, logits recomputed in the backward) or ``"reference"``.

    Returns:
        float32 loss; differentiable w.r.t. ``pred`` and ``action_embeds``. Under ``torch.func.vmap`` over runs
        (each with its own inputs, maps included) the runs are one call of the kernels, reduced per run.

    Precision: the gradients are computed in fp32 (every scale, ``1 / tau``, the upstream gradient and the
    mean's ``1 / N``, applied in fp32) and rounded once to the input dtype, so fp16/bf16 gradients are as
    accurate as the fp32 gradient rounded to that dtype. (With ``"mean"``/``"sum"``, the algorithms that compute
    the gradients in the forward, ``small`` and the chunked ones, multiply them by the actual upstream gradient in
    the backward: exact for 1 or a power of two (as loss scaling uses) short of fp16's subnormal range, one more
    rounding otherwise.) fp16 training still needs loss scaling, as anywhere: with ``reduction="mean"`` each row's
    gradient carries ``1 / N``, and at N = 65536 most of ``grad_pred`` lies in fp16's subnormal range (below
    6.1e-5), where it keeps only a few bits.

    Raises:
        ValueError: shape/width mismatch, tau <= 0, an unknown ``algorithm`` (or one the backend does not run),
            a target out of range or unavailable, a row whose mask allows no action. TypeError: wrong dtypes. The
            value checks (targets, mask rows) run on the device: on CUDA they are asynchronous device asserts
            (see ``set_value_checks``).
    """
    plan = _infonce_plan(pred, action_embeds, targets, tau, mask, reduction, ignore_index, algorithm, backend)
    impl = plan.impl
    if impl == "reference":
        return _checked_infonce_reference(plan, pred, action_embeds, targets, tau, mask, reduction, ignore_index)
    if impl == AUTO:  # an fp32 choice that depends on torch's matmul precision, read at each call
        impl = infonce_algorithm(plan.num_actions, pred.dtype)
    if mask is not None:
        mask = canonical_mask(mask, plan)
    grad = torch.is_grad_enabled()
    return infonce_op(
        pred, action_embeds, targets, mask, plan.tau, plan.ignore_index, reduction, 1,
        grad and pred.requires_grad, grad and action_embeds.requires_grad, impl,
    )[0]  # fmt: skip


def select_actions(
    pred: torch.Tensor,
    action_embeds: torch.Tensor,
    *,
    mode: str = "sample",
    tau: float = 1.0,
    mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    algorithm: str = "auto",
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
        algorithm: as in :func:`infonce_loss` (``"small"`` runs the fused kernel, selection's one-kernel path).
        backend: as in :func:`infonce_loss`.

    Returns:
        int64 action ids of shape ``pred.shape[:-1]``. Under ``torch.func.vmap`` over runs, one call of the
        kernels; each run draws as it would alone with the seed it was given (``randomness="different"``: its
        own; ``"same"``: the shared one).
    """
    if generator is not None:  # any generator object: not part of the signature
        check_generator(generator)
    plan = _select_plan(pred, action_embeds, mode, tau, mask, algorithm, backend)
    impl = plan.impl
    sample = mode == "sample"
    if impl == "reference":
        gumbel = None
        if sample:
            shape = tuple(pred.shape[:-1]) + (plan.num_actions,)
            gumbel = gumbel_noise(shape, generator=generator, device=pred.device)
        # The checked spec: rows without an action, and NaN logits of available actions, raise there.
        return select_actions_reference(pred, action_embeds, tau=tau, mask=mask, gumbel=gumbel)
    if impl == AUTO:
        impl = select_algorithm(plan.num_actions, pred.dtype)
    # Argmax needs no seed: a constant placeholder, so that argmax consumes no random numbers.
    seed = _draw_seed(generator, pred.device) if sample else _NO_SEEDS.get(pred.device)
    if seed is None:
        seed = _no_seed(pred.device)
    if mask is not None:
        mask = canonical_mask(mask, plan)
    return select_actions_op(pred, action_embeds, mask, plan.tau, sample, seed, impl)


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One int64 seed as a ``[1]`` tensor on ``device``, drawn from ``generator`` (torch's global CPU
    generator when None) on the generator's own device and copied without a host read. A CPU seed bound for
    a GPU is pinned first: CUDA documents that a copy from pageable memory may wait for the stream."""
    seed_device = generator.device if generator is not None else torch.device("cpu")
    seed = torch.randint(0, 2**62, (1,), generator=generator, device=seed_device)
    if seed.device.type == "cpu" and device.type == "cuda":
        seed = seed.pin_memory()
    return seed.to(device, non_blocking=True)


#: Argmax's placeholder seed per device (read by no kernel): made once, not at every call.
_NO_SEEDS: dict[torch.device, torch.Tensor] = {}


def _no_seed(device: torch.device) -> torch.Tensor:
    seed = _NO_SEEDS.get(device)
    if seed is None:
        seed = torch.zeros(1, dtype=torch.int64, device=device)
        if not torch.compiler.is_compiling():
            _NO_SEEDS[device] = seed
    return seed


# -- checked references ----------------------------------------------------------------------------
def _checked_infonce_reference(plan: Plan, pred, action_embeds, targets, tau, mask, reduction, ignore_index):
    """:func:`.reference.infonce_loss_reference` on checked arguments, after the value checks the op runs."""
    mask3 = canonical_mask(mask, plan)
    check_rows_have_actions(mask3)
    _, _, targets2 = canonical_views(pred, action_embeds, targets.long())
    check_target_values(targets2, mask3, plan.num_actions, plan.ignore_index)
    return reference.infonce_loss_reference(
        pred, action_embeds, targets, tau=plan.tau, mask=mask, reduction=reduction, ignore_index=plan.ignore_index
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
    check_pred_and_map(pred, action_embeds, mask)
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
    plan = _infonce_plan(pred, action_embeds, targets, tau, mask, reduction, ignore_index, AUTO, "reference")
    return _checked_infonce_reference(plan, pred, action_embeds, targets, tau, mask, reduction, ignore_index)


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
    mask_shape = check_pred_and_map(pred, action_embeds, mask)
    tau = check_positive_float(tau, "tau")
    check_rows_have_actions(None if mask is None else mask.view(torch.uint8).view(mask_shape))
    check_gumbel(gumbel, pred, action_embeds)
    logits = reference.action_logits_reference(pred, action_embeds, tau=tau, mask=mask)  # -inf where masked
    check_values(
        logits.isnan().any(),
        NAN_LOGIT_MESSAGE,  # the details as check_selection_status gives them
        lambda: f": NaN in pred: {bool(pred.isnan().any())}, in action_embeds: {bool(action_embeds.isnan().any())}",
    )
    return reference.select_actions_reference(pred, action_embeds, tau=tau, mask=mask, gumbel=gumbel)
