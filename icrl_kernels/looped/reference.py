"""Eager fp32 reference of the looped transformer's input injection fused with LayerNorm: the op's specification.

The looped transformer (Yang et al.) iterates ``Y_{t+1} = M(Y_t + P)`` with ``Y_0 = 0``, ``P`` the
embedded prompt and ``M`` one weight-tied GPT-2 block that also adds the learned position embedding.
Every loop therefore starts with

    hidden = Y_t + P + pos                         (the residual stream of the block)
    normed = LayerNorm(hidden) * weight + bias     (the block's first LayerNorm, ln_1)

with the biased variance over the last dimension, ``LayerNorm(x) = (x - mean) / sqrt(var + eps)``
(as ``torch.nn.LayerNorm``). Pinned conventions:

* the sum and the statistics are computed in fp32 (fp64 for fp64 inputs), and ``normed`` is the
  LayerNorm of the *unrounded* fp32 sum: with half-precision activations it can differ from
  ``F.layer_norm(y + prompt + pos)`` evaluated in half precision by the rounding of ``hidden``;
* ``y`` and ``prompt`` (the activations) share one dtype, which both outputs have; ``pos``,
  ``weight`` and ``bias`` are parameters and may have any float dtype (e.g. fp32 parameters with
  bf16 activations under autocast): they are read in the compute dtype.
"""

from __future__ import annotations

import torch

from .._library import compute_dtype


def injected_sum(
    y: torch.Tensor | None, prompt: torch.Tensor, pos: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``y + prompt + pos`` in ``dtype`` (``y = None`` is ``Y_0 = 0``; ``pos [L, D]`` broadcasts over the batch)."""
    hidden = prompt.to(dtype)
    if y is not None:
        hidden = hidden + y.to(dtype)
    if pos is not None:
        hidden = hidden + pos.to(dtype)
    return hidden


def layer_norm_statistics(hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``mean`` and ``rstd = 1 / sqrt(var + eps)`` over the last dim (biased variance), shape ``[B, L]``."""
    mean = hidden.mean(dim=-1)
    var = (hidden - mean[..., None]).square().mean(dim=-1)
    return mean, torch.rsqrt(var + eps)


def inject_layer_norm_reference(
    y: torch.Tensor | None,
    prompt: torch.Tensor,
    pos: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input injection + LayerNorm: ``hidden = y + prompt + pos``, ``normed = LayerNorm(hidden) * weight + bias``.

    Args:
        y: current iterate ``[B, L, D]``, or ``None`` for ``Y_0 = 0``.
        prompt: embedded prompt ``P``, ``[B, L, D]``, the same dtype as ``y``.
        pos: position embedding ``[L, D]`` (broadcast over the batch), or ``None``.
        weight: LayerNorm scale ``[D]``.
        bias: LayerNorm shift ``[D]``, or ``None``.
        eps: added to the variance.

    Returns:
        ``(hidden, normed)``, both ``[B, L, D]`` in ``prompt.dtype``; differentiable by autograd
        w.r.t. every tensor input.
    """
    dtype = compute_dtype(prompt)
    hidden = injected_sum(y, prompt, pos, dtype)
    mean, rstd = layer_norm_statistics(hidden, eps)
    normed = (hidden - mean[..., None]) * rstd[..., None] * weight.to(dtype)
    if bias is not None:
        normed = normed + bias.to(dtype)
    return hidden.to(prompt.dtype), normed.to(prompt.dtype)
