"""``torch.func.vmap`` rules of the ops that batched runs (:mod:`icrl_models.batched`) call: Mixture-of-Attention
gating, gated attention, the looped block's injection + LayerNorm and smeared keys (the n-gram ops have theirs in
``test_ngram_api.py``).

Under ``vmap`` over ``K`` runs each op launches once for all runs (its forward and its backward kernel each called
once), and gives every run the output and gradients of its own single call: the runs' rows folded into the batch,
or, where each run has its own parameters (smearing logits, the LayerNorm's weight and bias, position
embeddings), into the heads or an affine applied per run.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import cpu_backends

import icrl_kernels as ik

K, B, L, H, DH = 3, 2, 5, 3, 4  # runs, batch, length, heads, head dim: odd where it matters

#: Per op: the module whose functions launch the kernels, and those functions per backend (forward, backward).
LAUNCHERS = {
    "mixture_of_heads": {"eager": ("icrl_kernels.moa.function", "mixture_of_heads_forward_eager",
                                   "mixture_of_heads_backward_eager"),
                         "triton": ("icrl_kernels.moa.kernels", "mixture_of_heads_forward_triton",
                                    "mixture_of_heads_backward_triton")},
    "smeared_keys": {"eager": ("icrl_kernels.smeared.function", "smeared_keys_forward_eager",
                               "smeared_keys_backward_eager"),
                     "triton": ("icrl_kernels.smeared.kernels", "smeared_keys_forward_triton",
                                "smeared_keys_backward_triton")},
    "gated_attention": {"triton": ("icrl_kernels.attention.kernels", "gated_attention_forward_triton",
                                   "gated_attention_backward_triton")},
    "inject_layer_norm": {"eager": ("icrl_kernels.looped.function", "inject_layer_norm_forward_eager",
                                    "inject_layer_norm_backward_eager"),
                          "triton": ("icrl_kernels.looped.kernels", "inject_layer_norm_forward_triton",
                                     "inject_layer_norm_backward_triton")},
}  # fmt: skip


def _random(*shape, generator):
    return torch.randn(*shape, generator=generator)


def _cases():
    """``(op, name, make(generator) -> (inputs, in_dims), call(backend, *inputs) -> tensor or tuple)``."""

    def moa(shared_logits):
        def make(g):
            # SDPA's output layout: [K, B, H, L, Dh] transposed to heads-last, as the module passes it.
            heads = _random(K, B, H, L, DH, generator=g).transpose(2, 3)
            logits = (
                _random(L, H, generator=g)[None].expand(B, L, H) if shared_logits else _random(K, B, L, H, generator=g)
            )
            return (heads, logits), (0, None if shared_logits else 0)

        return make, lambda backend, h, lg: ik.mixture_of_heads(h, lg, gate="softmax", backend=backend)

    def smeared(shared_alpha):
        def make(g):
            alpha = _random(H, generator=g) if shared_alpha else _random(K, H, generator=g)
            return (_random(K, B, H, L, DH, generator=g), alpha), (0, None if shared_alpha else 0)

        return make, lambda backend, k, a: ik.smeared_keys(k, a, backend=backend)

    def attention(smear, gate):
        def make(g):
            qkv = [_random(K, B, H, L, DH, generator=g) for _ in range(3)]
            logits = _random(K, B, L, H, generator=g)
            alpha = _random(K, H, generator=g) if smear else None
            return (*qkv, logits, alpha), (0, 0, 0, 0, 0 if smear else None)

        return make, lambda backend, q, k, v, lg, a: ik.gated_attention(q, k, v, lg, gate=gate, smear_alpha=a,
                                                                        backend=backend)  # fmt: skip

    def looped(per_run_parameters):
        def make(g):
            d = 2 * DH
            if per_run_parameters:
                inputs = (
                    _random(K, B, L, d, generator=g),
                    _random(K, B, L, d, generator=g),
                    _random(K, L, d, generator=g),
                    1 + _random(K, d, generator=g),
                    _random(K, d, generator=g),
                )
                return inputs, (0, 0, 0, 0, 0)
            inputs = (None, _random(K, B, L, d, generator=g), _random(L, d, generator=g), 1 + _random(d, generator=g),
                      None)  # fmt: skip
            return inputs, (None, 0, None, None, None)

        return make, lambda backend, *args: ik.inject_layer_norm(*args, backend=backend)

    return [
        ("mixture_of_heads", "per-run logits", *moa(False)),
        ("mixture_of_heads", "shared logits", *moa(True)),
        ("smeared_keys", "per-run alpha", *smeared(False)),
        ("smeared_keys", "shared alpha", *smeared(True)),
        ("gated_attention", "smeared, softmax gate", *attention(True, "softmax")),
        ("gated_attention", "sigmoid gate", *attention(False, "sigmoid")),
        ("inject_layer_norm", "per-run parameters", *looped(True)),
        ("inject_layer_norm", "shared parameters, no y", *looped(False)),
    ]


CASES = [
    pytest.param(op, make, call, backend, id=f"{op}-{name}-{backend}")
    for op, name, make, call in _cases()
    for backend in cpu_backends()
    if backend in LAUNCHERS[op]
]


@contextlib.contextmanager
def _counted_launches(monkeypatch, op: str, backend: str):
    """``{"forward": n, "backward": n}``: calls of the op's kernel launchers (or eager implementations)."""
    module, forward, backward = LAUNCHERS[op][backend]
    counts = {"forward": 0, "backward": 0}
    with monkeypatch.context() as patch:
        for which, name in (("forward", forward), ("backward", backward)):
            original = getattr(__import__(module, fromlist=[name]), name)

            def counted(*args, _original=original, _which=which, **kwargs):
                counts[_which] += 1
                return _original(*args, **kwargs)

            patch.setattr(f"{module}.{name}", counted)
        yield counts


def _outputs(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("op, make, call, backend", CASES)
def test_vmap_rule_launches_once_and_gives_each_run_its_single_call(monkeypatch, op, make, call, backend):
    generator = torch.Generator().manual_seed(0)
    inputs, in_dims = make(generator)
    inputs = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    with _counted_launches(monkeypatch, op, backend) as launches:
        mapped = _outputs(torch.vmap(lambda *args: call(backend, *args), in_dims=in_dims)(*inputs))
        weights = [torch.randn(out.shape, generator=generator) for out in mapped]
        wanted = [x for x in inputs if x is not None]
        grads = torch.autograd.grad(sum((out * w).sum() for out, w in zip(mapped, weights)), wanted)
    assert launches == {"forward": 1, "backward": 1}

    def run(k):
        return [x if x is None or dim is None else x[k] for x, dim in zip(inputs, in_dims)]

    looped = [_outputs(call(backend, *run(k))) for k in range(K)]
    for index, out in enumerate(mapped):
        torch.testing.assert_close(out, torch.stack([outs[index] for outs in looped]), rtol=1e-5, atol=1e-6)
    loss = sum((outs[i] * weights[i][k]).sum() for k, outs in enumerate(looped) for i in range(len(outs)))
    for got, want, x in zip(grads, torch.autograd.grad(loss, wanted), wanted):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, x=x: f"{tuple(x.shape)}: {m}")


def _sdpa_cases():
    """``(name, make(generator) -> (inputs, in_dims), keyword arguments)`` of SDPA on the CPU (its flash kernel)."""
    S = L + 2  # keys longer than queries: the mask's last two dimensions differ

    def qkv(g, shared=()):
        shapes = {"q": (B, H, L, DH), "k": (B, H, S, DH), "v": (B, H, S, DH)}
        return [_random(*shape, generator=g) if name in shared else _random(K, *shape, generator=g)
                for name, shape in shapes.items()], [None if name in shared else 0 for name in shapes]  # fmt: skip

    def case(mask_shape=None, mask_vmapped=False, shared=(), **kwargs):
        def make(g):
            inputs, dims = qkv(g, shared)
            if mask_shape is not None:
                mask = _random(*((K,) if mask_vmapped else ()), *mask_shape, generator=g)
                inputs, dims = [*inputs, mask], [*dims, 0 if mask_vmapped else None]
            return inputs, dims

        return make, kwargs

    return [
        ("no mask", *case()),
        ("shared key and value", *case(shared=("k", "v"))),
        ("shared query, scale", *case(shared=("q",), scale=0.3)),
        ("shared [L, S] mask", *case((L, S))),
        ("shared per-row mask", *case((B, 1, L, S))),
        ("per-run [L, S] mask", *case((L, S), True)),
        ("per-run [1, H, L, S] mask", *case((1, H, L, S), True)),
        ("per-run boolean-like [B, 1, 1, S] mask", *case((B, 1, 1, S), True)),
    ]


@pytest.mark.parametrize("make, kwargs", [pytest.param(m, kw, id=name) for name, m, kw in _sdpa_cases()])
def test_cpu_sdpa_under_vmap_runs_once_and_gives_each_run_its_single_call(make, kwargs):
    """torch has no vmap rule for SDPA's CPU flash kernel (its fallback calls it per run, and its backward adds a
    zero-filled gradient of all runs per run); icrl_kernels folds the runs into the kernel's batch."""
    import torch.nn.functional as F
    from torch.profiler import profile

    generator = torch.Generator().manual_seed(0)
    inputs, in_dims = make(generator)
    qkv = [x.requires_grad_() for x in inputs[:3]]  # a mask that needs a gradient sends SDPA to its math kernel

    def attention(q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)

    weight = torch.randn(K, B, H, L, DH, generator=generator)
    with profile() as prof:
        mapped = torch.vmap(attention, in_dims=tuple(in_dims))(*inputs)
        grads = torch.autograd.grad((mapped * weight).sum(), qkv)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == 1  # per run: K calls
    looped = [attention(*[x if dim is None else x[k] for x, dim in zip(inputs, in_dims)]) for k in range(K)]
    torch.testing.assert_close(mapped, torch.stack(looped), rtol=1e-6, atol=1e-6)
    loss = sum((out * weight[k]).sum() for k, out in enumerate(looped))
    for got, want in zip(grads, torch.autograd.grad(loss, qkv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
