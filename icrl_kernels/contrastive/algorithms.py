"""Which algorithm computes InfoNCE and action selection on the Triton backend, chosen by the number of actions.

The same public functions (:func:`~icrl_kernels.infonce_loss`, :func:`~icrl_kernels.select_actions`,
``ActionMap``) run one of four algorithms (docs/ops.md#contrastive-action-scoring; their predicted costs are
in docs/performance.md#infonce-algorithms):

* :data:`SMALL` (``A`` up to one action tile): ONE kernel computes each row's loss, log-sum-exp and value
  checks and the gradient for ``pred`` (``softmax - one_hot``, the reduction's row weight and ``1 / tau``
  folded in), so the backward is a broadcast multiply by the upstream gradient (``small_kernels.py``).
* :data:`FUSED` (the three-pass kernels of ``kernels.py``): the logits never reach memory; the forward
  streams action tiles through an online log-sum-exp, the backward recomputes them.
* :data:`ROW_CHUNKS`: per chunk of rows, a cuBLAS GEMM writes the chunk's fp32 logits (sized to stay in
  L2), ONE Triton kernel turns them into losses, log-sum-exps and statuses and overwrites them in place with
  the gradient operand ``(softmax - one_hot) * w``, and GEMMs give the gradients for ``pred`` and, when
  asked, the map (``chunked.py``, ``chunked_kernels.py``).
* :data:`ACTION_CHUNKS`: the same over (row chunk, action chunk) blocks, for action sets too large for a
  chunk of rows: a first sweep carries each row's online log-sum-exp across the action chunks, a second
  recomputes each block's logits for the gradients.

The loss algorithms other than :data:`FUSED` compute the gradients in the forward when the reduction is
``"mean"`` or ``"sum"`` (the upstream gradient is then one scalar: the backward scales); with
``reduction="none"`` the backward runs them again with the upstream row weights.

Selection (argmax and Gumbel-max sampling) has no gradient: :data:`FUSED` is its one-kernel path (also
what :data:`SMALL` means for it), and the two chunked algorithms run the same GEMM chunks with a Triton
argmax / Gumbel-max kernel carrying each row's running best across action chunks.

**The thresholds below are placeholders**, estimates made before any GPU measured the new algorithms;
``benchmarks/bench_infonce.py::test_infonce_crossover`` and ``test_select_crossover`` (stage
``infonce-crossover`` of ``benchmarks/gpu_check.py``) time every algorithm over ``A`` = 125..10^6 and set
them (benchmarks/results/README.md says what that run must measure). :func:`forced_algorithm` pins an
algorithm (and the chunk sizes) for tests and for that sweep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

SMALL = "small"
FUSED = "fused"
ROW_CHUNKS = "row-chunks"
ACTION_CHUNKS = "action-chunks"
INFONCE_ALGORITHMS = (SMALL, FUSED, ROW_CHUNKS, ACTION_CHUNKS)
#: Selection's algorithms; :data:`SMALL` forced on a selection runs :data:`FUSED`, its one-kernel path.
SELECT_ALGORITHMS = (FUSED, ROW_CHUNKS, ACTION_CHUNKS)

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


@dataclass
class _Knobs:
    """Private overrides (:func:`forced_algorithm`): ``None`` keeps the default."""

    algorithm: str | None = None
    chunk_bytes: int | None = None
    action_chunk: int | None = None


_knobs = _Knobs()


@contextlib.contextmanager
def forced_algorithm(
    algorithm: str | None = None, *, chunk_bytes: int | None = None, action_chunk: int | None = None
) -> Iterator[None]:
    """Within the block, every InfoNCE and selection call on the Triton backend runs ``algorithm`` (one of
    :data:`INFONCE_ALGORITHMS`; ``None``: chosen by ``A`` as usual), with chunks of ``chunk_bytes`` of fp32
    logits and ``action_chunk`` actions where given. A private knob for tests (tiny chunks, so that several
    run at small sizes) and for the crossover sweep; not thread-safe. Restores the previous values on exit.

    Raises:
        ValueError: an unknown algorithm, or a chunk size below 4 bytes / 1 action.
    """
    if algorithm is not None and algorithm not in INFONCE_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {INFONCE_ALGORITHMS} or None, got {algorithm!r}")
    if chunk_bytes is not None and chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must hold at least one fp32 logit, got {chunk_bytes}")
    if action_chunk is not None and action_chunk < 1:
        raise ValueError(f"action_chunk must be >= 1, got {action_chunk}")
    previous = _Knobs(**vars(_knobs))
    _knobs.algorithm, _knobs.chunk_bytes, _knobs.action_chunk = algorithm, chunk_bytes, action_chunk
    try:
        yield
    finally:
        _knobs.algorithm, _knobs.chunk_bytes, _knobs.action_chunk = (
            previous.algorithm, previous.chunk_bytes, previous.action_chunk
        )  # fmt: skip


def _fp32_gemms_are_ieee() -> bool:
    """Whether cuBLAS runs fp32 GEMMs in full fp32 (torch's default). With TF32 allowed they would be less
    accurate than the Triton kernels' IEEE fp32 dots, so fp32 inputs then keep the kernels."""
    try:
        return torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:  # a torch that refuses to mix its old and new precision settings: assume TF32
        return False


def infonce_algorithm(num_actions: int, dtype: torch.dtype) -> str:
    """The algorithm of an InfoNCE call with ``num_actions`` actions and inputs of ``dtype`` (module doc).

    Raises:
        ValueError: :data:`SMALL` forced with more than :data:`SMALL_MAX_ACTIONS` actions.
    """
    forced = _knobs.algorithm
    if forced is not None:
        if forced == SMALL and num_actions > SMALL_MAX_ACTIONS:
            raise ValueError(f"algorithm {SMALL!r} holds at most {SMALL_MAX_ACTIONS} actions, got A = {num_actions}")
        return forced
    if num_actions <= SMALL_MAX_ACTIONS:
        return SMALL
    if num_actions < ROW_CHUNKS_MIN_ACTIONS or (dtype == torch.float32 and not _fp32_gemms_are_ieee()):
        return FUSED
    return ROW_CHUNKS if num_actions < HUGE_MIN_ACTIONS else HUGE_ALGORITHM


def select_algorithm(num_actions: int, dtype: torch.dtype) -> str:
    """The algorithm of a selection with ``num_actions`` actions and inputs of ``dtype`` (module doc)."""
    forced = _knobs.algorithm
    if forced is not None:
        return FUSED if forced == SMALL else forced
    if num_actions < SELECT_CHUNKS_MIN_ACTIONS or (dtype == torch.float32 and not _fp32_gemms_are_ieee()):
        return FUSED
    return ROW_CHUNKS if num_actions < HUGE_MIN_ACTIONS else HUGE_ALGORITHM


def chunk_shape(num_actions: int, algorithm: str) -> tuple[int, int]:
    """``(rows, actions)`` of a chunk of the chunked ``algorithm``: ``actions`` is the whole set for
    :data:`ROW_CHUNKS` and :data:`ACTION_CHUNK` (at most) for :data:`ACTION_CHUNKS`; ``rows`` fills
    :data:`CHUNK_BYTES` of fp32 logits, rounded down to a multiple of :data:`CHUNK_ROW_MULTIPLE` when larger,
    and at least 1."""
    chunk_bytes = _knobs.chunk_bytes or CHUNK_BYTES
    actions = num_actions
    if algorithm == ACTION_CHUNKS:
        actions = min(num_actions, _knobs.action_chunk or ACTION_CHUNK)
    rows = chunk_bytes // (4 * actions)
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
