"""Gated, smeared causal attention, forward + backward (issue 17; docs/performance.md#targets).

Every benchmark times ``gated_attention(q, k, v, gate_logits, smear_alpha=...)`` and the gradients w.r.t.
every input for one shape, one variant and one implementation. Variants:

* ``plain``: causal attention, no gate, no smearing (the floor: SDPA alone on the ``separate`` backend);
* ``gated``: softmax gate over heads (MoA); ``smeared``: smeared keys; ``gated-smeared``: both.

Implementations:

* ``triton``: the fused kernels (smearing in the key-tile prologue, the gate in the epilogue);
* ``separate``: SDPA (``is_causal=True``) between the separate ops ``smeared_keys`` and
  ``mixture_of_heads`` on their default backend (Triton on CUDA, eager on the CPU): what the attention
  modules run today. ``plain`` + ``separate`` is SDPA ungated, the issue's baseline (target: gated at most
  1.1x of it);
* ``eager``: the same composition with the ops' eager (PyTorch) backends;
* ``reference``: the dense fp32-math reference differentiated by autograd (up to ``L = 1024``: its
  ``L x L`` scores need gigabytes beyond that);
* ``compile``: ``torch.compile`` of the same composition in plain PyTorch ops (smearing as a shifted
  blend, SDPA, the gate as a softmax and a multiply), the best Inductor can fuse around SDPA (CPU smoke
  runs compile one case).

Bytes and FLOPs: :mod:`benchmarks.cost.attention`, the fused model for ``triton`` and the separate-ops
model for the others (both count what that implementation moves, not a common minimum).

Headline cases (``-m headline``): ``triton`` and ``separate`` at ``B = 16, L = 1024, H = 12, Dh = 64`` bf16
for ``plain`` and ``gated-smeared``, and the first smoke shape on a smoke run.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from icrl_kernels import gated_attention, gated_attention_reference, mixture_of_heads, smeared_keys
from icrl_kernels.testing import assert_close_rel

from .conftest import bench_device, select_shapes, skip_unless_runnable, split_graph
from .cost.attention import fwd_bwd_cost, separate_ops_fwd_bwd_cost


class Shape(NamedTuple):
    B: int
    H: int
    L: int
    Dh: int
    dtype: str


def shape_id(shape: Shape) -> str:
    return f"B{shape.B}-H{shape.H}-L{shape.L}-Dh{shape.Dh}-{shape.dtype}"


# Full set (CUDA, or ICRL_BENCH_FULL=1): the MoA attention row of docs/performance.md#targets (B = 8..64,
# H = 12, Dh = 64, L = 60..4096) in bf16 (training), one fp32 shape, and Dh = 128.
FULL_SHAPES = [
    Shape(B=64, H=12, L=60, Dh=64, dtype="bfloat16"),  # the DT's context: 20 steps x 3 tokens
    Shape(B=64, H=12, L=256, Dh=64, dtype="bfloat16"),
    Shape(B=16, H=12, L=1024, Dh=64, dtype="bfloat16"),
    Shape(B=64, H=12, L=1024, Dh=64, dtype="bfloat16"),
    Shape(B=8, H=12, L=4096, Dh=64, dtype="bfloat16"),
    Shape(B=8, H=12, L=1024, Dh=64, dtype="float32"),
    Shape(B=16, H=8, L=1024, Dh=128, dtype="bfloat16"),
]
# Smoke set: a few interpreter programs each.
SMOKE_SHAPES = [Shape(B=1, H=3, L=37, Dh=16, dtype="float32"), Shape(B=1, H=2, L=20, Dh=64, dtype="bfloat16")]
SHAPES = select_shapes(FULL_SHAPES, SMOKE_SHAPES)

VARIANTS = {"plain": (False, False), "gated": (True, False), "smeared": (False, True), "gated-smeared": (True, True)}
BACKENDS = ("triton", "triton+graph", "separate", "eager", "reference", "compile")
_HEADLINE_SHAPE = Shape(B=16, H=12, L=1024, Dh=64, dtype="bfloat16")
HEADLINE = {(_HEADLINE_SHAPE, variant, backend) for variant in ("plain", "gated-smeared") for backend in
            ("triton", "triton+graph", "separate")} | {(SMOKE_SHAPES[0], "gated-smeared", "triton")}  # fmt: skip
CASES = [
    pytest.param(shape, variant, backend, id=f"{shape_id(shape)}-{variant}-{backend}",
                 marks=[pytest.mark.headline] if (shape, variant, backend) in HEADLINE else [])
    for shape in SHAPES
    for variant in VARIANTS
    for backend in BACKENDS
]  # fmt: skip


def _separate(q, k, v, logits, alpha):
    """SDPA between the separate ops on their default backend (what the attention modules run today)."""
    keys = k if alpha is None else smeared_keys(k, alpha)
    heads = F.scaled_dot_product_attention(q, keys, v, is_causal=True).transpose(1, 2)
    return heads.flatten(2) if logits is None else mixture_of_heads(heads, logits)


def _plain_torch(q, k, v, logits, alpha):
    """The composition in plain PyTorch ops, for ``torch.compile`` (softmax gate)."""
    if alpha is not None:
        blend = torch.sigmoid(alpha.float()).to(k.dtype)[:, None, None]
        k = blend * k + (1 - blend) * F.pad(k, (0, 0, 1, 0))[:, :, :-1]
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    if logits is not None:
        heads = heads * torch.softmax(logits.float(), dim=-1).to(heads.dtype)[..., None]
    return heads.flatten(2)


@pytest.mark.parametrize("shape,variant,backend", CASES)
def test_gated_attention_fwd_bwd(timed, benchmark, shape: Shape, variant: str, backend: str) -> None:
    device = bench_device()
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_runnable(backend, device, compile_here=shape == SMOKE_SHAPES[0] and variant == "gated-smeared")
    if backend == "reference" and shape.L > 1024:
        pytest.skip("the dense reference's L x L scores need gigabytes at this length")
    gated, smeared = VARIANTS[variant]
    dtype = getattr(torch, shape.dtype)
    generator = torch.Generator().manual_seed(0)

    def leaf(*size):
        return torch.randn(*size, generator=generator).to(device, dtype).requires_grad_(True)

    q, k, v = (leaf(shape.B, shape.H, shape.L, shape.Dh) for _ in range(3))
    logits = leaf(shape.B, shape.L, shape.H) if gated else None
    alpha = torch.randn(shape.H, generator=generator).to(device).requires_grad_(True) if smeared else None
    leaves = tuple(t for t in (q, k, v, logits, alpha) if t is not None)
    grad_out = torch.randn(shape.B, shape.L, shape.H * shape.Dh, generator=generator).to(device, dtype)
    if backend == "separate":
        fn = _separate
    elif backend == "compile":
        fn = torch.compile(_plain_torch, dynamic=False)
        expected = gated_attention_reference(q, k, v, logits, smear_alpha=alpha)
        assert_close_rel(fn(q, k, v, logits, alpha), expected, rms_tol=3e-2, name="compiled composition")
    elif backend == "reference":
        fn = lambda *args: gated_attention_reference(*args[:4], smear_alpha=args[4])
    else:
        fn = lambda *args, backend=backend: gated_attention(*args[:4], smear_alpha=args[4], backend=backend)

    def step():
        return torch.autograd.grad(fn(q, k, v, logits, alpha), leaves, grad_out)

    benchmark.group = f"gated-attention-fwd-bwd {shape_id(shape)}"
    # "features", not "variant": summarize.py reads "variant" as an old name of the backend key.
    info = {"op": "gated_attention", "backend": backend_name, "features": variant, **shape._asdict()}
    model = fwd_bwd_cost if backend == "triton" else separate_ops_fwd_bwd_cost
    cost = model(shape.B, shape.H, shape.L, shape.Dh, dtype=dtype, gated=gated, smeared=smeared)
    timed(step, device=device, info=info, cost=cost, dtype=dtype, graphed=graphed)
