"""The Triton plan kernels (:mod:`icrl_kernels.ngram.plan_kernels`) build exactly the PyTorch plan.

``perm``, ``meta`` and ``count`` are compared bit for bit with :func:`build_ngram_plan` on fresh random
ids: every id dtype (packed keys for the narrow ones, dense ranks for int64), ``n`` from 1 to beyond
``L`` (and the large ``n`` that falls back to the PyTorch plan), padding, rows of one position, rows of
several tiles (a segment open across a tile edge carries its start), with outputs poisoned first. Then
the plan's users: :func:`ngram_plan` and ``ngram_attention`` take the kernels on the Triton backend, and
the kernels compile for sm_90 without spills.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels import ngram_attention, ngram_attention_reference, ngram_plan
from icrl_kernels.ngram.plan import build_ngram_plan
from icrl_kernels.testing import assert_close_rel, poisoned_outputs, triton_devices

TRITON_DEVICES = triton_devices()
pytestmark = pytest.mark.skipif(not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")

#: Largest id + 1 drawn per dtype (the narrow dtypes pack ids directly, int64 goes through ranks).
VOCAB = {torch.uint8: 200, torch.int8: 100, torch.int16: 30_000, torch.int32: 10**6, torch.int64: 10**12}


def _ids(batch: int, length: int, vocab: int, dtype: torch.dtype, padding: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=gen, dtype=torch.int64)
    if padding and dtype != torch.uint8:  # uint8 has no negative padding id
        ids[torch.rand(batch, length, generator=gen) < padding] = -1
    return ids.to(dtype)


def _assert_same_plan(ids: torch.Tensor, n: int, device: str) -> None:
    from icrl_kernels.ngram.plan_kernels import build_ngram_plan_triton

    expected = build_ngram_plan(ids, n)
    with poisoned_outputs():
        got = build_ngram_plan_triton(ids.to(device), n)
    for name, actual, wanted in zip(("perm", "meta", "count"), got, expected):
        assert actual.dtype == wanted.dtype, name
        assert torch.equal(actual.cpu(), wanted), f"{name} differs (n={n}, ids {ids.dtype} {tuple(ids.shape)})"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", list(VOCAB), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_plan_matches_pytorch_for_every_id_dtype(device, dtype, n):
    for seed, (batch, length, padding) in enumerate([(3, 50, 0.0), (2, 37, 0.2), (1, 1, 0.0), (2, 2, 0.5)]):
        _assert_same_plan(_ids(batch, length, VOCAB[dtype], dtype, padding, seed), n, device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "vocab,n",
    [(3, 2), (1, 1), (1, 3), (81, 2)],
    ids=["few-tokens", "one-token-n1", "one-token-n3", "vocab81"],
)
def test_rows_of_several_tiles(device, vocab, n):
    """Rows longer than a tile (1024 positions): a single token makes one segment across every tile edge
    (the segment start and the ranks are carried from tile to tile)."""
    from icrl_kernels.ngram.plan_kernels import PLAN_BLOCK_L

    ids = _ids(2, 2 * PLAN_BLOCK_L + 77, vocab, torch.int64, 0.05, seed=vocab + n)
    _assert_same_plan(ids, n, device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("n", [5, 6, 9], ids=["n5", "n6-fallback", "n9-beyond-L"])
def test_long_n_and_the_pytorch_fallback(device, n):
    """``L = 8``: ranks pack in base 8, so ``n = 5`` still packs (8^5 fits 63 bits with room); the rows
    below take ``n`` up to beyond ``L`` (no n-gram fits: every key -1). At ``L = 2000`` six ranks do not
    fit 63 bits: the PyTorch plan (with its re-ranking) is used, with the same result."""
    _assert_same_plan(_ids(2, 8, 3, torch.int64, 0.1, seed=n), n, device)
    _assert_same_plan(_ids(1, 2000, 5, torch.int64, 0.0, seed=n), n, device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_ngram_plan_and_attention_take_the_kernels(device, monkeypatch):
    """The public :func:`ngram_plan` and ``ngram_attention(backend="triton", algorithm="sort")`` build the
    plan with the kernels (the PyTorch builder is not called) and give the reference's outputs."""
    from icrl_kernels.ngram import plan as plan_module

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch plan builder ran on the Triton backend")

    ids = _ids(2, 45, 4, torch.int64, 0.1, seed=11).to(device)
    expected = build_ngram_plan(ids.cpu(), 2)
    monkeypatch.setattr(plan_module, "build_ngram_plan", refuse)
    built = ngram_plan(ids, 2)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(built, expected))
    h = torch.randn(2, 45, 8, generator=torch.Generator().manual_seed(3)).to(device)
    out = ngram_attention(h, ids, 2, backend="triton", algorithm="sort")
    assert_close_rel(out.cpu(), ngram_attention_reference(h.cpu(), ids.cpu(), 2))


_OFFLINE_COMPILE = """
from icrl_kernels.ngram import plan_kernels as k
from benchmarks.kernel_tools import CompileJob, compile_offline

# The benchmark's rows (L = 4096), int64 ids, one launch per kernel and key mode.
common = {"L": 4096, "BLOCK_L": k.PLAN_BLOCK_L}
jobs = [
    CompileJob(k._ngram_rank_kernel, {"sorted_ids_ptr": "*i64", "order_ptr": "*i64", "rank_ptr": "*i64", "L": 4096},
               common, k._PLAN_WARPS, 3, {"mode": "rank"}),
    *[CompileJob(k._ngram_keys_kernel, {"ids_ptr": "*i64", "rank_ptr": "*i64", "keys_ptr": "*i64", "L": 4096,
                                        "n": 2, "base": base}, {**common, "RANKED": ranked}, k._PLAN_WARPS, 3,
                 {"mode": f"keys ranked={ranked}"}) for ranked, base in ((True, 4096), (False, 2**31))],
    CompileJob(k._ngram_meta_kernel, {"sorted_keys_ptr": "*i64", "perm_ptr": "*i64", "meta_ptr": "*u8",
                                      "count_ptr": "*i32", "L": 4096},
               {**common, "SEGMENT_START_BIT": 1, "ADJACENT_BIT": 2, "VALID_BIT": 4}, k._PLAN_WARPS, 3,
               {"mode": "meta"}),
]
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_plan_kernels_compile_for_sm90_offline():
    reports = run_offline_compile(_OFFLINE_COMPILE)
    check_offline_reports(reports, {"_ngram_rank_kernel", "_ngram_keys_kernel", "_ngram_meta_kernel"})
