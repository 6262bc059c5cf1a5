"""Per-call overhead of every op on tiny CPU tensors: forward + backward through the public function.

At these sizes the arithmetic is negligible, so the time is what a call costs in Python, argument
checks, the custom-op dispatcher and autograd: what dominates a looped or decoding step. Each op runs
with ``backend="eager"`` (the registered op) and ``backend="reference"`` (plain autograd over torch ops),
single-threaded, median of ``--repeats`` timed calls after a warm-up.

Usage::

    python benchmarks/dispatch_overhead.py [--repeats 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import icrl_kernels as ik


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
        "smeared_keys": (
            lambda: (torch.randn(2, 4, 16, 8, requires_grad=True), torch.zeros(4, requires_grad=True)),
            lambda backend, k, alpha: ik.smeared_keys(k, alpha, backend=backend),
        ),
    }


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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
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
