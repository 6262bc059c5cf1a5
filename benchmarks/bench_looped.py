"""Looped block: a training step and a long inference loop (docs/ops.md, docs/performance.md#targets).

Shapes are the looped-transformer paper's (``D = 256``, 8 heads, one block, prompts of ``L = 81..201``
tokens, ``B = 64``). Backends (``backend`` in ``extra_info``, as in every other benchmark):

* ``fused``: :class:`icrl_kernels.LoopedBlock` with the fused injection + LayerNorm op (Triton on
  CUDA, eager PyTorch on CPU);
* ``fused-graph``: the same with ``cuda_graph=True`` (the no-grad loops replayed from CUDA graphs of
  ``graph_chunk = 50`` loops each: 500 loops are 10 replays; CUDA only);
* ``fused-graph-c1``: the same with ``graph_chunk=1`` (one replay per loop: what the chunking saves;
  inference only, CUDA only);
* ``eager``: the same module with ``backend="reference"``: the plain loop of the official code
  (``Y + P + pos`` then ``F.layer_norm``, autograd);
* ``compile``: ``torch.compile`` of one loop step (reference backend), looped in Python.

``train`` times ``b`` loops of which the last ``T`` keep autograd, a mean-squared loss over the kept
iterates and the backward (the paper's truncated loss); ``infer`` times ``b`` loops without autograd.
Bytes and FLOPs: :func:`benchmarks.cost.looped.train_step_cost` and
:func:`~benchmarks.cost.looped.inference_cost` (per loop the weights, the iterate and the prompt;
the blocks' matmul FLOPs, which bind).

The whole training step of the looped model (``test_looped_model_train_step``, op
``looped_model_train_step``): :class:`icrl_models.models.looped.LoopedTransformer` at the paper's shape
(``d = 20``, 41 points so ``L = 82``, ``D = 256``, 8 heads, ``b = 20, T = 10`` and ``b = 30, T = 15``,
bf16 autocast), :func:`icrl_models.looped_step.train_step` (loops, truncated loss, backward, Adam step;
Adam ``capturable=True`` on CUDA for every backend, so all do the same work):

* ``eager``: the reference injection backend, launched from Python (the official code's loop);
* ``fused``: the fused injection + LayerNorm op, launched from Python;
* ``graph-step``: ``fused`` captured whole in one CUDA graph
  (:func:`~icrl_models.looped_step.make_graphed_train_step`; CUDA only);
* ``compile-ro``: ``torch.compile(train_step, mode="reduce-overhead")`` (CUDA only).

The CPU smoke run executes ``eager`` and ``fused`` once; the graph variants skip cleanly.

Headline cases (``-m headline``): every backend for a bf16 train step at ``L = 81, b = 30, T = 15``
(the target: at least 3x the eager loop) and 500-loop bf16 inference at ``L = 81`` (at least 5x), and
the smoke shapes on a smoke run.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from icrl_kernels import LoopedBlock
from icrl_models.looped_step import make_graphed_train_step, make_optimizer, train_step
from icrl_models.models.looped import LoopedConfig, LoopedTransformer

from .conftest import as_params, bench_device, full_run, select_shapes, split_graph
from .cost.looped import inference_cost, train_step_cost


class Shape(NamedTuple):
    B: int
    L: int
    D: int
    H: int
    loops: int
    grad_loops: int
    dtype: str


def shape_id(shape: Shape) -> str:
    return f"B{shape.B}-L{shape.L}-D{shape.D}-H{shape.H}-b{shape.loops}-T{shape.grad_loops}-{shape.dtype}"


SMOKE_TRAIN = Shape(2, 9, 32, 2, 4, 2, "float32")
SMOKE_INFER = Shape(2, 9, 32, 2, 6, 0, "float32")
TRAIN_SHAPES = select_shapes(
    [Shape(64, L, 256, 8, loops, T, dtype) for L in (81, 201) for loops, T in ((20, 10), (30, 15))
     for dtype in ("float32", "bfloat16")],
    [SMOKE_TRAIN],
)  # fmt: skip
INFER_SHAPES = select_shapes(
    [Shape(64, L, 256, 8, 500, 0, dtype) for L in (81, 201) for dtype in ("float32", "bfloat16")], [SMOKE_INFER]
)
HEADLINE_SHAPES = [
    Shape(64, 81, 256, 8, 30, 15, "bfloat16"),  # train step at the paper's b_max / T
    Shape(64, 81, 256, 8, 500, 0, "bfloat16"),  # 500-loop inference
    SMOKE_TRAIN,
    SMOKE_INFER,
]
BACKENDS = ["fused", "fused-graph", "eager", "compile"]
#: The training step also as one CUDA graph of the whole step (loops with and without autograd, the loss and
#: the backward): ``fused`` replayed (``benchmarks/conftest.py``'s ``timed(graphed=True)``; CUDA only).
TRAIN_BACKENDS = [*BACKENDS, "fused+graph"]
INFER_BACKENDS = [*BACKENDS, "fused-graph-c1"]


def make_block(shape: Shape, backend: str, device: torch.device) -> tuple[LoopedBlock, callable]:
    """The module and a ``step(y, prompt)`` callable for ``backend``."""
    if backend.startswith("fused-graph") and device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    if backend == "compile" and device.type == "cpu" and not full_run():
        pytest.skip("an Inductor CPU compile per shape is too slow for a smoke run")
    torch.manual_seed(0)
    op_backend = "auto" if backend.startswith("fused") else "reference"
    block = LoopedBlock(
        shape.D,
        shape.H,
        shape.L,
        backend=op_backend,
        cuda_graph=backend.startswith("fused-graph"),
        graph_chunk=1 if backend == "fused-graph-c1" else 50,
    )
    block = block.to(device)
    if backend == "compile":
        block.step = torch.compile(block.step, dynamic=False)
    return block, block.step


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
@pytest.mark.parametrize("shape", as_params(TRAIN_SHAPES, headline=HEADLINE_SHAPES, ids=shape_id))
def test_looped_train_step(timed, benchmark, shape: Shape, backend: str) -> None:
    device = bench_device()
    dtype = getattr(torch, shape.dtype)
    backend_name, (backend, graphed) = backend, split_graph(backend)
    block, _ = make_block(shape, backend, device)
    prompt = torch.randn(shape.B, shape.L, shape.D, device=device, requires_grad=True)

    def step() -> None:
        with _autocast(device, dtype):
            iterates = block(prompt, loops=shape.loops, grad_loops=shape.grad_loops)
        iterates.float().square().mean().backward()

    benchmark.group = f"looped-train {shape_id(shape)}"
    info = {"op": "looped_block_train", "backend": backend_name, **shape._asdict()}
    cost = train_step_cost(shape.B, shape.L, shape.D, loops=shape.loops, grad_loops=shape.grad_loops, dtype=dtype)
    timed(step, device=device, info=info, cost=cost, dtype=dtype, warmup=2, graphed=graphed)


@pytest.mark.parametrize("backend", INFER_BACKENDS)
@pytest.mark.parametrize("shape", as_params(INFER_SHAPES, headline=HEADLINE_SHAPES, ids=shape_id))
def test_looped_inference(timed, benchmark, shape: Shape, backend: str) -> None:
    device = bench_device()
    dtype = getattr(torch, shape.dtype)
    block, _ = make_block(shape, backend, device)
    block.eval()
    prompt = torch.randn(shape.B, shape.L, shape.D, device=device)

    def step() -> None:
        with _autocast(device, dtype):
            block.run_without_grad(prompt, shape.loops)

    benchmark.group = f"looped-infer {shape_id(shape)}"
    info = {"op": "looped_block_inference", "backend": backend, **shape._asdict()}
    cost = inference_cost(shape.B, shape.L, shape.D, loops=shape.loops, dtype=dtype)
    timed(step, device=device, info=info, cost=cost, dtype=dtype, warmup=2)


# -- the looped model's whole training step (loops, loss, backward, Adam) -----------------------------------
STEP_SHAPES = select_shapes(
    [Shape(64, 82, 256, 8, loops, T, "bfloat16") for loops, T in ((20, 10), (30, 15))], [SMOKE_TRAIN]
)
STEP_HEADLINE = [Shape(64, 82, 256, 8, 30, 15, "bfloat16"), SMOKE_TRAIN]
STEP_BACKENDS = ["eager", "fused", "graph-step", "compile-ro"]


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("shape", as_params(STEP_SHAPES, headline=STEP_HEADLINE, ids=shape_id))
def test_looped_model_train_step(timed, benchmark, shape: Shape, backend: str) -> None:
    device = bench_device()
    if backend in ("graph-step", "compile-ro") and device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    dtype = getattr(torch, shape.dtype)
    autocast_dtype = None if dtype == torch.float32 else dtype
    points, n_dims = shape.L // 2, (20 if full_run() else 3)
    torch.manual_seed(0)
    config = LoopedConfig(
        n_dims=n_dims, max_points=points, d_model=shape.D, n_heads=shape.H,
        backend="reference" if backend == "eager" else "auto",
    )  # fmt: skip
    model = LoopedTransformer(config).to(device)
    optimizer = make_optimizer(model.parameters(), 1e-4, capturable=device.type == "cuda")
    xs = torch.randn(shape.B, points, n_dims, device=device)
    ys = torch.randn(shape.B, points, device=device)
    kwargs = dict(loops=shape.loops, grad_loops=shape.grad_loops, autocast_dtype=autocast_dtype)
    if backend == "graph-step":
        graphed = make_graphed_train_step(model, optimizer, (xs, ys), **kwargs)

        def step() -> None:
            graphed(xs, ys)
    elif backend == "compile-ro":
        compiled = torch.compile(train_step, mode="reduce-overhead")

        def step() -> None:
            compiled(model, optimizer, xs, ys, **kwargs)
    else:

        def step() -> None:
            train_step(model, optimizer, xs, ys, **kwargs)

    benchmark.group = f"looped-model-train {shape_id(shape)}"
    info = {"op": "looped_model_train_step", "backend": backend, **shape._asdict()}
    # The loop body's bytes and FLOPs (the read-in, read-out and Adam's pass over ~0.8M parameters are small).
    cost = train_step_cost(shape.B, shape.L, shape.D, loops=shape.loops, grad_loops=shape.grad_loops, dtype=dtype)
    timed(step, device=device, info=info, cost=cost, dtype=dtype, warmup=3)
