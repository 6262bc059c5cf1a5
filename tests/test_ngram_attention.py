"""Parity of n-gram match attention (eager and Triton paths) with the dense reference.

Every test draws fresh random inputs and compares the output and the gradient w.r.t. ``h`` with
``ngram_attention_reference`` (the spec). Kernel outputs start NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from icrl_kernels import ngram_attention, ngram_attention_reference, ngram_plan
from icrl_kernels.ngram.plan import ngram_keys
from icrl_kernels.ngram.reference import ngram_match_matrix
from icrl_kernels.testing import assert_close_rel, check_offline_reports, run_offline_compile, triton_devices

FAST_PATHS = [pytest.param("eager", "auto", "cpu", id="eager")] + [
    pytest.param("triton", algorithm, device, id=f"triton-{algorithm}-{getattr(device, 'values', [device])[0]}",
                 marks=getattr(device, "marks", ()))
    for device in triton_devices()
    for algorithm in ("sort", "tiled")
]  # fmt: skip
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_ids(
    batch: int, length: int, vocab: int, *, generator: torch.Generator, padding: float = 0.0
) -> torch.Tensor:
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    if padding > 0:
        ids[torch.rand(batch, length, generator=generator) < padding] = -1
    return ids


def check_parity(h: torch.Tensor, ids: torch.Tensor, n: int, backend: str, algorithm="auto", *, plan=None) -> None:
    """Output and gradient of ``backend`` / ``algorithm`` against the reference on the same inputs."""
    h = h.detach().requires_grad_(True)
    h_ref = h.detach().clone().requires_grad_(True)
    out = ngram_attention(h, ids, n, backend=backend, plan=plan, algorithm=algorithm)
    ref = ngram_attention_reference(h_ref, ids, n)
    assert out.dtype == h.dtype and out.shape == h.shape
    assert_close_rel(out, ref, name=f"{backend} output")
    grad_out = torch.randn_like(ref)
    (grad,) = torch.autograd.grad(out, h, grad_out)
    (grad_ref,) = torch.autograd.grad(ref, h_ref, grad_out)
    assert_close_rel(grad, grad_ref, name=f"{backend} grad_h")


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
from icrl_kernels.testing import compile_offline, config_jobs

# benchmarks/bench_ngram_attention.py (DESIGN.md section 5): D = 512 and 256 (the same specialisation: both
# are multiples of 16, so they compile once), the sort path at L = 4096, the tiled one at L = 256 (it runs
# up to L = 512). Every autotune config in bf16 (fp16 takes the same path) and fp32.
jobs = []
for (kernel, L), D, dtype in itertools.product(
    [(kernels._ngram_forward_kernel, 4096), (kernels._ngram_backward_kernel, 4096),
     (tiled_kernels._ngram_tiled_forward_kernel, 256), (tiled_kernels._ngram_tiled_backward_kernel, 256)],
    [512, 256], ["bf16", "fp32"],
):
    signature = {"perm_ptr": "*i64", "meta_ptr": "*u8", "ids_ptr": "*i64", "count_ptr": "*i32", "L": L, "D": D, "n": 2,
                 **dict.fromkeys(("h_ptr", "out_ptr", "grad_out_ptr", "grad_h_ptr"), "*" + dtype),
                 **dict.fromkeys(("stride_hb", "stride_ob", "stride_gb"), L * D),  # contiguous [B, L, D]
                 **dict.fromkeys(("stride_hl", "stride_ol", "stride_gl"), D)}
    jobs += config_jobs(kernel, signature, {"HALF_DOT": dtype == "bf16"}, L=L, D=D, dtype=dtype)
compile_offline(jobs)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """The interpreter accepts code the compiler rejects: compile the sort-path and tiled kernels to sm_90
    cubins in every autotune config, in bf16 and fp32, at the benchmark shapes, and check that none spills
    more than ``MAX_SPILL_BYTES`` per thread."""
    reports = run_offline_compile(_OFFLINE_COMPILE)
    check_offline_reports(reports, {"_ngram_forward_kernel", "_ngram_backward_kernel", "_ngram_tiled_forward_kernel",
                                    "_ngram_tiled_backward_kernel"})  # fmt: skip
