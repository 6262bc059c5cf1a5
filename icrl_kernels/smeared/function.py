"""Public entry point of smeared keys and its custom-op registration."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from .._backend import resolve_backend
from .._library import checked_per_signature, differentiable_op, unfold_first, vmapped_first
from . import reference
from .checks import check_smeared_keys_args
from .eager import smeared_keys_backward_eager, smeared_keys_forward_eager


@functools.cache
def _kernels() -> ModuleType:
    """The Triton kernels (they need Triton), imported on the Triton backend's first call."""
    from . import kernels

    return kernels


def _forward(k: torch.Tensor, alpha: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "triton":
        return _kernels().smeared_keys_forward_triton(k, alpha)
    return smeared_keys_forward_eager(k, alpha)


def _forward_fake(k, alpha, impl):
    return k.new_empty(k.shape)


def _backward(
    grad_out: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "triton":
        return _kernels().smeared_keys_backward_triton(grad_out, k, alpha)
    return smeared_keys_backward_eager(grad_out, k, alpha)


def _backward_fake(grad_out, k, alpha, impl):
    return k.new_empty(k.shape), alpha.new_empty(alpha.shape)


smeared_keys_op, smeared_keys_backward_op = differentiable_op(
    "smeared_keys",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=lambda inputs, output: inputs,  # (k, alpha, impl)
    saved_tensors=2,
    grad_inputs=(0, 1),
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
)


def _smeared_keys_vmap(info, in_dims: tuple, k: torch.Tensor, alpha: torch.Tensor, impl: str):
    """vmap over ``K`` slices (runs trained as one batched model) in one launch: with one ``alpha`` for every
    slice the slices are more batch rows; with each slice's own ``alpha [K, H]`` they are more heads, ``k`` as
    ``[B, K * H, L, Dh]`` (a copy) and ``alpha`` as ``[K * H]``."""
    size = info.batch_size
    k_dim, alpha_dim = in_dims[:2]
    if alpha_dim is None:
        return unfold_first(smeared_keys_op(vmapped_first(k, k_dim, size).flatten(0, 1), alpha, impl), size)
    heads = alpha.shape[-1]
    k = vmapped_first(k, k_dim, size).movedim(0, 1).flatten(1, 2)  # [B, K * H, L, Dh]
    out = smeared_keys_op(k, vmapped_first(alpha, alpha_dim, size).flatten(), impl)
    return out.unflatten(1, (size, heads)).movedim(1, 0), 0


smeared_keys_op.register_vmap(_smeared_keys_vmap)


@checked_per_signature
def _checked_impl(k: object, alpha: object, backend: object) -> str:
    """The argument checks and the backend of a call: ``"triton"``, ``"eager"`` or ``"reference"`` (an empty
    batch, sequence or head too: nothing to launch)."""
    check_smeared_keys_args(k, alpha)
    impl = resolve_backend(backend, k.device, kernel_inputs={"k": k, "alpha": alpha})
    return "reference" if k.numel() == 0 else impl


def smeared_keys(k: torch.Tensor, alpha: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Smeared keys: ``k'_j = sigmoid(alpha_h) k_j + (1 - sigmoid(alpha_h)) k_{j-1}`` with ``k_{-1} = 0``.

    One learnable logit per head blends each key with the key one position earlier (the induction-heads
    lecture's "key smearing"), so that a single attention layer can match a query against the token
    *before* each key. Apply it to the keys after any positional rotation, before the scores.

    Args:
        k: keys ``[B, H, L, Dh]``, fp32/fp16/bf16 (fp64 on the eager and reference backends); any strides.
        alpha: smearing logits ``[H]``, float, same device as ``k``; ``sigmoid(alpha)`` weighs the current key.
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager), ``"triton"``,
            ``"eager"`` (the reference forward and a closed-form backward, as one custom op) or
            ``"reference"`` (plain PyTorch ops differentiated by autograd).

    Returns:
        ``[B, H, L, Dh]`` in ``k.dtype`` (contiguous, except on the reference backend), differentiable w.r.t. ``k``
        and ``alpha``; arithmetic is fp32 whatever the input dtype (fp64 for fp64 inputs).
    """
    impl = _checked_impl(k, alpha, backend)
    if impl == "reference":
        return reference.smeared_keys_reference(k, alpha)
    return smeared_keys_op(k, alpha, impl)


def smeared_keys_reference(k: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The readable fp32 reference of :func:`smeared_keys` (:func:`.reference.smeared_keys_reference`, the
    op's spec) behind the same argument checks: plain PyTorch ops, differentiated by autograd.

    Returns:
        ``[B, H, L, Dh]`` in ``k.dtype``, computed in fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError/TypeError naming the argument, as :func:`smeared_keys`.
    """
    check_smeared_keys_args(k, alpha)
    return reference.smeared_keys_reference(k, alpha)
