"""Smeared keys, forward + backward (docs/ops.md, docs/performance.md#targets).

Every benchmark times ``k' = smeared_keys(k, alpha)`` and the gradient w.r.t. ``k [B, H, L, Dh]``
for one shape and one implementation:

* ``triton``: the fused Triton kernels (one elementwise pass each way, the ``alpha`` partials
  reduced in the backward's pass);
* ``eager``: the custom op on PyTorch ops (reference forward, closed-form backward);
* ``reference``: the reference differentiated by autograd (what a user would write);
* ``compile``: ``torch.compile`` of the reference (Inductor fuses it into a few kernels).

Every backend differentiates w.r.t. both ``k`` and ``alpha`` (as training does): the Triton and eager
custom ops compute the ``alpha`` gradient in the same backward anyway, and asking autograd for it
keeps the reference and ``compile`` from skipping that branch, so all four do the same work. Bytes
and FLOPs: :func:`benchmarks.cost.smeared.fwd_bwd_cost` (read ``k``, write ``k'``; read ``grad_out``
and ``k``, write ``grad_k`` and ``grad_alpha``). Inputs are ``k ~ N(0, 1)`` and ``alpha ~ N(0, 1)``.

Headline case (``-m headline``): ``triton`` at ``B = 64, H = 12, L = 1024, Dh = 64`` bf16 (the roofline
target), and the first smoke shape on a smoke run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch

from icrl_kernels.smeared import smeared_keys, smeared_keys_reference
from icrl_kernels.testing import assert_close_rel

from .conftest import backend_params, bench_device, select_shapes, skip_unless_runnable, split_graph
from .cost.smeared import fwd_bwd_cost


class Shape(NamedTuple):
    B: int
    H: int
    L: int
    Dh: int
    dtype: str


def shape_id(shape: Shape) -> str:
    return f"B{shape.B}-H{shape.H}-L{shape.L}-Dh{shape.Dh}-{shape.dtype}"


# Full set (CUDA, or ICRL_BENCH_FULL=1): the MoA attention row of docs/performance.md#targets (B = 8..64,
# H = 12, Dh = 64, L = 60..4096), the widths of the lecture's small models, and bf16 for training.
FULL_SHAPES = [
    *(Shape(B=8, H=12, L=L, Dh=64, dtype="float32") for L in (60, 256, 1024, 4096)),
    Shape(B=64, H=12, L=1024, Dh=64, dtype="float32"),
    Shape(B=64, H=12, L=1024, Dh=64, dtype="bfloat16"),
    Shape(B=8, H=12, L=4096, Dh=64, dtype="bfloat16"),
    Shape(B=32, H=8, L=2048, Dh=128, dtype="bfloat16"),
]
# Smoke set: each costs the Triton interpreter a handful of programs.
SMOKE_SHAPES = [Shape(B=2, H=3, L=70, Dh=24, dtype="float32"), Shape(B=1, H=2, L=33, Dh=64, dtype="bfloat16")]

SHAPES = select_shapes(FULL_SHAPES, SMOKE_SHAPES)

HEADLINE_CASES = [
    (shape, backend)
    for shape in (Shape(B=64, H=12, L=1024, Dh=64, dtype="bfloat16"), SMOKE_SHAPES[0])
    for backend in ("triton", "triton+graph")
]
CASES = backend_params(
    SHAPES, ("triton", "triton+graph", "eager", "reference", "compile"), headline=HEADLINE_CASES, ids=shape_id
)


@functools.cache
def _compiled_reference():
    return torch.compile(smeared_keys_reference, dynamic=False)


@pytest.mark.parametrize("shape,backend", CASES)
def test_smeared_keys_fwd_bwd(fwd_bwd, benchmark, shape: Shape, backend: str) -> None:
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(backend, device, compile_here=shape == SMOKE_SHAPES[0])
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    k = torch.randn(shape.B, shape.H, shape.L, shape.Dh, generator=generator).to(device, dtype).requires_grad_()
    alpha = torch.randn(shape.H, generator=generator).to(device).requires_grad_()
    if backend == "compile":
        fn = lambda keys: _compiled_reference()(keys, alpha)
        # A peer computing something else would make the timing meaningless: check it once here.
        assert_close_rel(fn(k), smeared_keys_reference(k, alpha), name="compiled reference")
    elif backend == "reference":
        fn = lambda keys: smeared_keys_reference(keys, alpha)
    else:
        fn = lambda keys: smeared_keys(keys, alpha, backend=backend)
    benchmark.group = f"smeared-keys-fwd-bwd {shape_id(shape)}"
    info = {"op": "smeared_keys", "backend": backend_name, **shape._asdict()}
    cost = fwd_bwd_cost(shape.B, shape.H, shape.L, shape.Dh, dtype=dtype, alpha_itemsize=alpha.element_size())
    fwd_bwd(fn, k, info=info, cost=cost, wrt=(alpha,), graphed=graphed)
