"""Triton kernels that build the n-gram plan (:mod:`.plan`) in a handful of launches.

:func:`.plan.build_ngram_plan` writes the plan with about 40 small PyTorch ops (key packing, a sort,
segment flags, a running max, a scatter). On a GPU each op is a launch of a few microseconds of work and
several of host time: profiled on an H200 (B = 16, L = 4096, D = 512, fp32), an n-gram forward +
backward took 1.8-2.0 ms of which the device was busy 0.45-0.5 ms, over 66 launches, most of them the
plan's. Here the same plan takes, for int64 ids and ``n >= 2``: one ``torch.sort`` of the ids and a rank
kernel (the ids' dense ranks, so that ``n`` ranks pack into one int64 key), a key kernel, the
``torch.sort`` of the keys, and a meta kernel (segment flags, match counts) -- five launches (ids of a
narrower dtype, or ``n == 1``, skip the first two). Prediction (not measured): the plan's share of host
time falls from ~1 ms to ~0.2 ms per call.

Outputs are identical to :func:`.plan.build_ngram_plan` (the tests compare them bit for bit):

* key of the n-gram ending at ``t`` (``t >= n - 1``, no padding id in it): its tokens packed oldest
  first, ``sum_j tok[t - n + 1 + j] * base^(n - 1 - j)``, with ``tok`` the id clamped at 0 and ``base``
  the dtype's id range, or ``tok`` the id's dense rank in its row and ``base = L`` when that range
  does not pack (int64 ids). Invalid positions get key ``-1``; valid keys are ``>= 0``, so a sorted
  position's validity is its key's sign and needs no gather.
* meta and count from the sorted keys and the permutation: a segment starts where the key changes, the
  previous element is adjacent when its position is one less, and the match count is the distance to
  the segment start minus the adjacency (zero when invalid); the segment start is a running max,
  carried across the row's tiles, so one program walks one row.

Rows of more than :data:`_KEY_LIMIT`-overflowing ``base^n`` (``n`` ranks of ``L`` positions that do
not fit 63 bits, e.g. ``n >= 6`` at ``L = 4096``) keep the PyTorch plan, which re-ranks between packs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import cdiv, launch
from .kernels import _max_combine
from .plan import _DTYPE_VOCAB, _KEY_LIMIT, PREVIOUS_ADJACENT, SEGMENT_START, VALID_NGRAM, build_ngram_plan

#: Positions per tile of every plan kernel (one program walks a row in tiles of this many).
PLAN_BLOCK_L = 1024
_PLAN_WARPS = 4


@triton.jit
def _ngram_rank_kernel(sorted_ids_ptr, order_ptr, rank_ptr, L, BLOCK_L: tl.constexpr):
    """One row: ``rank[order[k]]`` = number of distinct clamped ids below ``sorted_ids[k]`` (the row's ids
    sorted ascending; clamping at 0 keeps them sorted, so the padding ids share rank 0 with id 0)."""
    row_start = tl.program_id(0).to(tl.int64) * L
    carry = tl.zeros((), dtype=tl.int32)  # rank of the previous tile's last id
    for start in range(0, L, BLOCK_L):
        k = start + tl.arange(0, BLOCK_L)
        in_row = k < L
        has_previous = in_row & (k > 0)
        value = tl.maximum(tl.load(sorted_ids_ptr + row_start + k, mask=in_row, other=0).to(tl.int64), 0)
        previous = tl.maximum(tl.load(sorted_ids_ptr + row_start + k - 1, mask=has_previous, other=0).to(tl.int64), 0)
        # The first id of a tile compares with the previous tile's last one (read from memory), so only
        # the rank itself is carried.
        rank = tl.cumsum((has_previous & (value != previous)).to(tl.int32), 0) + carry
        order = tl.load(order_ptr + row_start + k, mask=in_row, other=0)
        tl.store(rank_ptr + row_start + order, rank.to(tl.int64), mask=in_row)
        carry = tl.max(tl.where(in_row, rank, 0), 0)  # ranks never decrease along the sorted row


@triton.jit
def _ngram_keys_kernel(ids_ptr, rank_ptr, keys_ptr, L, n, base, RANKED: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``(row, tile)``: the packed key of the n-gram ending at each position of the tile (``-1``
    where it starts before the row or holds a padding id). Tokens are the clamped ids, or their ranks
    when ``RANKED``."""
    row_start = tl.program_id(0).to(tl.int64) * L
    t = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    valid = (t < L) & (t >= n - 1)
    key = tl.zeros([BLOCK_L], dtype=tl.int64)
    for j in range(0, n):  # oldest token first: it ends up the most significant digit
        position = t - (n - 1) + j
        ids = tl.load(ids_ptr + row_start + position, mask=valid, other=0).to(tl.int64)
        valid = valid & (ids >= 0)
        if RANKED:
            token = tl.load(rank_ptr + row_start + position, mask=valid, other=0)
        else:
            token = tl.maximum(ids, 0)
        key = key * base + token
    tl.store(keys_ptr + row_start + t, tl.where(valid, key, -1), mask=t < L)


@triton.jit
def _ngram_meta_kernel(
    sorted_keys_ptr, perm_ptr, meta_ptr, count_ptr, L,
    SEGMENT_START_BIT: tl.constexpr, ADJACENT_BIT: tl.constexpr, VALID_BIT: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """One row: the flags of every sorted position (``meta``) and the match count of every position
    (``count``, scattered back through ``perm``)."""
    row_start = tl.program_id(0).to(tl.int64) * L
    segment_carry = tl.zeros((), dtype=tl.int32)  # start of the segment open at the tile's first position
    for start in range(0, L, BLOCK_L):
        k = start + tl.arange(0, BLOCK_L)
        in_row = k < L
        has_previous = in_row & (k > 0)
        key = tl.load(sorted_keys_ptr + row_start + k, mask=in_row, other=-1)
        previous_key = tl.load(sorted_keys_ptr + row_start + k - 1, mask=has_previous, other=-1)
        position = tl.load(perm_ptr + row_start + k, mask=in_row, other=0)
        previous_position = tl.load(perm_ptr + row_start + k - 1, mask=has_previous, other=0)
        starts = (k == 0) | (key != previous_key)
        adjacent = (~starts) & (position == previous_position + 1)
        valid = key >= 0
        segment_start = tl.associative_scan(tl.where(starts, k, 0), 0, _max_combine)
        segment_start = tl.maximum(segment_start, segment_carry)
        count = tl.where(valid, k - segment_start - adjacent.to(tl.int32), 0)
        meta = (starts.to(tl.int32) * SEGMENT_START_BIT + adjacent.to(tl.int32) * ADJACENT_BIT
                + valid.to(tl.int32) * VALID_BIT)  # fmt: skip
        tl.store(meta_ptr + row_start + k, meta.to(tl.uint8), mask=in_row)
        tl.store(count_ptr + row_start + position, count, mask=in_row)
        segment_carry = tl.max(tl.where(in_row, segment_start, 0), 0)


def ngram_keys_triton(ids: torch.Tensor, n: int) -> torch.Tensor | None:
    """``[B, L]`` int64 keys as :func:`.plan.ngram_keys` gives them at valid positions (``-1`` elsewhere),
    or ``None`` where ``n`` ranks do not pack into 63 bits (the caller then uses the PyTorch plan)."""
    batch, length = ids.shape
    keys = empty_output((batch, length), dtype=torch.int64, device=ids.device)
    if n > length:  # no n-gram fits in a row (the key kernel would loop n times for nothing)
        return keys.fill_(-1)
    base = _DTYPE_VOCAB.get(ids.dtype) if n > 1 else 1
    ranked = base is None or base**n > _KEY_LIMIT
    if ranked:
        base = max(1, length)
        if base**n > _KEY_LIMIT:
            return None
        sorted_ids, order = torch.sort(ids, dim=1)
        ranks = empty_output((batch, length), dtype=torch.int64, device=ids.device)
        launch(_ngram_rank_kernel, (batch,))(sorted_ids, order, ranks, length, BLOCK_L=PLAN_BLOCK_L,
                                             num_warps=_PLAN_WARPS)  # fmt: skip
    else:
        ranks = keys  # not read (RANKED is False): any int64 pointer
    launch(_ngram_keys_kernel, (batch, cdiv(length, PLAN_BLOCK_L)))(
        ids, ranks, keys, length, n, base, RANKED=ranked, BLOCK_L=PLAN_BLOCK_L, num_warps=_PLAN_WARPS
    )
    return keys


def build_ngram_plan_triton(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(perm, meta, count)`` of :func:`.plan.build_ngram_plan` for ``ids [B, L]`` on a Triton device."""
    ids = ids.contiguous()
    keys = ngram_keys_triton(ids, n)
    if keys is None:
        return tuple(build_ngram_plan(ids, n))
    batch, length = ids.shape
    sorted_keys, perm = torch.sort(keys, dim=1, stable=True)
    meta = empty_output((batch, length), dtype=torch.uint8, device=ids.device)
    count = empty_output((batch, length), dtype=torch.int32, device=ids.device)
    launch(_ngram_meta_kernel, (batch,))(
        sorted_keys, perm, meta, count, length,
        SEGMENT_START_BIT=SEGMENT_START, ADJACENT_BIT=PREVIOUS_ADJACENT, VALID_BIT=VALID_NGRAM,
        BLOCK_L=PLAN_BLOCK_L, num_warps=_PLAN_WARPS,
    )  # fmt: skip
    return perm, meta, count
