"""Eager fp32 reference of gated, smeared causal attention: the op's specification.

    k'  = smeared_keys_reference(k, smear_alpha)           (k' = k without smear_alpha)
        k'[b, h, j] = s_h k[b, h, j] + (1 - s_h) k[b, h, j - 1],  s_h = sigmoid(alpha_h),  k[b, h, -1] = 0
    O_h = softmax(q_h k'_h^T * Dh**-0.5 + causal mask) v_h          (per head, [B, H, L, Dh])
    out = mixture_of_heads_reference(O.transpose(1, 2), gate_logits, gate)   ([B, L, H * Dh])
        out[b, l, h * Dh + d] = G[b, l, h] O[b, h, l, d]; without gate_logits G = 1 (a plain head merge)

It composes the two existing references (smeared keys, Mixture-of-Attention gating) around a dense
causal softmax attention, so the fused kernel and the separate ops share one definition. The functions
here take checked arguments (:mod:`.checks`); the public, checked reference is
:func:`icrl_kernels.gated_attention_reference`.

Gradients used by the kernels (``Y_h`` the gated output of head ``h`` in a row, ``dY_h`` its gradient,
``D_h = <dY_h, Y_h>``, ``G`` the gate weights of the row):

    d O_h        = G_h dY_h
    flash "D_i"  = <dO_h, O_h> = <G_h dY_h, O_h> = <dY_h, Y_h> = D_h          (no ungated output needed)
    d logit_h    = D_h - G_h sum_j D_j     (softmax: G_h (dG_h - sum_j G_j dG_j) with G_h dG_h = D_h)
                 = (1 - G_h) D_h           (sigmoid: G_h (1 - G_h) dG_h)
                 = <dY_h, O_h>             (linear: dG_h itself; D_h / G_h fails where G_h = 0, so the
                                            kernel recomputes O_h in its dq pass)
    d k_j        = s dk'_j + (1 - s) dk'_{j+1},   d alpha_h = s (1 - s) sum_{b, j} <dk'_j, k_j - k_{j-1}>
"""

from __future__ import annotations

import torch

from .._library import compute_dtype
from ..moa.reference import gate_weights_reference as gate_weights_reference  # the gate (also the vmap rule's)
from ..moa.reference import mixture_of_heads_reference
from ..smeared.reference import smeared_keys_reference


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal softmax attention ``softmax(q k^T / sqrt(Dh) + mask) v`` in fp32 (fp64 stays fp64);
    ``[B, H, L, Dh]`` in the compute dtype."""
    dtype = compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    length = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def gated_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None = None,
    *,
    gate: str = "softmax",
    smear_alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention on (optionally smeared) keys with (optionally gated) merged heads: the spec.

    Args:
        q, k, v: ``[B, H, L, Dh]``, one float dtype; any strides.
        gate_logits: ``[B, L, H]`` or None (no gate: every head weighs 1).
        gate: ``"softmax"``, ``"sigmoid"`` or ``"linear"``, as :func:`icrl_kernels.mixture_of_heads`.
        smear_alpha: ``[H]`` smearing logits or None (keys as given), as :func:`icrl_kernels.smeared_keys`.

    Returns:
        ``[B, L, H * Dh]`` in ``q.dtype``; the math in fp32 (fp64 for fp64 inputs), differentiable by autograd
        w.r.t. every tensor input. The smeared keys are rounded to ``k.dtype`` (as :func:`smeared_keys_reference`
        returns them), which is what the kernels feed their dot products.
    """
    keys = k if smear_alpha is None else smeared_keys_reference(k, smear_alpha)
    heads = causal_attention_reference(q, keys, v).transpose(1, 2)  # [B, L, H, Dh]
    if gate_logits is None:
        return heads.flatten(2).to(q.dtype)
    return mixture_of_heads_reference(heads, gate_logits, gate).to(q.dtype)
