"""Per-call overhead of every op on tiny CPU tensors: forward + backward through the public function,
against the nearest native PyTorch op doing the same job.

At these sizes the arithmetic is negligible, so the time is what a call costs in Python, argument
checks, the custom-op dispatcher and autograd: what dominates a looped or decoding step. Each op runs
with ``backend="eager"`` (the registered op) and ``backend="reference"`` (plain autograd over torch ops),
single-threaded, median of ``--repeats`` timed calls after a warm-up.

Every op is also timed against its *native* counterpart (``Case.native``: e.g. SDPA for the attention
ops, ``F.layer_norm(y + prompt)`` for ``inject_layer_norm``), on the same inputs, with the same harness
(fresh leaves, forward, ``out.float().sum().backward()``), in the same run; the functions take turns call
by call, so that their ratio survives a shared machine's changing load. ``ours / native`` is what a user
who swaps the native op for ours pays on the host; the harness alone (``x * 1``) is printed for scale.

``--triton-host`` measures instead what the profile of an H200 run showed to dominate most ops on a GPU
(``benchmarks/results/README.md``, "Where the time goes"): the *host* time of the Triton path. Every
kernel launch is replaced by a counter (nothing runs), so the time is Python, argument checks, dispatch,
autograd and the PyTorch ops around the kernels; it also counts, per call, the Triton launches and the
PyTorch ops that would each launch a CUDA kernel (``torch.profiler``; views and allocations excluded), for
ours and for the native op. It needs ``TRITON_INTERPRET=1`` (so that CPU tensors take the Triton path) and
value checks are off (the unlaunched kernels leave their outputs unwritten). A CPU proxy: on a GPU each
launch also costs the driver a few microseconds.

Usage::

    python benchmarks/dispatch_overhead.py [--repeats 300] [--clock wall|thread] [--json PATH]
    TRITON_INTERPRET=1 python benchmarks/dispatch_overhead.py --triton-host [--repeats 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import icrl_kernels as ik  # noqa: E402
from benchmarks.kernel_tools import autotuned_kernels  # noqa: E402


class Case(NamedTuple):
    """One measured op: fresh inputs, our public function, and the nearest native PyTorch op doing the same
    job on the same inputs (the comparison of issue 55: a user replacing the native op pays the ratio)."""

    make_inputs: Callable[[], tuple]
    ours: Callable[..., torch.Tensor]  # ours(backend, *inputs)
    native_name: str
    native: Callable[..., torch.Tensor]  # native(*inputs)


def _cases() -> dict[str, Case]:
    """``name -> Case``: tiny inputs (fresh leaves per call), the op under test and its native counterpart."""
    torch.manual_seed(0)
    ids = torch.randint(0, 4, (2, 32))
    embeds = torch.randn(8, 16)
    targets = torch.randint(0, 8, (2, 16))
    # The native rows follow issue 55's table and lean towards the native op: SDPA's n-gram mask is given
    # (the op finds the matches in ``ids`` itself), and the attention rows leave out the head merge, gate
    # and smearing that ``gated_attention`` does in the same call. The n-gram mask: the 2-gram pattern of
    # ``ids`` plus the diagonal (no empty row).
    pattern = ik.ngram_match_matrix(ids, 2) | torch.eye(32, dtype=torch.bool)
    ones, zeros = torch.ones(32), torch.zeros(32)

    def sdpa_masked(h):
        return F.scaled_dot_product_attention(h, h, h, attn_mask=pattern)

    def smeared_native(k, alpha):  # k'_j = lerp(k_{j-1}, k_j, sigmoid(alpha))
        return torch.lerp(F.pad(k[:, :, :-1], (0, 0, 1, 0)), k, torch.sigmoid(alpha).view(1, -1, 1, 1))

    return {
        "ngram_attention": Case(
            lambda: (torch.randn(2, 32, 16, requires_grad=True),),
            lambda backend, h: ik.ngram_attention(h, ids, 2, backend=backend),
            "SDPA, boolean mask",
            sdpa_masked,
        ),
        "ngram_attention (sort path)": Case(
            lambda: (torch.randn(2, 32, 16, requires_grad=True),),
            lambda backend, h: ik.ngram_attention(h, ids, 2, backend=backend, algorithm="sort"),
            "SDPA, boolean mask",
            sdpa_masked,
        ),
        "infonce_loss": Case(
            lambda: (torch.randn(2, 16, 16, requires_grad=True),),
            lambda backend, pred: ik.infonce_loss(pred, embeds, targets, backend=backend),
            "cross_entropy(pred @ embeds.T)",
            lambda pred: F.cross_entropy((pred @ embeds.T).flatten(0, 1), targets.flatten()),
        ),
        "select_actions (no grad)": Case(
            lambda: (torch.randn(2, 16, 16),),
            lambda backend, pred: ik.select_actions(pred, embeds, mode="argmax", backend=backend),
            "(pred @ embeds.T).argmax(-1)",
            lambda pred: (pred @ embeds.T).argmax(-1),
        ),
        "mixture_of_heads": Case(
            lambda: (torch.randn(2, 16, 4, 8, requires_grad=True), torch.randn(2, 16, 4, requires_grad=True)),
            lambda backend, heads, logits: ik.mixture_of_heads(heads, logits, backend=backend),
            "einsum with softmax gates",
            lambda heads, logits: torch.einsum("blhd,blh->blhd", heads, logits.softmax(-1)).flatten(2),
        ),
        "inject_layer_norm": Case(
            lambda: (torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 16, 32, requires_grad=True)),
            lambda backend, y, prompt: ik.inject_layer_norm(y, prompt, None, ones, zeros, backend=backend)[1],
            "layer_norm(y + prompt)",
            lambda y, prompt: F.layer_norm(y + prompt, (32,), ones, zeros),
        ),
        "gated_attention": Case(
            lambda: tuple(torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)),
            lambda backend, q, k, v: ik.gated_attention(q, k, v, None, backend=backend),
            "SDPA, causal",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        ),
        "gated_attention (gated, smeared)": Case(
            lambda: (
                *(torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)),
                torch.randn(2, 16, 4, requires_grad=True),
                torch.zeros(4, requires_grad=True),
            ),
            lambda backend, q, k, v, logits, alpha: ik.gated_attention(
                q, k, v, logits, smear_alpha=alpha, backend=backend
            ),
            "SDPA, causal",
            lambda q, k, v, logits, alpha: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        ),
        "smeared_keys": Case(
            lambda: (torch.randn(2, 4, 16, 8, requires_grad=True), torch.zeros(4, requires_grad=True)),
            lambda backend, k, alpha: ik.smeared_keys(k, alpha, backend=backend),
            "lerp with the shifted keys",
            smeared_native,
        ),
    }


#: The harness alone: ``x * 1`` forward and backward, timed like every op.
HARNESS = Case(
    lambda: (torch.randn(2, 16, 16, requires_grad=True),), lambda backend, x: x * 1, "x * 1", lambda x: x * 1
)


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
def stubbed_kernel_launches(on_launch: Callable[[str], None] | None = None) -> Iterator[Counter]:
    """Within the block every launch of the package's Triton kernels is a no-op that is counted (the
    counter maps kernel name -> launches); every kernel module is imported first, so each one's
    ``launch`` is replaced, and restored afterwards. ``on_launch(kernel name)``, if given, runs in the
    launcher's ``launch(kernel, grid)`` call (tests read the stack there)."""
    from icrl_kernels import _triton

    autotuned_kernels()  # imports every ``*kernels`` module
    launches: Counter = Counter()
    counters: dict = {}  # kernel -> its counting no-op, made once: the stub itself should cost next to nothing

    def counting_launch(kernel, grid):
        if on_launch is not None:
            on_launch(_triton.kernel_name(kernel))
        run = counters.get(kernel)
        if run is None:
            name = _triton.kernel_name(kernel)

            def run(*args, **kwargs):
                launches[name] += 1

            counters[kernel] = run
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


def torch_kernel_ops(make_inputs, fn) -> int:
    """PyTorch ops of one call ``fn(*make_inputs())`` (forward + backward) that would each launch a kernel on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _forward_backward(fn, inputs)
    ops = [event for event in prof.events() if event.name.startswith("aten::")]
    top_level = [e for e in ops if not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    return sum(event.name not in NO_KERNEL_OPS for event in top_level)


def _forward_backward(fn, inputs: tuple) -> None:
    out = fn(*inputs)
    if out.requires_grad:
        out.float().sum().backward()


#: The clock of :func:`time_calls`: wall time, or with ``--clock thread`` the CPU time of this thread
#: (``time.thread_time``), which leaves out the time other processes of a shared machine take the core.
_clock = time.perf_counter


def time_calls(make_inputs, fns: dict[str, Callable], repeats: int, warmup: int = 20) -> dict[str, float]:
    """Median seconds of one forward (+ backward when an input needs grad) of each of ``fns`` (name -> fn).

    The functions take turns, one call each per round, so that a load that comes and goes on a shared
    machine slows all of them alike and their ratios stay meaningful."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + warmup):
        for name, fn in fns.items():
            inputs = make_inputs()
            start = _clock()
            _forward_backward(fn, inputs)
            if i >= warmup:
                samples[name].append(_clock() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def _with_backend(case: Case, backend: str) -> Callable:
    return lambda *inputs: case.ours(backend, *inputs)


def harness_us(repeats: int) -> float:
    """Microseconds of the harness alone (``x * 1`` forward and backward)."""
    return time_calls(HARNESS.make_inputs, {"harness": HARNESS.native}, repeats)["harness"] * 1e6


def triton_host_rows(repeats: int) -> list[dict]:
    """Per op: host microseconds of the Triton path with launches stubbed and of the native op, their
    ratio, Triton launches and PyTorch kernel ops per call of each (see the module docstring)."""
    from icrl_kernels import resolve_backend

    try:
        resolve_backend("triton", torch.device("cpu"))
    except ValueError as error:
        raise SystemExit(f"--triton-host needs TRITON_INTERPRET=1 set before the run: {error}") from None
    rows = []
    previous_checks = ik.set_value_checks("off")
    try:
        with stubbed_kernel_launches() as launches:
            for name, case in _cases().items():
                ours = _with_backend(case, "triton")
                seconds = time_calls(case.make_inputs, {"ours": ours, "native": case.native}, repeats)
                launches.clear()
                torch_ops = torch_kernel_ops(case.make_inputs, ours)
                rows.append({
                    "op": name, "triton_host_us": seconds["ours"] * 1e6, "triton_launches": sum(launches.values()),
                    "torch_kernel_ops": torch_ops, "native": case.native_name, "native_us": seconds["native"] * 1e6,
                    "native_kernel_ops": torch_kernel_ops(case.make_inputs, case.native),
                    "ours_over_native": seconds["ours"] / seconds["native"],
                })  # fmt: skip
    finally:
        ik.set_value_checks(previous_checks)
    return rows


def eager_rows(repeats: int) -> list[dict]:
    """Per op: microseconds of the eager backend (the registered op), the plain-autograd reference and the
    native op, taking turns."""
    rows = []
    for name, case in _cases().items():
        fns = {"eager": _with_backend(case, "eager"), "reference": _with_backend(case, "reference"),
               "native": case.native}  # fmt: skip
        seconds = time_calls(case.make_inputs, fns, repeats)
        rows.append({
            "op": name, "eager_us": seconds["eager"] * 1e6, "reference_us": seconds["reference"] * 1e6,
            "native": case.native_name, "native_us": seconds["native"] * 1e6,
            "eager_over_native": seconds["eager"] / seconds["native"],
        })  # fmt: skip
    return rows


def _machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time (default), or this thread's CPU time (steadier on a machine that other jobs share)",
    )
    parser.add_argument(
        "--triton-host",
        action="store_true",
        help="host time and launches of the Triton path "
        "with every kernel launch stubbed out (needs TRITON_INTERPRET=1)",
    )
    args = parser.parse_args(argv)
    global _clock
    _clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    harness = harness_us(args.repeats)
    header = (f"torch {torch.__version__}, {_machine()}, 1 thread, {args.clock} clock, median of {args.repeats}; "
              f"the harness alone (x * 1 forward and backward): {harness:.0f} us")  # fmt: skip
    if args.triton_host:
        rows = triton_host_rows(args.repeats)
        print(header + "; Triton path, kernels not run")
        print("| op | ours, host us | native op | native us | ours / native | Triton launches "
              "| PyTorch kernel ops, ours | PyTorch kernel ops, native |")  # fmt: skip
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        for row in rows:
            print(
                f"| {row['op']} | {row['triton_host_us']:.0f} | `{row['native']}` | {row['native_us']:.0f} "
                f"| {row['ours_over_native']:.2f} | {row['triton_launches']} | {row['torch_kernel_ops']} "
                f"| {row['native_kernel_ops']} |"
            )
        mode = "triton-host"
    else:
        rows = eager_rows(args.repeats)
        print(header)
        print("| op | eager (registered op) us | reference (plain autograd) us | native op | native us "
              "| eager / native |")  # fmt: skip
        print("|---|---:|---:|---|---:|---:|")
        for row in rows:
            print(
                f"| {row['op']} | {row['eager_us']:.0f} | {row['reference_us']:.0f} | `{row['native']}` "
                f"| {row['native_us']:.0f} | {row['eager_over_native']:.2f} |"
            )
        mode = "eager"
    if args.json:
        with open(args.json, "w") as f:
            record = {"torch": torch.__version__, "machine": _machine(), "repeats": args.repeats, "mode": mode,
                      "clock": args.clock, "harness_us": harness, "rows": rows}  # fmt: skip
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
