"""Eager PyTorch path of Mixture-of-Attention gating: the reference's math written into the op's output
layouts, with closed-form gradients (what CPUs run by default)."""

from __future__ import annotations

import torch

from .._library import compute_dtype, empty_output, empty_output_like


def gate_weights(gate_logits: torch.Tensor, gate: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gate weights ``G [..., H]`` (as :func:`.reference.gate_weights_reference`) computed in ``dtype``
    (default: the logits' compute dtype, fp32 or fp64); differentiable by autograd. The softmax is written
    out, which on a CPU is several times faster than ``torch.softmax`` over a dimension as short as the
    number of heads."""
    logits = gate_logits.to(compute_dtype(gate_logits) if dtype is None else dtype)
    if gate == "softmax":
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
        return weights / weights.sum(dim=-1, keepdim=True)
    if gate == "sigmoid":
        return torch.sigmoid(logits)
    return logits  # "linear"


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
    dtype = compute_dtype(head_out, gate_logits)
    weights = gate_weights(gate_logits, gate, dtype)
    out = empty_output((batch, length, heads * head_dim), dtype=head_out.dtype, device=head_out.device)
    _scale_heads_into(out.view(batch, length, heads, head_dim), head_out, weights, dtype)
    return out


def mixture_of_heads_backward_eager(
    grad_out: torch.Tensor, head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients in PyTorch (see :mod:`.reference`): ``d head_out`` in ``head_out``'s layout
    and dtype, ``d gate_logits`` contiguous in ``gate_logits``' dtype."""
    dtype = compute_dtype(head_out, gate_logits)
    weights = gate_weights(gate_logits, gate, dtype)
    grad = grad_out.unflatten(-1, head_out.shape[-2:])  # [B, L, H, Dh]
    grad_head = empty_output_like(head_out, head_out.dtype)
    _scale_heads_into(grad_head, grad, weights, dtype)
    grad_weights = (grad.to(dtype) * head_out.to(dtype)).sum(dim=-1)  # s_h = <dout_h, head_out_h>
    grad_logits = gate_grad_eager(weights, grad_weights, gate)
    return grad_head, grad_logits.to(gate_logits.dtype).contiguous()
