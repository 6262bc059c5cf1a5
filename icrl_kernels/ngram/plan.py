"""The sort-based plan shared by the eager and Triton paths of the O(L log L) algorithm.

Let ``g[t]`` be the identity of the n-gram ending at position ``t`` (valid when ``t >= n-1`` and no
id in it is negative). Query ``i`` matches key ``j`` iff ``g[i] == g[j-1]`` and ``j < i``. Sorting
positions ``t`` by ``(g[t], t)`` (a stable sort) therefore serves both sides at once: in sorted order
each n-gram forms one contiguous segment, ascending in ``t``. For the query at ``t_k`` (the k-th
element of its segment), the keys are ``j = t_m + 1`` for the earlier elements ``m < k`` of the
segment, except ``t_{k-1}`` when ``t_{k-1} = t_k - 1`` (that key is ``j = i``, and the pattern is
strict). So a segmented running sum over ``h[t + 1]`` in sorted order gives every output, and the
backward is the same running sum taken from the other end of each segment.

The plan stores, for each batch row, the permutation and one byte of flags per sorted position.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

#: Bits of :attr:`NGramPlan.meta` (per sorted position k).
SEGMENT_START = 1  # k starts a new n-gram segment
PREVIOUS_ADJACENT = 2  # the previous element of the segment is position perm[k] - 1
VALID_NGRAM = 4  # the n-gram ending at perm[k] is in range and has no padding

_PACKING_LIMIT = 2**62


class NGramPlan(NamedTuple):
    """Precomputed matching structure for one ``(ids, n)``; reusable across layers with the same n.

    Attributes:
        perm: ``[B, L]`` int64, positions sorted by (n-gram ending there, position).
        meta: ``[B, L]`` uint8, flags per sorted position (``SEGMENT_START | PREVIOUS_ADJACENT | VALID_NGRAM``).
        count: ``[B, L]`` int32, number of keys each query position matches (0: output row is zero).
    """

    perm: torch.Tensor
    meta: torch.Tensor
    count: torch.Tensor


def _shift_right(x: torch.Tensor, steps: int, fill: int = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t - steps]``, filled with ``fill`` where ``t < steps``."""
    if steps == 0:
        return x
    length = x.shape[1]
    if steps >= length:
        return torch.full_like(x, fill)
    return F.pad(x[:, : length - steps], (steps, 0), value=fill)


def ngram_valid(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, L]`` bool: the n-gram ending at each position is in range and contains no padding."""
    length = ids.shape[1]
    padding = (ids < 0).to(torch.int32).cumsum(dim=1)
    padding_in_window = padding - _shift_right(padding, n)
    in_range = torch.arange(length, device=ids.device) >= n - 1
    return (padding_in_window == 0) & in_range


def _dense_rank(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Replace values by their rank among the distinct values; return ranks and the number of ranks."""
    distinct, ranks = torch.unique(values, return_inverse=True)
    return ranks.view_as(values), int(distinct.numel())


def ngram_keys(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact integer identity of the n-gram ending at each position.

    Packs ``sum_k ids[t-k] * V^(k)`` exactly when ``V^n < 2^62`` (``V`` = max id + 1); otherwise
    ranks (n-gram, next id) pairs one token at a time, which is exact for any vocabulary.

    Returns:
        ``(keys [B, L] int64, valid [B, L] bool)``; invalid positions have key ``-1``.
    """
    valid = ngram_valid(ids, n)
    tokens = ids.clamp(min=0)
    vocab = int(tokens.max().item()) + 1 if tokens.numel() else 1
    if vocab**n < _PACKING_LIMIT:
        keys = torch.zeros_like(tokens)
        for k in range(n - 1, -1, -1):
            keys = keys * vocab + _shift_right(tokens, k)
    else:
        token_rank, num_tokens = _dense_rank(tokens)
        keys = token_rank
        for _ in range(n - 1):
            # (n-gram ending at t-1, token t) -> n-gram ending at t; ranks keep the product < 2^63.
            keys, _ = _dense_rank(_shift_right(keys, 1) * num_tokens + token_rank)
    return torch.where(valid, keys, torch.full_like(keys, -1)), valid


def build_ngram_plan(ids: torch.Tensor, n: int) -> NGramPlan:
    """Sort positions by n-gram and derive segment flags and match counts (see the module docstring)."""
    ids = ids.long()
    batch, length = ids.shape
    keys, valid = ngram_keys(ids, n)
    sorted_keys, perm = torch.sort(keys, dim=1, stable=True)
    position = torch.arange(length, device=ids.device).expand(batch, length)

    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    starts[:, 1:] = sorted_keys[:, 1:] != sorted_keys[:, :-1]
    previous_adjacent = torch.zeros_like(starts)
    previous_adjacent[:, 1:] = ~starts[:, 1:] & (perm[:, 1:] == perm[:, :-1] + 1)
    valid_sorted = valid.gather(1, perm)

    segment_start = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=1).values
    count_sorted = (position - segment_start - previous_adjacent.long()) * valid_sorted.long()
    count = torch.empty_like(count_sorted, dtype=torch.int32).scatter_(1, perm, count_sorted.to(torch.int32))

    meta = (
        starts.to(torch.uint8) * SEGMENT_START
        + previous_adjacent.to(torch.uint8) * PREVIOUS_ADJACENT
        + valid_sorted.to(torch.uint8) * VALID_NGRAM
    )
    return NGramPlan(perm, meta, count)


@torch.library.custom_op("icrl::ngram_plan", mutates_args=())
def _ngram_plan_op(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(build_ngram_plan(ids, n))


@_ngram_plan_op.register_fake
def _(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        ids.new_empty(ids.shape, dtype=torch.int64),
        ids.new_empty(ids.shape, dtype=torch.uint8),
        ids.new_empty(ids.shape, dtype=torch.int32),
    )


def ngram_plan(ids: torch.Tensor, n: int) -> NGramPlan:
    """Build the :class:`NGramPlan` of ``ids [B, L]`` for n-gram length ``n`` (a torch custom op).

    Computing a plan costs one sort of ``B x L`` keys; layers that share ids and ``n`` can share it
    through ``ngram_attention(..., plan=plan)``.
    """
    from .function import validate_ids_and_n

    ids, n = validate_ids_and_n(ids, n)
    return NGramPlan(*_ngram_plan_op(ids, n))
