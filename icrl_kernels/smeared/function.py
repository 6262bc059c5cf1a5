"""Public entry point of smeared keys and its custom-op registration."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._library import differentiable_op
from .._validation import KERNEL_FLOAT_DTYPES
from .reference import (
    check_smeared_keys_args,
    compute_dtype_of,
    next_positions,
    previous_positions,
    smear_weight,
    smeared_keys_reference,
)


def smeared_keys_backward_eager(
    grad_out: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients in PyTorch: ``grad_k[j] = w g[j] + (1 - w) g[j + 1]`` and
    ``grad_alpha[h] = w (1 - w) sum_{b, j, d} g[j] (k[j] - k[j - 1])`` with ``w = sigmoid(alpha[h])``."""
    dtype = compute_dtype_of(k)
    weight = smear_weight(alpha, dtype)
    grad, keys = grad_out.to(dtype), k.to(dtype)
    grad_k = weight * grad + (1 - weight) * next_positions(grad)
    weight = weight.view(-1)
    grad_alpha = (grad * (keys - previous_positions(keys))).sum(dim=(0, 2, 3)) * weight * (1 - weight)
    return grad_k.to(k.dtype).contiguous(), grad_alpha.to(alpha.dtype)


def _forward(k: torch.Tensor, alpha: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "triton":
        from .kernels import smeared_keys_forward_triton

        return smeared_keys_forward_triton(k, alpha)
    # Elementwise ops keep a strided input's layout; the op promises contiguous outputs (as its fake does).
    return smeared_keys_reference(k, alpha).contiguous()


def _forward_fake(k, alpha, impl):
    return k.new_empty(k.shape)


def _backward(
    grad_out: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "triton":
        from .kernels import smeared_keys_backward_triton

        return smeared_keys_backward_triton(grad_out, k, alpha)
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
    grad_inputs=(0, 1),
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
)


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
    check_smeared_keys_args(k, alpha)
    impl = resolve_backend(backend, k.device)
    if impl == "reference" or k.numel() == 0:  # nothing to launch for an empty batch, sequence or head
        return smeared_keys_reference(k, alpha)
    if impl == "triton":
        for name, tensor in (("k", k), ("alpha", alpha)):
            if tensor.dtype not in KERNEL_FLOAT_DTYPES:
                raise TypeError(f"{name} must be float16, bfloat16 or float32 for backend='triton', got {tensor.dtype}")
    return smeared_keys_op(k, alpha, impl)
