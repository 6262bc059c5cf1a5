"""Public entry point of Mixture-of-Attention head gating and its custom-op registration."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._library import differentiable_op, empty_output
from .._validation import KERNEL_FLOAT_DTYPES
from .reference import (
    check_mixture_of_heads_args,
    compute_dtype_of,
    gate_weights_reference,
    mixture_of_heads_reference,
)


def empty_like_layout(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output of ``like``'s shape whose memory order follows ``like``'s strides (dense, no gaps).

    The gradient of ``head_out`` is written in ``head_out``'s own memory order, so that it matches
    whatever layout the producer (SDPA) chose: PyTorch's flash kernels return ``[B, H, L, Dh]`` outputs
    that are ``[B, L, H, Dh]``-contiguous (``head_out`` is then contiguous), while SDPA on contiguous
    inputs or its math path returns ``[B, H, L, Dh]``-contiguous ones (``head_out`` is a transposed view).
    """
    order = sorted(range(like.dim()), key=lambda dim: -like.stride(dim))  # stable: ties keep dim order
    buffer = empty_output([like.shape[dim] for dim in order], dtype=dtype, device=like.device)
    inverse = [order.index(dim) for dim in range(like.dim())]
    return buffer.permute(inverse)


def gate_weights_eager(gate_logits: torch.Tensor, gate: str, dtype: torch.dtype) -> torch.Tensor:
    """:func:`gate_weights_reference` in ``dtype``; the softmax written out, which on CPU is several times
    faster than ``torch.softmax`` over a dimension as short as the number of heads."""
    if gate != "softmax":
        return gate_weights_reference(gate_logits, gate).to(dtype)
    logits = gate_logits.to(dtype)
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    return weights.div_(weights.sum(dim=-1, keepdim=True))


def gate_grad_eager(weights: torch.Tensor, grad_weights: torch.Tensor, gate: str) -> torch.Tensor:
    """Gradient w.r.t. the logits from ``G`` and ``dL/dG`` (both ``[..., H]``, compute dtype)."""
    if gate == "softmax":
        return weights * (grad_weights - (weights * grad_weights).sum(dim=-1, keepdim=True))
    if gate == "sigmoid":
        return weights * (1 - weights) * grad_weights
    return grad_weights


def _scale_heads_into(result: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> None:
    """``result[...] = values * weights[..., None]`` computed in ``dtype``, in one pass when no cast is needed."""
    if values.dtype == dtype == result.dtype:
        torch.mul(values, weights.unsqueeze(-1), out=result)
    else:
        result.copy_(values.to(dtype) * weights.unsqueeze(-1))


def mixture_of_heads_forward_eager(head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str) -> torch.Tensor:
    """The reference's math written straight into a contiguous ``[B, L, H * Dh]`` output (no merge copy)."""
    batch, length, heads, head_dim = head_out.shape
    dtype = compute_dtype_of(head_out, gate_logits)
    weights = gate_weights_eager(gate_logits, gate, dtype)
    out = empty_output((batch, length, heads * head_dim), dtype=head_out.dtype, device=head_out.device)
    _scale_heads_into(out.view(batch, length, heads, head_dim), head_out, weights, dtype)
    return out


def mixture_of_heads_backward_eager(
    grad_out: torch.Tensor, head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients in PyTorch (see :mod:`.reference`): ``d head_out`` in ``head_out``'s layout
    and dtype, ``d gate_logits`` contiguous in ``gate_logits``' dtype."""
    dtype = compute_dtype_of(head_out, gate_logits)
    weights = gate_weights_eager(gate_logits, gate, dtype)
    grad = grad_out.unflatten(-1, head_out.shape[-2:])  # [B, L, H, Dh]
    grad_head = empty_like_layout(head_out, head_out.dtype)
    _scale_heads_into(grad_head, grad, weights, dtype)
    grad_weights = (grad.to(dtype) * head_out.to(dtype)).sum(dim=-1)  # s_h = <dout_h, head_out_h>
    grad_logits = gate_grad_eager(weights, grad_weights, gate)
    return grad_head, grad_logits.to(gate_logits.dtype).contiguous()


def _forward(head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str, impl: str) -> torch.Tensor:
    if impl == "triton":
        from .kernels import mixture_of_heads_forward_triton

        return mixture_of_heads_forward_triton(head_out, gate_logits, gate)
    return mixture_of_heads_forward_eager(head_out, gate_logits, gate)


def _forward_fake(head_out, gate_logits, gate, impl):
    batch, length, heads, head_dim = head_out.shape
    return head_out.new_empty((batch, length, heads * head_dim))


def _backward(
    grad_out: torch.Tensor, head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "triton":
        from .kernels import mixture_of_heads_backward_triton

        return mixture_of_heads_backward_triton(grad_out, head_out, gate_logits, gate)
    return mixture_of_heads_backward_eager(grad_out, head_out, gate_logits, gate)


def _backward_fake(grad_out, head_out, gate_logits, gate, impl):
    return empty_like_layout(head_out, head_out.dtype), gate_logits.new_empty(gate_logits.shape)


mixture_of_heads_op, mixture_of_heads_backward_op = differentiable_op(
    "mixture_of_heads",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=lambda inputs, output: inputs,  # (head_out, gate_logits, gate, impl)
    grad_inputs=(0, 1),
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
)


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
    check_mixture_of_heads_args(head_out, gate_logits, gate)
    impl = resolve_backend(backend, head_out.device)
    if impl == "reference" or head_out.numel() == 0:  # nothing to launch for an empty batch or sequence
        return mixture_of_heads_reference(head_out, gate_logits, gate)
    if impl == "triton":
        for name, tensor in (("head_out", head_out), ("gate_logits", gate_logits)):
            if tensor.dtype not in KERNEL_FLOAT_DTYPES:
                raise TypeError(f"{name} must be float16, bfloat16 or float32 for backend='triton', got {tensor.dtype}")
    return mixture_of_heads_op(head_out, gate_logits, gate, impl)
