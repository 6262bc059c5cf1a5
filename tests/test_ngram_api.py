"""Public API of the n-gram op: validation errors, backend dispatch, custom-op checks, module, token ids."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels import NGramAttention, ngram_attention, ngram_attention_reference, resolve_backend, transition_ids
from icrl_kernels._validation import KERNEL_FLOAT_DTYPES
from icrl_kernels.ngram import function, reference
from icrl_kernels.ngram.function import (
    CPU_DENSE_MAX_LENGTH,
    TILED_MAX_LENGTH,
    _ngram_plan_op,
    ngram_attention_backward_op,
    ngram_attention_op,
    ngram_attention_tiled_backward_op,
    ngram_attention_tiled_op,
)
from icrl_kernels.ngram.plan import build_ngram_plan
from icrl_kernels.ngram.reference import ngram_attention_reference as dense_reference
from icrl_kernels.testing import assert_close_rel, triton_devices

IMPLS = ["eager"] + (["triton"] if triton_devices() else [])


def _inputs(batch=2, length=9, dim=5, vocab=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, dim, generator=gen), torch.randint(0, vocab, (batch, length), generator=gen)


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda h, ids: (h[0], ids, 1), ValueError, "h must be 3-D"),
        (lambda h, ids: (h.long(), ids, 1), TypeError, "h must have dtype"),
        (lambda h, ids: ([1.0], ids, 1), TypeError, "h must be a torch.Tensor"),
        (lambda h, ids: (h, ids[0], 1), ValueError, "ids must be 2-D"),
        (lambda h, ids: (h, ids.float(), 1), TypeError, "ids must have dtype"),
        (lambda h, ids: (h, ids[:, :-1], 1), ValueError, "ids must have shape"),
        (lambda h, ids: (h, ids, 0), ValueError, "n must be >= 1"),
        (lambda h, ids: (h, ids, -2), ValueError, "n must be >= 1"),
        (lambda h, ids: (h, ids, 1.5), TypeError, "n must be an int"),
        (lambda h, ids: (h, ids, True), TypeError, "n must be an int"),
        (lambda h, ids: (h[:0], ids[:0], 1), ValueError, "ids must have a non-empty batch"),
        (lambda h, ids: (h[:, :0], ids[:, :0], 1), ValueError, "at least one position"),
        (lambda h, ids: (h[..., :0], ids, 1), ValueError, "non-empty feature"),
        (lambda h, ids: (h.to("meta"), ids, 1), ValueError, "ids is on cpu but h is on meta"),
    ],
)
def test_bad_input_names_the_argument(make_args, error, match):
    h, ids = _inputs()
    with pytest.raises(error, match=match):
        ngram_attention(*make_args(h, ids))


def test_bad_backend():
    h, ids = _inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        ngram_attention(h, ids, 1, backend="cuda")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "eager"
    assert resolve_backend("reference", torch.device("cpu")) == "reference"


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_auto_picks_triton_under_interpreter_and_rejects_float64():
    assert resolve_backend("auto", torch.device("cpu" if not torch.cuda.is_available() else "cuda")) == "triton"
    h, ids = _inputs()
    with pytest.raises(TypeError, match="h must be float16, bfloat16 or float32"):
        ngram_attention(h.double(), ids, 1, backend="triton")


def test_plan_shape_mismatch():
    h, ids = _inputs()
    plan = build_ngram_plan(ids[:, :5], 1)
    with pytest.raises(ValueError, match="plan.perm"):
        ngram_attention(h, ids, 1, plan=plan)


def test_int32_ids_accepted():
    h, ids = _inputs()
    assert_close_rel(ngram_attention(h, ids.int(), 2, backend="eager"), ngram_attention_reference(h, ids, 2))


# --- custom-op registration ----------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck(impl):
    h, ids = _inputs(length=21, dim=6)
    perm, meta, count = _ngram_plan_op(ids, 2, impl)
    torch.library.opcheck(_ngram_plan_op, (ids, 2, impl))
    torch.library.opcheck(ngram_attention_op, (h.requires_grad_(True), perm, meta, count, impl))
    torch.library.opcheck(ngram_attention_backward_op, (torch.randn_like(h), perm, meta, count, impl))


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_opcheck_tiled():
    h, ids = _inputs(length=21, dim=6)
    torch.library.opcheck(ngram_attention_tiled_op, (h.requires_grad_(True), ids, 2))
    _, count = ngram_attention_tiled_op(h, ids, 2)
    torch.library.opcheck(ngram_attention_tiled_backward_op, (torch.randn_like(h), ids, count, 2))


def test_algorithm_argument():
    h, ids = _inputs()
    with pytest.raises(ValueError, match="algorithm must be one of"):
        ngram_attention(h, ids, 1, algorithm="dense")
    with pytest.raises(ValueError, match="algorithm='tiled' needs the Triton backend"):
        ngram_attention(h, ids, 1, backend="eager", algorithm="tiled")


def test_tiled_max_length_per_dtype():
    """One crossover per kernel dtype; fp32 dots run on FMA units, half ones on tensor cores, so the tiled
    kernel stays ahead of the sort path to a longer L in half precision."""
    assert set(TILED_MAX_LENGTH) == set(KERNEL_FLOAT_DTYPES)
    assert all(isinstance(value, int) and value >= 1 for value in TILED_MAX_LENGTH.values())
    assert TILED_MAX_LENGTH[torch.float32] <= TILED_MAX_LENGTH[torch.bfloat16] == TILED_MAX_LENGTH[torch.float16]


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_fullgraph_module(impl):
    torch.manual_seed(0)
    layer = NGramAttention(8, 2, backend=impl)
    h, ids = _inputs(length=17, dim=8)
    h.requires_grad_(True)
    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(h, ids)
    out.square().sum().backward()
    grad_compiled = h.grad.clone()
    h.grad = None
    expected = layer(h, ids)
    expected.square().sum().backward()
    assert_close_rel(out.detach(), expected.detach(), name="compiled output")
    assert_close_rel(grad_compiled, h.grad, name="compiled grad")


def test_torch_export_module():
    layer = NGramAttention(8, 1, backend="eager")
    h, ids = _inputs(length=12, dim=8)
    exported = torch.export.export(layer, (h, ids))
    assert_close_rel(exported.module()(h, ids).detach(), layer(h, ids).detach(), name="exported")


# --- module ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_module_matches_definition(bias):
    torch.manual_seed(1)
    layer = NGramAttention(10, 3, bias=bias, backend="eager")
    h, ids = _inputs(length=40, dim=10, vocab=2)
    h.requires_grad_(True)
    expected = layer.attn_proj(ngram_attention_reference(h, ids, 3)) + layer.skip_proj(h)
    out = layer(h, ids)
    assert_close_rel(out, expected, name="module output")
    grads = torch.autograd.grad(out.sum(), [h, *layer.parameters()])
    expected_grads = torch.autograd.grad(expected.sum(), [h, *layer.parameters()])
    for name, grad, expected_grad in zip(["h", "W_a", "b_a", "W_h", "b_h"], grads, expected_grads):
        assert_close_rel(grad, expected_grad, name=f"grad {name}")
    assert (layer.attn_proj.bias is None) == (not bias)


def test_module_rejects_bad_config():
    with pytest.raises(ValueError, match="n must be >= 1"):
        NGramAttention(8, 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        NGramAttention(8, 1, backend="gpu")


# --- token ids ---------------------------------------------------------------------------------


def test_transition_ids_bijective_and_padding():
    states, actions, rewards = torch.meshgrid(torch.arange(4), torch.arange(5), torch.arange(2), indexing="ij")
    ids = transition_ids(states, actions, rewards, num_states=4, num_actions=5, num_rewards=2)
    assert sorted(ids.flatten().tolist()) == list(range(40))
    assert torch.equal(ids, (states * 5 + actions) * 2 + rewards)
    padded = transition_ids(torch.tensor([1, -1]), torch.tensor([0, 0]), torch.tensor([1, 0]),
                            num_states=4, num_actions=5, num_rewards=2)  # fmt: skip
    assert padded.tolist() == [11, -1]
    assert transition_ids(torch.tensor([[3, -1]]), num_states=4, mode="state").tolist() == [[3, -1]]


def test_transition_ids_errors():
    with pytest.raises(ValueError, match="actions must be < 5"):
        transition_ids(
            torch.tensor([0]), torch.tensor([5]), torch.tensor([0]), num_states=1, num_actions=5, num_rewards=2
        )
    with pytest.raises(ValueError, match="states must be < 3"):
        transition_ids(torch.tensor([3]), num_states=3, mode="state")
    with pytest.raises(ValueError, match="needs actions and rewards"):
        transition_ids(torch.tensor([0]), num_states=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        transition_ids(torch.tensor([0]), num_states=3, mode="states")


# --- which path runs: a spy on each path's entry point ----------------------------------------------


@pytest.fixture
def ran_paths(monkeypatch) -> list[str]:
    """The paths ``ngram_attention`` takes, in call order: ``"reference"`` (dense), ``"sort-<impl>"`` (the
    sort path, eager or Triton) and ``"tiled"``. Each spy calls the real function."""
    calls: list[str] = []

    def spy(name, real):
        def wrapper(*args):
            calls.append(name(args) if callable(name) else name)
            return real(*args)

        return wrapper

    monkeypatch.setattr(reference, "ngram_attention_reference", spy("reference", reference.ngram_attention_reference))
    sort_path = spy(lambda args: f"sort-{args[-1]}", function.ngram_attention_op)  # args[-1]: the impl
    monkeypatch.setattr(function, "ngram_attention_op", sort_path)
    monkeypatch.setattr(function, "ngram_attention_tiled_op", spy("tiled", function.ngram_attention_tiled_op))
    return calls


def _check_against_reference(h, ids, n, **kwargs):
    """``ngram_attention(**kwargs)`` output and gradient against the reference on the same inputs (the spec
    itself, bound at import: :func:`ran_paths` spies on the module attribute that the op calls)."""
    h = h.detach().requires_grad_(True)
    h_ref = h.detach().clone().requires_grad_(True)
    out = ngram_attention(h, ids, n, **kwargs)
    with torch.no_grad():
        expected = dense_reference(h_ref.detach(), ids, n)
    assert out.dtype == h.dtype and out.shape == h.shape
    assert_close_rel(out, expected, name="output")
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, h, grad_out)
    (grad_ref,) = torch.autograd.grad(dense_reference(h_ref, ids, n), h_ref, grad_out)
    assert_close_rel(grad, grad_ref, name="grad_h")


@pytest.fixture
def no_triton(monkeypatch):
    """A CPU process without Triton's interpreter: ``backend="auto"`` resolves to the eager backend."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", torch.device("cpu")) == "eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_auto_is_dense_up_to_the_crossover_then_sort(no_triton, ran_paths, monkeypatch, dtype):
    monkeypatch.setattr(function, "CPU_DENSE_MAX_LENGTH", 24)
    for length, path in ((1, "reference"), (24, "reference"), (25, "sort-eager"), (61, "sort-eager")):
        h, ids = _inputs(batch=3, length=length, dim=7, vocab=3, seed=length)
        ids[0, ::5] = -1  # padding
        ran_paths.clear()
        _check_against_reference(h.to(dtype), ids, 2, backend="auto")
        assert ran_paths == [path], (length, ran_paths)


def test_cpu_auto_at_the_real_constants(no_triton, ran_paths):
    """The shipped constants: dense at ``CPU_DENSE_MAX_LENGTH``, sort one past it (B = 1, D = 4); with
    ``D = CPU_WIDE_DIM`` the same lengths stay dense up to ``CPU_DENSE_MAX_LENGTH_WIDE``."""
    wide = function.CPU_DENSE_MAX_LENGTH_WIDE
    cases = [(CPU_DENSE_MAX_LENGTH, 4, "reference"), (CPU_DENSE_MAX_LENGTH + 1, 4, "sort-eager"),
             (wide, function.CPU_WIDE_DIM, "reference"), (wide + 1, function.CPU_WIDE_DIM, "sort-eager"),
             (wide, function.CPU_WIDE_DIM - 1, "sort-eager")]  # fmt: skip
    assert CPU_DENSE_MAX_LENGTH < wide
    for length, dim, path in cases:
        h, ids = _inputs(batch=1, length=length, dim=dim, vocab=5, seed=1)
        ran_paths.clear()
        _check_against_reference(h, ids, 1)  # backend="auto" is the default
        assert ran_paths == [path], (length, dim)


def test_cpu_auto_forced_paths_and_plan(no_triton, ran_paths, monkeypatch):
    """``backend="eager"`` always sorts; a given plan keeps ``"auto"`` on the sort path (and is used); a
    pattern above ``CPU_DENSE_MAX_PATTERN_ELEMENTS`` takes the sort path whatever ``L``."""
    h, ids = _inputs(batch=2, length=20, dim=6, vocab=3)
    _check_against_reference(h, ids, 2, backend="eager")
    assert ran_paths == ["sort-eager"]
    ran_paths.clear()
    _check_against_reference(h, ids, 2, backend="auto", plan=build_ngram_plan(ids, 2))
    assert ran_paths == ["sort-eager"]
    ran_paths.clear()
    _check_against_reference(h, ids, 2, backend="reference")
    assert ran_paths == ["reference"]
    ran_paths.clear()
    monkeypatch.setattr(function, "CPU_DENSE_MAX_PATTERN_ELEMENTS", 2 * 20 * 20 - 1)
    _check_against_reference(h, ids, 2, backend="auto")
    assert ran_paths == ["sort-eager"]
    ran_paths.clear()
    _check_against_reference(h[:1], ids[:1], 2, backend="auto")
    assert ran_paths == ["reference"]


def test_cpu_auto_module_follows(no_triton, ran_paths, monkeypatch):
    """``NGramAttention(backend="auto")`` takes the same CPU paths as the function."""
    monkeypatch.setattr(function, "CPU_DENSE_MAX_LENGTH", 16)
    torch.manual_seed(2)
    layer = NGramAttention(6, 2)
    for length, path in ((16, "reference"), (17, "sort-eager")):
        h, ids = _inputs(length=length, dim=6, seed=length)
        ran_paths.clear()
        out = layer(h, ids)
        assert ran_paths == [path]
        expected = layer.attn_proj(ngram_attention_reference(h, ids, 2)) + layer.skip_proj(h)
        assert_close_rel(out, expected, name="module output")
    ran_paths.clear()
    layer(h, ids, plan=build_ngram_plan(ids, 2))
    assert ran_paths == ["sort-eager"]


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_auto_with_triton_never_takes_the_cpu_dense_path(ran_paths):
    """Where Triton runs (here: the interpreter), ``"auto"`` is Triton even below ``CPU_DENSE_MAX_LENGTH``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h, ids = _inputs(length=20, dim=6)
    _check_against_reference(h.to(device), ids.to(device), 2)
    assert ran_paths == ["tiled"]


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_auto_algorithm_uses_the_dtype_crossover(ran_paths, monkeypatch):
    """``algorithm="auto"`` compares ``L`` with ``TILED_MAX_LENGTH[h.dtype]``; a plan always means sort."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setitem(function.TILED_MAX_LENGTH, torch.float32, 16)
    monkeypatch.setitem(function.TILED_MAX_LENGTH, torch.float16, 32)
    h, ids = _inputs(length=24, dim=6, vocab=2)
    h, ids = h.to(device), ids.to(device)
    _check_against_reference(h, ids, 2, backend="triton")
    _check_against_reference(h.half(), ids, 2, backend="triton")
    _check_against_reference(h.half(), ids, 2, backend="triton", plan=build_ngram_plan(ids, 2))
    assert ran_paths == ["sort-triton", "tiled", "sort-triton"]


# --- the tiled kernel: compile-time n ---------------------------------------------------------------


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiled_every_n_on_the_same_inputs(dtype):
    """``n`` is a constexpr of the tiled kernels (one compile each): successive calls with n = 1..5 and back
    to 1 on the same ids must each match the reference (a compile reused across n would not). L = 100
    spans two 64-query tiles and four 32-key tiles, so both the below-diagonal loops (no causal compare)
    and the diagonal ones run; vocabulary 2 gives matches at every n."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 2, (2, 100), generator=gen)
    ids[1, 40:47] = -1
    h = torch.randn(2, 100, 20, generator=gen).to(dtype)
    for n in (1, 2, 3, 4, 5, 1):
        _check_against_reference(h.to(device), ids.to(device), n, backend="triton", algorithm="tiled")


def test_tiled_autotune_key():
    """The tiled kernels re-tune per feature width, ``size_bucket(B * L)``, ``n`` and dot precision."""
    pytest.importorskip("triton")
    from icrl_kernels.ngram import tiled_kernels

    for kernel in (tiled_kernels._ngram_tiled_forward_kernel, tiled_kernels._ngram_tiled_backward_kernel):
        assert list(kernel.keys) == ["D", "SIZE_BUCKET", "N", "HALF_DOT"]


_OFFLINE_COMPILE_TILED = """
import itertools
from icrl_kernels.ngram import tiled_kernels
from benchmarks.kernel_tools import compile_offline, config_jobs

# D = 512 (benchmarks/bench_ngram_attention.py; D = 64 and 256 specialise the same: multiples of 16) at
# L = 1024, the longest L that algorithm="auto" sends to the tiled kernel; n = 1, 2 and 4 (N-Gram AD
# stacks 1, 2, 3 or 1, 2, 4; register use grows with the unrolled n). Every config in bf16 (fp16 takes
# the same path) and fp32.
jobs = []
for kernel, dtype, n in itertools.product(
    [tiled_kernels._ngram_tiled_forward_kernel, tiled_kernels._ngram_tiled_backward_kernel], ["bf16", "fp32"], [1, 2, 4]
):
    L, D = 1024, 512
    signature = {"ids_ptr": "*i64", "count_ptr": "*i32", "L": L, "D": D, "SIZE_BUCKET": 8 * L,
                 **dict.fromkeys(("h_ptr", "out_ptr", "grad_out_ptr", "grad_h_ptr"), "*" + dtype),
                 **dict.fromkeys(("stride_hb", "stride_ob", "stride_gb"), L * D),  # contiguous [B, L, D]
                 **dict.fromkeys(("stride_hl", "stride_ol", "stride_gl"), D)}
    jobs += config_jobs(kernel, signature, {"N": n, "HALF_DOT": dtype == "bf16"}, L=L, D=D, dtype=dtype, n=n)
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_tiled_kernels_compile_for_sm90_offline():
    """Every autotune config of both tiled kernels compiles to sm_90 at n = 1, 2, 4 in bf16 and fp32
    without spilling more than ``MAX_SPILL_BYTES`` per thread (run with ``-s`` for the register report)."""
    reports = run_offline_compile(_OFFLINE_COMPILE_TILED)
    check_offline_reports(reports, {"_ngram_tiled_forward_kernel", "_ngram_tiled_backward_kernel"})
    assert len(reports) == 2 * 3 * (len(function_configs("forward")) + len(function_configs("backward")))


def function_configs(which: str) -> tuple:
    from icrl_kernels._triton import autotune_configs
    from icrl_kernels.ngram import tiled_kernels

    return autotune_configs(getattr(tiled_kernels, f"_ngram_tiled_{which}_kernel"))


# --- vmap: the run dimension of batched training folds into the batch ---------------------------


def _vmap_cases() -> list:
    """Every path's op once; the Triton sort path on CUDA only (under the interpreter it takes ~40 s here, and
    its ops are the eager path's with another ``impl``)."""
    cases = [("eager", "sort", "cpu"), ("reference", "auto", "cpu")]
    cases += [("triton", "tiled", device) for device in triton_devices()]
    cases += [("triton", "sort", device) for device in triton_devices() if device == "cuda"]
    return [pytest.param(*case, id="-".join(case)) for case in cases]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend, algorithm, device", _vmap_cases())
def test_vmap_over_runs_equals_each_run_alone(backend, algorithm, device, dtype):
    """``torch.func.vmap`` over a leading run dimension (icrl_models.batched: K models in one program) gives
    each run's own output and gradient, with ids vmapped or shared by the runs, padding ids included; the
    custom ops run once with the runs folded into their batch (fold_vmap_into_batch)."""
    gen = torch.Generator().manual_seed(3)
    runs, batch, length, dim = 3, 2, 11, 5  # odd sizes
    h = torch.randn(runs, batch, length, dim, generator=gen).to(device, dtype).requires_grad_()
    ids = torch.randint(0, 3, (runs, batch, length), generator=gen)
    ids[1, 0, 4:6] = -1
    ids = ids.to(device)
    weight = torch.randn(runs, batch, length, dim, generator=gen).to(device, dtype)
    kwargs = {"backend": backend} | ({"algorithm": algorithm} if backend == "triton" else {})
    for shared in (False, True):
        run_ids = ids[0].expand(runs, batch, length) if shared else ids
        mapped = torch.vmap(lambda x, i: ngram_attention(x, i, 2, **kwargs), in_dims=(0, None if shared else 0))
        out = mapped(h, ids[0] if shared else ids)
        (grad,) = torch.autograd.grad((out * weight).sum(), h)
        want = torch.stack([ngram_attention(h[k], run_ids[k], 2, **kwargs) for k in range(runs)])
        (want_grad,) = torch.autograd.grad((want * weight).sum(), h)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), torch.stack([ngram_attention_reference(h[k].detach().float(),
                                   run_ids[k], 2) for k in range(runs)]), rtol=2e-2, atol=2e-2)  # fmt: skip


def test_vmap_of_the_plan_op_folds_runs_into_the_batch():
    ids = torch.randint(0, 4, (3, 2, 10), generator=torch.Generator().manual_seed(0))
    perm, meta, count = torch.vmap(lambda i: _ngram_plan_op(i, 2, "eager"))(ids)
    for run in range(3):
        want = build_ngram_plan(ids[run], 2)
        assert torch.equal(perm[run], want.perm) and torch.equal(meta[run], want.meta)
        assert torch.equal(count[run], want.count)
