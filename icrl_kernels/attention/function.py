"""Public entry point of gated, smeared causal attention and its custom-op registration."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from .._backend import resolve_backend
from .._library import checked_per_signature, differentiable_op, unfold_first, vmapped_first
from . import reference
from .checks import check_gated_attention_args
from .eager import gated_attention_eager


@functools.cache
def _kernels() -> ModuleType:
    """The Triton kernels (they need Triton), imported on the Triton backend's first call."""
    from . import kernels

    return kernels


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: Optional[torch.Tensor],  # noqa: UP045 (torch.library parses the annotation)
    smear_alpha: Optional[torch.Tensor],  # noqa: UP045
    gate: str,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().gated_attention_forward_triton(q, k, v, gate_logits, smear_alpha, gate)


def _forward_fake(q, k, v, gate_logits, smear_alpha, gate, impl):
    batch, heads, length, head_dim = q.shape
    out = q.new_empty((batch, length, heads * head_dim))
    return out, q.new_empty((batch, heads, length), dtype=torch.float32)


def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: Optional[torch.Tensor],  # noqa: UP045
    smear_alpha: Optional[torch.Tensor],  # noqa: UP045
    out: torch.Tensor,
    lse: torch.Tensor,
    gate: str,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # None for an absent input's gradient (the registered op returns an empty tensor there).
    return _kernels().gated_attention_backward_triton(grad_out, q, k, v, gate_logits, smear_alpha, out, lse, gate)


def _backward_fake(grad_out, q, k, v, gate_logits, smear_alpha, out, lse, gate, impl):
    grads = [q.new_empty(q.shape) for _ in range(3)]
    # The registered backward's placeholders for absent inputs: empty, like its first tensor argument.
    grad_gate = gate_logits.new_empty(gate_logits.shape) if gate_logits is not None else grad_out.new_empty(0)
    grad_alpha = smear_alpha.new_empty(smear_alpha.shape) if smear_alpha is not None else grad_out.new_empty(0)
    return (*grads, grad_gate, grad_alpha)


gated_attention_op, gated_attention_backward_op = differentiable_op(
    "gated_attention",
    forward=_forward,
    forward_fake=_forward_fake,
    backward=_backward,
    backward_fake=_backward_fake,
    # (q, k, v, gate_logits, smear_alpha, out, lse, gate, impl)
    save=lambda inputs, output: (*inputs[:5], output[0], output[1], *inputs[5:]),
    saved_tensors=7,
    grad_inputs=(0, 1, 2, 3, 4),
    differentiable_outputs=1,
    traceable=("triton",),  # the launchers: torch.compile traces into the kernels (triton_op)
    materialize_grads=False,  # no zero gradient for lse, saved for the backward only
)


def _gated_attention_vmap(info, in_dims: tuple, q, k, v, gate_logits, smear_alpha, gate: str, impl: str):
    """vmap over ``K`` slices (runs trained as one batched model) in one launch. Without per-slice smearing
    logits the slices are more batch rows (views of a fused QKV projection stay views). With each slice's own
    ``smear_alpha [K, H]`` they are more heads: ``q, k, v`` as ``[B, K * H, L, Dh]`` (copies) and the logits as
    ``[K * H]``; the gates are then computed per slice first (a softmax over one slice's heads) and passed as
    ``"linear"`` gates of the ``K * H`` heads."""
    size = info.batch_size
    dims = dict(zip(("q", "k", "v", "gate_logits", "smear_alpha"), in_dims))
    if smear_alpha is None or dims["smear_alpha"] is None:
        rows = [None if t is None else vmapped_first(t, dims[name], size).flatten(0, 1)
                for name, t in (("q", q), ("k", k), ("v", v), ("gate_logits", gate_logits))]  # fmt: skip
        return unfold_first(gated_attention_op(*rows, smear_alpha, gate, impl), size)
    heads = smear_alpha.shape[-1]
    q, k, v = (vmapped_first(t, dims[name], size).movedim(0, 1).flatten(1, 2)
               for name, t in (("q", q), ("k", k), ("v", v)))  # fmt: skip
    if gate_logits is not None:
        gates = reference.gate_weights_reference(vmapped_first(gate_logits, dims["gate_logits"], size), gate)
        gate_logits, gate = gates.movedim(0, 2).flatten(2, 3), "linear"  # [B, L, K * H]
    alpha = vmapped_first(smear_alpha, dims["smear_alpha"], size).flatten()
    out, lse = gated_attention_op(q, k, v, gate_logits, alpha, gate, impl)
    # out [B, L, K * H * Dh]: slice s's heads are the s-th run of H * Dh features; lse [B, K * H, L].
    return (out.unflatten(2, (size, -1)).movedim(2, 0), lse.unflatten(1, (size, heads)).movedim(1, 0)), (0, 0)


gated_attention_op.register_vmap(_gated_attention_vmap)


@checked_per_signature
def _checked_impl(
    q: object, k: object, v: object, gate_logits: object, gate: object, smear_alpha: object, backend: object
) -> str:
    """The argument checks and the backend of a call: ``"triton"``, ``"eager"`` or ``"reference"`` (an empty
    batch, head or sequence too: nothing to launch)."""
    check_gated_attention_args(q, k, v, gate_logits, gate, smear_alpha)
    named = {"q": q, "k": k, "v": v, "gate_logits": gate_logits, "smear_alpha": smear_alpha}
    impl = resolve_backend(backend, q.device, kernel_inputs=named)
    if impl == "reference" or q.numel() == 0:
        return "reference"
    if impl == "triton" and q.shape[-1] > 128:  # one head row is one register tile; wider would need a loop
        raise ValueError(f"q must have a head dim (q.shape[-1]) <= 128 for backend='triton', got {q.shape[-1]}")
    return impl


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None = None,
    *,
    gate: str = "softmax",
    smear_alpha: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal softmax attention with an optional per-head gate and optional smeared keys, heads merged.

    ``out[b, l, h * Dh + d] = G[b, l, h] * O[b, h, l, d]`` with ``O_h = softmax(q_h k'_h^T Dh**-0.5 + causal
    mask) v_h``, where

    * ``k' = smeared_keys(k, smear_alpha)``, i.e. ``k'_j = s_h k_j + (1 - s_h) k_{j-1}`` with
      ``s_h = sigmoid(smear_alpha[h])`` and ``k_{-1} = 0`` (``k' = k`` when ``smear_alpha`` is None);
    * ``G = gate(gate_logits)`` as in :func:`icrl_kernels.mixture_of_heads`: softmax over heads,
      sigmoid or the logits themselves (``"linear"``); ``G = 1`` when ``gate_logits`` is None.

    On the Triton backend one flash-attention kernel does all of it: the keys are smeared as its tiles
    are loaded and each head's output is gated before its only store, so neither the smeared keys nor the
    ungated heads reach memory (the eager path writes both; see :mod:`benchmarks.cost.attention`).
    Apply any positional rotation (RoPE) to ``q`` and ``k`` before the call.

    Args:
        q, k, v: ``[B, H, L, Dh]``, one float dtype (fp32/fp16/bf16; fp64 on the eager and reference
            backends), one device; any strides (e.g. views of a fused QKV projection).
        gate_logits: ``[B, L, H]`` float logits, any float dtype, or None (no gate).
        gate: ``"softmax"``, ``"sigmoid"`` or ``"linear"``; ignored without ``gate_logits``.
        smear_alpha: ``[H]`` float smearing logits, or None (no smearing).
        backend: ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else eager), ``"triton"``
            (the fused kernels), ``"eager"`` (``smeared_keys`` -> SDPA ``is_causal=True`` ->
            ``mixture_of_heads``, each on its eager backend) or ``"reference"`` (dense fp32 math).

    Returns:
        ``[B, L, H * Dh]`` in ``q.dtype`` (contiguous except on the reference backend); softmax statistics
        and accumulation in fp32. Differentiable w.r.t. ``q``, ``k``, ``v``, ``gate_logits`` and
        ``smear_alpha``; each gradient has its input's dtype.

    Raises:
        TypeError/ValueError naming the argument: non-tensors, wrong ranks or shapes, non-float dtypes,
        ``q``/``k``/``v`` dtypes that differ, mixed devices, an unknown ``gate`` or ``backend``, and with
        ``backend="triton"`` fp64 inputs or a head dim above 128.
    """
    impl = _checked_impl(q, k, v, gate_logits, gate, smear_alpha, backend)
    if impl == "reference":
        return reference.gated_attention_reference(q, k, v, gate_logits, gate=gate, smear_alpha=smear_alpha)
    if impl == "eager":
        return gated_attention_eager(q, k, v, gate_logits, gate, smear_alpha, backend="eager")
    out, _ = gated_attention_op(q, k, v, gate_logits, smear_alpha, gate, impl)
    return out


def gated_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None = None,
    *,
    gate: str = "softmax",
    smear_alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """The readable fp32 reference of :func:`gated_attention` (:func:`.reference.gated_attention_reference`,
    the op's spec: dense causal attention between the smeared-keys and gating references) behind the same
    argument checks: plain PyTorch ops, differentiated by autograd.

    Returns:
        ``[B, L, H * Dh]`` in ``q.dtype``, computed in fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError/TypeError naming the argument, as :func:`gated_attention`.
    """
    check_gated_attention_args(q, k, v, gate_logits, gate, smear_alpha)
    return reference.gated_attention_reference(q, k, v, gate_logits, gate=gate, smear_alpha=smear_alpha)
