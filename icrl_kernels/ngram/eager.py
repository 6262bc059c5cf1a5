"""Eager PyTorch version of the sort + segmented-sum algorithm (the CPU default).

Same plan and same math as the Triton kernels, written with row gathers (``index_select``) and
``cumsum``. Segment sums come from float64 prefix sums (a difference of two float64 prefixes is
accurate to ~1e-16 of the prefix, far below fp32 rounding). Work is split into blocks of batch rows
and feature columns of about ``_ELEMENTS_PER_BLOCK`` elements: memory stays O(block) beyond the
inputs and outputs, and float64 buffers stay small enough for the allocator to reuse them (large
ones are mapped fresh and page-faulted in on every call, which dominated the run time).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .._library import empty_output
from .plan import PREVIOUS_ADJACENT, SEGMENT_START, VALID_NGRAM

_ELEMENTS_PER_BLOCK = 1 << 19
# Measured on a 2-core x86 CPU: row gathers of fewer than ~16 values are slow, and cumsum along L of
# blocks wider than ~64 columns slows down per element (strided passes fall out of cache).
_MIN_BLOCK_WIDTH, _MAX_BLOCK_WIDTH = 16, 64


def _blocks(batch: int, length: int, dim: int) -> Iterator[tuple[slice, list[tuple[int, int]]]]:
    """Batch-row slices, each with its ``[lo, hi)`` feature-column ranges."""
    width = min(dim, max(_MIN_BLOCK_WIDTH, min(_MAX_BLOCK_WIDTH, _ELEMENTS_PER_BLOCK // length)))
    rows = max(1, min(batch, _ELEMENTS_PER_BLOCK // (length * width)))
    columns = [(lo, min(dim, lo + width)) for lo in range(0, dim, width)]
    for first in range(0, batch, rows):
        yield slice(first, min(batch, first + rows)), columns


def _flat_rows(index: torch.Tensor, rows_per_batch: int) -> torch.Tensor:
    """Per-batch row indices ``[B, L]`` into indices of the flattened ``[B * rows_per_batch]`` rows."""
    offsets = torch.arange(index.shape[0], device=index.device).unsqueeze(1) * rows_per_batch
    return (index + offsets).reshape(-1)


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


def ngram_forward_eager(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Output ``[B, L, D]`` of n-gram attention from a plan (see :mod:`.plan`)."""
    batch, length, dim = h.shape
    out = empty_output((batch, length, dim), dtype=h.dtype, device=h.device)
    for rows, columns in _blocks(batch, length, dim):
        perm_rows, meta_rows = perm[rows], meta[rows]
        size = perm_rows.shape[0]
        position = torch.arange(length, device=h.device).expand(size, length)
        starts = (meta_rows & SEGMENT_START) != 0
        segment_start = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=1).values
        segment_start_rows = _flat_rows(segment_start, length)
        previous_adjacent = ((meta_rows[:, 1:] & PREVIOUS_ADJACENT) != 0).unsqueeze(-1).double()
        value_rows = _flat_rows(perm_rows + 1, length + 1)  # the key at sorted k carries h[t_k + 1]
        out_rows = _inverse_rows(perm_rows, length)
        inverse_count = _inverse_count(perm_rows, count[rows])
        for lo, hi in columns:
            width = hi - lo
            values = _with_zero_row(h[rows, :, lo:hi]).index_select(0, value_rows).view(size, length, width)
            segment_sum = values.cumsum(dim=1).sub_(values)  # exclusive prefix sums
            segment_sum.sub_(segment_sum.view(-1, width).index_select(0, segment_start_rows).view_as(values))
            # The previous element of the segment at t - 1 is the key j = i: strictly excluded.
            segment_sum[:, 1:].sub_(values[:, :-1] * previous_adjacent)
            segment_sum.mul_(inverse_count)
            out[rows, :, lo:hi] = segment_sum.view(-1, width).index_select(0, out_rows).view(size, length, width)
    return out


def ngram_backward_eager(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Gradient ``[B, L, D]`` of n-gram attention w.r.t. ``h`` from a plan and ``grad_out``."""
    batch, length, dim = grad_out.shape
    grad_h = empty_output((batch, length, dim), dtype=grad_out.dtype, device=grad_out.device)
    for rows, columns in _blocks(batch, length, dim):
        perm_rows, meta_rows = perm[rows], meta[rows]
        size = perm_rows.shape[0]
        position = torch.arange(length, device=grad_out.device).expand(size, length)
        starts = (meta_rows & SEGMENT_START) != 0
        ends = torch.ones_like(starts)
        ends[:, :-1] = starts[:, 1:]
        segment_last = torch.where(ends, position, torch.full_like(position, length - 1))
        segment_last_rows = _flat_rows(segment_last.flip(1).cummin(dim=1).values.flip(1), length)
        next_adjacent = ((meta_rows[:, 1:] & PREVIOUS_ADJACENT) != 0).unsqueeze(-1).double()
        has_key = (((meta_rows & VALID_NGRAM) != 0) & (perm_rows + 1 < length)).unsqueeze(-1).double()
        query_rows = _flat_rows(perm_rows, length)
        # Row t + 1 of grad_h reads the key at t's sorted position; row 0 (no key ends before it) a zero row.
        key_rows = _inverse_rows(perm_rows, length + 1, shift=1)
        inverse_count = _inverse_count(perm_rows, count[rows])
        for lo, hi in columns:
            width = hi - lo
            flat_grad = grad_out[rows, :, lo:hi].reshape(-1, width)
            weights = flat_grad.index_select(0, query_rows).view(size, length, width).double().mul_(inverse_count)
            inclusive = weights.cumsum(dim=1)
            later_sum = inclusive.view(-1, width).index_select(0, segment_last_rows).view_as(inclusive)
            later_sum.sub_(inclusive)
            # The next element of the segment at t + 1 is the query i = j: strictly excluded.
            later_sum[:, :-1].sub_(weights[:, 1:] * next_adjacent)
            later_sum.mul_(has_key)
            grad_h[rows, :, lo:hi] = _with_zero_row(later_sum).index_select(0, key_rows).view(size, length, width)
    return grad_h
