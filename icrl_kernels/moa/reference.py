"""Eager fp32 reference of per-head Mixture-of-Attention gating (GPT2-DTMA): the op's specification.

    G[b, l, :] = gate(logits[b, l, :])                  gate: softmax over heads | sigmoid | identity
    out[b, l, h * Dh + d] = G[b, l, h] * head_out[b, l, h, d]

Each head's output is scaled by its gate weight and the heads are concatenated, ready for the output
projection ``W_O``. ``"softmax"`` is the paper's gate, ``"linear"`` the official code's (the raw
logits of a linear map with bias, no normalisation), ``"sigmoid"`` an independent weight per head.

Gradients (``s[b, l, h] = <dout[b, l, h, :], head_out[b, l, h, :]>``, the gradient w.r.t. ``G``):

    d head_out[b, l, h, d] = G[b, l, h] * dout[b, l, h * Dh + d]
    d logits  = s                              (linear)
              = G (1 - G) s                    (sigmoid)
              = G (s - sum_j G_j s_j)          (softmax)

Dtypes: the math runs in fp32 (fp64 stays fp64) whatever the inputs; the output has ``head_out``'s
dtype. ``gate_logits`` may have another float dtype than ``head_out`` (fp32 logits with bf16 heads
under autocast): the logits are normalised in the compute dtype, so a wider logit dtype is never
rounded down to the heads' dtype, and its gradient comes back in ``gate_logits``' own dtype.

The functions here take checked arguments (:mod:`.checks`); the public, checked reference is
:func:`icrl_kernels.mixture_of_heads_reference`.
"""

from __future__ import annotations

import torch

from .._library import compute_dtype


def gate_weights_reference(gate_logits: torch.Tensor, gate: str = "softmax") -> torch.Tensor:
    """Normalised gate weights ``G`` from ``gate_logits [..., H]``, over the last (head) dimension.

    Args:
        gate_logits: ``[..., H]``, any float dtype.
        gate: ``"softmax"`` (weights sum to 1 over heads), ``"sigmoid"`` (each in (0, 1)) or
            ``"linear"`` (the logits unchanged).

    Returns:
        ``G`` in the compute dtype (fp32, or fp64 for fp64 logits), same shape; differentiable.
    """
    logits = gate_logits.to(compute_dtype(gate_logits))
    if gate == "softmax":
        return torch.softmax(logits, dim=-1)
    if gate == "sigmoid":
        return torch.sigmoid(logits)
    return logits  # "linear"


def mixture_of_heads_reference(
    head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str = "softmax"
) -> torch.Tensor:
    """Gate each head's output and merge the heads: ``out[b, l, h*Dh + d] = G[b, l, h] head_out[b, l, h, d]``.

    Args:
        head_out: per-head attention outputs ``[B, L, H, Dh]`` (any strides), any float dtype.
        gate_logits: ``[B, L, H]``, any float dtype.
        gate: ``"softmax"``, ``"sigmoid"`` or ``"linear"`` (see :func:`gate_weights_reference`).

    Returns:
        ``[B, L, H * Dh]`` in ``head_out.dtype``, computed in fp32 (fp64 for fp64 inputs);
        differentiable w.r.t. both inputs by autograd.
    """
    dtype = compute_dtype(head_out, gate_logits)
    weights = gate_weights_reference(gate_logits, gate).to(dtype)
    batch, length, heads, head_dim = head_out.shape
    merged = head_out.to(dtype) * weights.unsqueeze(-1)
    return merged.reshape(batch, length, heads * head_dim).to(head_out.dtype)
