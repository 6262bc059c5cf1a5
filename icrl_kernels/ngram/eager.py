"""Eager PyTorch version of the sort + segmented-sum algorithm (the CPU default).

Same plan and same math as the Triton kernels, written with row gathers (``index_select``),
``cumsum`` and row scatters (``index_copy_``). Segment sums come from float64 prefix sums (a
difference of two float64 prefixes is accurate to ~1e-16 of the prefix, far below fp32 rounding),
processed in chunks of the feature dimension so memory stays O(B * L * chunk).
"""

from __future__ import annotations

import torch

from .._library import empty_output
from .plan import PREVIOUS_ADJACENT, SEGMENT_START, VALID_NGRAM

_ELEMENTS_PER_CHUNK = 1 << 19  # 4 MiB float64 slabs: reused by the allocator, no fresh page faults per call


def _feature_chunks(batch: int, length: int, dim: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` column ranges holding about ``_ELEMENTS_PER_CHUNK`` elements of a ``[B, L, :]`` slab."""
    width = max(1, min(dim, _ELEMENTS_PER_CHUNK // max(1, batch * length)))
    return [(lo, min(dim, lo + width)) for lo in range(0, dim, width)]


def _flat_rows(index: torch.Tensor, rows_per_batch: int) -> torch.Tensor:
    """Per-batch row indices ``[B, L]`` into indices of the flattened ``[B * rows_per_batch]`` rows."""
    offsets = torch.arange(index.shape[0], device=index.device).unsqueeze(1) * rows_per_batch
    return (index + offsets).reshape(-1)


def _inverse_count(perm: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``1 / count`` in sorted order (0 where a query has no match), float64, ``[B, L, 1]``."""
    count_sorted = count.gather(1, perm).double()
    return torch.where(count_sorted > 0, 1.0 / count_sorted.clamp(min=1), 0.0).unsqueeze(-1)


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """``[B, L, C] -> [B * (L + 1), C]`` float64 with a zero row after each batch's rows."""
    batch, length, width = x.shape
    padded = torch.empty((batch, length + 1, width), dtype=torch.float64, device=x.device)
    padded[:, :length] = x
    padded[:, length] = 0
    return padded.view(-1, width)


def _inverse_rows(perm: torch.Tensor, rows_per_batch: int, shift: int = 0) -> torch.Tensor:
    """Flat indices that undo the sort: row ``perm[b, k] + shift`` of batch ``b`` reads sorted row ``k``.

    Original rows no sorted row maps to (``r < shift``) read the spare zero row ``rows_per_batch - 1``
    that the caller appends to each batch.
    """
    batch, length = perm.shape
    inverse = torch.full((batch, length + shift), rows_per_batch - 1, dtype=perm.dtype, device=perm.device)
    sorted_position = torch.arange(length, device=perm.device).expand(batch, length)
    inverse.scatter_(1, perm + shift, sorted_position)
    return _flat_rows(inverse[:, :length], rows_per_batch)


def ngram_forward_eager(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Output ``[B, L, D]`` of n-gram attention from a plan (see :mod:`.plan`)."""
    batch, length, dim = h.shape
    position = torch.arange(length, device=h.device).expand(batch, length)
    starts = (meta & SEGMENT_START) != 0
    segment_start = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=1).values
    segment_start_rows = _flat_rows(segment_start, length)
    previous_adjacent = ((meta[:, 1:] & PREVIOUS_ADJACENT) != 0).unsqueeze(-1).double()
    value_rows = _flat_rows(perm + 1, length + 1)  # the key at sorted k carries h[t_k + 1]
    out_rows = _inverse_rows(perm, length)
    inverse_count = _inverse_count(perm, count)

    out = empty_output((batch, length, dim), dtype=h.dtype, device=h.device)
    for lo, hi in _feature_chunks(batch, length, dim):
        values = _with_zero_row(h[:, :, lo:hi]).index_select(0, value_rows).view(batch, length, hi - lo)
        segment_sum = values.cumsum(dim=1).sub_(values)  # exclusive prefix sums
        segment_sum.sub_(segment_sum.view(-1, hi - lo).index_select(0, segment_start_rows).view_as(values))
        # The previous element of the segment at t - 1 is the key j = i: strictly excluded.
        segment_sum[:, 1:].sub_(values[:, :-1] * previous_adjacent)
        segment_sum.mul_(inverse_count)
        out[:, :, lo:hi] = segment_sum.view(-1, hi - lo).index_select(0, out_rows).view(batch, length, hi - lo)
    return out


def ngram_backward_eager(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Gradient ``[B, L, D]`` of n-gram attention w.r.t. ``h`` from a plan and ``grad_out``."""
    batch, length, dim = grad_out.shape
    position = torch.arange(length, device=grad_out.device).expand(batch, length)
    starts = (meta & SEGMENT_START) != 0
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    segment_last = torch.where(ends, position, torch.full_like(position, length - 1))
    segment_last_rows = _flat_rows(segment_last.flip(1).cummin(dim=1).values.flip(1), length)
    next_adjacent = ((meta[:, 1:] & PREVIOUS_ADJACENT) != 0).unsqueeze(-1).double()
    has_key = (((meta & VALID_NGRAM) != 0) & (perm + 1 < length)).unsqueeze(-1).double()
    query_rows = _flat_rows(perm, length)
    # Row t + 1 of grad_h reads the key at t's sorted position; row 0 (no key ends before it) reads a zero row.
    key_rows = _inverse_rows(perm, length + 1, shift=1)
    inverse_count = _inverse_count(perm, count)

    grad_h = empty_output((batch, length, dim), dtype=grad_out.dtype, device=grad_out.device)
    for lo, hi in _feature_chunks(batch, length, dim):
        flat_grad = grad_out[:, :, lo:hi].reshape(-1, hi - lo)
        weights = flat_grad.index_select(0, query_rows).view(batch, length, hi - lo).double().mul_(inverse_count)
        inclusive = weights.cumsum(dim=1)
        later_sum = inclusive.view(-1, hi - lo).index_select(0, segment_last_rows).view_as(inclusive).sub_(inclusive)
        # The next element of the segment at t + 1 is the query i = j: strictly excluded.
        later_sum[:, :-1].sub_(weights[:, 1:] * next_adjacent)
        later_sum.mul_(has_key)
        grad_h[:, :, lo:hi] = _with_zero_row(later_sum).index_select(0, key_rows).view(batch, length, hi - lo)
    return grad_h
