"""Gated, smeared causal attention (``gated_attention``): the Triton kernels (under the interpreter on CPU)
and the eager path against the fp32 reference and against SDPA, for output and every gradient (q, k, v,
gate logits, smearing logits); the custom-op registration, argument errors, and the offline sm_90 compile.

Every test draws fresh random inputs; kernel outputs start NaN-poisoned (tests/conftest.py). Interpreter
grids stay tiny (B <= 2, H <= 3, L <= 70: at most two 64-row blocks) since each program costs milliseconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels import gated_attention, gated_attention_reference, mixture_of_heads_reference, resolve_backend
from icrl_kernels.testing import RMS_TOLERANCE, assert_close_rel, triton_devices

TRITON_DEVICES = triton_devices()
needs_triton = pytest.mark.skipif(not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GATES = [None, "softmax", "sigmoid", "linear"]

#: Tolerances of the Triton kernels against the fp32 reference. fp32 and fp16 use the package's shared
#: tolerances. bf16 is looser: as in FlashAttention-2, the probabilities P and the score gradients dS are
#: rounded to the input dtype for the tensor-core dots, i.e. to 8 mantissa bits in bf16, a relative error of
#: up to 2^-9 per element that the softmax backward compounds (measured 0.5-1.4e-2 at L = 37; fp16, which
#: takes the same code with 3 more mantissa bits, stays about 8x below its own tolerance, so the arithmetic
#: itself is checked there).
TOLERANCE = {**RMS_TOLERANCE, torch.bfloat16: 3e-2}


def random_inputs(shape, *, dtype=torch.float32, gate=True, smear=True, device="cpu", seed=0, logit_dtype=None):
    """``q, k, v [B, H, L, Dh]``, gate logits ``[B, L, H]`` spread enough for far-from-uniform gates, and
    smearing logits ``[H]`` spanning saturated and balanced blends (None where not asked for)."""
    batch, heads, length, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
    logits = (2 * torch.randn(batch, length, heads, generator=gen)).to(device, logit_dtype or dtype) if gate else None
    alpha = (2 * torch.randn(heads, generator=gen)).to(device, torch.float32) if smear else None
    return q, k, v, logits, alpha


def check_parity(q, k, v, logits, alpha, gate, backend, *, tol=None, grad_out=None):
    """Output and every gradient of ``backend`` against the reference evaluated in fp32 on the same values."""
    inputs = [t.detach().requires_grad_(True) if t is not None else None for t in (q, k, v, logits, alpha)]
    ref_inputs = [t.detach().float().requires_grad_(True) if t is not None else None for t in inputs]
    kwargs = {"gate": gate or "softmax"}
    out = gated_attention(*inputs[:4], smear_alpha=inputs[4], backend=backend, **kwargs)
    ref = gated_attention_reference(*ref_inputs[:4], smear_alpha=ref_inputs[4], **kwargs)
    batch, heads, length, head_dim = q.shape
    assert out.shape == (batch, length, heads * head_dim) and out.dtype == q.dtype
    tol = tol or TOLERANCE[q.dtype]
    assert_close_rel(out, ref, rms_tol=tol, name=f"{backend} output")
    if grad_out is None:
        grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(99)).to(q.device, q.dtype)
    leaves = [t for t in inputs if t is not None]
    ref_leaves = [t for t in ref_inputs if t is not None]
    names = [n for n, t in zip(("q", "k", "v", "gate_logits", "smear_alpha"), inputs) if t is not None]
    grads = torch.autograd.grad(out, leaves, grad_out)
    grads_ref = torch.autograd.grad(ref, ref_leaves, grad_out.float())
    for name, leaf, grad, grad_ref in zip(names, leaves, grads, grads_ref):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert_close_rel(grad, grad_ref, rms_tol=tol, name=f"{backend} grad {name}")


# --- Triton kernels (interpreter on CPU) ----------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("smear", [False, True], ids=["plain", "smeared"])
@pytest.mark.parametrize("gate", GATES, ids=lambda g: g or "ungated")
def test_triton_parity_every_gate(gate, smear):
    """L = 70: two 64-query blocks (the second ragged), causal block skipping in all three kernels."""
    inputs = random_inputs(
        (1, 3, 70, 16), gate=gate is not None, smear=smear, device=DEVICE, seed=len(gate or "") + smear
    )
    check_parity(*inputs, gate, "triton")


@needs_triton
@pytest.mark.parametrize(
    "dtype,head_dim,gate,smear",
    [
        (torch.float16, 64, "softmax", True),
        (torch.bfloat16, 64, "softmax", True),
        (torch.bfloat16, 16, "linear", False),
        (torch.float16, 16, "sigmoid", True),
        (torch.bfloat16, 64, None, False),
    ],
    ids=lambda p: str(p).replace("torch.", ""),
)
def test_triton_parity_half_precision(dtype, head_dim, gate, smear):
    inputs = random_inputs((2, 2, 37, head_dim), dtype=dtype, gate=gate is not None, smear=smear, device=DEVICE,
                           seed=head_dim)  # fmt: skip
    check_parity(*inputs, gate, "triton")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_head_dim_not_a_power_of_two(dtype):
    """Dh = 48 is padded to a 64-wide tile with masks (loads, stores, the preprocess chunking)."""
    check_parity(*random_inputs((1, 2, 21, 48), dtype=dtype, device=DEVICE, seed=48), "softmax", "triton")


@needs_triton
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65])
def test_triton_lengths(length):
    """L = 1 (one key), 2, and one below, at and above the 64-row block."""
    check_parity(*random_inputs((2, 2, length, 16), device=DEVICE, seed=length), "sigmoid", "triton")


@needs_triton
def test_triton_matches_sdpa_ungated():
    """No gate, no smearing: plain causal attention, against PyTorch's SDPA (output and dq, dk, dv)."""
    q, k, v, _, _ = random_inputs((2, 3, 45, 32), gate=False, smear=False, device=DEVICE, seed=5)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    sdpa_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = gated_attention(*leaves, backend="triton")
    expected = F.scaled_dot_product_attention(*sdpa_leaves, is_causal=True).transpose(1, 2).flatten(2)
    assert_close_rel(out, expected, name="output vs SDPA")
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    for name, grad, grad_sdpa in zip(
        "qkv", torch.autograd.grad(out, leaves, grad_out), torch.autograd.grad(expected, sdpa_leaves, grad_out)
    ):
        assert_close_rel(grad, grad_sdpa, name=f"grad {name} vs SDPA")


@needs_triton
@pytest.mark.parametrize("gate", ["softmax", "sigmoid", "linear"])
def test_triton_matches_sdpa_plus_mixture_of_heads(gate):
    """Gated and smeared: against SDPA on the reference's smeared keys, then the MoA reference's gating."""
    from icrl_kernels import smeared_keys_reference

    q, k, v, logits, alpha = random_inputs((1, 2, 30, 16), device=DEVICE, seed=7)
    heads = F.scaled_dot_product_attention(q, smeared_keys_reference(k, alpha), v, is_causal=True)
    expected = mixture_of_heads_reference(heads.transpose(1, 2), logits, gate)
    out = gated_attention(q, k, v, logits, gate=gate, smear_alpha=alpha, backend="triton")
    assert_close_rel(out, expected, name="output vs SDPA + mixture_of_heads")


@needs_triton
def test_triton_strided_views_of_a_fused_projection():
    """q, k, v as ``transpose(1, 2)`` views of one ``[B, L, 3, H, Dh]`` projection, transposed gate logits
    and a non-contiguous output gradient: every stride is read, nothing is copied."""
    gen = torch.Generator().manual_seed(8)
    batch, length, heads, head_dim = 2, 19, 3, 16
    qkv = torch.randn(batch, length, 3, heads, head_dim, generator=gen).to(DEVICE)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    logits = torch.randn(batch, heads, length, generator=gen).to(DEVICE).transpose(1, 2)
    alpha = torch.randn(heads, generator=gen).to(DEVICE)
    grad_out = torch.randn(length, batch, heads * head_dim, generator=gen).to(DEVICE).transpose(0, 1)
    assert not (q.is_contiguous() or logits.is_contiguous() or grad_out.is_contiguous())
    check_parity(q, k, v, logits, alpha, "softmax", "triton", grad_out=grad_out)


@needs_triton
def test_triton_logits_in_another_dtype():
    """fp32 gate and smearing logits with bf16 q, k, v (autocast): gradients come back in each input's dtype."""
    inputs = random_inputs((1, 2, 20, 16), dtype=torch.bfloat16, device=DEVICE, seed=9, logit_dtype=torch.float32)
    check_parity(*inputs, "softmax", "triton")


@needs_triton
def test_triton_linear_gate_of_zero():
    """A linear gate of exactly 0 zeroes the row's output, yet its gradient <dY_h, O_h> is not zero: the
    kernel recomputes O_h rather than dividing D_h = <dY_h, Y_h> by the gate."""
    q, k, v, logits, _ = random_inputs((1, 2, 12, 16), smear=False, device=DEVICE, seed=10)
    logits[:, ::2] = 0.0
    logits = logits.requires_grad_(True)
    out = gated_attention(q, k, v, logits, gate="linear", backend="triton")
    assert (out[:, ::2] == 0).all()
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    (grad,) = torch.autograd.grad(out, logits, grad_out)
    assert grad[:, ::2].abs().min() > 0
    check_parity(q, k, v, logits, None, "linear", "triton", grad_out=grad_out)


@needs_triton
def test_triton_saturated_softmax_gate():
    """Logits 200 apart: the losing heads' softmax weights underflow to 0 in fp32; the logits' gradient
    (``D_h - G_h sum_j D_j``, no division) stays finite and matches the reference."""
    q, k, v, logits, alpha = random_inputs((1, 3, 10, 16), device=DEVICE, seed=12)
    logits[..., 0] += 200.0
    check_parity(q, k, v, logits, alpha, "softmax", "triton")


@needs_triton
@pytest.mark.parametrize("target", ["k", "v", "gate_logits"])
def test_triton_outlier_does_not_leak(target):
    """A huge finite value at position j changes only what causally depends on it: rows before j (and, for
    a gate logit, every other row) are unchanged; nothing becomes NaN or inf."""
    q, k, v, logits, alpha = random_inputs((1, 2, 40, 16), device=DEVICE, seed=13)
    base = gated_attention(q, k, v, logits, smear_alpha=alpha, backend="triton")
    j = 25
    tensors = {"k": k.clone(), "v": v.clone(), "gate_logits": logits.clone()}
    if target == "gate_logits":
        tensors[target][:, j] = 1e4
    else:
        tensors[target][:, :, j] = 1e4
    out = gated_attention(q, tensors["k"], tensors["v"], tensors["gate_logits"], smear_alpha=alpha, backend="triton")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :j], base[:, :j], rtol=1e-6, atol=1e-6)  # causal: rows < j never see j
    if target == "gate_logits":
        torch.testing.assert_close(out[:, j + 1 :], base[:, j + 1 :], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[:, j], base[:, j])


@needs_triton
def test_triton_custom_op_registration():
    """``torch.library.opcheck`` on the forward op (schema, fake tensor, autograd registration)."""
    from icrl_kernels.attention.function import gated_attention_op

    q, k, v, logits, alpha = random_inputs((1, 2, 9, 16), device=DEVICE, seed=14)
    args = (q.requires_grad_(True), k, v, logits.requires_grad_(True), alpha, "softmax", "triton")
    torch.library.opcheck(gated_attention_op, args, test_utils=("test_schema", "test_autograd_registration",
                                                               "test_faketensor"))  # fmt: skip


@needs_triton
def test_triton_fast_path_matches_the_dispatcher():
    """Plain eager calls skip the dispatcher (``icrl_kernels._library``): same output and gradients bit for bit."""
    from icrl_kernels._library import set_fast_dispatch

    inputs = random_inputs((1, 2, 9, 16), device=DEVICE, seed=20)
    results = []
    for fast in (True, False):
        previous = set_fast_dispatch(fast)
        try:
            leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
            out = gated_attention(*leaves[:4], smear_alpha=leaves[4], backend="triton")
            results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
        finally:
            set_fast_dispatch(previous)
    for fast, slow in zip(*results):
        torch.testing.assert_close(fast, slow, rtol=0, atol=0)


@needs_triton
def test_triton_compiles_fullgraph():
    """``torch.compile(fullgraph=True)`` keeps the op as one node (fake shapes for forward and backward)."""
    q, k, v, logits, alpha = random_inputs((1, 2, 9, 16), device=DEVICE, seed=21)
    q.requires_grad_(True)

    def fn(q, k, v, logits, alpha):
        return gated_attention(q, k, v, logits, smear_alpha=alpha, backend="triton")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, logits, alpha)
    assert_close_rel(out, fn(q, k, v, logits, alpha), name="compiled output")
    (grad,) = torch.autograd.grad(out.sum(), q)
    (grad_eager,) = torch.autograd.grad(fn(q, k, v, logits, alpha).sum(), q)
    assert_close_rel(grad, grad_eager, name="compiled grad q")


# --- eager path and reference ---------------------------------------------------------------------


@pytest.mark.parametrize("smear", [False, True], ids=["plain", "smeared"])
@pytest.mark.parametrize("gate", GATES, ids=lambda g: g or "ungated")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_eager_parity(dtype, gate, smear):
    inputs = random_inputs((2, 3, 23, 8), dtype=dtype, gate=gate is not None, smear=smear, seed=15)
    check_parity(*inputs, gate, "eager", tol=TOLERANCE[dtype] if dtype != torch.float64 else 1e-6)


def test_reference_by_hand():
    """One head, L = 2, Dh = 1: the smeared keys, the causal softmax and the gate written out."""
    q = torch.tensor([1.0, 2.0]).view(1, 1, 2, 1)
    k = torch.tensor([0.5, -1.0]).view(1, 1, 2, 1)
    v = torch.tensor([3.0, 5.0]).view(1, 1, 2, 1)
    alpha = torch.tensor([0.0])  # s = 1/2: k'_0 = 0.25, k'_1 = -0.25
    logits = torch.tensor([[[0.0], [1.0]]])  # sigmoid gates
    out = gated_attention_reference(q, k, v, logits, gate="sigmoid", smear_alpha=alpha)
    s0, s1 = 2.0 * 0.25, 2.0 * -0.25  # row 1's scores (Dh = 1: scale 1)
    p0 = torch.tensor(s0).exp() / (torch.tensor(s0).exp() + torch.tensor(s1).exp())
    row1 = p0 * 3.0 + (1 - p0) * 5.0
    expected = torch.stack([torch.sigmoid(torch.tensor(0.0)) * 3.0, torch.sigmoid(torch.tensor(1.0)) * row1])
    torch.testing.assert_close(out.view(2), expected)


def test_float64_gradcheck():
    q, k, v, logits, alpha = (t.double().requires_grad_(True) for t in random_inputs((1, 2, 5, 3), seed=16))
    assert torch.autograd.gradcheck(
        lambda *args: gated_attention(*args[:4], gate="softmax", smear_alpha=args[4], backend="eager"),
        (q, k, v, logits, alpha),
    )


def test_empty_sequence():
    q, k, v, logits, alpha = random_inputs((2, 3, 0, 8), seed=17)
    out = gated_attention(q, k, v, logits, smear_alpha=alpha)
    assert out.shape == (2, 0, 24)


def test_auto_backend_on_cpu_is_eager_without_the_interpreter():
    backend = resolve_backend("auto", torch.device("cpu"))
    assert backend == ("triton" if TRITON_DEVICES and "cpu" in TRITON_DEVICES else "eager")


# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda q, k, v, g, a: ((q[0], k, v), {}), ValueError, "q must be 4-D"),
        (lambda q, k, v, g, a: (([1.0], k, v), {}), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v, g, a: ((q, k[:, :, :-1], v), {}), ValueError, "k must have shape"),
        (lambda q, k, v, g, a: ((q, k, v[..., :-1]), {}), ValueError, "v must have shape"),
        (lambda q, k, v, g, a: ((q, k.double(), v), {}), TypeError, "k must have q's dtype"),
        (lambda q, k, v, g, a: ((q, k, v.long()), {}), TypeError, "v must have dtype"),
        (lambda q, k, v, g, a: ((q, k, v, g[:, :, :-1]), {}), ValueError, "gate_logits must have shape"),
        (lambda q, k, v, g, a: ((q, k, v, g.long()), {}), TypeError, "gate_logits must have dtype"),
        (lambda q, k, v, g, a: ((q, k, v, g.to("meta")), {}), ValueError, "gate_logits is on meta"),
        (lambda q, k, v, g, a: ((q, k, v, g), {"gate": "relu"}), ValueError, "gate must be one of"),
        (lambda q, k, v, g, a: ((q, k, v), {"smear_alpha": a[:-1]}), ValueError, "smear_alpha must have shape"),
        (lambda q, k, v, g, a: ((q, k, v), {"smear_alpha": [0.0, 0.0]}), TypeError, "smear_alpha must be a torch"),
        (lambda q, k, v, g, a: ((q, k, v), {"backend": "cuda"}), ValueError, "backend must be one of"),
    ],
)
def test_bad_input_names_the_argument(make_args, error, match):
    args, kwargs = make_args(*random_inputs((1, 2, 5, 8), seed=18))
    with pytest.raises(error, match=match):
        gated_attention(*args, **kwargs)
    if "backend" not in kwargs:
        with pytest.raises(error, match=match):
            gated_attention_reference(*args, **kwargs)


@needs_triton
def test_triton_rejects_float64_and_wide_heads():
    q, k, v, logits, alpha = random_inputs((1, 2, 3, 16), device=DEVICE, seed=19)
    with pytest.raises(TypeError, match="q must be float16, bfloat16 or float32"):
        gated_attention(q.double(), k.double(), v.double(), backend="triton")
    with pytest.raises(TypeError, match="smear_alpha must be float16, bfloat16 or float32"):
        gated_attention(q, k, v, smear_alpha=alpha.double(), backend="triton")
    wide = torch.zeros(1, 1, 2, 256, device=DEVICE)
    with pytest.raises(ValueError, match="q must have a head dim"):
        gated_attention(wide, wide, wide, backend="triton")


# --- compiled (non-interpreter) kernels, without a GPU --------------------------------------------

_OFFLINE_COMPILE = """
import itertools
from icrl_kernels.attention import kernels
from benchmarks.kernel_tools import CompileJob, compile_offline, config_jobs

# benchmarks/bench_gated_attention.py: B = 16, H = 12, L = 1024, Dh = 64 and 128 (the issue's head dims). q, k,
# v as transpose(1, 2) views of a fused [B, L, 3, H, Dh] projection, gate logits [B, L, H], grad_out
# contiguous. Every autotune config of the three attention kernels, and the preprocess kernel with its
# heuristic blocks, in bf16 (fp16 takes the same path) with the softmax gate and smearing (the heaviest
# variant) and the linear gate (the extra P V dot in the dq pass), and fp32 (tf32x3 dots, its fixed tiles)
# ungated.
B, H, L = 16, 12, 1024
jobs = []
variants = [("bf16", "softmax", True), ("bf16", "linear", False), ("fp32", None, False)]
for Dh, (dtype, gate, smear) in itertools.product([64, 128], variants):
    qkv = dict(zip(("b", "h", "l", "d"), (L * 3 * H * Dh, Dh, 3 * H * Dh, 1)))
    sig = {"H": H, "L": L, "Dh": Dh, "qk_scale": 0.18, "sm_scale": 0.125, "SIZE_BUCKET": L, "R": B * L,
           **{p: "*" + dtype for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "grad_out_ptr", "grad_q_ptr",
                                      "grad_v_ptr", "gate_ptr", "grad_gate_ptr")},
           "alpha_ptr": "*fp32", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "weight_ptr": "*fp32",
           "grad_k_ptr": "*fp32" if smear else "*" + dtype,
           **{f"stride_{t}{a}": s for t in "qkv" for a, s in qkv.items()},
           "stride_gb": L * H, "stride_gl": H, "stride_gh": 1,
           "stride_ob": L * H * Dh, "stride_ol": H * Dh, "stride_oc": 1}
    flags = {"GATE": kernels.GATE_CODES[gate], "SMEAR": smear, "HALF_DOT": int(dtype != "fp32"),
             "BLOCK_H": 16, "BLOCK_D": kernels.head_block(Dh)}
    info = {"dtype": dtype, "Dh": Dh, "gate": gate, "smear": smear}
    for tiles, kernel in (("forward", kernels._gated_attention_forward_kernel),
                          ("dkdv", kernels._gated_attention_backward_dkdv_kernel),
                          ("dq", kernels._gated_attention_backward_dq_kernel)):
        if dtype == "fp32":  # fp32 launches one fixed tile, not the autotuner's configs
            fixed = dict(kernels.FP32_TILES[tiles])
            warps, stages = fixed.pop("num_warps"), fixed.pop("num_stages")
            jobs.append(CompileJob(kernel, sig, {**flags, **fixed}, warps, stages, {"config": "fp32-tile", **info}))
        else:
            jobs += config_jobs(kernel, sig, flags, **info)
    jobs.append(CompileJob(kernels._gated_attention_backward_preprocess_kernel, sig,
                           {**flags, **kernels._preprocess_blocks(H, Dh)}, info={"config": "heuristic", **info}))
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """The interpreter accepts code the compiler rejects: compile every kernel in every autotune config to
    sm_90 cubins at the benchmark shape (Dh 64 and 128; bf16 gated and smeared, bf16 linear gate; fp32 in
    its fixed tiles) and check that none spills more than ``MAX_SPILL_BYTES`` per thread. Registers and
    shared memory are reported (``-s``); all fit an H100's 227 KB of shared memory per block."""
    reports = run_offline_compile(_OFFLINE_COMPILE, timeout=1500)
    check_offline_reports(reports, {"_gated_attention_forward_kernel", "_gated_attention_backward_dkdv_kernel",
                                    "_gated_attention_backward_dq_kernel",
                                    "_gated_attention_backward_preprocess_kernel"})  # fmt: skip


# --- cost model ---------------------------------------------------------------------------------------


def test_cost_model_hand_cases():
    """The worked examples of :mod:`benchmarks.cost.attention` (B=1, H=2, L=2, Dh=16 bf16: N = 64 elements,
    R = 4 rows, G = 4 logits, 3 causal pairs a head)."""
    from benchmarks.cost import OpCost
    from benchmarks.cost.attention import fwd_bwd_cost, sdpa_fwd_bwd_cost, separate_ops_fwd_bwd_cost

    bf16 = torch.bfloat16
    # 17 N s + 24 R + (3 G t + 12 R) + ((8 - s) N + 2 N s); FLOPs 18 Dh pairs (6 pairs).
    assert fwd_bwd_cost(1, 2, 2, 16, dtype=bf16) == OpCost(2176 + 96 + 72 + 640, 18 * 16 * 6)
    assert fwd_bwd_cost(1, 2, 2, 16, dtype=bf16, gate="linear").flops == 20 * 16 * 6
    # Ungated and unsmeared, the fused kernels move what SDPA moves (same traffic model), with 4 Dh more FLOPs.
    plain = fwd_bwd_cost(1, 2, 2, 16, dtype=bf16, gated=False, smeared=False)
    assert plain.bytes == sdpa_fwd_bwd_cost(1, 2, 2, 16, dtype=bf16).bytes == 2176 + 96
    # SDPA 2272 B / 14*16*6 FLOPs + smeared_keys 5*64*2 + 3*2*4 B / 9*64 + mixture_of_heads 5*64*2 + 3*4*2 B /
    # 4*64 + 14*4.
    assert separate_ops_fwd_bwd_cost(1, 2, 2, 16, dtype=bf16) == OpCost(2272 + 664 + 664, 1344 + 576 + 312)
