"""The ``fused`` algorithm of InfoNCE and action selection (``algorithms.FUSED``): three-pass Triton kernels
built from the tiles of :mod:`.kernels` (rows, maps and groups are explained there).

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
per thread on sm_90.

The functions ``infonce_forward``, ``infonce_backward`` and ``select`` are the algorithm's entry of
``algorithms.ALGORITHMS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import autotune, cdiv, launch, next_power_of_2
from .algorithms import count_rows, reduce_losses
from .kernels import (
    MAX_BLOCK_A,
    _available,
    _logits_tile,
    _online_logsumexp,
    _row_offsets,
    _row_seeds,
    _row_tile,
    _select_tile,
    _softmax_minus_one_hot,
    _store_choice,
    _store_row_results,
    _store_single_tile_grad,
    layout,
    mask_args,
)

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
        available_actions, target_available, A, ignore_index, 1.0, HAS_MASK, True,
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
    T, A, D, ROWS, SEED_ROWS, tau, MASK_COLS, SIZE_BUCKET,
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
    seeds, seed_rows = 0, rows
    if SAMPLE:  # drawn on the device: no host read of the generator's state
        seeds, seed_rows = _row_seeds(seed_ptr, rows, row_ok, SEED_ROWS)
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
            scores, available, seed_rows, actions, A, seeds, best, best_action, saw_nan, SAMPLE
        )  # fmt: skip
    _store_choice(out_ptr, status_ptr, rows, row_ok, best_action, saw_nan)


def _block_a(num_actions: int, half: bool, dim: int | None = None) -> int:
    """Action tile of the forward, ``grad_pred`` and selection: the whole set up to 128 actions;
    ``FMA_BLOCK_A`` for fp32 InfoNCE dots (see the module doc). Given ``dim``, a streamed set takes tiles
    of at most ``65536 / next_pow2(D)`` actions, so that ``grad_pred``'s full-width map tile
    (``[BLOCK_A, next_pow2(D)]``, 128 KB in bf16) fits in shared memory (227 KB on an H100; 128 actions
    x 1024 columns took 270 KB)."""
    if not half:
        return min(FMA_BLOCK_A, max(16, next_power_of_2(num_actions)))
    if num_actions <= MAX_BLOCK_A or dim is None:
        return min(MAX_BLOCK_A, max(16, next_power_of_2(num_actions)))
    return max(16, min(STREAM_BLOCK_A, 65536 // _do_full(dim)))


def _block_a_embeds(num_actions: int, dim: int, half: bool) -> int:
    """Action tile of ``grad_embeds``: its ``[BLOCK_A, next_pow2(D)]`` fp32 accumulator stays at most
    32 K elements (128 registers a thread with 8 warps)."""
    if not half:
        return FMA_BLOCK_A
    cap = max(16, min(EMBEDS_BLOCK_A, 32768 // next_power_of_2(dim)))
    return min(cap, max(16, next_power_of_2(num_actions)))


def _do_full(dim: int) -> int:
    return max(16, next_power_of_2(dim))


def _column_blocks(dim: int, max_do: int, half: bool) -> int:
    """Column blocks of a backward launch (grid axis 1), as the kernels' ``BLOCK_DO`` splits ``D``."""
    return cdiv(dim, min(_do_full(dim), max_do if half else FMA_MAX_DO.value))


def _num_splits(rows: int, tiles: int) -> int:
    """Row splits of ``grad_embeds``: enough programs for one per SM, at least ``MIN_SPLIT_ROWS`` rows each."""
    return max(1, min(cdiv(rows, MIN_SPLIT_ROWS), TARGET_PROGRAMS // tiles))


def infonce_forward(
    pred, embeds, targets, mask, tau: float, ignore_index: int, reduction: str, runs: int, want_pred, want_embeds
):  # fmt: skip
    """``ALGORITHMS["fused"]``'s forward (``algorithms.Algorithm``): the reduced loss, each row's float32
    log-sum-exp and the int8 status of the value checks (``checks.ROW_*``, 0 where the row is fine); the
    gradients are the backward's (``want_pred`` and ``want_embeds`` are not read)."""
    shape = layout(pred, embeds)
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, pred)
    losses = empty_output(targets.shape, dtype=torch.float32, device=pred.device)
    lse = empty_output(targets.shape, dtype=torch.float32, device=pred.device)
    status = empty_output(targets.shape, dtype=torch.int8, device=pred.device)
    launch(_infonce_forward_kernel, shape.grid)(
        pred, embeds, mask_t, targets, losses, lse, status,
        shape.steps, shape.num_actions, shape.dim, shape.rows, tau, ignore_index, mask_cols, shape.size_bucket,
        shape.stride_pb, shape.stride_pt, shape.stride_eg, shape.stride_ea, smb, smt, sma,
        HAS_MASK=mask is not None, HALF_DOT=shape.half,
        BLOCK_A=_block_a(shape.num_actions, shape.half, shape.dim),  # grad_pred's tiles: the same logits
    )  # fmt: skip
    count = count_rows(targets, ignore_index, runs) if reduction == "mean" else None
    return reduce_losses(losses, reduction, runs, count), lse, status, None, None


def infonce_backward(
    weights, pred, embeds, targets, mask, lse, tau: float, ignore_index: int, want_pred: bool, want_embeds: bool
):  # fmt: skip
    """``ALGORITHMS["fused"]``'s backward: ``(grad_pred, grad_embeds)`` (None where not wanted) given each row's
    loss gradient ``weights`` (float32, contiguous, 0 on ignored rows) and the forward's log-sum-exps."""
    grad_pred = grad_embeds = None
    if want_pred:
        grad_pred = _grad_pred(weights, pred, embeds, targets, mask, lse, tau)
    if want_embeds:
        grad_embeds = infonce_grad_embeds(weights, pred, embeds, targets, mask, lse, tau)
    return grad_pred, grad_embeds


def _grad_pred(weights, pred, embeds, targets, mask, lse, tau: float):
    """The ``grad_pred`` kernel's launch: ``pred``'s gradient in its dtype and shape."""
    shape = layout(pred, embeds)
    dim, rows, groups, half = shape.dim, shape.rows, shape.groups, shape.half
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, pred)
    block_a = _block_a(shape.num_actions, half, dim)
    single_tile = shape.num_actions <= block_a
    grad_pred = empty_output(pred.shape, dtype=pred.dtype, device=pred.device)

    def grid(meta):
        columns = 1 if single_tile else _column_blocks(dim, meta["MAX_DO"], half)
        return (cdiv(rows, meta["BLOCK_N"]) * groups, columns)

    launch(_infonce_grad_pred_kernel, grid)(
        pred, embeds, mask_t, targets, lse, weights, grad_pred, shape.steps, shape.num_actions, dim, rows, tau,
        mask_cols, shape.size_bucket, shape.stride_pb, shape.stride_pt, shape.stride_eg, shape.stride_ea, smb, smt, sma,
        shape.stride_gb, shape.stride_gt,
        HAS_MASK=mask is not None, HALF_DOT=half, SINGLE_TILE=single_tile, BLOCK_A=block_a, DO_FULL=_do_full(dim),
    )  # fmt: skip
    return grad_pred


def infonce_grad_embeds(weights, pred, embeds, targets, mask, lse, tau: float):
    """The map's gradient (``embeds``' dtype and shape) given each row's loss gradient ``weights`` (float32,
    zero on ignored rows) and log-sum-exp ``lse``: the ``grad_embeds`` kernel, with its rows split across
    programs when there are few action tiles (partial sums added afterwards). Also the ``small`` algorithm's."""
    shape = layout(pred, embeds)
    dim, num_actions, groups, rows, half = shape.dim, shape.num_actions, shape.groups, shape.rows, shape.half
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, pred)
    block_a = _block_a_embeds(num_actions, dim, half)
    action_blocks = cdiv(num_actions, block_a)
    num_splits = _num_splits(rows, action_blocks * groups)
    rows_per_split = cdiv(rows, num_splits)
    if num_splits == 1:
        out = empty_output((groups, num_actions, dim), dtype=embeds.dtype, device=pred.device)
    else:
        out = empty_output((groups * num_splits, num_actions, dim), dtype=torch.float32, device=pred.device)
    # max|w| on the device (no host read): the kernel scales the dot's operand by w / max|w|.
    w_max = weights.abs().amax().reshape(1)

    def grid(meta):
        return (action_blocks * groups * num_splits, _column_blocks(dim, meta["MAX_DO"], half))

    launch(_infonce_grad_embeds_kernel, grid)(
        pred, embeds, mask_t, targets, lse, weights, w_max, out, shape.steps, num_actions, dim, rows, rows_per_split,
        num_splits, tau, mask_cols, shape.size_bucket, shape.stride_pb, shape.stride_pt, shape.stride_eg,
        shape.stride_ea, smb, smt, sma, out.stride(0), out.stride(1),
        HAS_MASK=mask is not None, HALF_DOT=half, BLOCK_A=block_a, DO_FULL=_do_full(dim),
    )  # fmt: skip
    if num_splits > 1:
        out = out.view(groups, num_splits, num_actions, dim).sum(1).to(embeds.dtype)
    return out.view(embeds.shape)


def select(pred, embeds, mask, tau: float, sample: bool, seed: torch.Tensor, seed_rows: int):
    """``ALGORITHMS["fused"]``'s (and ``"small"``'s) selection: ``(actions, status)`` of ``pred.shape[:-1]``,
    per row the argmax of the logits over the available actions, plus Gumbel noise from the device seeds when
    ``sample`` (flat row ``r``: seed ``seed[r // seed_rows]``, counter ``(r % seed_rows) * A + action``); the int8
    status (``checks.ROW_*``) flags a row with no available action or a NaN logit of an available one."""
    shape = layout(pred, embeds)
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, pred)
    actions = empty_output(pred.shape[:-1], dtype=torch.int64, device=pred.device)
    status = empty_output(pred.shape[:-1], dtype=torch.int8, device=pred.device)
    launch(_select_actions_kernel, shape.grid)(
        pred, embeds, mask_t, seed, actions, status, shape.steps, shape.num_actions, shape.dim, shape.rows, seed_rows,
        tau, mask_cols, shape.size_bucket, shape.stride_pb, shape.stride_pt, shape.stride_eg, shape.stride_ea,
        smb, smt, sma,
        SAMPLE=sample, HAS_MASK=mask is not None, HALF_DOT=shape.half, BLOCK_A=_block_a(shape.num_actions, shape.half),
    )  # fmt: skip
    return actions, status
