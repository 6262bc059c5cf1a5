"""Cost models of the ops (``benchmarks/cost/<op>.py``), their shared type and the roofline bound.

Benchmarks and tests use them; they are not part of the installed package. Each op's module counts, as
a function of the shape and dtype, the minimal bytes a fused
implementation must move between device memory and the chip (every input of a pass read once, every
output written once; intermediates that a fused kernel keeps on chip are not counted) and the
floating-point operations of the math (a multiply-add is 2 FLOPs). The benchmarks record both and
compare the measured time with the roofline bound :func:`roofline`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpCost:
    """Minimal memory traffic (``bytes``) and arithmetic (``flops``) of one call of an op."""

    bytes: int
    flops: int

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.bytes + other.bytes, self.flops + other.flops)

    def __mul__(self, times: int) -> OpCost:
        return OpCost(self.bytes * times, self.flops * times)

    __rmul__ = __mul__


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return dtype.itemsize


def roofline(cost: OpCost, bytes_per_second: float, flops_per_second: float) -> tuple[float, str]:
    """The roofline bound in seconds and the term that binds (``"bytes"`` or ``"flops"``).

    ``max(bytes / bytes_per_second, flops / flops_per_second)``: no implementation that moves at
    least ``cost.bytes`` and computes ``cost.flops`` runs faster on a device that sustains those
    rates (ties go to ``"bytes"``).
    """
    memory_seconds = cost.bytes / bytes_per_second
    compute_seconds = cost.flops / flops_per_second
    if compute_seconds > memory_seconds:
        return compute_seconds, "flops"
    return memory_seconds, "bytes"
