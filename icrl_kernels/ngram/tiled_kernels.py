"""Tiled on-the-fly-mask Triton kernels of n-gram attention (FlashAttention-style), for short contexts.

No plan and no sort: each program compares token ids inside the kernel to build a
``[BLOCK_M, BLOCK_N]`` tile of the match pattern and multiplies it with a tile of ``h``. O(L^2 n)
compares and O(L^2 D) multiply-adds, O(L D) memory, two kernel launches (forward, backward) and no
host synchronisation. The sort path (:mod:`.kernels`) wins once L is large.

Precision: the pattern is 0/1, so a half-precision ``tl.dot`` of the pattern with fp16/bf16 ``h``
accumulating in fp32 is exact. The backward multiplies by ``grad_out / count``, an fp32 value; it is
split into a half-precision high part and the half-precision remainder (two dots), which keeps
about 16 bits of mantissa. fp32 inputs use IEEE fp32 dots. Triton's CPU interpreter computes bf16
dots wrongly, so under the interpreter bf16 tiles are upcast to fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .._library import empty_output
from .._triton import autotune, launch

_FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=8),
]
_BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_D": 64}, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=8),
]


@triton.jit
def _match_tile(ids_row, query, key, L, n):
    """``[BLOCK_M, BLOCK_N]`` bool: query ``i`` (its n-gram ends at i) matches key ``j`` (n-gram ends at j - 1)."""
    match = (key[None, :] < query[:, None]) & (key[None, :] >= n) & (query[:, None] < L)
    for k in range(0, n):
        query_id = tl.load(ids_row + query - k, mask=(query - k >= 0) & (query < L), other=-1)
        key_id = tl.load(ids_row + key - 1 - k, mask=(key - 1 - k >= 0) & (key < L), other=-1)
        match = match & (query_id[:, None] == key_id[None, :]) & (query_id >= 0)[:, None]
    return match


@autotune(_FORWARD_CONFIGS, key=["D"])
@triton.jit
def _ngram_tiled_forward_kernel(
    h_ptr, ids_ptr, out_ptr, count_ptr,
    L, D, n,
    stride_hb, stride_hl, stride_ob, stride_ol,
    HALF_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    block_m = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    block_d = tl.program_id(2)
    query = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ids_row = ids_ptr + row * L
    h_row = h_ptr + row * stride_hb
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_M], dtype=tl.int32)
    # Keys j < i <= last query of the block.
    for key_start in range(0, (block_m + 1) * BLOCK_M, BLOCK_N):
        key = key_start + tl.arange(0, BLOCK_N)
        match = _match_tile(ids_row, query, key, L, n)
        values = tl.load(
            h_row + key[:, None] * stride_hl + cols[None, :],
            mask=(key < L)[:, None] & col_ok[None, :],
            other=0.0,
        )
        if HALF_DOT:
            acc += tl.dot(match.to(values.dtype), values)
        else:
            acc += tl.dot(match.to(tl.float32), values.to(tl.float32), input_precision="ieee")
        count += tl.sum(match.to(tl.int32), axis=1)
    mean = tl.where((count > 0)[:, None], acc / tl.maximum(count, 1).to(tl.float32)[:, None], 0.0)
    query_ok = query < L
    tl.store(
        out_ptr + row * stride_ob + query[:, None] * stride_ol + cols[None, :],
        mean.to(out_ptr.dtype.element_ty),
        mask=query_ok[:, None] & col_ok[None, :],
    )
    if block_d == 0:
        tl.store(count_ptr + row * L + query, count, mask=query_ok)


@autotune(_BACKWARD_CONFIGS, key=["D"])
@triton.jit
def _ngram_tiled_backward_kernel(
    grad_out_ptr, ids_ptr, count_ptr, grad_h_ptr,
    L, D, n,
    stride_gb, stride_gl, stride_hb, stride_hl,
    HALF_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    block_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    block_d = tl.program_id(2)
    key = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = block_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ids_row = ids_ptr + row * L
    grad_out_row = grad_out_ptr + row * stride_gb
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Queries i > j >= first key of the block.
    for query_start in range((block_n * BLOCK_N) // BLOCK_M * BLOCK_M, L, BLOCK_M):
        query = query_start + tl.arange(0, BLOCK_M)
        match = _match_tile(ids_row, query, key, L, n)
        count = tl.load(count_ptr + row * L + query, mask=query < L, other=0)
        grad = tl.load(
            grad_out_row + query[:, None] * stride_gl + cols[None, :],
            mask=((query < L) & (count > 0))[:, None] & col_ok[None, :],
            other=0.0,
        )
        weights = grad.to(tl.float32) / tl.maximum(count, 1).to(tl.float32)[:, None]
        if HALF_DOT:
            high = weights.to(grad.dtype)
            low = (weights - high.to(tl.float32)).to(grad.dtype)
            pattern_t = tl.trans(match.to(grad.dtype))
            acc += tl.dot(pattern_t, high)
            acc += tl.dot(pattern_t, low)
        else:
            acc += tl.dot(tl.trans(match.to(tl.float32)), weights, input_precision="ieee")
    tl.store(
        grad_h_ptr + row * stride_hb + key[:, None] * stride_hl + cols[None, :],
        acc.to(grad_h_ptr.dtype.element_ty),
        mask=(key < L)[:, None] & col_ok[None, :],
    )


def _half_dot(dtype: torch.dtype) -> bool:
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not triton_interpreter_enabled()


def ngram_tiled_forward_triton(h: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [B, L, D]``, ``ids [B, L]`` -> (output ``[B, L, D]``, match count per query ``[B, L]`` int32)."""
    h, ids = h.contiguous(), ids.contiguous()
    batch, length, dim = h.shape
    out = empty_output(h.shape, dtype=h.dtype, device=h.device)
    count = empty_output((batch, length), dtype=torch.int32, device=h.device)

    def grid(meta):
        return (triton.cdiv(length, meta["BLOCK_M"]), batch, triton.cdiv(dim, meta["BLOCK_D"]))

    launch(_ngram_tiled_forward_kernel, grid)(
        h, ids, out, count,
        length, dim, n,
        h.stride(0), h.stride(1), out.stride(0), out.stride(1),
        HALF_DOT=_half_dot(h.dtype),
    )  # fmt: skip
    return out, count


def ngram_tiled_backward_triton(grad_out: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """Gradient w.r.t. ``h`` from ``grad_out [B, L, D]``, ``ids`` and the forward's match counts."""
    grad_out, ids = grad_out.contiguous(), ids.contiguous()
    batch, length, dim = grad_out.shape
    grad_h = empty_output(grad_out.shape, dtype=grad_out.dtype, device=grad_out.device)

    def grid(meta):
        return (triton.cdiv(length, meta["BLOCK_N"]), batch, triton.cdiv(dim, meta["BLOCK_D"]))

    launch(_ngram_tiled_backward_kernel, grid)(
        grad_out, ids, count.contiguous(), grad_h,
        length, dim, n,
        grad_out.stride(0), grad_out.stride(1), grad_h.stride(0), grad_h.stride(1),
        HALF_DOT=_half_dot(grad_out.dtype),
    )  # fmt: skip
    return grad_h
