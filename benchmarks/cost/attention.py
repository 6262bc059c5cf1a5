"""Cost models of gated, smeared causal attention (see :mod:`benchmarks.cost`): the fused Triton kernels and
the separate-ops baseline (``smeared_keys`` -> SDPA -> ``mixture_of_heads``) they replace.

Shapes: ``q, k, v [B, H, L, Dh]``, gate logits ``[B, L, H]``. Notation: ``N = B H L Dh`` head elements of
``s`` bytes, ``R = B H L`` rows (fp32 statistics, 4 bytes each), ``G = B L H`` logits of ``t`` bytes.
Flash-attention tiles re-read ``K``/``V`` (forward, dq) or ``Q``/``dY`` (dkdv) once per block of the other
side; those re-reads come from L2 at these sizes and are counted once, as every FlashAttention model does.

**Prediction (not a measurement), H100, B = 16, H = 12, L = 1024, Dh = 64, bf16, softmax gate, smearing,
forward + backward** (``N = 12.6 M``, ``R = 197 k``, ``G = 197 k``):

============================================  ===================================  ===========
path                                          bytes                                 MB
============================================  ===================================  ===========
fused (this op)                               ``19 N s + (8 - s) N + 3 G t + 36 R``  ~562
separate: smeared_keys + SDPA + MoA           ``27 N s + 3 G t + 24 R + 4 H``        ~686
SDPA alone (ungated, unsmeared floor)         ``17 N s + 24 R``                      ~433
============================================  ===================================  ===========

so the fusion saves ~123 MB (~18 %) of traffic and two launches a direction against the separate ops;
gated without smearing: ``17 N s + 3 G t + 36 R`` ~436 MB against ``22 N s + 3 G t + 24 R`` ~560 MB
(-22 %), within 1 % of plain SDPA's bytes. At 3.35 TB/s those bytes take 0.17 / 0.20 / 0.13 ms, while the
FLOPs (``18 Dh`` a causal pair here, ``14 Dh`` for FlashAttention-2, ~1e11 a call) take ~0.4 ms at a
realistic ~300 TFLOP/s: attention at L = 1024 is compute-bound, so the predicted gain is the separate ops'
whole passes (~0.04 ms of ~0.5 ms) rather than the byte ratio, and our 4 extra ``Dh`` FLOPs a pair
(two kernels recompute the scores, see below) cost about as much again. Whether the fused kernel beats SDPA +
the separate kernels must be measured (``benchmarks/bench_gated_attention.py``); until then SDPA stays
the default.
"""

from __future__ import annotations

import torch

from . import OpCost, itemsize
from .moa import attention_pairs, mixture_of_heads_fwd_bwd_cost
from .smeared import fwd_bwd_cost as smeared_keys_fwd_bwd_cost


def fwd_bwd_cost(
    B: int,
    H: int,
    L: int,
    Dh: int,
    *,
    dtype: torch.dtype | str,
    gated: bool = True,
    smeared: bool = True,
    gate: str = "softmax",
    logits_dtype: torch.dtype | str | None = None,
) -> OpCost:
    """Forward + backward of the fused ``gated_attention(backend="triton")`` w.r.t. every input.

    Bytes (``g = 1`` if ``gated``, ``m = 1`` if ``smeared``)::

        forward   : read q, k, v (3 N s) [the smeared key rows j - 1 come from the tile's own rows or
                    cache], the logits (g G t); write out (N s) and the log-sum-exp (4 R)
        preprocess: read dY, Y (2 N s), the logits (g G t); write D (4 R) [and G (4 R), d logits (G t)]
        dkdv      : read q, k, v, dY (4 N s), lse, D [and G] (8 R [+ 4 R]); write dv (N s) and dk' (N s,
                    or N * 4 fp32 when smeared: the alpha gradient sums it over B L Dh)
        dq        : read q, k, v, dY (4 N s), lse, D [and G] (8 R [+ 4 R]); write dq (N s)
        smear bwd : read dk' (4 N) and k (N s), write dk (N s)   (smeared_keys' backward kernel)
        total     = 17 N s + 24 R + g (3 G t + 12 R) + m ((8 - s) N + 2 N s)

    FLOPs (``pairs`` = causal (query, key) pairs, :func:`benchmarks.cost.moa.attention_pairs`): forward
    ``4 Dh`` a pair (``q k^T``, ``P V``); backward ``8 Dh`` in dkdv (``q k^T``, ``dP``, ``dV``, ``dK``) and
    ``6 Dh`` in dq (``q k^T``, ``dP``, ``dQ``), ``+ 2 Dh`` there for the linear gate (``P V`` again for
    ``<dY, O>``): ``(18 + 2 [linear]) Dh pairs``. Elementwise work (exp, gate, smear) is not counted, and
    the kernels' diagonal blocks compute some masked pairs beyond ``pairs``.

    Example: ``B=1, H=2, L=2, Dh=16`` bf16, softmax gate, smeared: ``N = 64, R = 4, G = 4``;
    ``17*128 + 96 + (24 + 48) + (384 + 256) = 2176 + 96 + 72 + 640 = 2984`` bytes,
    ``18*16*6 = 1728`` FLOPs.
    """
    N, R, G = B * H * L * Dh, B * H * L, B * L * H
    s = itemsize(dtype)
    t = s if logits_dtype is None else itemsize(logits_dtype)
    g, m = int(gated), int(smeared)
    total = 17 * N * s + 24 * R + g * (3 * G * t + 12 * R) + m * ((8 - s) * N + 2 * N * s)
    flops = (18 + 2 * int(gated and gate == "linear")) * Dh * attention_pairs(B, L, H)
    return OpCost(bytes=total, flops=flops)


def sdpa_fwd_bwd_cost(B: int, H: int, L: int, Dh: int, *, dtype: torch.dtype | str) -> OpCost:
    """Forward + backward of causal SDPA (a FlashAttention-2 kernel) with the same traffic model as
    :func:`fwd_bwd_cost` ungated and unsmeared: ``17 N s + 24 R`` bytes; ``14 Dh`` FLOPs a causal pair
    (one score recompute in the backward)."""
    N, R = B * H * L * Dh, B * H * L
    return OpCost(bytes=17 * N * itemsize(dtype) + 24 * R, flops=14 * Dh * attention_pairs(B, L, H))


def separate_ops_fwd_bwd_cost(
    B: int,
    H: int,
    L: int,
    Dh: int,
    *,
    dtype: torch.dtype | str,
    gated: bool = True,
    smeared: bool = True,
    logits_dtype: torch.dtype | str | None = None,
) -> OpCost:
    """The baseline the fused op replaces: ``smeared_keys`` (``5 N s + 3 H 4`` bytes), SDPA
    (:func:`sdpa_fwd_bwd_cost`) and ``mixture_of_heads`` (``5 N s + 3 G t``; without a gate a head-merge
    copy, ``2 N s``, and its gradient's, ``2 N s``), each a kernel of its own with its own passes."""
    cost = sdpa_fwd_bwd_cost(B, H, L, Dh, dtype=dtype)
    if smeared:
        cost = cost + smeared_keys_fwd_bwd_cost(B, H, L, Dh, dtype=dtype)
    if gated:
        cost = cost + mixture_of_heads_fwd_bwd_cost(B, L, H, Dh, dtype=dtype, logits_dtype=logits_dtype)
    else:
        cost = cost + OpCost(bytes=4 * B * H * L * Dh * itemsize(dtype), flops=0)
    return cost
