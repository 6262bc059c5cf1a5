"""Contrastive action scoring (Headless-AD): InfoNCE forward + backward and action selection
(docs/ops.md, docs/performance.md#targets).

``test_infonce_fwd_bwd`` times ``loss = InfoNCE(pred @ E^T / tau, targets)`` and its gradients for one
shape ``(N, D, A)`` (rows, width, actions; one action map shared by all rows) and one implementation:

* ``fused``: :func:`icrl_kernels.infonce_loss` with ``backend="auto"``: the Triton kernels on CUDA (or
  under ``TRITON_INTERPRET=1``), the row-chunked eager path on the CPU. Logits never reach memory;
* ``reference``: ``F.cross_entropy((pred @ E.T).float() / tau, targets)``, the eager baseline that
  materialises the ``N x A`` fp32 logits (and their gradient) -- what ``infonce_loss_reference`` does;
* ``compile``: ``torch.compile`` of that baseline;
* ``liger``: Liger-Kernel's fused linear cross-entropy (CUDA only, when ``liger_kernel`` is importable)
  on ``pred / tau`` against the map as the "LM head" weight, the general-purpose peer.

``wrt`` says which gradients are taken: ``pred`` (Headless-AD: the random map is a fixed buffer, so
only the prediction needs a gradient; every shape) or ``both`` (``pred`` and the map, as for a learned
head; the D = 512 slice and the smoke shapes).

``test_select_actions`` times one action per row: ``fused-sample`` / ``fused-argmax``
(:func:`icrl_kernels.select_actions`, Gumbel-max or argmax in one pass) against ``reference``
(``torch.multinomial(torch.softmax(pred @ E.T / tau))``) and ``argmax`` (``(pred @ E.T).argmax(-1)``).

Baselines that materialise ``N x A`` logits are skipped where those logits alone would exceed
:data:`LOGITS_LIMIT_BYTES` (e.g. ``A`` = 1M); the fused path still runs there. On CUDA every benchmark
records its peak memory. Inputs: ``pred ~ N(0, 1)``, map rows ``N(0, 1/D)`` (unit norm on average;
values do not change the work), uniform targets, tau = 0.7; bf16 on CUDA (training under autocast),
fp32 on the CPU. Bytes and FLOPs come from :mod:`benchmarks.cost.contrastive` (a fused
implementation's minimum: the logits never reach memory, and the backward recomputes them once); for
large ``A`` the FLOPs term of the roofline binds, for small ``A`` reading ``pred``.

Headline cases (``-m headline``): every backend at ``N = 65536, D = 512, wrt = pred`` with ``A = 125``,
``4096`` and ``1M`` (the targets: within 1.5x of the roofline; at least 3x eager and 1.5x
``torch.compile`` from ``A = 4096``; at least Liger's speed at ``A = 1M``), ``select_actions`` at
``N = 65536, D = 512, A = 4096``, and the smoke shapes on a smoke run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import icrl_kernels
from icrl_kernels._backend import triton_interpreter_enabled
from icrl_kernels.testing import relative_rms_error

from .conftest import as_params, bench_device, full_run, select_shapes, split_graph
from .cost.contrastive import infonce_fwd_bwd_cost, select_actions_cost

TAU = 0.7

#: Skip a materialising baseline when its fp32 ``N x A`` logits alone would exceed this (it also keeps
#: their gradient and, for the loss, the softmax: about three times as much).
LOGITS_LIMIT_BYTES = 8 * 2**30 if torch.cuda.is_available() else 2**30

#: On the CPU (``ICRL_BENCH_FULL=1``), skip shapes whose forward matmul alone exceeds this many flops.
CPU_FLOP_LIMIT = 2e11


class Shape(NamedTuple):
    N: int
    D: int
    A: int


def shape_id(shape: Shape) -> str:
    return f"N{shape.N}-D{shape.D}-A{shape.A}"


# Full set (CUDA, or ICRL_BENCH_FULL=1): the target grid (docs/performance.md), N x D x A. A = 5 and 125 are the
# bandit / dark-room action sets Headless-AD trains on; 4096 .. 1M are the large action spaces where the
# materialised logits become the bottleneck (and then do not fit at all).
FULL_SHAPES = [
    Shape(N, D, A) for N in (6400, 65536) for D in (128, 512, 1024) for A in (5, 125, 4096, 65536, 1_000_000)
]
# Smoke set: a single action tile, and two tiles (150 actions) with a ragged N; each costs the Triton
# interpreter a couple of programs.
SMOKE_SHAPES = [Shape(64, 32, 5), Shape(40, 48, 150)]

SHAPES = select_shapes(FULL_SHAPES, SMOKE_SHAPES)


def _wants_both_grads(shape: Shape) -> bool:
    return shape.D == 512 or not full_run()


# One case per target (Headless-AD trains with a fixed map, so the gradient is w.r.t. pred only): the
# roofline at the dark-room action set, the eager/compile targets at 4096, the Liger target at 1M.
HEADLINE_LOSS_CASES = [(Shape(65536, 512, A), "pred") for A in (125, 4096, 1_000_000)]
HEADLINE_LOSS_CASES += [(shape, "pred") for shape in SMOKE_SHAPES]
HEADLINE_SELECT_SHAPES = [Shape(65536, 512, 4096), SMOKE_SHAPES[0]]

LOSS_CASES = [
    pytest.param(
        shape,
        wrt,
        id=f"{shape_id(shape)}-{wrt}",
        marks=[pytest.mark.headline] if (shape, wrt) in HEADLINE_LOSS_CASES else [],
    )
    for shape in SHAPES
    for wrt in ("pred", "both")
    if wrt == "pred" or _wants_both_grads(shape)
]


def bench_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def make_inputs(shape: Shape, device: torch.device, seed: int = 0):
    """``pred [N, D]``, ``embeds [A, D]`` (in :func:`bench_dtype`) and ``targets [N]`` int64."""
    # Drawn on the device (a 1M x 1024 map takes seconds to draw on the host), straight in the dtype.
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = bench_dtype(device)
    pred = torch.randn(shape.N, shape.D, generator=generator, device=device, dtype=dtype)
    embeds = torch.randn(shape.A, shape.D, generator=generator, device=device, dtype=dtype) / shape.D**0.5
    targets = torch.randint(0, shape.A, (shape.N,), generator=generator, device=device)
    return pred, embeds, targets


def logits_bytes(shape: Shape) -> int:
    return shape.N * shape.A * 4


def skip_unless_runnable(shape: Shape, backend: str, device: torch.device, *, materialises: bool) -> None:
    """``pytest.skip`` for combinations that cannot run, or would not finish, here."""
    if materialises and logits_bytes(shape) > LOGITS_LIMIT_BYTES:
        pytest.skip(f"materialised N x A fp32 logits need {logits_bytes(shape) / 2**30:.1f} GiB")
    if device.type == "cpu" and 2 * shape.N * shape.A * shape.D > CPU_FLOP_LIMIT:
        pytest.skip("too much work for the CPU")
    if backend.startswith("fused") and device.type == "cpu" and full_run() and triton_interpreter_enabled():
        pytest.skip("full-size shapes are far too slow for the Triton interpreter")
    if backend == "compile" and device.type == "cpu":
        if triton_interpreter_enabled():
            pytest.skip("torch.compile baseline skipped under TRITON_INTERPRET=1 (CPU compile, not the op)")
        if not full_run() and shape != SMOKE_SHAPES[0]:
            pytest.skip("torch.compile takes seconds per shape on the CPU: smoke runs compile one shape")
    if backend == "liger":
        if device.type != "cuda":
            pytest.skip("Liger-Kernel is CUDA-only")
        pytest.importorskip("liger_kernel")


# -- implementations -------------------------------------------------------------------------------


def reference_loss(pred: torch.Tensor, embeds: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The materialising eager baseline: fp32 logits ``[N, A]``, then cross-entropy."""
    return F.cross_entropy((pred @ embeds.T).float() / TAU, targets)


def fused_loss(pred: torch.Tensor, embeds: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return icrl_kernels.infonce_loss(pred, embeds, targets, tau=TAU)


@functools.cache
def _compiled_reference() -> Callable[..., torch.Tensor]:
    # One graph per shape; the full grid visits more shapes than Dynamo's default recompile limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(reference_loss, dynamic=False)


@functools.cache
def _liger_loss() -> Callable[..., torch.Tensor]:
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    module = LigerFusedLinearCrossEntropyLoss()

    def loss(pred, embeds, targets):
        # Liger has no temperature: scale the input instead (same logits, pred . e / tau).
        return module(embeds, pred / TAU, targets)

    return loss


def loss_fn(backend: str) -> Callable[..., torch.Tensor]:
    return {
        "fused": lambda: fused_loss,
        "reference": lambda: reference_loss,
        "compile": _compiled_reference,
        "liger": _liger_loss,
    }[backend]()


def _check_peer(value: torch.Tensor, pred, embeds, targets, backend: str) -> None:
    """A peer computing something else would make the comparison meaningless: check its loss once.

    The tolerance admits bf16 rounding of the logits (the baselines round ``pred @ E.T`` to bf16 before
    the fp32 softmax; the fused kernels accumulate in fp32); a wrong temperature or target is off by O(1).
    """
    with torch.no_grad():
        expected = fused_loss(pred, embeds, targets)
    error = relative_rms_error(value.detach().float(), expected)
    assert error < 2e-2, f"{backend} disagrees with infonce_loss: relative error {error:.2e}"


@pytest.mark.parametrize("backend", ["fused", "fused+graph", "reference", "compile", "liger"])
@pytest.mark.parametrize("shape,wrt", LOSS_CASES)
def test_infonce_fwd_bwd(timed, benchmark, shape: Shape, wrt: str, backend: str) -> None:
    """Forward + backward of one implementation at one shape, on the benchmark device."""
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(shape, backend, device, materialises=backend in ("reference", "compile"))
    pred, embeds, targets = make_inputs(shape, device)
    pred.requires_grad_(True)
    embeds.requires_grad_(wrt == "both")
    leaves = (pred, embeds) if wrt == "both" else (pred,)
    fn = loss_fn(backend)
    if backend != "fused":
        _check_peer(fn(pred, embeds, targets), pred, embeds, targets, backend)

    def step() -> None:
        torch.autograd.grad(fn(pred, embeds, targets), leaves)

    cost = infonce_fwd_bwd_cost(shape.N, shape.D, shape.A, dtype=pred.dtype, grad_embeds=wrt == "both")
    benchmark.group = f"infonce-fwd-bwd {shape_id(shape)}-{wrt}"
    info = {"op": "infonce_loss", "backend": backend_name, **shape._asdict(), "wrt": wrt, "tau": TAU}
    timed(step, device=device, info=info, cost=cost, dtype=pred.dtype, graphed=graphed)


SELECT_BACKENDS = ["fused-sample", "fused-sample+graph", "fused-argmax", "reference", "argmax"]


def select_fn(backend: str) -> Callable[..., torch.Tensor]:
    if backend == "fused-sample":
        return lambda pred, embeds: icrl_kernels.select_actions(pred, embeds, mode="sample", tau=TAU)
    if backend == "fused-argmax":
        return lambda pred, embeds: icrl_kernels.select_actions(pred, embeds, mode="argmax", tau=TAU)
    if backend == "reference":
        return lambda pred, embeds: torch.multinomial(torch.softmax((pred @ embeds.T).float() / TAU, -1), 1)[:, 0]
    return lambda pred, embeds: (pred @ embeds.T).argmax(-1)


@pytest.mark.parametrize("backend", SELECT_BACKENDS)
@pytest.mark.parametrize("shape", as_params(SHAPES, headline=HEADLINE_SELECT_SHAPES, ids=shape_id))
def test_select_actions(timed, benchmark, shape: Shape, backend: str) -> None:
    """One action per row (no gradient), on the benchmark device."""
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(shape, backend, device, materialises=not backend.startswith("fused"))
    pred, embeds, _ = make_inputs(shape, device)
    fn = select_fn(backend)
    if backend.endswith("argmax") and logits_bytes(shape) <= LOGITS_LIMIT_BYTES:
        # Same ids up to near-ties (the fused kernels accumulate the bf16 dots in fp32).
        with torch.no_grad():
            agree = (fn(pred, embeds) == icrl_kernels.select_actions_reference(pred, embeds)).float().mean()
        assert agree > 0.95, f"{backend} picks other actions than the reference argmax ({agree:.1%} agree)"

    def step() -> None:
        with torch.no_grad():
            fn(pred, embeds)

    benchmark.group = f"select-actions {shape_id(shape)}"
    info = {"op": "select_actions", "backend": backend_name, **shape._asdict(), "tau": TAU}
    cost = select_actions_cost(shape.N, shape.D, shape.A, dtype=pred.dtype)
    timed(step, device=device, info=info, cost=cost, dtype=pred.dtype, graphed=graphed)
