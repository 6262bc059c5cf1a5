"""Eager fp32 reference of per-head Mixture-of-Attention gating (GPT2-DTMA): the op's specification.

    G[b, l, :] = gate(logits[b, l, :])                  gate: softmax over heads | sigmoid | identity
    out[b, l, h * Dh + d] = G[b, l, h] * head_out[b, l, h, d]

Each head's output is scaled by its gate weight and the heads are concatenated, ready for the output
projection ``W_O``. ``"softmax"`` is the paper's gate, ``"linear"`` the official code's (the raw
logits of a linear map with bias, no normalisation), ``"sigmoid"`` an independent weight per head.

Gradients (``s[b, l, h] = <dout[b, l, h, :], head_out[b, l, h, :]>``, the gradient w.r.t. ``G``):

    d head_out[b, l, h, d] = G[b, l, h] * dout[b, l, h * Dh + d]
    d logits  = s                              (linear)
              = G (1 - G) s                    (sigmoid)
              = G (s - sum_j G_j s_j)          (softmax)

Dtypes: the math runs in fp32 (fp64 stays fp64) whatever the inputs; the output has ``head_out``'s
dtype. ``gate_logits`` may have another float dtype than ``head_out`` (fp32 logits with bf16 heads
under autocast): the logits are normalised in the compute dtype, so a wider logit dtype is never
rounded down to the heads' dtype, and its gradient comes back in ``gate_logits``' own dtype.
"""

from __future__ import annotations

import torch

from .._validation import FLOAT_DTYPES, check_choice, check_same_device, check_shape, check_tensor

#: Gate normalisations, in the order the Triton kernels number them.
GATES: tuple[str, ...] = ("softmax", "sigmoid", "linear")


def compute_dtype_of(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the reference and the eager path compute in: fp64 if any input is fp64, fp32 otherwise."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def gate_weights_reference(gate_logits: torch.Tensor, gate: str = "softmax") -> torch.Tensor:
    """Normalised gate weights ``G`` from ``gate_logits [..., H]``, over the last (head) dimension.

    Args:
        gate_logits: ``[..., H]``, any float dtype.
        gate: ``"softmax"`` (weights sum to 1 over heads), ``"sigmoid"`` (each in (0, 1)) or
            ``"linear"`` (the logits unchanged).

    Returns:
        ``G`` in the compute dtype (fp32, or fp64 for fp64 logits), same shape; differentiable.
    """
    logits = gate_logits.to(compute_dtype_of(gate_logits))
    if gate == "softmax":
        return torch.softmax(logits, dim=-1)
    if gate == "sigmoid":
        return torch.sigmoid(logits)
    if gate == "linear":
        return logits
    raise ValueError(f"gate must be one of {GATES}, got {gate!r}")


def check_mixture_of_heads_args(head_out: object, gate_logits: object, gate: object) -> None:
    """The argument checks of :func:`mixture_of_heads` and its reference (shapes, dtypes, devices only).

    Raises:
        TypeError: a non-tensor or non-float input. ValueError: a wrong rank, ``gate_logits`` not
            ``head_out.shape[:3]``, tensors on different devices, an unknown ``gate``.
    """
    check_tensor(head_out, "head_out", ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(gate_logits, "gate_logits", ndim=3, dtypes=FLOAT_DTYPES)
    check_shape(gate_logits, "gate_logits", tuple(head_out.shape[:3]), "head_out.shape[:3], [B, L, H]")
    check_same_device(head_out=head_out, gate_logits=gate_logits)
    check_choice(gate, "gate", GATES)


def mixture_of_heads_reference(
    head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str = "softmax"
) -> torch.Tensor:
    """Gate each head's output and merge the heads: ``out[b, l, h*Dh + d] = G[b, l, h] head_out[b, l, h, d]``.

    Args:
        head_out: per-head attention outputs ``[B, L, H, Dh]`` (any strides), any float dtype.
        gate_logits: ``[B, L, H]``, any float dtype.
        gate: ``"softmax"``, ``"sigmoid"`` or ``"linear"`` (see :func:`gate_weights_reference`).

    Returns:
        ``[B, L, H * Dh]`` in ``head_out.dtype``, computed in fp32 (fp64 for fp64 inputs);
        differentiable w.r.t. both inputs by autograd.

    Raises:
        ValueError/TypeError naming the argument, as :func:`mixture_of_heads`
        (:func:`check_mixture_of_heads_args`).
    """
    check_mixture_of_heads_args(head_out, gate_logits, gate)
    dtype = compute_dtype_of(head_out, gate_logits)
    weights = gate_weights_reference(gate_logits, gate).to(dtype)
    batch, length, heads, head_dim = head_out.shape
    merged = head_out.to(dtype) * weights.unsqueeze(-1)
    return merged.reshape(batch, length, heads * head_dim).to(head_out.dtype)
