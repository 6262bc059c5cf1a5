"""Triton kernels of n-gram match attention: segmented running sums over a sorted plan.

One program owns one batch row and one block of feature columns, and walks the row's sorted
positions (:mod:`.plan`) in tiles of ``BLOCK_L``. Inside a tile, ``tl.associative_scan`` computes a
running sum that restarts at every segment boundary; a per-column carry continues the open segment
into the next tile. Rows are gathered from and scattered to their original positions, so the
``[B, L, L]`` pattern and the sorted copy of ``h`` never exist in memory: the forward reads ``h``
twice (value and self-exclusion rows) and writes the output once; the backward mirrors it from the
end of each segment. Accumulation is fp32 whatever the input dtype (inputs are upcast on load).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import autotune, launch

_CONFIGS = [
    triton.Config({"BLOCK_L": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_L": 128, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_L": 64, "BLOCK_D": 128}, num_warps=8),
    triton.Config({"BLOCK_L": 32, "BLOCK_D": 32}, num_warps=2),
    triton.Config({"BLOCK_L": 128, "BLOCK_D": 64}, num_warps=8),
]


@triton.jit
def _segmented_add(start_a, sum_a, start_b, sum_b):
    return start_a | start_b, tl.where(start_b != 0, sum_b, sum_a + sum_b)


@triton.jit
def _segment_running_sum(values, starts, carry, BLOCK_L: tl.constexpr):
    """Inclusive running sum of ``values [BLOCK_L, BLOCK_D]`` along rows, restarting where ``starts``.

    Rows before the tile's first segment start continue the previous tile's open segment (``carry``).
    Returns the running sums and the carry for the next tile.
    """
    flags = tl.broadcast_to(starts[:, None], values.shape)
    _, running = tl.associative_scan((flags, values), 0, _segmented_add)
    continues_open_segment = tl.cumsum(starts, 0) == 0
    running += tl.where(continues_open_segment[:, None], carry[None, :], 0.0)
    is_last_row = tl.arange(0, BLOCK_L) == BLOCK_L - 1
    next_carry = tl.sum(tl.where(is_last_row[:, None], running, 0.0), axis=0)
    return running, next_carry


@autotune(_CONFIGS, key=["D"])
@triton.jit
def _ngram_forward_kernel(
    h_ptr, perm_ptr, meta_ptr, count_ptr, out_ptr,
    L, D,
    stride_hb, stride_hl, stride_ob, stride_ol,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    h_row = h_ptr + row * stride_hb
    out_row = out_ptr + row * stride_ob
    plan_row = row * L
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(0, L, BLOCK_L):
        k = tile + tl.arange(0, BLOCK_L)
        k_ok = k < L
        t = tl.load(perm_ptr + plan_row + k, mask=k_ok, other=0)
        meta = tl.load(meta_ptr + plan_row + k, mask=k_ok, other=0).to(tl.int32)
        starts = meta & 1
        previous_adjacent = ((meta >> 1) & 1) != 0
        count = tl.load(count_ptr + plan_row + t, mask=k_ok, other=0)

        # The key at sorted position k carries h[t + 1] (the token after its n-gram).
        has_value = k_ok & (t + 1 < L)
        values = tl.load(
            h_row + (t + 1)[:, None] * stride_hl + cols[None, :],
            mask=has_value[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        running, carry = _segment_running_sum(values, starts, carry, BLOCK_L)

        # Exclude the key j = i (the previous segment element at t - 1 carries h[t]).
        excluded = k_ok & previous_adjacent & (count > 0)
        own = tl.load(
            h_row + t[:, None] * stride_hl + cols[None, :],
            mask=excluded[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        total = running - values - own
        mean = tl.where((count > 0)[:, None], total / tl.maximum(count, 1).to(tl.float32)[:, None], 0.0)
        tl.store(
            out_row + t[:, None] * stride_ol + cols[None, :],
            mean.to(out_ptr.dtype.element_ty),
            mask=k_ok[:, None] & col_ok[None, :],
        )


@autotune(_CONFIGS, key=["D"])
@triton.jit
def _ngram_backward_kernel(
    grad_out_ptr, perm_ptr, meta_ptr, count_ptr, grad_h_ptr,
    L, D,
    stride_gb, stride_gl, stride_hb, stride_hl,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    grad_out_row = grad_out_ptr + row * stride_gb
    grad_h_row = grad_h_ptr + row * stride_hb
    plan_row = row * L
    # Keys start at j = 1 (their n-gram ends at j - 1 >= 0): position 0 never gets a gradient.
    tl.store(grad_h_row + cols, tl.zeros([BLOCK_D], dtype=grad_h_ptr.dtype.element_ty), mask=col_ok)
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(0, L, BLOCK_L):
        k = L - 1 - (tile + tl.arange(0, BLOCK_L))  # walk sorted positions from the end
        k_ok = k >= 0
        t = tl.load(perm_ptr + plan_row + k, mask=k_ok, other=0)
        meta = tl.load(meta_ptr + plan_row + k, mask=k_ok, other=0).to(tl.int32)
        has_next = k_ok & (k + 1 < L)
        # Scanning backwards, a segment starts where the next sorted position starts one.
        meta_next = tl.load(meta_ptr + plan_row + k + 1, mask=has_next, other=1).to(tl.int32)
        starts = meta_next & 1
        next_adjacent = has_next & (((meta_next >> 1) & 1) != 0)

        count = tl.load(count_ptr + plan_row + t, mask=k_ok, other=0)
        is_query = k_ok & (count > 0)
        weights = (
            tl.load(
                grad_out_row + t[:, None] * stride_gl + cols[None, :],
                mask=is_query[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            / tl.maximum(count, 1).to(tl.float32)[:, None]
        )
        running, carry = _segment_running_sum(weights, starts, carry, BLOCK_L)

        # Exclude the query i = j (the next segment element, at t + 1).
        count_next = tl.load(count_ptr + plan_row + t + 1, mask=next_adjacent, other=0)
        excluded = next_adjacent & (count_next > 0)
        next_weights = (
            tl.load(
                grad_out_row + (t + 1)[:, None] * stride_gl + cols[None, :],
                mask=excluded[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            / tl.maximum(count_next, 1).to(tl.float32)[:, None]
        )
        total = running - weights - next_weights

        has_key_row = k_ok & (t + 1 < L)
        is_key = has_key_row & (((meta >> 2) & 1) != 0)
        grad = tl.where(is_key[:, None], total, 0.0)
        tl.store(
            grad_h_row + (t + 1)[:, None] * stride_hl + cols[None, :],
            grad.to(grad_h_ptr.dtype.element_ty),
            mask=has_key_row[:, None] & col_ok[None, :],
        )


def ngram_forward_triton(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Triton forward: ``h [B, L, D]`` and a plan to the output ``[B, L, D]`` (``h.dtype``)."""
    h = h.contiguous()
    batch, length, dim = h.shape
    out = empty_output(h.shape, dtype=h.dtype, device=h.device)

    def grid(meta_params):
        return (batch, triton.cdiv(dim, meta_params["BLOCK_D"]))

    launch(_ngram_forward_kernel, grid)(
        h, perm.contiguous(), meta.contiguous(), count.contiguous(), out,
        length, dim,
        h.stride(0), h.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    return out


def ngram_backward_triton(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Triton backward: ``grad_out [B, L, D]`` and a plan to the gradient w.r.t. ``h``."""
    grad_out = grad_out.contiguous()
    batch, length, dim = grad_out.shape
    grad_h = empty_output(grad_out.shape, dtype=grad_out.dtype, device=grad_out.device)

    def grid(meta_params):
        return (batch, triton.cdiv(dim, meta_params["BLOCK_D"]))

    launch(_ngram_backward_kernel, grid)(
        grad_out, perm.contiguous(), meta.contiguous(), count.contiguous(), grad_h,
        length, dim,
        grad_out.stride(0), grad_out.stride(1), grad_h.stride(0), grad_h.stride(1),
    )  # fmt: skip
    return grad_h
