"""Dense eager reference of n-gram match attention: the specification of the op.

O(B * L^2) time and memory; use it for tests and small inputs only. The functions here take checked
arguments (:mod:`.checks`); the public, checked ones are :func:`icrl_kernels.ngram_attention_reference`
and :func:`icrl_kernels.ngram_match_matrix`.
"""

from __future__ import annotations

import torch

from .._library import compute_dtype


def ngram_match_matrix(ids: torch.Tensor, n: int) -> torch.Tensor:
    """The n-gram match pattern ``A [B, L, L]`` (bool) of token ids ``ids [B, L]``.

    ``A[b, i, j]`` is true iff ``j < i`` and ``ids[b, i-k] == ids[b, j-1-k] >= 0`` for every
    ``k in 0..n-1`` (all indices in range): the query's n-gram ends at ``i``, the key's n-gram ends
    at ``j - 1``, so the value read is the token that followed the matched n-gram. Negative ids are
    padding and never match.
    """
    _, length = ids.shape
    i = torch.arange(length, device=ids.device).view(length, 1)
    j = torch.arange(length, device=ids.device).view(1, length)
    match = (j < i) & (i >= n - 1) & (j >= n)
    match = match.unsqueeze(0).expand(ids.shape[0], length, length).clone()
    for k in range(min(n, length)):
        query_ids = ids[:, (i - k).clamp(min=0).squeeze(1)].unsqueeze(2)  # [B, L, 1]
        key_ids = ids[:, (j - 1 - k).clamp(min=0).squeeze(0)].unsqueeze(1)  # [B, 1, L]
        match = match & (query_ids == key_ids) & (query_ids >= 0)
    return match


def ngram_attention_reference(h: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``A(n) @ h`` with each row of ``A`` divided by its match count (rows without a match give 0).

    Finite outliers are exact here (each output is one matmul row). A non-finite value of ``h`` spreads
    to every query of its batch row, as in any matmul (``0 * inf = nan``); the sort paths keep it in its
    own segment.

    Args:
        h: hidden states ``[B, L, D]``, any float dtype; the math runs in fp32 (fp64 stays fp64).
        ids: token ids ``[B, L]`` (integer); negative ids are padding.
        n: n-gram length, ``n >= 1`` (cost O(min(n, L)) in ``n``).

    Returns:
        ``[B, L, D]`` in ``h.dtype``.
    """
    dtype = compute_dtype(h)
    pattern = ngram_match_matrix(ids.long(), n).to(dtype)
    count = pattern.sum(dim=-1, keepdim=True)
    out = (pattern @ h.to(dtype)) / count.clamp(min=1)
    return out.to(h.dtype)
