"""Triton kernels of smeared keys: one elementwise pass forward, one backward with a per-program ``alpha`` partial.

A program owns a tile of ``BLOCK_L`` positions x ``BLOCK_D`` features of one ``(batch, head)``. The
forward reads the tile and the tile one position earlier (the overlap comes from cache, so DRAM
traffic is about one read of ``k`` and one write of the output) and blends them in fp32. The
backward reads ``grad_out`` at ``j`` and ``j + 1`` and writes
``grad_k[j] = w * g[j] + (1 - w) * g[j + 1]``; in the same pass it reduces its tile's share of
``sum g[j] . (k[j] - k[j - 1])`` to one fp32 number. A third, tiny kernel (one program per head) sums a
head's partials in a fixed order, scales the sum by ``w (1 - w)`` and writes the ``alpha`` gradient in
``alpha``'s dtype: deterministic (no atomics), and no PyTorch op around the kernels.

Block sizes come from a heuristic rather than autotuning: the op is memory-bound and a tile of about
4096 elements already keeps loads wide, and fixed sizes fix the number of partials the backward
writes. Inputs may be strided (a ``[B, L, H, Dh]`` projection transposed to ``[B, H, L, Dh]``);
outputs are contiguous ``[B, H, L, Dh]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import cdiv, launch, next_power_of_2, per_signature

#: Elements per program (BLOCK_L x BLOCK_D).
_TILE_ELEMENTS = 4096
_MAX_BLOCK_D = 128
_MAX_BLOCK_L = 256


def block_sizes(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_L, BLOCK_D)`` for head width ``head_dim``: whole heads up to 128 features, ~4096-element tiles."""
    block_d = min(next_power_of_2(head_dim), _MAX_BLOCK_D)
    block_l = min(max(16, _TILE_ELEMENTS // block_d), _MAX_BLOCK_L)
    return block_l, block_d


@triton.jit
def _load_current_and_previous(k_head, rows, cols, L, Dh, stride_kl, stride_kd):
    """Keys at ``rows`` and at ``rows - 1`` (zero before position 0 and outside the tensor), in fp32."""
    row_ok = rows < L
    col_ok = cols < Dh
    offsets = rows[:, None] * stride_kl + cols[None, :] * stride_kd
    current = tl.load(k_head + offsets, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    has_previous = row_ok & (rows > 0)
    previous = tl.load(k_head + offsets - stride_kl, mask=has_previous[:, None] & col_ok[None, :], other=0.0).to(
        tl.float32
    )
    return current, previous


@triton.jit
def _smeared_keys_forward_kernel(
    k_ptr, alpha_ptr, out_ptr,
    H, L, Dh,
    stride_kb, stride_kh, stride_kl, stride_kd, stride_a,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    batch_head = tl.program_id(0).to(tl.int64)
    batch, head = batch_head // H, batch_head % H
    rows = tl.program_id(1).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    weight = tl.sigmoid(tl.load(alpha_ptr + head * stride_a).to(tl.float32))
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    current, previous = _load_current_and_previous(k_head, rows, cols, L, Dh, stride_kl, stride_kd)
    smeared = weight * current + (1.0 - weight) * previous
    out_offsets = batch_head * L * Dh + rows[:, None] * Dh + cols[None, :]
    tl.store(
        out_ptr + out_offsets,
        smeared.to(out_ptr.dtype.element_ty),
        mask=(rows < L)[:, None] & (cols < Dh)[None, :],
    )


@triton.jit
def _smeared_keys_backward_kernel(
    grad_out_ptr, k_ptr, alpha_ptr, grad_k_ptr, partial_ptr,
    H, L, Dh,
    stride_gb, stride_gh, stride_gl, stride_gd,
    stride_kb, stride_kh, stride_kl, stride_kd, stride_a,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    batch_head = tl.program_id(0).to(tl.int64)
    batch, head = batch_head // H, batch_head % H
    row_block, col_block = tl.program_id(1), tl.program_id(2)
    rows = row_block.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < L
    col_ok = cols < Dh
    weight = tl.sigmoid(tl.load(alpha_ptr + head * stride_a).to(tl.float32))

    # Key j feeds outputs j (weight w) and j + 1 (weight 1 - w).
    grad_head = grad_out_ptr + batch * stride_gb + head * stride_gh
    grad_offsets = rows[:, None] * stride_gl + cols[None, :] * stride_gd
    grad = tl.load(grad_head + grad_offsets, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    has_next = (rows + 1) < L
    grad_next = tl.load(grad_head + grad_offsets + stride_gl, mask=has_next[:, None] & col_ok[None, :], other=0.0).to(
        tl.float32
    )
    grad_k = weight * grad + (1.0 - weight) * grad_next
    out_offsets = batch_head * L * Dh + rows[:, None] * Dh + cols[None, :]
    tl.store(grad_k_ptr + out_offsets, grad_k.to(grad_k_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    # d k'_j / d alpha = w (1 - w) (k_j - k_{j-1}); the caller applies w (1 - w) after the reduction.
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    current, previous = _load_current_and_previous(k_head, rows, cols, L, Dh, stride_kl, stride_kd)
    partial = tl.sum(tl.sum(grad * (current - previous), axis=1), axis=0)
    partial_index = (batch_head * tl.num_programs(1) + row_block) * tl.num_programs(2) + col_block
    tl.store(partial_ptr + partial_index, partial)


@triton.jit
def _smeared_keys_alpha_grad_kernel(
    partial_ptr, alpha_ptr, grad_alpha_ptr,
    B, H, P, stride_a,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """``grad_alpha[h] = w (1 - w) sum_{b, p} partial[b, h, p]`` (``partial`` ``[B, H, P]`` contiguous fp32),
    summed in a fixed order; one program per head."""
    head = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_P)
    total = tl.zeros((BLOCK_P,), dtype=tl.float32)
    row = partial_ptr + head.to(tl.int64) * P  # a 64-bit pointer stepped one batch entry (H rows) at a time
    for _ in range(0, B):
        for start in range(0, P, BLOCK_P):
            total += tl.load(row + start + offsets, mask=start + offsets < P, other=0.0)
        row += H * P
    weight = tl.sigmoid(tl.load(alpha_ptr + head * stride_a).to(tl.float32))
    grad = tl.sum(total, axis=0) * weight * (1.0 - weight)
    tl.store(grad_alpha_ptr + head, grad.to(grad_alpha_ptr.dtype.element_ty))


@per_signature
def _launch_config(shape: tuple[int, int, int, int]) -> tuple[tuple[int, int, int], dict, int, int]:
    """``(grid, constexprs, partials per (batch, head), BLOCK_P of the alpha-gradient kernel)`` for keys
    of ``shape``."""
    batch, heads, length, head_dim = shape
    block_l, block_d = block_sizes(head_dim)
    grid = (batch * heads, cdiv(length, block_l), cdiv(head_dim, block_d))
    partials = grid[1] * grid[2]
    return grid, {"BLOCK_L": block_l, "BLOCK_D": block_d}, partials, min(1024, next_power_of_2(partials))


def smeared_keys_forward_triton(k: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Triton forward: ``k [B, H, L, Dh]`` (any strides), ``alpha [H]`` -> contiguous ``k.dtype`` output."""
    _, heads, length, head_dim = shape = k.shape
    grid, blocks, _, _ = _launch_config(shape)
    out = empty_output(shape, dtype=k.dtype, device=k.device)
    launch(_smeared_keys_forward_kernel, grid)(
        k, alpha, out,
        heads, length, head_dim,
        *k.stride(), alpha.stride(0),
        **blocks,
    )  # fmt: skip
    return out


def smeared_keys_backward_triton(
    grad_out: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward: gradients w.r.t. ``k`` (contiguous, ``k.dtype``) and ``alpha`` (``alpha.dtype``)."""
    batch, heads, length, head_dim = shape = k.shape
    grid, blocks, partials, block_p = _launch_config(shape)
    device = k.device
    grad_k = empty_output(shape, dtype=k.dtype, device=device)
    # One slot per program, summed by the alpha-gradient kernel in a fixed order. Poisoned under test like
    # any output, so a program that skipped its slot turns the alpha gradient into NaN.
    partial = empty_output(grid, dtype=torch.float32, device=device)
    grad_alpha = empty_output((heads,), dtype=alpha.dtype, device=device)
    alpha_stride = alpha.stride(0)
    launch(_smeared_keys_backward_kernel, grid)(
        grad_out, k, alpha, grad_k, partial,
        heads, length, head_dim,
        *grad_out.stride(),
        *k.stride(), alpha_stride,
        **blocks,
    )  # fmt: skip
    launch(_smeared_keys_alpha_grad_kernel, (heads,))(
        partial, alpha, grad_alpha, batch, heads, partials, alpha_stride, BLOCK_P=block_p
    )
    return grad_k, grad_alpha
