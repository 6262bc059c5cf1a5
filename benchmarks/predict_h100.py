"""Predicted H100 lower bounds of every headline case, from the ops' cost models (no GPU needed).

For each headline shape it prints the minimal bytes and FLOPs (``benchmarks/cost/<op>.py``), the
roofline bound ``max(bytes / copy bandwidth, FLOPs / matmul peak)`` and the target time (1.5x the
bound, docs/performance.md#targets). The device rates are **assumptions**, not measurements: an H100 SXM's copy
bandwidth of about 3.0 TB/s (of 3.35 TB/s nominal HBM3), a dense bf16/fp16 matmul peak of about
700 TFLOP/s (of 989 nominal) and an fp32 (IEEE, non-TF32) peak of about 60 TFLOP/s (of 67 nominal).
The ``env`` stage of ``benchmarks/gpu_check.py`` measures the real ones; the benchmark summary then
uses those.

Usage::

    python benchmarks/predict_h100.py [--markdown]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cost import OpCost, roofline  # noqa: E402
from benchmarks.cost.contrastive import infonce_fwd_bwd_cost, select_actions_cost  # noqa: E402
from benchmarks.cost.looped import inference_cost, train_step_cost  # noqa: E402
from benchmarks.cost.moa import attention_fwd_bwd_cost, mixture_of_heads_fwd_bwd_cost  # noqa: E402
from benchmarks.cost.ngram import fwd_bwd_cost as ngram_cost  # noqa: E402
from benchmarks.cost.smeared import fwd_bwd_cost as smeared_cost  # noqa: E402

#: Assumed H100 SXM rates (see the module docstring): bytes/s and FLOP/s.
COPY_BANDWIDTH = 3.0e12
MATMUL_PEAK = {"bfloat16": 700e12, "float16": 700e12, "float32": 60e12}
#: Measured time must be within this factor of the roofline bound (docs/performance.md#targets).
ROOFLINE_TARGET = 1.5


@dataclass(frozen=True)
class Case:
    op: str
    shape: str
    dtype: str
    cost: OpCost


def headline_cases() -> list[Case]:
    """The headline shapes of the benchmarks (``pytest benchmarks -m headline`` on a GPU)."""
    bf16 = "bfloat16"
    cases = [
        Case("ngram_attention fwd+bwd", f"B16 L4096 D512 ({dtype})", dtype, ngram_cost(16, 4096, 512, dtype=dtype))
        for dtype in ("float32", bf16)
    ]
    cases.append(Case("ngram_attention fwd+bwd", "B8 L65536 D512", bf16, ngram_cost(8, 65536, 512, dtype=bf16)))
    for A in (125, 4096, 1_000_000):
        cases.append(
            Case(
                "infonce_loss fwd+bwd (grad pred)",
                f"N65536 D512 A{A}",
                bf16,
                infonce_fwd_bwd_cost(65536, 512, A, dtype=bf16),
            )  # fmt: skip
        )
    cases.append(
        Case(
            "infonce_loss fwd+bwd (grad pred, embeds)",
            "N65536 D512 A125",
            bf16,
            infonce_fwd_bwd_cost(65536, 512, 125, dtype=bf16, grad_embeds=True),
        )  # fmt: skip
    )
    cases.append(Case("select_actions", "N65536 D512 A4096", bf16, select_actions_cost(65536, 512, 4096, dtype=bf16)))
    for B in (16, 64):
        cases.append(
            Case(
                "MoAAttention layer fwd+bwd",
                f"B{B} L1024 H12 Dh64",
                bf16,
                attention_fwd_bwd_cost(B, 1024, 12, 64, dtype=bf16),
            )  # fmt: skip
        )
    cases.append(
        Case(
            "mixture_of_heads fwd+bwd",
            "B16 L1024 H12 Dh64",
            bf16,
            mixture_of_heads_fwd_bwd_cost(16, 1024, 12, 64, dtype=bf16),
        )  # fmt: skip
    )
    cases.append(Case("smeared_keys fwd+bwd", "B64 H12 L1024 Dh64", bf16, smeared_cost(64, 12, 1024, 64, dtype=bf16)))
    cases.append(
        Case(
            "looped train step",
            "B64 L81 D256 b30 T15",
            bf16,
            train_step_cost(64, 81, 256, loops=30, grad_loops=15, dtype=bf16),
        )  # fmt: skip
    )
    cases.append(
        Case("looped inference", "B64 L81 D256 500 loops", bf16, inference_cost(64, 81, 256, loops=500, dtype=bf16))
    )
    return cases


def predict(case: Case) -> dict:
    """Bound (seconds), the binding term, and the target time for ``case`` on the assumed H100."""
    bound, binding = roofline(case.cost, COPY_BANDWIDTH, MATMUL_PEAK[case.dtype])
    return {"op": case.op, "shape": case.shape, "dtype": case.dtype, "bytes": case.cost.bytes,
            "flops": case.cost.flops, "bound_s": bound, "binding": binding,
            "target_s": ROOFLINE_TARGET * bound}  # fmt: skip


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| op | shape | dtype | min bytes (MB) | GFLOP | bound | roofline bound ms | target ms (1.5x) |",
        "|---|---|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['bytes'] / 1e6:.4g} | {r['flops'] / 1e9:.4g} | "
            f"{r['binding']} | {_ms(r['bound_s'])} | {_ms(r['target_s'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    print(
        f"Assumed H100 (a prediction, not a measurement): copy {COPY_BANDWIDTH / 1e12:.1f} TB/s, "
        f"bf16 matmul {MATMUL_PEAK['bfloat16'] / 1e12:.0f} TFLOP/s, fp32 {MATMUL_PEAK['float32'] / 1e12:.0f} TFLOP/s"
    )
    print(markdown_table([predict(case) for case in headline_cases()]))


if __name__ == "__main__":
    main()
