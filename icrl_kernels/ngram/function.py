"""Public entry point of n-gram match attention and its custom-op registration."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._library import differentiable_op
from .._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    KERNEL_FLOAT_DTYPES,
    check_choice,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)
from .eager import ngram_backward_eager, ngram_forward_eager
from .plan import NGramPlan, _ngram_plan_op
from .reference import ngram_attention_reference


def validate_ids_and_n(ids: object, n: object) -> tuple[torch.Tensor, int]:
    """Check ``ids [B, L]`` (integer, non-empty) and ``n >= 1``; return ids as int64 and n as int."""
    check_tensor(ids, "ids", ndim=2, dtypes=INT_DTYPES)
    if ids.shape[0] == 0:
        raise ValueError(f"ids must have a non-empty batch, got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError(f"ids must have at least one position, got shape {tuple(ids.shape)}")
    return ids.long(), check_int(n, "n", min_value=1)


def _forward(h: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "triton":
        from .kernels import ngram_forward_triton

        return ngram_forward_triton(h, perm, meta, count)
    return ngram_forward_eager(h, perm, meta, count)


def _forward_fake(h, perm, meta, count, impl):
    return torch.empty_like(h)


def _backward(
    grad_out: torch.Tensor, perm: torch.Tensor, meta: torch.Tensor, count: torch.Tensor, impl: str
) -> torch.Tensor:
    if impl == "triton":
        from .kernels import ngram_backward_triton

        return ngram_backward_triton(grad_out, perm, meta, count)
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
    grad_inputs=(0,),
)


def _tiled_forward(h: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .tiled_kernels import ngram_tiled_forward_triton

    return ngram_tiled_forward_triton(h, ids, n)


def _tiled_forward_fake(h, ids, n):
    return torch.empty_like(h), ids.new_empty(ids.shape, dtype=torch.int32)


def _tiled_backward(grad_out: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    from .tiled_kernels import ngram_tiled_backward_triton

    return ngram_tiled_backward_triton(grad_out, ids, count, n)


def _tiled_backward_fake(grad_out, ids, count, n):
    return torch.empty_like(grad_out)


ngram_attention_tiled_op, ngram_attention_tiled_backward_op = differentiable_op(
    "ngram_attention_tiled",
    forward=_tiled_forward,
    forward_fake=_tiled_forward_fake,
    backward=_tiled_backward,
    backward_fake=_tiled_backward_fake,
    save=lambda inputs, output: (inputs[1], output[1], inputs[2]),  # (ids, count, n)
    grad_inputs=(0,),
    differentiable_outputs=1,
)

ALGORITHMS = ("auto", "sort", "tiled")

#: Up to this context length the ``"auto"`` algorithm of the Triton backend is the tiled kernel.
#: An estimate (no GPU measurement yet): the tiled kernel does O(L^2 D) work in two launches, the
#: sort path O(L D) memory traffic plus a sort and a dozen small launches.
TILED_MAX_LENGTH = 512


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
        n: n-gram length, ``n >= 1`` (``n > L`` gives all zeros).
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager),
            ``"triton"``, ``"eager"`` (sort + prefix sums in PyTorch) or ``"reference"`` (dense O(L^2)).
        plan: a precomputed :func:`ngram_plan` of ``(ids, n)``, to share the sort across layers.
        algorithm: Triton backend only: ``"sort"`` (sort + segmented sums, O(L log L + L D)),
            ``"tiled"`` (on-the-fly mask tiles, O(L^2 D), no sort) or ``"auto"`` (tiled up to
            ``TILED_MAX_LENGTH`` positions unless a plan is given, sort beyond).

    Returns:
        ``[B, L, D]`` in ``h.dtype``; differentiable w.r.t. ``h`` (ids get no gradient).
    """
    check_tensor(h, "h", ndim=3, dtypes=FLOAT_DTYPES)
    ids, n = validate_ids_and_n(ids, n)
    check_shape(ids, "ids", tuple(h.shape[:2]), "h.shape[:2]")
    check_same_device(h=h, ids=ids)
    if h.shape[2] == 0:
        raise ValueError(f"h must have a non-empty feature dimension, got shape {tuple(h.shape)}")
    check_choice(algorithm, "algorithm", ALGORITHMS)
    impl = resolve_backend(backend, h.device)
    if algorithm == "tiled" and impl != "triton":
        raise ValueError(f"algorithm='tiled' needs the Triton backend, but backend={backend!r} resolved to {impl!r}")
    if impl == "reference":
        return ngram_attention_reference(h, ids, n)
    if impl == "triton":
        if h.dtype not in KERNEL_FLOAT_DTYPES:
            raise TypeError(f"h must be float16, bfloat16 or float32 for backend='triton', got {h.dtype}")
        if algorithm == "auto":
            algorithm = "tiled" if plan is None and h.shape[1] <= TILED_MAX_LENGTH else "sort"
        if algorithm == "tiled":
            return ngram_attention_tiled_op(h, ids, n)[0]
    if plan is None:
        plan = NGramPlan(*_ngram_plan_op(ids, n))
    else:
        for name, tensor in zip(NGramPlan._fields, plan):
            check_shape(tensor, f"plan.{name}", tuple(ids.shape), "ids.shape")
            check_same_device(h=h, **{f"plan.{name}": tensor})
    return ngram_attention_op(h, plan.perm, plan.meta, plan.count, impl)
