"""Where the CPU ``backend="auto"`` of n-gram attention should switch from the dense reference to eager.

On a CPU without Triton, ``ngram_attention(backend="auto")`` runs the dense reference (one batched
matmul of the ``[B, L, L]`` pattern) up to ``CPU_DENSE_MAX_LENGTH`` positions and the eager sort +
prefix-sum path beyond (``icrl_kernels/ngram/function.py``). This script times forward + backward of
both, ``backend="reference"`` and ``backend="eager"``, over ``L``, single-threaded and with the default
number of torch threads, prints a markdown table per shape and thread count, and writes every timing to
JSON with the value of ``CPU_DENSE_MAX_LENGTH`` it suggests.

Shapes: N-Gram AD's training job (``icrl_models/train.py`` defaults: batch 32, ``d_model`` 64, n-gram
layers n = 1 and 2, Dark Room's 81 states as ids) and the target benchmark width (B = 8, D = 512,
n = 2, vocabulary 81); fp32; L = 64 .. 4096.

Run it on an otherwise idle machine (timings of a shared one are meaningless)::

    python benchmarks/ngram_cpu_crossover.py                 # full sweep, minutes
    python benchmarks/ngram_cpu_crossover.py --quick         # 1 repeat at 2 small sizes: checks it runs

The suggestion: per (shape, threads), the largest measured ``L`` at which the dense reference is still
faster with eager faster at every longer ``L``; ``CPU_DENSE_MAX_LENGTH`` should be the largest of those
over the configurations (then ``"auto"`` is never slower than dense in any of them; where it keeps the
dense path a little too long, it loses only part of eager's lead there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from icrl_kernels import ngram_attention  # noqa: E402
from icrl_kernels.ngram.function import CPU_DENSE_MAX_LENGTH  # noqa: E402
from icrl_kernels.testing import relative_rms_error  # noqa: E402

LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (32, 64)

#: Skip the dense reference where its fp32 ``[B, L, L]`` pattern alone would exceed this.
REFERENCE_PATTERN_LIMIT_BYTES = 4 * 2**30


class Shape(NamedTuple):
    name: str
    B: int
    D: int
    n: int
    vocab: int


SHAPES = (
    Shape("ngram-ad-n1", B=32, D=64, n=1, vocab=81),
    Shape("ngram-ad-n2", B=32, D=64, n=2, vocab=81),
    Shape("design-d512", B=8, D=512, n=2, vocab=81),
)
QUICK_SHAPES = (Shape("quick", B=2, D=16, n=2, vocab=5),)


def fwd_bwd_seconds(backend: str, h: torch.Tensor, ids: torch.Tensor, n: int, repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` forward + backward calls (after one warm-up call)."""
    grad_out = torch.randn_like(h)

    def call() -> None:
        out = ngram_attention(h, ids, n, backend=backend)
        out.backward(grad_out)
        h.grad = None

    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def crossover(rows: list[dict]) -> int | None:
    """Largest ``L`` at which the reference wins with eager winning at every longer ``L`` (``None``: eager
    wins everywhere measured; the longest ``L``: the reference wins everywhere)."""
    suggestion = None
    for row in sorted(rows, key=lambda r: r["L"]):
        if row["reference_s"] is not None and row["reference_s"] < row["eager_s"]:
            suggestion = row["L"]
    return suggestion


def run(shapes, lengths, thread_counts, repeats: int) -> dict:
    results, suggestions = [], []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for shape in shapes:
            rows = []
            for length in lengths:
                gen = torch.Generator().manual_seed(length)
                h = torch.randn(shape.B, length, shape.D, generator=gen).requires_grad_(True)
                ids = torch.randint(0, shape.vocab, (shape.B, length), generator=gen)
                if length == lengths[0]:  # both paths compute the op (a wrong one would time something else)
                    with torch.no_grad():
                        error = relative_rms_error(
                            ngram_attention(h, ids, shape.n, backend="eager"),
                            ngram_attention(h, ids, shape.n, backend="reference"),
                        )
                    assert error < 1e-5, f"eager and reference disagree: relative RMS error {error:.2e}"
                eager = fwd_bwd_seconds("eager", h, ids, shape.n, repeats)
                dense_fits = shape.B * length * length * 4 <= REFERENCE_PATTERN_LIMIT_BYTES
                reference = fwd_bwd_seconds("reference", h, ids, shape.n, repeats) if dense_fits else None
                row = {"shape": shape.name, **shape._asdict(), "L": length, "threads": threads,
                       "eager_s": statistics.median(eager), "eager_times_s": eager,
                       "reference_s": statistics.median(reference) if reference else None,
                       "reference_times_s": reference}  # fmt: skip
                rows.append(row)
                dense_ms = f"{row['reference_s'] * 1e3:.2f} ms" if reference else "skipped"
                progress = f"{shape.name} threads={threads} L={length}: eager {row['eager_s'] * 1e3:.2f} ms"
                print(f"  {progress}, reference {dense_ms}", file=sys.stderr, flush=True)
            results += rows
            suggestions.append({"shape": shape.name, "threads": threads, "dense_max_length": crossover(rows)})
    measured = [s["dense_max_length"] for s in suggestions if s["dense_max_length"] is not None]
    return {
        "results": results,
        "crossovers": suggestions,
        "suggested_CPU_DENSE_MAX_LENGTH": max(measured) if measured else 0,
    }


def markdown(report: dict) -> str:
    lines = []
    keys = sorted({(row["shape"], row["threads"]) for row in report["results"]}, key=lambda k: (k[1], k[0]))
    for shape, threads in keys:
        rows = [r for r in report["results"] if r["shape"] == shape and r["threads"] == threads]
        first = rows[0]
        lines += [f"### {shape}: B={first['B']}, D={first['D']}, n={first['n']}, vocab {first['vocab']}, "
                  f"{threads} thread{'s' if threads > 1 else ''}", "",
                  "| L | reference ms | eager ms | eager / reference |", "|---|---|---|---|"]  # fmt: skip
        for r in rows:
            ref = r["reference_s"]
            ratio = f"{r['eager_s'] / ref:.2f}" if ref else "-"
            ref_ms = f"{ref * 1e3:.2f}" if ref else "skipped (pattern > 4 GiB)"
            lines.append(f"| {r['L']} | {ref_ms} | {r['eager_s'] * 1e3:.2f} | {ratio} |")
        suggestion = next(s for s in report["crossovers"] if s["shape"] == shape and s["threads"] == threads)
        last = suggestion["dense_max_length"]
        verdict = "Eager faster at every measured L." if last is None else (
            f"Dense faster at L = {last}, eager at every longer L.")  # fmt: skip
        lines += ["", verdict, ""]
    lines.append(f"Suggested `CPU_DENSE_MAX_LENGTH` (largest of the above): {report['suggested_CPU_DENSE_MAX_LENGTH']} "
                 f"(currently {CPU_DENSE_MAX_LENGTH}).")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat at 2 small sizes: checks that the script runs")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 7; 1 with --quick)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/cpu-ngram-crossover.json, "
                             "a temp file with --quick)")  # fmt: skip
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 7)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    default_threads = torch.get_num_threads()
    thread_counts = sorted({1, default_threads})
    shapes, lengths = (QUICK_SHAPES, QUICK_LENGTHS) if args.quick else (SHAPES, LENGTHS)
    out = args.out
    if out is None:
        out = (Path(tempfile.gettempdir()) / "cpu-ngram-crossover-quick.json" if args.quick
               else Path(__file__).resolve().parent / "results" / "cpu-ngram-crossover.json")  # fmt: skip
    report = run(shapes, lengths, thread_counts, repeats)
    report["meta"] = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor(), "cpu_count": os.cpu_count(), "default_threads": default_threads,
        "repeats": repeats, "quick": args.quick, "dtype": "float32",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "CPU_DENSE_MAX_LENGTH": CPU_DENSE_MAX_LENGTH,
    }  # fmt: skip
    print(markdown(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
