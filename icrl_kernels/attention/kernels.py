"""Triton kernels of gated, smeared causal attention: a flash-attention forward and backward.

Layout: ``q, k, v [B, H, L, Dh]`` (any strides), output ``[B, L, H * Dh]`` contiguous (heads merged, as
``mixture_of_heads`` writes them), gate logits ``[B, L, H]`` (any strides), smearing logits ``[H]``.

Forward (one program per ``BLOCK_M`` queries of one ``(b, h)``; the longest causal rows start first):

* prologue, ``SMEAR``: each key tile is smeared as it is loaded, ``k'_j = s k_j + (1 - s) k_{j-1}``
  (``s = sigmoid(alpha_h)``, ``k_{-1} = 0``): the tile's rows ``j - 1`` are a second load of the same
  rows shifted by one, all but the first row already in cache, so the smeared keys never reach memory;
* the online softmax of the FlashAttention papers in base 2 (scores scaled by ``Dh**-0.5 * log2(e)``),
  fp32 statistics and accumulator, fp16/bf16 tiles fed to ``tl.dot`` in their own dtype (fp32 inputs
  use ``tf32x3`` dots, about fp32 accuracy, for tests); key blocks past the causal diagonal are skipped;
* epilogue, ``GATE``: the row's gate weight of this head (softmax over all ``H`` logits of the row,
  loaded and normalised in the program; sigmoid; linear) scales the normalised output before the
  single store, so the ungated head outputs never reach memory. The row's log-sum-exp is saved.

Backward, three kernels and the smearing's own backward:

1. ``preprocess`` (one program per ``BLOCK_R`` rows, all heads): ``D_h = <dY_h, Y_h>`` per (row, head)
   (FlashAttention's ``rowsum(dO * O)``, since ``<G dY, O> = <dY, G O>``), the gate weight ``G_h``, and
   for the softmax and sigmoid gates the logits' gradient (``D_h - G_h sum_j D_j``, ``(1 - G_h) D_h``);
2. ``dkdv`` (one program per ``BLOCK_N`` keys): ``dV``, ``dK'`` over the query blocks at or after the
   keys, with ``dO = G dY`` formed on load;
3. ``dq`` (one program per ``BLOCK_M`` queries): ``dQ`` over the key blocks up to the diagonal; for the
   linear gate it also recomputes ``O_h = P V`` and writes ``d logit_h = <dY_h, O_h>`` (``D_h / G_h``
   would divide by zero where a linear gate is 0);
4. with smearing, ``dK'`` goes through ``smeared_keys``' backward kernel (``dk_j = s dk'_j + (1 - s)
   dk'_{j+1}`` and the ``alpha`` gradient): ``dK'`` is written once and read once more, and ``k`` read once
   more, an extra ``3 B H L Dh`` elements of traffic (see :mod:`.cost`).

Every block size is a power of two >= 16 (``tl.dot`` needs 16), head widths that are not are padded
with masks; ``L`` need not be a multiple of any block.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreter_enabled
from .._library import empty_output
from .._triton import autotune, cdiv, launch, next_power_of_2, per_signature, size_bucket
from ..moa.checks import GATES
from ..moa.kernels import _gate_weights
from ..smeared.kernels import smeared_keys_backward_triton

#: softmax 0, sigmoid 1, linear 2 (as ``mixture_of_heads``' kernels), no gate 3.
GATE_CODES = {**{name: code for code, name in enumerate(GATES)}, None: len(GATES)}
_LOG2E = 1.4426950408889634

#: The first config is the interpreter's (and a sensible default); the others are for the GPU autotuner.
_FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=2),
]
#: The backward passes walk the other side in 32-row steps where the accumulators are large (dk and dv,
#: or dq, stay in registers for the whole loop): with 64-row steps and 4 warps, Dh = 128 spilled ~400 B
#: (and dkdv's 64 x 128 tile in 8 warps 264 B under Triton 3.6, the GPU image's).
_DQ_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
]
_DKDV_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3),
]
#: fp32 inputs (tests) skip the autotuner and launch one small tile: tf32x3 dots keep fp32 operands, twice
#: the registers of bf16 ones, and the bf16 tiles above spilled up to 1.5 KB per thread (and asked for up to
#: 384 KB of shared memory) at Dh = 128; 32 x 32 tiles compile with at most ~100 B of spills at Dh <= 128.
FP32_TILES = {
    "forward": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
}
#: Elements per chunk of the preprocess kernel (BLOCK_R x BLOCK_H x BLOCK_D), as ``mixture_of_heads``.
_TILE_ELEMENTS = 4096


def head_block(head_dim: int) -> int:
    """``BLOCK_D``: the head width padded to a power of two, at least 16 (every ``tl.dot`` dim >= 16)."""
    return max(16, next_power_of_2(head_dim))


@triton.jit
def _load_keys(k_head, cols, dims, L, Dh, weight, stride_kl, stride_kd, SMEAR: tl.constexpr):
    """Key tile ``[BLOCK_N, BLOCK_D]`` in fp32 at positions ``cols``: smeared with ``weight`` when ``SMEAR``
    (``w k_j + (1 - w) k_{j-1}``, zero before position 0); zero outside the tensor."""
    col_ok = cols < L
    dim_ok = dims < Dh
    offsets = cols[:, None] * stride_kl + dims[None, :] * stride_kd
    keys = tl.load(k_head + offsets, mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    if SMEAR:
        has_previous = col_ok & (cols > 0)
        previous = tl.load(k_head + offsets - stride_kl, mask=has_previous[:, None] & dim_ok[None, :], other=0.0)
        keys = weight * keys + (1.0 - weight) * previous.to(tl.float32)
    return keys


@triton.jit
def _operand(x, HALF_DOT: tl.constexpr, DTYPE: tl.constexpr):
    """``x`` (fp32) as a ``tl.dot`` operand: in the input dtype ``DTYPE`` (``HALF_DOT`` 1: fp16/bf16 tensor
    cores; loop-invariant tiles are cast once, which also halves their registers), fp32 (0: fp32 inputs),
    or rounded to ``DTYPE`` and kept in fp32 (2: bf16 under the CPU interpreter, whose bf16 dots are wrong;
    the GPU's rounding with exact products)."""
    # One return statement: the compiler checks every return's type, constexpr branches included.
    if HALF_DOT == 1:
        x = x.to(DTYPE)
    if HALF_DOT == 2:
        x = x.to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _dot(a, b, HALF_DOT: tl.constexpr, DTYPE: tl.constexpr):
    """``a @ b`` with fp32 accumulation, operands cast by :func:`_operand` (a no-op for tiles already cast).
    fp32 inputs use ``tf32x3`` (three TF32 tensor-core products, about fp32 accuracy: IEEE fp32 dots run
    on FMA units and spilled kilobytes per thread at these tiles)."""
    a = _operand(a, HALF_DOT, DTYPE)
    b = _operand(b, HALF_DOT, DTYPE)
    if HALF_DOT == 1:
        product = tl.dot(a, b)
    else:
        product = tl.dot(a, b, input_precision="tf32x3")
    return product


@triton.jit
def _smear_weight(alpha_ptr, head, SMEAR: tl.constexpr):
    """``sigmoid(alpha[head])`` in fp32 when ``SMEAR`` (else an unused 1)."""
    weight = 1.0
    if SMEAR:
        weight = tl.sigmoid(tl.load(alpha_ptr + head).to(tl.float32))
    return weight


@autotune(_FORWARD_CONFIGS, key=["Dh", "SIZE_BUCKET"])
@triton.jit
def _gated_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, gate_ptr, alpha_ptr, out_ptr, lse_ptr,
    H, L, Dh, qk_scale,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_gb, stride_gl, stride_gh,
    SIZE_BUCKET,
    GATE: tl.constexpr, SMEAR: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # The last query blocks see the most keys: launch them first so the tail of the grid is short work.
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // H, batch_head % H
    rows = block_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < L, dims < Dh
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    q_offsets = batch * stride_qb + head * stride_qh + rows[:, None] * stride_ql + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    q = _operand(q, HALF_DOT, DTYPE)
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    v_head = v_ptr + batch * stride_vb + head * stride_vh
    weight = _smear_weight(alpha_ptr, head, SMEAR)

    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Causal: keys up to the block's last query. Key 0 is in every row's first block, so no row's maximum
    # stays -inf after it (padding rows past L included), and exp2(-inf - max) is 0, never NaN.
    end = tl.minimum((block_m + 1) * BLOCK_M, L)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        keys = _load_keys(k_head, cols, dims, L, Dh, weight, stride_kl, stride_kd, SMEAR)
        scores = _dot(q, tl.trans(keys), HALF_DOT, DTYPE) * qk_scale
        visible = (cols[None, :] <= rows[:, None]) & (cols < L)[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v_offsets = cols[:, None] * stride_vl + dims[None, :] * stride_vd
        values = tl.load(v_head + v_offsets, mask=(cols < L)[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + _dot(probs, values, HALF_DOT, DTYPE)
        row_max = new_max
    out = acc / row_sum[:, None]

    if GATE != 3:  # the epilogue gate: this head's weight in each row
        if GATE == 0:  # softmax over the row's H logits (padded heads at -inf take no share)
            heads = tl.arange(0, BLOCK_H)
            head_ok = heads < H
            gate_offsets = batch * stride_gb + rows[:, None] * stride_gl + heads[None, :] * stride_gh
            logits = tl.load(gate_ptr + gate_offsets, mask=row_ok[:, None] & head_ok[None, :], other=0.0)
            logits = tl.where(head_ok[None, :], logits.to(tl.float32), float("-inf"))
            shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            own = tl.sum(tl.where(heads[None, :] == head, shifted, 0.0), axis=1)
            gates = own / tl.sum(shifted, axis=1)
        else:
            logit = tl.load(gate_ptr + batch * stride_gb + rows * stride_gl + head * stride_gh, mask=row_ok, other=0.0)
            gates = tl.sigmoid(logit.to(tl.float32)) if GATE == 1 else logit.to(tl.float32)
        out = out * gates[:, None]

    out_offsets = (batch * L + rows)[:, None] * (H * Dh) + head * Dh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + batch_head * L + rows, row_max + tl.math.log2(row_sum), mask=row_ok)


@triton.jit
def _gated_attention_backward_preprocess_kernel(
    grad_out_ptr, out_ptr, gate_ptr, delta_ptr, weight_ptr, grad_gate_ptr,
    R, L, H, Dh,
    stride_ob, stride_ol, stride_oc,
    stride_gb, stride_gl, stride_gh,
    GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    row_ok, head_ok = rows < R, heads < H
    batch, pos = rows // L, rows % L
    row_head_ok = row_ok[:, None, None] & head_ok[None, :, None]
    dout_rows = (batch * stride_ob + pos * stride_ol)[:, None, None] + heads[None, :, None] * (Dh * stride_oc)
    out_rows = rows[:, None, None] * (H * Dh) + heads[None, :, None] * Dh
    delta = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for start in range(0, Dh, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = row_head_ok & (cols < Dh)[None, None, :]
        dout = tl.load(grad_out_ptr + dout_rows + cols[None, None, :] * stride_oc, mask=mask, other=0.0).to(tl.float32)
        out = tl.load(out_ptr + out_rows + cols[None, None, :], mask=mask, other=0.0).to(tl.float32)
        delta += tl.sum(dout * out, axis=2)
    # [B, H, L] layouts for the attention kernels, which read one head's rows at a time.
    bhl = (batch * H * L + pos)[:, None] + heads[None, :] * L
    store_ok = row_ok[:, None] & head_ok[None, :]
    tl.store(delta_ptr + bhl, delta, mask=store_ok)
    if GATE != 3:
        weights = _gate_weights(gate_ptr, batch, pos, row_ok, heads, H, stride_gb, stride_gl, stride_gh, GATE)
        tl.store(weight_ptr + bhl, weights, mask=store_ok)
        # With D_h = <dY_h, Y_h> = G_h dG_h: no division by G (exact where a weight underflows to 0).
        if GATE == 0:
            grad_logits = delta - weights * tl.sum(delta, axis=1)[:, None]
            tl.store(grad_gate_ptr + rows[:, None] * H + heads[None, :], grad_logits.to(grad_gate_ptr.dtype.element_ty),
                     mask=store_ok)  # fmt: skip
        elif GATE == 1:
            grad_logits = (1.0 - weights) * delta
            tl.store(grad_gate_ptr + rows[:, None] * H + heads[None, :], grad_logits.to(grad_gate_ptr.dtype.element_ty),
                     mask=store_ok)  # fmt: skip


@triton.jit
def _load_grad_rows(grad_out_ptr, weight_ptr, batch, head, batch_head, rows, dims, L, Dh,
                    stride_ob, stride_ol, stride_oc, GATE: tl.constexpr):  # fmt: skip
    """``dO = G dY`` for one head's ``rows`` in fp32 ``[BLOCK_M, BLOCK_D]``, and ``dY`` itself."""
    row_ok = rows < L
    offsets = batch * stride_ob + rows[:, None] * stride_ol + (head * Dh + dims[None, :]) * stride_oc
    grad = tl.load(grad_out_ptr + offsets, mask=row_ok[:, None] & (dims < Dh)[None, :], other=0.0).to(tl.float32)
    grad_o = grad
    if GATE != 3:
        grad_o = grad * tl.load(weight_ptr + batch_head * L + rows, mask=row_ok, other=0.0)[:, None]
    return grad_o, grad


@autotune(_DKDV_CONFIGS, key=["Dh", "SIZE_BUCKET"])
@triton.jit
def _gated_attention_backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, alpha_ptr, grad_out_ptr, weight_ptr, lse_ptr, delta_ptr, grad_k_ptr, grad_v_ptr,
    H, L, Dh, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ob, stride_ol, stride_oc,
    SIZE_BUCKET,
    GATE: tl.constexpr, SMEAR: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    block_n = tl.program_id(0)  # the first key blocks see the most queries, and are launched first
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // H, batch_head % H
    cols = block_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok, dim_ok = cols < L, dims < Dh
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    weight = _smear_weight(alpha_ptr, head, SMEAR)
    keys = _load_keys(k_ptr + batch * stride_kb + head * stride_kh, cols, dims, L, Dh, weight, stride_kl, stride_kd,
                      SMEAR)  # fmt: skip
    v_offsets = batch * stride_vb + head * stride_vh + cols[:, None] * stride_vl + dims[None, :] * stride_vd
    values = tl.load(v_ptr + v_offsets, mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    keys, values = _operand(keys, HALF_DOT, DTYPE), _operand(values, HALF_DOT, DTYPE)
    q_head = q_ptr + batch * stride_qb + head * stride_qh
    grad_k = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    grad_v = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Queries at or after the block's first key (causal), from the query block holding it.
    for start in range((block_n * BLOCK_N // BLOCK_M) * BLOCK_M, L, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        q_offsets = rows[:, None] * stride_ql + dims[None, :] * stride_qd
        q = tl.load(q_head + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        grad_o, _ = _load_grad_rows(grad_out_ptr, weight_ptr, batch, head, batch_head, rows, dims, L, Dh,
                                    stride_ob, stride_ol, stride_oc, GATE)  # fmt: skip
        lse = tl.load(lse_ptr + batch_head * L + rows, mask=row_ok, other=float("inf"))  # padding rows: p = 0
        delta = tl.load(delta_ptr + batch_head * L + rows, mask=row_ok, other=0.0)
        scores_t = _dot(keys, tl.trans(q), HALF_DOT, DTYPE) * qk_scale  # [BLOCK_N, BLOCK_M]
        visible = (cols[:, None] <= rows[None, :]) & row_ok[None, :] & col_ok[:, None]
        probs_t = tl.where(visible, tl.math.exp2(scores_t - lse[None, :]), 0.0)
        grad_v += _dot(probs_t, grad_o, HALF_DOT, DTYPE)
        grad_probs_t = _dot(values, tl.trans(grad_o), HALF_DOT, DTYPE)
        grad_scores_t = probs_t * (grad_probs_t - delta[None, :])
        grad_k += _dot(grad_scores_t, q, HALF_DOT, DTYPE)
    out_offsets = batch_head * L * Dh + cols[:, None] * Dh + dims[None, :]
    store_ok = col_ok[:, None] & dim_ok[None, :]
    tl.store(grad_k_ptr + out_offsets, (grad_k * sm_scale).to(grad_k_ptr.dtype.element_ty), mask=store_ok)
    tl.store(grad_v_ptr + out_offsets, grad_v.to(grad_v_ptr.dtype.element_ty), mask=store_ok)


@autotune(_DQ_CONFIGS, key=["Dh", "SIZE_BUCKET"])
@triton.jit
def _gated_attention_backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, alpha_ptr, grad_out_ptr, weight_ptr, lse_ptr, delta_ptr, grad_q_ptr, grad_gate_ptr,
    H, L, Dh, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ob, stride_ol, stride_oc,
    SIZE_BUCKET,
    GATE: tl.constexpr, SMEAR: tl.constexpr, HALF_DOT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    batch_head = tl.program_id(1).to(tl.int64)
    batch, head = batch_head // H, batch_head % H
    rows = block_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < L, dims < Dh
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    weight = _smear_weight(alpha_ptr, head, SMEAR)
    q_offsets = batch * stride_qb + head * stride_qh + rows[:, None] * stride_ql + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    grad_o, _ = _load_grad_rows(grad_out_ptr, weight_ptr, batch, head, batch_head, rows, dims, L, Dh,
                                stride_ob, stride_ol, stride_oc, GATE)  # fmt: skip
    q, grad_o = _operand(q, HALF_DOT, DTYPE), _operand(grad_o, HALF_DOT, DTYPE)
    lse = tl.load(lse_ptr + batch_head * L + rows, mask=row_ok, other=float("inf"))  # padding rows: p = 0
    delta = tl.load(delta_ptr + batch_head * L + rows, mask=row_ok, other=0.0)
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    v_head = v_ptr + batch * stride_vb + head * stride_vh
    grad_q = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    out = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # the ungated O_h, for the linear gate only
    end = tl.minimum((block_m + 1) * BLOCK_M, L)  # up to the diagonal
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        keys = _load_keys(k_head, cols, dims, L, Dh, weight, stride_kl, stride_kd, SMEAR)
        v_offsets = cols[:, None] * stride_vl + dims[None, :] * stride_vd
        values = tl.load(v_head + v_offsets, mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        scores = _dot(q, tl.trans(keys), HALF_DOT, DTYPE) * qk_scale
        visible = (cols[None, :] <= rows[:, None]) & col_ok[None, :] & row_ok[:, None]
        probs = tl.where(visible, tl.math.exp2(scores - lse[:, None]), 0.0)
        grad_probs = _dot(grad_o, tl.trans(values), HALF_DOT, DTYPE)
        grad_scores = probs * (grad_probs - delta[:, None])
        grad_q += _dot(grad_scores, keys, HALF_DOT, DTYPE)
        if GATE == 2:
            out += _dot(probs, values, HALF_DOT, DTYPE)
    out_offsets = batch_head * L * Dh + rows[:, None] * Dh + dims[None, :]
    tl.store(grad_q_ptr + out_offsets, (grad_q * sm_scale).to(grad_q_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip
    if GATE == 2:  # linear gate: d logit_h = d G_h = <dY_h, O_h> (dY reloaded: no registers held in the loop)
        _, grad_y = _load_grad_rows(grad_out_ptr, weight_ptr, batch, head, batch_head, rows, dims, L, Dh,
                                    stride_ob, stride_ol, stride_oc, GATE)  # fmt: skip
        grad_logit = tl.sum(grad_y * out, axis=1)
        tl.store(grad_gate_ptr + (batch * L + rows) * H + head, grad_logit.to(grad_gate_ptr.dtype.element_ty),
                 mask=row_ok)  # fmt: skip


def _tiled_kernel(kernel, tiles: str, dtype: torch.dtype) -> tuple[object, dict]:
    """``(what to launch, its extra launch arguments)``: an autotuned attention kernel as it is, or for fp32
    inputs the kernel under the autotuner with ``FP32_TILES[tiles]``."""
    if dtype == torch.float32:
        return kernel.fn, dict(FP32_TILES[tiles])
    return kernel, {}


def _preprocess_blocks(heads: int, head_dim: int) -> dict:
    block_h = next_power_of_2(heads)
    block_d = min(next_power_of_2(head_dim), 128, max(16, _TILE_ELEMENTS // block_h))
    block_r = max(1, min(64, _TILE_ELEMENTS // (block_h * block_d)))
    return {"BLOCK_R": block_r, "BLOCK_H": block_h, "BLOCK_D": block_d}


def half_dot(dtype: torch.dtype) -> int:
    """``HALF_DOT`` of the kernels for inputs of ``dtype`` (see ``_dot``)."""
    if dtype == torch.float32:
        return 0
    return 2 if dtype == torch.bfloat16 and triton_interpreter_enabled() else 1


def _row_grid(length: int, batch_heads: int, block: str):
    """The grid of a kernel with one program per ``meta[block]`` rows of each ``(b, h)``."""

    def grid(meta):
        return cdiv(length, meta[block]), batch_heads

    return grid


class _Config(NamedTuple):
    """A launch's kernel (or the kernel under its autotuner), grid and constexprs, computed per signature."""

    kernel: object
    grid: object
    constexprs: dict


@per_signature
def _forward_config(
    shape: tuple[int, int, int, int], dtype: torch.dtype, gate: str | None, smear: bool
) -> tuple[_Config, tuple[int, int, int], float, int]:
    """The forward's launch, output shape ``[B, L, H * Dh]``, scaled ``qk_scale`` and size bucket."""
    batch, heads, length, head_dim = shape
    kernel, fixed = _tiled_kernel(_gated_attention_forward_kernel, "forward", dtype)
    constexprs = {"BLOCK_H": next_power_of_2(heads), "BLOCK_D": head_block(head_dim), "GATE": GATE_CODES[gate],
                  "SMEAR": smear, "HALF_DOT": half_dot(dtype), **fixed}  # fmt: skip
    launch_config = _Config(kernel, _row_grid(length, batch * heads, "BLOCK_M"), constexprs)
    return launch_config, (batch, length, heads * head_dim), head_dim**-0.5 * _LOG2E, size_bucket(length)


@per_signature
def _backward_config(
    shape: tuple[int, int, int, int], dtype: torch.dtype, gate: str | None, smear: bool
) -> tuple[_Config, _Config, _Config, float, int]:
    """The backward's three launches (preprocess, dk/dv, dq), ``sm_scale`` and size bucket."""
    batch, heads, length, head_dim = shape
    flags = {"GATE": GATE_CODES[gate], "SMEAR": smear, "HALF_DOT": half_dot(dtype)}
    blocks = _preprocess_blocks(heads, head_dim)
    preprocess = _Config(
        _gated_attention_backward_preprocess_kernel,
        (cdiv(batch * length, blocks["BLOCK_R"]),),
        {"GATE": flags["GATE"], **blocks},
    )
    launches = []
    for kernel, tiles, block in ((_gated_attention_backward_dkdv_kernel, "dkdv", "BLOCK_N"),
                                 (_gated_attention_backward_dq_kernel, "dq", "BLOCK_M")):  # fmt: skip
        kernel, fixed = _tiled_kernel(kernel, tiles, dtype)
        constexprs = {**flags, "BLOCK_D": head_block(head_dim), **fixed}
        launches.append(_Config(kernel, _row_grid(length, batch * heads, block), constexprs))
    return preprocess, *launches, head_dim**-0.5, size_bucket(length)


def gated_attention_forward_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None,
    smear_alpha: torch.Tensor | None,
    gate: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(out [B, L, H * Dh] contiguous in q.dtype, lse [B, H, L] fp32)``; ``lse`` is the
    base-2 log-sum-exp of each row's scaled scores (``log2 sum_j 2^(s_j Dh**-0.5 log2 e)``)."""
    batch, heads, length, head_dim = shape = q.shape
    gated = gate_logits is not None
    config, out_shape, qk_scale, bucket = _forward_config(
        shape, q.dtype, gate if gated else None, smear_alpha is not None
    )
    out = empty_output(out_shape, dtype=q.dtype, device=q.device)
    lse = empty_output((batch, heads, length), dtype=torch.float32, device=q.device)
    launch(config.kernel, config.grid)(
        q, k, v, gate_logits if gated else q, smear_alpha.contiguous() if smear_alpha is not None else q, out, lse,
        heads, length, head_dim, qk_scale,
        *q.stride(), *k.stride(), *v.stride(), *(gate_logits.stride() if gated else (0, 0, 0)),
        bucket,
        **config.constexprs,
    )  # fmt: skip
    return out, lse


def gated_attention_backward_triton(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None,
    smear_alpha: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    gate: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Triton backward: ``(dq, dk, dv)`` contiguous ``[B, H, L, Dh]`` in ``q.dtype``, ``d gate_logits``
    (contiguous, ``gate_logits.dtype``) and ``d smear_alpha`` (``smear_alpha.dtype``), None where absent."""
    batch, heads, length, head_dim = shape = q.shape
    gated, smeared = gate_logits is not None, smear_alpha is not None
    preprocess, dkdv, dq, sm_scale, bucket = _backward_config(shape, q.dtype, gate if gated else None, smeared)
    device = q.device
    delta = empty_output((batch, heads, length), dtype=torch.float32, device=device)
    weights = empty_output((batch, heads, length), dtype=torch.float32, device=device) if gated else delta
    grad_gate = empty_output(gate_logits.shape, dtype=gate_logits.dtype, device=device) if gated else None
    gate_arg = gate_logits if gated else q
    gate_strides = gate_logits.stride() if gated else (0, 0, 0)
    launch(preprocess.kernel, preprocess.grid)(
        grad_out, out, gate_arg, delta, weights, grad_gate if gated else delta,
        batch * length, length, heads, head_dim,
        *grad_out.stride(), *gate_strides,
        **preprocess.constexprs,
    )  # fmt: skip

    grad_q = empty_output(shape, dtype=q.dtype, device=device)
    # d k' when smeared, kept in fp32 for the alpha gradient's long sum (a 2-byte-per-element premium on bf16).
    grad_k = empty_output(shape, dtype=torch.float32 if smeared else q.dtype, device=device)
    grad_v = empty_output(shape, dtype=q.dtype, device=device)
    alpha_arg = smear_alpha.contiguous() if smeared else q
    common = (
        heads, length, head_dim, sm_scale * _LOG2E, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(),
        bucket,
    )  # fmt: skip
    launch(dkdv.kernel, dkdv.grid)(
        q, k, v, alpha_arg, grad_out, weights, lse, delta, grad_k, grad_v, *common, **dkdv.constexprs
    )
    launch(dq.kernel, dq.grid)(
        q, k, v, alpha_arg, grad_out, weights, lse, delta, grad_q, grad_gate if gated else delta,
        *common, **dq.constexprs,
    )  # fmt: skip
    grad_alpha = None
    if smeared:
        grad_k, grad_alpha = smeared_keys_backward_triton(grad_k, k, smear_alpha)
    return grad_q, grad_k, grad_v, grad_gate, grad_alpha
