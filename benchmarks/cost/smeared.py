"""Cost model of smeared keys (bytes and FLOPs of one forward + backward; see :mod:`benchmarks.cost`)."""

from __future__ import annotations

import torch

from . import OpCost, itemsize


def fwd_bwd_cost(
    B: int, H: int, L: int, Dh: int, *, dtype: torch.dtype | str, alpha_grad: bool = True, alpha_itemsize: int = 4
) -> OpCost:
    """Forward + backward of ``k' = smeared_keys(k, alpha)`` w.r.t. ``k [B, H, L, Dh]`` and, if
    ``alpha_grad``, ``alpha [H]`` (fp32 by default).

    Bytes (``N = B H L Dh`` elements of ``s`` bytes, ``a = alpha_itemsize``, ``g = 1`` if ``alpha_grad``)::

        forward : read k (N s) and alpha (H a), write k' (N s)
        backward: read dk' (N s) and alpha (H a) [and k (N s), for d alpha], write dk (N s) [and d alpha (H a)]
        total   = (4 + g) N s + (2 + g) H a

    (``dk_j = s dk'_j + (1 - s) dk'_{j+1}`` needs only ``dk'``; ``d alpha`` needs ``k_j - k_{j-1}``.)

    FLOPs per element: forward 3 (``s k_j + (1 - s) k_{j-1}``), ``dk`` 3, ``d alpha`` 3 (the difference,
    its product with ``dk'``, the sum): ``(6 + 3 g) N``. Per-head work (the sigmoid) is not counted.

    Example: ``B=1, H=2, L=3, Dh=4`` bf16 with the alpha gradient: ``5*24*2 + 3*2*4 = 264`` bytes and
    ``9*24 = 216`` FLOPs.
    """
    g = int(alpha_grad)
    elements = B * H * L * Dh
    alpha_bytes = (2 + g) * H * alpha_itemsize
    return OpCost(bytes=(4 + g) * elements * itemsize(dtype) + alpha_bytes, flops=(6 + 3 * g) * elements)
