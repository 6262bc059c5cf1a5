"""Every autotune config of every Triton kernel, forced one at a time, against the op's reference.

The autotuner times its configs on the GPU and keeps the fastest for each shape, so any config may
compute a user's results, but the parity tests only run the one that wins (and the interpreter only
the first). Each test here forces one config of one kernel (:func:`icrl_kernels.testing.forced_config`),
runs the public op forward and backward through the Triton backend and compares the output and the
gradients with the op's reference; kernel outputs start NaN-poisoned (tests/conftest.py), so an
element that a config's tiling never writes fails.

On CUDA the shape is benchmark-sized with ragged edges (no dimension a multiple of every tile). Under
``TRITON_INTERPRET=1`` the same tests run on the CPU at a tiny shape (one or a few programs a launch):
the CPU rehearsal of the GPU "configs" stage. The kernels come from
:func:`benchmarks.kernel_tools.autotuned_kernels`; a new autotuned kernel needs an entry in ``CHECKS``
(``test_every_autotuned_kernel_has_a_check`` fails until it has one).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.kernel_tools import autotuned_kernels  # noqa: E402
from icrl_kernels import (  # noqa: E402  (after the importorskip: the kernel modules need triton)
    gated_attention,
    gated_attention_reference,
    infonce_loss,
    infonce_loss_reference,
    ngram_attention,
    ngram_attention_reference,
    select_actions,
)
from icrl_kernels._triton import autotune_configs, config_name, kernel_name  # noqa: E402
from icrl_kernels.contrastive import action_logits_reference  # noqa: E402
from icrl_kernels.testing import (  # noqa: E402
    RMS_TOLERANCE,
    assert_close_rel,
    forced_config,
    relative_rms_error,
    triton_devices,
)

#: fp32 and bf16 take different code paths (FMA vs tensor-core dots, 16- vs 128-action InfoNCE tiles);
#: fp16 takes bf16's on every kernel. Under the interpreter bf16 dots are upcast, but the loads, casts
#: and stores still run in bf16.
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- one check per op: the public function forward and backward against the reference -------------


def check_ngram(algorithm: str, device: str, dtype: torch.dtype) -> None:
    """``ngram_attention(backend="triton", algorithm=...)`` and its gradient against the dense reference."""
    tiny = device == "cpu"
    if tiny:  # sort tiles of 32..128 positions: one to two tiles, one column block
        batch, length, dim, vocab = 1, 40, 24, 4
    else:  # benchmark-sized (docs/performance.md#targets):
        # the sort path at L = 1000, the tiled one at L = 250; D = 200 is ragged for every tile
        batch, length, dim, vocab = 2, 1000 if algorithm == "sort" else 250, 200, 16
    gen = _generator(length + dim)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    ids[torch.rand(batch, length, generator=gen) < 0.05] = -1  # padding never matches
    ids = ids.to(device)
    h = torch.randn(batch, length, dim, generator=gen).to(device, dtype).requires_grad_(True)
    h_ref = h.detach().float().requires_grad_(True)
    out = ngram_attention(h, ids, 2, backend="triton", algorithm=algorithm)
    ref = ngram_attention_reference(h_ref, ids, 2)
    assert_close_rel(out, ref, rms_tol=RMS_TOLERANCE[dtype], name="output")
    grad_out = torch.randn(ref.shape, generator=gen).to(device, dtype)  # the same (rounded) values for both
    (grad,) = torch.autograd.grad(out, h, grad_out)
    (grad_ref,) = torch.autograd.grad(ref, h_ref, grad_out.float())
    assert_close_rel(grad, grad_ref, rms_tol=RMS_TOLERANCE[dtype], name="grad_h")


def _contrastive_inputs(device: str, dtype: torch.dtype, actions: int | None = None):
    """``pred [B, T, D]``, one shared map ``[A, D]``, a ``[B, T, A]`` mask and targets among the available
    actions; logits of standard deviation about 2 (peaked, not one-hot)."""
    tiny = device == "cpu"
    # Tiny: A = 150 is 10 FMA action tiles or 2 tensor-core ones, D = 40 two BLOCK_D chunks of 32.
    # CUDA: N = 800 rows, D = 512 (one grad_pred block of all 512 columns), A = 1000 (ragged action tiles).
    batch, steps, dim, default_actions = (2, 5, 40, 150) if tiny else (4, 200, 512, 1000)
    actions = actions or default_actions
    gen = _generator(dim + actions)
    pred = torch.randn(batch, steps, dim, generator=gen)
    embeds = torch.randn(actions, dim, generator=gen) * (2.0 / math.sqrt(dim))
    mask = torch.rand(batch, steps, actions, generator=gen) < 0.7
    targets = torch.multinomial(mask.reshape(-1, actions).float(), 1, generator=gen).reshape(batch, steps)
    return pred.to(device, dtype), embeds.to(device, dtype), mask.to(device), targets.to(device)


def check_infonce(device: str, dtype: torch.dtype, actions: int | None = None, algorithm: str = "auto") -> None:
    """``infonce_loss(backend="triton")`` and both gradients against the fp32 reference on the same inputs,
    with and without a mask (``HAS_MASK`` compiles two variants of every kernel)."""
    pred, embeds, mask, targets = _contrastive_inputs(device, dtype, actions)
    for masked in (False, True):
        kwargs = {"mask": mask if masked else None, "tau": 0.7, "reduction": "none"}
        leaves = (pred.detach().clone().requires_grad_(True), embeds.detach().clone().requires_grad_(True))
        leaves_ref = (pred.detach().float().requires_grad_(True), embeds.detach().float().requires_grad_(True))
        loss = infonce_loss(*leaves, targets, backend="triton", algorithm=algorithm, **kwargs)
        expected = infonce_loss_reference(*leaves_ref, targets, **kwargs)
        name = "masked" if masked else "unmasked"
        assert_close_rel(loss, expected, rms_tol=RMS_TOLERANCE[dtype], name=f"{name} loss")
        # Random positive row weights: every row's gradient is scaled differently.
        grad_out = torch.rand(expected.shape, generator=_generator(1)).to(device) + 0.5
        grads = torch.autograd.grad(loss, leaves, grad_out)
        grads_ref = torch.autograd.grad(expected, leaves_ref, grad_out)
        for grad_name, grad, grad_ref in zip(("grad_pred", "grad_embeds"), grads, grads_ref):
            assert_close_rel(grad, grad_ref, rms_tol=RMS_TOLERANCE[dtype], name=f"{name} {grad_name}")


def _sample(pred, embeds, mask, algorithm: str = "auto") -> torch.Tensor:
    """A seeded Gumbel-max draw. tau = 1e4 scales the logits to ~1e-3, so the rounding differences between
    configs (~1e-9 after the scaling) cannot reorder the noise, which every config computes bit for bit
    the same (one Philox draw per (row, action), whatever the tiling)."""
    return select_actions(pred, embeds, mode="sample", tau=1e4, mask=mask, generator=_generator(7), backend="triton",
                          algorithm=algorithm)  # fmt: skip


def check_select(device: str, dtype: torch.dtype, algorithm: str = "auto") -> None:
    """``select_actions(backend="triton")``: argmax picks an available action whose reference logit is the
    row's maximum (up to rounding: near-ties may go either way); sampling picks available actions."""
    pred, embeds, mask, _ = _contrastive_inputs(device, dtype)
    logits = action_logits_reference(pred.float(), embeds.float(), mask=mask)
    chosen = select_actions(pred, embeds, mode="argmax", mask=mask, backend="triton", algorithm=algorithm)
    assert mask.gather(-1, chosen[..., None]).all(), "argmax picked an unavailable action"
    best = logits.max(-1).values
    gap = (best - logits.gather(-1, chosen[..., None])[..., 0]).max().item()
    assert gap <= 1e-4 * best.abs().max().item(), f"argmax is {gap:.3e} below the best logit"
    sampled = _sample(pred, embeds, mask, algorithm)
    assert mask.gather(-1, sampled[..., None]).all(), "sampling picked an unavailable action"


def check_gated_attention(device: str, dtype: torch.dtype) -> None:
    """``gated_attention(backend="triton")`` and every gradient against the reference: softmax gate with
    smeared keys, and the linear gate (whose dq pass also recomputes ``P V``). bf16 tolerance as in
    tests/test_attention_kernels.py (P and dS are rounded to bf16 for the tensor-core dots). fp32 inputs launch
    their own fixed tile (``FP32_TILES``) whatever config is forced: the configs are exercised in bf16."""
    tiny = device == "cpu"
    # Tiny: L = 70 is one 128-row, two 64-row or three 32-row blocks (ragged); Dh = 24 pads to 32. CUDA: L = 1000.
    batch, heads, length, head_dim = (1, 2, 70, 24) if tiny else (2, 12, 1000, 64)
    gen = _generator(length + head_dim)
    tol = 3e-2 if dtype == torch.bfloat16 else RMS_TOLERANCE[dtype]
    for gate, smear in (("softmax", True), ("linear", False)):
        leaves = [torch.randn(batch, heads, length, head_dim, generator=gen).to(device, dtype) for _ in range(3)]
        leaves.append(torch.randn(batch, length, heads, generator=gen).to(device, dtype))
        alpha = torch.randn(heads, generator=gen).to(device) if smear else None
        leaves = [t.requires_grad_(True) for t in leaves] + ([alpha.requires_grad_(True)] if smear else [])
        refs = [t.detach().float().requires_grad_(True) for t in leaves]
        out = gated_attention(*leaves[:4], gate=gate, smear_alpha=alpha, backend="triton")
        ref = gated_attention_reference(*refs[:4], gate=gate, smear_alpha=refs[4] if smear else None)
        grad_out = torch.randn(ref.shape, generator=gen).to(device, dtype)
        grads = torch.autograd.grad(out, leaves, grad_out)
        grads_ref = torch.autograd.grad(ref, refs, grad_out.float())
        names = ("output", *(f"grad {name}" for name in ("q", "k", "v", "gate_logits", "smear_alpha")))
        pairs = list(zip(names, (out, *grads), (ref, *grads_ref)))
        # Every error first (a failure shows them all in the captured output), next to PyTorch's own path in
        # the same dtype (SDPA and the eager gate) on the same inputs: the rounding a bf16 user already gets.
        eager = gated_attention(*leaves[:4], gate=gate, smear_alpha=alpha, backend="eager")
        eager_values = (eager, *torch.autograd.grad(eager, leaves, grad_out))
        for (name, actual, expected), baseline in zip(pairs, eager_values):
            print(f"{gate} {name}: relative RMS error {relative_rms_error(actual, expected):.3e} "
                  f"(PyTorch {dtype}: {relative_rms_error(baseline, expected):.3e})")  # fmt: skip
        for name, actual, expected in pairs:
            assert_close_rel(actual, expected, rms_tol=tol, name=f"{gate} {name}")


def forced(algorithm: str, check):
    """``check`` with the InfoNCE / selection ``algorithm`` (``contrastive/algorithms.py``); chunked ones in
    chunks of 4 rows (and 64 actions) under the interpreter, so that several chunks run, of 256 rows on CUDA."""

    def run(device: str, dtype: torch.dtype) -> None:
        from icrl_kernels.contrastive.algorithms import chunk_sizes

        rows = 4 if device == "cpu" else 256
        with chunk_sizes(chunk_bytes=4 * rows * 64, action_chunk=64):
            check(device, dtype, algorithm=algorithm)

    return run


def _chunked(check):
    """``check`` with row chunks and with action chunks."""
    return lambda device, dtype: [forced(algorithm, check)(device, dtype) for algorithm in CHUNKED_ALGORITHMS]


CHUNKED_ALGORITHMS = ("row_chunks", "action_chunks")

#: Autotuned kernel (:func:`icrl_kernels._triton.kernel_name`) -> the check of the op that launches it.
CHECKS = {
    "ngram_forward": lambda device, dtype: check_ngram("sort", device, dtype),
    "ngram_backward": lambda device, dtype: check_ngram("sort", device, dtype),
    "ngram_tiled_forward": lambda device, dtype: check_ngram("tiled", device, dtype),
    "ngram_tiled_backward": lambda device, dtype: check_ngram("tiled", device, dtype),
    "infonce_forward": check_infonce,
    "infonce_grad_pred": check_infonce,
    "infonce_grad_embeds": check_infonce,
    "select_actions": check_select,
    "infonce_small": forced("small", lambda device, dtype, algorithm: check_infonce(device, dtype, 100, algorithm)),
    "infonce_chunk": _chunked(check_infonce),
    "select_chunk": _chunked(check_select),
    "gated_attention_forward": check_gated_attention,
    "gated_attention_backward_dkdv": check_gated_attention,
    "gated_attention_backward_dq": check_gated_attention,
}

KERNELS = {kernel_name(kernel): kernel for kernel in autotuned_kernels()}
CONFIGS = [
    pytest.param(name, config, id=f"{name}-{config_name(config)}")
    for name, kernel in KERNELS.items()
    for config in autotune_configs(kernel)
]


def test_every_autotuned_kernel_has_a_check():
    assert set(KERNELS) == set(CHECKS), "add a check for every autotuned kernel to CHECKS"
    ids = [param.id for param in CONFIGS]
    assert len(set(ids)) == len(ids), f"two configs of one kernel share an id: {sorted(ids)}"


@pytest.mark.slow  # every autotune config of every kernel (docs/testing.md#test-tiers)
@pytest.mark.parametrize("name,config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", triton_devices())
def test_config_matches_reference(device, dtype, name, config):
    with forced_config(KERNELS[name], config):
        CHECKS[name](device, dtype)


@pytest.mark.slow  # every selection config (docs/testing.md#test-tiers)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", triton_devices())
def test_sampling_does_not_depend_on_the_config(device, dtype):
    """The same seed draws the same actions in every selection config."""
    pred, embeds, mask, _ = _contrastive_inputs(device, dtype)
    kernel = KERNELS["select_actions"]
    draws = {}
    for config in autotune_configs(kernel):
        with forced_config(kernel, config):
            draws[config_name(config)] = _sample(pred, embeds, mask)
    first, *others = draws.items()
    for name, draw in others:
        differ = int((draw != first[1]).sum())
        assert differ == 0, f"{name} draws {differ} actions unlike {first[0]}"
