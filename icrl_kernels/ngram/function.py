"""Public entry point of n-gram match attention and its custom-op registration."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from .._backend import resolve_backend
from .._library import checked_per_signature, differentiable_op, fold_vmap_into_batch, inference_op
from .._validation import check_choice
from . import reference
from .checks import ALGORITHMS, check_ids_and_n, check_ngram_attention_args, check_plan
from .eager import ngram_backward_eager, ngram_forward_eager
from .plan import NGramPlan, build_ngram_plan


@functools.cache
def _kernels() -> ModuleType:
    """The sort path's Triton kernels (they need Triton), imported on the Triton backend's first call."""
    from . import kernels

    return kernels


@functools.cache
def _plan_kernels() -> ModuleType:
    """The plan's Triton kernels."""
    from . import plan_kernels

    return plan_kernels


@functools.cache
def _tiled_kernels() -> ModuleType:
    """The tiled kernels."""
    from . import tiled_kernels

    return tiled_kernels


# -- the plan (sort) ------------------------------------------------------------------------------
def _ngram_plan(ids: torch.Tensor, n: int, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's tensors: from the Triton plan kernels on the Triton backend (five launches instead of ~40,
    :mod:`.plan_kernels`), else from :func:`build_ngram_plan`. Identical values."""
    if impl == "triton":
        return _plan_kernels().build_ngram_plan_triton(ids, n)
    return tuple(build_ngram_plan(ids, n))


def _ngram_plan_fake(ids: torch.Tensor, n: int, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        ids.new_empty(ids.shape, dtype=torch.int64),
        ids.new_empty(ids.shape, dtype=torch.uint8),
        ids.new_empty(ids.shape, dtype=torch.int32),
    )


# The Triton plan is traceable (kernels and sorts, no host read): torch.compile sees its kernels.
_ngram_plan_op = fold_vmap_into_batch(
    inference_op("ngram_plan", _ngram_plan, fake=_ngram_plan_fake, traceable=("triton",))
)


def ngram_plan(ids: torch.Tensor, n: int) -> NGramPlan:
    """Build the :class:`NGramPlan` of ``ids [B, L]`` for n-gram length ``n`` (a torch custom op).

    Computing a plan costs one sort of ``B x L`` keys; layers that share ids and ``n`` can share it
    through ``ngram_attention(..., plan=plan)``.
    """
    original_ids = ids
    ids, n = check_ids_and_n(ids, n)
    impl = "triton" if resolve_backend("auto", ids.device) == "triton" else "eager"
    return NGramPlan(*_ngram_plan_op(ids, n, impl), ids=original_ids, n=n)


# -- the sort path's op -----------------------------------------------------------------------------
def _forward(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "triton":
        return _kernels().ngram_forward_triton(h, perm, meta, count)
    return ngram_forward_eager(h, perm, meta, count)


def _forward_fake(h, perm, meta, count, impl):
    return torch.empty_like(h)


def _backward(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor, impl: str
) -> torch.Tensor:
    if impl == "triton":
        return _kernels().ngram_backward_triton(grad_out, perm, meta, count)
    return ngram_backward_eager(grad_out, perm, meta, count)


def _backward_fake(grad_out, perm, meta, count, impl):
    return torch.empty_like(grad_out)


ngram_attention_op, ngram_attention_backward_op = differentiable_op(
    "ngram_attention",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=lambda inputs, output: inputs[1:],  # (perm, meta, count, impl)
    saved_tensors=3,
    grad_inputs=(0,),
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
)
fold_vmap_into_batch(ngram_attention_op)


def _tiled_forward(h: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _tiled_kernels().ngram_tiled_forward_triton(h, ids, n)


def _tiled_forward_fake(h, ids, n):
    return torch.empty_like(h), ids.new_empty(ids.shape, dtype=torch.int32)


def _tiled_backward(grad_out: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    return _tiled_kernels().ngram_tiled_backward_triton(grad_out, ids, count, n)


def _tiled_backward_fake(grad_out, ids, count, n):
    return torch.empty_like(grad_out)


ngram_attention_tiled_op, ngram_attention_tiled_backward_op = differentiable_op(
    "ngram_attention_tiled",
    forward=_tiled_forward,
    forward_fake=_tiled_forward_fake,
    backward=_tiled_backward,
    backward_fake=_tiled_backward_fake,
    save=lambda inputs, output: (inputs[1], output[1], inputs[2]),  # (ids, count, n)
    saved_tensors=2,
    grad_inputs=(0,),
    differentiable_outputs=1,
    traceable=True,  # Triton only: torch.compile traces into the kernels (triton_op)
    materialize_grads=False,  # no zero gradient for the match counts, saved for the backward only
)
fold_vmap_into_batch(ngram_attention_tiled_op)

#: Per dtype of ``h``: up to this context length ``L`` the ``"auto"`` algorithm of the Triton backend
#: is the tiled kernel, beyond it the sort path: the two crossed between 2048 and 4096 on an H200 and
#: an H100 in fp32 and bf16 (fp16 takes bf16's value), the sort path being host-bound (launches) below.
#: ``benchmarks/bench_ngram_attention.py::test_ngram_tiled_crossover`` measures it; the numbers are in
#: ``benchmarks/results/kernel-constants.md#n-gram-tiled-vs-sort``.
TILED_MAX_LENGTH: dict[torch.dtype, int] = {torch.float32: 2048, torch.float16: 2048, torch.bfloat16: 2048}

#: CPU without Triton, ``backend="auto"``: up to this ``L`` the dense reference (one batched matmul of
#: the ``[B, L, L]`` pattern) is faster than the eager sort path, and ``"auto"`` takes it; up to
#: ``CPU_DENSE_MAX_LENGTH_WIDE`` for features at least ``CPU_WIDE_DIM`` wide, where the sort path's
#: per-column segmented scans cost more. Measured with ``benchmarks/ngram_cpu_crossover.py``; the numbers
#: are in ``benchmarks/results/README.md`` (n-gram ``backend="auto"`` on the CPU).
CPU_DENSE_MAX_LENGTH = 256
CPU_DENSE_MAX_LENGTH_WIDE = 512
CPU_WIDE_DIM = 256

#: ... as long as the dense pattern stays small: ``B * L * L`` at most this many elements (128 MiB as
#: fp32; the reference also keeps a bool copy and the autograd graph keeps the fp32 one). Both paths
#: are linear in ``B``, so this bounds memory, not the crossover: a huge batch takes the sort path.
CPU_DENSE_MAX_PATTERN_ELEMENTS = 2**25


def _cpu_auto_uses_dense(h: torch.Tensor, plan: NGramPlan | None) -> bool:
    """Whether ``backend="auto"``, resolved to eager, should take the dense reference instead (see
    ``CPU_DENSE_MAX_LENGTH``). A given ``plan`` keeps the sort path: the caller has already paid for the
    sort (to share it across layers), and the dense path would ignore it."""
    batch, length, dim = h.shape
    max_length = CPU_DENSE_MAX_LENGTH_WIDE if dim >= CPU_WIDE_DIM else CPU_DENSE_MAX_LENGTH
    return (
        plan is None
        and h.device.type == "cpu"
        and length <= max_length
        and batch * length * length <= CPU_DENSE_MAX_PATTERN_ELEMENTS
    )


@checked_per_signature
def _checked_call(h: object, ids: object, n: object, backend: object, algorithm: object) -> tuple[int, str]:
    """The argument checks (but a plan's) and the backend of a call: ``(n, impl)``."""
    _, n = check_ngram_attention_args(h, ids, n)
    check_choice(algorithm, "algorithm", ALGORITHMS)
    impl = resolve_backend(backend, h.device, kernel_inputs={"h": h})
    if algorithm == "tiled" and impl != "triton":
        raise ValueError(f"algorithm='tiled' needs the Triton backend, but backend={backend!r} resolved to {impl!r}")
    return n, impl


def ngram_attention(
    h: torch.Tensor,
    ids: torch.Tensor,
    n: int,
    *,
    backend: str = "auto",
    plan: NGramPlan | None = None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """N-gram induction-head attention ``A(n) @ h`` (no projections), exact, in O(L log L + L D).

    ``A[b, i, j] = 1`` iff ``j < i`` and ``ids[b, i-k] == ids[b, j-1-k] >= 0`` for every
    ``k in 0..n-1``: the query n-gram ends at ``i``, the key n-gram ends at ``j - 1``, and the value is
    ``h[b, j]``, the token that followed the matched n-gram. Each row is the uniform mean over its
    matches; a row with no match is exactly zero; negative ids are padding and never match.

    Args:
        h: hidden states ``[B, L, D]``, fp32/fp16/bf16 (fp64 on the eager and reference backends).
        ids: token ids ``[B, L]``, integer, same device as ``h``; any magnitude.
        n: n-gram length, an int ``>= 1`` (``n >= L - 1`` gives all zeros: no key can match; the cost
            does not grow with ``n`` beyond ``L``).
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``; otherwise, on the CPU, the
            dense reference up to ``CPU_DENSE_MAX_LENGTH`` positions, where it is faster, and eager
            beyond), ``"triton"``, ``"eager"`` (always sort + prefix sums in PyTorch) or
            ``"reference"`` (dense O(L^2)).
        plan: a precomputed :func:`ngram_plan` of ``(ids, n)``, to share the sort across layers. A plan
            always selects a sort path: ``"auto"`` then never takes the dense or tiled path. A plan
            built for another ``n`` or other ids raises ``ValueError`` (the ids compare is a device-side
            check, see :func:`check_plan`).
        algorithm: Triton backend only: ``"sort"`` (sort + segmented sums, O(L log L + L D)),
            ``"tiled"`` (on-the-fly mask tiles, O(L^2 D), no sort) or ``"auto"`` (tiled up to
            ``TILED_MAX_LENGTH[h.dtype]`` positions unless a plan is given, sort beyond).

    Returns:
        ``[B, L, D]`` in ``h.dtype``; differentiable w.r.t. ``h`` (ids get no gradient). A non-finite value
        in ``h`` (or in the gradient) reaches only the outputs (gradients) that average over it on the sort
        paths (eager and Triton): it never leaks into other n-gram segments. The dense paths (the
        reference, which CPU ``"auto"`` uses for short contexts, and the Triton *tiled* kernel, GPU
        ``"auto"`` for short contexts) multiply 0/1 patterns with ``h``, so ``0 * inf = nan`` spreads an
        ``inf``/``nan`` of ``h`` to its batch row (tile). Finite outliers stay in their segment on
        every path.

    Raises:
        TypeError: an argument of the wrong type or dtype (``h``, ``ids``, ``n``, ``plan``).
        ValueError: wrong ranks or shapes, empty ``ids``/``h``, ``n < 1``, devices that differ, an unknown
            ``backend`` or ``algorithm``, a ``plan`` of other ids or another ``n``.
    """
    n, impl = _checked_call(h, ids, n, backend, algorithm)
    ids = ids.long()
    if plan is not None:
        check_plan(plan, ids, n)
    length = h.shape[1]
    # No n-gram of more than L ids fits in a row: every n > L gives the same all-zero output as L + 1,
    # so the work stays O(L) whatever n is (the tiled kernel unrolls n compares; the plan packs n ids).
    n = min(n, length + 1)
    if backend == "auto" and impl == "eager" and _cpu_auto_uses_dense(h, plan):
        impl = "reference"
    if impl == "reference":
        return reference.ngram_attention_reference(h, ids, n)
    if impl == "triton":
        if algorithm == "auto" or n > length:  # n > L: nothing matches; the sort path's plan is O(1) then
            algorithm = "tiled" if plan is None and length <= TILED_MAX_LENGTH[h.dtype] and n <= length else "sort"
        if algorithm == "tiled":
            return ngram_attention_tiled_op(h, ids, n)[0]
    if plan is None:
        perm, meta, count = _ngram_plan_op(ids, n, impl)
    else:
        perm, meta, count = plan
    return ngram_attention_op(h, perm, meta, count, impl)


def ngram_attention_reference(h: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The dense reference of :func:`ngram_attention` (:func:`.reference.ngram_attention_reference`, the op's
    spec: ``A(n) @ h`` with each row divided by its match count, O(B L^2)) behind the same argument checks.

    Returns:
        ``[B, L, D]`` in ``h.dtype``, computed in fp32 (fp64 for fp64 ``h``); differentiable w.r.t. ``h``.

    Raises:
        ValueError/TypeError naming the argument, as :func:`ngram_attention`.
    """
    ids, n = check_ngram_attention_args(h, ids, n)
    return reference.ngram_attention_reference(h, ids, n)


def ngram_match_matrix(ids: torch.Tensor, n: int) -> torch.Tensor:
    """The n-gram match pattern ``A [B, L, L]`` (bool) of token ids ``ids [B, L]``
    (:func:`.reference.ngram_match_matrix`): ``A[b, i, j]`` is true iff ``j < i`` and the n-gram ending at
    ``i`` equals the one ending at ``j - 1``, with no negative (padding) id in either.

    Raises:
        TypeError: non-integer ``ids``, a non-int ``n``. ValueError: ``ids`` not 2-D or empty, ``n < 1``.
    """
    ids, n = check_ids_and_n(ids, n)
    return reference.ngram_match_matrix(ids, n)
