"""Fused Triton kernels of InfoNCE over action embeddings and of action selection.

Rows and maps. Every kernel works on rows ``r`` of the flattened ``[B, T]`` grid of predictions. A
*group* is the set of rows that share one action map: one sequence (``T`` rows) for per-sequence maps,
all ``B * T`` rows for a shared map. A program takes a tile of rows of one group, so one tile of the
map serves the whole tile of rows in a ``tl.dot``.

Logits never reach memory. A program walks the action axis in tiles of ``BLOCK_A`` actions; each
logits tile ``[BLOCK_N, BLOCK_A]`` is a ``tl.dot`` over ``D`` in chunks of ``BLOCK_D``:

* forward: an online log-sum-exp (running max and rescaled sum) plus the target's logit; it stores
  the loss and the log-sum-exp of each row (8 bytes per row);
* backward, ``grad_pred``: recompute each logits tile, turn it into ``softmax - one_hot`` with the saved
  log-sum-exp, and multiply by the map tile; a program owns ``BLOCK_DO`` output columns, so widths above
  ``BLOCK_DO`` recompute the logits once per column block;
* backward, ``grad_embeds``: a program owns ``BLOCK_A`` actions x ``BLOCK_DO`` columns and walks rows;
  with few action tiles (a shared map of a few actions) the rows are split across ``num_splits``
  programs whose partial sums (fp32) are added afterwards, deterministically, without atomics;
* selection: a running (max, argmax) of ``logits + Gumbel noise`` (Philox, seeded) or of the logits.

With ``A <= 128`` the whole action set is one tile held in registers; larger sets (up to millions of
actions) stream, and memory stays O(N D + A D). InfoNCE without half-precision dots (fp32) takes
``FMA_BLOCK_A`` = 16 actions a tile: its IEEE fp32 dots run on FMA units, which keep a whole slice of
both operands along the reduced axis in each thread, and with 128-action tiles the backward spilled
17-30 KB per thread in every autotune config on sm_90 (D = 512); 16-action tiles spill at most ~150
bytes. The forward uses the backward's tiles so that both compute the same logits (the interpreter's
dot rounds differently for different tile shapes, and the backward reuses the forward's log-sum-exp).

Precision: fp16/bf16 tiles go to ``tl.dot`` in their own dtype with fp32 accumulation (tensor cores);
``softmax - one_hot`` is cast to the input dtype for the backward dots, as FlashAttention does. fp32
inputs use IEEE fp32 dots. Triton's CPU interpreter computes bf16 dots wrongly, so under the
interpreter bf16 tiles are upcast first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .._library import empty_output
from .._triton import autotune, launch

#: Largest action tile; action sets up to this size are held in registers whole.
MAX_BLOCK_A = 128
#: Action tile of InfoNCE (forward and backward) without half-precision dots: fp32 FMA dots (module doc).
FMA_BLOCK_A = 16
#: Programs the grad_embeds launch aims for before it splits rows (about two waves on an H100).
TARGET_PROGRAMS = 264

# Autotune configs. The tests compile every config of every kernel for sm_90 (bf16 and fp32, D = 512,
# A = 125 and 4096, and A = 4096 with a mask) and fail on more than 256 bytes of spill per thread. The
# backward and selection hold two fp32 tiles at once ([BLOCK_N, BLOCK_A] logits plus the
# [BLOCK_N, 256] / [128, BLOCK_DO] accumulator, or the fp32 FMA-dot operands), so their 64-row tiles take
# 8 warps: with 4 they spilled ~1 KB (bf16) to 6 KB (fp32, masked) per thread. 128-row tiles spill in
# the backward whatever the warps (8: >= 0.5 KB in bf16, 6 KB in fp32 with a mask; 16 warps cap a
# thread at 128 registers), so only the forward and selection keep one. Not covered: a mask whose rows
# are not 16-element aligned (A = 125) is loaded element by element, which spills ~2 KB per thread in
# every 64-row tile (with the same mask padded to a row stride of 128: none in the forward).
_ROW_CONFIGS = [  # forward: one logits tile, no accumulator; 8 bytes of spill at most
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
    triton.Config({"BLOCK_N": 128, "BLOCK_D": 64}, num_warps=8),
]
_GRAD_PRED_CONFIGS = [
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
]
_COLUMN_CONFIGS = [  # grad_embeds
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
]
# Selection takes 128-action tiles in every dtype, so fp32 runs 128-wide FMA dots: the 128-row tile
# reads D in chunks of 16 (with 64 it spilled 312 bytes per thread with a mask).
_SELECT_CONFIGS = [
    triton.Config({"BLOCK_N": 32, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_D": 32}, num_warps=8),
    triton.Config({"BLOCK_N": 128, "BLOCK_D": 16}, num_warps=8),
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
def _logits_tile(
    pred_ptr, embeds_ptr, mask_ptr, rows, row_ok, actions, T, A, D, tau,
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
    available = action_ok[None, :] & row_ok[:, None]
    if HAS_MASK:
        allowed = tl.load(
            mask_ptr + _row_offsets(rows, T, stride_mb, stride_mt)[:, None] + actions[None, :].to(tl.int64) * stride_ma,
            mask=available,
            other=0,
        )
        available = available & (allowed != 0)
    return tl.where(available, acc / tau, float("-inf"))


@triton.jit
def _softmax_minus_one_hot(logits, row_lse, targets, actions, row_scale):
    """``(softmax - one_hot(target)) * row_scale`` of a logits tile, from each row's log-sum-exp."""
    probs = tl.exp(logits - row_lse[:, None])
    hit = actions[None, :] == targets[:, None]
    return (probs - tl.where(hit, 1.0, 0.0)) * row_scale[:, None]


@autotune(_ROW_CONFIGS, key=["A", "D"])
@triton.jit
def _infonce_forward_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, loss_ptr, lse_ptr,
    T, A, D, ROWS, tau, ignore_index,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index)
    running_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    target_logit = tl.zeros([BLOCK_N], dtype=tl.float32)
    for a_start in range(0, A, BLOCK_A):
        actions = a_start + tl.arange(0, BLOCK_A)
        logits = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        target_logit += tl.sum(tl.where(actions[None, :] == targets[:, None], logits, 0.0), axis=1)
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        # A row whose actions so far are all unavailable keeps max -inf; shift by 0 to avoid inf - inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(logits - shift[:, None]), axis=1)
        running_max = new_max
    # Rows past the end have no available action (sum 0); log(1) keeps them finite (they are not stored).
    lse = running_max + tl.log(tl.where(row_ok, running_sum, 1.0))
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(loss_ptr + rows, tl.where(targets == ignore_index, 0.0, lse - target_logit), mask=row_ok)


@autotune(_GRAD_PRED_CONFIGS, key=["A", "D"])
@triton.jit
def _infonce_grad_pred_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, lse_ptr, weights_ptr, grad_ptr,
    T, A, D, ROWS, tau,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma, stride_gb, stride_gt,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr,
):  # fmt: skip
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    out_dims = tl.program_id(1) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    out_ok = out_dims < D
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    row_lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    row_scale = tl.load(weights_ptr + rows, mask=row_ok, other=0.0) / tau
    acc = tl.zeros([BLOCK_N, BLOCK_DO], dtype=tl.float32)
    for a_start in range(0, A, BLOCK_A):
        actions = a_start + tl.arange(0, BLOCK_A)
        logits = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        grad_logits = _softmax_minus_one_hot(logits, row_lse, targets, actions, row_scale)
        e = tl.load(
            embeds + actions[:, None].to(tl.int64) * stride_ea + out_dims[None, :],
            mask=(actions < A)[:, None] & out_ok[None, :],
            other=0.0,
        )
        if HALF_DOT:
            acc += tl.dot(grad_logits.to(e.dtype), e)
        else:
            acc += tl.dot(grad_logits, e.to(tl.float32), input_precision="ieee")
    grad_rows = grad_ptr + _row_offsets(rows, T, stride_gb, stride_gt)
    tl.store(
        grad_rows[:, None] + out_dims[None, :],
        acc.to(grad_ptr.dtype.element_ty),
        mask=row_ok[:, None] & out_ok[None, :],
    )


@autotune(_COLUMN_CONFIGS, key=["A", "D"])
@triton.jit
def _infonce_grad_embeds_kernel(
    pred_ptr, embeds_ptr, mask_ptr, targets_ptr, lse_ptr, weights_ptr, out_ptr,
    T, A, D, ROWS, ROWS_PER_SPLIT, NUM_SPLITS, tau,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma, stride_os, stride_oa,
    HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr,
):  # fmt: skip
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
    acc = tl.zeros([BLOCK_A, BLOCK_DO], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        local = start + tl.arange(0, BLOCK_N)
        row_ok = local < last
        rows = group * ROWS + local
        targets = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
        row_lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        row_scale = tl.load(weights_ptr + rows, mask=row_ok, other=0.0) / tau
        logits = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        grad_logits = _softmax_minus_one_hot(logits, row_lse, targets, actions, row_scale)
        pred_rows = pred_ptr + _row_offsets(rows, T, stride_pb, stride_pt)
        p = tl.load(pred_rows[:, None] + out_dims[None, :], mask=row_ok[:, None] & out_ok[None, :], other=0.0)
        if HALF_DOT:
            acc += tl.dot(tl.trans(grad_logits.to(p.dtype)), p)
        else:
            acc += tl.dot(tl.trans(grad_logits), p.to(tl.float32), input_precision="ieee")
    tl.store(
        out_ptr + slot.to(tl.int64) * stride_os + actions[:, None].to(tl.int64) * stride_oa + out_dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(actions < A)[:, None] & out_ok[None, :],
    )


@autotune(_SELECT_CONFIGS, key=["A", "D"])
@triton.jit
def _select_actions_kernel(
    pred_ptr, embeds_ptr, mask_ptr, out_ptr,
    T, A, D, ROWS, tau, seed,
    stride_pb, stride_pt, stride_eg, stride_ea, stride_mb, stride_mt, stride_ma,
    SAMPLE: tl.constexpr, HAS_MASK: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    group, local = _row_tile(ROWS, BLOCK_N)
    row_ok = local < ROWS
    rows = group * ROWS + local
    embeds = embeds_ptr + group.to(tl.int64) * stride_eg
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    best_action = tl.zeros([BLOCK_N], dtype=tl.int64)
    for a_start in range(0, A, BLOCK_A):
        actions = a_start + tl.arange(0, BLOCK_A)
        scores = _logits_tile(
            pred_ptr, embeds, mask_ptr, rows, row_ok, actions, T, A, D, tau,
            stride_pb, stride_pt, stride_ea, stride_mb, stride_mt, stride_ma,
            HAS_MASK, HALF_DOT, BLOCK_N, BLOCK_A, BLOCK_D,
        )  # fmt: skip
        if SAMPLE:
            # Gumbel-max: one Philox draw per (row, action), so the sample does not depend on tiling.
            counter = rows[:, None].to(tl.int64) * A + actions[None, :]
            uniform = tl.maximum(tl.rand(seed, counter), 1e-20)
            scores += -tl.log(-tl.log(uniform))
        tile_best = tl.max(scores, axis=1)
        tile_action = tl.argmax(scores, axis=1).to(tl.int64) + a_start
        better = tile_best > best  # strict: ties keep the lower action id, like torch.argmax
        best_action = tl.where(better, tile_action, best_action)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + rows, best_action, mask=row_ok)


def _half_dot(dtype: torch.dtype) -> bool:
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not triton_interpreter_enabled()


def _block_a(num_actions: int, half_dot: bool = True) -> int:
    """Action tile: the whole set up to 128 actions; ``FMA_BLOCK_A`` for fp32 dots (see the module doc)."""
    return min(MAX_BLOCK_A if half_dot else FMA_BLOCK_A, max(16, triton.next_power_of_2(num_actions)))


def _block_out(dim: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(dim)))


def _layout_args(pred, embeds, mask):
    """Groups, rows per group, and the pointer/stride arguments shared by every kernel."""
    batch, steps, _ = pred.shape
    groups = embeds.shape[0]  # 1 (shared map) or B (one map per sequence)
    rows = steps if groups > 1 else batch * steps
    if mask is None:
        mask_args = (pred, 0, 0, 0)  # never read (HAS_MASK=False)
    else:
        mask_args = (mask, *(mask.stride(i) if mask.shape[i] > 1 else 0 for i in range(3)))
    return groups, rows, mask_args


def infonce_forward_triton(pred, embeds, targets, mask, tau: float, ignore_index: int):
    """Canonical inputs (see :mod:`.function`) -> per-row ``(loss, lse)``, ``[B, T]`` float32 each."""
    batch, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, smb, smt, sma) = _layout_args(pred, embeds, mask)
    losses = empty_output((batch, steps), dtype=torch.float32, device=pred.device)
    lse = empty_output((batch, steps), dtype=torch.float32, device=pred.device)

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_N"]) * groups,)

    launch(_infonce_forward_kernel, grid)(
        pred, embeds, mask_t, targets, losses, lse,
        steps, num_actions, dim, rows, tau, ignore_index,
        pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma,
        HAS_MASK=mask is not None, HALF_DOT=_half_dot(pred.dtype),
        BLOCK_A=_block_a(num_actions, _half_dot(pred.dtype)),  # the backward's tiles: the same logits
    )  # fmt: skip
    return losses, lse


def infonce_backward_triton(row_weights, pred, embeds, targets, mask, lse, tau: float, *, want_embeds: bool = True):
    """Gradients ``(grad_pred, grad_embeds)`` given each row's loss gradient ``row_weights [B, T]``;
    ``want_embeds=False`` skips the second pass and returns an empty tensor for ``embeds``."""
    batch, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, smb, smt, sma) = _layout_args(pred, embeds, mask)
    row_weights = row_weights.contiguous().float()
    common = (steps, num_actions, dim, rows)
    strides = (pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma)
    half_dot = _half_dot(pred.dtype)
    flags = {"HAS_MASK": mask is not None, "HALF_DOT": half_dot, "BLOCK_A": _block_a(num_actions, half_dot)}

    grad_pred = empty_output(pred.shape, dtype=pred.dtype, device=pred.device)
    block_do = _block_out(dim, 256)

    def pred_grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_N"]) * groups, triton.cdiv(dim, block_do))

    launch(_infonce_grad_pred_kernel, pred_grid)(
        pred, embeds, mask_t, targets, lse, row_weights, grad_pred, *common, tau,
        *strides, grad_pred.stride(0), grad_pred.stride(1), BLOCK_DO=block_do, **flags,
    )  # fmt: skip
    if not want_embeds:
        return grad_pred, embeds.new_empty(0)

    block_do = _block_out(dim, 128)
    tiles = triton.cdiv(num_actions, flags["BLOCK_A"]) * triton.cdiv(dim, block_do) * groups
    num_splits = max(1, min(triton.cdiv(rows, 64), TARGET_PROGRAMS // tiles))
    rows_per_split = triton.cdiv(rows, num_splits)
    if num_splits == 1:
        out = empty_output(embeds.shape, dtype=embeds.dtype, device=pred.device)
    else:
        out = empty_output((groups * num_splits, num_actions, dim), dtype=torch.float32, device=pred.device)

    def embeds_grid(meta):
        return (triton.cdiv(num_actions, flags["BLOCK_A"]) * groups * num_splits, triton.cdiv(dim, block_do))

    launch(_infonce_grad_embeds_kernel, embeds_grid)(
        pred, embeds, mask_t, targets, lse, row_weights, out, *common, rows_per_split, num_splits, tau,
        *strides, out.stride(0), out.stride(1), BLOCK_DO=block_do, **flags,
    )  # fmt: skip
    if num_splits > 1:
        out = out.view(groups, num_splits, num_actions, dim).sum(1).to(embeds.dtype)
    return grad_pred, out


def select_actions_triton(pred, embeds, mask, tau: float, sample: bool, seed: int) -> torch.Tensor:
    """``[B, T]`` int64 actions: argmax of the logits, plus seeded Gumbel noise when ``sample``."""
    batch, steps, dim = pred.shape
    num_actions = embeds.shape[1]
    groups, rows, (mask_t, smb, smt, sma) = _layout_args(pred, embeds, mask)
    actions = empty_output((batch, steps), dtype=torch.int64, device=pred.device)

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_N"]) * groups,)

    launch(_select_actions_kernel, grid)(
        pred, embeds, mask_t, actions,
        steps, num_actions, dim, rows, tau, seed,
        pred.stride(0), pred.stride(1), embeds.stride(0), embeds.stride(1), smb, smt, sma,
        SAMPLE=sample, HAS_MASK=mask is not None, HALF_DOT=_half_dot(pred.dtype), BLOCK_A=_block_a(num_actions),
    )  # fmt: skip
    return actions
