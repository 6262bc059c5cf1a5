"""Random orthonormal action embeddings (Headless-AD's per-step action map)."""

from __future__ import annotations

import warnings

import torch

from .._validation import check_bool, check_device, check_generator, check_int


class OvercompleteEmbeddingWarning(UserWarning):
    """More actions than embedding dimensions: the rows cannot all be orthonormal."""


def orthonormal_embeddings(
    num_actions: int,
    dim: int,
    *,
    batch: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = False,
) -> torch.Tensor:
    """Haar-random action embeddings with orthonormal rows: ``[num_actions, dim]`` (or ``[batch, ...]``).

    Each map is the QR factor of a standard Gaussian matrix with the signs of ``diag(R)`` folded into
    ``Q`` (what ``torch.nn.init.orthogonal_`` does), which makes it exactly Haar-distributed. Rows are
    unit vectors and mutually orthogonal while ``num_actions <= dim``, so a prediction aligned with one
    action's embedding puts no similarity on any other. With ``num_actions > dim`` that is impossible:
    then the *columns* are orthonormal, rows have norms below 1 and overlap; a warning
    (:class:`OvercompleteEmbeddingWarning`) says so, and ``strict=True`` raises instead.

    Args:
        num_actions: ``A >= 1`` rows.
        dim: embedding width ``D >= 1``.
        batch: ``None`` for one map ``[A, D]``; an int for ``batch`` independent maps ``[batch, A, D]``
            drawn in one call (one per sequence).
        generator: makes the draw reproducible. The Gaussian is drawn on the generator's device and moved to
            ``device``, so a CPU generator gives the same maps on every device.
        device, dtype: of the result (default: the generator's device or CPU, float32). The QR runs in
            float32 (float64 if asked for) and the result is cast.
        strict: raise ``ValueError`` instead of warning when ``num_actions > dim``.
    """
    num_actions = check_int(num_actions, "num_actions", min_value=1)
    dim = check_int(dim, "dim", min_value=1)
    if batch is not None:
        batch = check_int(batch, "batch", min_value=1)
    check_generator(generator)
    strict = check_bool(strict, "strict")
    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    device = check_device(generator.device if generator is not None else "cpu") if device is None else device
    device = check_device(device)
    if num_actions > dim:
        message = (
            f"num_actions ({num_actions}) > dim ({dim}): action embeddings cannot be orthonormal; the columns "
            "are orthonormal instead and the rows overlap (use dim >= num_actions)"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, OvercompleteEmbeddingWarning, stacklevel=2)
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tall, wide = max(num_actions, dim), min(num_actions, dim)
    shape = (tall, wide) if batch is None else (batch, tall, wide)
    draw_device = generator.device if generator is not None else device
    gaussian = torch.randn(shape, generator=generator, device=draw_device, dtype=work_dtype).to(device)
    q, r = torch.linalg.qr(gaussian)
    # Fold sign(diag R) into Q so the distribution is Haar (QR alone is biased by its sign convention).
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    q = q * torch.where(signs == 0, 1.0, signs).unsqueeze(-2)
    embeddings = q if num_actions > dim else q.transpose(-2, -1)
    return embeddings.to(dtype).contiguous()
