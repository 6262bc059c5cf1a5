"""Cost models of MoA gating: the whole attention layer and the ``mixture_of_heads`` op (see :mod:`benchmarks.cost`).

Shapes: ``x [B, L, D]`` with ``D = H * Dh``; ``head_out [B, L, H, Dh]``; ``gate_logits [B, L, H]``.
"""

from __future__ import annotations

import torch

from . import OpCost, itemsize


def attention_params(D: int, H: int, *, gated: bool = True) -> int:
    """Parameters of ``MoAAttention(D, H)`` with biases: ``qkv`` ``3D^2 + 3D`` for q, k, v plus, when
    gated, its ``H`` gate rows ``D H + H``; ``out_proj`` ``D^2 + D``."""
    return 4 * D * D + 4 * D + (D * H + H if gated else 0)


def attention_pairs(B: int, L: int, H: int, *, causal: bool = True) -> int:
    """(query, key) pairs the attention scores: ``B H L (L + 1) / 2`` causal, ``B H L^2`` otherwise."""
    return B * H * (L * (L + 1) // 2 if causal else L * L)


def attention_fwd_bwd_cost(
    B: int,
    L: int,
    H: int,
    Dh: int,
    *,
    dtype: torch.dtype | str,
    gated: bool = True,
    causal: bool = True,
    weight_grads: bool = True,
) -> OpCost:
    """Forward + backward of a whole ``MoAAttention`` layer (QKV projection, attention, gating, output
    projection) w.r.t. ``x`` and, if ``weight_grads``, every parameter. ``gated=False`` is plain attention.

    Bytes (``s`` = itemsize, ``P`` = :func:`attention_params`, ``w = 1`` if ``weight_grads``)::

        forward : read x (B L D s) and the parameters (P s), write y (B L D s)
        backward: read dy, x and the parameters, write dx [and the parameter gradients (P s)]
        total   = 4 B L D s + (2 + w) P s

    Only the layer's boundary is counted: ``q, k, v``, the heads and the gate logits are O(B L D)
    intermediates that even FlashAttention stores (and this layer's SDPA call does), so real traffic is
    a few times larger; at every benchmarked shape the FLOPs term binds by a wide margin anyway. ``x``
    is read once forward and once backward because the gate logits come out of the same projection
    as ``q, k, v`` (``qkv`` has ``3D + H`` rows): with a separate gate Linear, as before, ``x`` and ``dx``
    were each touched twice (``2 B L D s`` more), which this boundary count never showed.

    FLOPs (``g = 1`` if gated, ``pairs`` = :func:`attention_pairs`)::

        projections, forward: 2 B L D (3D + g H + D)   (qkv with its gate rows, out_proj)
        projections, backward: (1 + w) x forward        (input gradient [and weight gradient])
        attention core: 4 Dh per pair forward (q k^T and p v), 10 Dh per pair backward (scores
                        recomputed, dv, dp, dq, dk: FlashAttention's count)
        total = 2 B L D (4D + g H) (2 + w) + 14 Dh pairs

    The gating and softmax arithmetic (O(B L D)) is not counted.

    Example: ``B=1, L=2, H=2, Dh=2`` (``D=4``) fp32, gated, causal, with weight gradients: ``P = 90``,
    ``4*8*4 + 3*90*4 = 1208`` bytes; ``2*2*4*18*3 + 14*2*6 = 864 + 168 = 1032`` FLOPs.
    """
    D = H * Dh
    g = int(gated)
    w = int(weight_grads)
    params = attention_params(D, H, gated=gated)
    projection_flops = 2 * B * L * D * (4 * D + g * H) * (2 + w)
    core_flops = 14 * Dh * attention_pairs(B, L, H, causal=causal)
    return OpCost(bytes=4 * B * L * D * itemsize(dtype) + (2 + w) * params * itemsize(dtype),
                  flops=projection_flops + core_flops)  # fmt: skip


def mixture_of_heads_fwd_bwd_cost(
    B: int, L: int, H: int, Dh: int, *, dtype: torch.dtype | str, logits_dtype: torch.dtype | str | None = None
) -> OpCost:
    """Forward + backward of ``mixture_of_heads(head_out, gate_logits)`` w.r.t. both inputs.

    Bytes (``N = B L H Dh`` head elements of ``s`` bytes, ``B L H`` logits of ``t`` bytes, ``t = s``
    unless ``logits_dtype`` says otherwise)::

        forward : read head_out (N s) and the logits (B L H t), write out (N s)
        backward: read dout (N s), head_out (N s) and the logits, write d head_out (N s) and d logits
        total   = 5 N s + 3 B L H t

    FLOPs: forward ``out = G * head`` (``N``); backward ``d head = G * dout`` (``N``) and
    ``dG_h = <dout_h, head_h>`` (``2 N``); the gate softmax over ``H`` logits, about 5 operations a
    logit forward and 9 backward (recomputing it): ``4 N + 14 B L H``.

    Example: ``B=1, L=2, H=3, Dh=4`` bf16: ``5*24*2 + 3*6*2 = 276`` bytes, ``4*24 + 14*6 = 180`` FLOPs.
    """
    heads = B * L * H * Dh
    logits = B * L * H
    s = itemsize(dtype)
    t = s if logits_dtype is None else itemsize(logits_dtype)
    return OpCost(bytes=5 * heads * s + 3 * logits * t, flops=4 * heads + 14 * logits)
