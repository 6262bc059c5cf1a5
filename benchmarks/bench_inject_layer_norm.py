"""Looped-transformer input injection + LayerNorm, forward + backward (docs/ops.md, docs/performance.md#targets).

Every benchmark times ``hidden, normed = op(y, prompt, pos, weight, bias)`` and the gradients w.r.t.
all five inputs from upstream gradients on both outputs (what one loop of a looped transformer
does: ``hidden`` is the residual stream, ``normed`` feeds attention), for one shape and one
implementation:

* ``triton``: the fused Triton kernels (one pass each way);
* ``eager``: the custom op on ATen ops (fp32 sum, ``native_layer_norm`` and its backward);
* ``reference``: ``hidden = y + prompt + pos; F.layer_norm(hidden)`` differentiated by autograd, what
  a user would write (native LayerNorm kernels, half precision stays half precision); named
  ``reference`` because ``benchmarks/summarize.py`` takes ratios against that backend;
* ``compile``: ``torch.compile`` of that baseline (Inductor fuses the adds into the norm).

Bytes and FLOPs: :func:`benchmarks.cost.looped.inject_layer_norm_fwd_bwd_cost`, the minimum of a
fused implementation: the forward reads ``y`` and ``prompt`` and writes ``hidden`` and ``normed``; the
backward reads ``hidden``, ``d_hidden`` and ``d_normed`` and writes ``d_x`` (the one gradient of ``y`` and
``prompt``): ``8 * B * L * D`` elements, plus ``pos`` and its gradient (``2 * L * D``) and the LayerNorm
parameters (the row statistics are recomputed in registers, never stored). Shapes are the looped
transformer's (Yang et al.: GPT-2 block, D = 256; L = 2k + 1 tokens for k = 40 to 100 in-context
examples; batch 64).

Headline case (``-m headline``): ``triton`` at ``B = 64, L = 201`` bf16 (the roofline target), and the
first smoke shape on a smoke run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from icrl_kernels import inject_layer_norm, inject_layer_norm_reference
from icrl_kernels.testing import assert_close_rel

from .conftest import backend_params, bench_device, select_shapes, skip_unless_runnable, split_graph
from .cost.looped import inject_layer_norm_fwd_bwd_cost


class Shape(NamedTuple):
    B: int
    L: int
    D: int
    dtype: str


def shape_id(shape: Shape) -> str:
    return f"B{shape.B}-L{shape.L}-D{shape.D}-{shape.dtype}"


FULL_SHAPES = [
    *(Shape(B=64, L=L, D=256, dtype="float32") for L in (81, 121, 201)),
    *(Shape(B=64, L=L, D=256, dtype="bfloat16") for L in (81, 121, 201)),
]
SMOKE_SHAPES = [Shape(B=3, L=9, D=37, dtype="float32"), Shape(B=5, L=6, D=64, dtype="bfloat16")]

SHAPES = select_shapes(FULL_SHAPES, SMOKE_SHAPES)

HEADLINE_CASES = [
    (shape, backend)
    for shape in (Shape(B=64, L=201, D=256, dtype="bfloat16"), SMOKE_SHAPES[0])
    for backend in ("triton", "triton+graph")
]
CASES = backend_params(
    SHAPES, ("triton", "triton+graph", "eager", "reference", "compile"), headline=HEADLINE_CASES, ids=shape_id
)


def torch_inject_layer_norm(y, prompt, pos, weight, bias):
    """The unfused baseline: two adds and the native LayerNorm (same dtype rules as eager PyTorch)."""
    hidden = y + prompt + pos
    return hidden, F.layer_norm(hidden, hidden.shape[-1:], weight, bias)


@functools.cache
def _compiled_torch():
    return torch.compile(torch_inject_layer_norm, dynamic=False)


@pytest.mark.parametrize("shape,backend", CASES)
def test_inject_layer_norm_fwd_bwd(timed, benchmark, shape: Shape, backend: str) -> None:
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(backend, device, compile_here=shape == SMOKE_SHAPES[0])
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, shape.dtype)

    def draw(*size):
        return torch.randn(*size, generator=generator).to(device, dtype).requires_grad_()

    # All five in the activation dtype, so the unfused baseline runs in the same precision.
    inputs = (draw(shape.B, shape.L, shape.D), draw(shape.B, shape.L, shape.D), draw(shape.L, shape.D),
              draw(shape.D), draw(shape.D))  # fmt: skip
    grads_out = (torch.randn_like(inputs[1]), torch.randn_like(inputs[1]))
    if backend == "compile":
        fn = _compiled_torch()
    elif backend == "reference":
        fn = torch_inject_layer_norm
    else:
        fn = functools.partial(inject_layer_norm, backend=backend)
    # A peer computing something else would make the timing meaningless: check it once here.
    expected = inject_layer_norm_reference(*(t.detach().float() for t in inputs))
    for out, ref in zip(fn(*inputs), expected):
        assert_close_rel(out, ref, rms_tol=1e-5 if dtype == torch.float32 else 2e-2, name=f"{backend} output")

    def step():
        return torch.autograd.grad(fn(*inputs), inputs, grads_out)

    benchmark.group = f"inject-layer-norm-fwd-bwd {shape_id(shape)}"
    info = {"op": "inject_layer_norm", "backend": backend_name, **shape._asdict(), "shape": [shape.B, shape.L, shape.D]}
    cost = inject_layer_norm_fwd_bwd_cost(shape.B, shape.L, shape.D, dtype=dtype)
    timed(step, device=device, info=info, cost=cost, dtype=dtype, warmup=2, graphed=graphed)
