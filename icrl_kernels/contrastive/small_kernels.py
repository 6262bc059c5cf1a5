"""The ``small`` algorithm of InfoNCE (``algorithms.SMALL``, ``A <= 128``): loss and gradient for ``pred`` in one
kernel.

At Headless-AD's sizes (tens to a hundred actions) the fused path's work is tiny and its time goes to
launches and host code (the H100 profile: ~0.16 ms of kernels in a 1.26 ms call). Here one program takes a
tile of rows with every action at once, computes the logits (one ``tl.dot`` per ``BLOCK_D`` chunk of ``D``),
each row's log-sum-exp, loss and status of the value checks (as the fused forward kernel does), and,
in the same program, ``grad_pred[r] = (w_r / tau) sum_a (softmax - one_hot)[r, a] e_a`` from the logits
it already holds: no recompute, no second launch. The row weights ``w`` are the reduction's, folded in
the kernel (``1 / count`` of the non-ignored rows for ``"mean"``, 1 for ``"sum"``; 0 on ignored rows), or
given per row (``reduction="none"``'s upstream gradient, in the backward). Precision as the fused
kernels': the dot takes the unscaled ``softmax - one_hot`` in the input dtype, ``w / tau`` scales the fp32
result, one rounding (``fused_kernels.py``, module doc).

``infonce_forward`` and ``infonce_backward`` are the algorithm's entry of ``algorithms.ALGORITHMS``; its
selection is the fused kernel's (one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import autotune, launch, next_power_of_2
from .algorithms import count_rows, row_weights
from .fused_kernels import infonce_grad_embeds
from .fused_kernels import select as select  # the fused selection is the small algorithm's too
from .kernels import (
    _available,
    _logits_tile,
    _online_logsumexp,
    _row_offsets,
    _row_tile,
    _softmax_minus_one_hot,
    _store_row_results,
    _store_single_tile_grad,
    layout,
    mask_args,
)

#: ``ROW_WEIGHTS`` of the kernel: how each non-ignored row's gradient weight ``w_r`` is found.
WEIGHT_ONE, WEIGHT_MEAN, WEIGHT_GIVEN, WEIGHT_MEAN_COUNTED = 0, 1, 2, 3
# The kernel's copies.
_WEIGHT_MEAN, _WEIGHT_GIVEN = tl.constexpr(WEIGHT_MEAN), tl.constexpr(WEIGHT_GIVEN)
_WEIGHT_MEAN_COUNTED = tl.constexpr(WEIGHT_MEAN_COUNTED)
#: Up to this many rows (one run) the kernel counts the mean's non-ignored rows itself: every program reads every
#: target (8 bytes a row, from L2: 256 programs x 64 KB at 8192 rows, a few us on an H100), where counting
#: them with torch ops costs two launches (~10 us of host time each call on a GPU). An estimate, not measured.
COUNT_IN_KERNEL_MAX_ROWS = 8192
#: Targets a program reads per step of that count.
COUNT_BLOCK = tl.constexpr(1024)

#: Output columns per gradient dot with fp32 inputs, whatever the config: IEEE fp32 dots run on FMA units, which
#: keep a slice of both operands along the reduced axis (here all 128 actions) in each thread;
#: ``[64, 128] x [128, 32]`` fp32 dots spilled 1.6-1.9 KB per thread on sm_90 (``kernels.py``, module doc).
FMA_BLOCK_D = tl.constexpr(16)

# The first config is the interpreter's and has the fused kernels' first tiles (32 rows, BLOCK_D = 32), so that
# the fused grad_embeds kernel, which the map's gradient reuses, recomputes bit-identical logits (a lone
# available action then has gradient exactly 0). Tiles of 64 rows and more keep Hopper's warpgroup MMA for bf16;
# every config compiles for sm_90 with at most 32 bytes of spill per thread (tests/test_contrastive_kernels.py;
# [64, 64] on 4 warps spilled 24 bytes in bf16 and 1.9 KB in fp32 before FMA_BLOCK_D).
_SMALL_CONFIGS = [
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
    # (128 x 32 rows spilled 368 bytes a thread with an fp32 mask under Triton 3.6, the GPU image's: left out.)
]


@autotune(_SMALL_CONFIGS, key=["A", "D", "SIZE_BUCKET", "WRITE_GRAD"])
@triton.jit
def _infonce_small_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, weights_ptr, count_ptr, loss_ptr, lse_ptr, status_ptr, grad_ptr,
    T, A, D, ROWS, RUN_ROWS, tau, ignore_index, MASK_COLS, SIZE_BUCKET,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma, stride_gb, stride_gt,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr, WRITE_GRAD: tl.constexpr, ROW_WEIGHTS: tl.constexpr,
    STORE_LSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per row: loss, status (``checks.ROW_*``), with ``STORE_LSE`` log-sum-exp, and with ``WRITE_GRAD`` the
    gradient for ``pred`` under the row weights ``ROW_WEIGHTS`` (:data:`WEIGHT_ONE`; :data:`WEIGHT_MEAN`:
    ``1 / count`` with ``count`` read from ``count_ptr[r // RUN_ROWS]``, one count per run of ``RUN_ROWS`` flat
    rows; :data:`WEIGHT_MEAN_COUNTED`: ``1 / count`` of the non-ignored rows among the first ``RUN_ROWS``,
    counted by the program; :data:`WEIGHT_GIVEN`: ``weights_ptr[r]``; 0 on ignored rows). With a mean's weights
    the stored loss is the row's term of the mean, ``loss / count``."""
    GRAD_D: tl.constexpr = BLOCK_D if HALF_DOT else FMA_BLOCK_D
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index)
    actions = tl.arange(0, BLOCK_A)
    logits = _logits_tile(
        pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
        stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
        HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
    )  # fmt: skip
    hit = actions[None, :] == targets[:, None]
    target_logit = tl.sum(tl.where(hit, logits, 0.0), axis=1)
    available_actions = tl.zeros([BLOCK_N], dtype=tl.int32)
    target_available = tl.zeros([BLOCK_N], dtype=tl.int32)
    if HAS_MASK:  # counted from the mask itself, not from -inf logits (an infinite pred is not a masked action)
        available = _available(
            mask_ptr, rows, row_ok, actions, T, A, MASK_COLS, stride_mb, stride_mt, stride_ma, HAS_MASK
        )  # fmt: skip
        available_actions = tl.sum(available.to(tl.int32), axis=1)
        target_available = tl.sum((hit & available).to(tl.int32), axis=1)
    row_max, row_sum = _online_logsumexp(
        tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.float32), logits
    )  # fmt: skip
    if ROW_WEIGHTS == _WEIGHT_GIVEN:
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
    elif ROW_WEIGHTS == _WEIGHT_MEAN:
        count = tl.load(count_ptr + rows // RUN_ROWS, mask=row_ok, other=1)
        weight = 1.0 / count.to(tl.float32)
    elif ROW_WEIGHTS == _WEIGHT_MEAN_COUNTED:  # one run of RUN_ROWS rows, counted here
        used = tl.zeros([COUNT_BLOCK], dtype=tl.int32)
        for start in range(0, RUN_ROWS, COUNT_BLOCK):
            index = start + tl.arange(0, COUNT_BLOCK)
            used += (tl.load(targets_ptr + index, mask=index < RUN_ROWS, other=ignore_index) != ignore_index).to(
                tl.int32
            )
        weight = tl.zeros([BLOCK_N], dtype=tl.float32) + 1.0 / tl.sum(used, axis=0).to(tl.float32)
    else:
        weight = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
    # The mean's row losses are its terms (loss / count): the reduction is one sum, no division.
    loss_weight = weight if ROW_WEIGHTS == _WEIGHT_MEAN or ROW_WEIGHTS == _WEIGHT_MEAN_COUNTED else 1.0
    lse = _store_row_results(
        lse_ptr, loss_ptr, status_ptr, rows, row_ok, targets, row_max, row_sum, target_logit,
        available_actions, target_available, A, ignore_index, loss_weight, HAS_MASK, STORE_LSE,
    )  # fmt: skip
    if WRITE_GRAD:
        # No division by a count of 0: where every row is ignored no row takes the weight.
        row_scale = tl.where(targets != ignore_index, weight, 0.0) / tau
        grad_logits = _softmax_minus_one_hot(logits, lse, targets, actions)
        grad_rows = grad_ptr + _row_offsets(rows, T, stride_gb, stride_gt)
        _store_single_tile_grad(
            grad_rows, embeds, grad_logits, row_scale, row_ok, actions, A, D, stride_ea, HALF_DOT, GRAD_D
        )  # fmt: skip


def infonce_forward(
    pred, embeds, targets, mask, tau: float, ignore_index: int, reduction: str, runs: int, want_pred: bool,
    want_embeds: bool, weights=None,
):  # fmt: skip
    """``ALGORITHMS["small"]``'s forward (``algorithms.Algorithm``): one launch writes each row's loss (the mean's
    term ``loss / count`` for ``"mean"``: the reduction is one sum) and status and, for ``"mean"`` and ``"sum"``,
    the gradient for ``pred`` wanted (the fused ``grad_embeds`` kernel adds the map's). A mean of one run of at
    most :data:`COUNT_IN_KERNEL_MAX_ROWS` rows is counted by the kernel (no torch ops around it).

    ``weights`` (the backward's, with ``reduction="none"``): float32 per-row loss gradients (0 on ignored rows),
    the row weights of the gradients wanted instead of the reduction's."""
    mean = reduction == "mean"
    if weights is None and reduction == "none":  # the losses only: the backward computes the gradients
        want_pred = want_embeds = False
    count = None
    if mean and (runs > 1 or want_embeds or targets.numel() > COUNT_IN_KERNEL_MAX_ROWS):
        count = count_rows(targets, ignore_index, runs)
    if weights is not None:
        row_weights_kind = WEIGHT_GIVEN
    elif mean:
        row_weights_kind = WEIGHT_MEAN if count is not None else WEIGHT_MEAN_COUNTED
    else:
        row_weights_kind = WEIGHT_ONE
    shape = layout(pred, embeds)
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, pred)
    losses = empty_output(targets.shape, dtype=torch.float32, device=pred.device)
    lse = empty_output(targets.shape, dtype=torch.float32, device=pred.device) if want_embeds else None
    status = empty_output(targets.shape, dtype=torch.int8, device=pred.device)
    grad_pred = empty_output(pred.shape, dtype=pred.dtype, device=pred.device) if want_pred else None
    # Pointers a variant never reads stand in for the absent tensors.
    launch(_infonce_small_kernel, shape.grid)(
        pred, embeds, mask_t, targets, losses if weights is None else weights, targets if count is None else count,
        losses, losses if lse is None else lse, status, pred if grad_pred is None else grad_pred, shape.steps,
        shape.num_actions, shape.dim, shape.rows, targets.numel() // (1 if count is None else count.numel()), tau,
        ignore_index, mask_cols, shape.size_bucket, shape.stride_pb, shape.stride_pt, shape.stride_eg,
        shape.stride_ea, smb, smt, sma, shape.stride_gb, shape.stride_gt,
        HAS_MASK=mask is not None, HALF_DOT=shape.half, WRITE_GRAD=want_pred, ROW_WEIGHTS=row_weights_kind,
        STORE_LSE=want_embeds, BLOCK_A=max(16, next_power_of_2(shape.num_actions)),
    )  # fmt: skip
    grad_embeds = None
    if want_embeds:  # a reduction over every row: the fused kernel's, from the log-sum-exp just written
        grad_embeds = infonce_grad_embeds(
            row_weights(targets, ignore_index, count) if weights is None else weights, pred, embeds, targets, mask,
            lse, tau,
        )  # fmt: skip
    loss = losses if reduction == "none" else losses.sum() if runs == 1 else losses.view(runs, -1).sum(1)
    return loss, None, status, grad_pred, grad_embeds


def infonce_backward(
    weights, pred, embeds, targets, mask, lse, tau: float, ignore_index: int, want_pred: bool, want_embeds: bool
):  # fmt: skip
    """``ALGORITHMS["small"]``'s backward (``reduction="none"``): the kernel again, with the upstream row
    ``weights``."""
    return infonce_forward(
        pred, embeds, targets, mask, tau, ignore_index, "none", 1, want_pred, want_embeds, weights=weights
    )[3:]
