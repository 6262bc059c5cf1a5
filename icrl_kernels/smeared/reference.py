"""Eager fp32 reference of smeared keys (the induction-heads lecture's "key smearing"): the op's specification.

    k'[b, h, j] = sigmoid(alpha[h]) * k[b, h, j] + (1 - sigmoid(alpha[h])) * k[b, h, j - 1],   k[b, h, -1] = 0

Each head mixes every key with the key one position earlier, with a learnable weight per head. A
one-layer attention-only transformer can then match a query against the *previous* token of each
key, which is the prefix-matching half of an induction head; without smearing that needs a
previous-token head in an earlier layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation import FLOAT_DTYPES, check_same_device, check_shape, check_tensor


def compute_dtype_of(k: torch.Tensor) -> torch.dtype:
    """The dtype the reference and the eager path compute in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if k.dtype == torch.float64 else torch.float32


def previous_positions(x: torch.Tensor) -> torch.Tensor:
    """``x`` shifted one position later along dim 2 (``out[:, :, j] = x[:, :, j - 1]``), zero at ``j = 0``."""
    return F.pad(x[:, :, :-1], (0, 0, 1, 0))


def next_positions(x: torch.Tensor) -> torch.Tensor:
    """``x`` shifted one position earlier along dim 2 (``out[:, :, j] = x[:, :, j + 1]``), zero at the end."""
    return F.pad(x[:, :, 1:], (0, 0, 0, 1))


def smear_weight(alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sigmoid(alpha)`` in ``dtype``, shaped ``[1, H, 1, 1]`` to broadcast over ``[B, H, L, Dh]``."""
    return torch.sigmoid(alpha.to(dtype)).view(1, -1, 1, 1)


def check_smeared_keys_args(k: object, alpha: object) -> None:
    """The argument checks of :func:`smeared_keys` and its reference (shapes, dtypes, devices only).

    Raises:
        TypeError: a non-tensor or non-float input. ValueError: ``k`` not 4-D, ``alpha`` not
            ``[k.shape[1]]``, tensors on different devices.
    """
    check_tensor(k, "k", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(alpha, "alpha", ndim=1, dtypes=FLOAT_DTYPES)
    check_shape(alpha, "alpha", (k.shape[1],), "(k.shape[1],), one logit per head")
    check_same_device(k=k, alpha=alpha)


def smeared_keys_reference(k: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Smeared keys ``k' = sigmoid(alpha) k_j + (1 - sigmoid(alpha)) k_{j-1}`` (``k_{-1} = 0``), per head.

    Args:
        k: keys ``[B, H, L, Dh]``, any float dtype; the math runs in fp32 (fp64 stays fp64).
        alpha: one smearing logit per head, ``[H]``, any float dtype. ``sigmoid(alpha)`` is the weight
            of the current key: large ``alpha`` leaves keys unchanged, very negative ``alpha`` makes
            every key the previous position's key.

    Returns:
        ``[B, H, L, Dh]`` in ``k.dtype``; differentiable w.r.t. ``k`` and ``alpha`` by autograd.

    Raises:
        ValueError/TypeError naming the argument, as :func:`smeared_keys` (:func:`check_smeared_keys_args`).
    """
    check_smeared_keys_args(k, alpha)
    dtype = compute_dtype_of(k)
    weight = smear_weight(alpha, dtype)
    keys = k.to(dtype)
    return (weight * keys + (1 - weight) * previous_positions(keys)).to(k.dtype)
