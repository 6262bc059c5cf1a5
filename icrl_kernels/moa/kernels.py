"""Triton kernels of Mixture-of-Attention gating: one pass forward, one pass backward.

A program owns ``BLOCK_R`` rows (a row is one ``(b, l)`` position) with all ``H`` heads, padded to
``BLOCK_H`` (a power of two, masked: GPT-2 has ``H = 12``). It loads the row's ``H`` gate logits,
normalises them in fp32 (softmax over heads with padded heads at ``-inf``, sigmoid, or identity) and
walks the head width in ``BLOCK_D`` chunks:

* forward: ``out[r, h * Dh + d] = G[r, h] * head_out[r, h, d]``, written contiguous ``[B, L, H * Dh]``;
* backward: ``grad_head[r, h, d] = G[r, h] * dout[r, h * Dh + d]`` is written chunk by chunk while
  ``s[r, h] = sum_d dout * head_out`` accumulates in registers; after the last chunk the logits'
  gradient follows from ``s`` and ``G`` (softmax: ``G (s - sum_j G_j s_j)``) in the same program.

So each pass reads and writes every element once: the forward reads ``head_out`` and the logits and
writes ``out``; the backward reads ``dout`` and ``head_out`` and writes both gradients. ``head_out``
and ``dout`` may have any strides (the ``transpose(1, 2)`` view of SDPA's output is read in place);
``grad_head`` is written in whatever layout the caller allocated (``head_out``'s memory order).

Block sizes come from a heuristic rather than autotuning: the op is memory-bound, and a tile of
about 4096 elements keeps loads wide while bounding registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output, empty_output_like
from .._triton import cdiv, launch, next_power_of_2, per_signature
from .checks import GATES

#: Elements per chunk (BLOCK_R x BLOCK_H x BLOCK_D).
_TILE_ELEMENTS = 4096
_MAX_BLOCK_D = 128
_MAX_BLOCK_R = 64
_GATE_CODES = {name: code for code, name in enumerate(GATES)}  # softmax 0, sigmoid 1, linear 2


def block_sizes(heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_H, BLOCK_D)``: all heads at once, feature chunks of 16..128, ~4096-element tiles."""
    block_h = next_power_of_2(heads)
    block_d = min(next_power_of_2(head_dim), _MAX_BLOCK_D, max(16, _TILE_ELEMENTS // block_h))
    block_r = max(1, min(_MAX_BLOCK_R, _TILE_ELEMENTS // (block_h * block_d)))
    return block_r, block_h, block_d


@triton.jit
def _gate_weights(gate_ptr, batch, pos, row_ok, heads, H, stride_gb, stride_gl, stride_gh, GATE: tl.constexpr):
    """``G [BLOCK_R, BLOCK_H]`` in fp32; padded heads get 0 (and no share of the softmax)."""
    head_ok = heads < H
    offsets = batch[:, None] * stride_gb + pos[:, None] * stride_gl + heads[None, :] * stride_gh
    logits = tl.load(gate_ptr + offsets, mask=row_ok[:, None] & head_ok[None, :], other=0.0).to(tl.float32)
    if GATE == 0:
        logits = tl.where(head_ok[None, :], logits, float("-inf"))
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        weights = shifted / tl.sum(shifted, axis=1)[:, None]
    elif GATE == 1:
        weights = tl.sigmoid(logits)
    else:
        weights = logits
    return tl.where(head_ok[None, :], weights, 0.0)


@triton.jit
def _mixture_of_heads_forward_kernel(
    head_ptr, gate_ptr, out_ptr,
    R, L, H, Dh,
    stride_xb, stride_xl, stride_xh, stride_xd,
    stride_gb, stride_gl, stride_gh,
    GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    row_ok, head_ok = rows < R, heads < H
    batch, pos = rows // L, rows % L
    weights = _gate_weights(gate_ptr, batch, pos, row_ok, heads, H, stride_gb, stride_gl, stride_gh, GATE)[:, :, None]
    row_head_ok = row_ok[:, None, None] & head_ok[None, :, None]
    x_rows = (batch * stride_xb + pos * stride_xl)[:, None, None] + heads[None, :, None] * stride_xh
    out_rows = rows[:, None, None] * (H * Dh) + heads[None, :, None] * Dh
    for start in range(0, Dh, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = row_head_ok & (cols < Dh)[None, None, :]
        x = tl.load(head_ptr + x_rows + cols[None, None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_rows + cols[None, None, :], (weights * x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mixture_of_heads_backward_kernel(
    grad_out_ptr, head_ptr, gate_ptr, grad_head_ptr, grad_gate_ptr,
    R, L, H, Dh,
    stride_ob, stride_ol, stride_oc,
    stride_xb, stride_xl, stride_xh, stride_xd,
    stride_gb, stride_gl, stride_gh,
    stride_db, stride_dl, stride_dh, stride_dd,
    GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    row_ok, head_ok = rows < R, heads < H
    batch, pos = rows // L, rows % L
    weights = _gate_weights(gate_ptr, batch, pos, row_ok, heads, H, stride_gb, stride_gl, stride_gh, GATE)
    row_head_ok = row_ok[:, None, None] & head_ok[None, :, None]
    dout_rows = (batch * stride_ob + pos * stride_ol)[:, None, None] + heads[None, :, None] * (Dh * stride_oc)
    x_rows = (batch * stride_xb + pos * stride_xl)[:, None, None] + heads[None, :, None] * stride_xh
    dx_rows = (batch * stride_db + pos * stride_dl)[:, None, None] + heads[None, :, None] * stride_dh
    # s[r, h] = <dout_h, head_out_h>, the gradient w.r.t. the gate weight: the row's heads stay in registers.
    grad_weights = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for start in range(0, Dh, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = row_head_ok & (cols < Dh)[None, None, :]
        dout = tl.load(grad_out_ptr + dout_rows + cols[None, None, :] * stride_oc, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(head_ptr + x_rows + cols[None, None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        grad_weights += tl.sum(dout * x, axis=2)
        grad_x = weights[:, :, None] * dout
        tl.store(grad_head_ptr + dx_rows + cols[None, None, :] * stride_dd, grad_x.to(grad_head_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    if GATE == 0:
        grad_logits = weights * (grad_weights - tl.sum(weights * grad_weights, axis=1)[:, None])
    elif GATE == 1:
        grad_logits = weights * (1.0 - weights) * grad_weights
    else:
        grad_logits = grad_weights
    tl.store(grad_gate_ptr + rows[:, None] * H + heads[None, :], grad_logits.to(grad_gate_ptr.dtype.element_ty),
             mask=row_ok[:, None] & head_ok[None, :])  # fmt: skip


@per_signature
def _launch_config(shape: tuple[int, int, int, int], gate: str) -> tuple[tuple[int], tuple[int, int, int], dict]:
    """``(grid, output shape, constexprs)`` for ``head_out`` of ``shape``."""
    batch, length, heads, head_dim = shape
    block_r, block_h, block_d = block_sizes(heads, head_dim)
    grid = (cdiv(batch * length, block_r),)
    constexprs = {"GATE": _GATE_CODES[gate], "BLOCK_R": block_r, "BLOCK_H": block_h, "BLOCK_D": block_d}
    return grid, (batch, length, heads * head_dim), constexprs


def mixture_of_heads_forward_triton(head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str) -> torch.Tensor:
    """Triton forward: ``head_out [B, L, H, Dh]``, ``gate_logits [B, L, H]`` (any strides) -> contiguous
    ``[B, L, H * Dh]`` in ``head_out.dtype``."""
    batch, length, heads, head_dim = shape = head_out.shape
    grid, out_shape, constexprs = _launch_config(shape, gate)
    out = empty_output(out_shape, dtype=head_out.dtype, device=head_out.device)
    launch(_mixture_of_heads_forward_kernel, grid)(
        head_out, gate_logits, out,
        batch * length, length, heads, head_dim,
        *head_out.stride(),
        *gate_logits.stride(),
        **constexprs,
    )  # fmt: skip
    return out


def mixture_of_heads_backward_triton(
    grad_out: torch.Tensor, head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward: ``grad_head`` (``head_out``'s dtype and memory order) and ``grad_gate_logits``
    (contiguous, ``gate_logits.dtype``) in one pass."""
    batch, length, heads, head_dim = shape = head_out.shape
    grid, _, constexprs = _launch_config(shape, gate)
    grad_head = empty_output_like(head_out, head_out.dtype)
    grad_gate = empty_output(gate_logits.shape, dtype=gate_logits.dtype, device=gate_logits.device)
    launch(_mixture_of_heads_backward_kernel, grid)(
        grad_out, head_out, gate_logits, grad_head, grad_gate,
        batch * length, length, heads, head_dim,
        *grad_out.stride(),
        *head_out.stride(),
        *gate_logits.stride(),
        *grad_head.stride(),
        **constexprs,
    )  # fmt: skip
    return grad_head, grad_gate
