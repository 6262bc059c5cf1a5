"""Cost models of InfoNCE and action selection (bytes and FLOPs per call; see :mod:`benchmarks.cost`).

Shapes: ``pred [N, D]`` (all rows flattened), ``maps`` distinct action maps of ``A x D`` (1 when one map
is shared by all rows, ``B`` for per-sequence maps), targets ``[N]`` int64. ``logits = pred @ E^T / tau``
never reach memory in a fused implementation, so they cost FLOPs but no bytes.

FLOPs count the dots only (``2 N A D`` per pass over the logits). The exponentials and the softmax
arithmetic (O(N A)) run on other units and are not counted; at small ``D`` (about 128 on an H100) the
forward's exponentials take about as long as its dots, so there the bound is optimistic.
"""

from __future__ import annotations

import torch

from . import OpCost, itemsize

#: Bytes per row of the saved statistics a fused InfoNCE keeps between forward and backward (fp32 lse).
_ROW_STATS_BYTES = 4
_TARGET_BYTES = 8


def infonce_fwd_bwd_cost(
    N: int, D: int, A: int, *, dtype: torch.dtype | str, grad_embeds: bool = False, maps: int = 1
) -> OpCost:
    """Forward + backward of ``infonce_loss(pred, E, targets)`` w.r.t. ``pred`` (and ``E`` if ``grad_embeds``).

    Bytes (``s`` = itemsize of ``dtype``, ``m = maps``, ``g = 1`` if ``grad_embeds`` else 0)::

        forward : read pred (N D s), the maps (m A D s), targets (8 N); write lse (4 N)
        backward: read pred, the maps, targets, lse; write grad_pred (N D s) [and grad_E (m A D s)]
        total   = 3 N D s + (2 + g) m A D s + 24 N

    (the loss and its upstream gradient are scalars and not counted).

    FLOPs: the forward's logits (``2 N A D``); the backward recomputes them once, since a fused
    implementation stores only the per-row log-sum-exp (``2 N A D``, as FlashAttention's backward
    recomputes its scores), and multiplies ``softmax - one_hot`` by ``E`` for ``grad_pred``
    (``2 N A D``) [and by ``pred`` for ``grad_E``, ``2 N A D``]: ``2 N A D (3 + g)``. A materialising
    implementation skips the recompute but writes and reads the ``N x A`` logits.

    Example: ``N=4, D=8, A=3`` bf16, one map, ``grad_embeds=False``: ``3*32*2 + 2*24*2 + 24*4 = 384``
    bytes and ``2*96*3 = 576`` FLOPs; with ``grad_embeds=True``: ``432`` bytes, ``768`` FLOPs.
    """
    s = itemsize(dtype)
    g = int(grad_embeds)
    map_bytes = maps * A * D * s
    rows = 2 * _TARGET_BYTES * N + 2 * _ROW_STATS_BYTES * N  # targets read twice, lse written and read
    return OpCost(bytes=3 * N * D * s + (2 + g) * map_bytes + rows, flops=2 * N * A * D * (3 + g))


def select_actions_cost(N: int, D: int, A: int, *, dtype: torch.dtype | str, maps: int = 1) -> OpCost:
    """One action per row by ``select_actions(pred, E)`` (argmax or Gumbel-max sampling over the logits).

    Bytes: read ``pred`` (``N D s``) and the maps (``m A D s``), write the ids (``8 N``); the Gumbel
    noise is generated on chip from a seed. FLOPs: the logits, ``2 N A D``.

    Example: ``N=4, D=8, A=3`` bf16, one map: ``64 + 48 + 32 = 144`` bytes and ``192`` FLOPs.
    """
    s = itemsize(dtype)
    return OpCost(bytes=N * D * s + maps * A * D * s + 8 * N, flops=2 * N * A * D)
