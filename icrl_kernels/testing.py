"""Test helpers shared by every op's parity tests (importable by downstream projects too)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from . import _library
from ._backend import triton_available, triton_interpreter_enabled

__all__ = [
    "RMS_TOLERANCE",
    "TESTED_DTYPES",
    "assert_close_rel",
    "fast_impls",
    "fast_paths",
    "forced_config",
    "poisoned_outputs",
    "relative_rms_error",
    "triton_devices",
]

#: Relative-RMS tolerance by input dtype (docs/testing.md#parity-with-the-reference).
RMS_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within the block, kernel outputs start as NaN (floats) / -1 (ints) instead of uninitialised memory."""
    previous = _library.set_output_poisoning(True)
    try:
        yield
    finally:
        _library.set_output_poisoning(previous)


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (``expected`` all zero: the absolute norm)."""
    actual64, expected64 = actual.detach().double(), expected.detach().double()
    diff = torch.linalg.vector_norm(actual64 - expected64).item()
    scale = torch.linalg.vector_norm(expected64).item()
    return diff / scale if scale > 0 else diff


def assert_close_rel(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rms_tol: float | None = None,
    max_abs_tol: float | None = None,
    name: str = "output",
) -> None:
    """Assert ``actual`` matches ``expected`` by relative RMS error and by max absolute error.

    Shapes must agree and ``actual`` must not contain NaN or inf where ``expected`` is finite.
    ``rms_tol`` defaults to :data:`RMS_TOLERANCE` of ``actual.dtype``; ``max_abs_tol`` defaults to
    ``50 * rms_tol * max(1, max|expected|)``, which catches a single badly wrong element that the RMS
    would average away.
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    finite = torch.isfinite(expected)
    bad = ~torch.isfinite(actual) & finite
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values (e.g. unwritten, NaN-poisoned elements)"
    if rms_tol is None:
        rms_tol = RMS_TOLERANCE[actual.dtype]
    err = relative_rms_error(actual, expected)
    assert err <= rms_tol, f"{name}: relative RMS error {err:.3e} > {rms_tol:.1e}"
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    if max_abs_tol is None:
        max_abs_tol = 50 * rms_tol * scale
    max_abs = (actual.detach().double() - expected.detach().double()).abs().max().item() if expected.numel() else 0.0
    assert max_abs <= max_abs_tol, f"{name}: max abs error {max_abs:.3e} > {max_abs_tol:.1e}"


def triton_devices() -> list[str]:
    """Devices on which the Triton path can run in this process: ``"cpu"`` when Triton's interpreter is on
    (``TRITON_INTERPRET=1``), ``"cuda"`` when a CUDA device is present.

    Plain strings, so that they can be nested in other parameters; the repository's ``conftest.py``
    marks every test that runs on ``"cuda"`` with ``gpu`` (``pytest -m gpu`` selects the CUDA tests).
    """
    devices: list[str] = []
    if triton_available() and triton_interpreter_enabled():
        devices.append("cpu")
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


#: The activation dtypes every kernel is tested in.
TESTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fast_paths() -> list:
    """``(backend, device)`` pytest parameters of an op's fast paths: the eager path on the CPU, then the
    Triton path on every device of :func:`triton_devices` (ids ``eager``, ``triton-cpu``, ``triton-cuda``)."""
    import pytest

    return [pytest.param("eager", "cpu", id="eager")] + [
        pytest.param("triton", device, id=f"triton-{device}") for device in triton_devices()
    ]


def fast_impls() -> list[str]:
    """The fast backends that can run in this process: ``["eager"]``, plus ``"triton"`` where Triton runs."""
    return ["eager"] + (["triton"] if triton_devices() else [])


# --- forcing one autotune config ------------------------------------------------------------------


@contextlib.contextmanager
def forced_config(kernel, config) -> Iterator[None]:
    """Within the block, the autotuned ``kernel`` launches with ``config`` only (no timing, no cached pick).

    Works on a GPU and under the interpreter, whose autotuner keeps only the first config: any config of
    :func:`icrl_kernels._triton.autotune_configs` can be forced. The kernel's configs and its tuning cache
    are restored afterwards, even if the block raises.
    """
    saved_configs, saved_cache = kernel.configs, dict(kernel.cache)
    kernel.configs = [config]  # a single config is launched as is (Autotuner.run skips the cache)
    kernel.cache.clear()
    try:
        yield
    finally:
        kernel.configs = saved_configs
        kernel.cache.clear()
        kernel.cache.update(saved_cache)


# --- compiled (non-interpreter) kernels without a GPU ---------------------------------------------
#
# The CPU interpreter accepts code the real compiler rejects (and the reverse), so every op's tests
# also compile its kernels for an H100 (sm_90) in a subprocess without ``TRITON_INTERPRET``:
#
#     reports = run_offline_compile("from icrl_kernels.testing import ...; compile_offline(jobs)")
#     check_offline_reports(reports, {"_my_forward_kernel", ...})
#
# Autotuned kernels are compiled in every config (:func:`config_jobs`): the autotuner may pick any of
# them on some GPU and shape, so a config that fails to compile or spills is a bug even if the
# interpreter's first config is fine.


def _unwrap_jit(kernel):
    """The ``JITFunction`` under ``triton.autotune`` / ``triton.heuristics`` wrappers."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _specialise(value) -> tuple[str, bool]:
    """``(type, divisible by 16)`` of a runtime argument, as a launch specialises it."""
    if isinstance(value, str):
        return value, value.startswith("*")  # fresh torch allocations are 16-byte aligned
    if isinstance(value, int) and not isinstance(value, bool):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"signature values are Triton type strings or sample ints/floats, got {value!r}")


def _specialisation(fn, signature: Mapping[str, object], constexprs: Mapping[str, object]) -> tuple[dict, dict, dict]:
    """``(types, constexprs, attrs)`` of an ``ASTSource`` for the ``JITFunction`` ``fn`` (see
    :func:`compile_for_gpu_offline`): what a launch with these arguments would compile."""
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    types, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name not in constexprs and name not in signature:
            raise KeyError(f"{fn.__name__}: no signature entry or constexpr for argument {name!r}")
        value = constexprs.get(name, signature.get(name))
        if name in constexprs or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            types[name], constexprs[name] = "constexpr", value
            continue
        types[name], divisible = _specialise(value)
        attrs[(index,)] = [["tt.divisibility", 16]] if divisible else []
    return types, constexprs, attrs


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread of the one kernel in ``cubin``, from ``cuobjdump -res-usage``."""
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK):(\d+)", text))
    return {"registers": int(usage["REG"]), "stack": int(usage["STACK"])}


def compile_for_gpu_offline(
    kernel, signature: Mapping[str, object], constexprs: Mapping[str, object], *, num_warps: int = 4,
    num_stages: int = 3, arch: int = 90,
) -> dict:  # fmt: skip
    """Compile a ``@triton.jit`` kernel to a CUDA cubin for compute capability ``arch``, no GPU needed.

    Runs the real compiler (TTIR -> TTGIR -> LLVM -> PTX -> ptxas, Triton's cache applies), which
    rejects code the interpreter accepts. Call it in a process *without* ``TRITON_INTERPRET`` (see
    :func:`run_offline_compile`): under the interpreter ``@triton.jit`` does not make a ``JITFunction``.

    ``kernel`` may be autotuned. ``signature`` maps every runtime argument to a Triton type string
    (``"*bf16"``, ``"i32"``; pointers count as 16-byte aligned, as fresh torch tensors are) or to a
    sample ``int`` / ``float`` specialised as a launch would: ``1`` becomes a constant, multiples of
    16 get the divisibility hint that lets loads vectorise. ``constexprs`` gives every ``tl.constexpr``.
    Names the kernel does not take are ignored (one pair of dicts can serve a forward and a backward).
    Returns ``{"name", "registers", "stack", "shared", "mma"}``: registers per thread and stack bytes per
    thread (register spills: Triton inlines every call) from the cubin, shared memory bytes per program, and
    the tensor-core instruction families of its dots (:func:`_mma_versions`: ``"v3"`` is Hopper's
    warpgroup ``wgmma``, ``"v2"`` the ``mma.sync`` of earlier GPUs, ``""`` no tensor-core dot).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _unwrap_jit(kernel)
    types, constexprs, attrs = _specialisation(fn, signature, constexprs)
    compiled = triton.compile(
        ASTSource(fn, types, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    return {"name": fn.__name__, **_resource_usage(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
            "mma": _mma_versions(compiled.asm["ttgir"])}  # fmt: skip


def _mma_versions(ttgir: str) -> str:
    """The tensor-core MMA versions a compiled kernel's dots use, from their layouts in its Triton GPU IR:
    e.g. ``"v3"`` (Hopper ``wgmma``: needs 64-row tiles per warpgroup) or ``"v2+v3"``; ``""`` for none."""
    versions = sorted(set(re.findall(r"#ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir)))
    return "+".join(f"v{version}" for version in versions)


class CompileJob(NamedTuple):
    """One :func:`compile_for_gpu_offline` call; ``info`` (dtype, shape, ...) is copied into its report."""

    kernel: object
    signature: Mapping[str, object]
    constexprs: Mapping[str, object]
    num_warps: int = 4
    num_stages: int = 3
    info: Mapping[str, object] = {}


def config_jobs(
    kernel, signature: Mapping[str, object], constexprs: Mapping[str, object], **info: object
) -> list[CompileJob]:
    """One :class:`CompileJob` per autotune config of ``kernel`` (its block sizes, warps and stages on top
    of ``constexprs``), each report naming its config as :func:`icrl_kernels._triton.config_name` does."""
    from ._triton import autotune_configs, config_name

    return [
        CompileJob(kernel, signature, {**constexprs, **config.kwargs}, config.num_warps, config.num_stages,
                   {"config": config_name(config), **info})
        for config in autotune_configs(kernel)
    ]  # fmt: skip


#: Jobs of :func:`compile_offline`, inherited by its forked workers (kernels do not pickle).
_JOBS: list[CompileJob] = []


def _compile_job(index: int) -> dict:
    job = _JOBS[index]
    report = compile_for_gpu_offline(
        job.kernel, job.signature, job.constexprs, num_warps=job.num_warps, num_stages=job.num_stages
    )
    return {"name": report["name"], **job.info, **{key: value for key, value in report.items() if key != "name"}}


def compile_offline(jobs: Sequence[CompileJob], *, processes: int | None = None) -> None:
    """Run :func:`compile_for_gpu_offline` for every job and print one JSON report a line, in job order (for
    :func:`run_offline_compile`). Jobs that would compile the same specialisation (e.g. two widths that
    are both multiples of 16) are compiled once; the others are spread over ``processes`` forked workers
    (default: one per CPU this process may use), since ptxas is single-threaded and a cold compile of a
    large tile takes seconds."""
    import json
    import multiprocessing

    keys = []
    for job in jobs:
        fn = _unwrap_jit(job.kernel)
        types, constexprs, attrs = _specialisation(fn, job.signature, job.constexprs)
        keys.append(repr((fn.__name__, types, sorted(constexprs.items()), attrs, job.num_warps, job.num_stages)))
    first = {key: index for index, key in reversed(list(enumerate(keys)))}  # key -> first job with it
    unique = sorted(set(first.values()))
    _JOBS[:] = jobs
    if processes is None:
        processes = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = max(1, min(processes, len(unique)))
    if processes > 1 and "fork" in multiprocessing.get_all_start_methods():
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            results = dict(zip(unique, pool.map(_compile_job, unique, chunksize=1)))
    else:
        results = {index: _compile_job(index) for index in unique}
    for job, key in zip(jobs, keys):
        report = results[first[key]]
        print(json.dumps({**report, **job.info}))  # a duplicate keeps its own info (its shape)


def offline_compilation_unavailable(arch: int = 90) -> str | None:
    """Why :func:`compile_for_gpu_offline` cannot work here (no NVIDIA backend or ptxas), or ``None``."""
    try:
        from triton import knobs
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource  # noqa: F401

        get_ptxas(arch)
        knobs.nvidia.cuobjdump  # noqa: B018  (raises where the tool is missing)
    except Exception as error:  # an older or CPU-only Triton, no bundled ptxas
        return f"{type(error).__name__}: {error}"
    return None


#: Report fields printed first, in this order; the rest follow (shapes, flags).
_REPORT_COLUMNS = ("name", "config", "dtype", "registers", "stack", "shared", "mma")


def run_offline_compile(code: str, *, arch: int = 90, timeout: float = 600) -> list[dict]:
    """Run ``code`` in a fresh Python without ``TRITON_INTERPRET`` and return the JSON objects it prints,
    one a line (e.g. :func:`compile_offline` reports); fail with its stderr if it fails. Skips the calling
    test, with the reason, where offline compilation is unavailable. One subprocess per test file keeps
    the import cost (a few seconds) to one. Each report is printed as a line of ``key=value`` (shown by
    ``pytest -s`` / ``-rP``): registers and stack (spill) bytes per thread, shared memory bytes per program."""
    import json

    import pytest

    reason = offline_compilation_unavailable(arch)
    if reason is not None:
        pytest.skip(f"offline compilation unavailable here: {reason}")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"offline compilation failed:\n{result.stderr[-4000:]}"
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for report in reports:
        keys = [key for key in _REPORT_COLUMNS if key in report] + [key for key in report if key not in _REPORT_COLUMNS]
        print(" ".join(f"{key}={report[key]}" for key in keys))
    return reports


#: Stack bytes per thread (register spills) above which an offline-compiled kernel fails its test. Every
#: config counts, since the autotuner may pick any of them: a spill of a few dozen bytes costs little
#: (ptxas keeps loop-invariant values there), hundreds mean the tile does not fit the register file.
MAX_SPILL_BYTES = 256


def check_offline_reports(reports: list[dict], kernels: set[str], *, max_spill_bytes: int = MAX_SPILL_BYTES) -> None:
    """Every kernel in ``kernels`` compiled, and no report (kernel x config x dtype) spills more than
    ``max_spill_bytes`` per thread."""
    assert {report["name"] for report in reports} == kernels, reports
    heavy = [report for report in reports if report["stack"] > max_spill_bytes]
    assert not heavy, f"register spills above {max_spill_bytes} bytes per thread: {heavy}"
