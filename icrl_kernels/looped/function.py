"""Public entry point of the fused input injection + LayerNorm and its custom-op registration.

The op ``icrl::inject_layer_norm`` returns ``(hidden, normed, mean, rstd)``; only the first two are
differentiable (``mean`` and ``rstd`` are fp32 per-row statistics saved for the backward). The
backward reads ``hidden`` (an output the block keeps anyway as its residual stream), ``mean`` and
``rstd``, so nothing else of the forward stays alive for it: not ``y``, not ``prompt``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._backend import resolve_backend
from .._library import differentiable_op
from .._validation import (
    KERNEL_FLOAT_DTYPES,
    check_positive_float,
)
from .reference import check_inject_layer_norm_args, compute_dtype_of, inject_layer_norm_reference, injected_sum


# -- eager path: ATen's fused LayerNorm kernels on the fp32 sum -----------------------------------
# The reference spelled out op by op is ~6x slower on a CPU (64 x 201 x 256, one thread: 166 ms vs 26 ms
# forward + backward), and CPUs run this path by default; ``native_layer_norm`` computes the same
# statistics and returns them for the backward.
def inject_layer_norm_forward_eager(
    y: torch.Tensor | None,
    prompt: torch.Tensor,
    pos: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden, normed, mean, rstd)``: contiguous outputs in ``prompt.dtype``, statistics ``[B, L]`` in the
    compute dtype (fp32, or fp64 for fp64 activations)."""
    dtype = compute_dtype_of(prompt)
    hidden = injected_sum(y, prompt, pos, dtype).contiguous()
    normed, mean, rstd = torch.native_layer_norm(
        hidden, hidden.shape[-1:], weight.to(dtype), bias.to(dtype) if bias is not None else None, eps
    )
    hidden_out = hidden.to(prompt.dtype)
    if hidden_out is prompt:  # y = pos = None with contiguous fp32 (fp64) prompt: outputs may not alias inputs
        hidden_out = prompt.clone()
    return hidden_out, normed.to(prompt.dtype), mean.squeeze(-1), rstd.squeeze(-1)


def inject_layer_norm_backward_eager(
    grad_hidden: torch.Tensor,
    grad_normed: torch.Tensor,
    hidden: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    want_weight: bool = True,
    want_bias: bool = True,
    want_pos: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients in the compute dtype (``mean.dtype``): ``(d_x [B, L, D], d_weight [D], d_bias [D], d_pos [L, D])``,
    ``None`` for the ones not wanted; ``d_y = d_prompt = d_x``.

    With ``xhat = (hidden - mean) * rstd`` and ``g = grad_normed * weight`` (per row of ``D`` features):

        d_x      = grad_hidden + rstd * (g - mean_D(g) - xhat * mean_D(g * xhat))
        d_weight = sum_rows grad_normed * xhat,    d_bias = sum_rows grad_normed,    d_pos = sum_batch d_x

    (ATen's ``native_layer_norm_backward`` evaluates the LayerNorm part.)
    """
    dtype = mean.dtype
    weight = weight.to(dtype)
    # ATen reads only the bias's presence (to size d_bias), never its values: weight stands in for it.
    grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad_normed.to(dtype), hidden.to(dtype), hidden.shape[-1:], mean[..., None], rstd[..., None],
        weight, weight, [True, want_weight, want_bias],
    )  # fmt: skip
    grad_x = grad_x + grad_hidden.to(dtype)
    grad_pos = grad_x.sum(dim=0) if want_pos else None
    return grad_x, grad_weight, grad_bias, grad_pos


# -- custom op -------------------------------------------------------------------------------------
def _forward(
    y: Optional[torch.Tensor],  # noqa: UP045 (torch.library parses the annotation)
    prompt: torch.Tensor,
    pos: Optional[torch.Tensor],  # noqa: UP045
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if impl == "triton":
        from .kernels import inject_layer_norm_forward_triton

        return inject_layer_norm_forward_triton(y, prompt, pos, weight, bias, eps)
    return inject_layer_norm_forward_eager(y, prompt, pos, weight, bias, eps)


def _forward_fake(y, prompt, pos, weight, bias, eps, impl):
    stats_dtype = torch.float64 if prompt.dtype == torch.float64 else torch.float32
    stats = prompt.new_empty(prompt.shape[:2], dtype=stats_dtype)
    return prompt.new_empty(prompt.shape), prompt.new_empty(prompt.shape), stats, torch.empty_like(stats)


def _backward(
    grad_hidden: torch.Tensor,
    grad_normed: torch.Tensor,
    hidden: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045 (only its dtype is used)
    pos: Optional[torch.Tensor],  # noqa: UP045 (only its dtype is used)
    impl: str,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    want_y, want_prompt, want_pos, want_weight, want_bias = needs_grad
    want_pos = want_pos and pos is not None
    want_bias = want_bias and bias is not None
    if impl == "triton":
        from .kernels import inject_layer_norm_backward_triton

        grad_y, grad_prompt, grad_pos, grad_weight, grad_bias = inject_layer_norm_backward_triton(
            grad_hidden, grad_normed, hidden, mean, rstd, weight,
            want_y=want_y, want_prompt=want_prompt, want_pos=want_pos, want_weight=want_weight, want_bias=want_bias,
        )  # fmt: skip
    else:
        grad_x, grad_weight, grad_bias, grad_pos = inject_layer_norm_backward_eager(
            grad_hidden, grad_normed, hidden, mean, rstd, weight, want_weight, want_bias, want_pos
        )
        grad_x = grad_x.to(hidden.dtype)
        # Outputs of a custom op may not alias each other: y and prompt get equal, separate tensors.
        grad_y = grad_x if want_y else None
        grad_prompt = (grad_x.clone() if want_y else grad_x) if want_prompt else None
    # Gradients nobody asked for are distinct empty tensors (outputs of a custom op may not alias).
    return (
        grad_y if grad_y is not None else hidden.new_empty(0),
        grad_prompt if grad_prompt is not None else hidden.new_empty(0),
        grad_pos.to(pos.dtype) if grad_pos is not None else hidden.new_empty(0),
        grad_weight.to(weight.dtype) if grad_weight is not None else hidden.new_empty(0),
        grad_bias.to(bias.dtype) if grad_bias is not None else hidden.new_empty(0),
    )


def _backward_fake(grad_hidden, grad_normed, hidden, mean, rstd, weight, bias, pos, impl, needs_grad):
    want_y, want_prompt, want_pos, want_weight, want_bias = needs_grad
    return (
        torch.empty_like(hidden) if want_y else hidden.new_empty(0),
        torch.empty_like(hidden) if want_prompt else hidden.new_empty(0),
        torch.empty_like(pos) if want_pos and pos is not None else hidden.new_empty(0),
        torch.empty_like(weight) if want_weight else hidden.new_empty(0),
        torch.empty_like(bias) if want_bias and bias is not None else hidden.new_empty(0),
    )


def _save(inputs: tuple, output: tuple) -> tuple:
    y, prompt, pos, weight, bias, eps, impl = inputs
    hidden, normed, mean, rstd = output
    # pos and bias are saved for their dtype (and None-ness) only: parameters, alive anyway.
    return hidden, mean, rstd, weight, bias, pos, impl


inject_layer_norm_op, inject_layer_norm_backward_op = differentiable_op(
    "inject_layer_norm",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    grad_inputs=(0, 1, 2, 3, 4),  # y, prompt, pos, weight, bias
    differentiable_outputs=2,
    pass_needs_grad=True,
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
)


# -- public function -------------------------------------------------------------------------------
def inject_layer_norm(
    y: torch.Tensor | None,
    prompt: torch.Tensor,
    pos: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    eps: float = 1e-5,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Looped-transformer input injection fused with the block's first LayerNorm, in one pass.

    ``hidden = y + prompt + pos`` and ``normed = LayerNorm(hidden) * weight + bias`` (biased variance,
    as ``torch.nn.LayerNorm``): the start of every loop ``Y_{t+1} = M(Y_t + P)`` of a looped
    transformer whose block adds the position embedding and normalises its input.

    Args:
        y: current iterate ``[B, L, D]``, or ``None`` for ``Y_0 = 0`` (then ``hidden = prompt + pos``).
        prompt: embedded prompt ``P`` ``[B, L, D]``, the same dtype as ``y``.
        pos: position embedding ``[L, D]``, broadcast over the batch, or ``None``.
        weight: LayerNorm scale ``[D]``.
        bias: LayerNorm shift ``[D]``, or ``None``.
        eps: > 0, added to the variance.
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager), ``"triton"``,
            ``"eager"`` (ATen's fused LayerNorm forward and backward on the fp32 sum, as one custom op) or
            ``"reference"`` (plain PyTorch ops differentiated by autograd).

    Dtypes: ``y`` and ``prompt`` are fp32/fp16/bf16 (fp64 too on the eager and reference backends) and
    share a dtype; ``pos``, ``weight`` and ``bias`` may each have any float dtype (fp32 parameters with
    bf16 activations under autocast are fine: a custom op sees its inputs uncast). The sum and the
    statistics are computed in fp32; ``normed`` normalises the unrounded fp32 sum. Inputs may have any
    strides.

    Returns:
        ``(hidden, normed)``, both ``[B, L, D]`` contiguous in the activation dtype (``prompt.dtype``).
        Gradients flow to ``y``, ``prompt``, ``pos`` (summed over the batch), ``weight`` and ``bias``
        from both outputs, each in its input's dtype; ``y`` and ``prompt`` receive equal gradients
        (separate tensors). The backward reads ``hidden``: do not modify it in place (write
        ``hidden = hidden + attn``, not ``hidden += attn``); autograd raises if you do.

    Raises:
        ValueError: a shape that does not match ``prompt`` (the message names the argument), tensors
            on different devices, ``eps <= 0``, an unknown backend. TypeError: a non-float tensor,
            ``y`` and ``prompt`` of different dtypes, fp64 with ``backend="triton"``.
    """
    check_inject_layer_norm_args(y, prompt, pos, weight, bias)
    eps = check_positive_float(eps, "eps")
    impl = resolve_backend(backend, prompt.device)
    if impl == "reference" or prompt.numel() == 0:  # nothing to launch for an empty batch or sequence
        return inject_layer_norm_reference(y, prompt, pos, weight, bias, eps=eps)
    if impl == "triton":
        for name, tensor in (("y", y), ("prompt", prompt), ("pos", pos), ("weight", weight), ("bias", bias)):
            if tensor is not None and tensor.dtype not in KERNEL_FLOAT_DTYPES:
                raise TypeError(f"{name} must be float16, bfloat16 or float32 for backend='triton', got {tensor.dtype}")
    hidden, normed, _, _ = inject_layer_norm_op(y, prompt, pos, weight, bias, eps, impl)
    return hidden, normed
