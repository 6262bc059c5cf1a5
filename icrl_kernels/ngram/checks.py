"""Argument checks of n-gram match attention, shared by :func:`ngram_attention`, :func:`ngram_plan` and the
checked references. Shapes, dtypes and devices are read on the host; the one value check (a plan's ids
against the ids given) goes through ``check_values`` (no host sync on CUDA)."""

from __future__ import annotations

import torch

from .._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    check_values,
)
from .plan import NGramPlan

#: ``algorithm=`` of :func:`ngram_attention`.
ALGORITHMS = ("auto", "sort", "tiled")


def check_ids_and_n(ids: object, n: object) -> tuple[torch.Tensor, int]:
    """Check ``ids [B, L]`` (integer, non-empty) and ``n >= 1``; return ids as int64 and n as int."""
    check_tensor(ids, "ids", ndim=2, dtypes=INT_DTYPES)
    if ids.shape[0] == 0:
        raise ValueError(f"ids must have a non-empty batch, got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError(f"ids must have at least one position, got shape {tuple(ids.shape)}")
    return ids.long(), check_int(n, "n", min_value=1)


def check_ngram_attention_args(h: object, ids: object, n: object) -> tuple[torch.Tensor, int]:
    """The tensor and ``n`` checks of :func:`ngram_attention` and its reference; return ids as int64 and n
    as int.

    Raises:
        TypeError: a non-tensor, a non-float ``h``, non-integer ``ids``, a non-int ``n``.
        ValueError: wrong ranks, ``ids`` not ``h.shape[:2]``, empty ``ids``/``h``, ``n < 1``, devices that differ.
    """
    check_tensor(h, "h", ndim=3, dtypes=FLOAT_DTYPES)
    ids, n = check_ids_and_n(ids, n)
    check_shape(ids, "ids", tuple(h.shape[:2]), "h.shape[:2]")
    check_same_device(h=h, ids=ids)
    if h.shape[2] == 0:
        raise ValueError(f"h must have a non-empty feature dimension, got shape {tuple(h.shape)}")
    return ids, n


def check_plan(plan: object, ids: torch.Tensor, n: int) -> NGramPlan:
    """Check that ``plan`` is an :class:`NGramPlan` built from these ``ids [B, L]`` and this ``n``.

    Shapes, device and ``n`` are compared on the host. If ``plan.ids`` is the very tensor given, its
    version counter tells whether it was written in place since the build (then refused). Otherwise
    the ids are compared element by element; that compare goes through
    ``check_values`` (a device-side assert on CUDA, no host sync) and reads ``2 B L`` ids, nothing next
    to ``h``.

    Raises:
        TypeError: ``plan`` is not an :class:`NGramPlan`.
        ValueError: it was built for another ``n``, another shape, device or other ids.
    """
    if not isinstance(plan, NGramPlan):
        raise TypeError(f"plan must be an NGramPlan (from ngram_plan(ids, n)), got {type(plan).__name__}")
    if plan.n != n:
        raise ValueError(f"plan was built for n={plan.n}, but n={n}; build one with ngram_plan(ids, {n})")
    for name in (*NGramPlan._fields, "ids"):
        check_shape(getattr(plan, name), f"plan.{name}", tuple(ids.shape), "ids.shape")
    check_same_device(ids=ids, **{"plan.ids": plan.ids})
    if plan.ids is ids:
        # The plan holds the tensor itself (no copy): an in-place write since the build cannot be told
        # apart from one that kept the values, so any write is refused.
        if ids._version != plan._ids_version:
            raise ValueError("plan was built from ids that were modified in place since; build a new ngram_plan")
    else:
        check_values(
            (plan.ids.long() != ids.long()).any(),
            "plan was built from other ids than the ids given; build it with ngram_plan(ids, n)",
        )
    return plan
