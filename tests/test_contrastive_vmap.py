"""``torch.func.vmap`` over runs of the contrastive ops (issue 54: batched runs with per-run action maps).

Each of ``K`` stacked runs has its own predictions, targets, mask and action map (``[A, D]`` per run, or
``[B, A, D]`` one per sequence), or the runs share one map. Under ``vmap`` the ops' rules fold the runs into
one call (``contrastive/function.py``: ``_fold_runs``), reduce the loss per run, and give every run what its
own call gives: loss and both gradients, on every backend and algorithm, against a loop of single calls. A
spy on the kernel launches shows the runs cost one call's launches, not ``K``. Kernel outputs start
NaN-poisoned (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from _contrastive import IGNORE, random_mask

from icrl_kernels.contrastive import infonce_loss, select_actions
from icrl_kernels.contrastive.algorithms import ACTION_CHUNKS, FUSED, INFONCE_ALGORITHMS, ROW_CHUNKS, chunk_sizes
from icrl_kernels.testing import triton_devices

RUNS, BATCH, STEPS, DIM, ACTIONS = 3, 2, 5, 16, 7
PATHS = [pytest.param("eager", "auto", "cpu", id="eager"), pytest.param("reference", "auto", "cpu", id="reference")]
PATHS += [pytest.param("triton", algorithm, device, id=f"{algorithm}-{device}")
          for device in triton_devices() for algorithm in INFONCE_ALGORITHMS]  # fmt: skip
#: How the runs hold their maps: one ``[A, D]`` map per run, one ``[B, A, D]`` map per sequence of each run, or
#: one ``[A, D]`` map every run shares (not vmapped); with the mask layouts and prediction shapes they meet.
LAYOUTS = ["run-map", "sequence-maps", "shared-map", "rows-2d"]


def _problem(layout: str, device: str, seed: int):
    """``(pred, embeds, targets, mask, in_dims)`` of ``RUNS`` runs: run 2 is all padding (its mean is NaN, its
    gradients 0), run 1 has one padded row; targets among each row's available actions."""
    gen = torch.Generator().manual_seed(seed)
    rows = (BATCH, STEPS) if layout != "rows-2d" else (BATCH * STEPS,)
    pred = torch.randn(RUNS, *rows, DIM, generator=gen)
    if layout == "sequence-maps":
        embeds, mask = torch.randn(RUNS, BATCH, ACTIONS, DIM, generator=gen), random_mask((RUNS, BATCH, ACTIONS), gen)
        full = mask[:, :, None].expand(RUNS, BATCH, STEPS, ACTIONS)
    elif layout == "shared-map":
        embeds, mask = torch.randn(ACTIONS, DIM, generator=gen), random_mask((ACTIONS,), gen)
        full = mask.expand(RUNS, *rows, ACTIONS)
    else:
        embeds, mask = torch.randn(RUNS, ACTIONS, DIM, generator=gen), random_mask((RUNS, *rows, ACTIONS), gen)
        full = mask
    targets = torch.multinomial(full.reshape(-1, ACTIONS).float(), 1, generator=gen).view(RUNS, *rows)
    targets.view(RUNS, -1)[1, 3] = IGNORE
    targets[2] = IGNORE
    shared = layout == "shared-map"
    in_dims = (0, None if shared else 0, 0, None if shared else 0)
    return pred.to(device), (embeds * 0.5).to(device), targets.to(device), mask.to(device), in_dims


def _run(values: tuple, in_dims: tuple, run: int) -> tuple:
    return tuple(value if dim is None else value[run] for value, dim in zip(values, in_dims))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend,algorithm,device", PATHS)
def test_infonce_under_vmap_equals_each_run_alone(backend, algorithm, device, layout):
    """Loss and both gradients of every reduction under ``vmap`` equal a loop of single calls (fp32 rounding:
    the reductions add in another order), the map's gradient also where every run shares the map."""
    pred, embeds, targets, mask, in_dims = _problem(layout, device, seed=LAYOUTS.index(layout))
    for reduction in ("mean", "sum", "none"):

        def loss(p, e, t, m, reduction=reduction):
            return infonce_loss(p, e, t, mask=m, tau=0.8, reduction=reduction, algorithm=algorithm, backend=backend)

        leaves = (pred.clone().requires_grad_(True), embeds.clone().requires_grad_(True))
        mapped = torch.vmap(loss, in_dims=in_dims)(*leaves, targets, mask)
        weights = torch.rand(mapped.shape, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
        grads = torch.autograd.grad((mapped.nan_to_num() * weights).sum(), leaves)
        alone_leaves = (pred.clone().requires_grad_(True), embeds.clone().requires_grad_(True))
        alone = torch.stack([loss(*_run((*alone_leaves, targets, mask), in_dims, k)) for k in range(RUNS)])
        alone_grads = torch.autograd.grad((alone.nan_to_num() * weights).sum(), alone_leaves)
        assert mapped.shape == alone.shape and mapped.dtype == torch.float32
        torch.testing.assert_close(mapped, alone, equal_nan=True, msg=f"{reduction} loss")
        for name, grad, expected in zip(("grad_pred", "grad_embeds"), grads, alone_grads):
            torch.testing.assert_close(grad, expected, msg=f"{reduction} {name}")
        if reduction == "mean":
            assert torch.isnan(mapped[2]) and not torch.isnan(mapped[:2]).any()  # run 2 is all padding


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("algorithm", INFONCE_ALGORITHMS)
def test_vmapped_runs_dispatch_one_calls_launches(monkeypatch, algorithm, device):
    """Under ``vmap`` the runs are one call of the kernels: a forward and backward of ``RUNS`` runs launch what
    one run's call launches (the run dimension is folded into the kernels' grid), for both ops."""
    from icrl_kernels.contrastive import chunked_kernels, fused_kernels, small_kernels

    launches: list[str] = []
    for module in (fused_kernels, small_kernels, chunked_kernels):
        real = module.launch
        monkeypatch.setattr(
            module, "launch", lambda kernel, grid, real=real: launches.append(kernel) or real(kernel, grid)
        )
    pred, embeds, targets, mask, in_dims = _problem("run-map", device, seed=7)
    action_chunk = 3 if algorithm == ACTION_CHUNKS else None  # several action chunks

    def step(p, e, t, m):
        loss = infonce_loss(p, e, t, mask=m, algorithm=algorithm, backend="triton")
        return loss, select_actions(p.detach(), e.detach(), mask=m, algorithm=algorithm, backend="triton")

    counts = []
    for call in (lambda *args: torch.vmap(step, in_dims=in_dims, randomness="different")(*args),
                 lambda *args: step(*_run(args, in_dims, 0))):  # fmt: skip
        launches.clear()
        leaves = (pred.clone().requires_grad_(True), embeds.clone().requires_grad_(True))
        with chunk_sizes(action_chunk=action_chunk):
            loss, _ = call(*leaves, targets, mask)
            loss.sum().backward()
        counts.append(len(launches))
    assert counts[0] == counts[1] and counts[0] >= 2, counts


@pytest.mark.parametrize("layout", ["run-map", "sequence-maps", "shared-map"])
@pytest.mark.parametrize("backend,algorithm,device", [p for p in PATHS if p.values[1] in ("auto", FUSED, ROW_CHUNKS)])
def test_select_under_vmap_equals_each_run_alone(backend, algorithm, device, layout):
    """Argmax under ``vmap`` equals each run's own call; sampling with ``randomness="same"`` (one seed for every
    run) draws what each run draws alone from that generator; with ``"different"`` the runs draw apart, never an
    unavailable action."""
    pred, embeds, _, mask, in_dims = _problem(layout, device, seed=11)
    in_dims = (in_dims[0], in_dims[1], in_dims[3])

    def pick(mode, tau=0.5):
        def one(p, e, m):
            return select_actions(p, e, mode=mode, mask=m, tau=tau, generator=torch.Generator().manual_seed(5),
                                  algorithm=algorithm, backend=backend)  # fmt: skip

        return one

    for mode in ("argmax", "sample"):
        mapped = torch.vmap(pick(mode), in_dims=in_dims, randomness="same")(pred, embeds, mask)
        alone = torch.stack([pick(mode)(*_run((pred, embeds, mask), in_dims, k)) for k in range(RUNS)])
        assert torch.equal(mapped, alone), mode
    # Identical runs with their own seeds (every action available, a high tau: near-uniform draws): the runs draw
    # apart.
    same_pred, every_action = pred[:1].expand_as(pred).contiguous(), torch.ones_like(mask)
    draws = torch.vmap(pick("sample", tau=100.0), in_dims=in_dims, randomness="different")(
        same_pred, embeds, every_action
    )
    if layout == "shared-map":  # the same scores in every run: only the seeds tell the runs apart
        assert not (draws[0] == draws[1]).all()
    # And never an unavailable action.
    draws = torch.vmap(pick("sample"), in_dims=in_dims, randomness="different")(pred, embeds, mask)
    available = mask if in_dims[2] is not None else mask.expand(RUNS, *pred.shape[1:-1], ACTIONS)
    if layout == "sequence-maps":
        available = available[:, :, None].expand(RUNS, BATCH, STEPS, ACTIONS)
    assert available.gather(-1, draws[..., None]).all(), "a draw picked an unavailable action"
