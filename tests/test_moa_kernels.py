"""Mixture-of-Attention gating: Triton and eager paths against the fp32 reference (output, grad head_out,
grad gate_logits) for every gate, the custom-op registration, argument errors, and ``MoAAttention``.

Every test draws fresh random inputs; kernel outputs start NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels import MoAAttention, mixture_of_heads, mixture_of_heads_reference, resolve_backend
from icrl_kernels.moa import GATES, gate_weights_reference
from icrl_kernels.moa.function import mixture_of_heads_backward_op, mixture_of_heads_op
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


def random_inputs(shape, *, dtype=torch.float32, logit_dtype=torch.float32, device="cpu", sdpa_view=True, seed=0):
    """``head_out [B, L, H, Dh]`` (by default the ``transpose(1, 2)`` view of a ``[B, H, L, Dh]`` buffer, as
    SDPA returns it) and ``gate_logits [B, L, H]`` spread enough that softmax weights are far from uniform."""
    batch, length, heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    if sdpa_view:
        head_out = torch.randn(batch, heads, length, head_dim, generator=gen).transpose(1, 2)
    else:
        head_out = torch.randn(*shape, generator=gen)
    gate_logits = 2 * torch.randn(batch, length, heads, generator=gen)
    return head_out.to(device=device, dtype=dtype), gate_logits.to(device=device, dtype=logit_dtype)


def check_parity(head_out: torch.Tensor, gate_logits: torch.Tensor, gate: str, backend: str, *, grad_out=None):
    """Output and both gradients of ``backend`` against the reference evaluated in fp32 on the same values."""
    head_out = head_out.detach().requires_grad_(True)
    gate_logits = gate_logits.detach().requires_grad_(True)
    head_ref = head_out.detach().float().requires_grad_(True)
    logits_ref = gate_logits.detach().float().requires_grad_(True)
    out = mixture_of_heads(head_out, gate_logits, gate=gate, backend=backend)
    ref = mixture_of_heads_reference(head_ref, logits_ref, gate)
    batch, length, heads, head_dim = head_out.shape
    assert out.shape == (batch, length, heads * head_dim) and out.dtype == head_out.dtype
    assert out.is_contiguous()
    assert_close_rel(out, ref, name=f"{backend} {gate} output")
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out)
    grad_head, grad_logits = torch.autograd.grad(out, (head_out, gate_logits), grad_out)
    grad_head_ref, grad_logits_ref = torch.autograd.grad(ref, (head_ref, logits_ref), grad_out.float())
    assert grad_head.dtype == head_out.dtype and grad_logits.dtype == gate_logits.dtype
    assert_close_rel(grad_head, grad_head_ref, name=f"{backend} {gate} grad head_out")
    # s_h sums Dh exact fp32 products of the same values: its error is fp32 rounding, plus the final
    # rounding to the logits' dtype. Low-precision heads only enter through those exact products.
    rms_tol = max(RMS_TOLERANCE[gate_logits.dtype], 1e-5)
    assert_close_rel(grad_logits, grad_logits_ref, rms_tol=rms_tol, name=f"{backend} {gate} grad gate_logits")


SHAPES = [
    (2, 37, 12, 33),  # GPT-2's H = 12 (padded to 16) with an odd head width; 74 rows, not a multiple of the block
    (2, 50, 3, 7),  # small heads: 64-row blocks, two programs, the second partial
    (1, 70, 3, 200),  # head width over 128: two feature chunks per head
    (2, 1, 5, 24),  # L = 1
    (3, 4, 1, 64),  # H = 1: a softmax gate of one head is exactly 1
]


def test_shapes_reach_the_kernel_edges():
    """The parity shapes exercise a partial last row block, several row blocks and several feature chunks."""
    from icrl_kernels.moa.kernels import block_sizes

    blocks = [(shape, block_sizes(shape[2], shape[3])) for shape in SHAPES]
    assert any((b * length) % block_r and b * length > block_r for (b, length, _, _), (block_r, _, _) in blocks)
    assert any(head_dim > block_d for (_, _, _, head_dim), (_, _, block_d) in blocks)
    assert any(heads < block_h for (_, _, heads, _), (_, block_h, _) in blocks)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_parity_fp32(backend, device, gate, shape):
    head_out, gate_logits = random_inputs(shape, device=device, seed=sum(shape))
    check_parity(head_out, gate_logits, gate, backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 37, 12, 33), (3, 5, 5, 64)], ids=lambda s: "x".join(map(str, s)))
def test_parity_low_precision(backend, device, gate, dtype, shape):
    """Low-precision heads and logits (as under autocast, where the gate's linear map also runs in bf16)."""
    head_out, gate_logits = random_inputs(shape, dtype=dtype, logit_dtype=dtype, device=device, seed=1)
    check_parity(head_out, gate_logits, gate, backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype,logit_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_dtypes(backend, device, dtype, logit_dtype):
    """Heads and logits in different dtypes: the output takes the heads', each gradient its input's."""
    head_out, gate_logits = random_inputs((2, 9, 12, 16), dtype=dtype, logit_dtype=logit_dtype, device=device, seed=2)
    check_parity(head_out, gate_logits, "softmax", backend)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_strided_everything(backend, device):
    """Strided logits (a slice of a wider projection) and a strided upstream gradient."""
    gen = torch.Generator().manual_seed(3)
    gate_logits = (2 * torch.randn(2, 11, 10, generator=gen)).to(device)[..., 1:4]  # [B, L, H], row stride 10
    head_out = torch.randn(2, 3, 11, 18, generator=gen).to(device)[..., ::2].transpose(1, 2)  # [B, L, H, 9]
    assert not head_out.is_contiguous() and not gate_logits.is_contiguous()
    grad_out = torch.randn(27, 11, 2, generator=gen).to(device).permute(2, 1, 0)  # [2, 11, 27], strided
    for gate in GATES:
        check_parity(head_out, gate_logits, gate, backend, grad_out=grad_out)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_grad_head_keeps_the_sdpa_layout(backend, device):
    """The head_out gradient is written in head_out's memory order: for SDPA's transposed view, it is the
    transposed view of a [B, H, L, Dh]-contiguous buffer, which SDPA's backward reads without a copy."""
    head_out, gate_logits = random_inputs((2, 7, 3, 5), device=device, seed=4)
    head_out.requires_grad_(True)
    out = mixture_of_heads(head_out, gate_logits, backend=backend)
    (grad_head,) = torch.autograd.grad(out, head_out, torch.ones_like(out))
    assert grad_head.stride() == head_out.stride()
    assert grad_head.transpose(1, 2).is_contiguous()


def test_reference_by_hand():
    head_out = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]).view(1, 1, 3, 2)
    logits = torch.tensor([0.0, math.log(2.0), math.log(5.0)]).view(1, 1, 3)  # softmax: 1/8, 2/8, 5/8
    expected = {
        "softmax": [1 / 8, 2 / 8, 2 * 10 / 8, 2 * 20 / 8, 5 * 100 / 8, 5 * 200 / 8],
        "sigmoid": [0.5, 1.0, 10 * 2 / 3, 20 * 2 / 3, 100 * 5 / 6, 200 * 5 / 6],
        "linear": [0.0, 0.0, 10 * math.log(2.0), 20 * math.log(2.0), 100 * math.log(5.0), 200 * math.log(5.0)],
    }
    for gate, values in expected.items():
        torch.testing.assert_close(mixture_of_heads_reference(head_out, logits, gate).view(-1), torch.tensor(values))


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_single_head_softmax_is_identity(backend, device):
    """Softmax over one head is 1: the output is head_out and the logits get exactly zero gradient."""
    head_out, gate_logits = random_inputs((2, 5, 1, 12), device=device, seed=5)
    gate_logits.requires_grad_(True)
    out = mixture_of_heads(head_out, gate_logits, backend=backend)
    torch.testing.assert_close(out, head_out.reshape(2, 5, 12), rtol=1e-6, atol=1e-6)
    (grad_logits,) = torch.autograd.grad(out, gate_logits, torch.randn_like(out))
    assert not grad_logits.any()


@pytest.mark.parametrize("backend", ["eager", "reference"])
@pytest.mark.parametrize("gate", GATES)
def test_float64_gradcheck(backend, gate):
    head_out, gate_logits = random_inputs((2, 3, 4, 3), seed=6)
    inputs = (head_out.double().requires_grad_(True), gate_logits.double().requires_grad_(True))
    assert torch.autograd.gradcheck(lambda h, g: mixture_of_heads(h, g, gate=gate, backend=backend), inputs)


@pytest.mark.parametrize("backend", ["eager", "reference"] + (["triton"] if triton_devices() else []))
def test_empty_batch(backend):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    head_out, gate_logits = random_inputs((0, 4, 3, 5), device=device, seed=7)
    assert mixture_of_heads(head_out, gate_logits, backend=backend).shape == (0, 4, 15)


# --- custom-op registration, compile, errors ------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("sdpa_view", [False, True], ids=["contiguous", "sdpa-view"])
def test_opcheck(impl, gate, sdpa_view):
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    head_out, gate_logits = random_inputs((2, 6, 3, 5), device=device, sdpa_view=sdpa_view, seed=8)
    torch.library.opcheck(
        mixture_of_heads_op, (head_out.requires_grad_(True), gate_logits.requires_grad_(True), gate, impl)
    )
    grad_out = torch.randn(2, 15, 6, generator=torch.Generator().manual_seed(9)).to(device).transpose(1, 2)
    torch.library.opcheck(mixture_of_heads_backward_op, (grad_out, head_out.detach(), gate_logits.detach(), gate, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_fullgraph(impl):
    """The op is opaque to Dynamo: the public function compiles without graph breaks, forward and backward."""
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    head_out, gate_logits = random_inputs((2, 6, 3, 5), device=device, seed=10)
    head_out.requires_grad_(True)
    gate_logits.requires_grad_(True)

    def fn(h, g):
        return mixture_of_heads(h, g, gate="softmax", backend=impl)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(head_out, gate_logits)
    assert_close_rel(out, mixture_of_heads_reference(head_out, gate_logits), name="compiled output")
    grads = torch.autograd.grad(out.square().sum(), (head_out, gate_logits))
    expected = torch.autograd.grad(mixture_of_heads_reference(head_out, gate_logits).square().sum(),
                                   (head_out, gate_logits))  # fmt: skip
    for grad, grad_ref in zip(grads, expected):
        assert_close_rel(grad, grad_ref, name="compiled grad")


@pytest.mark.parametrize(
    "make_args,kwargs,error,match",
    [
        (lambda h, g: (h, g), {"gate": "relu"}, ValueError, "gate must be one of"),
        (lambda h, g: (h, g), {"gate": None}, ValueError, "gate must be one of"),
        (lambda h, g: (h, g), {"backend": "cuda"}, ValueError, "backend must be one of"),
        (lambda h, g: (h[0], g), {}, ValueError, "head_out must be 4-D"),
        (lambda h, g: ([1.0], g), {}, TypeError, "head_out must be a torch.Tensor"),
        (lambda h, g: (h.long(), g), {}, TypeError, "head_out must have dtype"),
        (lambda h, g: (h, g[..., None]), {}, ValueError, "gate_logits must be 3-D"),
        (lambda h, g: (h, g.long()), {}, TypeError, "gate_logits must have dtype"),
        (lambda h, g: (h, g[..., :-1]), {}, ValueError, r"gate_logits must have shape head_out.shape\[:3\]"),
        (lambda h, g: (h, g[:, :-1]), {}, ValueError, r"gate_logits must have shape head_out.shape\[:3\]"),
        (lambda h, g: (h, g.to("meta")), {}, ValueError, "gate_logits is on meta but head_out is on cpu"),
    ],
)
def test_bad_input_names_the_argument(make_args, kwargs, error, match):
    head_out, gate_logits = random_inputs((2, 3, 4, 5), seed=11)
    with pytest.raises(error, match=match):
        mixture_of_heads(*make_args(head_out, gate_logits), **kwargs)


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_triton_rejects_float64():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_backend("auto", torch.device(device)) == "triton"
    head_out, gate_logits = random_inputs((1, 2, 3, 4), device=device, seed=12)
    with pytest.raises(TypeError, match="head_out must be float16, bfloat16 or float32"):
        mixture_of_heads(head_out.double(), gate_logits, backend="triton")
    with pytest.raises(TypeError, match="gate_logits must be float16, bfloat16 or float32"):
        mixture_of_heads(head_out, gate_logits.double(), backend="triton")


# --- module --------------------------------------------------------------------------------------


def _moa_by_hand(layer: MoAAttention, x, *, gate_input=None, head_mask=None, allowed=None):
    """qkv -> explicit causal softmax attention -> per-head gate -> out_proj, written out in fp32."""
    batch, length, d_model = x.shape
    heads, head_dim = layer.n_heads, layer.head_dim
    q, k, v = layer.qkv(x)[..., : 3 * d_model].view(batch, length, 3, heads, head_dim).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if allowed is not None:
        causal = causal & allowed
    scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(~causal, float("-inf"))
    per_head = (scores.softmax(-1) @ v).transpose(1, 2)  # [B, L, H, Dh]
    if layer.gate is None:
        weights = torch.ones(batch, length, heads)
    else:
        logits = torch.nn.functional.linear(x if gate_input is None else gate_input, layer.gate_weight, layer.gate_bias)
        if layer.gate == "softmax":
            weights = logits.softmax(-1)
        elif layer.gate == "sigmoid":
            weights = logits.sigmoid()
        else:
            weights = logits
    if head_mask is not None:
        weights = weights * head_mask
    return layer.out_proj((per_head * weights[..., None]).reshape(batch, length, d_model))


def _module_backends():
    return ["eager", "reference"] + (["triton"] if "cpu" in triton_devices() else [])


@pytest.mark.parametrize("backend", _module_backends())
@pytest.mark.parametrize("gate", [*GATES, None])
def test_module_matches_hand_written_moa(backend, gate):
    torch.manual_seed(13)
    layer = MoAAttention(24, 3, gate=gate, backend=backend)
    x = torch.randn(2, 13, 24, requires_grad=True)
    gate_input = torch.randn(2, 13, 24, requires_grad=True) if gate is not None else None
    out = layer(x, gate_input=gate_input)
    expected = _moa_by_hand(layer, x, gate_input=gate_input)
    assert_close_rel(out, expected, rms_tol=1e-5, name="module output")
    leaves = [x, *([gate_input] if gate_input is not None else []), *layer.parameters()]
    grads = torch.autograd.grad(out.square().sum(), leaves)
    expected_grads = torch.autograd.grad(expected.square().sum(), leaves)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close_rel(grad, expected_grad, rms_tol=1e-5, name="module grad")
    if gate is not None:  # the gate is trained: its rows of qkv (weight and bias) receive nonzero gradients
        named = dict(zip([name for name, _ in layer.named_parameters()], grads[2:]))
        assert named["qkv.weight"][3 * 24 :].abs().sum() > 0
        assert named["qkv.bias"][3 * 24 :].abs().sum() > 0


def test_ungated_module_is_plain_causal_attention():
    torch.manual_seed(14)
    layer = MoAAttention(20, 4, gate=None, bias=False)
    assert layer.gate_weight is None and layer.gate_bias is None and layer.qkv.weight.shape == (60, 20)
    assert not any("gate" in name for name, _ in layer.named_parameters())
    x = torch.randn(3, 9, 20)
    q, k, v = layer.project(x)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = layer.out_proj(plain.transpose(1, 2).reshape(3, 9, 20))
    assert_close_rel(layer(x), expected, rms_tol=1e-6, name="ungated output")


@pytest.mark.parametrize("gate", ["softmax", "linear", None])
def test_head_mask_equals_zeroing_the_head_by_hand(gate):
    torch.manual_seed(15)
    layer = MoAAttention(24, 4, gate=gate, backend="eager")
    x = torch.randn(2, 7, 24)
    head_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out, gates = layer(x, head_mask=head_mask, return_gates=True)
    assert_close_rel(out, _moa_by_hand(layer, x, head_mask=head_mask), rms_tol=1e-5, name="masked output")
    assert not torch.allclose(out, layer(x), atol=1e-4), "ablating a head must change the output"
    # Zeroing head 1's value rows removes exactly its contribution, whatever its gate weight.
    ablated = MoAAttention(24, 4, gate=gate, backend="eager")
    ablated.load_state_dict(layer.state_dict())
    with torch.no_grad():
        ablated.qkv.weight[2 * 24 + 6 : 2 * 24 + 12] = 0
        ablated.qkv.bias[2 * 24 + 6 : 2 * 24 + 12] = 0
    assert_close_rel(out, ablated(x), rms_tol=1e-5, name="mask vs zeroed values")
    assert gates.shape == (2, 7, 4)


def test_return_gates():
    torch.manual_seed(16)
    x = torch.randn(2, 5, 16)
    layer = MoAAttention(16, 4, gate="softmax")
    out, gates = layer(x, return_gates=True)
    torch.testing.assert_close(gates.sum(-1), torch.ones(2, 5))
    torch.testing.assert_close(out, layer(x))
    torch.testing.assert_close(gates, gate_weights_reference(layer.gate_logits(x), "softmax"))
    sigmoid_gates = MoAAttention(16, 4, gate="sigmoid")(x, return_gates=True)[1]
    assert ((sigmoid_gates > 0) & (sigmoid_gates < 1)).all()
    _, ones = MoAAttention(16, 4, gate=None)(x, return_gates=True)
    torch.testing.assert_close(ones, torch.ones(2, 5, 4))


def test_module_attn_mask_combines_with_causal():
    torch.manual_seed(17)
    layer = MoAAttention(12, 3, gate="softmax", backend="eager")
    x = torch.randn(2, 6, 12)
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    allowed[0, :, :, 0] = False  # batch 0: nobody may attend to key 0 ...
    allowed[0, :, 0, 0] = True  # ... except query 0, which would otherwise attend to nothing
    out = layer(x, attn_mask=allowed)
    assert_close_rel(out, _moa_by_hand(layer, x, allowed=allowed), rms_tol=1e-5, name="masked attention")
    with pytest.raises(TypeError, match="attn_mask must have dtype"):
        layer(x, attn_mask=allowed.float())


def test_qk_and_ov_weights():
    torch.manual_seed(18)
    layer = MoAAttention(20, 4, gate="softmax", bias=False)
    x = torch.randn(1, 6, 20)
    w_q, w_k = layer.qk_weights()
    assert w_q.shape == w_k.shape == (4, 20, 5)
    q, k, v = layer.project(x)
    for head in range(4):
        bilinear = x[0] @ (w_q[head] @ w_k[head].T) @ x[0].T  # x_i M_h x_j^T
        torch.testing.assert_close(bilinear, q[0, head] @ k[0, head].T, rtol=1e-5, atol=1e-5)
    w_v, w_o = layer.ov_weights()
    assert w_v.shape == (4, 20, 5) and w_o.shape == (4, 5, 20)
    torch.testing.assert_close(x[0] @ w_v[1], v[0, 1], rtol=1e-5, atol=1e-5)
    merged = torch.randn(6, 20)  # out_proj of concatenated heads = sum over heads of head_h @ W_o[h]
    by_head = sum(merged[:, h * 5 : (h + 1) * 5] @ w_o[h] for h in range(4))
    torch.testing.assert_close(layer.out_proj(merged), by_head, rtol=1e-5, atol=1e-5)


def test_module_rejects_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        MoAAttention(10, 3)
    with pytest.raises(ValueError, match="gate must be one of"):
        MoAAttention(8, 2, gate="tanh")
    with pytest.raises(ValueError, match="backend must be one of"):
        MoAAttention(8, 2, backend="gpu")
    with pytest.raises(ValueError, match="dropout"):
        MoAAttention(8, 2, dropout=1.5)
    layer = MoAAttention(8, 2)
    with pytest.raises(ValueError, match=r"head_mask must have shape \(n_heads,\)"):
        layer(torch.randn(1, 3, 8), head_mask=torch.ones(3))
    with pytest.raises(ValueError, match="x must be 3-D"):
        layer(torch.randn(3, 8))


def test_module_dropout_only_in_training():
    torch.manual_seed(19)
    layer = MoAAttention(16, 2, dropout=0.5, backend="eager")
    x = torch.randn(2, 5, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_module_compiles_fullgraph():
    torch.manual_seed(20)
    layer = MoAAttention(16, 2, backend="eager")
    x = torch.randn(2, 9, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close_rel(compiled(x), layer(x), name="compiled module")


def test_module_under_autocast():
    """bf16 autocast (how GPU training runs; CPU autocast here): bf16 heads and logits, fp32 gate math."""
    torch.manual_seed(21)
    layer = MoAAttention(24, 3, backend="eager")
    x = torch.randn(2, 11, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, gates = layer(x, return_gates=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(gates.sum(-1), torch.ones(2, 11))
    assert_close_rel(out, layer(x), rms_tol=3e-2, name="autocast output")
    (grad,) = torch.autograd.grad(out.float().square().sum(), x)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


# --- compiled (non-interpreter) kernels, without a GPU --------------------------------------------

_OFFLINE_COMPILE = """
from icrl_kernels.moa import kernels
from benchmarks.kernel_tools import CompileJob, compile_offline

# benchmarks/bench_moa.py (docs/performance.md#targets): B = 8, H = 12, Dh = 64, L = 1024; head_out is SDPA's
# [B, H, L, Dh] output seen through transpose(1, 2), gate logits and grad_out contiguous, grad_head in
# head_out's memory order. Block sizes from the wrapper's heuristic (no autotuning).
B, H, Dh, L = 8, 12, 64, 1024
block_r, block_h, block_d = kernels.block_sizes(H, Dh)
head = dict(zip(("stride_xb", "stride_xl", "stride_xh", "stride_xd"), (H * L * Dh, Dh, L * Dh, 1)))
gate = dict(zip(("stride_gb", "stride_gl", "stride_gh"), (L * H, H, 1)))
jobs = []
for dtype, gate_name in [("bf16", "softmax"), ("fp32", "sigmoid")]:  # "linear" only skips the sigmoid
    constexprs = {"GATE": kernels._GATE_CODES[gate_name], "BLOCK_R": block_r, "BLOCK_H": block_h, "BLOCK_D": block_d}
    forward = {"head_ptr": "*" + dtype, "gate_ptr": "*" + dtype, "out_ptr": "*" + dtype, "R": B * L, "L": L, "H": H,
               "Dh": Dh, **head, **gate}
    backward = {**forward, "grad_out_ptr": "*" + dtype, "grad_head_ptr": "*" + dtype, "grad_gate_ptr": "*" + dtype,
                **dict(zip(("stride_ob", "stride_ol", "stride_oc"), (L * H * Dh, H * Dh, 1))),
                **dict(zip(("stride_db", "stride_dl", "stride_dh", "stride_dd"), head.values()))}
    info = {"dtype": dtype, "gate": gate_name, "BLOCK_R": block_r, "BLOCK_H": block_h, "BLOCK_D": block_d}
    jobs += [CompileJob(kernels._mixture_of_heads_forward_kernel, forward, constexprs, info=info),
             CompileJob(kernels._mixture_of_heads_backward_kernel, backward, constexprs, info=info)]
compile_offline(jobs)
"""


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """The interpreter accepts code the compiler rejects: compile both kernels to sm_90 cubins with the
    wrapper's block sizes at the benchmark shape (softmax gate in bf16, sigmoid in fp32) and check that
    neither spills more than ``MAX_SPILL_BYTES`` per thread."""
    reports = run_offline_compile(_OFFLINE_COMPILE)
    check_offline_reports(reports, {"_mixture_of_heads_forward_kernel", "_mixture_of_heads_backward_kernel"})
