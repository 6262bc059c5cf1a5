"""Looped block: a training step and a long inference loop (DESIGN.md sections 2.4 and 5).

Shapes are the looped-transformer paper's (``D = 256``, 8 heads, one block, prompts of ``L = 81..201``
tokens, ``B = 64``). Implementations:

* ``fused``: :class:`icrl_kernels.LoopedBlock` with the fused injection + LayerNorm op (Triton on
  CUDA, eager PyTorch on CPU);
* ``fused-graph``: the same with ``cuda_graph=True`` (the no-grad loops replayed from a CUDA graph;
  CUDA only);
* ``eager``: the same module with ``backend="reference"``: the plain loop of the official code
  (``Y + P + pos`` then ``F.layer_norm``, autograd);
* ``compile``: ``torch.compile`` of one loop step (reference backend), looped in Python.

``train`` times ``b`` loops of which the last ``T`` keep autograd, a mean-squared loss over the kept
iterates and the backward (the paper's truncated loss); ``infer`` times ``b`` loops without autograd.
Bytes moved are a lower bound per loop: the block's weights read once and the iterate read and written
once (activations inside the block are not counted), times the loops.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from icrl_kernels import LoopedBlock

from .conftest import bench_device, full_run, select_shapes


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


TRAIN_SHAPES = select_shapes(
    [Shape(64, L, 256, 8, loops, T, dtype) for L in (81, 201) for loops, T in ((20, 10), (30, 15))
     for dtype in ("float32", "bfloat16")],
    [Shape(2, 9, 32, 2, 4, 2, "float32")],
)  # fmt: skip
INFER_SHAPES = select_shapes(
    [Shape(64, L, 256, 8, 500, 0, dtype) for L in (81, 201) for dtype in ("float32", "bfloat16")],
    [Shape(2, 9, 32, 2, 6, 0, "float32")],
)
IMPLEMENTATIONS = ["fused", "fused-graph", "eager", "compile"]


def make_block(shape: Shape, implementation: str, device: torch.device) -> tuple[LoopedBlock, callable]:
    """The module and a ``step(y, prompt)`` callable for ``implementation``."""
    if implementation == "fused-graph" and device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    if implementation == "compile" and device.type == "cpu" and not full_run():
        pytest.skip("an Inductor CPU compile per shape is too slow for a smoke run")
    torch.manual_seed(0)
    backend = "auto" if implementation.startswith("fused") else "reference"
    block = LoopedBlock(shape.D, shape.H, shape.L, backend=backend, cuda_graph=implementation == "fused-graph")
    block = block.to(device)
    if implementation == "compile":
        block.step = torch.compile(block.step, dynamic=False)
    return block, block.step


def bytes_per_loop(block: LoopedBlock, shape: Shape, dtype: torch.dtype) -> int:
    weights = sum(p.numel() for p in block.parameters()) * torch.finfo(dtype).bits // 8
    return weights + 2 * shape.B * shape.L * shape.D * torch.finfo(dtype).bits // 8


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", TRAIN_SHAPES, ids=shape_id)
def test_looped_train_step(timed, benchmark, shape: Shape, implementation: str) -> None:
    device = bench_device()
    dtype = getattr(torch, shape.dtype)
    block, _ = make_block(shape, implementation, device)
    prompt = torch.randn(shape.B, shape.L, shape.D, device=device, requires_grad=True)

    def step() -> None:
        with _autocast(device, dtype):
            iterates = block(prompt, loops=shape.loops, grad_loops=shape.grad_loops)
        iterates.float().square().mean().backward()

    benchmark.group = f"looped-train {shape_id(shape)}"
    info = {"op": "looped_block_train", "implementation": implementation, **shape._asdict()}
    timed(step, device=device, info=info, bytes_moved=shape.loops * bytes_per_loop(block, shape, dtype), warmup=2)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", INFER_SHAPES, ids=shape_id)
def test_looped_inference(timed, benchmark, shape: Shape, implementation: str) -> None:
    device = bench_device()
    dtype = getattr(torch, shape.dtype)
    block, _ = make_block(shape, implementation, device)
    block.eval()
    prompt = torch.randn(shape.B, shape.L, shape.D, device=device)

    def step() -> None:
        with _autocast(device, dtype):
            block.run_without_grad(prompt, shape.loops)

    benchmark.group = f"looped-infer {shape_id(shape)}"
    info = {"op": "looped_block_inference", "implementation": implementation, **shape._asdict()}
    timed(step, device=device, info=info, bytes_moved=shape.loops * bytes_per_loop(block, shape, dtype), warmup=2)
