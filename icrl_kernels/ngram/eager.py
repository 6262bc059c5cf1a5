"""Eager PyTorch version of the sort + segmented-sum algorithm (the CPU default).

Same plan and same math as the Triton kernels, written with ``gather`` / ``cumsum`` / ``scatter``.
Segment sums come from float64 prefix sums (a difference of two float64 prefixes is accurate to
~1e-16 of the prefix, far below fp32 rounding), processed in chunks of the feature dimension so
memory stays O(B * L * chunk).
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


def _shift_down(x: torch.Tensor) -> torch.Tensor:
    """``out[:, k] = x[:, k - 1]`` along dim 1, zero at ``k = 0``."""
    return torch.nn.functional.pad(x[:, :-1], (0, 0, 1, 0))


def _shift_up(x: torch.Tensor) -> torch.Tensor:
    """``out[:, k] = x[:, k + 1]`` along dim 1, zero at the end."""
    return torch.nn.functional.pad(x[:, 1:], (0, 0, 0, 1))


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _inverse_count(perm: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``1 / count`` in sorted order (0 where a query has no match), float64, ``[B, L, 1]``."""
    count_sorted = count.gather(1, perm).double()
    return torch.where(count_sorted > 0, 1.0 / count_sorted.clamp(min=1), 0.0).unsqueeze(-1)


def ngram_forward_eager(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Output ``[B, L, D]`` of n-gram attention from a plan (see :mod:`.plan`)."""
    batch, length, dim = h.shape
    position = torch.arange(length, device=h.device).expand(batch, length)
    starts = (meta & SEGMENT_START) != 0
    previous_adjacent = ((meta & PREVIOUS_ADJACENT) != 0).unsqueeze(-1)
    segment_start = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=1).values
    inverse_count = _inverse_count(perm, count)
    inverse_perm = torch.empty_like(perm).scatter_(1, perm, position.contiguous())

    out = empty_output((batch, length, dim), dtype=h.dtype, device=h.device)
    for lo, hi in _feature_chunks(batch, length, dim):
        padded = torch.nn.functional.pad(h[:, :, lo:hi].double(), (0, 0, 0, 1))  # row L is the zero key value
        values = _gather_rows(padded, perm + 1)  # value of the key at sorted k: h[t_k + 1]
        exclusive = values.cumsum(dim=1) - values
        segment_sum = exclusive - _gather_rows(exclusive, segment_start)
        # The previous element of the segment at t - 1 is the key j = i: strictly excluded.
        segment_sum = segment_sum - previous_adjacent * _shift_down(values)
        out[:, :, lo:hi] = _gather_rows(segment_sum * inverse_count, inverse_perm).to(h.dtype)
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
    segment_last = segment_last.flip(1).cummin(dim=1).values.flip(1)
    next_adjacent = torch.zeros_like(starts)
    next_adjacent[:, :-1] = (meta[:, 1:] & PREVIOUS_ADJACENT) != 0
    has_key = ((meta & VALID_NGRAM) != 0) & (perm + 1 < length)
    key_scale = has_key.unsqueeze(-1).double()
    inverse_count = _inverse_count(perm, count)

    grad_h = empty_output((batch, length, dim), dtype=grad_out.dtype, device=grad_out.device)
    for lo, hi in _feature_chunks(batch, length, dim):
        weights = _gather_rows(grad_out[:, :, lo:hi].double(), perm) * inverse_count  # query at sorted k
        inclusive = weights.cumsum(dim=1)
        later_sum = _gather_rows(inclusive, segment_last) - inclusive
        # The next element of the segment at t + 1 is the query i = j: strictly excluded.
        later_sum = (later_sum - next_adjacent.unsqueeze(-1) * _shift_up(weights)) * key_scale
        padded = torch.zeros((batch, length + 1, hi - lo), dtype=torch.float64, device=grad_out.device)
        padded.scatter_(1, (perm + 1).unsqueeze(-1).expand(-1, -1, hi - lo), later_sum)
        grad_h[:, :, lo:hi] = padded[:, :length].to(grad_out.dtype)
    return grad_h
