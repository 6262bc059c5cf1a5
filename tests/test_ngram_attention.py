"""Parity of n-gram match attention (eager and Triton paths) with the dense reference.

Every test draws fresh random inputs and compares the output and the gradient w.r.t. ``h`` with
``ngram_attention_reference`` (the spec). Kernel outputs start NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import check_parity, no_host_reads, random_ids

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels import NGramDecodeState, ngram_attention, ngram_attention_reference, ngram_plan, transition_ids
from icrl_kernels.ngram.plan import SEGMENT_START, build_ngram_plan, ngram_keys
from icrl_kernels.ngram.reference import ngram_match_matrix
from icrl_kernels.testing import assert_close_rel, triton_devices

pytest.importorskip("triton")  # the kernel modules need it: an install without the `triton` extra skips this file
from icrl_kernels.ngram import kernels as ngram_kernels  # noqa: E402

FAST_PATHS = [pytest.param("eager", "auto", "cpu", id="eager")] + [
    pytest.param("triton", algorithm, device, id=f"triton-{algorithm}-{device}")
    for device in triton_devices()
    for algorithm in ("sort", "tiled")
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("backend,algorithm,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch,length,dim,vocab,n,padding",
    [
        (2, 45, 19, 3, 1, 0.0),
        (3, 77, 33, 2, 2, 0.1),  # vocabulary 2: long segments
        (2, 131, 70, 5, 3, 0.05),  # several tiles, D spans two column blocks
        (1, 60, 24, 10_000, 2, 0.0),  # large vocabulary: mostly unmatched rows
        (2, 50, 13, 3, 8, 0.0),
    ],
)
def test_parity_random(backend, algorithm, device, dtype, batch, length, dim, vocab, n, padding):
    gen = torch.Generator().manual_seed(1000 * length + 10 * n + dim)
    ids = random_ids(batch, length, vocab, generator=gen, padding=padding).to(device)
    h = torch.randn(batch, length, dim, generator=gen).to(device=device, dtype=dtype)
    check_parity(h, ids, n, backend, algorithm)


def _edge_cases(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    return {
        "L=1": (random_ids(2, 1, 4, generator=gen), 1),
        "L=2": (torch.tensor([[3, 3], [1, 2]]), 1),
        "n>L": (random_ids(2, 6, 2, generator=gen), 7),
        "n=L": (random_ids(2, 6, 2, generator=gen), 6),
        "all padding": (torch.full((2, 20), -1), 1),
        "padding row": (torch.cat([torch.full((1, 30), -3), random_ids(1, 30, 3, generator=gen)]), 2),
        "one token repeated": (torch.full((2, 70), 5), 1),
        "one token repeated n=3": (torch.full((1, 70), 0), 3),
        "no match anywhere": (torch.arange(40).view(2, 20), 1),
        "alternating": (torch.arange(66).remainder(2).view(1, 66), 2),
        "large ids": (torch.randint(0, 3, (2, 40), generator=gen) * (1 << 40), 2),
    }


@pytest.mark.parametrize("backend,algorithm,device", FAST_PATHS)
@pytest.mark.parametrize("case", list(_edge_cases(torch.Generator())))
def test_parity_edge_cases(backend, algorithm, device, case):
    gen = torch.Generator().manual_seed(7)
    ids, n = _edge_cases(gen)[case]
    h = torch.randn(*ids.shape, 17, generator=gen)
    check_parity(h.to(device), ids.to(device), n, backend, algorithm)


def test_reference_pattern_by_hand():
    """The pinned convention on a hand-checked example (query n-gram ends at i, key n-gram at j - 1)."""
    ids = torch.tensor([[1, 2, 1, 2, 1, -1, 1]])
    pattern = ngram_match_matrix(ids, 1)[0]
    expected_rows = {  # i: keys j with ids[j-1] == ids[i] and j < i
        2: [1], 3: [2], 4: [1, 3], 6: [1, 3, 5],
    }  # fmt: skip
    for i in range(7):
        assert pattern[i].nonzero().flatten().tolist() == expected_rows.get(i, []), i
    pattern2 = ngram_match_matrix(ids, 2)[0]
    assert pattern2[3].nonzero().flatten().tolist() == [2]  # (1,2) ends at 1, followed by j = 2
    assert pattern2[4].nonzero().flatten().tolist() == [3]  # (2,1) ends at 2
    assert pattern2[6].nonzero().flatten().tolist() == []  # (-1, 1) contains padding
    h = torch.arange(7.0).view(1, 7, 1)
    out = ngram_attention_reference(h, ids, 1)[0, :, 0]
    assert out.tolist() == [0.0, 0.0, 1.0, 2.0, 2.0, 0.0, 3.0]


@pytest.mark.parametrize("backend,algorithm,device", FAST_PATHS)
def test_row_without_match_is_exactly_zero(backend, algorithm, device):
    ids = torch.tensor([[0, 1, 2, 3, 0, 1, 9, 9]], device=device)
    h = torch.randn(1, 8, 5, device=device)
    out = ngram_attention(h, ids, 1, backend=backend, algorithm=algorithm)
    matched = ngram_match_matrix(ids, 1).any(-1)[0]
    assert torch.equal(out[0, ~matched], torch.zeros_like(out[0, ~matched]))
    assert (out[0, matched].abs() > 0).all()


@pytest.mark.parametrize("backend,algorithm,device", FAST_PATHS)
def test_shared_plan_matches_fresh_plan(backend, algorithm, device):
    gen = torch.Generator().manual_seed(3)
    ids = random_ids(2, 50, 4, generator=gen).to(device)
    plan = ngram_plan(ids, 2)
    h = torch.randn(2, 50, 9, generator=gen).to(device)
    check_parity(h, ids, 2, backend, "sort", plan=plan)


def test_key_packing_and_ranking_agree():
    """Keys are compared for equality only: the packed and the ranked encodings must induce one partition."""
    gen = torch.Generator().manual_seed(5)
    small = random_ids(3, 90, 3, generator=gen, padding=0.05)
    for n in (1, 2, 4):
        packed, valid = ngram_keys(small, n)
        # Shift ids far apart so that V^n overflows and ranking is used; the partition must not change.
        ranked, valid_ranked = ngram_keys(torch.where(small >= 0, small * (1 << 60) // 4, small), n)
        assert torch.equal(valid, valid_ranked)
        same_packed = packed.unsqueeze(-1) == packed.unsqueeze(-2)
        same_ranked = ranked.unsqueeze(-1) == ranked.unsqueeze(-2)
        assert torch.equal(same_packed & valid.unsqueeze(-1), same_ranked & valid.unsqueeze(-1))


@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_float64_supported_off_triton(backend):
    gen = torch.Generator().manual_seed(11)
    ids = random_ids(2, 30, 3, generator=gen)
    h = torch.randn(2, 30, 6, generator=gen, dtype=torch.float64)
    out = ngram_attention(h, ids, 2, backend=backend)
    ref = ngram_attention_reference(h, ids, 2)
    assert_close_rel(out, ref, rms_tol=1e-12)


def test_eager_gradcheck_float64():
    gen = torch.Generator().manual_seed(12)
    ids = random_ids(1, 12, 2, generator=gen)
    h = torch.randn(1, 12, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ngram_attention(x, ids, 1, backend="eager"), (h,))


def _brute_force_rows(h: torch.Tensor, ids: torch.Tensor, n: int, rows: list[int]) -> torch.Tensor:
    """Output rows computed straight from the definition, O(L * n) each, for long sequences."""
    length = ids.shape[0]
    out = torch.zeros(len(rows), h.shape[-1], dtype=torch.float64)
    for r, i in enumerate(rows):
        if i < n - 1 or bool((ids[i - n + 1 : i + 1] < 0).any()):
            continue
        gram = ids[i - n + 1 : i + 1]
        windows = ids.unfold(0, n, 1)  # windows[t] = ids[t : t + n], ending at t + n - 1
        ends = torch.arange(n - 1, length)
        keys_j = ends + 1
        hit = (windows == gram).all(dim=1) & (keys_j < i)
        if hit.any():
            out[r] = h[keys_j[hit]].double().mean(dim=0)
    return out


def test_long_context_eager_is_exact_and_subquadratic():
    """L = 40_000 runs through the eager sort path (a dense pattern would need 6.4 GB) and is exact."""
    gen = torch.Generator().manual_seed(21)
    length, n = 40_000, 2
    ids = random_ids(1, length, 81, generator=gen)
    h = torch.randn(1, length, 8, generator=gen)
    out = ngram_attention(h, ids, n, backend="eager")
    rows = [0, 1, 2, 5000, 12_345, 39_998, 39_999] + torch.randint(0, length, (20,), generator=gen).tolist()
    expected = _brute_force_rows(h[0], ids[0], n, rows)
    assert_close_rel(out[0, rows], expected.float(), name="long-context rows")


@pytest.mark.parametrize("backend,algorithm,device", FAST_PATHS)
def test_non_contiguous_inputs(backend, algorithm, device):
    """Strided views (a transposed h, every other id) give the same result as contiguous copies."""
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(2, 21, 66, generator=gen).to(device).transpose(1, 2)  # [2, 66, 21], not contiguous
    ids = random_ids(2, 132, 3, generator=gen).to(device)[:, ::2]
    assert not h.is_contiguous() and not ids.is_contiguous()
    check_parity(h, ids, 2, backend, algorithm)


# --- compiled (non-interpreter) kernels, without a GPU --------------------------------------------

_OFFLINE_COMPILE = """
import itertools
from icrl_kernels.ngram import kernels, tiled_kernels
from benchmarks.kernel_tools import CompileJob, compile_offline, config_jobs

# benchmarks/bench_ngram_attention.py (docs/performance.md#targets): D = 512 and 256 (the same specialisation: both
# are multiples of 16, so they compile once), the sort path at L = 4096 (B = 16: chunks of 384, 11 a row),
# the tiled one at L = 256 (it runs up to L = 512). Every autotune config in bf16 (fp16 takes the same
# path) and fp32; the sort path's carry kernels in their one config.
jobs = []
for (kernel, L), D, dtype in itertools.product(
    [(kernels._ngram_forward_kernel, 4096), (kernels._ngram_backward_kernel, 4096),
     (kernels._ngram_forward_carry_kernel, 4096), (kernels._ngram_backward_carry_kernel, 4096),
     (tiled_kernels._ngram_tiled_forward_kernel, 256), (tiled_kernels._ngram_tiled_backward_kernel, 256)],
    [512, 256], ["bf16", "fp32"],
):
    signature = {"perm_ptr": "*i64", "meta_ptr": "*u8", "ids_ptr": "*i64", "count_ptr": "*i32", "L": L, "D": D, "n": 2,
                 "partial_ptr": "*fp32", "boundary_ptr": "*i32", "CHUNK_L": 384, "NUM_CHUNKS": 11,
                 "SIZE_BUCKET": 16 * L,
                 **dict.fromkeys(("h_ptr", "out_ptr", "grad_out_ptr", "grad_h_ptr"), "*" + dtype),
                 **dict.fromkeys(("stride_hb", "stride_ob", "stride_gb"), L * D),  # contiguous [B, L, D]
                 **dict.fromkeys(("stride_hl", "stride_ol", "stride_gl"), D)}
    if kernel in (kernels._ngram_forward_carry_kernel, kernels._ngram_backward_carry_kernel):
        constexprs = {"BLOCK_L": kernels._CARRY_BLOCK_L, "BLOCK_D": kernels._CARRY_BLOCK_D}
        jobs.append(CompileJob(kernel, signature, constexprs, kernels._CARRY_WARPS, 3,
                               {"config": "carry", "L": L, "D": D, "dtype": dtype}))
    else:
        jobs += config_jobs(kernel, signature, {"HALF_DOT": dtype == "bf16", "N": 2}, L=L, D=D, dtype=dtype)
# Rows of one chunk (short rows, L = 256): NUM_CHUNKS == 1 becomes a constant, a different program (its
# never-entered look-back loop crashed Triton 3.6's coalesce pass on an H200).
for kernel in (kernels._ngram_forward_kernel, kernels._ngram_backward_kernel):
    signature = {"perm_ptr": "*i64", "meta_ptr": "*u8", "count_ptr": "*i32", "partial_ptr": "*fp32",
                 "boundary_ptr": "*i32", "L": 256, "D": 512, "CHUNK_L": 256, "NUM_CHUNKS": 1, "SIZE_BUCKET": 4096,
                 **dict.fromkeys(("h_ptr", "out_ptr", "grad_out_ptr", "grad_h_ptr"), "*bf16"),
                 **dict.fromkeys(("stride_hb", "stride_ob", "stride_gb"), 256 * 512),
                 **dict.fromkeys(("stride_hl", "stride_ol", "stride_gl"), 512)}
    jobs += config_jobs(kernel, signature, {}, L=256, D=512, dtype="bf16", chunks=1)
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """The interpreter accepts code the compiler rejects: compile the sort-path and tiled kernels to sm_90
    cubins in every autotune config, in bf16 and fp32, at the benchmark shapes, and check that none spills
    more than ``MAX_SPILL_BYTES`` per thread."""
    reports = run_offline_compile(_OFFLINE_COMPILE)
    check_offline_reports(reports, {"_ngram_forward_kernel", "_ngram_backward_kernel", "_ngram_forward_carry_kernel",
                                    "_ngram_backward_carry_kernel", "_ngram_tiled_forward_kernel",
                                    "_ngram_tiled_backward_kernel"})  # fmt: skip


# --- sort path: rows split into chunks (carry pass + look-back) ------------------------------------

TRITON_DEVICES = triton_devices()


def _segment_chunk_spans(ids: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """For every segment of the plan (every row), how many chunks of ``chunk`` sorted positions it touches."""
    meta = build_ngram_plan(ids.cpu(), n).meta
    spans = []
    for row in meta:
        starts = ((row & SEGMENT_START) != 0).nonzero().flatten().tolist() + [row.numel()]
        spans += [(end - 1) // chunk - start // chunk + 1 for start, end in zip(starts[:-1], starts[1:])]
    return torch.tensor(spans)


#: The long interpreted cases are the slow tier (docs/testing.md#test-tiers); the first stays in the default one.
_SLOW = pytest.mark.slow


@pytest.mark.skipif(not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch,length,dim,vocab,n,padding,chunk",
    [
        (2, 70, 19, 3, 1, 0.1, 16),  # segments of ~20 positions cross chunk boundaries
        pytest.param(1, 90, 33, 1, 1, 0.0, 8, marks=_SLOW),  # one token repeated: one segment spans all 12 chunks
        pytest.param(2, 56, 24, 2, 2, 0.2, 7, marks=_SLOW),  # ragged chunks (7 is not a tile multiple), padding
        pytest.param(1, 50, 9, 40, 1, 0.0, 5, marks=_SLOW),  # mostly single-position segments: every chunk
    ],
)
def test_sort_path_chunked_parity(device, dtype, batch, length, dim, vocab, n, padding, chunk):
    """Forward and backward with rows cut into many chunks, so that segments cross chunk boundaries."""
    gen = torch.Generator().manual_seed(97 * length + chunk)
    ids = random_ids(batch, length, vocab, generator=gen, padding=padding)
    spans = _segment_chunk_spans(ids, n, chunk)
    assert spans.max() >= 3 if vocab <= 2 else spans.max() >= 2  # the carry path is exercised
    h = torch.randn(batch, length, dim, generator=gen).to(device=device, dtype=dtype)
    with ngram_kernels.forced_chunk_length(chunk):
        check_parity(h, ids.to(device), n, "triton", "sort")


@pytest.mark.skipif(not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("length,chunk", [(1, 1), (1, 128), (2, 1), (5, 2)])
def test_sort_path_chunked_short_rows(device, length, chunk):
    gen = torch.Generator().manual_seed(length + 10 * chunk)
    ids = random_ids(2, length, 2, generator=gen)
    h = torch.randn(2, length, 5, generator=gen).to(device)
    with ngram_kernels.forced_chunk_length(chunk):
        check_parity(h, ids.to(device), 1, "triton", "sort")


@pytest.mark.slow  # every autotune config, interpreted (docs/testing.md#test-tiers)
@pytest.mark.skipif(not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("kernel_name", ["_ngram_forward_kernel", "_ngram_backward_kernel"])
@pytest.mark.parametrize("config_index", range(len(ngram_kernels._CONFIGS)))
def test_sort_path_chunked_every_config(device, kernel_name, config_index):
    """Each autotune config (the interpreter otherwise runs only the first) with chunks shorter than its
    tile and a segment spanning many chunks."""
    from icrl_kernels.testing import forced_config

    gen = torch.Generator().manual_seed(config_index)
    ids = random_ids(1, 60, 2, generator=gen, padding=0.1)
    h = torch.randn(1, 60, 40, generator=gen).to(device)
    kernel = getattr(ngram_kernels, kernel_name)
    with forced_config(kernel, ngram_kernels._CONFIGS[config_index]), ngram_kernels.forced_chunk_length(9):
        check_parity(h, ids.to(device), 1, "triton", "sort")


@pytest.mark.parametrize(
    "batch,length,dim,fills",
    [(8, 4096, 512, True), (16, 4096, 512, True), (16, 4096, 256, True), (4, 8192, 512, True),
     (1, 65536, 64, False), (2, 300, 32, False)],
)  # fmt: skip
def test_chunking_fills_the_gpu(batch, length, dim, fills):
    """At the benchmark shapes (B = 8..16, L = 4096, D = 256..512; docs/performance.md) every config's grid has >= 4
    programs per H100 SM; chunks are whole tiles, within max_chunks (which bounds the look-back and
    wins over filling the GPU when B * D is small)."""
    chunk = ngram_kernels.chunk_length(batch, length, dim)
    chunks = -(-length // chunk)
    assert chunk % ngram_kernels._MAX_BLOCK_L == 0
    assert chunks <= ngram_kernels.max_chunks(length) or chunk == ngram_kernels._MAX_BLOCK_L
    fewest_programs = min(batch * chunks * -(-dim // c.kwargs["BLOCK_D"]) for c in ngram_kernels._CONFIGS)
    assert (fewest_programs >= ngram_kernels.TARGET_PROGRAMS) == fills
    assert ngram_kernels.chunk_length(batch, 100, dim) == 128  # short rows: one chunk of one tile or less


# --- the plan: identical permutation, and no value read on the host ---------------------------------


def _brute_force_perm(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Positions sorted by (n-gram as a tuple of ids, oldest first; invalid n-grams first), then position."""
    length = ids.shape[1]
    perms = []
    for row in ids.tolist():

        def key(t, row=row):
            gram = row[t - n + 1 : t + 1] if t >= n - 1 else None
            return (0, (), t) if gram is None or min(gram) < 0 else (1, tuple(gram), t)

        perms.append(sorted(range(length), key=key))
    return torch.tensor(perms)


@pytest.mark.parametrize(
    "dtype,vocab,n",
    [(torch.int64, 3, 2), (torch.int64, 1 << 40, 3), (torch.int32, 7, 3), (torch.int16, 5, 4),
     (torch.int8, 4, 9), (torch.uint8, 200, 8), (torch.int64, 3, 13), (torch.int32, 1 << 30, 2)],
)  # fmt: skip
def test_plan_permutation_is_lexicographic(dtype, vocab, n):
    """Whatever the key encoding (ids packed by dtype bound, ranked and packed, re-ranked for long n),
    the plan sorts positions by n-gram (lexicographic) then position, and equals the int64 plan."""
    gen = torch.Generator().manual_seed(vocab % 1000 + n)
    ids = torch.randint(0, min(vocab, 2**62), (3, 40), generator=gen)
    if dtype != torch.uint8:
        ids[torch.rand(3, 40, generator=gen) < 0.1] = -1
    ids = ids.to(dtype)
    plan = build_ngram_plan(ids, n)
    assert torch.equal(plan.perm, _brute_force_perm(ids.long(), n))
    for mine, wide in zip(plan, build_ngram_plan(ids.long(), n)):
        assert torch.equal(mine, wide)


def test_detector_catches_host_reads(monkeypatch):
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        torch.unique(torch.ones(3))
    # Also inside a custom op (the plan is one): the former vocabulary read is caught.
    from icrl_kernels.ngram import function as ngram_function

    original = ngram_function.build_ngram_plan
    monkeypatch.setattr(ngram_function, "build_ngram_plan", lambda ids, n: original(ids + 0 * int(ids.max()), n))
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        ngram_function._ngram_plan_op(torch.zeros(1, 4, dtype=torch.long), 2, "eager")  # the PyTorch builder


@pytest.mark.parametrize("backend", ["eager"] + (["triton"] if TRITON_DEVICES else []))
@pytest.mark.parametrize("n,vocab", [(1, 3), (2, 3), (3, 1 << 50)])
def test_plan_and_op_without_host_reads(backend, n, vocab):
    """The plan (keys, sort, flags, counts) and the op's forward and backward read no value on the host."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, vocab, (2, 30), generator=gen)
    ids[0, :3] = -1
    h = torch.randn(2, 30, 7, generator=gen, requires_grad=True)
    chunked = ngram_kernels.forced_chunk_length(8) if backend == "triton" else contextlib.nullcontext()
    with chunked, no_host_reads():
        build_ngram_plan(ids, n)
        plan = ngram_plan(ids, n)
        algorithm = "sort" if backend == "triton" else "auto"
        out = ngram_attention(h, ids, n, backend=backend, algorithm=algorithm, plan=plan)
        (grad,) = torch.autograd.grad(out, h, torch.ones_like(out))
    h_ref = h.detach().requires_grad_(True)
    ref = ngram_attention_reference(h_ref, ids, n)
    (grad_ref,) = torch.autograd.grad(ref, h_ref, torch.ones_like(ref))
    assert_close_rel(out, ref)
    assert_close_rel(grad, grad_ref, name="grad_h")


def test_token_ids_and_decode_without_host_reads():
    states, actions, rewards = torch.tensor([[0, 2, 1, -1]]), torch.tensor([[1, 0, 2, 0]]), torch.tensor([[0, 1, 1, 0]])
    with no_host_reads():
        ids = transition_ids(states, actions, rewards, num_states=3, num_actions=3, num_rewards=2)
        state = NGramDecodeState(1, 3, 2, max_len=4)
        for i in range(4):
            state.step(torch.randn(1, 3), ids[:, i])
        state.reset(torch.tensor([0]))
        state.reset(torch.tensor([True]))
    assert ids.tolist() == [[2, 13, 11, -1]]
