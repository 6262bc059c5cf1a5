"""Shared helpers for the op benchmarks (one ``bench_<op>.py`` per op).

Shape sets: every benchmark file declares a full set (the shapes DESIGN.md section 5 asks for) and a
tiny smoke set. The full set runs on CUDA, or anywhere when ``ICRL_BENCH_FULL=1``; otherwise the
smoke set runs, small enough that ``TRITON_INTERPRET=1 pytest benchmarks --benchmark-disable`` runs
every benchmark once in seconds on a laptop CPU (the Triton interpreter takes about half a second
per program per tile).

Timing: the :func:`fwd_bwd` fixture times ``forward + backward`` of one op and records, in
``benchmark.extra_info``, the shape, the device and library versions, the estimated bytes moved and
achieved bytes/s, and on CUDA the peak memory and the device's measured copy bandwidth, so that
``benchmarks/summarize.py`` can print time ratios and roofline fractions from the JSON alone.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

#: Wall time each timed benchmark aims for (seconds); rounds are chosen to fill it.
TARGET_SECONDS = float(os.environ.get("ICRL_BENCH_SECONDS", "1.0"))
MIN_ROUNDS = 3
MAX_ROUNDS = 200


def full_run() -> bool:
    """True when the full DESIGN.md shape sets should run: on CUDA, or when ``ICRL_BENCH_FULL=1``."""
    return torch.cuda.is_available() or os.environ.get("ICRL_BENCH_FULL", "0") == "1"


def select_shapes(full: Sequence[Any], smoke: Sequence[Any]) -> list[Any]:
    """The full shape set when :func:`full_run`, else the smoke set."""
    return list(full if full_run() else smoke)


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


@pytest.fixture(scope="session")
def copy_bandwidth() -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write counted) on CUDA, else ``None``.

    Measured here rather than taken from a data sheet so that the roofline fraction of every benchmark
    compares with what this device actually sustains in the same run.
    """
    if not torch.cuda.is_available():
        return None
    device = bench_device()
    src = torch.empty(256 * 2**20, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    repeats = 10
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    bandwidth = 2 * src.numel() * src.element_size() / seconds
    del src, dst
    torch.cuda.empty_cache()  # hand the 2 GiB back for the benchmarks' own inputs
    return bandwidth


def _choose_rounds(step: Callable[[], None], device: torch.device) -> int:
    """Rounds that fill about :data:`TARGET_SECONDS`, from one timed call after the warm-up."""
    start = time.perf_counter()
    step()
    _sync(device)
    seconds = time.perf_counter() - start
    return int(min(MAX_ROUNDS, max(MIN_ROUNDS, TARGET_SECONDS / max(seconds, 1e-9))))


@pytest.fixture
def timed(benchmark, copy_bandwidth):
    """Time ``step()`` (which must leave no pending work but CUDA kernels): the core of every benchmark.

    Returns ``run(step, *, device, info, bytes_moved, warmup=1)``. ``warmup`` untimed calls first
    (compilation, Triton autotuning, allocator growth), then one more to size the rounds to about
    ``ICRL_BENCH_SECONDS``. ``extra_info`` gets ``info``, the device and versions, ``bytes_moved`` (the
    minimum traffic of a fused implementation) and, when timed, achieved bytes/s and on CUDA the peak
    memory over the timed calls (inputs included), the copy bandwidth and the roofline fraction.
    """

    def run(step: Callable[[], Any], *, device: torch.device, info: dict, bytes_moved: int, warmup: int = 1):
        def call() -> None:
            step()
            _sync(device)

        benchmark.extra_info.update(info, device=device_name(device), bytes_moved=bytes_moved, **_versions())
        if benchmark.disabled:
            benchmark(call)  # --benchmark-disable: a smoke run that only checks the benchmark executes
            return
        for _ in range(warmup):
            call()
        rounds = _choose_rounds(call, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=0)
        median = benchmark.stats.stats.median
        benchmark.extra_info["bytes_per_second"] = bytes_moved / median
        if device.type == "cuda":
            benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            benchmark.extra_info["copy_bytes_per_second"] = copy_bandwidth
            benchmark.extra_info["roofline_fraction"] = bytes_moved / median / copy_bandwidth

    return run


@pytest.fixture
def fwd_bwd(timed):
    """Time ``forward + backward`` of ``fn(h)`` with a fixed upstream gradient.

    Returns ``run(fn, h, *, info, extra_bytes=0, warmup=1)`` where ``fn`` maps the leaf ``h``
    (``[B, L, D]``, ``requires_grad``) to an output of the same shape, and ``info`` holds the shape
    parameters to record (``B``, ``L``, ``D`` and anything op-specific such as ``backend``).

    One timed call is ``out = fn(h); torch.autograd.grad(out, h, grad_out)`` (see :func:`timed`). Bytes
    moved are estimated as the minimum traffic of a fused op: read ``h``, write ``out``, read
    ``grad_out``, write ``grad_h`` (``4 * B * L * D * itemsize``) plus ``extra_bytes`` (e.g. token ids).
    """

    def run(
        fn: Callable[[torch.Tensor], torch.Tensor],
        h: torch.Tensor,
        *,
        info: dict[str, Any],
        extra_bytes: int = 0,
        warmup: int = 1,
    ) -> None:
        grad_out = torch.randn_like(h)
        bytes_moved = 4 * h.numel() * h.element_size() + extra_bytes
        info = {**info, "shape": list(h.shape), "dtype": str(h.dtype).removeprefix("torch.")}
        timed(lambda: torch.autograd.grad(fn(h), h, grad_out), device=h.device, info=info, bytes_moved=bytes_moved,
              warmup=warmup)  # fmt: skip

    return run
