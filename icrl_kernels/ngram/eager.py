"""Eager PyTorch version of the sort + segmented-sum algorithm (the CPU default).

Same plan and same math as the Triton kernels, written with row gathers (``index_select``) and a
segmented running sum in float64 (:func:`segmented_cumsum`) that restarts at every segment start:
each output depends on its own n-gram segment only, so an outlier (``1e30``, ``inf``, ``nan``) in one
segment cannot cancel or poison another (a prefix sum over the whole sorted row did). Work is split into
blocks of batch rows and feature columns of about ``_ELEMENTS_PER_BLOCK`` elements: memory stays O(block) beyond the
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


def segmented_cumsum(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Inclusive running sum of ``x [S, L, W]`` along ``L`` that restarts wherever ``starts [S, L]`` (bool).

    Every sum kept adds values of one segment only, so a huge or non-finite value changes nothing
    outside its own segment (a prefix sum over the whole row followed by differences would cancel
    ``1e20 + 1 - 1e20`` to 0 and turn ``inf - inf`` into nan in every later segment). Pairwise
    recursion: scan the sums of adjacent pairs (half as many rows), then fill in the even rows.
    ``2 L`` element operations over ``log2 L`` levels.
    """
    length = x.shape[1]
    if length == 1:
        return x.clone()
    if length % 2:  # one zero row that starts its own segment: changes no other row
        x = torch.cat([x, x.new_zeros(x.shape[0], 1, x.shape[2])], dim=1)
        starts = torch.cat([starts, starts.new_ones(starts.shape[0], 1)], dim=1)
    left, right = x[:, 0::2], x[:, 1::2]
    left_starts, right_starts = starts[:, 0::2], starts[:, 1::2]
    # torch.where, not a multiply by 0/1: the discarded cross-segment sum never enters a kept value.
    pair_scan = segmented_cumsum(
        torch.where(right_starts.unsqueeze(-1), right, left + right), left_starts | right_starts
    )
    out = torch.empty_like(x)
    out[:, 1::2] = pair_scan
    out[:, 0] = x[:, 0]
    out[:, 2::2] = torch.where(left_starts[:, 1:].unsqueeze(-1), left[:, 1:], pair_scan[:, :-1] + left[:, 1:])
    return out[:, :length]


def ngram_forward_eager(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Output ``[B, L, D]`` of n-gram attention from a plan (see :mod:`.plan`).

    In sorted order, the query at ``k`` sums the values ``v(m) = h[perm[m] + 1]`` of the earlier
    elements ``m < k`` of its segment, without ``v(k - 1)`` when that key is ``j = i``
    (``PREVIOUS_ADJACENT``): ``scan(k - 2) + v(k - 1)``, each term kept only where it lies in the
    segment. Nothing is subtracted, so each output depends on its own segment's values only.
    """
    batch, length, dim = h.shape
    out = empty_output((batch, length, dim), dtype=h.dtype, device=h.device)
    for rows, columns in _blocks(batch, length, dim):
        perm_rows, meta_rows = perm[rows], meta[rows]
        size = perm_rows.shape[0]
        starts = (meta_rows & SEGMENT_START) != 0
        adjacent = (meta_rows & PREVIOUS_ADJACENT) != 0
        # k - 1 (and k - 2) lie in k's segment; the key at k - 1 is taken unless it is j = i.
        take_previous = (~starts[:, 1:] & ~adjacent[:, 1:]).unsqueeze(-1)
        take_scan = (~starts[:, 2:] & ~starts[:, 1:-1]).unsqueeze(-1)
        value_rows = _flat_rows(perm_rows + 1, length + 1)  # the key at sorted k carries h[t_k + 1]
        out_rows = _inverse_rows(perm_rows, length)
        inverse_count = _inverse_count(perm_rows, count[rows])
        has_match = inverse_count > 0
        for lo, hi in columns:
            width = hi - lo
            values = _with_zero_row(h[rows, :, lo:hi]).index_select(0, value_rows).view(size, length, width)
            scan = segmented_cumsum(values, starts)
            total = torch.zeros_like(values)
            total[:, 1:] = torch.where(take_previous, values[:, :-1], 0.0)
            total[:, 2:] += torch.where(take_scan, scan[:, :-2], 0.0)
            # where, not a multiply: an invalid query's (padding) segment sum may be inf, and inf * 0 = nan.
            total = torch.where(has_match, total * inverse_count, 0.0)
            out[rows, :, lo:hi] = total.view(-1, width).index_select(0, out_rows).view(size, length, width)
    return out


def ngram_backward_eager(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Gradient ``[B, L, D]`` of n-gram attention w.r.t. ``h`` from a plan and ``grad_out``.

    The key at sorted ``k`` (value ``h[perm[k] + 1]``) receives the weights ``w(m) = grad_out[perm[m]] /
    count`` of the later elements ``m > k`` of its segment, without ``w(k + 1)`` when that query is
    ``i = j``: ``w(k + 1) + suffix_scan(k + 2)``, each term kept only inside the segment (the mirror of
    the forward; no subtraction).
    """
    batch, length, dim = grad_out.shape
    grad_h = empty_output((batch, length, dim), dtype=grad_out.dtype, device=grad_out.device)
    for rows, columns in _blocks(batch, length, dim):
        perm_rows, meta_rows = perm[rows], meta[rows]
        size = perm_rows.shape[0]
        starts = (meta_rows & SEGMENT_START) != 0
        adjacent = (meta_rows & PREVIOUS_ADJACENT) != 0
        ends = torch.ones_like(starts)
        ends[:, :-1] = starts[:, 1:]
        take_next = (~starts[:, 1:] & ~adjacent[:, 1:]).unsqueeze(-1)
        take_scan = (~starts[:, 1:-1] & ~starts[:, 2:]).unsqueeze(-1)
        has_key = (((meta_rows & VALID_NGRAM) != 0) & (perm_rows + 1 < length)).unsqueeze(-1)
        query_rows = _flat_rows(perm_rows, length)
        # Row t + 1 of grad_h reads the key at t's sorted position; row 0 (no key ends before it) a zero row.
        key_rows = _inverse_rows(perm_rows, length + 1, shift=1)
        inverse_count = _inverse_count(perm_rows, count[rows])
        has_match = inverse_count > 0
        for lo, hi in columns:
            width = hi - lo
            flat_grad = grad_out[rows, :, lo:hi].reshape(-1, width)
            gathered = flat_grad.index_select(0, query_rows).view(size, length, width).double()
            weights = torch.where(has_match, gathered * inverse_count, 0.0)
            suffix = segmented_cumsum(weights.flip(1), ends.flip(1)).flip(1)
            total = torch.zeros_like(weights)
            total[:, :-1] = torch.where(take_next, weights[:, 1:], 0.0)
            total[:, :-2] += torch.where(take_scan, suffix[:, 2:], 0.0)
            total = torch.where(has_key, total, 0.0)
            grad_h[rows, :, lo:hi] = _with_zero_row(total).index_select(0, key_rows).view(size, length, width)
    return grad_h
