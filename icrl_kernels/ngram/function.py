"""Public entry point of n-gram match attention and its custom-op registration."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._library import differentiable_op
from .._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    KERNEL_FLOAT_DTYPES,
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


def ngram_attention(
    h: torch.Tensor,
    ids: torch.Tensor,
    n: int,
    *,
    backend: str = "auto",
    plan: NGramPlan | None = None,
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

    Returns:
        ``[B, L, D]`` in ``h.dtype``; differentiable w.r.t. ``h`` (ids get no gradient).
    """
    check_tensor(h, "h", ndim=3, dtypes=FLOAT_DTYPES)
    ids, n = validate_ids_and_n(ids, n)
    check_shape(ids, "ids", tuple(h.shape[:2]), "h.shape[:2]")
    check_same_device(h=h, ids=ids)
    if h.shape[2] == 0:
        raise ValueError(f"h must have a non-empty feature dimension, got shape {tuple(h.shape)}")
    impl = resolve_backend(backend, h.device)
    if impl == "reference":
        return ngram_attention_reference(h, ids, n)
    if impl == "triton" and h.dtype not in KERNEL_FLOAT_DTYPES:
        raise TypeError(f"h must be float16, bfloat16 or float32 for backend='triton', got {h.dtype}")
    if plan is None:
        plan = NGramPlan(*_ngram_plan_op(ids, n))
    else:
        for name, tensor in zip(NGramPlan._fields, plan):
            check_shape(tensor, f"plan.{name}", tuple(ids.shape), "ids.shape")
            check_same_device(h=h, **{f"plan.{name}": tensor})
    return ngram_attention_op(h, plan.perm, plan.meta, plan.count, impl)
