"""``MoAAttention`` with the gate folded into its QKV projection, and the ``attention=`` choice of
``MoAAttention`` / ``SmearedKeyAttention`` (``"sdpa"`` vs ``"fused"`` = :func:`icrl_kernels.gated_attention`).

The fused projection must compute what the former separate ``gate_proj`` Linear computed (outputs and
every gradient within fp rounding), old state dicts with ``gate_proj.*`` keys must load, and the
``"fused"`` implementation must equal ``"sdpa"`` (output and every parameter gradient).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import icrl_kernels
from icrl_kernels import MoAAttention, SmearedKeyAttention, mixture_of_heads
from icrl_kernels.moa import GATES
from icrl_kernels.modules import GPT2Block
from icrl_kernels.testing import assert_close_rel, triton_devices

HAS_FUSED = hasattr(icrl_kernels, "gated_attention")
needs_fused = pytest.mark.skipif(not HAS_FUSED, reason="icrl_kernels.gated_attention is not available")


class _Unfused(nn.Module):
    """The layer as it was before the fold: ``qkv = Linear(D, 3D)`` and a separate ``gate_proj = Linear(D, H)``
    (always with a bias), SDPA, then ``mixture_of_heads``. Built from a fused layer's weights."""

    def __init__(self, fused: MoAAttention) -> None:
        super().__init__()
        d, h = fused.d_model, fused.n_heads
        self.n_heads, self.gate, self.backend = h, fused.gate, fused.backend
        self.qkv = nn.Linear(d, 3 * d, bias=fused.out_proj.bias is not None)
        self.out_proj = nn.Linear(d, d, bias=fused.out_proj.bias is not None)
        self.gate_proj = nn.Linear(d, h) if fused.gate is not None else None
        with torch.no_grad():
            self.qkv.weight.copy_(fused.qkv.weight[: 3 * d])
            if self.qkv.bias is not None:
                self.qkv.bias.copy_(fused.qkv.bias[: 3 * d])
            self.out_proj.load_state_dict(fused.out_proj.state_dict())
            if self.gate_proj is not None:
                self.gate_proj.weight.copy_(fused.gate_weight)
                self.gate_proj.bias.copy_(fused.gate_bias)

    def forward(self, x, gate_input=None):
        q, k, v = rearrange(self.qkv(x), "b l (three h e) -> three b h l e", three=3, h=self.n_heads).unbind(0)
        heads = rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h l e -> b l h e")
        if self.gate_proj is None:
            merged = rearrange(heads, "b l h e -> b l (h e)")
        else:
            logits = self.gate_proj(x if gate_input is None else gate_input)
            merged = mixture_of_heads(heads, logits, gate=self.gate, backend=self.backend)
        return self.out_proj(merged)

    def fused_grads(self, d_model: int) -> dict[str, torch.Tensor]:
        """This module's gradients laid out as the fused layer's parameters."""
        grads = {"out_proj.weight": self.out_proj.weight.grad}
        weight = [self.qkv.weight.grad] + ([self.gate_proj.weight.grad] if self.gate_proj is not None else [])
        grads["qkv.weight"] = torch.cat(weight)
        if self.out_proj.bias is not None:
            grads["out_proj.bias"] = self.out_proj.bias.grad
            bias = [self.qkv.bias.grad] + ([self.gate_proj.bias.grad] if self.gate_proj is not None else [])
            grads["qkv.bias"] = torch.cat(bias)
        elif self.gate_proj is not None:
            grads["qkv_gate_bias"] = self.gate_proj.bias.grad
        return grads


def _backends():
    return ["eager"] + (["triton"] if "cpu" in triton_devices() else [])


# --- the gate folded into qkv ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(
    ("gate", "separate_gate_input"), [(gate, False) for gate in (*GATES, None)] + [(gate, True) for gate in GATES]
)
def test_fused_projection_equals_separate_gate_linear(backend, bias, gate, separate_gate_input):
    """Output, d x, d gate_input and every parameter gradient equal the former two-Linear layer's."""
    torch.manual_seed(3)
    layer = MoAAttention(24, 3, gate=gate, bias=bias, backend=backend)
    unfused = _Unfused(layer)
    x = torch.randn(2, 11, 24, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    e = torch.randn(2, 11, 24, requires_grad=True) if separate_gate_input else None
    e_ref = e.detach().clone().requires_grad_() if separate_gate_input else None
    out = layer(x, gate_input=e)
    expected = unfused(x_ref, gate_input=e_ref)
    torch.testing.assert_close(out, expected)  # fp32 rounding of the same GEMMs, not a loose tolerance
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    if separate_gate_input:
        torch.testing.assert_close(e.grad, e_ref.grad)
    expected_grads = unfused.fused_grads(24)
    params = dict(layer.named_parameters())
    assert set(params) == set(expected_grads)
    for name, parameter in params.items():
        torch.testing.assert_close(parameter.grad, expected_grads[name], msg=lambda m, n=name: f"{n}: {m}")
    if gate is not None:  # the gate rows are trained
        gate_bias_grad = layer.qkv.bias.grad[72:] if bias else layer.qkv_gate_bias.grad
        assert layer.qkv.weight.grad[72:].abs().sum() > 0 and gate_bias_grad.abs().sum() > 0


@pytest.mark.parametrize(("d_model", "heads"), [(24, 3), (768, 12), (64, 8)], ids=["75-rows", "gpt2-small", "64-wide"])
def test_gated_projection_keeps_the_ungated_qkv_gemm(d_model, heads):
    """q, k, v are views of one ``3D``-wide projection, exactly the ungated layer's GEMM (whose width cuBLAS
    tiles well), and the gate logits a separate ``H``-wide GEMM of the same weight's gate rows; the weight
    gradient is still one ``[3D + H, D]`` buffer."""
    torch.manual_seed(0)
    layer = MoAAttention(d_model, heads, gate="softmax", backend="eager")
    plain = MoAAttention(d_model, heads, gate=None, backend="eager")
    with torch.no_grad():
        plain.qkv.weight.copy_(layer.qkv.weight[: 3 * d_model])
        plain.qkv.bias.copy_(layer.qkv.bias[: 3 * d_model])
    x = torch.randn(2, 5, d_model)
    q, k, v, logits = layer.project_with_gate(x)
    assert all(t.stride(2) == 3 * d_model and t.stride(3) == 1 for t in (q, k, v))
    assert q.data_ptr() + d_model * q.element_size() == k.data_ptr()  # one buffer for q, k, v
    assert logits.shape == (2, 5, heads) and logits.is_contiguous()
    for got, want in zip((q, k, v), plain.project(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(logits, layer.gate_logits(x))


def test_gate_input_defaults_to_x():
    torch.manual_seed(4)
    layer = MoAAttention(16, 4, gate="softmax", backend="eager")
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x, gate_input=x), layer(x), rtol=0, atol=0)
    torch.testing.assert_close(layer(x, gate_input=x.clone()), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layout_accessors_and_init(bias):
    torch.manual_seed(5)
    d, h = 64, 4
    layer = MoAAttention(d, h, gate="softmax", bias=bias)
    assert layer.qkv.weight.shape == (3 * d + h, d)
    assert layer.gate_weight.shape == (h, d) and layer.gate_bias.shape == (h,)
    assert layer.gate_weight.data_ptr() == layer.qkv.weight[3 * d :].data_ptr()  # a view, not a copy
    if bias:
        assert layer.qkv.bias.shape == (3 * d + h,) and layer.qkv_gate_bias is None
        assert layer.gate_bias.data_ptr() == layer.qkv.bias[3 * d :].data_ptr()
    else:
        assert layer.qkv.bias is None and layer.gate_bias is layer.qkv_gate_bias
    # nn.Linear(D, .)'s init, as the former gate_proj = nn.Linear(D, H) had: U(-1/sqrt(D), 1/sqrt(D))
    # (64 heads, so the gate bias has enough samples to test the distribution).
    wide = MoAAttention(256, 64, gate="softmax", bias=bias)
    bound = 1 / math.sqrt(256)
    for tensor in (wide.gate_weight, wide.gate_bias):
        assert tensor.abs().max() <= bound and tensor.abs().max() > 0.8 * bound
        assert abs(tensor.std() / (bound / math.sqrt(3)) - 1) < 0.2
    ungated = MoAAttention(d, h, gate=None, bias=bias)
    assert ungated.qkv.weight.shape == (3 * d, d) and ungated.gate_weight is None and ungated.gate_bias is None
    x = torch.randn(2, 3, d)
    torch.testing.assert_close(layer.gate_logits(x), x @ layer.gate_weight.T + layer.gate_bias)
    torch.testing.assert_close(layer.gate_weights(x), layer.gate_logits(x).softmax(-1))


def _old_state_dict(layer: MoAAttention, prefix: str = "") -> dict[str, torch.Tensor]:
    """``layer``'s weights under the former keys: ``qkv [3D]`` rows and a separate ``gate_proj``."""
    d = layer.d_model
    state = {f"{prefix}qkv.weight": layer.qkv.weight[: 3 * d].detach().clone()}
    state.update({f"{prefix}out_proj.{k}": v.clone() for k, v in layer.out_proj.state_dict().items()})
    if layer.qkv.bias is not None:
        state[f"{prefix}qkv.bias"] = layer.qkv.bias[: 3 * d].detach().clone()
    if layer.gate is not None:
        state[f"{prefix}gate_proj.weight"] = layer.gate_weight.detach().clone()
        state[f"{prefix}gate_proj.bias"] = layer.gate_bias.detach().clone()
    return state


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("gate", ["softmax", None])
def test_old_state_dicts_with_gate_proj_load(bias, gate):
    torch.manual_seed(6)
    source = MoAAttention(20, 4, gate=gate, bias=bias, backend="eager")
    old = _old_state_dict(source)
    assert ("gate_proj.weight" in old) == (gate is not None)
    kept = dict(old)
    target = MoAAttention(20, 4, gate=gate, bias=bias, backend="eager")
    result = target.load_state_dict(old)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    assert set(old) == set(kept)  # the caller's dict keeps its keys
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    x = torch.randn(2, 6, 20)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    # New state dicts round-trip too.
    again = MoAAttention(20, 4, gate=gate, bias=bias, backend="eager")
    again.load_state_dict(target.state_dict())
    torch.testing.assert_close(again(x), source(x), rtol=0, atol=0)


def test_old_state_dict_of_a_nested_block_loads():
    """The hook sees prefixed keys (``attn.gate_proj.weight`` inside a GPT-2 block)."""
    torch.manual_seed(7)
    block = GPT2Block(24, 3, gate="sigmoid", backend="eager")
    state = {k: v for k, v in block.state_dict().items() if not k.startswith("attn.")}
    state.update(_old_state_dict(block.attn, prefix="attn."))
    fresh = GPT2Block(24, 3, gate="sigmoid", backend="eager")
    fresh.load_state_dict(state)
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(fresh(x), block(x), rtol=0, atol=0)


def test_gpt2_weights_fill_the_qkv_rows_and_keep_the_gate(tmp_path):
    """A GPT-2 checkpoint fills rows :3D of a gated layer's qkv; the gate rows keep their init; saving
    writes GPT-2's [D, 3D] c_attn."""
    from icrl_models.gpt2_checkpoint import gpt2_state_dict, load_gpt2_weights, save_gpt2_weights
    from icrl_models.models.dt_moa import DecisionTransformerMoA, DTMoAConfig

    torch.manual_seed(8)
    config = DTMoAConfig(n_layer=2, n_head=3, n_embd=24, n_positions=30, state_sizes=(5,), num_actions=4,
                         context_len=10, moa_layers=(0,), dropout=0.0, backend="eager")  # fmt: skip
    source = DecisionTransformerMoA(config)
    save_gpt2_weights(source, tmp_path, format="bin")
    saved = gpt2_state_dict(source)
    assert saved["h.0.attn.c_attn.weight"].shape == (24, 72) and saved["h.0.attn.c_attn.bias"].shape == (72,)
    target = DecisionTransformerMoA(config)
    gate_rows = target.blocks[0].attn.qkv.weight[72:].clone()
    gate_bias = target.blocks[0].attn.gate_bias.clone()
    load_gpt2_weights(target, tmp_path)
    for i in range(2):
        torch.testing.assert_close(target.blocks[i].attn.qkv.weight[:72], source.blocks[i].attn.qkv.weight[:72])
        torch.testing.assert_close(target.blocks[i].attn.qkv.bias[:72], source.blocks[i].attn.qkv.bias[:72])
    assert torch.equal(target.blocks[0].attn.qkv.weight[72:], gate_rows)
    assert torch.equal(target.blocks[0].attn.gate_bias, gate_bias)
    # GPT-2's initialisation (normal(0, 0.02), zero bias) covers the gate rows, as it did gate_proj.
    assert 0.01 < gate_rows.std() < 0.03 and torch.equal(gate_bias, torch.zeros(3))


# --- attention="fused" -----------------------------------------------------------------------------


def test_fused_attention_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="attention must be one of"):
        MoAAttention(16, 2, attention="flash")
    with pytest.raises(ValueError, match="attention must be one of"):
        SmearedKeyAttention(16, 2, attention="flash")
    with pytest.raises(ValueError, match="dropout must be 0 with attention='fused'"):
        MoAAttention(16, 2, dropout=0.1, attention="fused")
    with pytest.raises(ValueError, match="dropout must be 0 with attention='fused'"):
        GPT2Block(16, 2, gate="softmax", dropout=0.1, attention="fused")
    layer = MoAAttention(16, 2, attention="fused", backend="eager")
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="attn_mask is not supported with attention='fused'"):
        layer(x, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="head_mask is not supported with attention='fused'"):
        layer(x, head_mask=torch.ones(2))
    with pytest.raises(ValueError, match="is_causal must be True with attention='fused'"):
        layer(x, is_causal=False)
    assert "attention='fused'" in repr(layer) and "attention='sdpa'" in repr(MoAAttention(16, 2))


def _compare_implementations(make, x, *, gate_input=None, rtol=None, atol=None):
    """Output, d x and every parameter gradient of ``attention="fused"`` vs ``"sdpa"`` (same weights)."""
    sdpa, fused = make("sdpa"), make("fused")
    fused.load_state_dict(sdpa.state_dict())
    x_fused = x.detach().clone().requires_grad_()
    kwargs = {} if gate_input is None else {"gate_input": gate_input}
    expected, out = sdpa(x, **kwargs), fused(x_fused, **kwargs)
    tolerances = {} if rtol is None else {"rtol": rtol, "atol": atol}
    torch.testing.assert_close(out, expected, **tolerances)
    grad = torch.randn_like(out)
    expected.backward(grad)
    out.backward(grad)
    torch.testing.assert_close(x_fused.grad, x.grad, **tolerances)
    for (name, p_sdpa), (_, p_fused) in zip(sdpa.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(p_fused.grad, p_sdpa.grad, **tolerances, msg=lambda m, n=name: f"{n}: {m}")


@needs_fused
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("gate", [*GATES, None])
def test_moa_fused_equals_sdpa_eager(gate, bias):
    torch.manual_seed(9)
    x = torch.randn(2, 13, 24, requires_grad=True)
    _compare_implementations(lambda a: MoAAttention(24, 3, gate=gate, bias=bias, backend="eager", attention=a), x)


@needs_fused
def test_moa_fused_equals_sdpa_with_gate_input_and_gates():
    torch.manual_seed(10)
    x = torch.randn(2, 7, 24, requires_grad=True)
    e = torch.randn(2, 7, 24)
    _compare_implementations(lambda a: MoAAttention(24, 3, backend="eager", attention=a), x, gate_input=e)
    layer = MoAAttention(24, 3, backend="eager", attention="fused")
    sdpa = MoAAttention(24, 3, backend="eager")
    sdpa.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x, return_gates=True)[1], sdpa(x, return_gates=True)[1])


@needs_fused
@pytest.mark.parametrize("smear", [True, False], ids=["smeared", "plain"])
def test_smeared_fused_equals_sdpa_eager(smear):
    torch.manual_seed(11)
    x = torch.randn(2, 13, 24, requires_grad=True)

    def make(attention):
        layer = SmearedKeyAttention(24, 3, smear=smear, bias=True, backend="eager", attention=attention)
        if smear:
            with torch.no_grad():
                layer.smear_logit.copy_(torch.tensor([-1.0, 0.5, 2.0]))
        return layer

    _compare_implementations(make, x)
    layer = make("fused")
    out, pattern = layer(x, need_weights=True)
    assert out.shape == (2, 13, 24) and pattern.shape == (2, 3, 13, 13)


@needs_fused
@pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("gate", ["softmax", None])
def test_fused_equals_sdpa_under_the_interpreter(gate):
    """A tiny case on the Triton kernel (interpreter): Dh = 16 so every tl.dot dim is >= 16."""
    torch.manual_seed(12)
    x = torch.randn(1, 9, 32, requires_grad=True)
    _compare_implementations(
        lambda a: MoAAttention(32, 2, gate=gate, backend="triton", attention=a), x, rtol=1e-4, atol=1e-5
    )

    def make(attention):
        return SmearedKeyAttention(32, 2, smear=True, smear_init=0.7, backend="triton", attention=attention)

    _compare_implementations(make, x.detach().requires_grad_(), rtol=1e-4, atol=1e-5)


@needs_fused
def test_fused_module_under_autocast_and_bf16():
    torch.manual_seed(13)
    layer = MoAAttention(24, 3, backend="eager", attention="fused")
    x = torch.randn(2, 9, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert_close_rel(out, layer(x), rms_tol=3e-2, name="autocast fused output")


@needs_fused
def test_fused_modules_compile_fullgraph():
    torch.manual_seed(14)
    x = torch.randn(2, 9, 16)
    for layer in (MoAAttention(16, 2, backend="eager", attention="fused"),
                  SmearedKeyAttention(16, 2, backend="eager", attention="fused")):  # fmt: skip
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert_close_rel(compiled(x), layer(x), name=f"compiled {type(layer).__name__}")
