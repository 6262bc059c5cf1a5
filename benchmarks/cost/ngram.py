"""Cost model of n-gram match attention (bytes and FLOPs of one forward + backward; see :mod:`benchmarks.cost`)."""

from __future__ import annotations

import torch

from . import OpCost, itemsize


def fwd_bwd_cost(B: int, L: int, D: int, *, dtype: torch.dtype | str, ids_itemsize: int = 8) -> OpCost:
    """Forward + backward of ``out = A(n) @ h`` w.r.t. ``h [B, L, D]`` with ``ids [B, L]``.

    Bytes (``s`` = itemsize of ``dtype``, ``i`` = ``ids_itemsize``)::

        forward : read h (B L D s) and ids (B L i), write out (B L D s)
        backward: read grad_out (B L D s) and ids (B L i), write grad_h (B L D s)
                  (the op is linear in h: the backward does not read h)
        total   = 4 B L D s + 2 B L i

    The plan (sorted positions, segment bounds, match counts) is O(B L) integers that the fast path
    derives from ``ids`` and that a fused kernel can keep in on-chip memory tile by tile; it is not
    counted, so the bound does not depend on ``n`` or the vocabulary.

    FLOPs: the sort + prefix-sum algorithm, per element of ``h`` in the forward: one add of the
    prefix sum, one subtraction of the matched range's ends and one multiply by ``1 / count``
    (``3 B L D``); the backward does the same on ``grad_out`` (suffix sums): ``6 B L D`` in all. The
    sort and binary searches are integer work and not counted. (The dense reference does
    ``4 B L^2 D`` FLOPs of matmul instead; this op is memory-bound by orders of magnitude.)

    Example: ``B=2, L=3, D=4`` fp32, int64 ids: ``4*24*4 + 2*6*8 = 480`` bytes, ``6*24 = 144`` FLOPs.
    """
    elements = B * L * D
    return OpCost(bytes=4 * elements * itemsize(dtype) + 2 * B * L * ids_itemsize, flops=6 * elements)
