"""Per-call overhead of every op on tiny CPU tensors: forward + backward through the public function.

At these sizes the arithmetic is negligible, so the time is what a call costs in Python, argument
checks, the custom-op dispatcher and autograd: what dominates a looped or decoding step. Each op runs
with ``backend="eager"`` (the registered op) and ``backend="reference"`` (plain autograd over torch ops),
single-threaded, median of ``--repeats`` timed calls after a warm-up.

``--triton-host`` measures instead what the profile of an H200 run showed to dominate most ops on a GPU
(``benchmarks/results/README.md``, "Where the time goes"): the *host* time of the Triton path. Every
kernel launch is replaced by a counter (nothing runs), so the time is Python, argument checks, dispatch,
autograd and the PyTorch ops around the kernels; it also counts, per call, the Triton launches and the
PyTorch ops that would each launch a CUDA kernel (``torch.profiler``; views and allocations excluded).
It needs ``TRITON_INTERPRET=1`` (so that CPU tensors take the Triton path) and value checks are off (the
unlaunched kernels leave their outputs unwritten). A CPU proxy: on a GPU each launch also costs the
driver a few microseconds.

Usage::

    python benchmarks/dispatch_overhead.py [--repeats 300] [--json PATH]
    TRITON_INTERPRET=1 python benchmarks/dispatch_overhead.py --triton-host [--repeats 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import icrl_kernels as ik  # noqa: E402
from benchmarks.kernel_tools import autotuned_kernels  # noqa: E402


def _cases():
    """``name -> (make_inputs, call)``: tiny inputs (fresh leaves per call) and the op under test."""
    torch.manual_seed(0)
    ids = torch.randint(0, 4, (2, 32))
    embeds = torch.randn(8, 16)
    targets = torch.randint(0, 8, (2, 16))

    return {
        "ngram_attention": (
            lambda: (torch.randn(2, 32, 16, requires_grad=True),),
            lambda backend, h: ik.ngram_attention(h, ids, 2, backend=backend),
        ),
        "ngram_attention (sort path)": (
            lambda: (torch.randn(2, 32, 16, requires_grad=True),),
            lambda backend, h: ik.ngram_attention(h, ids, 2, backend=backend, algorithm="sort"),
        ),
        "infonce_loss": (
            lambda: (torch.randn(2, 16, 16, requires_grad=True),),
            lambda backend, pred: ik.infonce_loss(pred, embeds, targets, backend=backend),
        ),
        "select_actions (no grad)": (
            lambda: (torch.randn(2, 16, 16),),
            lambda backend, pred: ik.select_actions(pred, embeds, mode="argmax", backend=backend),
        ),
        "mixture_of_heads": (
            lambda: (torch.randn(2, 16, 4, 8, requires_grad=True), torch.randn(2, 16, 4, requires_grad=True)),
            lambda backend, heads, logits: ik.mixture_of_heads(heads, logits, backend=backend),
        ),
        "inject_layer_norm": (
            lambda: (torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 16, 32, requires_grad=True)),
            lambda backend, y, prompt: ik.inject_layer_norm(
                y, prompt, None, torch.ones(32), torch.zeros(32), backend=backend
            )[1],
        ),
        "gated_attention": (
            lambda: tuple(torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)),
            lambda backend, q, k, v: ik.gated_attention(q, k, v, None, backend=backend),
        ),
        "gated_attention (gated, smeared)": (
            lambda: (
                *(torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)),
                torch.randn(2, 16, 4, requires_grad=True),
                torch.zeros(4, requires_grad=True),
            ),
            lambda backend, q, k, v, logits, alpha: ik.gated_attention(
                q, k, v, logits, smear_alpha=alpha, backend=backend
            ),
        ),
        "smeared_keys": (
            lambda: (torch.randn(2, 4, 16, 8, requires_grad=True), torch.zeros(4, requires_grad=True)),
            lambda backend, k, alpha: ik.smeared_keys(k, alpha, backend=backend),
        ),
    }


#: PyTorch ops that launch no kernel (views, metadata, allocation): not counted as launches.
NO_KERNEL_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
    "aten::slice", "aten::select", "aten::expand", "aten::transpose", "aten::t", "aten::permute",
    "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::unbind", "aten::split",
    "aten::split_with_sizes", "aten::narrow", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::new_empty", "aten::new_empty_strided", "aten::resolve_conj", "aten::resolve_neg",
    "aten::lift_fresh", "aten::contiguous", "aten::to", "aten::_to_copy_noop", "aten::result_type",
    "aten::is_nonzero", "aten::flatten", "aten::unflatten", "aten::chunk", "aten::movedim",
}  # fmt: skip


@contextlib.contextmanager
def stubbed_kernel_launches() -> Iterator[Counter]:
    """Within the block every launch of the package's Triton kernels is a no-op that is counted (the
    counter maps kernel name -> launches); every kernel module is imported first, so each one's
    ``launch`` is replaced, and restored afterwards."""
    from icrl_kernels import _triton

    autotuned_kernels()  # imports every ``*kernels`` module
    launches: Counter = Counter()

    def counting_launch(kernel, grid):
        def run(*args, **kwargs):
            launches[_triton.kernel_name(kernel)] += 1

        return run

    original = _triton.launch
    modules = [module for name, module in list(sys.modules.items())
               if name.startswith("icrl_kernels.") and getattr(module, "launch", None) is original]  # fmt: skip
    for module in modules:
        module.launch = counting_launch
    try:
        yield launches
    finally:
        for module in modules:
            module.launch = original


def torch_kernel_ops(make_inputs, call, backend: str) -> int:
    """PyTorch ops of one call (forward + backward) that would each launch a kernel on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = call(backend, *inputs)
        if out.requires_grad:
            out.float().sum().backward()
    ops = [event for event in prof.events() if event.name.startswith("aten::")]
    top_level = [e for e in ops if not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    return sum(event.name not in NO_KERNEL_OPS for event in top_level)


def triton_host_rows(repeats: int) -> list[dict]:
    """Per op: host microseconds of the Triton path with launches stubbed, Triton launches and PyTorch
    kernel ops per call (see the module docstring)."""
    from icrl_kernels import resolve_backend

    try:
        resolve_backend("triton", torch.device("cpu"))
    except ValueError as error:
        raise SystemExit(f"--triton-host needs TRITON_INTERPRET=1 set before the run: {error}") from None
    rows = []
    previous_checks = ik.set_value_checks("off")
    try:
        with stubbed_kernel_launches() as launches:
            for name, (make_inputs, call) in _cases().items():
                seconds = time_call(make_inputs, call, "triton", repeats)
                launches.clear()
                torch_ops = torch_kernel_ops(make_inputs, call, "triton")
                rows.append({"op": name, "triton_host_us": seconds * 1e6, "triton_launches": sum(launches.values()),
                             "torch_kernel_ops": torch_ops})  # fmt: skip
    finally:
        ik.set_value_checks(previous_checks)
    return rows


def time_call(make_inputs, call, backend: str, repeats: int) -> float:
    """Median seconds of one forward (+ backward when an input needs grad)."""
    samples = []
    for i in range(repeats + 20):
        inputs = make_inputs()
        start = time.perf_counter()
        out = call(backend, *inputs)
        if out.requires_grad:
            out.float().sum().backward()
        if i >= 20:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    parser.add_argument(
        "--triton-host",
        action="store_true",
        help="host time and launches of the Triton path "
        "with every kernel launch stubbed out (needs TRITON_INTERPRET=1)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.triton_host:
        rows = triton_host_rows(args.repeats)
        print(f"torch {torch.__version__}, 1 thread, median of {args.repeats}; Triton path, kernels not run")
        print("| op | host us per call | Triton launches | PyTorch kernel ops |")
        print("|---|---:|---:|---:|")
        for row in rows:
            print(
                f"| {row['op']} | {row['triton_host_us']:.0f} | {row['triton_launches']} | {row['torch_kernel_ops']} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "repeats": args.repeats, "mode": "triton-host", "rows": rows},
                          f, indent=2)  # fmt: skip
        return
    rows = []
    for name, (make_inputs, call) in _cases().items():
        eager = time_call(make_inputs, call, "eager", args.repeats)
        reference = time_call(make_inputs, call, "reference", args.repeats)
        rows.append({"op": name, "eager_us": eager * 1e6, "reference_us": reference * 1e6})
    machine = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {machine}, 1 thread, median of {args.repeats}")
    print("| op | eager (registered op) us | reference (plain autograd) us |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row['op']} | {row['eager_us']:.0f} | {row['reference_us']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
