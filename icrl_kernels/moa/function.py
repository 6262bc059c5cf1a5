"""Public entry point of Mixture-of-Attention head gating and its custom-op registration."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from .._backend import resolve_backend
from .._library import checked_per_signature, differentiable_op, empty_output_like, fold_vmap_into_batch
from . import reference
from .checks import check_mixture_of_heads_args
from .eager import mixture_of_heads_backward_eager, mixture_of_heads_forward_eager


@functools.cache
def _kernels() -> ModuleType:
    """The Triton kernels (they need Triton), imported on the Triton backend's first call."""
    from . import kernels

    return kernels


def _forward(head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str, impl: str) -> torch.Tensor:
    if impl == "triton":
        return _kernels().mixture_of_heads_forward_triton(head_out, gate_logits, gate)
    return mixture_of_heads_forward_eager(head_out, gate_logits, gate)


def _forward_fake(head_out, gate_logits, gate, impl):
    batch, length, heads, head_dim = head_out.shape
    return head_out.new_empty((batch, length, heads * head_dim))


def _backward(
    grad_out: torch.Tensor, head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "triton":
        return _kernels().mixture_of_heads_backward_triton(grad_out, head_out, gate_logits, gate)
    return mixture_of_heads_backward_eager(grad_out, head_out, gate_logits, gate)


def _backward_fake(grad_out, head_out, gate_logits, gate, impl):
    return empty_output_like(head_out, head_out.dtype), gate_logits.new_empty(gate_logits.shape)


mixture_of_heads_op, mixture_of_heads_backward_op = differentiable_op(
    "mixture_of_heads",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=lambda inputs, output: inputs,  # (head_out, gate_logits, gate, impl)
    saved_tensors=2,
    grad_inputs=(0, 1),
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
)
# Under torch.func.vmap (runs trained as one batched model) the runs' tokens are more rows: one launch for all.
fold_vmap_into_batch(mixture_of_heads_op)


@checked_per_signature
def _checked_impl(head_out: object, gate_logits: object, gate: object, backend: object) -> str:
    """The argument checks and the backend of a call: ``"triton"``, ``"eager"`` or ``"reference"`` (an empty
    batch or sequence too: nothing to launch)."""
    check_mixture_of_heads_args(head_out, gate_logits, gate)
    impl = resolve_backend(backend, head_out.device, kernel_inputs={"head_out": head_out, "gate_logits": gate_logits})
    return "reference" if head_out.numel() == 0 else impl


def mixture_of_heads(
    head_out: torch.Tensor, gate_logits: torch.Tensor, *, gate: str = "softmax", backend: str = "auto"
) -> torch.Tensor:
    """Per-head Mixture-of-Attention gating and head merge (GPT2-DTMA): ``concat_h(G_h * head_h)``.

    ``out[b, l, h * Dh + d] = G[b, l, h] * head_out[b, l, h, d]`` with ``G = softmax_h(gate_logits)``
    (``"softmax"``, the paper), ``sigmoid(gate_logits)`` (``"sigmoid"``) or ``gate_logits`` itself
    (``"linear"``, the official code). Feed the result to the attention's output projection.

    Args:
        head_out: per-head attention outputs ``[B, L, H, Dh]``, fp32/fp16/bf16 (fp64 on the eager and
            reference backends), any strides: pass ``sdpa_out.transpose(1, 2)`` as it is, the kernel
            reads strides and nothing is copied.
        gate_logits: ``[B, L, H]``, float, same device; may have another float dtype than ``head_out``
            (e.g. fp32 logits with bf16 heads): gates are computed in fp32 from the logits as given.
        gate: ``"softmax"``, ``"sigmoid"`` or ``"linear"``.
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager), ``"triton"``,
            ``"eager"`` (reference forward, closed-form backward, as one custom op) or ``"reference"``
            (plain PyTorch ops differentiated by autograd).

    Returns:
        ``[B, L, H * Dh]`` contiguous (except on the reference backend) in ``head_out.dtype``, computed
        in fp32; differentiable w.r.t. both inputs. The ``head_out`` gradient has ``head_out``'s dtype and
        memory order, the ``gate_logits`` gradient ``gate_logits``' dtype.
    """
    impl = _checked_impl(head_out, gate_logits, gate, backend)
    if impl == "reference":
        return reference.mixture_of_heads_reference(head_out, gate_logits, gate)
    return mixture_of_heads_op(head_out, gate_logits, gate, impl)


def mixture_of_heads_reference(
    head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str = "softmax"
) -> torch.Tensor:
    """The readable fp32 reference of :func:`mixture_of_heads` (:func:`.reference.mixture_of_heads_reference`,
    the op's spec) behind the same argument checks: plain PyTorch ops, differentiated by autograd.

    Returns:
        ``[B, L, H * Dh]`` in ``head_out.dtype``, computed in fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError/TypeError naming the argument, as :func:`mixture_of_heads`.
    """
    check_mixture_of_heads_args(head_out, gate_logits, gate)
    return reference.mixture_of_heads_reference(head_out, gate_logits, gate)
