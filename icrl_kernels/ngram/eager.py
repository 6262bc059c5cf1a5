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

_ELEMENTS_PER_CHUNK = 1 << 24


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
    return torch.nn.functional.pad(x.double(), (0, 0, 0, 1)).reshape(-1, x.shape[-1])


def ngram_forward_eager(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Output ``[B, L, D]`` of n-gram attention from a plan (see :mod:`.plan`)."""
    batch, length, dim = h.shape
    position = torch.arange(length, device=h.device).expand(batch, length)
    starts = (meta & SEGMENT_START) != 0
    segment_start = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=1).values
    segment_start_rows = _flat_rows(segment_start, length)
    previous_adjacent = ((meta[:, 1:] & PREVIOUS_ADJACENT) != 0).unsqueeze(-1).double()
    value_rows = _flat_rows(perm + 1, length + 1)  # the key at sorted k carries h[t_k + 1]
    out_rows = _flat_rows(perm, length)
    inverse_count = _inverse_count(perm, count)

    out = empty_output((batch, length, dim), dtype=h.dtype, device=h.device)
    for lo, hi in _feature_chunks(batch, length, dim):
        values = _with_zero_row(h[:, :, lo:hi]).index_select(0, value_rows).view(batch, length, hi - lo)
        segment_sum = values.cumsum(dim=1).sub_(values)  # exclusive prefix sums
        segment_sum.sub_(segment_sum.view(-1, hi - lo).index_select(0, segment_start_rows).view_as(values))
        # The previous element of the segment at t - 1 is the key j = i: strictly excluded.
        segment_sum[:, 1:].sub_(values[:, :-1] * previous_adjacent)
        segment_sum.mul_(inverse_count)
        chunk = torch.empty((batch * length, hi - lo), dtype=h.dtype, device=h.device)
        chunk.index_copy_(0, out_rows, segment_sum.view(-1, hi - lo).to(h.dtype))
        out[:, :, lo:hi] = chunk.view(batch, length, hi - lo)
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
    key_rows = _flat_rows(perm + 1, length + 1)
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
        # Key at sorted k writes row t_k + 1; row 0 (no key ends before it) and the spare row L stay 0.
        chunk = torch.zeros((batch * (length + 1), hi - lo), dtype=torch.float64, device=grad_out.device)
        chunk.index_copy_(0, key_rows, later_sum.view(-1, hi - lo))
        grad_h[:, :, lo:hi] = chunk.view(batch, length + 1, hi - lo)[:, :length].to(grad_out.dtype)
    return grad_h
