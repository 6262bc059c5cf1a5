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
``4096`` and ``1M`` (the targets, docs/performance.md#targets: within 1.5x of the roofline; at ``A = 4096``
at least 4.5x eager, 1.4x ``torch.compile`` and 2x Liger; at ``A = 1M`` 1.3x Liger; at ``A = 125`` 1.5x
eager), ``select_actions`` at ``N = 65536, D = 512, A = 4096``, and the smoke shapes on a smoke run. Each
InfoNCE case also records its memory: ``input_bytes`` and ``grad_bytes`` (what any implementation holds) beside
the measured ``peak_memory_bytes`` (CUDA), and for ``fused`` the algorithm ``A`` chose and its predicted peak
over the inputs (``algorithms.infonce_memory_bytes``; the target: peak at most inputs + gradients + 64 MiB).

``test_infonce_crossover`` and ``test_select_crossover`` (stage ``infonce-crossover`` of
``benchmarks/gpu_check.py``) time every algorithm of ``icrl_kernels/contrastive/algorithms.py`` (``algorithm=``), over
``A`` = 125..10^6 (bf16, ``N = 65536``, ``D = 512``, gradient for ``pred``; tiny smoke shapes on the CPU):
the data that sets the thresholds between the algorithms (placeholders until then), and, through the
recorded autotuning, the new kernels' configs. The InfoNCE sweep also replays each call from a CUDA graph up
to ``A = 16384`` (``<algorithm>+graph``), where host time can decide the choice, and times row chunks of 8, 16
and 64 MiB besides the default 32 at ``A = 4096`` (``row_chunks@16MiB``: ``CHUNK_BYTES``' data).
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
from icrl_kernels.contrastive.algorithms import (
    ACTION_CHUNKS,
    CHUNK_ROW_MULTIPLE,
    INFONCE_ALGORITHMS,
    ROW_CHUNKS,
    SELECT_ALGORITHMS,
    SMALL,
    SMALL_MAX_ACTIONS,
    chunk_shape,
    chunk_sizes,
    infonce_algorithm,
    infonce_memory_bytes,
)
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


def fused_loss(
    pred: torch.Tensor, embeds: torch.Tensor, targets: torch.Tensor, algorithm: str = "auto"
) -> torch.Tensor:
    return icrl_kernels.infonce_loss(pred, embeds, targets, tau=TAU, algorithm=algorithm)


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
    ours = backend == "fused" and (device.type == "cuda" or triton_interpreter_enabled())  # the Triton backend
    info.update(memory_info(shape, pred.dtype, wrt, infonce_algorithm(shape.A, pred.dtype) if ours else None))
    timed(step, device=device, info=info, cost=cost, dtype=pred.dtype, graphed=graphed)


def memory_info(shape: Shape, dtype: torch.dtype, wrt: str, algorithm: str | None) -> dict:
    """What a call must hold (its inputs and the gradients it returns) and, for one of our algorithms, its
    predicted peak over the inputs: beside the measured ``peak_memory_bytes`` they give the workspace."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    grads = shape.N * shape.D * itemsize + (shape.A * shape.D * itemsize if wrt == "both" else 0)
    info = {"input_bytes": (shape.N + shape.A) * shape.D * itemsize + 8 * shape.N, "grad_bytes": grads}
    if algorithm is not None:
        predicted = infonce_memory_bytes(algorithm, shape.N, shape.D, shape.A, itemsize=itemsize,
                                         want_embeds=wrt == "both")  # fmt: skip
        info.update(algorithm=algorithm, predicted_peak_over_inputs_bytes=predicted)
    return info


# -- crossover of the algorithms (their thresholds) --------------------------------------------------------

#: Action counts of the sweep: Headless-AD's 125, the fused/row_chunks threshold's neighbourhood, the
#: headline 4096, and the huge sets where action chunks compete with the fused kernels.
CROSSOVER_ACTIONS = (125, 512, 1024, 4096, 16384, 65536, 262144, 1_000_000)
CROSSOVER_SHAPES = (
    [Shape(65536, 512, A) for A in CROSSOVER_ACTIONS] if full_run() else [Shape(64, 32, 5), Shape(40, 48, 150)]
)
#: Up to here the sweep also replays each call from a CUDA graph (host time matters at small ``A``).
CROSSOVER_GRAPH_MAX_ACTIONS = 16384
#: Row chunks of other sizes than ``CHUNK_BYTES`` (32 MiB of fp32 logits), at ``A = 4096`` (on the CPU, the
#: smoke shapes' largest ``A``): whether a chunk stays in L2 (50 MB on an H100) decides its speed, and fewer,
#: larger chunks launch fewer kernels. Backend ``row_chunks@<MiB>MiB``.
CHUNK_SIZES_MIB = (8, 16, 64)


def skip_unless_algorithm_runs(shape: Shape, algorithm: str, device: torch.device) -> None:
    """``pytest.skip`` an algorithm that cannot or should not run at ``shape``: ``small`` above one action tile;
    row chunks where a chunk would hold fewer than 64 rows (each chunk's GEMM re-reads the whole map: at
    ``A = 10^6``, 8-row chunks would read it 8192 times); action chunks where one chunk holds every action (the
    same work as row chunks); anything where Triton cannot run."""
    if algorithm == SMALL and shape.A > SMALL_MAX_ACTIONS:
        pytest.skip(f"the small algorithm holds at most {SMALL_MAX_ACTIONS} actions")
    if algorithm == ROW_CHUNKS and full_run() and chunk_shape(shape.A, ROW_CHUNKS)[0] < CHUNK_ROW_MULTIPLE:
        pytest.skip("row chunks of fewer than 64 rows: the action-chunked algorithm's regime")
    if algorithm == ACTION_CHUNKS and full_run() and chunk_shape(shape.A, ACTION_CHUNKS)[1] >= shape.A:
        pytest.skip("one action chunk: the row-chunked algorithm")
    skip_unless_runnable(shape, "fused", device, materialises=False)
    if device.type == "cpu" and not triton_interpreter_enabled():
        pytest.skip("the algorithms run on the Triton backend: on the CPU only under TRITON_INTERPRET=1")


def _crossover_backends(algorithms: tuple[str, ...]) -> list:
    chunk_sweep_actions = 4096 if full_run() else CROSSOVER_SHAPES[-1].A
    params = [
        pytest.param(shape, backend, id=f"{shape_id(shape)}-{backend}")
        for shape in CROSSOVER_SHAPES
        for algorithm in algorithms
        for backend in (algorithm, algorithm + "+graph")
        if not backend.endswith("+graph") or shape.A <= CROSSOVER_GRAPH_MAX_ACTIONS
    ]
    params += [
        pytest.param(shape, f"{ROW_CHUNKS}@{mib}MiB", id=f"{shape_id(shape)}-{ROW_CHUNKS}@{mib}MiB")
        for shape in CROSSOVER_SHAPES
        for mib in CHUNK_SIZES_MIB
        if shape.A == chunk_sweep_actions
    ]
    return params


def _chunks(backend: str):
    """The chunk size of a crossover backend (``<algorithm>``, ``<algorithm>+graph`` or ``row_chunks@<MiB>MiB``:
    row chunks of that many MiB of fp32 logits; the default elsewhere)."""
    size = split_graph(backend)[0].partition("@")[2]
    return chunk_sizes(chunk_bytes=int(size.removesuffix("MiB")) << 20 if size else None)


@pytest.mark.parametrize("shape,backend", _crossover_backends(INFONCE_ALGORITHMS))
def test_infonce_crossover(timed, benchmark, shape: Shape, backend: str) -> None:
    """Forward + backward (gradient for ``pred``) of one algorithm (``algorithm=``), at one ``A``."""
    device = bench_device()
    algorithm, graphed = split_graph(backend)
    algorithm = algorithm.partition("@")[0]
    skip_unless_algorithm_runs(shape, algorithm, device)
    pred, embeds, targets = make_inputs(shape, device)
    pred.requires_grad_(True)

    def step() -> None:
        torch.autograd.grad(fused_loss(pred, embeds, targets, algorithm=algorithm), (pred,))

    benchmark.group = f"infonce-crossover {shape_id(shape)}"
    info = {"op": "infonce_crossover", "backend": backend, **shape._asdict(), "tau": TAU}
    cost = infonce_fwd_bwd_cost(shape.N, shape.D, shape.A, dtype=pred.dtype)
    with _chunks(backend):
        info.update(memory_info(shape, pred.dtype, "pred", algorithm))  # with the forced chunk size
        timed(step, device=device, info=info, cost=cost, dtype=pred.dtype, graphed=graphed)


@pytest.mark.parametrize("mode", ["argmax", "sample"])
@pytest.mark.parametrize("shape,algorithm", [
    pytest.param(shape, algorithm, id=f"{shape_id(shape)}-{algorithm}")
    for shape in CROSSOVER_SHAPES for algorithm in SELECT_ALGORITHMS
])  # fmt: skip
def test_select_crossover(timed, benchmark, shape: Shape, algorithm: str, mode: str) -> None:
    """One action per row by one selection algorithm (``algorithm=``), at one ``A``."""
    device = bench_device()
    skip_unless_algorithm_runs(shape, algorithm, device)
    pred, embeds, _ = make_inputs(shape, device)

    def step() -> None:
        with torch.no_grad():
            icrl_kernels.select_actions(pred, embeds, mode=mode, tau=TAU, algorithm=algorithm)

    benchmark.group = f"select-crossover {shape_id(shape)}-{mode}"
    info = {"op": "select_crossover", "backend": algorithm, **shape._asdict(), "mode": mode, "tau": TAU}
    cost = select_actions_cost(shape.N, shape.D, shape.A, dtype=pred.dtype)
    timed(step, device=device, info=info, cost=cost, dtype=pred.dtype)


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
