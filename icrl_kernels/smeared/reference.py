"""Eager fp32 reference of smeared keys (the induction-heads lecture's "key smearing"): the op's specification.

    k'[b, h, j] = sigmoid(alpha[h]) * k[b, h, j] + (1 - sigmoid(alpha[h])) * k[b, h, j - 1],   k[b, h, -1] = 0

Each head mixes every key with the key one position earlier, with a learnable weight per head. A
one-layer attention-only transformer can then match a query against the *previous* token of each
key, which is the prefix-matching half of an induction head; without smearing that needs a
previous-token head in an earlier layer.

The functions here take checked arguments (:mod:`.checks`); the public, checked reference is
:func:`icrl_kernels.smeared_keys_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._library import compute_dtype


def previous_positions(x: torch.Tensor) -> torch.Tensor:
    """``x`` shifted one position later along dim 2 (``out[:, :, j] = x[:, :, j - 1]``), zero at ``j = 0``."""
    return F.pad(x[:, :, :-1], (0, 0, 1, 0))


def smear_weight(alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sigmoid(alpha)`` in ``dtype``, shaped ``[1, H, 1, 1]`` to broadcast over ``[B, H, L, Dh]``."""
    return torch.sigmoid(alpha.to(dtype)).view(1, -1, 1, 1)


def smeared_keys_reference(k: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Smeared keys ``k' = sigmoid(alpha) k_j + (1 - sigmoid(alpha)) k_{j-1}`` (``k_{-1} = 0``), per head.

    Args:
        k: keys ``[B, H, L, Dh]``, any float dtype; the math runs in fp32 (fp64 stays fp64).
        alpha: one smearing logit per head, ``[H]``, any float dtype. ``sigmoid(alpha)`` is the weight
            of the current key: large ``alpha`` leaves keys unchanged, very negative ``alpha`` makes
            every key the previous position's key.

    Returns:
        ``[B, H, L, Dh]`` in ``k.dtype``; differentiable w.r.t. ``k`` and ``alpha`` by autograd.
    """
    dtype = compute_dtype(k)
    weight = smear_weight(alpha, dtype)
    keys = k.to(dtype)
    return (weight * keys + (1 - weight) * previous_positions(keys)).to(k.dtype)
