"""The eager path: PyTorch's SDPA between the existing ``smeared_keys`` and ``mixture_of_heads`` ops.

This is what CPU tensors run by default and the "separate kernels" baseline the fused kernel is
measured against: smeared keys are written out as their own tensor, SDPA writes the ungated heads,
and ``mixture_of_heads`` reads them back to scale and merge them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..moa.function import mixture_of_heads
from ..smeared.function import smeared_keys


def gated_attention_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None,
    gate: str,
    smear_alpha: torch.Tensor | None,
    *,
    backend: str = "eager",
) -> torch.Tensor:
    """``smeared_keys`` -> ``F.scaled_dot_product_attention(is_causal=True)`` -> ``mixture_of_heads``
    (or a plain head merge without ``gate_logits``); ``backend`` is passed to the two icrl ops.
    Arguments as :func:`icrl_kernels.gated_attention`; differentiable by autograd. Returns contiguous
    ``[B, L, H * Dh]`` in ``q.dtype``."""
    keys = k if smear_alpha is None else smeared_keys(k, smear_alpha, backend=backend)
    heads = F.scaled_dot_product_attention(q, keys, v, is_causal=True).transpose(1, 2)  # [B, L, H, Dh]
    if gate_logits is None:
        return heads.flatten(2).contiguous()
    return mixture_of_heads(heads, gate_logits, gate=gate, backend=backend)
