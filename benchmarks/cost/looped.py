"""Cost models of the looped block: the fused injection + LayerNorm op and whole loops (see :mod:`benchmarks.cost`).

Shapes: iterate ``Y`` and prompt ``P`` ``[B, L, D]``; one loop body of ``n_layers`` GPT-2 blocks (``D``
wide, 4x MLP, causal attention) plus the final LayerNorm, as :class:`icrl_kernels.LoopedBlock` runs it.
"""

from __future__ import annotations

import torch

from . import OpCost, itemsize


def inject_layer_norm_fwd_bwd_cost(B: int, L: int, D: int, *, dtype: torch.dtype | str) -> OpCost:
    """Forward + backward of ``hidden, normed = inject_layer_norm(y, prompt, pos, weight, bias)`` w.r.t.
    all five inputs, from upstream gradients on both outputs.

    Bytes (``s`` = itemsize; ``y``, ``prompt``, ``hidden``, ``normed`` are ``[B, L, D]``, ``pos [L, D]``,
    ``weight``, ``bias [D]``)::

        forward : read y, prompt (2 B L D s), pos (L D s), weight, bias (2 D s); write hidden, normed (2 B L D s)
        backward: read hidden, d_hidden, d_normed (3 B L D s), weight (D s);
                  write d_x (B L D s: the one gradient of y and prompt), d_pos (L D s), d_weight, d_bias (2 D s)
        total   = 8 B L D s + 2 L D s + 5 D s

    FLOPs per element of ``[B, L, D]``: forward 9 (two adds, the mean, centring, squaring and
    summing the variance, the scale by ``rstd``, the affine map); backward 19 (the row statistics
    recomputed from ``hidden`` (4), ``xhat``, ``dxhat = dnormed * w``, the two row sums, the two
    parameter reductions, the input gradient, adding ``d_hidden`` and reducing ``d_pos`` over ``B``):
    ``28 B L D``. Per-row work (``rsqrt``) is not counted; the op is memory-bound by two orders of
    magnitude.

    Example: ``B=2, L=3, D=4`` fp32: ``768 + 96 + 80 = 944`` bytes and ``28*24 = 672`` FLOPs.
    """
    s = itemsize(dtype)
    rows = B * L
    return OpCost(bytes=8 * rows * D * s + 2 * L * D * s + 5 * D * s, flops=28 * rows * D)


def loop_params(L: int, D: int, *, n_layers: int = 1) -> int:
    """Parameters one loop reads: ``n_layers`` GPT-2 blocks (``12 D^2 + 13 D`` each with biases and
    both LayerNorms), ``ln_f`` (``2 D``) and the ``L`` position rows it adds (``L D``)."""
    return n_layers * (12 * D * D + 13 * D) + 2 * D + L * D


def loop_forward_flops(B: int, L: int, D: int, *, n_layers: int = 1) -> int:
    """Matmul FLOPs of one loop forward: per block ``24 B L D^2`` (qkv ``6``, out_proj ``2``, MLP ``16``
    times ``B L D^2``) plus causal attention ``4 Dh`` per (query, key) pair over ``H`` heads, i.e.
    ``2 B D L (L + 1)`` (independent of ``H``)."""
    return n_layers * (24 * B * L * D * D + 2 * B * D * L * (L + 1))


def inference_cost(B: int, L: int, D: int, *, loops: int, dtype: torch.dtype | str, n_layers: int = 1) -> OpCost:
    """``loops`` iterations without autograd (``LoopedBlock.run_without_grad``).

    Bytes per loop (``W`` = :func:`loop_params` ``* s``, ``X = B L D s``): read the weights, ``Y_t`` and
    ``P``, write ``Y_{t+1}`` (``W + 3 X``); the first loop reads no iterate (``Y_0 = 0``):
    ``loops (W + 3 X) - X``. Activations inside a block are not counted (a minimal bound; they are
    O(X) each). FLOPs: ``loops`` x :func:`loop_forward_flops`.

    Example: ``B=1, L=2, D=4``, 3 loops, fp32: ``W = 260*4 = 1040``, ``X = 32``: ``3*1136 - 32 = 3376``
    bytes; ``3 * (768 + 48) = 2448`` FLOPs.
    """
    s = itemsize(dtype)
    weights = loop_params(L, D, n_layers=n_layers) * s
    act = B * L * D * s
    return OpCost(bytes=loops * (weights + 3 * act) - act, flops=loops * loop_forward_flops(B, L, D, n_layers=n_layers))


def train_step_cost(
    B: int, L: int, D: int, *, loops: int, grad_loops: int, dtype: torch.dtype | str, n_layers: int = 1
) -> OpCost:
    """A truncated-loss training step: ``loops`` forward loops, the last ``grad_loops`` of them also
    backward (w.r.t. the weights and the prompt), as ``LoopedBlock.forward(prompt, loops=b,
    grad_loops=T)`` followed by ``loss.backward()``.

    Bytes: the forward of :func:`inference_cost`, plus per backward loop: read the weights, ``dY_{t+1}``,
    ``Y_t`` and ``P``, write ``dY_t``, and read + write the weight-gradient and ``dP`` accumulators:
    ``T (3 W + 6 X)``.

    FLOPs: the forward ``b F`` (``F`` = :func:`loop_forward_flops`) plus per backward loop twice the
    projections' forward (input and weight gradients, ``48 B L D^2`` per block) and 2.5x the
    attention core (scores recomputed: ``5 B D L (L + 1)`` per block).

    Example: ``B=1, L=2, D=4``, ``b=3, T=1``, fp32: bytes ``3376 + (3*1040 + 6*32) = 6688``; FLOPs
    ``2448 + 1536 + 120 = 4104``.
    """
    s = itemsize(dtype)
    weights = loop_params(L, D, n_layers=n_layers) * s
    act = B * L * D * s
    backward = OpCost(
        bytes=grad_loops * (3 * weights + 6 * act),
        flops=grad_loops * n_layers * (48 * B * L * D * D + 5 * B * D * L * (L + 1)),
    )
    return inference_cost(B, L, D, loops=loops, dtype=dtype, n_layers=n_layers) + backward
