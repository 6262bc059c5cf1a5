"""N-gram attention under hostile values and sizes (issue 18): outliers stay in their own segment,
huge ``n`` costs O(1) in ``n``, plans of other inputs are rejected, token ids never wrap.

The outlier tests compare against the float64 reference with the outlier zeroed: an output (gradient)
row that does not average over the outlier must not change when it is ``1e30`` instead of 0. Before
the segmented sums these failed: the eager path took differences of a prefix sum over the whole sorted
row (``(1e20 + S) - 1e20 = 0``), the Triton sort path subtracted the adjacent key from an inclusive sum.
"""

from __future__ import annotations

import contextlib
import signal

import pytest
import torch

from icrl_kernels import NGramDecodeState, ngram_attention, ngram_attention_reference, ngram_plan, transition_ids
from icrl_kernels.ngram.reference import ngram_match_matrix
from icrl_kernels.testing import assert_close_rel, triton_devices

TRITON_DEVICES = triton_devices()
DEVICE = TRITON_DEVICES[0] if TRITON_DEVICES else None
# The device is not a parameter here, so the Triton cases carry the ``gpu`` marker themselves on CUDA.
_TRITON_MARKS = [pytest.mark.gpu] if DEVICE == "cuda" else []
# (backend, algorithm, chunk): chunk None is the launcher's own chunking (one chunk at these lengths).
PATHS = [pytest.param("eager", "auto", None, id="eager"), pytest.param("reference", "auto", None, id="reference")]
TRITON_PATHS = []
if TRITON_DEVICES:
    TRITON_PATHS = [pytest.param("triton", "sort", None, id="triton-sort", marks=_TRITON_MARKS)]
    PATHS += TRITON_PATHS
# Chunks of 5 positions, so that segments cross chunk boundaries (carry pass + look-back): ~10x more
# interpreted programs, so one test only.
CHUNKED_PATHS = PATHS + (
    [pytest.param("triton", "sort", 5, id="triton-sort-chunk5", marks=_TRITON_MARKS)] if TRITON_DEVICES else []
)
# Non-finite values stay in their segment on the sort paths only: the dense ones (the reference, the
# tiled kernel) multiply 0/1 patterns with h, and 0 * inf = nan reaches the whole batch row (tile), as
# documented in ngram_attention's docstring.
NON_FINITE_PATHS = [p for p in PATHS if p.values[0] != "reference"]


def _device(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def _chunked(chunk: int | None):
    if not chunk:
        return contextlib.nullcontext()
    from icrl_kernels.ngram import kernels as ngram_kernels  # needs triton: only the Triton paths get here

    return ngram_kernels.forced_chunk_length(chunk)


def _inputs(seed: int, length: int = 40, vocab: int = 3, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[0, 7] = -1  # padding: its own (invalid) segment
    return gen, ids


def _key_with_matches(ids: torch.Tensor, n: int) -> tuple[int, int, torch.Tensor]:
    """A key position ``(b, t)`` that some queries match and some matching-capable queries do not."""
    pattern = ngram_match_matrix(ids, n)
    b = 0
    matches = pattern[b].sum(0)  # per key: how many queries read it
    t = int(torch.argmax((matches > 0).int() * torch.arange(ids.shape[1]).flip(0)))  # an early key
    assert matches[t] > 0
    return b, t, pattern


def _cases(paths, cases, triton_cases):
    """``paths x cases``, except that the Triton paths (~2 ms per interpreted program, and a chunked
    sort launches hundreds) take only ``triton_cases``, a subset covering each dtype and ``n`` once (the
    forced-chunk path only the first)."""
    out = []
    for path in paths:
        is_triton = path.values[0] == "triton"
        chunked = is_triton and path.values[2] is not None  # ~10x the programs: the first case only
        for case in (triton_cases[:1] if chunked else triton_cases) if is_triton else cases:
            out.append(pytest.param(*path.values, *case, id=f"{path.id}-" + "-".join(map(str, case)), marks=path.marks))
    return out


H_OUTLIERS = [(torch.float32, 1e20), (torch.float32, -3e38), (torch.float16, 6e4), (torch.bfloat16, 1e30)]


@pytest.mark.parametrize(
    "backend,algorithm,chunk,dtype,outlier,n",
    _cases(
        CHUNKED_PATHS,
        [(dtype, outlier, n) for dtype, outlier in H_OUTLIERS for n in (1, 2)],
        [(torch.float32, 1e20, 2), (torch.float16, 6e4, 1), (torch.bfloat16, 1e30, 2)],
    ),
)
def test_outlier_in_h_stays_in_its_segment(backend, algorithm, chunk, dtype, outlier, n):
    gen, ids = _inputs(seed=11 + n)
    h = torch.randn(*ids.shape, 12, generator=gen, dtype=torch.float64)
    b, t, pattern = _key_with_matches(ids, n)
    h_outlier = h.clone()
    h_outlier[b, t, 3] = outlier
    device = _device(backend)
    with _chunked(chunk):
        out = ngram_attention(h_outlier.to(device, dtype), ids.to(device), n, backend=backend, algorithm=algorithm)
    h_zero = h.clone()
    h_zero[b, t, 3] = 0
    expected = ngram_attention_reference(h_zero, ids, n)  # float64
    unaffected = ~pattern[:, :, t].clone()
    unaffected[1 - b] = True  # the other batch row never sees it
    affected = ~unaffected
    assert affected.any() and unaffected[b].sum() > 5
    assert_close_rel(out.cpu()[unaffected].double(), expected[unaffected], rms_tol=_tol(dtype), name="unaffected rows")
    # Rows that do average over the outlier still get every other column right.
    others = [c for c in range(12) if c != 3]
    got = out.cpu()[affected][:, others].double()
    assert_close_rel(got, expected[affected][:, others], rms_tol=_tol(dtype), name="other columns")


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize(
    "backend,algorithm,chunk,dtype,outlier,n",
    _cases(
        PATHS,
        [(dtype, outlier, n) for dtype, outlier in [(torch.float32, 1e30), (torch.float16, 6e4)] for n in (1, 2)],
        [(torch.float32, 1e30, 2), (torch.float16, 6e4, 1)],
    ),
)
def test_outlier_in_grad_out_stays_in_its_segment(backend, algorithm, chunk, dtype, outlier, n):
    gen, ids = _inputs(seed=23 + n)
    h = torch.randn(*ids.shape, 10, generator=gen)
    grad_out = torch.randn(*ids.shape, 10, generator=gen, dtype=torch.float64)
    pattern = ngram_match_matrix(ids, n)
    b = 0
    i = int(torch.nonzero(pattern[b].any(1)).flatten()[-1])  # a query with matches
    grad_outlier = grad_out.clone()
    grad_outlier[b, i, 2] = outlier
    device = _device(backend)
    h_dev = h.to(device, dtype).requires_grad_(True)
    with _chunked(chunk):
        out = ngram_attention(h_dev, ids.to(device), n, backend=backend, algorithm=algorithm)
        (grad,) = torch.autograd.grad(out, h_dev, grad_outlier.to(device, dtype))
    grad_zero = grad_out.clone()
    grad_zero[b, i, 2] = 0
    h_ref = h.double().requires_grad_(True)
    (expected,) = torch.autograd.grad(ngram_attention_reference(h_ref, ids, n), h_ref, grad_zero)
    unaffected = ~pattern[:, i, :].clone()  # keys the outlying query does not read
    unaffected[1 - b] = True
    assert (~unaffected).any()
    assert_close_rel(grad.cpu()[unaffected].double(), expected[unaffected], rms_tol=_tol(dtype), name="grad rows")
    others = [c for c in range(10) if c != 2]
    got = grad.cpu()[~unaffected][:, others].double()
    assert_close_rel(got, expected[~unaffected][:, others], rms_tol=_tol(dtype), name="other columns")


@pytest.mark.parametrize(
    "backend,algorithm,chunk,value",
    _cases(
        NON_FINITE_PATHS,
        [(float("inf"),), (float("-inf"),), (float("nan"),)],
        [(float("inf"),), (float("nan"),)],
    ),
)
def test_non_finite_h_reaches_only_matching_rows(backend, algorithm, chunk, value):
    """On the sort paths a non-finite ``h`` entry propagates exactly to the outputs that average over it."""
    gen, ids = _inputs(seed=5)
    h = torch.randn(*ids.shape, 6, generator=gen)
    b, t, pattern = _key_with_matches(ids, 1)
    h[b, t, 1] = value
    device = _device(backend)
    h_dev = h.to(device).requires_grad_(True)
    with _chunked(chunk):
        out = ngram_attention(h_dev, ids.to(device), 1, backend=backend, algorithm=algorithm).cpu()
        grad_out = torch.randn(out.shape, generator=gen)
        grad_out[b, t + 1, 4] = value  # and one in the gradient
        (grad,) = torch.autograd.grad(out, h_dev, grad_out)  # out is on the CPU already
    grad = grad.cpu()  # on h's device: the masks below are built on the CPU
    affected = torch.zeros_like(pattern[:, :, t])
    affected[b] = pattern[b, :, t]
    assert affected.any()
    column = out[..., 1]
    if value != value:
        assert column[affected].isnan().all()
    else:
        assert (column[affected] == value).all()
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[..., 1] = ~affected
    assert torch.isfinite(out[finite]).all()
    grad_affected = torch.zeros_like(pattern[:, t + 1, :])
    grad_affected[b] = pattern[b, t + 1, :]
    finite_grad = torch.ones_like(grad, dtype=torch.bool)
    finite_grad[..., 4] = ~grad_affected
    assert torch.isfinite(grad[finite_grad]).all()
    if grad_affected.any():
        assert (~torch.isfinite(grad[..., 4][grad_affected])).all()


# --- n far above L -------------------------------------------------------------------------------


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail (instead of hanging CI) if the block runs longer than ``seconds``."""

    def timeout(signum, frame):
        raise TimeoutError(f"took more than {seconds} s: work grows with n")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


HUGE_N_PATHS = [("eager", "auto"), ("reference", "auto"), ("auto", "auto")] + (
    [pytest.param("triton", algorithm, marks=_TRITON_MARKS) for algorithm in ("sort", "tiled", "auto")]
    if TRITON_DEVICES
    else []
)


@pytest.mark.parametrize("backend,algorithm", HUGE_N_PATHS)
@pytest.mark.parametrize("n", [10**9, 13, 12])
def test_huge_n_gives_zeros_quickly(backend, algorithm, n):
    ids = torch.zeros(2, 11, dtype=torch.long)  # one repeated token: every n <= 10 would match
    device = _device(backend) if backend != "auto" else "cpu"
    h = torch.randn(2, 11, 5, device=device, requires_grad=True)
    with _deadline(120):  # generous for a loaded CPU (20 s was hit beside 3 other jobs); 10**9 work never ends
        out = ngram_attention(h, ids.to(device), n, backend=backend, algorithm=algorithm)
        (grad,) = torch.autograd.grad(out, h, torch.ones_like(out))
    assert torch.equal(out.cpu(), torch.zeros(2, 11, 5)) and torch.equal(grad.cpu(), torch.zeros(2, 11, 5))


def test_huge_n_plan_and_decode_quickly():
    ids = torch.zeros(2, 11, dtype=torch.long)
    h = torch.randn(2, 11, 5)
    with _deadline(120):
        plan = ngram_plan(ids, 10**9)
        assert plan.n == 10**9 and torch.equal(plan.count, torch.zeros(2, 11, dtype=torch.int32))
        out = ngram_attention(h, ids, 10**9, backend="eager", plan=plan)
        state = NGramDecodeState(2, 5, 10**9, max_len=11)
        steps = [state.step(h[:, i], ids[:, i]) for i in range(11)]
    assert torch.equal(out, torch.zeros_like(h)) and torch.equal(torch.stack(steps, 1), torch.zeros_like(h))
    assert state.table_keys.numel() <= 2 * 11  # not B * max_len * n
    with pytest.raises(ValueError, match="max_len"):
        state.step(h[:, 0], ids[:, 0])


def test_decode_n_equal_max_len_still_matches_full_op():
    """The O(1)-in-n shortcut starts only beyond max_len: n == max_len keeps the normal tables."""
    ids = torch.tensor([[1, 1, 1, 1]])
    h = torch.randn(1, 4, 3)
    state = NGramDecodeState(1, 3, 4, max_len=4)
    steps = torch.stack([state.step(h[:, i], ids[:, i]) for i in range(4)], 1)
    assert_close_rel(steps, ngram_attention_reference(h, ids, 4))


# --- plans built from other inputs ----------------------------------------------------------------


def _plan_case(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (2, 20), generator=gen)
    h = torch.randn(2, 20, 4, generator=gen)
    return h, ids


@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_plan_of_other_n_rejected(backend):
    h, ids = _plan_case()
    with pytest.raises(ValueError, match=r"plan was built for n=2, but n=3"):
        ngram_attention(h, ids, 3, backend=backend, plan=ngram_plan(ids, 2))


def test_plan_of_other_ids_rejected():
    h, ids = _plan_case()
    other = ids.clone()
    other[1, 5] = (other[1, 5] + 1) % 3
    with pytest.raises(ValueError, match="plan was built from other ids"):
        ngram_attention(h, ids, 2, plan=ngram_plan(other, 2))
    # ... also when the very tensor it was built from is modified in place afterwards.
    plan = ngram_plan(ids, 2)
    ids[0, 0] = (ids[0, 0] + 1) % 3
    with pytest.raises(ValueError, match="plan was built from ids that were modified in place"):
        ngram_attention(h, ids, 2, plan=plan)


def test_plan_of_equal_ids_accepted():
    h, ids = _plan_case()
    plan = ngram_plan(ids.int(), 2)  # other dtype, other tensor, same values
    assert_close_rel(ngram_attention(h, ids, 2, plan=plan), ngram_attention_reference(h, ids, 2))
    assert_close_rel(ngram_attention(h, ids.clone(), 2, plan=ngram_plan(ids, 2)), ngram_attention_reference(h, ids, 2))


@pytest.mark.parametrize("plan", [(1, 2, 3), "plan", torch.zeros(3)], ids=["tuple", "str", "tensor"])
def test_plan_of_wrong_type_rejected(plan):
    h, ids = _plan_case()
    with pytest.raises(TypeError, match="plan must be an NGramPlan"):
        ngram_attention(h, ids, 2, plan=plan)


def test_plan_tuple_of_its_tensors_rejected():
    """A bare tuple of the plan's tensors records no ids or n: rejected, not trusted."""
    h, ids = _plan_case()
    with pytest.raises(TypeError, match="plan must be an NGramPlan"):
        ngram_attention(h, ids, 2, plan=tuple(ngram_plan(ids, 2)))


# --- transition ids past int64 ---------------------------------------------------------------------


def test_transition_ids_overflow_rejected():
    states = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"num_states=4294967296, num_actions=4294967296, num_rewards=2"):
        transition_ids(states, states, states, num_states=2**32, num_actions=2**32, num_rewards=2)


def test_transition_ids_at_the_int64_limit():
    """``num_states * num_actions * num_rewards == 2**63``: the largest id is ``2**63 - 1``, still exact."""
    states = torch.tensor([[2**61 - 1, 0]])
    actions = torch.tensor([[1, 0]])
    rewards = torch.tensor([[1, 0]])
    ids = transition_ids(states, actions, rewards, num_states=2**61, num_actions=2, num_rewards=2)
    assert ids.tolist() == [[2**63 - 1, 0]]


@pytest.mark.parametrize(
    "backend,algorithm,chunk,dtype,outlier",
    _cases(PATHS, [(torch.float32, 1e20), (torch.float16, 6e4)], [(torch.float32, 1e20)]),
)
def test_outlier_left_out_as_j_equals_i_does_not_cancel(backend, algorithm, chunk, dtype, outlier):
    """One repeated token: the query at ``i`` reads every key ``j < i`` but not ``j = i`` (strict). With
    ``h[6]`` an outlier, query 6 must not see it (a running sum minus the excluded key cancelled to 0),
    and no key but ``j < 6`` may see ``grad_out[6]``."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.zeros(1, 12, dtype=torch.long)
    h = torch.randn(1, 12, 3, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(1, 12, 3, generator=gen, dtype=torch.float64)
    h_outlier, grad_outlier = h.clone(), grad_out.clone()
    h_outlier[0, 6, 0] = outlier
    grad_outlier[0, 6, 0] = outlier
    device = _device(backend)
    h_dev = h_outlier.to(device, dtype).requires_grad_(True)
    with _chunked(chunk):
        out = ngram_attention(h_dev, ids.to(device), 1, backend=backend, algorithm=algorithm)
        (grad,) = torch.autograd.grad(out, h_dev, grad_outlier.to(device, dtype))
    h_ref = h.clone()
    h_ref[0, 6, 0] = 0
    h_ref.requires_grad_(True)
    grad_ref = grad_out.clone()
    grad_ref[0, 6, 0] = 0
    expected = ngram_attention_reference(h_ref, ids, 1)
    (expected_grad,) = torch.autograd.grad(expected, h_ref, grad_ref)
    assert_close_rel(out.cpu()[0, :7].double(), expected[0, :7].detach(), rms_tol=_tol(dtype), name="queries <= 6")
    assert_close_rel(grad.cpu()[0, 6:].double(), expected_grad[0, 6:], rms_tol=_tol(dtype), name="keys >= 6")
