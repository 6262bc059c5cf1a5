"""The ``row_chunks`` and ``action_chunks`` algorithms of InfoNCE and action selection (``algorithms.ROW_CHUNKS``,
``algorithms.ACTION_CHUNKS``): cuBLAS GEMMs around Triton row kernels.

The entry functions (``row_chunks_infonce_forward``, ..., ``action_chunks_select``: the two algorithms' entries
of ``algorithms.ALGORITHMS``) view their inputs in a canonical layout (``pred [B, T, D]`` and
``embeds [1 or B, A, D]`` contiguous, ``targets [B, T]`` int64, the padded uint8 ``mask`` or None). Rows are the
flattened ``[B, T]``
grid; a chunk is a contiguous range of them (with a shared map any range; with one map per sequence, whole
sequences or a slice of one sequence's steps, so that each GEMM multiplies rows by their own map). For each
chunk of rows and each chunk of actions (one, the whole set, for :data:`~.algorithms.ROW_CHUNKS`):

1. a GEMM writes the chunk's logits ``pred . e_a`` in fp32 (bf16/fp16 inputs with fp32 accumulation and
   output: ``torch.mm(..., out_dtype=torch.float32)`` on CUDA; on the CPU, and on a torch without it, the
   inputs upcast, whose products are exact in fp32, so the result is the same up to summation order). A
   GEMM that rounded the logits to bf16 would move every softmax probability by up to ~0.4% of its logit's
   size, far above what the kernels' fp32 accumulation allows;
2. one Triton kernel (:mod:`.chunked_kernels`) reads them once for each row's online log-sum-exp, loss and
   status and, when gradients are wanted and the row's log-sum-exp is final, overwrites the chunk in place
   with ``(softmax - one_hot) * w / max|w|`` in the inputs' dtype;
3. GEMMs with fp32 output accumulate ``operand @ E`` (gradient for ``pred``) and ``operand^T @ pred``
   (gradient for the map); ``max|w| / tau`` scales each fp32 result once and casts it to the inputs' dtype.

With more than one action chunk, a first sweep over the action chunks finishes every row's log-sum-exp and
a second recomputes each block's logits for the gradients (three GEMM passes over the logits instead of
two). Memory: the gradients, one chunk of fp32 logits (:data:`~.algorithms.CHUNK_BYTES`), per row 9 bytes of
outputs (and 20 bytes of carried state with action chunks); no host reads, so a call can be captured in a
CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch

from .._library import empty_output
from .algorithms import (
    ACTION_CHUNKS,
    ROW_CHUNKS,
    canonical_views,
    chunk_shape,
    count_rows,
    reduce_losses,
    row_weights,
)

#: ``torch.mm`` / ``torch.bmm`` take ``out_dtype`` (torch >= 2.8): fp32 output of half-precision GEMMs on CUDA.
_GEMM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")


class RowChunk(NamedTuple):
    """Flat rows ``start .. stop`` of the ``[B, T]`` grid as ``n`` blocks of rows, each against its map:
    ``pred [n, rows, D]`` (a view) and ``maps``, the slice of ``embeds``' first axis they use."""

    start: int
    stop: int
    pred: torch.Tensor
    maps: slice


def row_chunks(pred: torch.Tensor, groups: int, rows_per_chunk: int) -> Iterator[RowChunk]:
    """Chunks of at most ``rows_per_chunk`` rows covering the ``[B, T]`` grid in order; ``groups``: the number
    of maps (1: one shared map, any range of rows; ``B``: one per sequence, whole sequences or a slice of one)."""
    batch, steps, dim = pred.shape
    if groups == 1:
        flat = pred.view(1, batch * steps, dim)
        for start in range(0, batch * steps, rows_per_chunk):
            stop = min(start + rows_per_chunk, batch * steps)
            yield RowChunk(start, stop, flat[:, start:stop], slice(0, 1))
    elif rows_per_chunk >= steps:
        per_chunk = rows_per_chunk // steps
        for first in range(0, batch, per_chunk):
            last = min(first + per_chunk, batch)
            yield RowChunk(first * steps, last * steps, pred[first:last], slice(first, last))
    else:
        for b in range(batch):
            for t in range(0, steps, rows_per_chunk):
                stop = min(t + rows_per_chunk, steps)
                yield RowChunk(b * steps + t, b * steps + stop, pred[b : b + 1, t:stop], slice(b, b + 1))


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of ``[n, m, k]`` and ``[n, k, p]`` with fp32 accumulation and an fp32 result (module doc, 1)."""
    if a.dim() == 3 and a.shape[0] == 1:  # one GEMM, not a batch of one
        return matmul_fp32(a[0], b[0])[None]
    if a.dtype == torch.float32:
        return torch.matmul(a, b)
    if a.is_cuda and _GEMM_OUT_DTYPE:
        return (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
    return torch.matmul(a.float(), b.float())


def _block_logits(chunk: RowChunk, embeds: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """fp32 ``pred . e_a`` of the chunk's rows and actions ``start .. stop``, ``[R, C]`` (module doc, step 1)."""
    logits = matmul_fp32(chunk.pred, embeds[chunk.maps, start:stop].transpose(1, 2))
    return logits.view(chunk.stop - chunk.start, stop - start)


def _operand_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the kernel writes the gradient operand of fp32 ``logits [R, C]`` (contiguous): the tensor itself
    for fp32, else ``[R, C]`` of ``dtype`` over the first half of each row's bytes (stride ``(2 C, 1)``)."""
    if dtype == torch.float32:
        return logits
    rows, columns = logits.shape
    return logits.view(dtype).view(rows, 2 * columns)[:, :columns]


def infonce_chunked(
    pred, embeds, targets, mask, tau: float, ignore_index: int, algorithm: str, *, weights=None,
    want_pred: bool = False, want_embeds: bool = False,
):  # fmt: skip
    """Chunked InfoNCE on canonical inputs (module doc).

    Args:
        weights: float32 ``[B, T]`` gradient weight of each row (0 on ignored rows): with ``want_pred`` /
            ``want_embeds``, the gradients of ``sum_r weights[r] * loss[r]`` are computed; None: the loss only.
        algorithm: :data:`~.algorithms.ROW_CHUNKS` or :data:`~.algorithms.ACTION_CHUNKS` (chunk sizes from
            :func:`~.algorithms.chunk_shape`).

    Returns:
        ``(losses, lse, status, grad_pred, grad_embeds)``: float32 ``[B, T]`` losses and log-sum-exps, int8
        ``[B, T]`` statuses (``checks.ROW_*``), and the gradients in the inputs' dtype (None where not asked).
    """
    # Imported here, where the kernels run: the module itself imports without triton.
    from .chunked_kernels import (
        RowState,
        infonce_chunk_triton,
        new_outputs,
    )

    batch, steps, dim = pred.shape
    groups, num_actions, _ = embeds.shape
    rows_per_chunk, action_chunk = chunk_shape(num_actions, algorithm)
    outputs = new_outputs((batch, steps), pred.device, select=False)
    want_pred, want_embeds = weights is not None and want_pred, weights is not None and want_embeds
    write_grad = want_pred or want_embeds
    state = RowState(batch * steps, pred.device, select=False) if action_chunk < num_actions else None
    scale = wmax = None
    if write_grad:
        wmax = weights.abs().amax().reshape(1)
        scale = wmax / tau  # of the GEMMs' fp32 output (the operand carries w / max|w|)
    grad_pred = empty_output(pred.shape, dtype=pred.dtype, device=pred.device) if want_pred else None
    grad_embeds = torch.zeros(embeds.shape, dtype=torch.float32, device=pred.device) if want_embeds else None
    flat_grad = grad_pred.view(batch * steps, dim) if want_pred else None
    common = {"num_actions": num_actions, "steps": steps, "tau": tau, "ignore_index": ignore_index}

    single = action_chunk >= num_actions
    # One sweep over the action chunks finishes each row's statistics (and, with one chunk, its gradients);
    # with several, a second recomputes each block's logits once the row's log-sum-exp is known.
    sweeps = (True,) if single or not write_grad else (True, False)
    for chunk in row_chunks(pred, groups, rows_per_chunk):
        rows, accumulated = chunk.stop - chunk.start, None
        for stats in sweeps:
            for start in range(0, num_actions, action_chunk):
                stop = min(start + action_chunk, num_actions)
                logits = _block_logits(chunk, embeds, start, stop)
                operand = _operand_view(logits, pred.dtype)
                gradients = write_grad and (single or not stats)
                infonce_chunk_triton(
                    logits, operand, targets, mask, weights, wmax, outputs, state if stats else None,
                    row0=chunk.start, action0=start, stats=stats, first=stats and start == 0,
                    last=stats and stop == num_actions,
                    write_grad=gradients, **common,
                )  # fmt: skip
                if gradients:
                    accumulated = _gradient_gemms(
                        chunk, operand, embeds, start, stop, accumulated, grad_embeds, want_pred
                    )
        if want_pred:
            torch.mul(accumulated.view(rows, dim), scale, out=flat_grad[chunk.start : chunk.stop])
    if want_embeds:
        grad_embeds = torch.mul(grad_embeds, scale, out=torch.empty_like(embeds))
    return (*outputs, grad_pred, grad_embeds)


def _gradient_gemms(chunk: RowChunk, operand, embeds, start: int, stop: int, accumulated, grad_embeds, want_pred):
    """Add one block's ``operand [R, C] @ E[start:stop]`` to ``accumulated`` (fp32 ``[n, rows, D]``, None at the
    first block; returned) and, into ``grad_embeds`` (fp32), ``operand^T @ pred`` of the chunk's rows."""
    blocks, block_rows, _ = chunk.pred.shape
    operand = operand.view(blocks, block_rows, stop - start)
    if grad_embeds is not None:
        grad_embeds[chunk.maps, start:stop] += matmul_fp32(operand.transpose(1, 2), chunk.pred)
    if not want_pred:
        return accumulated
    product = matmul_fp32(operand, embeds[chunk.maps, start:stop])
    return product if accumulated is None else accumulated.add_(product)


def select_chunked(pred, embeds, mask, tau: float, sample: bool, seed: torch.Tensor, seed_rows: int, algorithm: str):
    """Chunked selection on canonical inputs: ``([B, T] int64 actions, [B, T] int8 status)`` as
    :func:`.fused_kernels.select` returns them (the same Gumbel draw per ``(row, action)``)."""
    # Imported here, where the kernels run: the module itself imports without triton.
    from .chunked_kernels import (
        RowState,
        new_outputs,
        select_chunk_triton,
    )

    batch, steps, _ = pred.shape
    groups, num_actions, _ = embeds.shape
    rows_per_chunk, action_chunk = chunk_shape(num_actions, algorithm)
    outputs = new_outputs((batch, steps), pred.device, select=True)
    state = RowState(batch * steps, pred.device, select=True) if action_chunk < num_actions else None
    for chunk in row_chunks(pred, groups, rows_per_chunk):
        for start in range(0, num_actions, action_chunk):
            stop = min(start + action_chunk, num_actions)
            select_chunk_triton(
                _block_logits(chunk, embeds, start, stop), mask, seed, outputs, state, row0=chunk.start,
                action0=start, num_actions=num_actions, steps=steps, seed_rows=seed_rows, tau=tau, sample=sample,
                first=start == 0, last=stop == num_actions,
            )  # fmt: skip
    return outputs


# -- the algorithms' entries (algorithms.Algorithm) -----------------------------------------------------------
def _infonce_forward(
    algorithm: str, pred, embeds, targets, mask, tau: float, ignore_index: int, reduction: str, runs: int,
    want_pred: bool, want_embeds: bool,
):  # fmt: skip
    reduced = reduction != "none"
    want_pred, want_embeds = reduced and want_pred, reduced and want_embeds
    count = count_rows(targets, ignore_index, runs) if reduction == "mean" else None
    weights = row_weights(targets, ignore_index, count) if want_pred or want_embeds else None
    losses, _, status, grad_pred, grad_embeds = _infonce(
        algorithm, pred, embeds, targets, mask, tau, ignore_index, weights, want_pred, want_embeds
    )
    return reduce_losses(losses, reduction, runs, count), None, status, grad_pred, grad_embeds


def _infonce(algorithm, pred, embeds, targets, mask, tau, ignore_index, weights, want_pred, want_embeds):
    """:func:`infonce_chunked` on the entries' inputs; outputs in their shapes."""
    pred3, embeds3, targets2 = canonical_views(pred, embeds, targets)
    losses, lse, status, grad_pred, grad_embeds = infonce_chunked(
        pred3.contiguous(), embeds3.contiguous(), targets2, mask, tau, ignore_index, algorithm,
        weights=None if weights is None else weights.view(targets2.shape), want_pred=want_pred,
        want_embeds=want_embeds,
    )  # fmt: skip
    return (
        losses.view(targets.shape),
        lse.view(targets.shape),
        status.view(targets.shape),
        None if grad_pred is None else grad_pred.view(pred.shape),
        None if grad_embeds is None else grad_embeds.view(embeds.shape),
    )


def _infonce_backward(
    algorithm: str, weights, pred, embeds, targets, mask, lse, tau: float, ignore_index: int, want_pred, want_embeds
):  # fmt: skip
    """The forward again, with the upstream row ``weights`` (``reduction="none"``); ``lse`` is not needed."""
    return _infonce(algorithm, pred, embeds, targets, mask, tau, ignore_index, weights, want_pred, want_embeds)[3:]


def _select(algorithm: str, pred, embeds, mask, tau: float, sample: bool, seed: torch.Tensor, seed_rows: int):
    pred3, embeds3 = canonical_views(pred, embeds)
    actions, status = select_chunked(
        pred3.contiguous(), embeds3.contiguous(), mask, tau, sample, seed, seed_rows, algorithm
    )
    return actions.view(pred.shape[:-1]), status.view(pred.shape[:-1])


row_chunks_infonce_forward = functools.partial(_infonce_forward, ROW_CHUNKS)
row_chunks_infonce_backward = functools.partial(_infonce_backward, ROW_CHUNKS)
row_chunks_select = functools.partial(_select, ROW_CHUNKS)
action_chunks_infonce_forward = functools.partial(_infonce_forward, ACTION_CHUNKS)
action_chunks_infonce_backward = functools.partial(_infonce_backward, ACTION_CHUNKS)
action_chunks_select = functools.partial(_select, ACTION_CHUNKS)
