"""Shared helpers for the op benchmarks (one ``bench_<op>.py`` per op).

Shape sets: every benchmark file declares a full set (the shapes of docs/performance.md#targets) and a
tiny smoke set. The full set runs on CUDA, or anywhere when ``ICRL_BENCH_FULL=1``; otherwise the
smoke set runs, small enough that ``TRITON_INTERPRET=1 pytest benchmarks --benchmark-disable`` runs
every benchmark once in seconds on a laptop CPU (the Triton interpreter takes about half a second
per program per tile). In both sets one case per performance target carries the ``headline`` marker
(:func:`as_params`), so ``pytest benchmarks -m headline`` runs the cases behind the targets first.

Timing: the :func:`timed` fixture (and :func:`fwd_bwd` on top of it, for ``forward + backward``)
records, in ``benchmark.extra_info``, the shape, the device and library versions, the op's minimal
bytes and FLOPs from its cost model (``benchmarks/cost/<op>.py``), and on CUDA the peak memory,
the device's measured copy bandwidth and matmul peaks, and the roofline bound
``max(bytes / copy bandwidth, FLOPs / matmul peak)`` with the term that binds, so that
``benchmarks/summarize.py`` can print ratios, targets and roofline fractions from the JSON alone.

Profile (``ICRL_BENCH_PROFILE=1``, CUDA only): after the timed rounds, :data:`PROFILE_CALLS` more calls run
under ``torch.profiler`` and ``extra_info`` gets, per call, the device-busy seconds (the union of the
kernel and copy intervals), the launches and the five kernels that take longest, so that
``summarize.py`` can say whether a case is bound by its kernels or by the host (launch gaps, Python).

L2: inputs are not rotated between timed calls, so a case whose working set fits in the L2 cache
(50 MB on an H100) may read it from L2 rather than device memory and run faster than the copy
bandwidth allows. Rotating input sets would need per-op code and, for the large cases that the targets
are about, changes nothing; instead ``summarize.py`` shows a roofline fraction above 100% as
"L2-resident, not a roofline" and marks the cases whose bytes fit in the recorded ``l2_cache_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from icrl_kernels._backend import triton_available

from .cost import OpCost, roofline

#: Wall time each timed benchmark aims for (seconds); rounds are chosen to fill it.
TARGET_SECONDS = float(os.environ.get("ICRL_BENCH_SECONDS", "1.0"))
MIN_ROUNDS = 3
MAX_ROUNDS = 200

#: ``ICRL_BENCH_PROFILE=1``: profile :data:`PROFILE_CALLS` calls of every CUDA benchmark after timing it.
PROFILE = os.environ.get("ICRL_BENCH_PROFILE", "0") == "1"
PROFILE_CALLS = 5


def full_run() -> bool:
    """True when the full target shape sets should run: on CUDA, or when ``ICRL_BENCH_FULL=1``."""
    return torch.cuda.is_available() or os.environ.get("ICRL_BENCH_FULL", "0") == "1"


def select_shapes(full: Sequence[Any], smoke: Sequence[Any]) -> list[Any]:
    """The full shape set when :func:`full_run`, else the smoke set."""
    return list(full if full_run() else smoke)


def as_params(cases: Sequence[Any], *, headline: Sequence[Any] = (), ids: Callable[[Any], str] | None = None) -> list:
    """``cases`` as ``pytest.param`` values, the ones in ``headline`` marked ``pytest.mark.headline``.

    ``headline`` may list cases of both the full and the smoke set; only those in ``cases`` matter.
    Marking a shape marks every backend parametrised beside it, so the headline run has both sides of
    each ratio.
    """
    return [
        pytest.param(case, marks=[pytest.mark.headline] if case in headline else [], id=ids(case) if ids else None)
        for case in cases
    ]


def backend_params(
    shapes: Sequence[Any], backends: Sequence[str], *, headline: Sequence[tuple[Any, str]], ids: Callable[[Any], str]
) -> list:
    """``(shape, backend)`` pairs as ``pytest.param`` values (id ``<shape id>-<backend>``), the pairs in
    ``headline`` marked ``pytest.mark.headline``: for ops whose headline is one backend's roofline."""
    return [
        pytest.param(shape, backend, id=f"{ids(shape)}-{backend}",
                     marks=[pytest.mark.headline] if (shape, backend) in headline else [])
        for shape in shapes
        for backend in backends
    ]  # fmt: skip


def skip_unless_runnable(backend: str, device: torch.device, *, compile_here: bool = True) -> None:
    """``pytest.skip`` a benchmark that cannot run, or would not finish, here.

    A Triton backend (``"triton"``, ``"triton-..."``) where Triton cannot run, or at full sizes under the
    interpreter; ``"compile"`` on a CPU smoke run unless ``compile_here`` (an Inductor CPU compile takes
    seconds, so smoke runs compile one shape).
    """
    if backend.startswith("triton"):
        from icrl_kernels import resolve_backend

        try:
            resolve_backend("triton", device)
        except ValueError as error:
            pytest.skip(str(error))
        if device.type == "cpu" and full_run():
            pytest.skip("full-size shapes are far too slow for the Triton interpreter")
    if backend == "compile" and device.type == "cpu" and not full_run() and not compile_here:
        pytest.skip("an Inductor CPU compile takes seconds: one smoke shape is enough")


#: The backend-name suffix of a case that replays our call from a CUDA graph (``timed(..., graphed=True)``).
GRAPH_SUFFIX = "+graph"


def split_graph(backend: str) -> tuple[str, bool]:
    """``"triton+graph"`` -> ``("triton", True)``; ``"triton"`` -> ``("triton", False)``."""
    return backend.removesuffix(GRAPH_SUFFIX), backend.endswith(GRAPH_SUFFIX)


def graph_replay(step: Callable[[], Any], device: torch.device, warmup: int = 2) -> Callable[[], None]:
    """``step`` captured in one CUDA graph, as a function that replays it: the device work of a call without
    its host time (Python, argument checks, autograd bookkeeping, launches). ``warmup`` calls run first on a
    side stream (compiles, autotuning, the allocator), as PyTorch's capture recipe does."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def bench_device() -> torch.device:
    """The device the benchmarks measure: the first CUDA device if there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    # CUDA launches are asynchronous: without a sync the timer would only measure the launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)"


def _versions() -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # triton is Linux-only
        triton_version = "absent"
    return {"torch": torch.__version__, "triton": triton_version}


def median_seconds(fn: Callable[[], Any], device: torch.device, *, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls: each timed with CUDA events
    on a CUDA device, with the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_time = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_time)
    return sorted(times)[len(times) // 2]


@pytest.fixture(scope="session")
def copy_bandwidth() -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write counted) on CUDA, else ``None``.

    Measured here rather than taken from a data sheet so that the roofline of every benchmark compares
    with what this device actually sustains in the same run. The 1 GiB buffers are far larger than any
    L2 cache (50 MB on an H100), so this is device-memory bandwidth.
    """
    if not torch.cuda.is_available():
        return None
    bandwidth = copy_bytes_per_second(bench_device(), 2**30)
    torch.cuda.empty_cache()  # hand the 2 GiB back for the benchmarks' own inputs
    return bandwidth


def copy_bytes_per_second(device: torch.device, size: int) -> float:
    """Bytes read + written per second by a copy of ``size`` bytes on ``device`` (median of 10)."""
    src = torch.empty(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * size / median_seconds(lambda: dst.copy_(src), device, repeats=10)


#: Side of the square matmul that measures the device's peak (large enough to saturate an H100).
MATMUL_PEAK_SIZE = 8192


@pytest.fixture(scope="session")
def matmul_peak() -> dict[str, float] | None:
    """Measured matmul throughput in FLOP/s on CUDA, ``{"bfloat16": ..., "float32": ...}``, else ``None``.

    A ``8192^3`` matmul of random data (zeros would draw less power and clock higher), the median of
    10 calls timed with CUDA events after 3 warm-up calls. ``float32`` is measured with the process's
    TF32 setting (PyTorch's default: off, IEEE fp32), which is how the fp32 benchmarks run. Half-precision
    ops are bound by the bf16 figure, fp32 ops by the fp32 one (:func:`peak_for`).
    """
    if not torch.cuda.is_available():
        return None
    device = bench_device()
    peaks = {name: matmul_flops_per_second(device, getattr(torch, name)) for name in ("bfloat16", "float32")}
    torch.cuda.empty_cache()
    return peaks


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype, size: int = MATMUL_PEAK_SIZE) -> float:
    """FLOP/s of a ``size^3`` matmul of random ``dtype`` data on ``device`` (median of 10)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    out = torch.empty_like(a)
    return 2 * size**3 / median_seconds(lambda: torch.mm(a, b, out=out), device, repeats=10)


def peak_for(peaks: dict[str, float], dtype: torch.dtype | str) -> float:
    """The matmul peak that bounds an op computing in ``dtype``: the bf16 one for fp16/bf16, else fp32."""
    name = str(dtype).removeprefix("torch.")
    return peaks["bfloat16"] if name in ("bfloat16", "float16") else peaks["float32"]


def roofline_info(cost: OpCost, dtype: torch.dtype | str, copy_bytes_per_second: float, peaks: dict[str, float]):
    """``extra_info`` entries of the roofline bound of ``cost`` (see :func:`benchmarks.cost.roofline`)."""
    flops_per_second = peak_for(peaks, dtype)
    seconds, bound = roofline(cost, copy_bytes_per_second, flops_per_second)
    return {
        "copy_bytes_per_second": copy_bytes_per_second,
        "matmul_flops_per_second": peaks["bfloat16"],
        "matmul_flops_per_second_fp32": peaks["float32"],
        "roofline_flops_per_second": flops_per_second,
        "roofline_seconds": seconds,
        "roofline_bound": bound,
    }


def _l2_cache_bytes(device: torch.device) -> int | None:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)


def _choose_rounds(step: Callable[[], None], device: torch.device) -> int:
    """Rounds that fill about :data:`TARGET_SECONDS`, from one timed call after the warm-up."""
    start = time.perf_counter()
    step()
    _sync(device)
    seconds = time.perf_counter() - start
    return int(min(MAX_ROUNDS, max(MIN_ROUNDS, TARGET_SECONDS / max(seconds, 1e-9))))


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals given in microseconds, in seconds."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total * 1e-6


def device_profile(call: Callable[[], None], calls: int = PROFILE_CALLS) -> dict[str, Any]:
    """Where the time of ``call()`` (which ends with a device sync) goes on CUDA, per call over ``calls`` calls:
    ``device_busy_seconds`` (the union of the kernel and memcpy/memset intervals: device time with work),
    ``launches_per_call`` and ``top_kernels`` (``[name, seconds per call]``, the five longest by total time).

    A busy time far below the timed median means the device waits for the host (launch gaps, Python,
    syncs); close to it means the kernels themselves are the cost."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
    device_events = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, float] = {}
    for event in device_events:
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.time_range.elapsed_us() * 1e-6 / calls
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:5]
    return {
        "device_busy_seconds": _union_seconds([(e.time_range.start, e.time_range.end) for e in device_events]) / calls,
        "launches_per_call": len(device_events) / calls,
        "top_kernels": [[name[:100], seconds] for name, seconds in top],
    }


@pytest.fixture
def timed(benchmark, copy_bandwidth, matmul_peak):
    """Time ``step()`` (which must leave no pending work but CUDA kernels): the core of every benchmark.

    Returns ``run(step, *, device, info, cost, dtype, warmup=1, graphed=False)``. ``cost`` is the op's
    :class:`~benchmarks.cost.OpCost` (minimal bytes and FLOPs of a fused implementation, from its
    ``cost.py``) and ``dtype`` the dtype its math runs in (which matmul peak bounds it). ``warmup``
    untimed calls first (compilation, Triton autotuning, allocator growth), then one more to size the
    rounds to about ``ICRL_BENCH_SECONDS``. ``graphed``: after the warm-up, ``step`` is captured in a CUDA graph
    (:func:`graph_replay`) and each timed call replays it (CUDA only: skipped elsewhere); the backend of such a
    case ends in ``+graph`` (:data:`GRAPH_SUFFIX`), and ``summarize.py`` judges rooflines on it and reports the
    eager call minus the replay as host overhead.

    ``extra_info`` gets ``info``, the device and versions, ``bytes_moved`` and ``flops`` and, when timed,
    the achieved bytes/s and FLOP/s; on CUDA also the peak memory over the timed calls (inputs
    included), the copy bandwidth, both matmul peaks, the L2 size, the roofline bound in seconds
    (``roofline_seconds``), which term binds (``roofline_bound``: ``"bytes"`` or ``"flops"``) and
    ``roofline_fraction = roofline_seconds / median`` (1 is the hardware limit), and ``autotune``: every
    config the warm-up calls timed, per newly tuned kernel and key
    (:func:`benchmarks.kernel_tools.recorded_autotuning`).
    """

    def run(
        step: Callable[[], Any],
        *,
        device: torch.device,
        info: dict,
        cost: OpCost,
        dtype: torch.dtype | str,
        warmup: int = 1,
        graphed: bool = False,
    ) -> None:
        if graphed and device.type != "cuda":
            pytest.skip("CUDA graphs need a CUDA device")

        def call() -> None:
            step()
            _sync(device)

        benchmark.extra_info.update(info, device=device_name(device), device_type=device.type, **_versions())
        benchmark.extra_info.update(bytes_moved=cost.bytes, flops=cost.flops)
        if device.type == "cuda":
            benchmark.extra_info.update(roofline_info(cost, dtype, copy_bandwidth, matmul_peak))
            benchmark.extra_info["l2_cache_bytes"] = _l2_cache_bytes(device)
        if benchmark.disabled:
            benchmark(call)  # --benchmark-disable: a smoke run that only checks the benchmark executes
            return
        with _recorded_autotuning(device) as tuned:
            for _ in range(warmup):
                call()
        if tuned:
            benchmark.extra_info["autotune"] = tuned
        if graphed:
            replay = graph_replay(step, device)

            def call() -> None:
                replay()
                _sync(device)

        rounds = _choose_rounds(call, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=0)
        median = benchmark.stats.stats.median
        benchmark.extra_info["bytes_per_second"] = cost.bytes / median
        benchmark.extra_info["flops_per_second"] = cost.flops / median
        if device.type == "cuda":
            benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            benchmark.extra_info["roofline_fraction"] = benchmark.extra_info["roofline_seconds"] / median
            if PROFILE:
                try:
                    benchmark.extra_info.update(device_profile(call))
                except Exception as error:  # a profiler failure must not lose the timing
                    benchmark.extra_info["profile_error"] = f"{type(error).__name__}: {error}"[:300]

    return run


def _recorded_autotuning(device: torch.device):
    """On CUDA, :func:`benchmarks.kernel_tools.recorded_autotuning` (the timing of every config the warm-up
    calls tune); elsewhere, or without Triton, an empty list."""
    if device.type != "cuda" or not triton_available():
        return contextlib.nullcontext([])
    from .kernel_tools import recorded_autotuning

    return recorded_autotuning()


@pytest.fixture
def fwd_bwd(timed):
    """Time ``forward + backward`` of ``fn(h)`` with a fixed upstream gradient.

    Returns ``run(fn, h, *, info, cost, wrt=(), warmup=1, graphed=False)`` where ``fn`` maps the leaf ``h``
    (``requires_grad``) to an output of the same shape, ``info`` holds the shape parameters to record
    (``B``, ``L``, ``D`` and anything op-specific such as ``backend``), ``cost`` is the op's
    :class:`~benchmarks.cost.OpCost` for this shape and ``wrt`` more leaves to differentiate (e.g. a
    layer's parameters, as training does).

    One timed call is ``out = fn(h); torch.autograd.grad(out, (h, *wrt), grad_out)`` (see :func:`timed`;
    the roofline uses ``h.dtype``).
    """

    def run(
        fn: Callable[[torch.Tensor], torch.Tensor],
        h: torch.Tensor,
        *,
        info: dict[str, Any],
        cost: OpCost,
        wrt: Sequence[torch.Tensor] = (),
        warmup: int = 1,
        graphed: bool = False,
    ) -> None:
        grad_out = torch.randn_like(h)
        leaves = (h, *wrt)
        info = {**info, "shape": list(h.shape), "dtype": str(h.dtype).removeprefix("torch.")}
        timed(lambda: torch.autograd.grad(fn(h), leaves, grad_out), device=h.device, info=info, cost=cost,
              dtype=h.dtype, warmup=warmup, graphed=graphed)  # fmt: skip

    return run
