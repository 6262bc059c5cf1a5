"""Triton kernels of the chunked InfoNCE and selection (:mod:`.chunked`): they read a chunk of fp32 logits
that a cuBLAS GEMM wrote, ``[R, C]`` for rows ``ROW0 .. ROW0 + R`` of the flattened ``[B, T]`` grid and
actions ``A0 .. A0 + C`` (``pred . e_a``, not yet divided by ``tau``).

* :func:`_infonce_chunk_kernel`: a program takes ``BLOCK_N`` rows and walks the chunk's columns in tiles of
  ``BLOCK_A``. ``STATS``: each row's online log-sum-exp (running max and sum), target logit and mask counts,
  carried across action chunks in per-row buffers (``FIRST`` starts them, ``LAST`` turns them into the
  loss, log-sum-exp and status, as the fused forward does). ``WRITE_GRAD``: a second walk overwrites the
  chunk *in place* with the gradient operand ``(softmax - one_hot) * w_r / max|w|`` in the inputs' dtype (a
  half-precision row takes the first half of its fp32 row's bytes), for the gradient GEMMs; ``max|w| / tau``
  scales their fp32 results (the operand stays in [-1, 1], normal in fp16, as in ``kernels.py``).
* :func:`_select_chunk_kernel`: each row's running (best score, action, NaN seen) across action chunks,
  the same tile update as the fused selection kernel (``kernels._select_tile``), so the Gumbel noise of a
  ``(row, action)`` is the same draw and the choice never an unavailable action.

In place, half precision: the bytes a tile's stores write belong to fp32 columns of the same or earlier
tiles of the row. Within the first tile they overlap columns other threads of the program still load, so a
barrier separates each tile's loads from its stores; later tiles never write bytes a later load reads.
Both kernels are autotuned; the autotuner times each config by running it several times, so the buffers a
run changes (the chunk in place, the carried per-row state) are restored between runs (``restore_value``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import autotune, cdiv, launch, size_bucket
from .kernels import (
    _available,
    _online_logsumexp,
    _row_seeds,
    _select_tile,
    _store_choice,
    _store_row_results,
    mask_args,
)

# Row kernels over an L2-resident chunk: no dots, the tile is one load per thread. The first config is the
# interpreter's (and the default where nothing was tuned).
_CHUNK_CONFIGS = [
    triton.Config({"BLOCK_N": 8, "BLOCK_A": 128}, num_warps=4),
    triton.Config({"BLOCK_N": 4, "BLOCK_A": 256}, num_warps=4),
    triton.Config({"BLOCK_N": 16, "BLOCK_A": 256}, num_warps=8),
    triton.Config({"BLOCK_N": 32, "BLOCK_A": 128}, num_warps=8),
]


@triton.jit
def _chunk_tile(
    chunk_rows, mask_ptr, rows, row_ok, columns, A0, C, A, T, tau, MASK_COLS, stride_mb, stride_mt, stride_ma,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """``(logits, available, actions)`` of one ``[BLOCK_N, BLOCK_A]`` tile of a chunk: the fp32 logits
    ``raw / tau``, ``-inf`` where the action is unavailable or past the chunk (NaN stays NaN where available),
    and the tile's global action ids."""
    column_ok = columns < C
    actions = A0 + columns
    raw = tl.load(chunk_rows + columns[None, :], mask=row_ok[:, None] & column_ok[None, :], other=0.0)
    available = column_ok[None, :] & _available(
        mask_ptr, rows, row_ok, actions, T, A, MASK_COLS, stride_mb, stride_mt, stride_ma, HAS_MASK
    )  # fmt: skip
    return tl.where(available, raw / tau, float("-inf")), available, actions


@autotune(
    _CHUNK_CONFIGS,
    key=["C", "SIZE_BUCKET", "STATS", "WRITE_GRAD"],
    restore_value=["logits_ptr", "max_ptr", "sum_ptr", "hit_ptr", "actions_ptr", "targets_ok_ptr"],
)
@triton.jit
def _infonce_chunk_kernel(
    logits_ptr, grad_ptr, mask_ptr, targets_ptr, weights_ptr, wmax_ptr, loss_ptr, lse_ptr, status_ptr,
    max_ptr, sum_ptr, hit_ptr, actions_ptr, targets_ok_ptr,
    ROW0, R, A0, C, A, T, tau, ignore_index, MASK_COLS, SIZE_BUCKET,
    stride_lr, stride_gr, stride_mb, stride_mt, stride_ma,
    HAS_MASK: tl.constexpr, STATS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    WRITE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
):  # fmt: skip
    """One chunk's statistics (``STATS``) and/or in-place gradient operand (``WRITE_GRAD``), module doc.
    The state carried across action chunks, per flat row: ``max_ptr``/``sum_ptr`` (fp32 online
    log-sum-exp), ``hit_ptr`` (fp32 target logit), ``actions_ptr``/``targets_ok_ptr`` (int32: available
    actions, available targets); not read or written when one chunk spans every action."""
    local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = local < R
    rows = ROW0 + local
    chunk_rows = logits_ptr + local.to(tl.int64)[:, None] * stride_lr
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index)
    if STATS:
        if FIRST:
            running_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
            running_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
            target_logit = tl.zeros([BLOCK_N], dtype=tl.float32)
            available_actions = tl.zeros([BLOCK_N], dtype=tl.int32)
            target_available = tl.zeros([BLOCK_N], dtype=tl.int32)
        else:
            running_max = tl.load(max_ptr + rows, mask=row_ok, other=float("-inf"))
            running_sum = tl.load(sum_ptr + rows, mask=row_ok, other=0.0)
            target_logit = tl.load(hit_ptr + rows, mask=row_ok, other=0.0)
            available_actions = tl.load(actions_ptr + rows, mask=row_ok, other=0)
            target_available = tl.load(targets_ok_ptr + rows, mask=row_ok, other=0)
        for a_start in range(0, C, BLOCK_A):
            columns = a_start + tl.arange(0, BLOCK_A)
            logits, available, actions = _chunk_tile(
                chunk_rows, mask_ptr, rows, row_ok, columns, A0, C, A, T, tau, MASK_COLS,
                stride_mb, stride_mt, stride_ma, HAS_MASK,
            )  # fmt: skip
            hit = (actions[None, :] == targets[:, None]) & (columns < C)[None, :]
            target_logit += tl.sum(tl.where(hit, logits, 0.0), axis=1)
            available_actions += tl.sum(available.to(tl.int32), axis=1)
            target_available += tl.sum((hit & available).to(tl.int32), axis=1)
            running_max, running_sum = _online_logsumexp(running_max, running_sum, logits)
        if LAST:
            lse = _store_row_results(
                lse_ptr, loss_ptr, status_ptr, rows, row_ok, targets, running_max, running_sum, target_logit,
                available_actions, target_available, A, ignore_index, 1.0, HAS_MASK, True,
            )  # fmt: skip
        else:
            tl.store(max_ptr + rows, running_max, mask=row_ok)
            tl.store(sum_ptr + rows, running_sum, mask=row_ok)
            tl.store(hit_ptr + rows, target_logit, mask=row_ok)
            tl.store(actions_ptr + rows, available_actions, mask=row_ok)
            tl.store(targets_ok_ptr + rows, target_available, mask=row_ok)
    else:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    if WRITE_GRAD:
        # The operand is (softmax - one_hot) * w / max|w|, in [-1, 1]; max|w| / tau scales the GEMMs' fp32 output.
        w_max = tl.load(wmax_ptr)
        w_inv = tl.where(w_max > 0, 1.0 / tl.where(w_max > 0, w_max, 1.0), 0.0)
        ratio = tl.load(weights_ptr + rows, mask=row_ok, other=0.0) * w_inv
        grad_rows = grad_ptr + local.to(tl.int64)[:, None] * stride_gr
        for a_start in range(0, C, BLOCK_A):
            columns = a_start + tl.arange(0, BLOCK_A)
            logits, available, actions = _chunk_tile(
                chunk_rows, mask_ptr, rows, row_ok, columns, A0, C, A, T, tau, MASK_COLS,
                stride_mb, stride_mt, stride_ma, HAS_MASK,
            )  # fmt: skip
            hit = actions[None, :] == targets[:, None]
            operand = (tl.exp(logits - lse[:, None]) - tl.where(hit, 1.0, 0.0)) * ratio[:, None]
            tl.debug_barrier()  # every load of this tile is done before a store may overwrite its bytes (doc)
            tl.store(
                grad_rows + columns[None, :],
                operand.to(grad_ptr.dtype.element_ty),
                mask=row_ok[:, None] & (columns < C)[None, :],
            )


@autotune(_CHUNK_CONFIGS, key=["C", "SIZE_BUCKET", "SAMPLE"], restore_value=["best_ptr", "choice_ptr", "nan_ptr"])
@triton.jit
def _select_chunk_kernel(
    logits_ptr, mask_ptr, seed_ptr, out_ptr, status_ptr, best_ptr, choice_ptr, nan_ptr,
    ROW0, R, A0, C, A, T, SEED_ROWS, tau, MASK_COLS, SIZE_BUCKET, stride_lr, stride_mb, stride_mt, stride_ma,
    SAMPLE: tl.constexpr, HAS_MASK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
):  # fmt: skip
    """One chunk's update of each row's choice (module doc); ``LAST`` stores the action (-1 where the mask
    leaves none) and the status (``checks.ROW_*``). State carried across action chunks, per flat row:
    ``best_ptr`` (fp32 best score), ``choice_ptr`` (int64 its action, -1: none yet), ``nan_ptr`` (int32)."""
    local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = local < R
    rows = ROW0 + local
    chunk_rows = logits_ptr + local.to(tl.int64)[:, None] * stride_lr
    seeds, seed_rows = 0, rows
    if SAMPLE:  # drawn on the device: no host read of the generator's state
        seeds, seed_rows = _row_seeds(seed_ptr, rows, row_ok, SEED_ROWS)
    if FIRST:
        best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        best_action = tl.full([BLOCK_N], -1, dtype=tl.int64)
        saw_nan = tl.zeros([BLOCK_N], dtype=tl.int32)
    else:
        best = tl.load(best_ptr + rows, mask=row_ok, other=float("-inf"))
        best_action = tl.load(choice_ptr + rows, mask=row_ok, other=-1)
        saw_nan = tl.load(nan_ptr + rows, mask=row_ok, other=0)
    for a_start in range(0, C, BLOCK_A):
        columns = a_start + tl.arange(0, BLOCK_A)
        scores, available, actions = _chunk_tile(
            chunk_rows, mask_ptr, rows, row_ok, columns, A0, C, A, T, tau, MASK_COLS,
            stride_mb, stride_mt, stride_ma, HAS_MASK,
        )  # fmt: skip
        best, best_action, saw_nan = _select_tile(
            scores, available, seed_rows, actions, A, seeds, best, best_action, saw_nan, SAMPLE
        )  # fmt: skip
    if LAST:
        _store_choice(out_ptr, status_ptr, rows, row_ok, best_action, saw_nan)
    else:
        tl.store(best_ptr + rows, best, mask=row_ok)
        tl.store(choice_ptr + rows, best_action, mask=row_ok)
        tl.store(nan_ptr + rows, saw_nan, mask=row_ok)


# -- launchers -----------------------------------------------------------------------------------------


class RowState:
    """Per-row state carried across the action chunks of one call (flat ``[B * T]`` rows), allocated once."""

    def __init__(self, rows: int, device: torch.device, *, select: bool):
        if select:
            self.tensors = (
                torch.empty(rows, dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.int64, device=device),
                torch.empty(rows, dtype=torch.int32, device=device),
            )
        else:
            floats = torch.empty((3, rows), dtype=torch.float32, device=device)
            ints = torch.empty((2, rows), dtype=torch.int32, device=device)
            self.tensors = (*floats, *ints)


def infonce_chunk_triton(
    logits, operand, targets, mask, weights, wmax, outputs, state, *, row0: int, action0: int, num_actions: int,
    steps: int, tau: float, ignore_index: int, stats: bool, first: bool, last: bool, write_grad: bool,
):  # fmt: skip
    """Launch :func:`_infonce_chunk_kernel` on one chunk.

    Args:
        logits: fp32 ``[R, C]`` (rows ``row0 ..``, actions ``action0 ..``), row-contiguous.
        operand: where the gradient operand goes: ``logits`` itself (fp32 inputs) or a half-precision view of
            its bytes with rows of ``2 C`` elements (``[R, C]`` of stride ``(2 C, 1)``); read only with ``write_grad``.
        targets: int64 ``[B, T]``; mask: canonical padded uint8 or None; weights: fp32 ``[B, T]`` row weights and
            ``wmax`` their max magnitude (one-element tensor), used with ``write_grad`` only.
        outputs: ``(losses, lse, status)`` of the whole call, ``[B, T]``; state: a :class:`RowState` or None.
    """
    rows, columns = logits.shape
    losses, lse, status = outputs
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, logits)
    carried = state.tensors if state is not None else (lse,) * 3 + (status,) * 2  # unused stand-ins

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_N"]),)

    launch(_infonce_chunk_kernel, grid)(
        logits, operand, mask_t, targets, weights if write_grad else lse, wmax if write_grad else lse,
        losses, lse, status, *carried,
        row0, rows, action0, columns, num_actions, steps, tau, ignore_index, mask_cols, size_bucket(rows),
        logits.stride(0), operand.stride(0), smb, smt, sma,
        HAS_MASK=mask is not None, STATS=stats, FIRST=first, LAST=last, WRITE_GRAD=write_grad,
    )  # fmt: skip


def select_chunk_triton(
    logits, mask, seed, outputs, state, *, row0: int, action0: int, num_actions: int, steps: int, seed_rows: int,
    tau: float, sample: bool, first: bool, last: bool,
):  # fmt: skip
    """Launch :func:`_select_chunk_kernel` on one chunk of fp32 ``logits [R, C]``; ``outputs``: the call's
    ``(actions int64, status int8)``, ``[B, T]``; ``state``: a :class:`RowState` (``select=True``) or None."""
    rows, columns = logits.shape
    actions, status = outputs
    mask_t, mask_cols, smb, smt, sma = mask_args(mask, logits)
    carried = state.tensors if state is not None else (logits, actions, status)  # unused stand-ins

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_N"]),)

    launch(_select_chunk_kernel, grid)(
        logits, mask_t, seed, actions, status, *carried,
        row0, rows, action0, columns, num_actions, steps, seed_rows, tau, mask_cols, size_bucket(rows),
        logits.stride(0), smb, smt, sma,
        SAMPLE=sample, HAS_MASK=mask is not None, FIRST=first, LAST=last,
    )  # fmt: skip


def new_outputs(shape, device: torch.device, *, select: bool):
    """The per-row outputs of a call: ``(losses, lse, status)`` or, for a selection, ``(actions, status)``."""
    status = empty_output(shape, dtype=torch.int8, device=device)
    if select:
        return empty_output(shape, dtype=torch.int64, device=device), status
    losses = empty_output(shape, dtype=torch.float32, device=device)
    return losses, empty_output(shape, dtype=torch.float32, device=device), status
