"""Triton building blocks every contrastive algorithm's kernels share, and their host-side layout.

Rows and maps. Every kernel works on rows ``r`` of the flattened ``[B, T]`` grid of predictions. A
*group* is the set of rows that share one action map: one sequence (``T`` rows) for per-sequence maps,
all ``B * T`` rows for a shared map. A program takes a tile of rows of one group, so one tile of the
map serves the whole tile of rows in a ``tl.dot``. The launchers read the inputs as the public functions
pass them (:func:`layout`): ``pred [N, D]`` is one sequence of ``N`` steps, per-sequence ``pred [B, D]``
``B`` sequences of one step, with strides (0 where a dimension has one element) instead of reshaped views.

The pieces: a logits tile (``tl.dot`` over ``D`` in chunks of ``BLOCK_D``, ``-inf`` on unavailable
actions), the online log-sum-exp, each row's loss, log-sum-exp and status of the value checks (1 byte:
no available action, target out of range or unavailable; ``checks.check_row_status``), the gradient
``(softmax - one_hot) @ E`` of a single action tile, and selection's running (max, lowest id) of
``logits + Gumbel noise`` (Philox, seeded from a device tensor) or of the logits, over available actions
only, with each row's status (no available action, a NaN logit; ``checks.check_selection_status``).

Precision: fp16/bf16 tiles go to ``tl.dot`` in their own dtype with fp32 accumulation (tensor cores),
fp32 tiles to IEEE fp32 dots; Triton's CPU interpreter computes bf16 dots wrongly, so under the
interpreter bf16 tiles are upcast first (:func:`half_dot`). Scales are applied in fp32 to fp32 results
(``fused_kernels.py``, module doc).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .._triton import cdiv, per_signature, size_bucket
from . import checks

# The per-row status codes (checks.check_row_status and checks.check_selection_status read them).
ROW_NO_ACTION = tl.constexpr(checks.ROW_NO_ACTION)
ROW_TARGET_OUT_OF_RANGE = tl.constexpr(checks.ROW_TARGET_OUT_OF_RANGE)
ROW_TARGET_UNAVAILABLE = tl.constexpr(checks.ROW_TARGET_UNAVAILABLE)
ROW_NAN_LOGIT = tl.constexpr(checks.ROW_NAN_LOGIT)

#: Largest action tile; action sets up to this size are held in registers whole.
MAX_BLOCK_A = 128


@triton.jit
def _row_offsets(rows, T, stride_b, stride_t):
    """Memory offsets of flat rows ``r = b * T + t`` in a tensor with strides ``(stride_b, stride_t)``."""
    seq = rows // T
    return seq.to(tl.int64) * stride_b + (rows - seq * T).to(tl.int64) * stride_t


@triton.jit
def _row_tile(ROWS, BLOCK_N: tl.constexpr):
    """``(group, local rows)`` of this program; grid axis 0 enumerates groups x row blocks (axis 0 has
    room for 2^31 - 1 programs, the others only 65535, and there may be one group per sequence)."""
    blocks = tl.cdiv(ROWS, BLOCK_N)
    pid = tl.program_id(0)
    group = pid // blocks
    return group, (pid - group * blocks) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _available(
    mask_ptr, rows, row_ok, actions, T, A, MASK_COLS, stride_mb, stride_mt, stride_ma, HAS_MASK: tl.constexpr
):  # fmt: skip
    """``[BLOCK_N, BLOCK_A]`` bool: the row exists, the action exists, and the mask allows it."""
    available = (actions < A)[None, :] & row_ok[:, None]
    if HAS_MASK:
        # Bounded by MASK_COLS (the mask's padded width, a multiple of 16 when function.py padded it; the
        # padding is zero) rather than A, so that 16-byte vector loads stay whole: bounded by A = 125 the
        # loads went element by element and spilled ~2 KB per thread.
        allowed = tl.load(
            mask_ptr + _row_offsets(rows, T, stride_mb, stride_mt)[:, None] + actions[None, :].to(tl.int64) * stride_ma,
            mask=row_ok[:, None] & (actions < MASK_COLS)[None, :],
            other=0,
        )
        available = available & (allowed != 0)
    return available


@triton.jit
def _logits_tile(
    pred_ptr, embeds_ptr, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
    stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_N, BLOCK_A]`` tile of ``pred . e_a / tau``, ``-inf`` on unavailable or missing actions."""
    pred_rows = pred_ptr + _row_offsets(rows, T, stride_pb, stride_pt)
    action_ok = actions < A
    acc = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    for d_start in range(0, D, BLOCK_D):
        dims = d_start + tl.arange(0, BLOCK_D)
        dim_ok = dims < D
        p = tl.load(pred_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        e = tl.load(
            embeds_ptr + actions[:, None].to(tl.int64) * stride_ea + dims[None, :],
            mask=action_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if HALF_DOT:
            acc += tl.dot(p, tl.trans(e))
        else:
            acc += tl.dot(p.to(tl.float32), tl.trans(e.to(tl.float32)), input_precision="ieee")
    available = _available(
        mask_ptr, rows, row_ok, actions, T, A, MASK_COLS, stride_mb, stride_mt, stride_ma, HAS_MASK
    )  # fmt: skip
    return tl.where(available, acc / tau, float("-inf"))


@triton.jit
def _softmax_minus_one_hot(logits, row_lse, targets, actions):
    """Unscaled ``softmax - one_hot(target)`` of a logits tile (values in [-1, 1]), from each row's
    log-sum-exp. Scales are applied to the fp32 accumulators (module doc, precision)."""
    probs = tl.exp(logits - row_lse[:, None])
    hit = actions[None, :] == targets[:, None]
    return probs - tl.where(hit, 1.0, 0.0)


@triton.jit
def _online_logsumexp(running_max, running_sum, logits):
    """One logits tile's update of each row's running max and sum of ``exp(logit - max)`` (the online
    log-sum-exp of the forward kernels)."""
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))
    # A row whose actions so far are all unavailable keeps max -inf; shift by 0 to avoid inf - inf.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(logits - shift[:, None]), axis=1)
    return new_max, running_sum


@triton.jit
def _store_row_results(
    lse_ptr, loss_ptr, status_ptr, rows, row_ok, targets, running_max, running_sum, target_logit,
    available_actions, target_available, A, ignore_index, loss_weight, HAS_MASK: tl.constexpr,
    STORE_LSE: tl.constexpr,
):  # fmt: skip
    """Store each row's loss times ``loss_weight`` (a row's share of a reduction, or 1), status of the value
    checks (``checks.ROW_*``) and, with ``STORE_LSE``, log-sum-exp from its online statistics; return the
    log-sum-exp."""
    # Rows past the end, or whose mask allows no action, have sum 0: log(1) keeps the log finite (the
    # lse is then running_max = -inf, or not stored); a NaN sum stays NaN.
    lse = running_max + tl.log(tl.where(running_sum == 0, 1.0, running_sum))
    if STORE_LSE:
        tl.store(lse_ptr + rows, lse, mask=row_ok)
    # An ignored row's 0 is weighted too: 0 * (1 / 0) = NaN where every row of a run is ignored, the mean's 0 / 0.
    tl.store(loss_ptr + rows, tl.where(targets == ignore_index, 0.0, lse - target_logit) * loss_weight, mask=row_ok)
    used = targets != ignore_index
    out_of_range = used & ((targets < 0) | (targets >= A))
    status = tl.where(out_of_range, ROW_TARGET_OUT_OF_RANGE, 0)
    if HAS_MASK:
        status = tl.where(used & ~out_of_range & (target_available == 0), ROW_TARGET_UNAVAILABLE, status)
        status = tl.where(available_actions == 0, ROW_NO_ACTION, status)
    tl.store(status_ptr + rows, status.to(tl.int8), mask=row_ok)
    return lse


@triton.jit
def _store_single_tile_grad(
    grad_rows, embeds, grad_logits, row_scale, row_ok, actions, A, D, stride_ea,
    HALF_DOT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``grad[r] = row_scale[r] * sum_a grad_logits[r, a] e_a`` for a whole action set held in one tile:
    one dot per output chunk of ``BLOCK_D`` columns, stored at once (no accumulator across action tiles,
    so no width limit). ``grad_logits`` is the unscaled ``softmax - one_hot`` (fp32); ``row_scale`` is
    applied in fp32 to the fp32 result (module doc, precision)."""
    grad_half = grad_logits.to(embeds.dtype.element_ty)
    for d_start in range(0, D, BLOCK_D):
        dims = d_start + tl.arange(0, BLOCK_D)
        dim_ok = dims < D
        e = tl.load(
            embeds + actions[:, None].to(tl.int64) * stride_ea + dims[None, :],
            mask=(actions < A)[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if HALF_DOT:
            out = tl.dot(grad_half, e)
        else:
            out = tl.dot(grad_logits, e.to(tl.float32), input_precision="ieee")
        tl.store(
            grad_rows[:, None] + dims[None, :],
            (out * row_scale[:, None]).to(grad_rows.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _select_tile(
    scores, available, seed_rows, actions, A, seeds, best, best_action, saw_nan, SAMPLE: tl.constexpr
):  # fmt: skip
    """One tile's update of each row's running choice: ``(best score, its action id, saw a NaN logit)``.

    ``scores`` are the tile's logits (any value where ``available`` is False) and ``actions`` their global ids;
    ``seeds`` and ``seed_rows`` each row's seed and row index among its seed's rows (:func:`_row_seeds`): the
    Gumbel noise is a function of ``(seed, seed_row * A + action)`` only."""
    is_nan = scores != scores
    saw_nan |= tl.max((is_nan & available).to(tl.int32), axis=1)
    if SAMPLE:
        # Gumbel-max: one Philox draw per (row, action), so the sample does not depend on tiling.
        counter = seed_rows[:, None].to(tl.int64) * A + actions[None, :]
        uniform = tl.maximum(tl.rand(seeds[:, None], counter), 1e-20)
        scores += -tl.log(-tl.log(uniform))
    # The choice is made among available actions only, whatever the values: NaN scores rank lowest
    # (like -inf), and a row whose available scores are all -inf or NaN gets its first available
    # action (the running best starts at "none", -1, not at action 0, which may be masked).
    scores = tl.where(available & ~is_nan, scores, float("-inf"))
    tile_best = tl.max(scores, axis=1)
    tile_action = tl.min(tl.where(available & (scores == tile_best[:, None]), actions[None, :], 2147483647), axis=1).to(
        tl.int64
    )  # the lowest id among ties, like torch.argmax
    found = tile_action < 2147483647
    better = found & ((best_action < 0) | (tile_best > best))  # strict: ties keep the lower id
    return tl.where(better, tile_best, best), tl.where(better, tile_action, best_action), saw_nan


@triton.jit
def _store_choice(out_ptr, status_ptr, rows, row_ok, best_action, saw_nan):
    """Store each row's chosen action (-1: none available) and its status (``checks.ROW_*``)."""
    tl.store(out_ptr + rows, best_action, mask=row_ok)
    status = tl.where(best_action < 0, ROW_NO_ACTION, tl.where(saw_nan != 0, ROW_NAN_LOGIT, 0))
    tl.store(status_ptr + rows, status.to(tl.int8), mask=row_ok)


@triton.jit
def _row_seeds(seed_ptr, rows, row_ok, SEED_ROWS):
    """``(seeds, seed_rows)`` of a tile of flat rows: row ``r`` takes seed ``seed_ptr[r // SEED_ROWS]`` (one seed
    per run of ``SEED_ROWS`` rows; one for all rows outside ``vmap``) and counts its draws from ``r % SEED_ROWS``."""
    run = rows // SEED_ROWS
    return tl.load(seed_ptr + run, mask=row_ok, other=0), rows - run * SEED_ROWS


def half_dot(dtype: torch.dtype) -> bool:
    """Whether tiles of ``dtype`` go to ``tl.dot`` in their own dtype (fp16; bf16 but under the interpreter)."""
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not triton_interpreter_enabled()


class Layout(NamedTuple):
    """What the launchers need of ``pred`` and ``embeds`` as the public functions pass them (:func:`layout`).

    ``[N, D]`` predictions are one sequence of ``N`` steps, per-sequence ``[B, D]`` ones ``B`` sequences of one
    step; ``groups`` is 1 (a shared map) or ``B`` (one per sequence) and ``rows`` the rows per group. Strides are
    those of ``pred`` (``stride_pb``, ``stride_pt``; 0 for a dimension of one element), of ``embeds`` and of a
    contiguous gradient of ``pred``'s shape (``stride_gb``, ``stride_gt``); ``half``: :func:`half_dot`;
    ``size_bucket``: the autotune key of ``rows``; ``grid``: the grid of a launch whose programs take
    ``BLOCK_N`` rows of one group."""

    batch: int
    steps: int
    dim: int
    num_actions: int
    groups: int
    rows: int
    stride_pb: int
    stride_pt: int
    stride_eg: int
    stride_ea: int
    stride_gb: int
    stride_gt: int
    half: bool
    size_bucket: int
    grid: Callable


def layout(pred: torch.Tensor, embeds: torch.Tensor) -> Layout:
    """The :class:`Layout` of ``pred`` and ``embeds``, computed once per shapes, strides and dtype
    (:func:`icrl_kernels._triton.per_signature`)."""
    return _layout(pred.shape, pred.stride(), embeds.shape, embeds.stride(), pred.dtype)


@per_signature
def _layout(pred_shape, pred_strides, embeds_shape, embeds_strides, dtype: torch.dtype) -> Layout:
    per_sequence = len(embeds_shape) == 3
    dim, num_actions = pred_shape[-1], embeds_shape[-2]
    if len(pred_shape) == 3:
        batch, steps = pred_shape[0], pred_shape[1]
        pred_rows, grad_rows = pred_strides[:2], (steps * dim, dim)
    elif per_sequence:
        batch, steps = pred_shape[0], 1
        pred_rows, grad_rows = (pred_strides[0], 0), (dim, 0)
    else:
        batch, steps = 1, pred_shape[0]
        pred_rows, grad_rows = (0, pred_strides[0]), (0, dim)
    groups, rows = (batch, steps) if per_sequence else (1, batch * steps)
    embeds_rows = (embeds_strides[0], embeds_strides[1]) if per_sequence else (0, embeds_strides[0])

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_N"]) * groups,)

    return Layout(batch, steps, dim, num_actions, groups, rows, *pred_rows, *embeds_rows, *grad_rows,
                  half_dot(dtype), size_bucket(rows), grid)  # fmt: skip


def mask_args(mask: torch.Tensor | None, stand_in: torch.Tensor):
    """The canonical padded ``mask``'s ``(tensor, padded width, strides)`` as the kernels take them (a stride
    of 0 where a dimension broadcasts); ``stand_in`` fills its place when there is no mask (never read).

    ``mask`` is ``[1 or B, 1 or T, A_pad]`` with ``A_pad >= A`` (columns past ``A`` are zero): see
    :func:`.checks.padded_mask`."""
    if mask is None:
        return stand_in, 16, 0, 0, 0
    return (mask, mask.shape[2], *(mask.stride(i) if mask.shape[i] > 1 else 0 for i in range(3)))
