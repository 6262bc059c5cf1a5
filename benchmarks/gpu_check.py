"""Staged GPU check: everything the first CUDA session must measure, in stages that each fit one command.

GPU time comes rarely and in short commands (15 device-minutes a session, commands of at most 10, a
machine start of about 30 s), so every stage
is independent, writes its results into the output folder the moment it ends (a stage killed at its
time limit loses only itself) and stops itself after ``--timeout`` seconds (default 480: inside a 10-minute
command with room to copy the files back)::

    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages env,parity   # first command
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages memcheck:540  # compute-sanitizer, its own command
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages memcheck --sanitizer-parts racecheck
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages headline     # ~4-5 min on an H200
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages headline --headline-k "bench_looped or select"
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages configs
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages full-ngram,full-infonce
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --stages parity:240,train:160   # own limit per stage
    PYTHONPATH=. python3 benchmarks/gpu_check.py --list                     # stages, commands, estimates
    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT --dry-run             # CPU rehearsal of every stage

Stages (in order; ``--stages all`` runs them all):

========== ==============================================================================================
``env``    nvidia-smi, Python / torch / triton / CUDA versions, SMs and L2, and the two ceilings measured
           on the device: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul peak
``parity`` the CUDA tests (``pytest -m gpu tests``, one pytest-xdist worker per core up to 16 where
           installed; 232 s for 350 tests on an H200's 16 cores). Give it ~5 minutes
``memcheck`` compute-sanitizer over the edge-case tests of every kernel (``SANITIZER_PARTS``): memcheck in
           three parts (n-gram; contrastive; MoA, inject + LayerNorm, smeared keys, gated attention), then
           racecheck on one case of every kernel with a shared-memory reduction; each part one process,
           ``memcheck.json``/``.md`` rewritten as each ends; ``--sanitizer-parts`` runs some parts
``configs`` every autotune config of every kernel forced once against the reference
           (``tests/test_autotune_configs.py``); ``configs.md`` lists the gated-attention errors of every
           config, passing ones included, to show each one's margin to the tolerance
``headline`` one benchmark case per target (docs/performance.md) (``pytest -m headline``) and its summary table
``profile`` our headline cases again, each followed by 5 calls under ``torch.profiler``: device-busy time
           per call against the median (kernel- or host-bound), launches per call, the longest kernels
``ngram-crossover`` the tiled against the sort n-gram kernels over ``L`` (``TILED_MAX_LENGTH``'s data)
``infonce-crossover`` every InfoNCE and selection algorithm (``algorithm=``) over ``A`` = 125..10^6 (the
           thresholds of ``icrl_kernels/contrastive/algorithms.py``, and the new kernels' autotuning)
``train``  ``icrl-train`` on the device: the main job and N-Gram AD at width 512, fused kernels against
           ``--backend reference``: steps per second, and whether the loss falls
``paper-goals`` issue 19's GPU run: ``icrl-compare --preset goals-paper`` with one Table 1 draw per setting
           and seed, trials in worker processes sharing the GPU, until the stage's limit; what finished is
           reported (commit it as ``benchmarks/results/ngram-ad-goals-paper.*``) and reused next time
``full-*`` the remaining benchmarks (``-m "not headline"``), one slice per op so each fits a command
========== ==============================================================================================

Each stage writes ``<stage>.log`` (the full output), ``<stage>.json`` (what it measured: for benchmark
stages the pytest-benchmark JSON) and ``<stage>.md`` (a table), and updates ``stages.json`` (status,
seconds and exit code of every stage so far): at most 7 files for two stages, so two stages per command
come back whole where a command's files are capped at 8.

``--dry-run`` rehearses every stage on the CPU: Triton's interpreter (``TRITON_INTERPRET=1``), the
benchmarks' smoke shapes, the test selections collected in full and the sanitizer selection run without
the sanitizer. CI runs it, so a broken stage is caught before it costs GPU time.

Extra pure-Python packages (for example liger-kernel, the InfoNCE peer) on a machine with no network:
download the wheel beforehand (``pip download --no-deps liger-kernel -d wheels``), carry the folder and
pass ``--wheels wheels``: they are installed into a temporary folder put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as ``python benchmarks/gpu_check.py``: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

#: Default stage time limit: 8 minutes, inside a 10-minute device command.
DEFAULT_TIMEOUT = 480

#: Seconds between SIGINT (pytest then still writes its JSON and junit files) and SIGKILL at the time limit.
GRACE_SECONDS = 30


@dataclass(frozen=True)
class SanitizerPart:
    """One pytest process of the ``memcheck`` stage under compute-sanitizer's ``tool``: ``selection`` is
    ``(test file, -k expression)`` pairs (``{device}`` becomes ``cuda``, or ``cpu`` in a dry run)."""

    name: str
    tool: str
    selection: tuple[tuple[str, str], ...]
    kernels: str


#: The ``memcheck`` stage, part by part (each one process, its results written as it ends, so a stage stopped
#: at its limit keeps the parts that ran; ``--sanitizer-parts`` runs some of them). memcheck (out-of-bounds and
#: misaligned accesses, uninitialised reads of device memory) over the edge-case tests of every kernel: lengths
#: 1, 2 and just past a block, n > L, all padding, ragged tiles, one head or one available action, strided and
#: optional inputs. racecheck (shared-memory hazards) over one small case of every kernel with a reduction: no
#: kernel uses atomics (docs/conventions.md), but Triton's cross-warp reductions (sums, maxima, scans) go
#: through shared memory. Under the sanitizer each launch runs ~10-100x slower, so the selections stay small.
SANITIZER_PARTS = (
    SanitizerPart(
        "memcheck-ngram", "memcheck",
        (("tests/test_ngram_attention.py", "(edge_cases or row_without_match) and {device}"),
         ("tests/test_ngram_plan_kernels.py", "(rows_of_several_tiles or long_n) and {device}")),
        "n-gram forward/backward (sort and tiled) and plan kernels",
    ),
    SanitizerPart(
        "memcheck-contrastive", "memcheck",
        (("tests/test_contrastive_kernels.py",
          "(single_available_action or masked_actions_get_exactly or masked_actions_are_never_chosen "
          "or select_overflowing) and {device}"),
         ("tests/test_contrastive_algorithms.py",
          "(single_available_action or masked_actions_get_exactly or select_overflow) and {device}")),
        "InfoNCE forward, grad_pred, grad_embeds (fused, small, row and action chunks); select_actions",
    ),
    SanitizerPart(
        "memcheck-attention", "memcheck",
        (("tests/test_moa_kernels.py", "(strided_everything or single_head) and {device}"),
         ("tests/test_looped_kernels.py", "(optional_inputs or strided_inputs) and {device}"),
         ("tests/test_smeared_kernels.py", "strided and {device}"),
         ("tests/test_attention_kernels.py", "triton_lengths or triton_head_dim_not_a_power_of_two")),
        "mixture of heads, inject + LayerNorm, smeared keys, gated attention (forward, preprocess, dk/dv, dq)",
    ),
    SanitizerPart(
        "racecheck", "racecheck",
        (("tests/test_ngram_attention.py", "row_without_match and {device}"),
         ("tests/test_ngram_plan_kernels.py", "rows_of_several_tiles and vocab81 and {device}"),
         ("tests/test_contrastive_kernels.py",
          "((single_available_action and shared) or (masked_actions_are_never_chosen and argmax)) and {device}"),
         ("tests/test_contrastive_algorithms.py",
          "((single_available_action and shared) or (select_overflow and argmax)) and {device}"),
         ("tests/test_moa_kernels.py", "single_head and {device}"),
         ("tests/test_looped_kernels.py", "optional_inputs and y0 and {device}"),
         ("tests/test_smeared_kernels.py", "strided and {device}"),
         ("tests/test_attention_kernels.py", "triton_lengths and 65")),
        "one case of every kernel with a reduction",
    ),
)  # fmt: skip


def sanitizer_selection(part: SanitizerPart, device: str) -> list[str]:
    """pytest arguments selecting ``part`` in one run: its files, then one ``-k`` expression that ORs the
    files' expressions (a test matching another file's words is taken too)."""
    files = list(dict.fromkeys(path for path, _ in part.selection))
    words = " or ".join(f"({expression.format(device=device)})" for _, expression in part.selection)
    return [*files, "-k", words]


#: The benchmark slices of the ``full-*`` stages: ``(stage, files, -k expression or None)``.
FULL_SLICES = [
    ("full-ngram", ["benchmarks/bench_ngram_attention.py"], None),
    ("full-infonce", ["benchmarks/bench_infonce.py"], None),
    ("full-moa", ["benchmarks/bench_moa.py", "benchmarks/bench_dt_moa.py"], None),
    ("full-looped", ["benchmarks/bench_looped.py", "benchmarks/bench_inject_layer_norm.py"], None),
    ("full-smeared", ["benchmarks/bench_smeared_keys.py"], None),
    ("full-attention", ["benchmarks/bench_gated_attention.py"], None),
    ("full-models", ["benchmarks/bench_ad.py", "benchmarks/bench_generation.py", "benchmarks/bench_sweep.py"], None),
]


@dataclass
class Context:
    """Where a stage writes and how it runs its commands."""

    out: Path
    dry_run: bool
    timeout: float
    env: dict[str, str]
    deadline: float = 0.0
    record: dict = field(default_factory=dict)
    #: ``--headline-k``: a pytest ``-k`` expression narrowing the ``headline`` stage (None: every case).
    headline_k: str | None = None
    #: ``--cuda-graph``: the ``paper-goals`` stage's runs replay their training steps from CUDA graphs.
    cuda_graph: bool = False
    #: ``--parity-k``: a pytest ``-k`` expression narrowing the ``parity`` stage's CUDA suite (None: all of it).
    parity_k: str | None = None
    #: ``--sanitizer-parts``: the parts of :data:`SANITIZER_PARTS` the ``memcheck`` stage runs (None: all).
    sanitizer_parts: tuple[str, ...] | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def remaining(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def write(self, name: str, payload) -> None:
        """Write ``name`` under the output folder at once (JSON for dicts and lists, else text)."""
        text = json.dumps(payload, indent=1, default=str) if isinstance(payload, (dict, list)) else str(payload)
        (self.out / name).write_text(text)

    def run(self, command: list[str], log_name: str, *, env: dict[str, str] | None = None) -> int:
        """Run ``command`` from the repository root, appending its output to ``log_name``, within the stage's
        time left; at the limit pytest gets SIGINT first (it still writes its reports), then SIGKILL."""
        with open(self.out / log_name, "a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(
                command, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return process.wait(timeout=self.remaining())
            except subprocess.TimeoutExpired:
                log.write(f"\n[gpu_check] stage time limit ({self.timeout:.0f} s) reached: interrupting\n")
                log.flush()
                os.killpg(process.pid, signal.SIGINT)
                try:
                    process.wait(timeout=GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                return 124


# --- env ---------------------------------------------------------------------------------------------


def measure_ceilings(device: str, *, dry_run: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and matmul peaks (FLOP/s), measured on ``device``
    with the benchmarks' own functions (so ``env`` reports the ceilings every roofline is judged against).

    On CUDA: a 1 GiB copy (far beyond L2) and 8192^3 bf16 and fp32 products on random data (zeros run
    faster on Hopper than real data). In a dry run: 64 MiB and 256^3 on the CPU, only so the code runs."""
    import torch

    from benchmarks.conftest import MATMUL_PEAK_SIZE, copy_bytes_per_second, matmul_flops_per_second

    where = torch.device(device)
    copy_size, matmul_size = (2**26, 256) if dry_run else (2**30, MATMUL_PEAK_SIZE)
    facts = {
        "copy_bytes": copy_size,
        "copy_bytes_per_second": copy_bytes_per_second(where, copy_size),
        "matmul_size": matmul_size,
        **{f"matmul_{name}_flops_per_second": matmul_flops_per_second(where, getattr(torch, name), matmul_size)
           for name in ("bfloat16", "float32")},
    }  # fmt: skip
    if device == "cuda":
        torch.cuda.empty_cache()  # the stages after this one run in subprocesses: hand the memory back
    return facts


def _command_output(command: list[str]) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def stage_env(ctx: Context) -> tuple[str, dict]:
    import numpy
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    facts = {
        "commit": _command_output(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        "dirty": bool(_command_output(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "numpy": numpy.__version__,
        "cuda_runtime": torch.version.cuda,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {name: _package_version(name) for name in OPTIONAL_PACKAGES},
    }
    if ctx.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch (use --dry-run to rehearse on the CPU)")
        props = torch.cuda.get_device_properties(0)
        facts.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_bytes=props.total_memory,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            nvidia_smi=_command_output(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
                    "power.limit,temperature.gpu,ecc.mode.current,mig.mode.current",
                    "--format=csv",
                ]
            ),  # fmt: skip
            compute_sanitizer=shutil.which("compute-sanitizer") or _find_sanitizer(),
        )
    else:
        facts["device"] = platform.processor() or platform.machine()
    facts.update(measure_ceilings(ctx.device, dry_run=ctx.dry_run))
    lines = ["| fact | value |", "|---|---|"] + [
        f"| {key} | {value} |" for key, value in facts.items() if key not in ("packages", "nvidia_smi")
    ]
    lines += ["", f"- copy bandwidth: {facts['copy_bytes_per_second'] / 1e12:.3g} TB/s (read + write)"]
    lines += [f"- {name} matmul peak: {facts[f'matmul_{name}_flops_per_second'] / 1e12:.4g} TFLOP/s"
              for name in ("bfloat16", "float32")]  # fmt: skip
    if facts.get("nvidia_smi"):
        lines += ["", "```", facts["nvidia_smi"], "```"]
    ctx.write("env.json", facts)
    ctx.write("env.md", "# Environment\n\n" + "\n".join(lines) + "\n")
    return "passed", {"device": facts["device"], "copy_TBps": facts["copy_bytes_per_second"] / 1e12,
                      "bf16_matmul_TFLOPs": facts["matmul_bfloat16_flops_per_second"] / 1e12}  # fmt: skip


#: Optional packages whose presence changes what runs (peers, skipped tests): recorded by ``env``.
OPTIONAL_PACKAGES = ("gymnasium", "hypothesis", "safetensors", "liger_kernel", "xdist", "pytest_benchmark")


def _package_version(name: str) -> str | None:
    from importlib import import_module

    try:
        module = import_module(name)
    except ImportError:
        return None
    return getattr(module, "__version__", "present")


def _find_sanitizer() -> str | None:
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/cuda/bin/compute-sanitizer"):
        if Path(candidate).exists():
            return candidate
    return None


# --- pytest stages -----------------------------------------------------------------------------------


#: pyproject's addopts leave out the tests marked slow; the GPU runner runs every tier (a stage's own ``-m``,
#: later on the command line, replaces this one).
EVERY_TIER = ["-m", "slow or not slow"]


def _pytest(ctx: Context, args: list[str], log_name: str, junit: Path | None = None, **kwargs) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *EVERY_TIER, *args]
    if junit is not None:
        command.append(f"--junitxml={junit}")
    return ctx.run(command, log_name, **kwargs)


def _junit_counts(path: Path) -> dict:
    """Counts and the failing test ids from a junit XML file (empty when pytest never wrote it)."""
    if not path.exists():
        return {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {
        key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    failed = []
    for case in (case for suite in suites for case in suite.iter("testcase")):
        # An Element without children is falsy, so test against None rather than with ``or``.
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}: {problem.get('message', '')[:300]}")
    return {**counts, "failed": failed}


def _captured_lines(path: Path, marker: str) -> dict[str, list[str]]:
    """Test id -> the lines of its captured stdout that contain ``marker``, from a junit XML file written with
    ``-o junit_logging=system-out`` (passing tests included; empty when pytest never wrote the file)."""
    if not path.exists():
        return {}
    root = ElementTree.parse(path).getroot()
    lines = {}
    for case in root.iter("testcase"):
        output = case.find("system-out")
        text = output.text if output is not None else None
        kept = [line.strip() for line in (text or "").splitlines() if marker in line]
        if kept:
            lines[f"{case.get('classname')}::{case.get('name')}"] = kept
    return lines


def _status(code: int) -> str:
    return {0: "passed", 124: "timed out", 5: "selected no test"}.get(code, "failed")


def _has_xdist() -> bool:
    from importlib.util import find_spec

    return find_spec("xdist") is not None


def stage_parity(ctx: Context) -> tuple[str, dict]:
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "parity.xml"
        if ctx.dry_run:
            # The whole suite already runs in CI; here only check that the selection collects.
            code = _pytest(ctx, ["--collect-only", "tests"], "parity.log")
            collected = re.findall(r"(\d+) tests? collected", (ctx.out / "parity.log").read_text())
            results["suite"] = {"exit": code, **_junit_counts(junit), "tests": int(collected[-1]) if collected else 0}
        else:
            # The CUDA tests only (marked ``gpu``): the CPU suite is CI's. Their cost is Triton compiles,
            # which are CPU-bound, so one xdist worker per core (up to 16).
            workers = min(16, len(os.sched_getaffinity(0)))
            xdist = ["-n", str(workers)] if _has_xdist() and workers > 1 else []
            narrow = ["-k", ctx.parity_k] if ctx.parity_k else []
            code = _pytest(ctx, [*xdist, "-m", "gpu", *narrow, "tests"], "parity.log", junit)
            results["suite"] = {"exit": code, **_junit_counts(junit), "k": ctx.parity_k}
    ctx.write("parity.json", results)
    lines = ["# Parity", "", "| run | exit | tests | failed | errors | skipped |", "|---|---|---|---|---|---|"]
    lines.append(_count_row("suite", results["suite"]))
    failed = results["suite"]["failed"]
    lines += ["", "(compute-sanitizer runs in its own stage, memcheck)", ""] + [f"- FAILED {name}" for name in failed]
    ctx.write("parity.md", "\n".join(lines) + "\n")
    return _status(results["suite"]["exit"]), {"failed": len(failed), "tests": results["suite"]["tests"]}


#: compute-sanitizer's closing lines: memcheck's ``ERROR SUMMARY: N errors``, racecheck's ``RACECHECK SUMMARY:
#: N hazards displayed (E errors, W warnings)``.
_SANITIZER_SUMMARY = re.compile(
    r"(?:ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?)"
)


def sanitizer_errors(log_text: str) -> int | None:
    """The errors compute-sanitizer reported in ``log_text`` (summed over its summary lines; None if none)."""
    counts = [int(memcheck or racecheck) for memcheck, racecheck in _SANITIZER_SUMMARY.findall(log_text)]
    return sum(counts) if counts else None


def stage_memcheck(ctx: Context) -> tuple[str, dict]:
    """compute-sanitizer over the edge-case tests of every kernel, part by part (:data:`SANITIZER_PARTS`):
    memcheck, then racecheck for the kernels whose reductions use shared memory. Each part is one pytest
    process under the sanitizer (CUDA and torch start-up alone take tens of seconds there), run with
    ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that an access past a tensor is past its allocation too (inside
    the caching allocator's blocks memcheck sees nothing); ``memcheck.json``/``.md`` are rewritten as each
    part ends. A dry run runs the same selections without the sanitizer, under the interpreter."""
    sanitizer = None if ctx.dry_run else (shutil.which("compute-sanitizer") or _find_sanitizer())
    if not ctx.dry_run and sanitizer is None:
        raise RuntimeError("compute-sanitizer not found (on PATH, /usr/local/cuda/bin or /opt/cuda/bin)")
    parts = [part for part in SANITIZER_PARTS if ctx.sanitizer_parts is None or part.name in ctx.sanitizer_parts]
    env = {**ctx.env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    log = ctx.out / "memcheck.log"
    runs: list[dict] = []
    for part in parts:
        if time.monotonic() >= ctx.deadline:
            runs.append({"part": part.name, "tool": part.tool, "status": "not run (stage time limit)"})
            continue
        selection = sanitizer_selection(part, ctx.device)
        start = log.stat().st_size if log.exists() else 0
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "part.xml"
            pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *EVERY_TIER,
                      f"--junitxml={junit}"]  # fmt: skip
            prefix = [sanitizer, "--tool", part.tool, "--error-exitcode", "99", "--target-processes", "all"]
            code = ctx.run([*(prefix if sanitizer else []), *pytest, *selection], "memcheck.log", env=env)
            counts = _junit_counts(junit)
        with open(log, encoding="utf-8", errors="replace") as file:
            file.seek(start)
            errors = sanitizer_errors(file.read())
        clean = code == 0 and (errors == 0 or (ctx.dry_run and errors is None)) and counts["tests"] > 0
        runs.append({"part": part.name, "tool": part.tool, "kernels": part.kernels, "exit": code,
                     "sanitizer_errors": errors, "status": "passed" if clean else _status(code) if code else "failed",
                     "selection": " ".join(selection), **counts})  # fmt: skip
        _write_memcheck(ctx, sanitizer, runs)
    _write_memcheck(ctx, sanitizer, runs)
    statuses = [run["status"] for run in runs]
    status = "passed" if all(s == "passed" for s in statuses) else "timed out" if any(
        s in ("timed out", "not run (stage time limit)") for s in statuses) else "failed"  # fmt: skip
    return status, {"parts": {run["part"]: run["status"] for run in runs},
                    "sanitizer_errors": sum(run.get("sanitizer_errors") or 0 for run in runs)}  # fmt: skip


def _write_memcheck(ctx: Context, sanitizer: str | None, runs: list[dict]) -> None:
    """``memcheck.json`` and ``memcheck.md`` of the parts run so far."""
    ctx.write("memcheck.json", {"sanitizer": sanitizer or "not run (dry run)", "parts": runs})
    lines = ["# compute-sanitizer", "", f"sanitizer: {sanitizer or 'not run (dry run: the selections only)'}", "",
             "| part | tool | status | sanitizer errors | exit | tests | failed | errors | skipped |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        cells = [run["part"], run["tool"], run["status"], run.get("sanitizer_errors", "-"),
                 *(run.get(key, "-") for key in ("exit", "tests", "failures", "errors", "skipped"))]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += [""] + [f"- {run['part']}: {run['kernels']}" for run in runs if "kernels" in run]
    lines += [f"- FAILED {name}" for run in runs for name in run.get("failed", [])]
    ctx.write("memcheck.md", "\n".join(lines) + "\n")


def _count_row(name: str, counts: dict) -> str:
    cells = [name, counts["exit"], counts["tests"], counts["failures"], counts["errors"], counts["skipped"]]
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def stage_configs(ctx: Context) -> tuple[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "configs.xml"
        # The checks print each output's and gradient's error; the junit report keeps them for passing
        # configs too, so a tolerance can be judged by its margin, not only by the configs that cross it.
        args = ["tests/test_autotune_configs.py", "-k", ctx.device, "-o", "junit_logging=system-out"]
        code = _pytest(ctx, args, "configs.log", junit)
        counts = {
            "exit": code,
            **_junit_counts(junit),
            "rms_errors_by_test": _captured_lines(junit, "relative RMS error"),
        }
    ctx.write("configs.json", counts)
    lines = ["# Every autotune config forced once", "", "| run | exit | tests | failed | errors | skipped |",
             "|---|---|---|---|---|---|", _count_row("configs", counts), ""]  # fmt: skip
    lines += [f"- FAILED {name}" for name in counts["failed"]]
    for test, errors in counts["rms_errors_by_test"].items():
        lines += ["", f"{test}:", *(f"- {error}" for error in errors)]
    ctx.write("configs.md", "\n".join(lines) + "\n")
    return _status(code), {"tests": counts["tests"], "failed": len(counts["failed"])}


def _benchmark_stage(ctx: Context, name: str, args: list[str], extra_env: dict | None = None) -> tuple[str, dict]:
    """Run benchmarks into ``<name>.json`` and summarise them into ``<name>.md``."""
    json_path = ctx.out / f"{name}.json"
    env = {**ctx.env, **(extra_env or {})}
    if ctx.dry_run:
        env["ICRL_BENCH_SECONDS"] = "0.001"  # time three rounds: enough to exercise the JSON and summary
    code = _pytest(ctx, [*args, f"--benchmark-json={json_path}"], f"{name}.log", env=env)
    summary = {}
    if json_path.exists():
        from benchmarks import summarize

        ctx.write(f"{name}.md", summarize.summarize(json_path))
        summary["benchmarks"] = len(json.loads(json_path.read_text())["benchmarks"])
    return _status(code), summary


def headline_files() -> list[str]:
    """Our kernels' files first (:data:`PROFILE_FILES`: their predictions wait for a GPU), then every other
    ``benchmarks/bench_*.py`` in name order. pytest runs files in this order, and a stage stopped at its
    limit keeps the cases that ran."""
    others = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks").glob("bench_*.py")
        if str(path.relative_to(ROOT)) not in PROFILE_FILES
    )  # fmt: skip
    return [*PROFILE_FILES, *others]


def stage_headline(ctx: Context) -> tuple[str, dict]:
    """One benchmark case per target; ``--headline-k`` narrows it, e.g. to the cases an earlier session's
    stage did not reach (``-k`` also matches file names: ``"bench_looped or bench_ad"``)."""
    narrow = ["-k", ctx.headline_k] if ctx.headline_k else []
    return _benchmark_stage(ctx, "headline", [*headline_files(), "-m", "headline", *narrow])


#: The headline cases of our own kernels, and of the peers named by a target that the headline stage could not
#: measure or that bound ours (Liger where installed, the ungated SDPA layer MoA is judged against), by id words.
PROFILE_SELECTION = (
    "sort or fused or mixture or inject or smeared_keys or liger or (moa_attention and (triton or ungated))"
)


#: The profile stage's files, quickest and most asked-about first (a stage stopped at its limit keeps what ran:
#: on an H200 the InfoNCE and looped files alone took 150 s, the A = 1M cases ~1 s a call).
PROFILE_FILES = [
    "benchmarks/bench_ngram_attention.py",
    "benchmarks/bench_moa.py",
    "benchmarks/bench_smeared_keys.py",
    "benchmarks/bench_inject_layer_norm.py",
    "benchmarks/bench_infonce.py",
    "benchmarks/bench_looped.py",
]


def stage_profile(ctx: Context) -> tuple[str, dict]:
    """Our headline cases again, each followed by a few calls under ``torch.profiler`` (``ICRL_BENCH_PROFILE``):
    device-busy time per call against the median, launches, longest kernels (the "where the time goes" table)."""
    args = [*PROFILE_FILES, "-m", "headline", "-k", PROFILE_SELECTION]
    return _benchmark_stage(ctx, "profile", args, extra_env={"ICRL_BENCH_PROFILE": "1"})


def stage_ngram_crossover(ctx: Context) -> tuple[str, dict]:
    """The tiled against the sort n-gram kernels over ``L`` (fp32 and bf16): ``TILED_MAX_LENGTH``'s data."""
    return _benchmark_stage(ctx, "ngram-crossover", ["benchmarks/bench_ngram_attention.py", "-k", "tiled_crossover"])


def stage_infonce_crossover(ctx: Context) -> tuple[str, dict]:
    """Every InfoNCE and selection algorithm (``algorithm=``) over ``A`` (bf16, N 65536, D 512): the data of the
    thresholds in ``icrl_kernels/contrastive/algorithms.py`` (benchmarks/results/README.md: what to read from it)."""
    return _benchmark_stage(ctx, "infonce-crossover", ["benchmarks/bench_infonce.py", "-k", "crossover"])


#: The training runs of the ``train`` stage, each in every :data:`TRAIN_MODES`: ``(name, model and task flags,
#: size flags)`` (the dry run replaces the size flags by a tiny size). The main job (N-Gram AD, width 64),
#: N-Gram AD at the paper's width 512, and Headless-AD on bandits.
TRAIN_RUNS = [
    ("main-job", [], []),
    ("ngram-ad-512", [], ["--d-model", "512", "--num-heads", "8", "--seq-len", "250", "--batch-size", "64"]),
    ("headless-ad", ["--model", "headless_ad", "--env", "bernoulli_bandit"], []),
]
#: ``(mode, icrl-train flags)``: the fused kernels, the same with each step replayed from a CUDA graph, and
#: the plain-PyTorch reference. (The dry run on the CPU replaces ``auto`` by ``eager``; ``--cuda-graph``
#: is then ignored, so that run checks the plumbing only.)
TRAIN_MODES = [
    ("auto", ["--backend", "auto", "--cuda-graph", "off"]),
    ("auto+graph", ["--backend", "auto", "--cuda-graph", "on"]),
    ("reference", ["--backend", "reference", "--cuda-graph", "off"]),
]


def _loss_trend(metrics_path: Path) -> dict:
    """Steps per second (median of the logged rows after the first) and the loss at the start and the end
    (means of the first and last five logged rows) of one run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "loss" in row]
    if not rows:
        return {"rows": 0}
    speeds = sorted(row["steps_per_second"] for row in rows[1:]) or [rows[0]["steps_per_second"]]
    first = sum(row["loss"] for row in rows[:5]) / len(rows[:5])
    last = sum(row["loss"] for row in rows[-5:]) / len(rows[-5:])
    return {"rows": len(rows), "steps_per_second": speeds[len(speeds) // 2], "loss_first": first,
            "loss_last": last, "loss_falls": last < first}  # fmt: skip


def stage_train(ctx: Context) -> tuple[str, dict]:
    """A few hundred steps of ``icrl-train`` per run of :data:`TRAIN_RUNS` on the device (bf16 autocast on
    CUDA), with the fused kernels and with ``--backend reference``: steps per second, and that the loss falls."""
    steps, histories, episodes = (4, 4, 10) if ctx.dry_run else (400, 200, 100)
    runs_dir = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    common = ["--steps", str(steps), "--num-histories", str(histories), "--source-episodes", str(episodes),
              "--log-every", "1" if ctx.dry_run else "20", "--checkpoint-every", str(10 * steps), "--eval-tasks", "2",
              "--eval-episodes", "2", "--eval-envs-per-task", "1", "--device", ctx.device, "--no-progress"]  # fmt: skip
    results, codes = [], []
    for name, task_flags, size_flags in TRAIN_RUNS:
        # The dry run checks the plumbing only: interpreted kernels at width 512 would take many minutes.
        flags = [*task_flags, *(["--seq-len", "20", "--batch-size", "4"] if ctx.dry_run else size_flags)]
        data = None  # the first mode's run generates the histories; the others read them
        for mode, mode_flags in TRAIN_MODES:
            if ctx.dry_run:
                mode_flags = [("eager" if flag == "auto" else flag) for flag in mode_flags]
            run_dir = runs_dir / f"{name}-{mode}"
            reuse = ["--data", str(data)] if data is not None and data.exists() else []
            command = [sys.executable, "-m", "icrl_models.train", *common, *flags, *mode_flags, *reuse,
                       "--out-dir", str(run_dir)]  # fmt: skip
            code = ctx.run(command, "train.log")
            codes.append(code)
            data = data or run_dir / "train.icrl"
            metrics = run_dir / "metrics.jsonl"
            trend = _loss_trend(metrics) if metrics.exists() else {"rows": 0}
            results.append({"run": name, "mode": mode, "flags": [*flags, *mode_flags], "exit": code, **trend})
            ctx.write("train.json", results)  # after every run: a stage stopped at its limit keeps the rest
    lines = ["# Training runs (icrl-train)", "", f"{steps} steps each; loss: mean of the first / last 5 logged rows",
             "", "| run | mode | exit | steps/s | loss first | loss last | falls |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        cells = [r["run"], r["mode"], r["exit"], *(f"{r[k]:.3g}" if k in r else "-" for k in
                 ("steps_per_second", "loss_first", "loss_last")), r.get("loss_falls", "-")]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    ctx.write("train.md", "\n".join(lines) + "\n")
    status = "timed out" if 124 in codes else "passed" if all(code == 0 for code in codes) else "failed"
    return status, {"runs": len(results)}


#: Where the ``paper-goals`` stage's results are committed; a later session's stage reads them back
#: (``--reuse-results``), so the slice grows across GPU sessions instead of starting again.
PAPER_GOALS_RESULTS = ROOT / "benchmarks" / "results" / "ngram-ad-goals-paper.json"
#: Trials at a time in the ``paper-goals`` stage, one torch thread each, all on the one GPU. A guess for a
#: 16-core machine (each run was host-bound at width 64 on an H200: 81 steps per second alone), to be tuned.
PAPER_GOALS_WORKERS = 8
#: Seconds of the stage kept for the ``--report-only`` pass after the sweep is stopped at its limit.
PAPER_GOALS_REPORT_SECONDS = 45


def stage_paper_goals(ctx: Context) -> tuple[str, dict]:
    """The N-Gram AD paper preset (``icrl-compare --preset goals-paper``: 10k steps a run, every held-out
    goal) with one Table 1 draw per setting and seed (the first of the preset's 500: 3 settings x 3 seeds x 2
    models = 18 runs), trials in worker processes on the GPU, trials already in :data:`PAPER_GOALS_RESULTS`
    reused. At the stage's limit the sweep is stopped and a ``--report-only`` pass writes what finished
    (``paper-goals.{json,md,png}``: commit them as ``benchmarks/results/ngram-ad-goals-paper.*``)."""
    runs_dir = Path(tempfile.mkdtemp(prefix="gpu_check_paper_goals_"))
    workers = 2 if ctx.dry_run else PAPER_GOALS_WORKERS
    flags = ["--preset", "goals-paper", "--runs", "1", "--scheduler", "processes", "--trial-cpus", "1",
             "--workers", str(workers), "--out-dir", str(runs_dir), "--no-progress"]  # fmt: skip
    if ctx.dry_run:  # the plumbing only: one setting and seed, a tiny model, two worker processes
        flags += ["--num-train-tasks", "10", "--seeds", "0", "--steps", "2", "--num-histories", "6",
                  "--source-episodes", "20", "--eval-tasks", "2", "--eval-episodes", "2", "--eval-envs-per-task",
                  "1", "--d-model", "16", "--num-heads", "2", "--num-layers", "1", "--batch-size", "4",
                  "--backend", "eager"]  # fmt: skip
    elif PAPER_GOALS_RESULTS.exists():
        flags += ["--reuse-results", str(PAPER_GOALS_RESULTS)]
    # Not part of a trial's identity: reused trials stay valid. Without the flag the runs train eagerly
    # (icrl-compare's default, --cuda-graph auto, would graph them on CUDA).
    flags += ["--cuda-graph", "on" if ctx.cuda_graph else "off"]
    command = [sys.executable, "-m", "icrl_models.experiments.ngram_ad", *flags]
    sweep = dataclasses.replace(ctx, deadline=ctx.deadline - PAPER_GOALS_REPORT_SECONDS)
    code = sweep.run(command, "paper-goals.log")
    if code != 0:  # stopped at its limit (or failed): report the runs that finished
        ctx.run([*command, "--report-only"], "paper-goals.log")
    copied = []
    for suffix in ("json", "md", "png"):
        result = runs_dir / f"ngram-ad-goals.{suffix}"
        if result.exists():
            shutil.copyfile(result, ctx.out / f"paper-goals.{suffix}")
            copied.append(suffix)
    details = {"exit": code, "files": copied}
    if "json" in copied:
        trials = json.loads((runs_dir / "ngram-ad-goals.json").read_text())["trials"]
        details["trials"] = dict(sorted(Counter(trial["status"] for trial in trials).items()))
    return _status(code), details


def _full_stage(name: str, files: list[str], expression: str | None) -> Callable[[Context], tuple[str, dict]]:
    def stage(ctx: Context) -> tuple[str, dict]:
        args = [*files, "-m", "not headline"] + (["-k", expression] if expression else [])
        return _benchmark_stage(ctx, name, args)

    return stage


STAGES: dict[str, tuple[Callable[[Context], tuple[str, dict]], str]] = {
    "env": (stage_env, "~1 min: versions, nvidia-smi, a 1 GiB copy and an 8192^3 bf16 matmul, 10 each"),
    "parity": (stage_parity, "~4-5 min (measured on an H200: the ~350 CUDA tests (-m gpu) in 232 s, 16 xdist "
               "workers, their cost mostly Triton compiles)"),
    "memcheck": (stage_memcheck, "~5-8 min (estimate; never run to the end: the 34 edge tests of the parity stage's "
                 "former memcheck took ~45 s in one process): compute-sanitizer memcheck over the edge cases of "
                 "every kernel in 3 parts, then racecheck, each part one process; --sanitizer-parts runs some"),
    "configs": (stage_configs, "~2-4 min (estimate): one compile (~1-2 s) + one fwd/bwd per config of every "
                "autotuned kernel"),
    "headline": (stage_headline, "~4-5 min (measured on an H200: 36 cases in 166 s, then 24 in 106 s): ~1 s "
                 "of timed calls per case plus autotuning and torch.compile/FlexAttention compiles"),
    "profile": (stage_profile, "~1-2 min (estimate): our headline cases (~20) timed again, then 5 calls each "
                "under torch.profiler: device-busy time against the median, launches, longest kernels"),
    "ngram-crossover": (stage_ngram_crossover, "~1-2 min (estimate): tiled vs sort n-gram kernels over L, "
                        "fp32 and bf16 (TILED_MAX_LENGTH)"),
    "infonce-crossover": (stage_infonce_crossover, "~4-6 min (estimate): 34 InfoNCE cases (forward + backward, the "
                          "algorithms at 8 action counts, graph replays up to A = 16384, 3 more chunk sizes at "
                          "A = 4096) and 36 selection cases; the fused kernels at A = 10^6 take ~1 s a call"),
    "train": (stage_train, "~5-8 min (estimate): 400 steps of icrl-train, the main job, N-Gram AD at width 512 and "
              "Headless-AD, each with the fused kernels, the same replayed from a CUDA graph (--cuda-graph), and "
              "--backend reference, after 200 histories per environment are generated"),
    "paper-goals": (stage_paper_goals, "up to its limit: icrl-compare --preset goals-paper --runs 1 (18 runs of 10k "
                    f"steps, {PAPER_GOALS_WORKERS} at a time on the GPU); stopped at the limit, finished runs "
                    "reported and reused by the next session (no estimate: never run)"),
    **{name: (_full_stage(name, files, expression), "up to 8 min: stopped at --timeout, results kept")
       for name, files, expression in FULL_SLICES},
}  # fmt: skip


def base_env(dry_run: bool, wheels: Path | None) -> dict[str, str]:
    """The environment the stages' subprocesses run in: the checkout first on ``PYTHONPATH``; the
    interpreter on in a dry run and off otherwise; ``--wheels`` installed into a temporary folder."""
    # A pytest-xdist worker's variables would make the stages' own pytest runs believe they are workers too
    # (pytest-benchmark then disables itself and writes no results): the stages start fresh sessions.
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST_")}
    paths = [str(ROOT)]
    if wheels is not None:
        target = Path(tempfile.mkdtemp(prefix="gpu_check_wheels_"))
        found = sorted(str(path) for path in wheels.glob("*.whl"))
        if not found:
            raise SystemExit(f"gpu_check: --wheels {wheels}: no .whl files there")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(target), *found], check=True)  # fmt: skip
        paths.insert(0, str(target))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.pop("TRITON_INTERPRET", None)
        env.pop("ICRL_BENCH_FULL", None)
    return env


def parse_stages(text: str, default_timeout: float = DEFAULT_TIMEOUT) -> list[tuple[str, float]]:
    """``"env,parity:250"`` -> ``[("env", default_timeout), ("parity", 250.0)]``: each stage with its time
    limit in seconds (``name:seconds``; ``all`` runs every stage with the default)."""
    if text == "all":
        return [(name, default_timeout) for name in STAGES]
    stages = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, seconds = item.partition(":")
        try:
            timeout = float(seconds) if seconds else default_timeout
        except ValueError:
            raise SystemExit(f"gpu_check: --stages {item!r}: the time limit after ':' must be seconds") from None
        if timeout <= 0:
            raise SystemExit(f"gpu_check: --stages {item!r}: the time limit must be positive")
        stages.append((name.strip(), timeout))
    unknown = [name for name, _ in stages if name not in STAGES]
    if unknown or not stages:
        raise SystemExit(f"gpu_check: unknown stage(s) {unknown or text!r}; choose from: all, {', '.join(STAGES)}")
    return stages


def parse_sanitizer_parts(text: str | None) -> tuple[str, ...] | None:
    """``"memcheck-ngram,racecheck"`` -> those part names (checked against :data:`SANITIZER_PARTS`); None: all."""
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    known = [part.name for part in SANITIZER_PARTS]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"gpu_check: unknown sanitizer part(s) {unknown or text!r}; choose from: {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out", nargs="?", type=Path, help="output folder (created; results are written as each stage ends)"
    )
    parser.add_argument(
        "--stages",
        default="all",
        help="comma-separated stages, each optionally with its own time "
        "limit ('parity:250'), or 'all' (default); see --list",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per stage (default 480)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every stage on the CPU under the interpreter")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to install (no network) before the stages")
    parser.add_argument("--list", action="store_true", help="print the stages with their estimates and exit")
    parser.add_argument(
        "--headline-k",
        metavar="EXPR",
        help="pytest -k expression for the headline stage (e.g. the cases an earlier run did not reach)",
    )
    parser.add_argument(
        "--parity-k",
        metavar="EXPR",
        help="pytest -k expression for the parity stage's CUDA tests (e.g. the files changed since the last "
        "GPU run); the memcheck run of the edge cases is unchanged",
    )
    parser.add_argument(
        "--sanitizer-parts",
        metavar="NAMES",
        help=f"memcheck: comma-separated parts to run (default all: {', '.join(p.name for p in SANITIZER_PARTS)})",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="paper-goals: train with icrl-train --cuda-graph (once the parity stage passed its graphed tests)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, (_, estimate) in STAGES.items():
            print(f"{name:13s} {estimate}")
        return 0
    if args.out is None:
        parser.error("the output folder is required (or --list)")
    stages = parse_stages(args.stages, args.timeout)
    sanitizer_parts = parse_sanitizer_parts(args.sanitizer_parts)
    args.out.mkdir(parents=True, exist_ok=True)
    env = base_env(args.dry_run, args.wheels)
    record_path = args.out / "stages.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    for name, timeout in stages:
        ctx = Context(
            args.out, args.dry_run, timeout, env, deadline=time.monotonic() + timeout, headline_k=args.headline_k,
            cuda_graph=args.cuda_graph, parity_k=args.parity_k, sanitizer_parts=sanitizer_parts,
        )  # fmt: skip
        print(f"[gpu_check] {name} ...", flush=True)
        start = time.monotonic()
        try:
            status, details = STAGES[name][0](ctx)
        except Exception as error:  # a broken stage must not cost the stages after it
            status, details = "error", {"error": f"{type(error).__name__}: {error}"}
        seconds = time.monotonic() - start
        record[name] = {"status": status, "seconds": round(seconds, 1), "dry_run": args.dry_run, **details}
        record_path.write_text(json.dumps(record, indent=1))
        print(f"[gpu_check] {name}: {status} in {seconds:.0f} s {details}", flush=True)
    failed = [name for name, _ in stages if record[name]["status"] != "passed"]
    print(f"[gpu_check] results in {args.out}; " + (f"not passed: {', '.join(failed)}" if failed else "all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
