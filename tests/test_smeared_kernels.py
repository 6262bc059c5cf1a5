"""Smeared keys: Triton and eager paths against the fp32 reference (outputs, grad k, grad alpha), the
custom-op registration, argument errors, and the ``SmearedKeyAttention`` module.

Every test draws fresh random inputs; kernel outputs (and the backward's per-program partials) start
NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels import resolve_backend
from icrl_kernels.modules.smeared_attention import SmearedKeyAttention
from icrl_kernels.smeared import smeared_keys, smeared_keys_reference
from icrl_kernels.smeared.function import smeared_keys_backward_op, smeared_keys_op
from icrl_kernels.testing import (
    RMS_TOLERANCE,
    TESTED_DTYPES,
    assert_close_rel,
    fast_impls,
    fast_paths,
    triton_devices,
)

FAST_PATHS = fast_paths()
IMPLS = fast_impls()
DTYPES = list(TESTED_DTYPES)


def random_inputs(shape, *, dtype=torch.float32, alpha_dtype=torch.float32, device="cpu", seed=0):
    """``k [B, H, L, Dh]`` and ``alpha [H]``; alpha spans saturated and balanced blends."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    alpha = (3 * torch.randn(shape[1], generator=gen)).to(device=device, dtype=alpha_dtype)
    return k, alpha


def check_parity(k: torch.Tensor, alpha: torch.Tensor, backend: str) -> None:
    """Output, grad k and grad alpha of ``backend`` against the reference evaluated in fp32 on the same values."""
    k = k.detach().requires_grad_(True)
    alpha = alpha.detach().requires_grad_(True)
    k_ref = k.detach().float().requires_grad_(True)
    alpha_ref = alpha.detach().float().requires_grad_(True)
    out = smeared_keys(k, alpha, backend=backend)
    ref = smeared_keys_reference(k_ref, alpha_ref)
    assert out.dtype == k.dtype and out.shape == k.shape
    assert_close_rel(out, ref, name=f"{backend} output")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out)
    grad_k, grad_alpha = torch.autograd.grad(out, (k, alpha), grad_out)
    grad_k_ref, grad_alpha_ref = torch.autograd.grad(ref, (k_ref, alpha_ref), grad_out.float())
    assert grad_k.dtype == k.dtype and grad_alpha.dtype == alpha.dtype
    assert_close_rel(grad_k, grad_k_ref, name=f"{backend} grad k")
    # grad alpha is an fp32 sum of B * L * Dh exact products (inputs are the same values), rounded to
    # alpha's dtype: its tolerance is alpha's, whatever the precision of k.
    assert_close_rel(grad_alpha, grad_alpha_ref, rms_tol=RMS_TOLERANCE[alpha.dtype], name=f"{backend} grad alpha")


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (2, 3, 37, 19),  # odd sizes everywhere
        (2, 2, 1, 8),  # L = 1: only the current key
        (1, 2, 130, 70),  # several position blocks
        (1, 2, 45, 200),  # two feature blocks
        (3, 1, 6, 1),  # one head, one feature
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_parity(backend, device, dtype, shape):
    k, alpha = random_inputs(shape, dtype=dtype, device=device, seed=sum(shape))
    check_parity(k, alpha, backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("alpha_dtype", [torch.float16, torch.bfloat16])
def test_low_precision_alpha(backend, device, alpha_dtype):
    k, alpha = random_inputs((2, 3, 21, 12), alpha_dtype=alpha_dtype, device=device, seed=4)
    check_parity(k, alpha, backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_strided_keys_and_gradients(backend, device):
    """Keys as projections produce them (``[B, L, H, Dh]`` transposed) and a non-contiguous upstream gradient."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2, 29, 3, 10, generator=gen).to(device).transpose(1, 2).requires_grad_(True)
    alpha = torch.randn(3, generator=gen).to(device).requires_grad_(True)
    assert not k.is_contiguous()
    out = smeared_keys(k, alpha, backend=backend)
    ref = smeared_keys_reference(k, alpha)
    assert_close_rel(out, ref, name="strided output")
    grad_out = torch.randn(2, 10, 29, 3, generator=gen).to(device).permute(0, 3, 2, 1)  # [B, H, L, Dh], strided
    grads = torch.autograd.grad(out, (k, alpha), grad_out)
    grads_ref = torch.autograd.grad(ref, (k, alpha), grad_out)
    for name, grad, grad_ref in zip(("k", "alpha"), grads, grads_ref):
        assert_close_rel(grad, grad_ref, name=f"strided grad {name}")


def test_reference_by_hand():
    """The pinned convention: the current key weighs sigmoid(alpha), the previous one the rest, k_{-1} = 0."""
    k = torch.tensor([1.0, 10.0, 100.0]).view(1, 1, 3, 1).repeat(1, 2, 1, 1)
    alpha = torch.tensor([math.log(3.0), -50.0])  # sigmoid: 0.75 and ~0
    out = smeared_keys_reference(k, alpha)
    torch.testing.assert_close(out[0, 0, :, 0], torch.tensor([0.75, 7.75, 77.5]))
    torch.testing.assert_close(out[0, 1, :, 0], torch.tensor([0.0, 1.0, 10.0]))


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_alpha_gradient_is_deterministic(backend, device):
    k, alpha = random_inputs((3, 2, 150, 24), device=device, seed=6)
    alpha.requires_grad_(True)
    grad_out = torch.randn(k.shape, generator=torch.Generator().manual_seed(7)).to(device)
    first = torch.autograd.grad(smeared_keys(k, alpha, backend=backend), alpha, grad_out)[0]
    second = torch.autograd.grad(smeared_keys(k, alpha, backend=backend), alpha, grad_out)[0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_float64_gradcheck(backend):
    k, alpha = random_inputs((2, 2, 5, 3), dtype=torch.float64, alpha_dtype=torch.float64, seed=8)
    k.requires_grad_(True)
    alpha.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: smeared_keys(a, b, backend=backend), (k, alpha))


@pytest.mark.parametrize("backend", ["eager", "reference"] + (["triton"] if triton_devices() else []))
def test_empty_batch(backend):
    k, alpha = random_inputs((0, 2, 4, 3), seed=9)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    out = smeared_keys(k.to(device), alpha.to(device), backend=backend)
    assert out.shape == (0, 2, 4, 3)


# --- custom-op registration and errors ------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_opcheck(impl, strided):
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    k, alpha = random_inputs((2, 3, 11, 6), device=device, seed=10)
    if strided:  # the same values viewed from a [B, L, H, Dh] buffer
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(smeared_keys_op, (k.requires_grad_(True), alpha.requires_grad_(True), impl))
    grad_out = torch.randn(2, 11, 3, 6, generator=torch.Generator().manual_seed(11)).to(device).transpose(1, 2)
    grad_out = grad_out if strided else grad_out.contiguous()
    torch.library.opcheck(smeared_keys_backward_op, (grad_out, k.detach(), alpha.detach(), impl))


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda k, a: (k[0], a), ValueError, "k must be 4-D"),
        (lambda k, a: (k.long(), a), TypeError, "k must have dtype"),
        (lambda k, a: ([1.0], a), TypeError, "k must be a torch.Tensor"),
        (lambda k, a: (k, a[None]), ValueError, "alpha must be 1-D"),
        (lambda k, a: (k, a.long()), TypeError, "alpha must have dtype"),
        (lambda k, a: (k, a[:-1]), ValueError, r"alpha must have shape \(k.shape\[1\],\)"),
        (lambda k, a: (k, a.to("meta")), ValueError, "alpha is on meta but k is on cpu"),
    ],
)
def test_bad_input_names_the_argument(make_args, error, match):
    k, alpha = random_inputs((2, 3, 5, 4), seed=12)
    with pytest.raises(error, match=match):
        smeared_keys(*make_args(k, alpha))


def test_bad_backend():
    k, alpha = random_inputs((1, 2, 3, 4), seed=13)
    with pytest.raises(ValueError, match="backend must be one of"):
        smeared_keys(k, alpha, backend="cuda")


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_triton_rejects_float64():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_backend("auto", torch.device(device)) == "triton"
    k, alpha = random_inputs((1, 2, 3, 4), device=device, seed=14)
    with pytest.raises(TypeError, match="k must be float16, bfloat16 or float32"):
        smeared_keys(k.double(), alpha, backend="triton")
    with pytest.raises(TypeError, match="alpha must be float16, bfloat16 or float32"):
        smeared_keys(k, alpha.double(), backend="triton")


# --- module --------------------------------------------------------------------------------------


def _attention_by_definition(layer: SmearedKeyAttention, x: torch.Tensor) -> torch.Tensor:
    """softmax(q k'^T / sqrt(Dh) + causal) v through W_O, written out with the reference op."""
    batch, length, d_model = x.shape
    q, k, v = layer.qkv(x).view(batch, length, 3, layer.num_heads, layer.head_dim).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if layer.smear_logit is not None:
        k = smeared_keys_reference(k, layer.smear_logit)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = (q @ k.transpose(-1, -2) / math.sqrt(layer.head_dim)).masked_fill(~causal, float("-inf")).softmax(-1)
    return layer.out((weights @ v).transpose(1, 2).reshape(batch, length, d_model))


@pytest.mark.parametrize("smear", [True, False])
@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_module_matches_definition(smear, backend):
    torch.manual_seed(15)
    layer = SmearedKeyAttention(24, 3, smear=smear, smear_init=0.7, bias=True, backend=backend)
    x = torch.randn(2, 13, 24, requires_grad=True)
    out = layer(x)
    expected = _attention_by_definition(layer, x)
    assert_close_rel(out, expected, rms_tol=1e-5, name="module output")
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad(out.square().sum(), params)
    expected_grads = torch.autograd.grad(expected.square().sum(), params)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close_rel(grad, expected_grad, rms_tol=1e-5, name="module grad")
    assert (layer.smear_weight() is None) == (not smear)
    assert ("smear_logit" in dict(layer.named_parameters())) == smear


def test_module_attention_pattern_reproduces_the_fused_forward():
    """The reference-path pattern, applied to the values, gives exactly what the SDPA forward computed."""
    torch.manual_seed(16)
    layer = SmearedKeyAttention(20, 4, smear=True, backend="eager")
    with torch.no_grad():
        layer.smear_logit.copy_(torch.tensor([-2.0, 0.0, 1.0, 4.0]))
    x = torch.randn(3, 17, 20)
    out, pattern = layer(x, need_weights=True)
    assert pattern.shape == (3, 4, 17, 17)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(3, 4, 17))
    assert not pattern.triu(1).any(), "no attention to future keys"
    _, _, v = layer.project(x)
    assert_close_rel(out, layer.merge_heads(pattern @ v), rms_tol=1e-5, name="pattern @ v")


def test_module_rejects_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        SmearedKeyAttention(10, 3)
    with pytest.raises(ValueError, match="backend must be one of"):
        SmearedKeyAttention(8, 2, backend="gpu")
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        SmearedKeyAttention(8, 0)


def test_module_compiles_fullgraph():
    """The op is opaque to Dynamo (a custom op), so the module compiles without graph breaks."""
    torch.manual_seed(17)
    layer = SmearedKeyAttention(16, 2, backend="eager")
    x = torch.randn(2, 9, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close_rel(compiled(x), layer(x), name="compiled output")


# --- compiled (non-interpreter) kernels, without a GPU --------------------------------------------

_OFFLINE_COMPILE = """
from icrl_kernels.smeared import kernels
from benchmarks.kernel_tools import CompileJob, compile_offline

# benchmarks/bench_smeared_keys.py (docs/performance.md#targets, L = 1024): H = 12, Dh = 64 in bf16 (keys as the
# [B, L, H, Dh] projection seen through transpose(1, 2), as the module passes them) and fp32 (contiguous
# [B, H, L, Dh]), H = 8, Dh = 128 in bf16; and H = 8, Dh = 32 in fp32, a third tile shape. Block sizes from
# the wrapper's heuristic (no autotuning).
B, L = 8, 1024
jobs = []
for dtype, H, Dh, transposed in [("bf16", 12, 64, True), ("fp32", 12, 64, False), ("bf16", 8, 128, False),
                                 ("fp32", 8, 32, False)]:
    k_strides = (L * H * Dh, Dh, H * Dh, 1) if transposed else (H * L * Dh, L * Dh, Dh, 1)
    block_l, block_d = kernels.block_sizes(Dh)
    blocks = {"BLOCK_L": block_l, "BLOCK_D": block_d}
    sizes = {"H": H, "L": L, "Dh": Dh, "alpha_ptr": "*" + dtype, "stride_a": 1}
    forward = {"k_ptr": "*" + dtype, "out_ptr": "*" + dtype, **sizes,
               **dict(zip(("stride_kb", "stride_kh", "stride_kl", "stride_kd"), k_strides))}
    backward = {**forward, "grad_out_ptr": "*" + dtype, "grad_k_ptr": "*" + dtype, "partial_ptr": "*fp32",
                **dict(zip(("stride_gb", "stride_gh", "stride_gl", "stride_gd"), (H * L * Dh, L * Dh, Dh, 1)))}
    info = {"dtype": dtype, "H": H, "Dh": Dh, "transposed": transposed, **blocks}
    _, _, partials, block_p = kernels._launch_config((B, H, L, Dh))
    alpha_grad = {"partial_ptr": "*fp32", "alpha_ptr": "*" + dtype, "grad_alpha_ptr": "*" + dtype, "B": B, "H": H,
                  "P": partials, "stride_a": 1}
    jobs += [CompileJob(kernels._smeared_keys_forward_kernel, forward, blocks, info=info),
             CompileJob(kernels._smeared_keys_backward_kernel, backward, blocks, info=info),
             CompileJob(kernels._smeared_keys_alpha_grad_kernel, alpha_grad, {"BLOCK_P": block_p}, info=info)]
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """The interpreter accepts code the compiler rejects: compile the three kernels to sm_90 cubins with the
    wrapper's block sizes at the benchmark shapes (bf16 and fp32) and check that none spills more than
    ``MAX_SPILL_BYTES`` per thread."""
    reports = run_offline_compile(_OFFLINE_COMPILE)
    check_offline_reports(
        reports,
        {"_smeared_keys_forward_kernel", "_smeared_keys_backward_kernel", "_smeared_keys_alpha_grad_kernel"},
    )
