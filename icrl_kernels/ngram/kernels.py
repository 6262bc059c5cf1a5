"""Triton kernels of n-gram match attention: segmented running sums over a sorted plan.

**Work split.** Each batch row's ``L`` sorted positions (:mod:`.plan`) are cut into chunks of
``CHUNK_L`` positions; one program owns one (row, chunk, block of ``BLOCK_D`` feature columns) and walks
its chunk in tiles of ``BLOCK_L``. Inside a tile, ``tl.associative_scan`` computes a running sum that
restarts at every segment boundary; a per-column carry continues the open segment into the next tile.
A segment may cross chunk boundaries, so each direction runs in two passes:

1. a *carry* kernel gives every chunk but one its open-segment sum at its outgoing edge, which only
   needs the rows from the chunk's last segment boundary to that edge (a short tail unless one n-gram
   fills the chunk), and the position of that boundary (``-1``: none in the chunk);
2. the main kernel first *looks back* over those finished partials (nearest chunk first, until one
   holds a boundary: O(1) chunks unless a segment spans many) to get its incoming carry, then computes
   its chunk.

:func:`chunk_length` picks ``CHUNK_L`` from ``B``, ``L`` and ``D`` (host arithmetic on shapes) so that
the grid has at least ``4 * 132`` programs (4 per H100 SM) wherever ``L`` allows.

**Fewer gathers.** The forward at sorted position ``k`` needs the running sum of the values
``v(m) = h[perm[m] + 1]`` of the earlier segment elements, minus ``v(k - 1)`` when that key is ``j = i``
(:data:`.plan.PREVIOUS_ADJACENT`). Scanning ``y(k) = v(k - 1)`` (zero at a segment start) instead of
``v(k)`` leaves the *exclusive* segmented sum of ``y`` (the rows before ``k``) plus ``y(k)`` unless
``adj(k)``, a value in registers: ``h`` is gathered once per position, not twice. The match count is
``k - segment_start(k) - adj(k)`` (zero for invalid n-grams), a scan of the meta bits, so the forward
does not read ``count`` at all. The backward mirrors it: it scans ``x(k) = w(k + 1)`` (the weight
``grad_out[perm[k+1]] / count`` of the next segment element) from the end, so ``grad_out`` and ``count``
are gathered once per position.

**Prefetch.** The plan entries (``perm``, ``meta``) of tile ``i + 1`` are loaded at the top of tile
``i``, before tile ``i``'s gathers of ``h`` / ``grad_out`` that depend on ``perm``: the loop-carried
registers turn the per-tile chain "load perm -> gather rows -> scan -> store" into "gather rows -> scan
-> store" with the next plan load in flight meanwhile (the forward's former third link, the ``count``
gather, is gone; the backward's ``count`` and ``grad_out`` gathers are independent and issue together).

**Bytes (prediction, H100, per forward + backward; ``s`` = itemsize, N = B L D).** Before: the forward
read ``h`` once plus once more for every adjacent pair (``1 + a`` times; ``a`` = fraction of positions
whose previous segment element is ``t - 1``, up to 1 for a repeated token), the backward ``grad_out``
likewise; with the two writes, ``(4 + 2a) N s`` bytes, plus one ``count`` gather per position in the
forward and two in the backward, on only ``B * D / BLOCK_D`` = 64 to 256 programs at B = 16, D = 512
(0.5 to 2 per SM: latency-bound, one dependent chain of 3 to 4 loads per tile and program). After:
``h`` and ``grad_out`` are read once each, ``out`` and ``grad_h`` written once (``4 N s``), plus the
carry passes' tails (``2 f N s``; ``f`` = mean tail fraction of a chunk: small for short segments, at
most 1 when one n-gram fills whole chunks), ``~13 B L`` bytes of plan per pass and ``8 B D chunks``
bytes of partials (360 KB below). At B = 16, L = 4096, D = 512 bf16: ``4 N s`` = 268 MB, ~80 us at
3.35 TB/s; 40% of copy bandwidth allows 200 us. Grid: 11 chunks of 384 positions, 704 (``BLOCK_D`` =
128) to 2816 (``BLOCK_D`` = 32) programs; at B = 8, 32 chunks of 128, 1024 to 4096 programs.

**Segment isolation.** Each sum combines values of one segment only: the scan's combine restarts at
segment starts with ``tl.where``, the exclusive sum is scanned directly (a tuple scan carrying the
last row's value) instead of inclusive minus own value, the adjacency exclusion leaves a term out
rather than subtracting it, and carries hold only the open segment. So one huge or non-finite value
changes only the outputs that average over it. The bytes moved are the same as with a plain running
sum (the extra tuple member lives in registers): no pass over ``h`` or ``grad_out`` is added.

Accumulation is fp32 whatever the input dtype (inputs are upcast on load).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from .._library import empty_output
from .._triton import autotune, cdiv, launch, per_signature, size_bucket

# The configs that won autotune keys on an H100 (benchmarks/results/kernel-constants.md#n-gram-sort-configs);
# the ones that never won are no longer compiled and timed.
_CONFIGS = [
    triton.Config({"BLOCK_L": 64, "BLOCK_D": 64}, num_warps=4),
    triton.Config({"BLOCK_L": 128, "BLOCK_D": 32}, num_warps=4),
    triton.Config({"BLOCK_L": 32, "BLOCK_D": 32}, num_warps=2),
]
#: The column block :func:`chunk_length` counts programs with (every config's ``BLOCK_D`` is at most this, so
#: each gets at least as many programs; 128 as in the measured runs), and the longest tile of ``_CONFIGS``
#: (chunks are whole tiles of every config).
_MAX_BLOCK_D, _MAX_BLOCK_L = 128, 128
#: Tile of the carry kernels (not autotuned: they read a tail of each chunk, a small part of the work).
_CARRY_BLOCK_L, _CARRY_BLOCK_D, _CARRY_WARPS = 64, 64, 4
#: 4 programs per SM of an H100 (132 SMs).
TARGET_PROGRAMS = 4 * 132


def max_chunks(length: int) -> int:
    """At most ``sqrt(L / 2)`` chunks a row. The look-back of chunk ``c`` reads up to ``c`` partials (when
    one n-gram spans the whole row), ``sum_c 4 c <= 4 chunks^2 / 2 <= L`` bytes per row and column in
    all: at most 25% of the main kernel's ``2 L s >= 4 L`` bytes (bf16), whatever the data."""
    return max(1, math.isqrt(length // 2))


_forced_chunk_length: int | None = None


@contextlib.contextmanager
def forced_chunk_length(chunk: int) -> Iterator[None]:
    """Within the block, the sort-path kernels cut rows into chunks of ``chunk`` positions (tests use small
    chunks so that segments cross chunk boundaries under the interpreter)."""
    global _forced_chunk_length
    previous, _forced_chunk_length = _forced_chunk_length, int(chunk)
    try:
        yield
    finally:
        _forced_chunk_length = previous


def chunk_length(batch: int, length: int, dim: int) -> int:
    """Sorted positions per program: the longest multiple of ``_MAX_BLOCK_L`` that still gives
    ``TARGET_PROGRAMS`` programs with the widest column block, within :func:`max_chunks` chunks a row.

    ``chunk_length(16, 4096, 512) == 384`` (11 chunks, 704 programs at ``BLOCK_D = 128``);
    ``chunk_length(8, 4096, 512) == 128`` (32 chunks, 1024 programs).
    """
    if _forced_chunk_length is not None:
        return _forced_chunk_length
    programs_per_chunk = batch * cdiv(dim, _MAX_BLOCK_D)
    chunks_wanted = cdiv(TARGET_PROGRAMS, programs_per_chunk)
    chunk = (length // chunks_wanted) // _MAX_BLOCK_L * _MAX_BLOCK_L
    fewest = cdiv(cdiv(length, max_chunks(length)), _MAX_BLOCK_L) * _MAX_BLOCK_L
    return max(_MAX_BLOCK_L, chunk, fewest)


@triton.jit
def _segmented_exclusive_add(start_a, before_a, last_a, start_b, before_b, last_b):
    """Combine of a segmented *exclusive* running sum. An element of a range is (has a segment start,
    sum of the range's open segment without its last row, last row's value): the sum kept for a row
    never includes the row itself and never crosses a segment start (``tl.where``, not a multiply, so
    a discarded cross-segment sum cannot leak a large or non-finite value)."""
    return start_a | start_b, tl.where(start_b != 0, before_b, before_a + last_a + before_b), last_b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _segment_exclusive_sum(values, starts, carry, BLOCK_L: tl.constexpr):
    """Exclusive running sum of ``values [BLOCK_L, BLOCK_D]`` along rows, restarting where ``starts``:
    row ``k`` gets the sum of the rows before it in its segment, not its own value (computed directly,
    not as inclusive minus own value: ``(S + 1e20) - 1e20`` would lose ``S``).

    Rows before the tile's first segment start continue the previous tile's open segment (``carry``,
    its inclusive sum). Returns the exclusive sums and the carry for the next tile.
    """
    flags = tl.broadcast_to(starts[:, None], values.shape)
    _, before, _ = tl.associative_scan((flags, tl.zeros_like(values), values), 0, _segmented_exclusive_add)
    continues_open_segment = tl.cumsum(starts, 0) == 0
    before += tl.where(continues_open_segment[:, None], carry[None, :], 0.0)
    is_last_row = tl.arange(0, BLOCK_L) == BLOCK_L - 1
    next_carry = tl.sum(tl.where(is_last_row[:, None], before + values, 0.0), axis=0)
    return before, next_carry


# --- forward --------------------------------------------------------------------------------------


@triton.jit
def _ngram_forward_carry_kernel(
    h_ptr, perm_ptr, meta_ptr, partial_ptr, boundary_ptr,
    L, D, CHUNK_L, NUM_CHUNKS,
    stride_hb, stride_hl,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Pass 1 of the forward, for chunks ``0 .. NUM_CHUNKS - 2``: the sum of ``y(k) = v(k - 1)`` from the
    chunk's last segment start to its end (``partial [B, NUM_CHUNKS, D]``, fp32) and that start's
    position (``boundary [B, NUM_CHUNKS]``, ``-1`` if the chunk has none). Walks the chunk backwards
    and stops at the first tile holding a segment start."""
    pid = tl.program_id(0)
    row = (pid // (NUM_CHUNKS - 1)).to(tl.int64)
    chunk = pid % (NUM_CHUNKS - 1)
    lo = chunk * CHUNK_L
    hi = tl.minimum(lo + CHUNK_L, L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    h_row = h_ptr + row * stride_hb
    plan_row = row * L
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    last_start = tl.full([], -1, dtype=tl.int32)
    tile_hi = hi
    searching = tile_hi > lo
    while searching:
        k = tile_hi - BLOCK_L + tl.arange(0, BLOCK_L)
        k_ok = (k >= lo) & (k < tile_hi)
        # perm[k - 1] does not depend on meta: both loads issue together.
        source = tl.load(perm_ptr + plan_row + k - 1, mask=k_ok & (k > 0), other=0)
        meta = tl.load(meta_ptr + plan_row + k, mask=k_ok, other=0).to(tl.int32)
        is_start = k_ok & ((meta & 1) != 0)
        tile_last = tl.max(tl.where(is_start, k, -1), axis=0)
        take = k_ok & (k > tile_last) & (source + 1 < L)  # y(k) of a segment start is 0: k > tile_last
        values = tl.load(
            h_row + (source + 1)[:, None] * stride_hl + cols[None, :],
            mask=take[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(values, axis=0)
        last_start = tile_last
        tile_hi -= BLOCK_L
        searching = (tile_last < 0) & (tile_hi > lo)
    slot = row * NUM_CHUNKS + chunk
    tl.store(partial_ptr + slot * D + cols, acc, mask=col_ok)
    tl.store(boundary_ptr + slot, last_start, mask=tl.program_id(1) == 0)


@autotune(_CONFIGS, key=["D", "SIZE_BUCKET"])
@triton.jit
def _ngram_forward_kernel(
    h_ptr, perm_ptr, meta_ptr, partial_ptr, boundary_ptr, out_ptr,
    L, D, CHUNK_L, NUM_CHUNKS,
    stride_hb, stride_hl, stride_ob, stride_ol,
    SIZE_BUCKET,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = (pid // NUM_CHUNKS).to(tl.int64)
    chunk = pid % NUM_CHUNKS
    lo = chunk * CHUNK_L
    hi = tl.minimum(lo + CHUNK_L, L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    h_row = h_ptr + row * stride_hb
    out_row = out_ptr + row * stride_ob
    plan_row = row * L

    # Look back over the earlier chunks' partials (finished by the carry kernel) until one holds a
    # segment start: its open segment reaches this chunk. Chunk 0 starts a segment at k = 0.
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    segment_start = tl.zeros([], dtype=tl.int32)
    # Rows of one chunk have nothing to look back over. The branch also keeps the loop out of the
    # NUM_CHUNKS == 1 specialisation (Triton makes an int argument equal to 1 a constant), whose
    # never-entered loop crashed Triton 3.6's TritonGPUCoalesce pass on sm_90.
    if NUM_CHUNKS > 1:
        previous = chunk - 1
        searching = previous >= 0
        while searching:
            slot = row * NUM_CHUNKS + previous
            carry += tl.load(partial_ptr + slot * D + cols, mask=col_ok, other=0.0)
            boundary = tl.load(boundary_ptr + slot)
            segment_start = tl.maximum(boundary, 0)
            previous -= 1
            searching = (boundary < 0) & (previous >= 0)

    # Prefetch: plan entries of the first tile (later tiles' are loaded one tile ahead, below).
    k = lo + tl.arange(0, BLOCK_L)
    k_ok = k < hi
    next_target = tl.load(perm_ptr + plan_row + k, mask=k_ok, other=0)
    next_source = tl.load(perm_ptr + plan_row + k - 1, mask=k_ok & (k > 0), other=0)
    next_meta = tl.load(meta_ptr + plan_row + k, mask=k_ok, other=0)
    for tile in range(lo, hi, BLOCK_L):
        k = tile + tl.arange(0, BLOCK_L)
        k_ok = k < hi
        target, source, meta = next_target, next_source, next_meta.to(tl.int32)
        k_next = k + BLOCK_L
        next_ok = k_next < hi
        next_target = tl.load(perm_ptr + plan_row + k_next, mask=next_ok, other=0)
        next_source = tl.load(perm_ptr + plan_row + k_next - 1, mask=next_ok, other=0)
        next_meta = tl.load(meta_ptr + plan_row + k_next, mask=next_ok, other=0)

        starts = meta & 1
        adjacent = (meta >> 1) & 1
        valid = ((meta >> 2) & 1) != 0
        # y(k) = v(k - 1) = h[perm[k - 1] + 1] inside a segment (0 at its start).
        has_value = k_ok & (starts == 0) & (k > 0) & (source + 1 < L)
        values = tl.load(
            h_row + (source + 1)[:, None] * stride_hl + cols[None, :],
            mask=has_value[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        before, carry = _segment_exclusive_sum(values, starts, carry, BLOCK_L)
        # y(k) is the key just before k in the segment; it is j = i when adjacent: then left out
        # (strict pattern). Added, never subtracted: nothing cancels.
        total = before + tl.where(adjacent[:, None] != 0, 0.0, values)

        start_here = tl.where(k_ok & (starts != 0), k, -1)
        own_start = tl.maximum(tl.associative_scan(start_here, 0, _max_combine), segment_start)
        segment_start = tl.maximum(segment_start, tl.max(start_here, axis=0))
        count = tl.where(valid & k_ok, k - own_start - adjacent, 0)
        mean = tl.where((count > 0)[:, None], total / tl.maximum(count, 1).to(tl.float32)[:, None], 0.0)
        tl.store(
            out_row + target[:, None] * stride_ol + cols[None, :],
            mean.to(out_ptr.dtype.element_ty),
            mask=k_ok[:, None] & col_ok[None, :],
        )


# --- backward -------------------------------------------------------------------------------------


@triton.jit
def _ngram_backward_carry_kernel(
    grad_out_ptr, perm_ptr, meta_ptr, count_ptr, partial_ptr, boundary_ptr,
    L, D, CHUNK_L, NUM_CHUNKS,
    stride_gb, stride_gl,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Pass 1 of the backward, for chunks ``1 .. NUM_CHUNKS - 1``: the sum of ``x(k) = w(k + 1)`` from the
    chunk's first position to its first segment end (``partial``), and that end's position
    (``boundary``, ``-1`` if the chunk has none). Walks the chunk forwards and stops at the first tile
    holding a segment end."""
    pid = tl.program_id(0)
    row = (pid // (NUM_CHUNKS - 1)).to(tl.int64)
    chunk = pid % (NUM_CHUNKS - 1) + 1
    lo = chunk * CHUNK_L
    hi = tl.minimum(lo + CHUNK_L, L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    grad_out_row = grad_out_ptr + row * stride_gb
    plan_row = row * L
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    first_end = tl.full([], -1, dtype=tl.int32)
    tile_lo = lo
    searching = tile_lo < hi
    while searching:
        k = tile_lo + tl.arange(0, BLOCK_L)
        k_ok = k < hi
        has_next = k_ok & (k + 1 < L)
        query = tl.load(perm_ptr + plan_row + k + 1, mask=has_next, other=0)
        # k ends its segment where k + 1 starts one (or k is the last position).
        meta_next = tl.load(meta_ptr + plan_row + k + 1, mask=has_next, other=1).to(tl.int32)
        is_end = k_ok & ((meta_next & 1) != 0)
        tile_first = tl.min(tl.where(is_end, k, L), axis=0)
        take = k_ok & (k < tile_first)  # x(k) of a segment end is 0: k < tile_first
        count = tl.load(count_ptr + plan_row + query, mask=take, other=0)
        weights = (
            tl.load(
                grad_out_row + query[:, None] * stride_gl + cols[None, :],
                mask=(take & (count > 0))[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            / tl.maximum(count, 1).to(tl.float32)[:, None]
        )
        acc += tl.sum(weights, axis=0)
        first_end = tl.where(tile_first < L, tile_first, -1)
        tile_lo += BLOCK_L
        searching = (tile_first >= L) & (tile_lo < hi)
    slot = row * NUM_CHUNKS + chunk
    tl.store(partial_ptr + slot * D + cols, acc, mask=col_ok)
    tl.store(boundary_ptr + slot, first_end, mask=tl.program_id(1) == 0)


@autotune(_CONFIGS, key=["D", "SIZE_BUCKET"])
@triton.jit
def _ngram_backward_kernel(
    grad_out_ptr, perm_ptr, meta_ptr, count_ptr, partial_ptr, boundary_ptr, grad_h_ptr,
    L, D, CHUNK_L, NUM_CHUNKS,
    stride_gb, stride_gl, stride_hb, stride_hl,
    SIZE_BUCKET,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = (pid // NUM_CHUNKS).to(tl.int64)
    chunk = pid % NUM_CHUNKS
    lo = chunk * CHUNK_L
    hi = tl.minimum(lo + CHUNK_L, L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    grad_out_row = grad_out_ptr + row * stride_gb
    grad_h_row = grad_h_ptr + row * stride_hb
    plan_row = row * L
    # Keys start at j = 1 (their n-gram ends at j - 1 >= 0): position 0 never gets a gradient.
    # (The chunk index is broadcast over the columns: a scalar mask term fails when NUM_CHUNKS == 1 is
    # specialised to a constant.)
    first_chunk = cols * 0 + chunk == 0
    tl.store(grad_h_row + cols, tl.zeros([BLOCK_D], dtype=grad_h_ptr.dtype.element_ty), mask=col_ok & first_chunk)

    # Look back (towards the end) over the later chunks' partials until one holds a segment end.
    carry = tl.zeros([BLOCK_D], dtype=tl.float32)
    if NUM_CHUNKS > 1:  # as in the forward: no loop in the NUM_CHUNKS == 1 specialisation
        later = chunk + 1
        searching = later < NUM_CHUNKS
        while searching:
            slot = row * NUM_CHUNKS + later
            carry += tl.load(partial_ptr + slot * D + cols, mask=col_ok, other=0.0)
            boundary = tl.load(boundary_ptr + slot)
            later += 1
            searching = (boundary < 0) & (later < NUM_CHUNKS)

    # Walk the chunk from its end; prefetch the first tile's plan entries.
    k = hi - 1 - tl.arange(0, BLOCK_L)
    k_ok = k >= lo
    has_next = k_ok & (k + 1 < L)
    next_key = tl.load(perm_ptr + plan_row + k, mask=k_ok, other=0)
    next_meta = tl.load(meta_ptr + plan_row + k, mask=k_ok, other=0)
    next_query = tl.load(perm_ptr + plan_row + k + 1, mask=has_next, other=0)
    next_meta_next = tl.load(meta_ptr + plan_row + k + 1, mask=has_next, other=1)
    for tile in range(0, hi - lo, BLOCK_L):
        k = hi - 1 - (tile + tl.arange(0, BLOCK_L))
        k_ok = k >= lo
        key, meta, query, meta_next = next_key, next_meta.to(tl.int32), next_query, next_meta_next.to(tl.int32)
        k_following = k - BLOCK_L
        following_ok = k_following >= lo
        next_key = tl.load(perm_ptr + plan_row + k_following, mask=following_ok, other=0)
        next_meta = tl.load(meta_ptr + plan_row + k_following, mask=following_ok, other=0)
        next_query = tl.load(perm_ptr + plan_row + k_following + 1, mask=following_ok, other=0)
        next_meta_next = tl.load(meta_ptr + plan_row + k_following + 1, mask=following_ok, other=1)

        # Scanning from the end, a segment starts at its last element k (k + 1 starts a new one).
        ends = meta_next & 1
        in_segment = k_ok & (ends == 0)  # then k + 1 < L and the query at k + 1 shares k's n-gram
        count = tl.load(count_ptr + plan_row + query, mask=in_segment, other=0)
        weights = (
            tl.load(
                grad_out_row + query[:, None] * stride_gl + cols[None, :],
                mask=(in_segment & (count > 0))[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            / tl.maximum(count, 1).to(tl.float32)[:, None]
        )
        before, carry = _segment_exclusive_sum(weights, ends, carry, BLOCK_L)
        # x(k) is the query just after k in the segment; it is i = j when adjacent: then left out
        # (strict pattern). Added, never subtracted: nothing cancels.
        next_adjacent = ((meta_next >> 1) & 1) != 0
        total = before + tl.where(next_adjacent[:, None], 0.0, weights)

        has_key_row = k_ok & (key + 1 < L)
        is_key = has_key_row & (((meta >> 2) & 1) != 0)
        grad = tl.where(is_key[:, None], total, 0.0)
        tl.store(
            grad_h_row + (key + 1)[:, None] * stride_hl + cols[None, :],
            grad.to(grad_h_ptr.dtype.element_ty),
            mask=has_key_row[:, None] & col_ok[None, :],
        )


# --- launchers ------------------------------------------------------------------------------------


def _carry_buffers(batch: int, chunks: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch of the carry pass: ``partial [B, chunks, D]`` fp32 and ``boundary [B, chunks]`` int32
    (with a single chunk the main kernel never reads them: one 1-element fp32 stand-in, seen as both)."""
    if chunks == 1:
        stand_in = torch.empty(1, dtype=torch.float32, device=device)
        return stand_in, stand_in.view(torch.int32)
    partial = torch.empty(batch, chunks, dim, dtype=torch.float32, device=device)
    boundary = torch.empty(batch, chunks, dtype=torch.int32, device=device)
    return partial, boundary


@per_signature
def _launch_config(shape: tuple[int, int, int], forced_chunk: int | None) -> tuple[int, int, tuple, object, int]:
    """``(chunk, chunks, carry grid, main grid, size bucket)`` of the sort path's kernels for ``[B, L, D]``
    (``forced_chunk``: :func:`forced_chunk_length`'s, part of the key)."""
    batch, length, dim = shape
    chunk = chunk_length(batch, length, dim)
    chunks = cdiv(length, chunk)

    def grid(meta_params):
        return (batch * chunks, cdiv(dim, meta_params["BLOCK_D"]))

    carry_grid = (batch * (chunks - 1), cdiv(dim, _CARRY_BLOCK_D))
    return chunk, chunks, carry_grid, grid, size_bucket(batch * length)


def ngram_forward_triton(
    h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton forward: ``h [B, L, D]`` and a plan (``perm``, ``meta`` ``[B, L]``) to the output ``[B, L, D]``
    (``h.dtype``). ``count`` is not read: the kernel derives match counts from ``meta``."""
    h = h.contiguous()
    perm, meta = perm.contiguous(), meta.contiguous()
    batch, length, dim = shape = h.shape
    chunk, chunks, carry_grid, grid, bucket = _launch_config(shape, _forced_chunk_length)
    out = empty_output(shape, dtype=h.dtype, device=h.device)
    partial, boundary = _carry_buffers(batch, chunks, dim, h.device)
    if chunks > 1:
        launch(_ngram_forward_carry_kernel, carry_grid)(
            h, perm, meta, partial, boundary,
            length, dim, chunk, chunks,
            h.stride(0), h.stride(1),
            BLOCK_L=_CARRY_BLOCK_L, BLOCK_D=_CARRY_BLOCK_D, num_warps=_CARRY_WARPS,
        )  # fmt: skip
    launch(_ngram_forward_kernel, grid)(
        h, perm, meta, partial, boundary, out,
        length, dim, chunk, chunks,
        h.stride(0), h.stride(1), out.stride(0), out.stride(1),
        bucket,
    )  # fmt: skip
    return out


def ngram_backward_triton(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """Triton backward: ``grad_out [B, L, D]`` and a plan to the gradient w.r.t. ``h`` (``[B, L, D]``)."""
    grad_out = grad_out.contiguous()
    perm, meta, count = perm.contiguous(), meta.contiguous(), count.contiguous()
    batch, length, dim = shape = grad_out.shape
    chunk, chunks, carry_grid, grid, bucket = _launch_config(shape, _forced_chunk_length)
    grad_h = empty_output(shape, dtype=grad_out.dtype, device=grad_out.device)
    partial, boundary = _carry_buffers(batch, chunks, dim, grad_out.device)
    if chunks > 1:
        launch(_ngram_backward_carry_kernel, carry_grid)(
            grad_out, perm, meta, count, partial, boundary,
            length, dim, chunk, chunks,
            grad_out.stride(0), grad_out.stride(1),
            BLOCK_L=_CARRY_BLOCK_L, BLOCK_D=_CARRY_BLOCK_D, num_warps=_CARRY_WARPS,
        )  # fmt: skip
    launch(_ngram_backward_kernel, grid)(
        grad_out, perm, meta, count, partial, boundary, grad_h,
        length, dim, chunk, chunks,
        grad_out.stride(0), grad_out.stride(1), grad_h.stride(0), grad_h.stride(1),
        bucket,
    )  # fmt: skip
    return grad_h
