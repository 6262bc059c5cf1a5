"""Tiled on-the-fly-mask Triton kernels of n-gram attention (FlashAttention-style), for short contexts.

No plan and no sort: each program compares token ids inside the kernel to build a
``[BLOCK_M, BLOCK_N]`` tile of the match pattern and multiplies it with a tile of ``h``. O(L^2 n)
compares and O(L^2 D) multiply-adds, O(L D) memory, two kernel launches (forward, backward) and no
host synchronisation. The sort path (:mod:`.kernels`) wins once L is large (see
``TILED_MAX_LENGTH`` in :mod:`.function`).

The n-gram length ``N`` is a compile-time constant: the ``N`` id comparisons of a tile are unrolled
(``tl.static_range``), so the compiler can issue the id loads of every ``k`` ahead of the compares
and keep no loop counter; each ``n`` compiles once. Tiles strictly below the diagonal (every key
before every query) skip the causal compare, which only the one or two diagonal tiles per program
need. With half-precision dots the compares, not the tensor-core dots, bound a tile (an int64
equality is two integer instructions per element and per ``k``, a dot 2 * BLOCK_D FLOPs on units
~60x faster), and every column block of ``D`` recomputes the tile: hence configs with
``BLOCK_D`` up to 256, so that ``D = 512`` rebuilds each tile 2 times rather than 8.

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
from .._triton import autotune, cdiv, launch, per_signature, size_bucket

# The first config of each list is the one the interpreter runs and a sensible default everywhere.
# Chosen from offline sm_90 compiles at n = 1..4 (registers per thread; tests/test_ngram_api.py): with
# ``N`` unrolled, the compiler issues every ``k``'s id loads up front, so a [64, 64] tile on 4 warps,
# or [128, 64] on 8, spilled 600-900 B/thread at n = 4 and is not offered. BLOCK_D = 256 halves (vs
# 128) the tile rebuilds at D = 512. The backward runs unpipelined (num_stages=1): its software
# pipelining (prefetching the next query tile's ids, counts and grad_out) spilled 600-2500 B/thread at
# n = 4, and without it every config stays at <= 244 registers and no spill.
# The forward configs that won autotune keys on an H100, and every backward config (each won somewhere):
# benchmarks/results/kernel-constants.md#n-gram-tiled-configs.
_FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 128}, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 256}, num_warps=8),
]
_BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=8, num_stages=1),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_D": 64}, num_warps=8, num_stages=1),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=8, num_stages=1),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_D": 256}, num_warps=8, num_stages=1),
]

#: Autotune key: the feature width, the power-of-two bucket of ``B * L`` (the number of programs and
#: of tiles per program both grow with it), ``N`` (compares per tile element) and the dot precision
#: (tensor-core half dots vs FMA fp32 dots favour different tiles). Triton adds the tensors' dtypes.
_KEY = ["D", "SIZE_BUCKET", "N", "HALF_DOT"]


@triton.jit
def _match_tile(ids_row, query, key, L, N: tl.constexpr, CAUSAL: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` bool: query ``i`` (its n-gram ends at i) matches key ``j`` (n-gram ends at j - 1).

    Out-of-range positions load id -1 (padding), so the range conditions of the definition
    (``i >= N - 1``, ``j >= N``, ``i, j < L``) need no compare of their own: a query with an id < 0 at
    any ``k`` is invalid, and a valid query id never equals a key's -1. ``CAUSAL``: apply ``j < i``
    (only tiles that straddle the diagonal need it).
    """
    query_ok = query < L
    for k in tl.static_range(N):
        query_id = tl.load(ids_row + query - k, mask=query_ok & (query >= k), other=-1)
        key_id = tl.load(ids_row + key - 1 - k, mask=(key < L) & (key >= k + 1), other=-1)
        query_ok = query_ok & (query_id >= 0)
        if k == 0:  # resolved at compile time: the loop is unrolled
            match = query_id[:, None] == key_id[None, :]
        else:
            match = match & (query_id[:, None] == key_id[None, :])
    if CAUSAL:
        match = match & (key[None, :] < query[:, None])
    return match & query_ok[:, None]


@triton.jit
def _forward_tile(acc, count, ids_row, h_row, query, key, cols, col_ok, L, stride_hl,
                  N: tl.constexpr, CAUSAL: tl.constexpr, HALF_DOT: tl.constexpr):  # fmt: skip
    match = _match_tile(ids_row, query, key, L, N, CAUSAL)
    values = tl.load(
        h_row + key[:, None] * stride_hl + cols[None, :], mask=(key < L)[:, None] & col_ok[None, :], other=0.0
    )
    if HALF_DOT:
        acc += tl.dot(match.to(values.dtype), values)
    else:
        acc += tl.dot(match.to(tl.float32), values.to(tl.float32), input_precision="ieee")
    count += tl.sum(match.to(tl.int32), axis=1)
    return acc, count


@autotune(_FORWARD_CONFIGS, key=_KEY)
@triton.jit
def _ngram_tiled_forward_kernel(
    h_ptr, ids_ptr, out_ptr, count_ptr,
    L, D, SIZE_BUCKET,
    stride_hb, stride_hl, stride_ob, stride_ol,
    N: tl.constexpr, HALF_DOT: tl.constexpr,
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
    # Keys j < i <= last query of the block (and j >= N: earlier keys have no preceding n-gram).
    # Tiles ending at or before the block's first query need no causal compare; the rest straddle it.
    first_query = block_m * BLOCK_M
    below_end = first_query // BLOCK_N * BLOCK_N
    for key_start in range(N // BLOCK_N * BLOCK_N, below_end, BLOCK_N):
        key = key_start + tl.arange(0, BLOCK_N)
        acc, count = _forward_tile(acc, count, ids_row, h_row, query, key, cols, col_ok, L, stride_hl,
                                   N, False, HALF_DOT)  # fmt: skip
    for key_start in range(below_end, tl.minimum(first_query + BLOCK_M, L), BLOCK_N):
        key = key_start + tl.arange(0, BLOCK_N)
        acc, count = _forward_tile(acc, count, ids_row, h_row, query, key, cols, col_ok, L, stride_hl,
                                   N, True, HALF_DOT)  # fmt: skip
    mean = tl.where((count > 0)[:, None], acc / tl.maximum(count, 1).to(tl.float32)[:, None], 0.0)
    query_ok = query < L
    tl.store(
        out_ptr + row * stride_ob + query[:, None] * stride_ol + cols[None, :],
        mean.to(out_ptr.dtype.element_ty),
        mask=query_ok[:, None] & col_ok[None, :],
    )
    if block_d == 0:
        tl.store(count_ptr + row * L + query, count, mask=query_ok)


@triton.jit
def _backward_tile(acc, ids_row, count_row, grad_out_row, query, key, cols, col_ok, L, stride_gl,
                   N: tl.constexpr, CAUSAL: tl.constexpr, HALF_DOT: tl.constexpr):  # fmt: skip
    match = _match_tile(ids_row, query, key, L, N, CAUSAL)
    count = tl.load(count_row + query, mask=query < L, other=0)
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
    return acc


@autotune(_BACKWARD_CONFIGS, key=_KEY)
@triton.jit
def _ngram_tiled_backward_kernel(
    grad_out_ptr, ids_ptr, count_ptr, grad_h_ptr,
    L, D, SIZE_BUCKET,
    stride_gb, stride_gl, stride_hb, stride_hl,
    N: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    block_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    block_d = tl.program_id(2)
    key = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = block_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ids_row = ids_ptr + row * L
    count_row = count_ptr + row * L
    grad_out_row = grad_out_ptr + row * stride_gb
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Queries i > j >= first key of the block. Query tiles starting after the block's last key need
    # no causal compare; the ones before straddle the diagonal.
    first_key = block_n * BLOCK_N
    above_start = tl.cdiv(first_key + BLOCK_N, BLOCK_M) * BLOCK_M
    for query_start in range(first_key // BLOCK_M * BLOCK_M, tl.minimum(above_start, L), BLOCK_M):
        query = query_start + tl.arange(0, BLOCK_M)
        acc = _backward_tile(acc, ids_row, count_row, grad_out_row, query, key, cols, col_ok, L, stride_gl,
                             N, True, HALF_DOT)  # fmt: skip
    for query_start in range(above_start, L, BLOCK_M):
        query = query_start + tl.arange(0, BLOCK_M)
        acc = _backward_tile(acc, ids_row, count_row, grad_out_row, query, key, cols, col_ok, L, stride_gl,
                             N, False, HALF_DOT)  # fmt: skip
    tl.store(
        grad_h_ptr + row * stride_hb + key[:, None] * stride_hl + cols[None, :],
        acc.to(grad_h_ptr.dtype.element_ty),
        mask=(key < L)[:, None] & col_ok[None, :],
    )


def _half_dot(dtype: torch.dtype) -> bool:
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not triton_interpreter_enabled()


@per_signature
def _launch_config(shape: tuple[int, int, int], dtype: torch.dtype, n: int) -> tuple[object, object, int, dict]:
    """``(forward grid, backward grid, size bucket, constexprs)`` of the tiled kernels for ``[B, L, D]``."""
    batch, length, dim = shape

    def forward_grid(meta):
        return (cdiv(length, meta["BLOCK_M"]), batch, cdiv(dim, meta["BLOCK_D"]))

    def backward_grid(meta):
        return (cdiv(length, meta["BLOCK_N"]), batch, cdiv(dim, meta["BLOCK_D"]))

    return forward_grid, backward_grid, size_bucket(batch * length), {"N": int(n), "HALF_DOT": _half_dot(dtype)}


def ngram_tiled_forward_triton(h: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [B, L, D]``, ``ids [B, L]``, ``n >= 1`` -> (output ``[B, L, D]``, match count per query ``[B, L]`` int32).

    ``n`` is a compile-time constant of the kernel (one compile per distinct ``n``)."""
    h, ids = h.contiguous(), ids.contiguous()
    batch, length, dim = shape = h.shape
    grid, _, bucket, constexprs = _launch_config(shape, h.dtype, n)
    out = empty_output(shape, dtype=h.dtype, device=h.device)
    count = empty_output((batch, length), dtype=torch.int32, device=h.device)
    launch(_ngram_tiled_forward_kernel, grid)(
        h, ids, out, count,
        length, dim, bucket,
        h.stride(0), h.stride(1), out.stride(0), out.stride(1),
        **constexprs,
    )  # fmt: skip
    return out, count


def ngram_tiled_backward_triton(grad_out: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """Gradient w.r.t. ``h`` ``[B, L, D]`` from ``grad_out [B, L, D]``, ``ids [B, L]``, the forward's match
    counts ``count [B, L]`` and ``n``."""
    grad_out, ids = grad_out.contiguous(), ids.contiguous()
    batch, length, dim = shape = grad_out.shape
    _, grid, bucket, constexprs = _launch_config(shape, grad_out.dtype, n)
    grad_h = empty_output(shape, dtype=grad_out.dtype, device=grad_out.device)
    launch(_ngram_tiled_backward_kernel, grid)(
        grad_out, ids, count.contiguous(), grad_h,
        length, dim, bucket,
        grad_out.stride(0), grad_out.stride(1), grad_h.stride(0), grad_h.stride(1),
        **constexprs,
    )  # fmt: skip
    return grad_h
