"""Public entry point of the fused input injection + LayerNorm and its custom-op registration.

The op ``icrl::inject_layer_norm`` returns ``(hidden, normed)``, both differentiable. The backward reads
``hidden`` (an output the block keeps anyway as its residual stream) and ``weight`` and recomputes each row's
statistics from ``hidden``, so nothing else of the forward stays alive for it: not ``y``, not ``prompt``, no
side output. It returns one gradient ``d_x`` for both ``y`` and ``prompt`` (autograd hands the one tensor to
both, as for ``y + prompt``).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from .._backend import resolve_backend
from .._library import (
    checked_per_signature,
    compute_dtype,
    differentiable_op,
    first_tensor,
    unfold_first,
    vmapped_first,
)
from . import reference
from .checks import check_inject_layer_norm_args
from .eager import inject_layer_norm_backward_eager, inject_layer_norm_forward_eager


@functools.cache
def _kernels() -> ModuleType:
    """The Triton kernels (they need Triton), imported on the Triton backend's first call."""
    from . import kernels

    return kernels


# -- custom op -------------------------------------------------------------------------------------
def _forward(
    y: Optional[torch.Tensor],  # noqa: UP045 (torch.library parses the annotation)
    prompt: torch.Tensor,
    pos: Optional[torch.Tensor],  # noqa: UP045
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "triton":
        return _kernels().inject_layer_norm_forward_triton(y, prompt, pos, weight, bias, eps)
    return inject_layer_norm_forward_eager(y, prompt, pos, weight, bias, eps)


def _forward_fake(y, prompt, pos, weight, bias, eps, impl):
    return prompt.new_empty(prompt.shape), prompt.new_empty(prompt.shape)


def _backward(
    grad_hidden: Optional[torch.Tensor],  # noqa: UP045 (None: hidden unused, autograd materialised nothing)
    grad_normed: Optional[torch.Tensor],  # noqa: UP045 (None: normed unused)
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pos_dtype: Optional[torch.dtype],  # noqa: UP045 (None: no pos)
    bias_dtype: Optional[torch.dtype],  # noqa: UP045 (None: no bias)
    impl: str,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``(y and prompt, pos, weight, bias)``, ``None`` for those nobody asked for (the
    registered op returns empty tensors there: :func:`icrl_kernels._library.differentiable_op`)."""
    want_y, want_prompt, want_pos, want_weight, want_bias = needs_grad  # False for an absent y, pos or bias
    want_x = want_y or want_prompt
    if impl == "triton":
        return _kernels().inject_layer_norm_backward_triton(
            grad_hidden,
            grad_normed,
            hidden,
            weight,
            eps,
            (want_x, want_pos, want_weight, want_bias),
            pos_dtype,
            bias_dtype,
        )
    zeros = torch.zeros_like(hidden)  # the eager path (CPUs) reads an absent upstream gradient as zeros
    grad_x, grad_weight, grad_bias, grad_pos = inject_layer_norm_backward_eager(
        grad_hidden if grad_hidden is not None else zeros, grad_normed if grad_normed is not None else zeros,
        hidden, weight, eps, want_weight, want_bias, want_pos,
    )  # fmt: skip
    return (
        grad_x.to(hidden.dtype) if want_x else None,
        grad_pos.to(pos_dtype) if want_pos else None,
        grad_weight.to(weight.dtype) if want_weight else None,
        grad_bias.to(bias_dtype) if want_bias else None,
    )


def _backward_fake(grad_hidden, grad_normed, hidden, weight, eps, pos_dtype, bias_dtype, impl, needs_grad):
    want_y, want_prompt, want_pos, want_weight, want_bias = needs_grad
    want_x = want_y or want_prompt
    placeholder = first_tensor((grad_hidden, grad_normed, hidden))  # as the registered backward's
    width = weight.shape
    return (
        torch.empty_like(hidden) if want_x else placeholder.new_empty(0),
        hidden.new_empty(hidden.shape[1:], dtype=pos_dtype) if want_pos else placeholder.new_empty(0),
        torch.empty_like(weight) if want_weight else placeholder.new_empty(0),
        weight.new_empty(width, dtype=bias_dtype) if want_bias else placeholder.new_empty(0),
    )


def _save(inputs: tuple, output: tuple) -> tuple:
    y, prompt, pos, weight, bias, eps, impl = inputs
    # Of pos and bias only the dtypes are needed (their gradients' dtypes).
    pos_dtype = pos.dtype if pos is not None else None
    return output[0], weight, eps, pos_dtype, bias.dtype if bias is not None else None, impl


inject_layer_norm_op, inject_layer_norm_backward_op = differentiable_op(
    "inject_layer_norm",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    save=_save,
    saved_tensors=2,  # hidden, weight; then eps, pos's dtype, bias's dtype, impl
    grad_inputs=((0, 1), 2, 3, 4),  # (y, prompt): one gradient for both; pos, weight, bias
    pass_needs_grad=True,
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
    materialize_grads=False,  # an unused output's gradient is None, not a zero tensor to read
)


def _inject_layer_norm_vmap(info, in_dims: tuple, y, prompt, pos, weight, bias, eps: float, impl: str):
    """vmap over ``K`` slices (runs trained as one batched model) in one launch, the slices as more batch rows.
    Per-slice parameters (``pos [K, L, D]``, ``weight`` / ``bias [K, D]``) cannot ride along as rows: then the
    injected sum (``prompt + y + pos``, in the compute dtype, as the op adds them) goes in as the prompt, the op
    normalises it with unit weight and no bias, and each slice's affine is applied to that output."""
    size = info.batch_size
    dims = dict(zip(("y", "prompt", "pos", "weight", "bias"), in_dims))

    def rows(value, name):
        return None if value is None else vmapped_first(value, dims[name], size).flatten(0, 1)

    if all(dims[name] is None for name in ("pos", "weight", "bias")):
        return unfold_first(inject_layer_norm_op(rows(y, "y"), rows(prompt, "prompt"), pos, weight, bias, eps, impl),
                            size)  # fmt: skip
    dtype = compute_dtype(prompt)
    slices = {name: None if value is None else vmapped_first(value, dims[name], size)
              for name, value in (("y", y), ("prompt", prompt), ("pos", pos))}  # fmt: skip
    position = None if pos is None else slices["pos"][:, None]  # [K, 1, L, D]: every row of its slice
    injected = reference.injected_sum(slices["y"], slices["prompt"], position, dtype).flatten(0, 1)
    unit = torch.ones(weight.shape[-1], dtype=dtype, device=prompt.device)
    hidden, normalised = (t.unflatten(0, (size, -1)) for t in
                          inject_layer_norm_op(None, injected, None, unit, None, eps, impl))  # fmt: skip
    scale = vmapped_first(weight, dims["weight"], size).to(dtype)[:, None, None]
    normed = normalised * scale
    if bias is not None:
        normed = normed + vmapped_first(bias, dims["bias"], size).to(dtype)[:, None, None]
    return (hidden.to(prompt.dtype), normed.to(prompt.dtype)), (0, 0)


inject_layer_norm_op.register_vmap(_inject_layer_norm_vmap)


# -- public function -------------------------------------------------------------------------------
@checked_per_signature
def _checked_call(
    y: object, prompt: object, pos: object, weight: object, bias: object, eps: object, backend: object
) -> tuple[float, str]:
    """The argument checks and the backend of a call: ``(eps, impl)``, ``impl`` ``"reference"`` too for an
    empty batch or sequence (nothing to launch)."""
    eps = check_inject_layer_norm_args(y, prompt, pos, weight, bias, eps)
    named = {"y": y, "prompt": prompt, "pos": pos, "weight": weight, "bias": bias}
    impl = resolve_backend(backend, prompt.device, kernel_inputs=named)
    return eps, "reference" if prompt.numel() == 0 else impl


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
        from both outputs, each in its input's dtype; ``y`` and ``prompt`` receive equal gradients (one
        tensor, as with ``y + prompt``: ``torch.autograd.grad`` may return it for both). The backward
        reads ``hidden``: do not modify it in place (write ``hidden = hidden + attn``, not
        ``hidden += attn``); autograd raises if you do.

    Raises:
        ValueError: a shape that does not match ``prompt`` (the message names the argument), tensors
            on different devices, ``eps <= 0``, an unknown backend. TypeError: a non-float tensor,
            ``y`` and ``prompt`` of different dtypes, fp64 with ``backend="triton"``.
    """
    eps, impl = _checked_call(y, prompt, pos, weight, bias, eps, backend)
    if impl == "reference":
        return reference.inject_layer_norm_reference(y, prompt, pos, weight, bias, eps=eps)
    return inject_layer_norm_op(y, prompt, pos, weight, bias, eps, impl)


def inject_layer_norm_reference(
    y: torch.Tensor | None,
    prompt: torch.Tensor,
    pos: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable fp32 reference of :func:`inject_layer_norm` (:func:`.reference.inject_layer_norm_reference`,
    the op's spec) behind the same argument checks: plain PyTorch ops, differentiated by autograd.

    Returns:
        ``(hidden, normed)``, both ``[B, L, D]`` in ``prompt.dtype``.

    Raises:
        ValueError/TypeError naming the argument, as :func:`inject_layer_norm`.
    """
    eps = check_inject_layer_norm_args(y, prompt, pos, weight, bias, eps)
    return reference.inject_layer_norm_reference(y, prompt, pos, weight, bias, eps=eps)
