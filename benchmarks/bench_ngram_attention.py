"""N-gram match attention, forward + backward (docs/ops.md, docs/performance.md#targets).

Every benchmark times ``out = A(n) @ h`` (row-normalised n-gram match pattern, no projections) and
the gradient w.r.t. ``h [B, L, D]`` for one shape and one implementation:

* ``eager``: sort + prefix sums in PyTorch, O(L log L + L D) (the CPU default);
* ``triton-sort``: the Triton kernels over the same sorted plan (``algorithm="sort"``);
* ``triton-tiled``: the Triton kernels that build the mask tile by tile from the ids, O(L^2 D)
  work but no sort (``algorithm="tiled"``); comparing the two Triton rows over ``L`` gives the
  length up to which ``algorithm="auto"`` should pick the tiled kernel;
* ``reference``: the dense ``[B, L, L]`` pattern and a matmul, O(L^2 D) time and O(L^2) memory, with
  fp32 matmuls in full precision (TF32 off, PyTorch's default);
* ``reference-tf32``: the same with TF32 matmuls allowed (CUDA only; on the CPU TF32 does not exist);
* ``flex``: FlexAttention (CUDA only) with a mask_mod that encodes the same pattern, the general-
  purpose peer a user would otherwise reach for, its block mask built once outside the timed region
  (as a user would share it across layers);
* ``flex+mask``: the same with the n-gram keys and the block mask built inside every timed call.

The ``eager`` and ``triton-sort`` timings include building the plan (one sort of ``B x L`` keys),
because ``ngram_attention(h, ids, n)`` does that on every call, so ``flex+mask`` is the like-for-like
peer and ``flex`` the one with its setup amortised; the ``reference`` timings include building the
dense pattern. Inputs are fp32 ``h ~ N(0, 1)`` and ids drawn uniformly from ``[0, vocab)``. Bytes and
FLOPs: :func:`benchmarks.cost.ngram.fwd_bwd_cost`.

Headline cases (``-m headline``): every backend at ``B=16, L=4096, D=512, n=2`` with vocabularies 81
and 10^4 (the targets: at least 10x the dense reference, faster than FlexAttention at vocab 10^4), and
the first two smoke shapes on a smoke run.

``test_ngram_cpu_crossover`` times ``eager`` against ``reference`` on the CPU over a sweep of ``L``;
``benchmarks/summarize.py`` reads the ratio per ``L`` and the crossover from the saved JSON. (The
constant ``CPU_DENSE_MAX_LENGTH`` of ``backend="auto"`` on the CPU comes from the standalone
``benchmarks/ngram_cpu_crossover.py``, which sweeps more shapes and thread counts.)

``test_ngram_tiled_crossover`` times ``triton-tiled`` against ``triton-sort`` over ``L`` in fp32 (FMA
dots) and bf16 (tensor-core dots): where they cross, per dtype, is ``TILED_MAX_LENGTH[dtype]`` of
``algorithm="auto"`` (``icrl_kernels/ngram/function.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import icrl_kernels
from icrl_kernels.ngram.plan import ngram_keys
from icrl_kernels.testing import assert_close_rel, relative_rms_error

from .conftest import as_params, bench_device, select_shapes, skip_unless_runnable, split_graph
from .cost.ngram import fwd_bwd_cost

#: FlexAttention head width: ``h [B, L, D]`` is viewed as ``D / 64`` heads of 64 features.
HEAD_DIM = 64

#: Skip the dense reference when its fp32 ``[B, L, L]`` pattern alone would exceed this.
REFERENCE_PATTERN_LIMIT_BYTES = 4 * 2**30


class Shape(NamedTuple):
    B: int
    L: int
    D: int
    vocab: int
    n: int


def shape_id(shape: Shape) -> str:
    return f"B{shape.B}-L{shape.L}-D{shape.D}-V{shape.vocab}-n{shape.n}"


# Full set (CUDA, or ICRL_BENCH_FULL=1): not the cartesian product of the target ranges (docs/performance.md), which
# would take hours, but three slices through it.
TARGET_LENGTHS = (256, 1024, 4096, 16384, 65536)
# Scaling in L at a fixed width: where the dense O(L^2) paths (reference, FlexAttention, the tiled
# kernel) fall behind the sort-based ones and then out of memory. 512 and 2048 are extra points
# around the tiled/sort switch of algorithm="auto" (TILED_MAX_LENGTH; see test_ngram_tiled_crossover).
LENGTH_SWEEP = [Shape(B=8, L=L, D=512, vocab=81, n=2) for L in sorted({*TARGET_LENGTHS, 512, 2048})]
# Vocabulary and n at L = 4096: they change the number of matches per row (not the work of the
# sort-based paths) and how many blocks of the FlexAttention mask are empty.
VOCAB_SWEEP = [Shape(B=16, L=4096, D=512, vocab=V, n=n) for V in (81, 10_000) for n in (1, 2, 3)]
# The batch and width corners of the target range.
CORNERS = [Shape(B=64, L=1024, D=256, vocab=81, n=2), Shape(B=64, L=4096, D=512, vocab=81, n=2)]
FULL_SHAPES = LENGTH_SWEEP + VOCAB_SWEEP + CORNERS

# FlexAttention compiles once per distinct shape (tens of seconds each), so it runs on the target
# lengths and the vocabulary sweep only, which keeps a full CUDA run to a few minutes.
FLEX_SHAPES = [s for s in LENGTH_SWEEP if s.L in TARGET_LENGTHS] + VOCAB_SWEEP

# Smoke set: a power-of-two tile, a ragged length with a large vocabulary and n = 3, and a batch of
# two short rows; each costs the Triton interpreter at most a few programs x tiles.
SMOKE_SHAPES = [
    Shape(B=1, L=64, D=64, vocab=81, n=2),
    Shape(B=1, L=100, D=48, vocab=10_000, n=3),
    Shape(B=2, L=30, D=16, vocab=81, n=1),
]

SHAPES = select_shapes(FULL_SHAPES, SMOKE_SHAPES)

# One shape per target, every backend: the 10x-over-dense target at vocabulary 81 and 10^4, and the
# FlexAttention target at 10^4 (sparse matches: most of flex's mask blocks are empty, its best case).
HEADLINE_SHAPES = [Shape(B=16, L=4096, D=512, vocab=81, n=2), Shape(B=16, L=4096, D=512, vocab=10_000, n=2),
                   *SMOKE_SHAPES[:2]]  # fmt: skip
BACKENDS = [
    "eager", "triton-sort", "triton-sort+graph", "triton-tiled", "triton-tiled+graph", "reference", "reference-tf32",
    "flex", "flex+mask",
]  # fmt: skip

# The CPU crossover sweep runs its full L range only when asked for explicitly, so that a CUDA run
# (full shapes by default) does not spend minutes on the CPU.
if os.environ.get("ICRL_BENCH_FULL", "0") == "1":
    CROSSOVER_SHAPES = [Shape(B=8, L=L, D=256, vocab=81, n=2) for L in (256, 512, 1024, 2048, 4096)]
else:
    CROSSOVER_SHAPES = [Shape(B=2, L=L, D=32, vocab=81, n=2) for L in (32, 96)]

# Tiled vs sort on the GPU around TILED_MAX_LENGTH (2048, measured on an H200; first estimated 512-1024), at
# The target width and at N-Gram AD's training shape (batch 32, d_model 64, n = 1 and 2); smoke: two tiny
# lengths for the interpreter.
TILED_CROSSOVER_SHAPES = select_shapes(
    [Shape(B=8, L=L, D=512, vocab=81, n=2) for L in (256, 512, 1024, 2048, 4096)]
    + [Shape(B=32, L=L, D=64, vocab=81, n=n) for n in (1, 2) for L in (256, 512, 1024, 2048)],
    [Shape(B=1, L=L, D=32, vocab=81, n=2) for L in (40, 96)],
)


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [B, L, D]`` fp32 leaf with ``requires_grad`` and ``ids [B, L]`` int64 in ``[0, vocab)``."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(shape.B, shape.L, shape.D, generator=generator)
    ids = torch.randint(0, shape.vocab, (shape.B, shape.L), generator=generator)
    return h.to(device).requires_grad_(), ids.to(device)


@functools.cache
def _compiled(name: str) -> Callable[..., object]:
    """``torch.compile`` of ``flex_attention`` or ``create_block_mask``, compiled once per process."""
    from torch.nn.attention import flex_attention as flex

    # One graph per shape (dynamic=False: static shapes are what FlexAttention tunes best). The
    # benchmark visits more shapes than Dynamo's default limit of 8 recompiles, past which it would
    # silently fall back to the unfused implementation that materialises [B, H, L, L] scores.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(getattr(flex, name), dynamic=False)


def flex_ngram_attention(ids: torch.Tensor, n: int, dim: int, *, compiled: bool = True, mask_per_call: bool = False):
    """The n-gram pattern as a FlexAttention mask; returns ``fn(h [B, L, dim]) -> [B, L, dim]``.

    With ``g[b, t]`` the identity of the n-gram ending at ``t`` (``-1`` when out of range or padded),
    query ``q`` attends to key ``kv`` iff ``kv < q`` and ``g[b, q] == g[b, kv - 1] >= 0``. Queries and
    keys are all zero, so every allowed score is equal and the softmax is the uniform mean over the
    matches; a row with no match comes out as zero, as the op's convention requires. Values are ``h``
    split into ``dim / 64`` heads. The keys ``g`` and the block mask are built here, once, outside any
    timed region, or with ``mask_per_call`` on every call of ``fn`` (what the op does with its plan).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if dim % HEAD_DIM:
        raise ValueError(f"dim must be a multiple of {HEAD_DIM}, got {dim}")
    batch, length = ids.shape
    heads = dim // HEAD_DIM
    # Filled by build_mask; the mask_mod reads these same two tensors on every call, so a rebuilt mask
    # reuses the compiled graph (a fresh closure per call could make Dynamo recompile).
    query_key = torch.empty_like(ids, dtype=torch.int64)
    key_of_kv = torch.empty_like(query_key)

    def mask_mod(b, h, q, kv):
        query = query_key[b, q]
        return (kv < q) & (query == key_of_kv[b, kv]) & (query >= 0)

    # Compiled, the mask is evaluated block by block inside one kernel; uncompiled, it materialises
    # [B, 1, L, L] intermediates (tens of GB at L = 65536).
    make_block_mask = _compiled("create_block_mask") if compiled else create_block_mask

    def build_mask():
        keys, _ = ngram_keys(ids, n)
        query_key.copy_(keys)
        # key_of_kv[b, kv] = g[b, kv - 1]; kv = 0 has no preceding n-gram, so it gets -2, which no query
        # key (>= 0 when valid) equals. Shifting once here keeps the mask_mod free of a kv - 1 index.
        key_of_kv.copy_(F.pad(keys[:, :-1], (1, 0), value=-2))
        return make_block_mask(mask_mod, batch, None, length, length, device=ids.device)

    shared_mask = None if mask_per_call else build_mask()
    attend = _compiled("flex_attention") if compiled else flex_attention
    zeros = torch.zeros(batch, heads, length, HEAD_DIM, device=ids.device)

    def run(h: torch.Tensor) -> torch.Tensor:
        block_mask = build_mask() if mask_per_call else shared_mask
        values = h.view(batch, length, heads, HEAD_DIM).transpose(1, 2)
        q = zeros.to(h.dtype)
        out = attend(q, q, values, block_mask=block_mask)
        return out.transpose(1, 2).reshape(batch, length, dim)

    return run


def skip_unless_ngram_runnable(shape: Shape, backend: str, device: torch.device) -> None:
    """``pytest.skip`` for combinations that cannot run, or would not finish, here."""
    if backend.startswith("reference") and shape.B * shape.L * shape.L * 4 > REFERENCE_PATTERN_LIMIT_BYTES:
        pytest.skip(f"dense [B, L, L] pattern needs {shape.B * shape.L**2 * 4 / 2**30:.0f} GiB")
    if backend == "reference-tf32" and device.type != "cuda":
        pytest.skip("TF32 matmuls exist on CUDA only: on the CPU this is the reference")
    skip_unless_runnable(backend, device)
    if backend.startswith("flex"):
        if device.type != "cuda":
            # FlexAttention has no CPU backward in this torch ("does not support backward on CPU").
            pytest.skip("FlexAttention fwd+bwd needs CUDA")
        if shape not in FLEX_SHAPES:
            pytest.skip("FlexAttention runs on the target lengths and the vocabulary sweep only")


def ngram_fn(backend: str, ids: torch.Tensor, n: int, dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if backend.startswith("flex"):
        return flex_ngram_attention(ids, n, dim, mask_per_call=backend == "flex+mask")
    if backend.startswith("triton-"):
        algorithm = backend.removeprefix("triton-")
        return lambda h: icrl_kernels.ngram_attention(h, ids, n, backend="triton", algorithm=algorithm)
    implementation = backend.removesuffix("-tf32")
    return lambda h: icrl_kernels.ngram_attention(h, ids, n, backend=implementation)


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """``torch.set_float32_matmul_precision`` for the block (``"highest"``: IEEE fp32, ``"high"``: TF32)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _run(
    fwd_bwd, benchmark, shape: Shape, backend: str, device: torch.device, group: str, dtype: torch.dtype | None = None
) -> None:
    backend_name, (backend, graphed) = backend, split_graph(backend)
    skip_unless_ngram_runnable(shape, backend, device)
    h, ids = make_inputs(shape, device)
    if dtype is not None:
        h = h.detach().to(dtype).requires_grad_()
    fn = ngram_fn(backend, ids, shape.n, shape.D)
    if backend.startswith("flex"):
        # A peer computing something else would make the comparison meaningless: check it once at
        # this very shape against the library's eager path. The tolerance admits TF32 rounding inside
        # FlexAttention's kernels; a wrong mask gives errors of order 1.
        # (With grad enabled, so that this call compiles the same graph the timed calls use.)
        error = relative_rms_error(fn(h), icrl_kernels.ngram_attention(h, ids, shape.n, backend="eager"))
        assert error < 1e-2, f"FlexAttention peer disagrees with the op: relative RMS error {error:.2e}"
    benchmark.group = f"{group} {shape_id(shape)}"
    info = {"op": "ngram_attention", "backend": backend_name, **shape._asdict()}
    if dtype is not None:
        info["dtype"] = str(dtype).removeprefix("torch.")
    cost = fwd_bwd_cost(shape.B, shape.L, shape.D, dtype=h.dtype, ids_itemsize=ids.element_size())
    # The TF32 setting is global and read when the backward's matmuls launch too, so it spans the call.
    with float32_matmul_precision("high" if backend.endswith("-tf32") else "highest"):
        fwd_bwd(fn, h, info=info, cost=cost, graphed=graphed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", as_params(SHAPES, headline=HEADLINE_SHAPES, ids=shape_id))
def test_ngram_attention_fwd_bwd(fwd_bwd, benchmark, shape: Shape, backend: str) -> None:
    """Forward + backward of every implementation at one shape, on the benchmark device."""
    _run(fwd_bwd, benchmark, shape, backend, bench_device(), group="ngram-fwd-bwd")


@pytest.mark.parametrize("backend", ["eager", "reference"])
@pytest.mark.parametrize("shape", CROSSOVER_SHAPES, ids=shape_id)
def test_ngram_cpu_crossover(fwd_bwd, benchmark, shape: Shape, backend: str) -> None:
    """Eager sort + prefix sums against the dense reference on the CPU, over ``L``.

    The dense path wins at short ``L`` (one well-optimised matmul); the O(L log L) path wins once the
    ``L^2`` term dominates. ``summarize.py`` reports the smallest ``L`` from which eager stays faster.
    """
    _run(fwd_bwd, benchmark, shape, backend, torch.device("cpu"), group="ngram-cpu-crossover")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton-sort", "triton-tiled"])
@pytest.mark.parametrize("shape", TILED_CROSSOVER_SHAPES, ids=shape_id)
def test_ngram_tiled_crossover(fwd_bwd, benchmark, shape: Shape, backend: str, dtype: torch.dtype) -> None:
    """The two Triton algorithms over ``L`` per dtype: ``TILED_MAX_LENGTH[dtype]`` is the last ``L`` at which
    ``triton-tiled`` is still faster. Both include everything their call does (the sort path its plan)."""
    _run(fwd_bwd, benchmark, shape, backend, bench_device(), group="ngram-tiled-crossover", dtype=dtype)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_peer_matches_reference() -> None:
    """The FlexAttention peer computes the op: outputs (and, on CUDA, gradients) match the reference.

    Covers a ragged length, a padded row (negative ids: rows with no match must be exactly zero) and
    a small vocabulary so that rows have many matches. On the CPU, FlexAttention has no backward and
    compiling it takes half a minute, so only the uncompiled forward is checked there.
    """
    device = bench_device()
    generator = torch.Generator().manual_seed(1)
    batch, length, dim, n = 2, 200, 128, 2
    ids = torch.randint(0, 9, (batch, length), generator=generator)
    ids[1, 120:] = -1
    h = torch.randn(batch, length, dim, generator=generator).to(device).requires_grad_()
    ids = ids.to(device)

    fn = flex_ngram_attention(ids, n, dim, compiled=device.type == "cuda")
    expected = icrl_kernels.ngram_attention_reference(h, ids, n)
    if device.type != "cuda":
        # FlexAttention refuses CPU inputs that require grad. The mask built per call (flex+mask)
        # must give the same output as the shared one.
        rebuilt = flex_ngram_attention(ids, n, dim, compiled=False, mask_per_call=True)
        for name, out in (("flex", fn(h.detach())), ("flex+mask", rebuilt(h.detach()))):
            assert_close_rel(out, expected.detach(), rms_tol=1e-4, name=f"{name} output")
            assert not out[1, 120:].any(), "rows with no match must be exactly zero"
        return
    out = fn(h)
    assert_close_rel(out, expected, rms_tol=1e-3, name="flex output")
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, h, grad_out)
    (expected_grad,) = torch.autograd.grad(expected, h, grad_out)
    assert_close_rel(grad, expected_grad, rms_tol=1e-3, name="flex grad_h")
