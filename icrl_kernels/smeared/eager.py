"""Eager PyTorch path of smeared keys: the reference's forward and a closed-form backward (what CPUs run)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._library import compute_dtype
from .reference import previous_positions, smear_weight, smeared_keys_reference


def next_positions(x: torch.Tensor) -> torch.Tensor:
    """``x`` shifted one position earlier along dim 2 (``out[:, :, j] = x[:, :, j + 1]``), zero at the end."""
    return F.pad(x[:, :, 1:], (0, 0, 0, 1))


def smeared_keys_forward_eager(k: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The reference's forward, contiguous: elementwise ops keep a strided input's layout, and the op
    promises contiguous outputs (as its fake does)."""
    return smeared_keys_reference(k, alpha).contiguous()


def smeared_keys_backward_eager(
    grad_out: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients in PyTorch: ``grad_k[j] = w g[j] + (1 - w) g[j + 1]`` and
    ``grad_alpha[h] = w (1 - w) sum_{b, j, d} g[j] (k[j] - k[j - 1])`` with ``w = sigmoid(alpha[h])``."""
    dtype = compute_dtype(k)
    weight = smear_weight(alpha, dtype)
    grad, keys = grad_out.to(dtype), k.to(dtype)
    grad_k = weight * grad + (1 - weight) * next_positions(grad)
    weight = weight.view(-1)
    grad_alpha = (grad * (keys - previous_positions(keys))).sum(dim=(0, 2, 3)) * weight * (1 - weight)
    return grad_k.to(k.dtype).contiguous(), grad_alpha.to(alpha.dtype)
