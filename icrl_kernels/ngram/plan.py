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
Building it reads no tensor value on the host (:func:`ngram_keys` chooses its encoding from shapes and
dtypes only), so on a GPU it is a queue of kernels with no synchronisation. This module holds the plan
and its PyTorch build; :mod:`.plan_kernels` builds the same plan in Triton, and the public
:func:`icrl_kernels.ngram_plan` (a custom op, in :mod:`.function`) picks one of the two.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .._validation import INT_DTYPES, check_int, check_same_device, check_shape, check_tensor

#: Bits of :attr:`NGramPlan.meta` (per sorted position k).
SEGMENT_START = 1  # k starts a new n-gram segment
PREVIOUS_ADJACENT = 2  # the previous element of the segment is position perm[k] - 1
VALID_NGRAM = 4  # the n-gram ending at perm[k] is in range and has no padding

#: Packed keys stay below this bound (int64 holds every value up to ``2**63 - 1``).
_KEY_LIMIT = 2**63


class NGramPlan:
    """Precomputed matching structure for one ``(ids, n)``; reusable across layers with the same n.

    Build it with :func:`ngram_plan`. It remembers what it was built from, so that
    ``ngram_attention(h, ids, n, plan=plan)`` can reject a plan of other ids or another ``n`` (a plan
    of other ids would silently give wrong outputs). Iterating yields ``(perm, meta, count)``.

    Attributes:
        perm: ``[B, L]`` int64, positions sorted by (n-gram ending there, position).
        meta: ``[B, L]`` uint8, flags per sorted position (``SEGMENT_START | PREVIOUS_ADJACENT | VALID_NGRAM``).
        count: ``[B, L]`` int32, number of keys each query position matches (0: output row is zero).
        ids: ``[B, L]`` the integer ids the plan was built from (kept by reference, not copied).
        n: the n-gram length it was built for.

    Raises:
        TypeError: a field is not a tensor of the dtype above, or ``n`` is not an int.
        ValueError: the tensors differ in shape or device, or ``n < 1``.
    """

    __slots__ = ("perm", "meta", "count", "ids", "n", "_ids_version")
    _fields = ("perm", "meta", "count")

    def __init__(
        self, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor, *, ids: torch.Tensor, n: int
    ) -> None:
        check_tensor(ids, "ids", ndim=2, dtypes=INT_DTYPES)
        for name, value, dtype in (
            ("perm", perm, torch.int64),
            ("meta", meta, torch.uint8),
            ("count", count, torch.int32),
        ):
            check_tensor(value, f"plan.{name}", dtypes=(dtype,))
            check_shape(value, f"plan.{name}", tuple(ids.shape), "ids.shape")
        check_same_device(ids=ids, **{"plan.perm": perm, "plan.meta": meta, "plan.count": count})
        self.perm, self.meta, self.count = perm, meta, count
        self.ids = ids
        self.n = check_int(n, "n", min_value=1)
        # In-place writes to ``ids`` after the build bump its version: ngram_attention then refuses the plan.
        self._ids_version = ids._version

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.perm, self.meta, self.count))

    def __repr__(self) -> str:
        return f"NGramPlan(n={self.n}, shape={tuple(self.perm.shape)}, device={self.perm.device})"


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


def _dense_rank_rows(values: torch.Tensor) -> torch.Tensor:
    """Rank of each value among the distinct values of its row (order-preserving), in ``[0, L)``.

    One row-wise sort, a cumulative sum of "differs from the previous sorted value" and a scatter back:
    no output whose size depends on the data (``torch.unique`` would read the number of distinct values
    on the host), so nothing waits for the device.
    """
    sorted_values, order = torch.sort(values, dim=1)
    new_value = torch.zeros_like(sorted_values)
    new_value[:, 1:] = sorted_values[:, 1:] != sorted_values[:, :-1]
    return torch.empty_like(new_value).scatter_(1, order, new_value.cumsum(dim=1))


#: Largest id + 1 of the integer dtypes narrower than int64 (ids are clamped at 0 first).
_DTYPE_VOCAB = {torch.uint8: 2**8, torch.int8: 2**7, torch.int16: 2**15, torch.int32: 2**31}


def ngram_keys(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact integer identity of the n-gram ending at each position, computed without reading a value on
    the host (the choice of encoding depends only on ``n``, ``L`` and the dtype of ``ids``).

    Keys order the n-grams lexicographically (oldest id most significant), which makes the plan's
    permutation independent of the encoding:

    - ``n == 1``: the id itself;
    - ids narrower than int64 with ``V^n <= 2^63`` (``V`` = the dtype's largest id + 1): the ids packed
      in base ``V``, ``sum_k ids[t-k] * V^k``;
    - otherwise: ids are replaced by their rank within the row (``< L``, one row-wise sort) and packed
      in base ``L``; when ``L^m`` would pass ``2^63``, the ``m``-gram keys are re-ranked (one more sort)
      and packing goes on from the ranks. Exact for any vocabulary.

    Returns:
        ``(keys [B, L] int64, valid [B, L] bool)``; invalid positions have key ``-1``.
    """
    valid = ngram_valid(ids, n)
    if n > ids.shape[1]:  # no n-gram fits in the row: O(1) in n (no packing loop of n - 1 steps)
        return torch.full(ids.shape, -1, dtype=torch.int64, device=ids.device), valid
    tokens = ids.clamp(min=0).long()
    if n == 1:
        keys = tokens
    else:
        base = _DTYPE_VOCAB.get(ids.dtype)
        if base is None or base**n > _KEY_LIMIT:
            base = max(1, ids.shape[1])
            tokens = _dense_rank_rows(tokens)
        keys, bound = tokens, base  # keys < bound
        for _ in range(n - 1):
            if bound * base > _KEY_LIMIT:
                keys, bound = _dense_rank_rows(keys), ids.shape[1]
            # (n-gram ending at t-1, token t) -> the longer n-gram ending at t.
            keys, bound = _shift_right(keys, 1) * base + tokens, bound * base
    return torch.where(valid, keys, torch.full_like(keys, -1)), valid


def build_ngram_plan(ids: torch.Tensor, n: int) -> NGramPlan:
    """Sort positions by n-gram and derive segment flags and match counts (see the module docstring)."""
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
    return NGramPlan(perm, meta, count, ids=ids, n=n)
