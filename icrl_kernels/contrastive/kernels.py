"""Fused Triton kernels of InfoNCE over action embeddings and of action selection.

Rows and maps. Every kernel works on rows ``r`` of the flattened ``[B, T]`` grid of predictions. A
*group* is the set of rows that share one action map: one sequence (``T`` rows) for per-sequence maps,
all ``B * T`` rows for a shared map. A program takes a tile of rows of one group, so one tile of the
map serves the whole tile of rows in a ``tl.dot``.

Logits never reach memory. A program walks the action axis in tiles of ``BLOCK_A`` actions; each
logits tile ``[BLOCK_N, BLOCK_A]`` is a ``tl.dot`` over ``D`` in chunks of ``BLOCK_D``:

* forward: an online log-sum-exp (running max and rescaled sum) plus the target's logit; it stores
  the loss and the log-sum-exp of each row (8 bytes per row), and each row's status under the value checks
  (1 byte: no available action, target out of range or unavailable; ``checks.check_row_status``), so that
  the checks cost three small ops on the device instead of 8-22 torch ops of their own;
* backward, ``grad_pred``: a program owns a row tile and *all* ``D`` output columns. With one action
  tile (``A <= 128``) it computes ``softmax - one_hot`` once and then one dot per output chunk, stored
  at once. With streamed actions (tiles of ``STREAM_BLOCK_A`` = 64, so that the ``[64, next_pow2(D)]``
  map tile of the gradient dot fits in shared memory up to D = 1024) it keeps a
  ``[BLOCK_N, next_pow2(D)]`` fp32 accumulator (``D`` up to ``MAX_DO`` = 512 or 1024, per config; 256
  with fp32 FMA dots; wider outputs fall back to column blocks, one logits pass each);
* backward, ``grad_embeds``: a program owns ``BLOCK_A`` (<= 64) actions x all ``D`` columns
  (``[BLOCK_A, next_pow2(D)]`` fp32 accumulator, same ``MAX_DO`` fallback) and walks rows; with few
  action tiles (a shared map of a few actions) the rows are split across ``num_splits`` programs whose
  partial sums (fp32) are added afterwards, deterministically, without atomics;
* selection: a running (max, lowest id) of ``logits + Gumbel noise`` (Philox, seeded from a device
  tensor) or of the logits, over available actions only, and each row's status (no available action, a
  NaN logit; ``checks.check_selection_status``).

So every ``(row tile, action tile)`` softmax gradient is computed once per gradient kernel, never once
per output-column block: 3 logits passes and 2 gradient dots per forward + backward at any ``D`` (column
blocks took 9 at D = 512, 15 at D = 1024; the history, with byte counts and predicted times:
benchmarks/results/kernel-constants.md#infonce-logits-passes).
The ideal is 4 (the forward's logits, the backward's recompute, two gradient dots); one fused backward
could share the recompute, but ``grad_embeds`` then needs a cross-program reduction over rows per action
(atomics, or fp32 partials of ``A x D`` per row tile: 16 GB at N = 65536, A = 4096), so we keep two
kernels and pay one extra recompute.

Precision: fp16/bf16 tiles go to ``tl.dot`` in their own dtype with fp32 accumulation (tensor cores).
The backward dots take the *unscaled* ``softmax - one_hot`` (values in [-1, 1]) cast to the input dtype,
and every scale is applied in fp32 to the fp32 accumulator: ``w_r / tau`` per row for ``grad_pred``;
for ``grad_embeds``, whose row weights sit inside the row sum, the operand is scaled by ``w_r / max|w|``
(in [-1, 1]; ``max|w|`` is computed on the device and loaded as a scalar) and the accumulator by
``max|w| / tau``. Then one downcast. (Scaling before the cast put ``1 / (N tau)`` = 1.5e-5 at N = 65536
into fp16's subnormal range.) fp32 inputs use IEEE fp32 dots: without half-precision dots InfoNCE takes
``FMA_BLOCK_A`` = 16 actions a tile: its IEEE fp32 dots run on FMA units, which keep a whole slice of both
operands along the reduced axis in each thread, and with 128-action tiles the backward spilled 17-30 KB
per thread on sm_90. Triton's CPU interpreter computes bf16 dots wrongly, so under the interpreter bf16
tiles are upcast first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .._library import empty_output
from .._triton import autotune, cdiv, launch, next_power_of_2, size_bucket
from . import checks

# The forward's per-row status codes (checks.check_row_status reads them).
ROW_NO_ACTION = tl.constexpr(checks.ROW_NO_ACTION)
ROW_TARGET_OUT_OF_RANGE = tl.constexpr(checks.ROW_TARGET_OUT_OF_RANGE)
ROW_TARGET_UNAVAILABLE = tl.constexpr(checks.ROW_TARGET_UNAVAILABLE)
ROW_NAN_LOGIT = tl.constexpr(checks.ROW_NAN_LOGIT)

#: Largest action tile; action sets up to this size are held in registers whole.
MAX_BLOCK_A = 128
#: Action tile of InfoNCE's forward and ``grad_pred`` with streamed actions (more than 128) and
#: half-precision dots: the ``[BLOCK_N, BLOCK_A]`` logits tile sits next to ``grad_pred``'s full-width
#: accumulator (with 128 actions, masked bf16 tiles spilled 0.6-1 KB per thread on sm_90).
STREAM_BLOCK_A = 64
#: Action tile of InfoNCE (forward and backward) without half-precision dots: fp32 FMA dots (module doc).
FMA_BLOCK_A = 16
#: Width of the backward's accumulators with fp32 FMA dots: 512 columns spilled 0.3-0.6 KB per thread with
#: a mask on sm_90 (FMA dots keep a slice of both operands along the reduced axis in each thread).
FMA_MAX_DO = tl.constexpr(256)
#: Largest action tile of ``grad_embeds`` with half-precision dots: its ``[BLOCK_A, D]`` fp32 accumulator
#: lives in registers (64 x 512 / 256 threads = 128 registers a thread at D = 512).
EMBEDS_BLOCK_A = 64
#: Programs the grad_embeds launch aims for before it splits rows: one per H100 SM (each program holds a
#: full-width accumulator, so one runs per SM at a time); more splits only add fp32 partial sums.
TARGET_PROGRAMS = 132
#: Rows a grad_embeds split takes at least (fewer would write more partial sums than they read rows).
MIN_SPLIT_ROWS = 64

# Autotune configs. The tests compile every config of every kernel for sm_90 (bf16 and fp32, D = 512 and
# 1024, A = 125 with and without a mask, A = 4096 with and without a mask) and fail on more than 256 bytes
# of spill per thread (and on more shared memory than an H100 has). ``MAX_DO`` caps the width of the
# backward's full-width accumulators (``BLOCK_DO = min(next_pow2(D), MAX_DO)``, ``FMA_MAX_DO`` with fp32
# dots): wider outputs fall back to column blocks (one recompute of the logits each). 128-row tiles
# spill in the backward whatever the warps, so only the forward and selection keep one.
_ROW_CONFIGS = [  # forward: one logits tile, no accumulator
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
    triton.Config({"BLOCK_N": 128, "BLOCK_D": 64}, num_warps=8),
]
# The first config of each kernel (the interpreter's only one) has the forward's first tiles (32 rows,
# BLOCK_D = 32), so that the backward recomputes bit-identical logits: a lone available action then has
# softmax exactly 1 and gradient exactly 0 (with BLOCK_D = 64 the recomputed logit differed by ~1e-7).
_GRAD_PRED_CONFIGS = [
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32, "MAX_DO": 512}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64, "MAX_DO": 512}, num_warps=8),  # <= 24 B
    # Full width up to D = 1024: 32 x 1024 fp32 over 512 threads (8 warps: 296 B of spill with a mask).
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32, "MAX_DO": 1024}, num_warps=16),  # <= 240 B (masked)
]
_COLUMN_CONFIGS = [  # grad_embeds; 4 warps spilled 1.2 KB (64 x 512 accumulator over 128 threads)
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32, "MAX_DO": 1024}, num_warps=8),  # none
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64, "MAX_DO": 512}, num_warps=8),  # <= 128 B
]
# Selection: 128-action tiles with half-precision dots, 16 with fp32 FMA dots (as InfoNCE). No 128-row
# tile: with a mask, 128 rows x 16 columns x 8 warps spilled 272-368 B per thread in bf16 under Triton
# 3.6's ptxas (the GPU image's), though under 3.9 it stayed within 232 B.
_SELECT_CONFIGS = [
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
]


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
    available_actions, target_available, A, ignore_index, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """Store each row's log-sum-exp, loss and status of the value checks (``checks.ROW_*``) from its
    online statistics; return the log-sum-exp."""
    # Rows past the end, or whose mask allows no action, have sum 0: log(1) keeps the log finite (the
    # lse is then running_max = -inf, or not stored); a NaN sum stays NaN.
    lse = running_max + tl.log(tl.where(running_sum == 0, 1.0, running_sum))
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(loss_ptr + rows, tl.where(targets == ignore_index, 0.0, lse - target_logit), mask=row_ok)
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


@autotune(_ROW_CONFIGS, key=["A", "D", "SIZE_BUCKET"])
@triton.jit
def _infonce_forward_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, loss_ptr, lse_ptr, status_ptr,
    T, A, D, ROWS, tau, ignore_index, MASK_COLS, SIZE_BUCKET,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per row: the loss, the log-sum-exp, and the status of the value checks (``checks.ROW_*``): a row
    whose mask allows no action, a target out of range, a target the mask makes unavailable, else 0.
    The checks come from what the kernel loads anyway, so they cost no launches of their own."""
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index)
    running_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    target_logit = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Counted from the mask itself, not from -inf logits (an infinite pred is not a masked action).
    available_actions = tl.zeros([BLOCK_N], dtype=tl.int32)
    target_available = tl.zeros([BLOCK_N], dtype=tl.int32)
    for a_start in range(0, A, BLOCK_A):
        actions = a_start + tl.arange(0, BLOCK_A)
        logits = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        hit = actions[None, :] == targets[:, None]
        target_logit += tl.sum(tl.where(hit, logits, 0.0), axis=1)
        if HAS_MASK:  # the same mask tile _logits_tile just read (cached)
            available = _available(
                mask_ptr, rows, row_ok, actions, T, A, MASK_COLS, stride_mb, stride_mt, stride_ma, HAS_MASK
            )  # fmt: skip
            available_actions += tl.sum(available.to(tl.int32), axis=1)
            target_available += tl.sum((hit & available).to(tl.int32), axis=1)
        running_max, running_sum = _online_logsumexp(running_max, running_sum, logits)
    _store_row_results(
        lse_ptr, loss_ptr, status_ptr, rows, row_ok, targets, running_max, running_sum, target_logit,
        available_actions, target_available, A, ignore_index, HAS_MASK,
    )  # fmt: skip


@autotune(_GRAD_PRED_CONFIGS, key=["A", "D", "SIZE_BUCKET"])
@triton.jit
def _infonce_grad_pred_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, lse_ptr, weights_ptr, grad_ptr,
    T, A, D, ROWS, tau, MASK_COLS, SIZE_BUCKET,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma, stride_gb, stride_gt,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr, SINGLE_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, DO_FULL: tl.constexpr,
    MAX_DO: tl.constexpr,
):  # fmt: skip
    """``grad_pred[r] = (w_r / tau) * sum_a (softmax - one_hot)[r, a] e_a``: each program owns a row tile and
    computes each of its ``(row tile, action tile)`` softmax gradients once (module doc)."""
    # fp32 FMA dots keep slices of both operands in each thread: at most FMA_MAX_DO columns (module doc).
    BLOCK_DO: tl.constexpr = min(DO_FULL, MAX_DO if HALF_DOT else FMA_MAX_DO)
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    row_lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    # fp32 scale of each row, applied to the fp32 result: the dots see only values in [-1, 1].
    row_scale = tl.load(weights_ptr + rows, mask=row_ok, other=0.0) / tau
    grad_rows = grad_ptr + _row_offsets(rows, T, stride_gb, stride_gt)
    if SINGLE_TILE:
        # The whole action set is one tile: one softmax gradient per row tile, then one dot per output
        # chunk straight to memory (no accumulator across action tiles, so no width limit).
        actions = tl.arange(0, BLOCK_A)
        logits = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        grad_logits = _softmax_minus_one_hot(logits, row_lse, targets, actions)
        _store_single_tile_grad(
            grad_rows, embeds, grad_logits, row_scale, row_ok, actions, A, D, stride_ea, HALF_DOT, BLOCK_D
        )  # fmt: skip
    else:
        # Streamed actions: a [BLOCK_N, BLOCK_DO] accumulator spans the whole width (D <= MAX_DO), so each
        # logits tile is computed once; wider outputs take column blocks (grid axis 1), one pass each.
        out_dims = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
        out_ok = out_dims < D
        acc = tl.zeros([BLOCK_N, BLOCK_DO], dtype=tl.float32)
        for a_start in range(0, A, BLOCK_A):
            actions = a_start + tl.arange(0, BLOCK_A)
            logits = _logits_tile(
                pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
                stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
                HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
            )  # fmt: skip
            grad_logits = _softmax_minus_one_hot(logits, row_lse, targets, actions)
            e = tl.load(
                embeds + actions[:, None].to(tl.int64) * stride_ea + out_dims[None, :],
                mask=(actions < A)[:, None] & out_ok[None, :],
                other=0.0,
            )
            if HALF_DOT:
                acc += tl.dot(grad_logits.to(e.dtype), e)
            else:
                acc += tl.dot(grad_logits, e.to(tl.float32), input_precision="ieee")
        tl.store(
            grad_rows[:, None] + out_dims[None, :],
            (acc * row_scale[:, None]).to(grad_ptr.dtype.element_ty),
            mask=row_ok[:, None] & out_ok[None, :],
        )


@autotune(_COLUMN_CONFIGS, key=["A", "D", "SIZE_BUCKET"])
@triton.jit
def _infonce_grad_embeds_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, lse_ptr, weights_ptr, wmax_ptr, out_ptr,
    T, A, D, ROWS, ROWS_PER_SPLIT, NUM_SPLITS, tau, MASK_COLS, SIZE_BUCKET,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma, stride_os, stride_oa,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, DO_FULL: tl.constexpr,
    MAX_DO: tl.constexpr,
):  # fmt: skip
    """``grad_embeds[a] = sum_r (w_r / tau) (softmax - one_hot)[r, a] pred_r`` over the rows of one split:
    a program owns ``BLOCK_A`` actions x the whole width and computes each ``(row tile, action tile)``
    softmax gradient once."""
    # fp32 FMA dots keep slices of both operands in each thread: at most FMA_MAX_DO columns (module doc).
    BLOCK_DO: tl.constexpr = min(DO_FULL, MAX_DO if HALF_DOT else FMA_MAX_DO)
    # Axis 0 enumerates slots (group * NUM_SPLITS + split) x action blocks, axis 1 column blocks.
    action_blocks = tl.cdiv(A, BLOCK_A)
    slot = tl.program_id(0) // action_blocks
    actions = (tl.program_id(0) - slot * action_blocks) * BLOCK_A + tl.arange(0, BLOCK_A)
    out_dims = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    out_ok = out_dims < D
    group = slot // NUM_SPLITS
    first = (slot - group * NUM_SPLITS) * ROWS_PER_SPLIT
    last = tl.minimum(first + ROWS_PER_SPLIT, ROWS)
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    # The row weights sit inside the row sum: the dot takes (softmax - one_hot) * w_r / max|w| (in [-1, 1],
    # normal even where w_r / tau is subnormal in fp16), and max|w| / tau scales the fp32 result.
    w_max = tl.load(wmax_ptr)
    w_inv = tl.where(w_max > 0, 1.0 / tl.where(w_max > 0, w_max, 1.0), 0.0)
    acc = tl.zeros([BLOCK_A, BLOCK_DO], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        local = start + tl.arange(0, BLOCK_N)
        row_ok = local < last
        rows = group * ROWS + local
        targets = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
        row_lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        row_ratio = tl.load(weights_ptr + rows, mask=row_ok, other=0.0) * w_inv
        logits = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        grad_logits = _softmax_minus_one_hot(logits, row_lse, targets, actions) * row_ratio[:, None]
        pred_rows = pred_ptr + _row_offsets(rows, T, stride_pb, stride_pt)
        # The same rows the logits just read: served from L1/L2, not HBM.
        p = tl.load(pred_rows[:, None] + out_dims[None, :], mask=row_ok[:, None] & out_ok[None, :], other=0.0)
        if HALF_DOT:
            acc += tl.dot(tl.trans(grad_logits.to(p.dtype)), p)
        else:
            acc += tl.dot(tl.trans(grad_logits), p.to(tl.float32), input_precision="ieee")
    tl.store(
        out_ptr + slot.to(tl.int64) * stride_os + actions[:, None].to(tl.int64) * stride_oa + out_dims[None, :],
        (acc * (w_max / tau)).to(out_ptr.dtype.element_ty),
        mask=(actions < A)[:, None] & out_ok[None, :],
    )


@autotune(_SELECT_CONFIGS, key=["A", "D", "SIZE_BUCKET"])
@triton.jit
def _select_actions_kernel(
    pred_ptr, embeds_ptr, mask_ptr, seed_ptr, out_ptr, status_ptr,
    T, A, D, ROWS, tau, MASK_COLS, SIZE_BUCKET,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma,
    SAMPLE: tl.constexpr, HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per row, the lowest available action of highest score (logit, plus Gumbel noise when sampling),
    and the row's status under the value checks: ``ROW_NO_ACTION`` where the mask leaves no action (the
    id stored is then -1), else ``ROW_NAN_LOGIT`` where an available action's logit is NaN, else 0."""
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    seed = 0
    if SAMPLE:
        seed = tl.load(seed_ptr)  # drawn on the device: no host read of the generator's state
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    best_action = tl.full([BLOCK_N], -1, dtype=tl.int64)  # -1: no available action seen yet
    saw_nan = tl.zeros([BLOCK_N], dtype=tl.int32)
    for a_start in range(0, A, BLOCK_A):
        actions = a_start + tl.arange(0, BLOCK_A)
        scores = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau, MASK_COLS,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        available = _available(
            mask_ptr, rows, row_ok, actions, T, A, MASK_COLS, stride_mb, stride_mt, stride_ma, HAS_MASK
        )  # fmt: skip
        best, best_action, saw_nan = _select_tile(
            scores, available, rows, actions, A, seed, best, best_action, saw_nan, SAMPLE
        )  # fmt: skip
    _store_choice(out_ptr, status_ptr, rows, row_ok, best_action, saw_nan)


@triton.jit
def _select_tile(scores, available, rows, actions, A, seed, best, best_action, saw_nan, SAMPLE: tl.constexpr):
    """One tile's update of each row's running choice: ``(best score, its action id, saw a NaN logit)``.

    ``scores`` are the tile's logits (any value where ``available`` is False), ``actions`` their global ids
    and ``rows`` the flat row ids (the Gumbel noise is a function of ``(seed, row * A + action)`` only)."""
    is_nan = scores != scores
    saw_nan |= tl.max((is_nan & available).to(tl.int32), axis=1)
    if SAMPLE:
        # Gumbel-max: one Philox draw per (row, action), so the sample does not depend on tiling.
        counter = rows[:, None].to(tl.int64) * A + actions[None, :]
        uniform = tl.maximum(tl.rand(seed, counter), 1e-20)
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


def _half_dot(dtype: torch.dtype) -> bool:
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not triton_interpreter_enabled()


def _block_a(num_actions: int, half_dot: bool, dim: int | None = None) -> int:
    """Action tile of the forward, ``grad_pred`` and selection: the whole set up to 128 actions;
    ``FMA_BLOCK_A`` for fp32 InfoNCE dots (see the module doc). Given ``dim``, a streamed set takes tiles
    of at most ``65536 / next_pow2(D)`` actions, so that ``grad_pred``'s full-width map tile
    (``[BLOCK_A, next_pow2(D)]``, 128 KB in bf16) fits in shared memory (227 KB on an H100; 128 actions
    x 1024 columns took 270 KB)."""
    if not half_dot:
        return min(FMA_BLOCK_A, max(16, next_power_of_2(num_actions)))
    if num_actions <= MAX_BLOCK_A or dim is None:
        return min(MAX_BLOCK_A, max(16, next_power_of_2(num_actions)))
    return max(16, min(STREAM_BLOCK_A, 65536 // _do_full(dim)))


def _block_a_embeds(num_actions: int, dim: int, half_dot: bool) -> int:
    """Action tile of ``grad_embeds``: its ``[BLOCK_A, next_pow2(D)]`` fp32 accumulator stays at most
    32 K elements (128 registers a thread with 8 warps)."""
    if not half_dot:
        return FMA_BLOCK_A
    cap = max(16, min(EMBEDS_BLOCK_A, 32768 // next_power_of_2(dim)))
    return min(cap, max(16, next_power_of_2(num_actions)))


def _do_full(dim: int) -> int:
    return max(16, next_power_of_2(dim))


def _column_blocks(dim: int, max_do: int, half_dot: bool) -> int:
    """Column blocks of a backward launch (grid axis 1), as the kernels' ``BLOCK_DO`` splits ``D``."""
    return cdiv(dim, min(_do_full(dim), max_do if half_dot else FMA_MAX_DO.value))


def _layout_args(pred, embeds, mask):
    """Groups, rows per group, and the mask's ``(tensor, padded width, strides)`` shared by every kernel.

    ``mask`` is ``[1 or B, 1 or T, A_pad]`` with ``A_pad >= A`` (columns past ``A`` are zero): see
    :func:`.function._padded_mask`."""
    batch, steps, _ = pred.shape
    groups = embeds.shape[0]  # 1 (shared map) or B (one map per sequence)
    rows = steps if groups > 1 else batch * steps
    return groups, rows, mask_args(mask, pred)


def mask_args(mask, stand_in: torch.Tensor):
    """The canonical padded ``mask``'s ``(tensor, padded width, strides)`` as the kernels take them (a stride
    of 0 where a dimension broadcasts); ``stand_in`` fills its place when there is no mask (never read)."""
    if mask is None:
        return stand_in, 16, 0, 0, 0
    return (mask, mask.shape[2], *(mask.stride(i) if mask.shape[i] > 1 else 0 for i in range(3)))


def infonce_forward_triton(pred, embeds, targets, mask, tau: float, ignore_index: int):
    """Canonical inputs (see :mod:`.function`) -> per-row ``(loss, lse, status)``, ``[B, T]`` each: float32
    losses and log-sum-exps, and the int8 status of the value checks (``checks.ROW_*``, 0 where the row is
    fine), which :func:`.checks.check_row_status` turns into errors."""
    batch, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, mask_cols, smb, smt, sma) = _layout_args(pred, embeds, mask)
    losses = empty_output((batch, steps), dtype=torch.float32, device=pred.device)
    lse = empty_output((batch, steps), dtype=torch.float32, device=pred.device)
    status = empty_output((batch, steps), dtype=torch.int8, device=pred.device)
    half_dot = _half_dot(pred.dtype)

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_N"]) * groups,)

    launch(_infonce_forward_kernel, grid)(
        pred, embeds, mask_t, targets, losses, lse, status,
        steps, num_actions, dim, rows, tau, ignore_index, mask_cols, size_bucket(rows),
        pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma,
        HAS_MASK=mask is not None, HALF_DOT=half_dot,
        BLOCK_A=_block_a(num_actions, half_dot, dim),  # grad_pred's tiles: the same logits
    )  # fmt: skip
    return losses, lse, status


def _num_splits(rows: int, tiles: int) -> int:
    """Row splits of ``grad_embeds``: enough programs for one per SM, at least ``MIN_SPLIT_ROWS`` rows each."""
    return max(1, min(cdiv(rows, MIN_SPLIT_ROWS), TARGET_PROGRAMS // tiles))


def infonce_backward_triton(row_weights, pred, embeds, targets, mask, lse, tau: float, *, want_embeds: bool = True):
    """Gradients ``(grad_pred, grad_embeds)`` given each row's loss gradient ``row_weights [B, T]``;
    ``want_embeds=False`` skips the second kernel and returns an empty tensor for ``embeds``."""
    batch, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, mask_cols, smb, smt, sma) = _layout_args(pred, embeds, mask)
    row_weights = row_weights.contiguous().float()
    common = (steps, num_actions, dim, rows)
    strides = (pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma)
    half_dot = _half_dot(pred.dtype)
    do_full = _do_full(dim)
    block_a = _block_a(num_actions, half_dot, dim)
    single_tile = num_actions <= block_a

    grad_pred = empty_output(pred.shape, dtype=pred.dtype, device=pred.device)

    def pred_grid(meta):
        columns = 1 if single_tile else _column_blocks(dim, meta["MAX_DO"], half_dot)
        return (cdiv(rows, meta["BLOCK_N"]) * groups, columns)

    launch(_infonce_grad_pred_kernel, pred_grid)(
        pred, embeds, mask_t, targets, lse, row_weights, grad_pred, *common, tau, mask_cols, size_bucket(rows),
        *strides, grad_pred.stride(0), grad_pred.stride(1),
        HAS_MASK=mask is not None, HALF_DOT=half_dot, SINGLE_TILE=single_tile, BLOCK_A=block_a, DO_FULL=do_full,
    )  # fmt: skip
    if not want_embeds:
        return grad_pred, embeds.new_empty(0)
    return grad_pred, infonce_grad_embeds_triton(row_weights, pred, embeds, targets, mask, lse, tau)


def infonce_grad_embeds_triton(row_weights, pred, embeds, targets, mask, lse, tau: float):
    """``grad_embeds [1 or B, A, D]`` (``embeds``' dtype) given each row's loss gradient ``row_weights [B, T]``
    (float32, zero on ignored rows) and log-sum-exp ``lse [B, T]``: the ``grad_embeds`` kernel, with its rows
    split across programs when there are few action tiles (partial sums added afterwards)."""
    _, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, mask_cols, smb, smt, sma) = _layout_args(pred, embeds, mask)
    common = (steps, num_actions, dim, rows)
    strides = (pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma)
    half_dot = _half_dot(pred.dtype)
    block_a = _block_a_embeds(num_actions, dim, half_dot)
    action_blocks = cdiv(num_actions, block_a)
    num_splits = _num_splits(rows, action_blocks * groups)
    rows_per_split = cdiv(rows, num_splits)
    if num_splits == 1:
        out = empty_output(embeds.shape, dtype=embeds.dtype, device=pred.device)
    else:
        out = empty_output((groups * num_splits, num_actions, dim), dtype=torch.float32, device=pred.device)
    # max|w| on the device (no host read): the kernel scales the dot's operand by w / max|w|.
    w_max = row_weights.abs().amax().reshape(1)

    def embeds_grid(meta):
        return (action_blocks * groups * num_splits, _column_blocks(dim, meta["MAX_DO"], half_dot))

    launch(_infonce_grad_embeds_kernel, embeds_grid)(
        pred, embeds, mask_t, targets, lse, row_weights, w_max, out, *common, rows_per_split, num_splits, tau,
        mask_cols, size_bucket(rows), *strides, out.stride(0), out.stride(1),
        HAS_MASK=mask is not None, HALF_DOT=half_dot, BLOCK_A=block_a, DO_FULL=_do_full(dim),
    )  # fmt: skip
    if num_splits > 1:
        out = out.view(groups, num_splits, num_actions, dim).sum(1).to(embeds.dtype)
    return out


def select_actions_triton(pred, embeds, mask, tau: float, sample: bool, seed: torch.Tensor):
    """``([B, T] int64 actions, [B, T] int8 status)``: per row the argmax of the logits over the
    available actions, plus Gumbel noise from the device tensor ``seed`` (int64, one element) when
    ``sample``; the status (``checks.ROW_*``) flags a row with no available action or a NaN logit of an
    available one, for :func:`.checks.check_selection_status`."""
    batch, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, mask_cols, smb, smt, sma) = _layout_args(pred, embeds, mask)
    actions = empty_output((batch, steps), dtype=torch.int64, device=pred.device)
    status = empty_output((batch, steps), dtype=torch.int8, device=pred.device)

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_N"]) * groups,)

    launch(_select_actions_kernel, grid)(
        pred, embeds, mask_t, seed, actions, status,
        steps, num_actions, dim, rows, tau, mask_cols, size_bucket(rows),
        pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma,
        SAMPLE=sample, HAS_MASK=mask is not None, HALF_DOT=_half_dot(pred.dtype),
        BLOCK_A=_block_a(num_actions, _half_dot(pred.dtype)),
    )  # fmt: skip
    return actions, status
