"""Mixture-of-Attention gating, forward + backward (docs/ops.md, docs/performance.md#targets).

Two families of benchmarks:

``test_moa_attention_fwd_bwd`` times a whole ``MoAAttention`` layer (QKV projection, SDPA, gating,
output projection) and the gradients w.r.t. its input ``x [B, L, D]`` and all its parameters (as in
training) at ``H = 12, Dh = 64`` (GPT-2 small):

* ``triton`` / ``eager``: the gated layer with ``mixture_of_heads`` on that backend;
* ``reference``: the same layer with the gate math as plain PyTorch ops after SDPA, differentiated by
  autograd (the eager MoA a user would write);
* ``ungated``: ``MoAAttention(gate=None)``, ordinary causal attention: the floor. The issue's target
  is gated (``triton``) at most 1.1x ``ungated`` at GPT-2-small shapes.

``test_mixture_of_heads_fwd_bwd`` times the op alone on ``head_out [B, L, H, Dh]`` in the two layouts
SDPA produces: ``blhd`` (contiguous: what PyTorch's flash kernels return, e.g. for the strided q/k/v
views of one QKV projection, as in ``MoAAttention``) and ``bhld`` (the ``transpose(1, 2)`` view of a
``[B, H, L, Dh]``-contiguous output, e.g. SDPA on contiguous inputs): ``triton``, ``eager``,
``reference`` (autograd) and ``compile`` (``torch.compile`` of the reference).

Bytes and FLOPs: :mod:`benchmarks.cost.moa` (the layer's boundary traffic and its projection and
attention FLOPs, compute-bound; the op's ``5 N`` head-sized elements plus ``3 B L H`` logits,
memory-bound).

Headline cases (``-m headline``): every layer backend at ``B = 16`` and ``64``, ``L = 1024``, bf16 (the
target: gated at most 1.1x ungated), the Triton op at ``B = 16, L = 1024`` bf16 in SDPA's flash layout
(its roofline target), and the first smoke shape on a smoke run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch

from icrl_kernels import MoAAttention, mixture_of_heads, mixture_of_heads_reference
from icrl_kernels.testing import assert_close_rel

from .conftest import as_params, bench_device, select_shapes, skip_unless_runnable, split_graph
from .cost.moa import attention_fwd_bwd_cost, mixture_of_heads_fwd_bwd_cost


class Shape(NamedTuple):
    B: int
    L: int
    H: int
    Dh: int
    dtype: str


def shape_id(shape: Shape) -> str:
    return f"B{shape.B}-L{shape.L}-H{shape.H}-Dh{shape.Dh}-{shape.dtype}"


# Full set (CUDA, or ICRL_BENCH_FULL=1): the MoA row of docs/performance.md#targets,
# B = 8..64, H = 12, Dh = 64, L = 60..4096.
# L = 60 is the DT's context (20 steps x 3 tokens); bf16 is how training runs on GPU (autocast).
FULL_SHAPES = [
    *(Shape(B=8, L=L, H=12, Dh=64, dtype="float32") for L in (60, 256, 1024, 4096)),
    *(Shape(B=64, L=L, H=12, Dh=64, dtype="bfloat16") for L in (60, 256, 1024)),
    Shape(B=8, L=4096, H=12, Dh=64, dtype="bfloat16"),
    Shape(B=16, L=1024, H=12, Dh=64, dtype="bfloat16"),  # the headline shape of the gated-vs-ungated target
]
# Smoke set: a few interpreter programs each.
SMOKE_SHAPES = [Shape(B=2, L=37, H=12, Dh=16, dtype="float32"), Shape(B=1, L=20, H=3, Dh=64, dtype="bfloat16")]

SHAPES = select_shapes(FULL_SHAPES, SMOKE_SHAPES)

HEADLINE_SHAPES = [Shape(B=B, L=1024, H=12, Dh=64, dtype="bfloat16") for B in (16, 64)] + SMOKE_SHAPES[:1]
HEADLINE_OP_CASES = [
    (shape, "blhd", backend)
    for shape in (HEADLINE_SHAPES[0], SMOKE_SHAPES[0])
    for backend in ("triton", "triton+graph")
]
OP_BACKENDS = ["triton", "triton+graph", "eager", "reference", "compile"]
OP_CASES = [
    pytest.param(
        shape,
        layout,
        backend,
        id=f"{shape_id(shape)}-{layout}-{backend}",
        marks=[pytest.mark.headline] if (shape, layout, backend) in HEADLINE_OP_CASES else [],
    )
    for shape in SHAPES
    for layout in ("blhd", "bhld")
    for backend in OP_BACKENDS
]


@pytest.mark.parametrize("backend", ["triton", "triton+graph", "eager", "reference", "ungated"])
@pytest.mark.parametrize("shape", as_params(SHAPES, headline=HEADLINE_SHAPES, ids=shape_id))
def test_moa_attention_fwd_bwd(fwd_bwd, benchmark, shape: Shape, backend: str) -> None:
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(backend, device, compile_here=shape == SMOKE_SHAPES[0])
    dtype = getattr(torch, shape.dtype)
    d_model = shape.H * shape.Dh
    torch.manual_seed(0)
    if backend == "ungated":
        layer = MoAAttention(d_model, shape.H, gate=None)
    else:
        layer = MoAAttention(d_model, shape.H, gate="softmax", backend=backend)
    layer = layer.to(device=device, dtype=dtype)
    x = torch.randn(shape.B, shape.L, d_model, device=device, dtype=dtype, requires_grad=True)
    benchmark.group = f"moa-attention-fwd-bwd {shape_id(shape)}"
    info = {"op": "moa_attention", "backend": backend_name, **shape._asdict()}
    cost = attention_fwd_bwd_cost(shape.B, shape.L, shape.H, shape.Dh, dtype=dtype, gated=backend != "ungated")
    fwd_bwd(layer, x, info=info, cost=cost, wrt=tuple(layer.parameters()), graphed=graphed)


@functools.cache
def _compiled_reference():
    return torch.compile(mixture_of_heads_reference, dynamic=False)


@pytest.mark.parametrize("shape,layout,backend", OP_CASES)
def test_mixture_of_heads_fwd_bwd(timed, benchmark, shape: Shape, layout: str, backend: str) -> None:
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(backend, device, compile_here=shape == SMOKE_SHAPES[0])
    if backend == "compile" and device.type == "cpu" and layout != "bhld":
        pytest.skip("an Inductor CPU compile takes seconds: one smoke layout is enough")
    dtype = getattr(torch, shape.dtype)
    generator = torch.Generator().manual_seed(0)
    # sdpa_out [B, H, L, Dh] as SDPA returns it; the op reads it through its [B, L, H, Dh] view.
    if layout == "bhld":
        sdpa_out = torch.randn(shape.B, shape.H, shape.L, shape.Dh, generator=generator).to(device, dtype)
    else:
        sdpa_out = torch.randn(shape.B, shape.L, shape.H, shape.Dh, generator=generator).to(device, dtype)
        sdpa_out = sdpa_out.transpose(1, 2)
    sdpa_out = sdpa_out.detach().requires_grad_(True)
    logits = torch.randn(shape.B, shape.L, shape.H, generator=generator).to(device, dtype).requires_grad_(True)
    grad_out = torch.randn(shape.B, shape.L, shape.H * shape.Dh, generator=generator).to(device, dtype)
    if backend == "compile":
        fn = _compiled_reference()
        heads = sdpa_out.transpose(1, 2)
        assert_close_rel(fn(heads, logits), mixture_of_heads_reference(heads, logits), name="compiled reference")
    elif backend == "reference":
        fn = mixture_of_heads_reference
    else:
        fn = lambda heads, gate_logits: mixture_of_heads(heads, gate_logits, backend=backend)

    def step():
        return torch.autograd.grad(fn(sdpa_out.transpose(1, 2), logits), (sdpa_out, logits), grad_out)

    benchmark.group = f"moa-op-fwd-bwd {shape_id(shape)}-{layout}"
    info = {"op": "mixture_of_heads", "backend": backend_name, "layout": layout, **shape._asdict()}
    cost = mixture_of_heads_fwd_bwd_cost(shape.B, shape.L, shape.H, shape.Dh, dtype=dtype)
    timed(step, device=device, info=info, cost=cost, dtype=dtype, graphed=graphed)
