"""Public API of the n-gram op: validation errors, backend dispatch, custom-op checks, module, token ids."""

from __future__ import annotations

import pytest
import torch

from icrl_kernels import NGramAttention, ngram_attention, ngram_attention_reference, resolve_backend, transition_ids
from icrl_kernels.ngram.function import (
    TILED_MAX_LENGTH,
    ngram_attention_backward_op,
    ngram_attention_op,
    ngram_attention_tiled_backward_op,
    ngram_attention_tiled_op,
)
from icrl_kernels.ngram.plan import _ngram_plan_op, build_ngram_plan
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
    perm, meta, count = _ngram_plan_op(ids, 2)
    torch.library.opcheck(_ngram_plan_op, (ids, 2))
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
    assert TILED_MAX_LENGTH >= 1


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
