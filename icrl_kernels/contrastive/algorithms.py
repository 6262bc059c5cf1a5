"""The algorithms of InfoNCE and action selection: one table, and the choice by the number of actions.

:func:`~icrl_kernels.infonce_loss` and :func:`~icrl_kernels.select_actions` take ``algorithm=`` (default
``"auto"``); every name below is an entry of :data:`ALGORITHMS` and the ops run ``ALGORITHMS[name]``'s
functions (docs/ops.md#contrastive-action-scoring; predicted costs in docs/performance.md#infonce-algorithms):

* :data:`SMALL` (``A`` up to one action tile; ``small_kernels.py``): ONE kernel computes each row's loss,
  log-sum-exp and value checks and the gradient for ``pred`` (``softmax - one_hot``, the reduction's row weight
  and ``1 / tau`` folded in), so the backward is a broadcast multiply by the upstream gradient.
* :data:`FUSED` (the three-pass kernels of ``fused_kernels.py``): the logits never reach memory; the forward
  streams action tiles through an online log-sum-exp, the backward recomputes them.
* :data:`ROW_CHUNKS` (``chunked.py``, ``chunked_kernels.py``): per chunk of rows, a cuBLAS GEMM writes the chunk's
  fp32 logits (sized to stay in L2), ONE Triton kernel turns them into losses, log-sum-exps and statuses and
  overwrites them in place with the gradient operand ``(softmax - one_hot) * w``, and GEMMs give the gradients
  for ``pred`` and, when asked, the map.
* :data:`ACTION_CHUNKS`: the same over (row chunk, action chunk) blocks, for action sets too large for a chunk
  of rows: a first sweep carries each row's online log-sum-exp across the action chunks, a second recomputes
  each block's logits for the gradients.
* :data:`EAGER` (``eager.py``): the PyTorch path in row chunks (what CPU tensors run without Triton); it is
  what ``backend="eager"`` means, and never chosen on the Triton backend.

The algorithms other than :data:`FUSED` and :data:`EAGER` compute the gradients in the forward when the
reduction is ``"mean"`` or ``"sum"`` (the upstream gradient is then one scalar: the backward scales); with
``reduction="none"`` the backward runs them again with the upstream row weights.

Selection (argmax and Gumbel-max sampling) has no gradient: :data:`FUSED` is its one-kernel path (also what
:data:`SMALL` means for it), and the two chunked algorithms run the same GEMM chunks with a Triton argmax /
Gumbel-max kernel carrying each row's running best across action chunks.

**The thresholds below are placeholders**, estimates made before any GPU measured the algorithms;
``benchmarks/bench_infonce.py::test_infonce_crossover`` and ``test_select_crossover`` (stage
``infonce-crossover`` of ``benchmarks/gpu_check.py``) time every algorithm over ``A`` = 125..10^6 and set them
(benchmarks/results/README.md says what that run must measure).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

SMALL = "small"
FUSED = "fused"
ROW_CHUNKS = "row_chunks"
ACTION_CHUNKS = "action_chunks"
EAGER = "eager"
AUTO = "auto"
#: The Triton algorithms of InfoNCE, each a valid ``algorithm=`` of :func:`~icrl_kernels.infonce_loss`.
INFONCE_ALGORITHMS = (SMALL, FUSED, ROW_CHUNKS, ACTION_CHUNKS)
#: Selection's distinct algorithms; :data:`SMALL` asked of a selection runs :data:`FUSED`, its one-kernel path.
SELECT_ALGORITHMS = (FUSED, ROW_CHUNKS, ACTION_CHUNKS)
#: What ``algorithm=`` accepts.
ALGORITHM_CHOICES = (AUTO, *INFONCE_ALGORITHMS)

# -- thresholds (placeholders until the GPU crossover sweep measures them; see the module doc) ---------
#: Largest action set of :data:`SMALL`: one action tile (``kernels.MAX_BLOCK_A``), a hard limit of the kernel,
#: which holds every action of a row tile at once. Whether it wins up to here is for the sweep to say.
SMALL_MAX_ACTIONS = 128
#: Smallest action set of :data:`ROW_CHUNKS` (loss); between :data:`SMALL_MAX_ACTIONS` and this, :data:`FUSED`.
#: An estimate: from about a thousand actions a chunk's GEMMs are large enough to run near the bf16 peak.
ROW_CHUNKS_MIN_ACTIONS = 1024
#: Smallest action set taken by :data:`HUGE_ALGORITHM`: above it a 32 MiB chunk of full logits rows would
#: hold fewer than 64 rows, and each chunk's GEMM re-reads the whole map for so few rows.
HUGE_MIN_ACTIONS = 131072
#: The algorithm of huge action sets: :data:`ACTION_CHUNKS` or :data:`FUSED` (both exact; the sweep decides).
HUGE_ALGORITHM = ACTION_CHUNKS
#: Smallest action set of chunked selection (argmax / Gumbel-max over GEMM chunks); below it, the fused kernel.
SELECT_CHUNKS_MIN_ACTIONS = 1024

# -- chunk sizes ---------------------------------------------------------------------------------------
#: fp32 logits per chunk: 32 MiB. An H100 has 50 MB of L2: the chunk written by the GEMM is read back by the
#: Triton kernel and (overwritten by the gradient operand, 16 MiB in bf16) by the gradient GEMMs while it is
#: still cached, with room left for the map's and ``pred``'s tiles. It also keeps a call's workspace within
#: 64 MiB at the headline shape (``N = 65536, D = 512, A = 4096`` bf16: the saved 64 MiB gradient for
#: ``pred`` plus one chunk stays below the gradient the backward returns plus 64 MiB; :func:`infonce_memory_bytes`).
CHUNK_BYTES = 32 << 20
#: Actions per chunk of :data:`ACTION_CHUNKS` (2048 rows x 4096 actions of fp32 = 32 MiB): GEMMs of at least
#: 4096 columns run near the bf16 peak, and each row chunk reads the map once per sweep.
ACTION_CHUNK = 4096
#: Rows of a chunk are a multiple of this (when a chunk holds more): whole 64-row GEMM tiles.
CHUNK_ROW_MULTIPLE = 64


class Algorithm(NamedTuple):
    """One entry of :data:`ALGORITHMS`: how one algorithm computes InfoNCE and selection.

    The functions take the op's inputs as the public functions pass them (``pred [N, D]``, ``[B, T, D]`` or,
    with one map per sequence, ``[B, D]``; ``embeds [A, D]`` or ``[B, A, D]``, last dimension contiguous; int64
    contiguous ``targets`` of ``pred.shape[:-1]``; the canonical uint8 mask ``[1 or B, 1 or T, A_pad]`` (16-column
    aligned for the Triton algorithms) or None; see :mod:`.function`):

    * ``infonce_forward(pred, embeds, targets, mask, tau, ignore_index, reduction, runs, want_pred, want_embeds)``
      -> ``(loss, lse, status, grad_pred, grad_embeds)``: the float32 loss, reduced over each of ``runs`` equal
      slices of the flat rows (``[]`` for one run, ``[runs]``; per row for ``"none"``: :func:`reduce_losses`),
      the float32 per-row log-sum-exps the algorithm's backward needs (None where it needs none), the int8
      per-row status of the value checks (``checks.ROW_*``; None where the algorithm checks the values itself),
      and, where the algorithm computes them in the forward (``gradients_in_forward``, ``"mean"`` or ``"sum"``)
      and ``want_pred`` / ``want_embeds`` ask, the gradients of that loss for an upstream gradient of 1 per run
      (row weights :func:`row_weights`); None otherwise.
    * ``infonce_backward(weights, pred, embeds, targets, mask, lse, tau, ignore_index, want_pred, want_embeds)`` ->
      ``(grad_pred, grad_embeds)`` (None where not asked) for float32 per-row loss gradients ``weights`` (0 on
      ignored rows); ``lse`` is the forward's (None where the algorithm recomputes it).
    * ``select(pred, embeds, mask, tau, sample, seed, seed_rows)`` -> ``(actions, status)``: int64 ids and int8
      statuses of ``pred.shape[:-1]``; ``seed`` holds int64 seeds, flat row ``r`` drawing its Gumbel noise from
      ``seed[r // seed_rows]`` at counter ``(r % seed_rows) * A + action`` (one seed per run under ``vmap``).
    """

    name: str
    gradients_in_forward: bool
    infonce_forward: Callable
    infonce_backward: Callable
    select: Callable


#: ``name -> (module, whether it computes the gradients in the forward)``: the modules are imported on first
#: use (all but ``eager`` need Triton), each exporting ``infonce_forward``, ``infonce_backward`` and ``select``
#: (the chunked module one set per chunked algorithm, prefixed ``row_chunks_`` / ``action_chunks_``).
_MODULES = {
    SMALL: ("small_kernels", True),
    FUSED: ("fused_kernels", False),
    ROW_CHUNKS: ("chunked", True),
    ACTION_CHUNKS: ("chunked", True),
    EAGER: ("eager", False),
}
ALGORITHMS: dict[str, Algorithm] = {}


def algorithm_entry(name: str) -> Algorithm:
    """``ALGORITHMS[name]``, importing its module on first use."""
    entry = ALGORITHMS.get(name)
    if entry is None:
        module_name, gradients_in_forward = _MODULES[name]
        module = importlib.import_module(f"{__package__}.{module_name}")
        prefix = f"{name}_" if module_name == "chunked" else ""
        entry = Algorithm(
            name,
            gradients_in_forward,
            getattr(module, prefix + "infonce_forward"),
            getattr(module, prefix + "infonce_backward"),
            getattr(module, prefix + "select"),
        )
        ALGORITHMS[name] = entry
    return entry


def canonical_views(pred: torch.Tensor, embeds: torch.Tensor, *row_tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``pred [B, T, D]``, ``embeds [1 or B, A, D]`` and each per-row tensor ``[B, T]``: views of an entry's
    inputs (``[N, D]`` is one sequence of ``N`` steps, per-sequence ``[B, D]`` ``B`` one-step sequences), for the
    algorithms that index sequences and steps on the host (chunked, eager)."""
    per_sequence = embeds.dim() == 3
    pred3 = pred if pred.dim() == 3 else (pred[:, None] if per_sequence else pred[None])
    embeds3 = embeds if per_sequence else embeds[None]
    return (pred3, embeds3, *(t.view(pred3.shape[:2]) for t in row_tensors))


def count_rows(targets: torch.Tensor, ignore_index: int, runs: int) -> torch.Tensor:
    """The non-ignored rows of each run (int64 ``[runs]``, 0-dim for one run): the mean's divisor."""
    used = targets != ignore_index
    return used.sum() if runs == 1 else used.view(runs, -1).sum(1)


def reduce_losses(losses: torch.Tensor, reduction: str, runs: int, count: torch.Tensor | None) -> torch.Tensor:
    """Per-row ``losses`` (0 on ignored rows) reduced over each run: ``"none"`` as they are, ``"sum"``, or
    ``"mean"`` (``count``: :func:`count_rows`; a run whose rows are all ignored has mean 0 / 0 = NaN)."""
    if reduction == "none":
        return losses
    loss = losses.sum() if runs == 1 else losses.view(runs, -1).sum(1)
    return loss if count is None else loss / count


def row_weights(targets: torch.Tensor, ignore_index: int, count: torch.Tensor | None) -> torch.Tensor:
    """float32 per-row weights of the reduced loss's gradients (``Algorithm.infonce_forward``): ``1 / count[run]``
    on non-ignored rows (``count``: each run's non-ignored rows, over equal slices of the flat rows), or 1 where
    ``count`` is None (``"sum"``); 0 on ignored rows. Where every row of a run is ignored, ``1 / 0`` is taken by
    no row (the reference's gradients are then 0)."""
    used = targets != ignore_index
    if count is None:
        return used.float()
    scale = 1.0 / count
    if count.dim() > 0:  # one count per run: each row takes its run's
        scale = scale.repeat_interleave(targets.numel() // count.numel()).view(targets.shape)
    return torch.where(used, scale, 0.0)


def _fp32_gemms_are_ieee() -> bool:
    """Whether cuBLAS runs fp32 GEMMs in full fp32 (torch's default). With TF32 allowed they would be less
    accurate than the Triton kernels' IEEE fp32 dots, so fp32 inputs then keep the kernels."""
    try:
        return torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:  # a torch that refuses to mix its old and new precision settings: assume TF32
        return False


def infonce_algorithm(num_actions: int, dtype: torch.dtype) -> str:
    """The algorithm ``"auto"`` runs for an InfoNCE call with ``num_actions`` actions and inputs of ``dtype``."""
    if num_actions <= SMALL_MAX_ACTIONS:
        return SMALL
    if num_actions < ROW_CHUNKS_MIN_ACTIONS or (dtype == torch.float32 and not _fp32_gemms_are_ieee()):
        return FUSED
    return ROW_CHUNKS if num_actions < HUGE_MIN_ACTIONS else HUGE_ALGORITHM


def select_algorithm(num_actions: int, dtype: torch.dtype) -> str:
    """The algorithm ``"auto"`` runs for a selection with ``num_actions`` actions and inputs of ``dtype``."""
    if num_actions < SELECT_CHUNKS_MIN_ACTIONS or (dtype == torch.float32 and not _fp32_gemms_are_ieee()):
        return FUSED
    return ROW_CHUNKS if num_actions < HUGE_MIN_ACTIONS else HUGE_ALGORITHM


def depends_on_matmul_precision(num_actions: int, dtype: torch.dtype) -> bool:
    """Whether ``"auto"`` may change with torch's fp32 matmul precision (a setting that can change between
    calls): fp32 inputs at action counts where a chunked algorithm could run."""
    return dtype == torch.float32 and num_actions >= min(ROW_CHUNKS_MIN_ACTIONS, SELECT_CHUNKS_MIN_ACTIONS)


# -- chunk sizes (a private, per-context override for tests and the crossover sweep) -------------------
_chunk_sizes: contextvars.ContextVar[tuple[int | None, int | None]] = contextvars.ContextVar(
    "icrl_contrastive_chunk_sizes", default=(None, None)
)


@contextlib.contextmanager
def chunk_sizes(*, chunk_bytes: int | None = None, action_chunk: int | None = None) -> Iterator[None]:
    """Within the block (in this thread or task only: a ``contextvars`` override), the chunked algorithms use
    chunks of ``chunk_bytes`` of fp32 logits and ``action_chunk`` actions where given (``None``: the defaults,
    :data:`CHUNK_BYTES`, :data:`ACTION_CHUNK`). A private knob for tests (tiny chunks, so that several run at
    small sizes) and for the crossover sweep.

    Raises:
        ValueError: a chunk size below 4 bytes / 1 action.
    """
    if chunk_bytes is not None and chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must hold at least one fp32 logit, got {chunk_bytes}")
    if action_chunk is not None and action_chunk < 1:
        raise ValueError(f"action_chunk must be >= 1, got {action_chunk}")
    token = _chunk_sizes.set((chunk_bytes, action_chunk))
    try:
        yield
    finally:
        _chunk_sizes.reset(token)


def chunk_shape(num_actions: int, algorithm: str) -> tuple[int, int]:
    """``(rows, actions)`` of a chunk of the chunked ``algorithm``: ``actions`` is the whole set for
    :data:`ROW_CHUNKS` and :data:`ACTION_CHUNK` (at most) for :data:`ACTION_CHUNKS`; ``rows`` fills
    :data:`CHUNK_BYTES` of fp32 logits, rounded down to a multiple of :data:`CHUNK_ROW_MULTIPLE` when larger,
    and at least 1."""
    chunk_bytes, action_chunk = _chunk_sizes.get()
    actions = num_actions
    if algorithm == ACTION_CHUNKS:
        actions = min(num_actions, action_chunk or ACTION_CHUNK)
    rows = (chunk_bytes or CHUNK_BYTES) // (4 * actions)
    if rows >= 2 * CHUNK_ROW_MULTIPLE:
        rows -= rows % CHUNK_ROW_MULTIPLE
    return max(1, rows), actions


def infonce_memory_bytes(
    algorithm: str, N: int, D: int, A: int, *, itemsize: int, maps: int = 1, want_embeds: bool = False
) -> int:
    """Predicted peak device memory of one forward + backward (``reduction="mean"``, gradient for ``pred``
    and, with ``want_embeds``, the map) beyond its inputs, the returned gradients included: an estimate from
    the buffers each algorithm allocates (allocator rounding not counted).

    Per row the forward writes a loss, a log-sum-exp and a status (9 bytes). :data:`FUSED` keeps nothing
    else: its backward allocates the gradients. The others keep the gradients they compute in the forward
    (``N D s`` for ``pred``) until the backward has scaled them into new tensors, so both exist at once;
    the chunked ones also hold one chunk of fp32 logits and, with action chunks, each row's running
    statistics (16 bytes) and a fp32 ``[rows, D]`` accumulator of the chunk's gradient. The map's gradient
    adds ``maps A D s`` and, chunked, its fp32 accumulator.
    """
    rows_bytes = 9 * N
    grad_pred = N * D * itemsize
    grad_embeds = maps * A * D * itemsize if want_embeds else 0
    if algorithm == FUSED:
        return max(rows_bytes, grad_pred + grad_embeds + 4 * N)  # + the backward's fp32 row weights
    saved = grad_pred + grad_embeds
    forward = saved + rows_bytes
    if algorithm in (ROW_CHUNKS, ACTION_CHUNKS):
        rows, actions = chunk_shape(A, algorithm)
        forward += 4 * rows * actions + (4 * maps * A * D if want_embeds else 0)
        if actions < A:
            forward += 16 * N + 4 * rows * D
    return max(forward, 2 * saved)
