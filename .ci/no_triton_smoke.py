"""CPU smoke test of an installation without Triton (run by .ci/run in the `.ci-venv-notriton` environment).

Every public op's default path (``backend="auto"``, i.e. eager on CPU tensors without Triton) forward and backward
on tiny inputs, checked against its reference; every module's forward and backward; the n-gram decode state; one
tiny model per model family; and ``backend="triton"`` refused with a ValueError that says what is missing.
Exits non-zero at the first failure.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

if importlib.util.find_spec("triton") is not None:
    sys.exit("no_triton_smoke.py must run where triton is NOT installed")

import icrl_kernels as ik  # noqa: E402  (after the check: the point is importing without triton)
from icrl_kernels._backend import resolve_backend  # noqa: E402

if Path(ik.__file__).resolve().parent == Path(__file__).resolve().parents[1] / "icrl_kernels":
    sys.exit(f"icrl_kernels comes from the source tree ({ik.__file__}): run this against the installed wheel")
print("icrl_kernels from", Path(ik.__file__).parent)

torch.manual_seed(0)


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5) -> None:
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=atol, rtol=1e-4):
        sys.exit(f"{name}: eager result differs from the reference")
    print(f"ok  {name}")


def first(out):
    return out[0] if isinstance(out, tuple) else out


def grads(fn, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of sum(fn(...) * fixed random weights) w.r.t. ``tensors`` (each a fresh leaf)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = first(fn(*leaves))
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weight).sum().backward()
    return [leaf.grad for leaf in leaves]


def op_parity(name: str, fast, reference, *tensors: torch.Tensor) -> None:
    check(f"{name} forward", first(fast(*tensors)), first(reference(*tensors)))
    for index, (got, want) in enumerate(zip(grads(fast, *tensors), grads(reference, *tensors))):
        check(f"{name} grad {index}", got, want)


# --- ops ------------------------------------------------------------------------------------------------------
B, L, D, H, A = 2, 7, 8, 2, 5
assert resolve_backend("auto", torch.device("cpu")) == "eager"
try:
    ik.ngram_attention(torch.randn(B, L, D), torch.randint(0, 3, (B, L)), 2, backend="triton")
except ValueError as error:
    assert "triton" in str(error), error
    print("ok  backend='triton' refused:", error)
else:
    sys.exit("backend='triton' without triton must raise ValueError")

ids = torch.randint(0, 3, (B, L))
ids[0, 2] = -1  # padding
op_parity("ngram_attention", lambda h: ik.ngram_attention(h, ids, 2),
          lambda h: ik.ngram_attention_reference(h, ids, 2), torch.randn(B, L, D))  # fmt: skip
plan = ik.ngram_plan(ids, 2)
check("ngram_attention(plan=)", ik.ngram_attention(torch.ones(B, L, D), ids, 2, plan=plan),
      ik.ngram_attention_reference(torch.ones(B, L, D), ids, 2))  # fmt: skip
tokens = ik.transition_ids(torch.randint(0, 4, (B, L)), torch.randint(0, 3, (B, L)), torch.randint(0, 2, (B, L)),
                           num_states=4, num_actions=3, num_rewards=2)  # fmt: skip
state = ik.NGramDecodeState(B, D, 2, L)
h = torch.randn(B, L, D)
stepped = torch.stack([state.step(h[:, t], tokens[:, t]) for t in range(L)], dim=1)
check("NGramDecodeState.step", stepped, ik.ngram_attention_reference(h, tokens, 2))

embeds = ik.orthonormal_embeddings(A, D)
targets = torch.randint(0, A, (B * L,))
op_parity("infonce_loss", lambda p, e: ik.infonce_loss(p, e, targets, tau=0.5).reshape(1),
          lambda p, e: ik.infonce_loss_reference(p, e, targets, tau=0.5).reshape(1),
          torch.randn(B * L, D), embeds)  # fmt: skip
pred = torch.randn(B * L, D)
check("select_actions", ik.select_actions(pred, embeds, mode="argmax"),
      ik.select_actions_reference(pred, embeds))  # fmt: skip

op_parity("inject_layer_norm", lambda y, p, pos, w, b: ik.inject_layer_norm(y, p, pos, w, b)[1],
          lambda y, p, pos, w, b: ik.inject_layer_norm_reference(y, p, pos, w, b)[1],
          torch.randn(B, L, D), torch.randn(B, L, D), torch.randn(L, D), torch.rand(D) + 0.5,
          torch.randn(D))  # fmt: skip
for gate in ("softmax", "sigmoid", "linear"):
    op_parity(f"mixture_of_heads[{gate}]", lambda o, g, gate=gate: ik.mixture_of_heads(o, g, gate=gate),
              lambda o, g, gate=gate: ik.mixture_of_heads_reference(o, g, gate=gate),
              torch.randn(B, L, H, D // H), torch.randn(B, L, H))  # fmt: skip
op_parity("smeared_keys", ik.smeared_keys, ik.smeared_keys_reference, torch.randn(B, H, L, D // H), torch.randn(H))
op_parity("gated_attention", lambda q, k, v, g, a: ik.gated_attention(q, k, v, g, smear_alpha=a),
          lambda q, k, v, g, a: ik.gated_attention_reference(q, k, v, g, smear_alpha=a),
          *(torch.randn(B, H, L, D // H) for _ in range(3)), torch.randn(B, L, H), torch.randn(H))  # fmt: skip


# --- modules ----------------------------------------------------------------------------------------------------
def module_smoke(name: str, module: torch.nn.Module, *args, **kwargs) -> None:
    out = first(module(*args, **kwargs))
    out.float().square().mean().backward()
    missing = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if not torch.isfinite(out).all() or missing:
        sys.exit(f"{name}: non-finite output or parameters without gradients {missing}")
    print(f"ok  {name} forward/backward")


x = torch.randn(B, L, D)
module_smoke("NGramAttention", ik.NGramAttention(D, 2), x, ids)
module_smoke("MoAAttention", ik.MoAAttention(D, H), x)
module_smoke("SmearedKeyAttention", ik.SmearedKeyAttention(D, H), x)
module_smoke("MoAAttention(attention='fused')", ik.MoAAttention(D, H, attention="fused"), x)
module_smoke("LoopedBlock", ik.LoopedBlock(D, H, L), x, loops=2)
action_map = ik.ActionMap(A, D)
action_map.regenerate()
module_smoke("ActionMap", action_map, torch.randn(B * L, D, requires_grad=True), targets)
if action_map.select(pred).shape != (B * L,):
    sys.exit("ActionMap.select: wrong shape")

# --- tiny models --------------------------------------------------------------------------------------------------
from icrl_models.models.ad import ADConfig, ADModel  # noqa: E402
from icrl_models.models.looped import LoopedConfig, LoopedTransformer  # noqa: E402

for ngram_sizes in ((), (1, 2)):
    model = ADModel(ADConfig(num_states=9, num_actions=3, seq_len=L, d_model=8, num_heads=2, num_layers=1,
                             ngram_sizes=ngram_sizes))  # fmt: skip
    logits = model(torch.randint(0, 9, (B, L)), torch.randint(0, 3, (B, L)), torch.randint(0, 2, (B, L)))
    if logits.shape != (B, L, 3) or not torch.isfinite(logits).all():
        sys.exit(f"ADModel(ngram_sizes={ngram_sizes}): bad logits {tuple(logits.shape)}")
    logits.square().mean().backward()
    print(f"ok  ADModel(ngram_sizes={ngram_sizes}) forward/backward")
looped = LoopedTransformer(LoopedConfig(n_dims=3, max_points=4, d_model=8, n_heads=2))
print(f"ok  LoopedTransformer constructed ({sum(p.numel() for p in looped.parameters())} parameters)")
print("no-Triton smoke test passed")
