"""Tooling for the Triton kernels, kept out of the wheel (the tests, the benchmarks and ``gpu_check.py`` use it):
finding every autotuned kernel, recording the autotuner's choices, and compiling kernels for an H100
(sm_90) without a GPU, in every autotune config, with their register and spill reports.

Importable without Triton: the kernel modules and Triton's compiler are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import icrl_kernels

#: The repository root (``benchmarks`` is importable from it).
ROOT = Path(__file__).resolve().parents[1]


def autotuned_kernels() -> list:
    """Every kernel of the package declared with ``icrl_kernels._triton.autotune``.

    Kernel modules are imported lazily by the ops, so this first imports every ``icrl_kernels`` module
    whose name ends in ``kernels`` (``ngram.kernels``, ``ngram.tiled_kernels``, ...): a new autotuned
    kernel is found without being listed anywhere.
    """
    from icrl_kernels import _triton

    for module in pkgutil.walk_packages(icrl_kernels.__path__, prefix="icrl_kernels."):
        if module.name.rsplit(".", 1)[-1].endswith("kernels"):
            importlib.import_module(module.name)
    return _triton.imported_autotuned_kernels()


@contextlib.contextmanager
def recorded_autotuning(kernels: Sequence | None = None) -> Iterator[list[dict]]:
    """Within the block, record every autotuning of ``kernels`` (default: :func:`autotuned_kernels`).

    Yields a list that fills as the block runs, one entry per newly tuned key of a kernel::

        {"kernel": "infonce_grad_pred", "key": "(512, 4096, 17, 'torch.bfloat16', ...)",
         "best": "BLOCK_N64-BLOCK_D64-MAX_DO512-w8", "timings_ms": {config name: median ms, ...}}

    ``timings_ms`` holds every config the autotuner timed (``inf`` for one that failed to compile or ran out
    of resources), in the declared order, so a benchmark run on a GPU also says how far each config is from
    the best (the data to choose the configs and the interpreter's default, the first, from). Keys tuned
    before the block are not re-tuned, so they are not recorded; under the interpreter, whose autotuner
    keeps one config, nothing is tuned and the list stays empty. Each kernel's ``run`` is wrapped for the
    block only and restored afterwards, even if the block raises.
    """
    from icrl_kernels._triton import config_name, kernel_name

    records: list[dict] = []
    wrapped = list(autotuned_kernels() if kernels is None else kernels)

    def recording(kernel, run):
        def run_and_record(*args, **kwargs):
            before = set(kernel.cache)
            result = run(*args, **kwargs)
            timings = getattr(kernel, "configs_timings", None) or {}
            for key in set(kernel.cache) - before:  # one new key per call: the timings are its own
                records.append({
                    "kernel": kernel_name(kernel),
                    "key": str(key),
                    "best": config_name(kernel.cache[key]),
                    "timings_ms": {config_name(config): float(_median(times)) for config, times in timings.items()},
                })  # fmt: skip
            return result

        return run_and_record

    saved = [(kernel, kernel.__dict__.get("run")) for kernel in wrapped]
    for kernel in wrapped:
        kernel.run = recording(kernel, kernel.run)  # an instance attribute over the class's method
    try:
        yield records
    finally:
        for kernel, previous in saved:
            if previous is None:
                del kernel.run
            else:
                kernel.run = previous


def _median(times) -> float:
    """The autotuner's timing of a config: ``do_bench``'s quantiles ``[median, p20, p80]`` or one number."""
    return times[0] if isinstance(times, (list, tuple)) else times


# --- compiled (non-interpreter) kernels without a GPU ---------------------------------------------
#
# The CPU interpreter accepts code the real compiler rejects (and the reverse), so every op's tests
# also compile its kernels for an H100 (sm_90) in a subprocess without ``TRITON_INTERPRET``:
#
#     reports = run_offline_compile("from benchmarks.kernel_tools import ...; compile_offline(jobs)")
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
    from icrl_kernels._triton import autotune_configs, config_name

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
    # The repository first on the path: ``code`` imports ``benchmarks`` (this module) wherever pytest runs.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
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
