"""Shared pieces of the contrastive-op tests (tests/test_contrastive_*.py): the parity cases and their inputs,
and the checks that more than one file runs (on the fused path, and under each forced algorithm)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import pytest
import torch

from icrl_kernels.contrastive import (
    action_logits_reference,
    infonce_loss,
    infonce_loss_reference,
    select_actions,
    select_actions_reference,
)
from icrl_kernels.testing import (
    RMS_TOLERANCE,
    assert_close_rel,
    relative_rms_error,
)

IGNORE = -100


class Case(NamedTuple):
    """One InfoNCE problem: ``pred_shape`` is ``[N, D]``, ``[B, T, D]`` or (per-sequence) ``[B, D]``."""

    name: str
    pred_shape: tuple[int, ...]
    num_actions: int
    per_sequence: bool
    mask: str | None  # None, "A" ([A]), "BA" ([B, A]) or "full" (pred.shape[:-1] + (A,))
    ignore: float  # fraction of rows whose target is ignore_index
    tau: float
    reduction: str


class Inputs(NamedTuple):
    pred: torch.Tensor
    embeds: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor | None


def random_mask(shape: tuple[int, ...], generator: torch.Generator, keep: float = 0.6) -> torch.Tensor:
    """Random availability with at least one available action per row (the op rejects empty rows)."""
    mask = torch.rand(shape, generator=generator) < keep
    flat = mask.reshape(-1, shape[-1])
    flat[torch.arange(flat.shape[0]), torch.randint(0, shape[-1], (flat.shape[0],), generator=generator)] = True
    return flat.reshape(shape)


def expand_mask(mask: torch.Tensor | None, logits_shape: tuple[int, ...]) -> torch.Tensor:
    """A mask in any accepted layout, broadcast to the full ``logits_shape`` (as the reference aligns it)."""
    if mask is None:
        return torch.ones(logits_shape, dtype=torch.bool)
    if mask.dim() == 2 and len(logits_shape) == 3:
        mask = mask[:, None, :]
    return mask.expand(logits_shape)


def make_inputs(case: Case, dtype: torch.dtype, device: str, seed: int, ignore_index: int = IGNORE) -> Inputs:
    """Fresh random inputs; logits have a standard deviation of about 2 / tau (peaked but not one-hot).

    Targets are drawn among each row's available actions; a fraction ``case.ignore`` is then padding.
    """
    gen = torch.Generator().manual_seed(seed)
    *lead, dim = case.pred_shape
    num_actions = case.num_actions
    pred = torch.randn(*lead, dim, generator=gen)
    embeds_shape = (lead[0], num_actions, dim) if case.per_sequence else (num_actions, dim)
    embeds = torch.randn(embeds_shape, generator=gen) * (2.0 / math.sqrt(dim))
    logits_shape = (*lead, num_actions)
    mask = {
        None: lambda: None,
        "A": lambda: random_mask((num_actions,), gen),
        "BA": lambda: random_mask((lead[0], num_actions), gen),
        "full": lambda: random_mask(logits_shape, gen),
    }[case.mask]()
    available = expand_mask(mask, logits_shape).reshape(-1, num_actions).float()
    targets = torch.multinomial(available, 1, generator=gen).reshape(lead)
    if case.ignore > 0:
        targets[torch.rand(lead, generator=gen) < case.ignore] = ignore_index
    pred, embeds = pred.to(device=device, dtype=dtype), embeds.to(device=device, dtype=dtype)
    return Inputs(pred, embeds, targets.to(device), None if mask is None else mask.to(device))


def check_infonce_parity(
    inputs: Inputs,
    backend: str,
    *,
    tau: float,
    reduction: str,
    ignore_index: int = IGNORE,
    embeds_grad: bool = True,
    seed: int = 0,
    algorithm: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Loss and gradients of ``backend`` against the fp32 reference on the same (upcast) inputs."""
    dtype = inputs.pred.dtype
    pred = inputs.pred.detach().clone().requires_grad_(True)
    embeds = inputs.embeds.detach().clone().requires_grad_(embeds_grad)
    pred_ref = inputs.pred.detach().float().requires_grad_(True)
    embeds_ref = inputs.embeds.detach().float().requires_grad_(True)
    kwargs = {"tau": tau, "mask": inputs.mask, "reduction": reduction, "ignore_index": ignore_index}
    loss = infonce_loss(pred, embeds, inputs.targets, backend=backend, algorithm=algorithm, **kwargs)
    expected = infonce_loss_reference(pred_ref, embeds_ref, inputs.targets, **kwargs)
    assert loss.dtype == torch.float32, "the loss is float32 whatever the input dtype"
    assert loss.shape == expected.shape
    # The tolerance is the one of the *input* dtype (the loss is always float32). float64 inputs are
    # computed in fp32 by every path, the reference included, so they get the fp32 tolerance.
    tol = RMS_TOLERANCE[torch.float32 if dtype == torch.float64 else dtype]
    assert_close_rel(loss, expected, rms_tol=tol, name=f"{backend} loss")
    if reduction == "none":
        ignored = inputs.targets == ignore_index
        assert torch.equal(loss.detach()[ignored], torch.zeros_like(loss.detach()[ignored])), "ignored rows are 0"

    gen = torch.Generator().manual_seed(seed + 1)
    # Random positive upstream weights, so every row's gradient is scaled differently.
    grad_out = (torch.rand(expected.shape, generator=gen) + 0.5).to(loss.device)
    leaves = (pred, embeds) if embeds_grad else (pred,)
    grads = torch.autograd.grad(loss, leaves, grad_out)
    grads_ref = torch.autograd.grad(expected, (pred_ref, embeds_ref), grad_out)
    for name, grad, grad_ref in zip(("grad_pred", "grad_embeds"), grads, grads_ref):
        assert grad.dtype == dtype, f"{name} must have the input dtype"
        assert_close_rel(grad, grad_ref, rms_tol=tol, name=f"{backend} {name}")
    return loss, grads


PARITY_CASES = [
    Case("A1-single-action", (13, 24), 1, False, None, 0.0, 1.0, "mean"),
    Case("A5-maskA-tau0.5", (37, 24), 5, False, "A", 0.0, 0.5, "sum"),
    Case("A7-BTD-fullmask-ignore", (3, 11, 40), 7, False, "full", 0.2, 1.0, "none"),
    Case("A7-BTD-maskBA-tau1.7", (2, 9, 24), 7, False, "BA", 0.1, 1.7, "mean"),
    Case("perseq-BD-A5-mask", (4, 24), 5, True, "BA", 0.0, 1.0, "none"),  # [B, A] is the full mask here
    Case("perseq-BTD-A7-maskBA", (3, 10, 40), 7, True, "BA", 0.1, 2.0, "mean"),
    # Two action tiles (128 + 22), D = 72 spans three BLOCK_D chunks, masked actions in both tiles.
    Case("A150-D72-maskA", (45, 72), 150, False, "A", 0.0, 0.7, "mean"),
    Case("A300-BTD-shared", (2, 5, 40), 300, False, None, 0.0, 1.0, "sum"),
    Case("perseq-A300-fullmask", (2, 9, 40), 300, True, "full", 0.2, 1.3, "none"),
    # D = 260: one full-width (next_pow2 = 512) accumulator, ragged columns.
    Case("D260-full-width", (21, 260), 9, False, None, 0.0, 1.0, "none"),
    # D = 520 > MAX_DO = 512 of the first config: the backward's column-block fallback (two blocks), with
    # streamed actions (two half tiles, ten fp32 ones) and a padded [A] mask.
    Case("D520-column-fallback", (11, 520), 150, False, "A", 0.1, 0.8, "mean"),
]


CASES = {case.name: case for case in PARITY_CASES}


def check_single_available_action(backend, device, per_sequence, algorithm: str = "auto"):
    """With one available action the softmax is 1 on the target: loss and both gradients exactly 0."""
    gen = torch.Generator().manual_seed(5)
    for num_actions, mask_kind in ((1, None), (7, "one-per-row")):
        pred = torch.randn(3, 11, 24, generator=gen).to(device).requires_grad_(True)
        shape = (3, num_actions, 24) if per_sequence else (num_actions, 24)
        embeds = torch.randn(shape, generator=gen).to(device).requires_grad_(True)
        targets = torch.randint(0, num_actions, (3, 11), generator=gen).to(device)
        mask = None
        if mask_kind:
            mask = torch.nn.functional.one_hot(targets, num_actions).bool()
        loss = infonce_loss(pred, embeds, targets, mask=mask, reduction="none", backend=backend, algorithm=algorithm)
        assert torch.equal(loss.detach(), torch.zeros_like(loss)), loss
        grad_pred, grad_embeds = torch.autograd.grad(loss.sum(), (pred, embeds))
        assert torch.equal(grad_pred, torch.zeros_like(grad_pred))
        assert torch.equal(grad_embeds, torch.zeros_like(grad_embeds))


def check_ignore_index_values(backend, device, ignore_index, algorithm: str = "auto"):
    """``ignore_index`` may be any int: negative, a valid action id, or an id past the action set."""
    # A full mask: with ignore_index = 2, padded rows may "target" an action their mask excludes.
    case = Case("ignore", (4, 9, 24), 5, False, "full", 0.3, 1.2, "none")
    inputs = make_inputs(case, torch.float32, device, seed=9, ignore_index=ignore_index)
    assert (inputs.targets == ignore_index).any()
    for reduction in ("none", "mean"):
        check_infonce_parity(
            inputs, backend, tau=case.tau, reduction=reduction, ignore_index=ignore_index, algorithm=algorithm
        )


def check_all_rows_ignored(backend, device, algorithm: str = "auto"):
    """Every row padding: the sum is 0 with zero gradients; the mean is NaN (0 / 0), as in the reference, and
    its gradients are zero too (the reference's are: ignored rows take no share of the inf upstream)."""
    gen = torch.Generator().manual_seed(10)
    pred = torch.randn(2, 5, 16, generator=gen).to(device).requires_grad_(True)
    embeds = torch.randn(7, 16, generator=gen).to(device).requires_grad_(True)
    targets = torch.full((2, 5), IGNORE, device=device)
    total = infonce_loss(pred, embeds, targets, reduction="sum", backend=backend, algorithm=algorithm)
    assert total.item() == 0.0
    grad_pred, grad_embeds = torch.autograd.grad(total, (pred, embeds))
    assert not grad_pred.any() and not grad_embeds.any()
    mean = infonce_loss(pred, embeds, targets, backend=backend, algorithm=algorithm)
    expected = infonce_loss_reference(pred, embeds, targets)
    assert torch.isnan(mean) and torch.isnan(expected)
    for grad, grad_ref in zip(torch.autograd.grad(mean, (pred, embeds)), torch.autograd.grad(expected, (pred, embeds))):
        assert not grad.any() and not grad_ref.any()


def assert_argmax_equal(actions, pred, embeds, tau, mask, *, gap: float) -> None:
    """Exact equality with the reference argmax, except rows whose top two logits are within ``gap``
    (two implementations may round a near-tie differently; then either of the two is right)."""
    expected = select_actions_reference(pred, embeds, tau=tau, mask=mask)
    assert actions.shape == expected.shape and actions.dtype == torch.int64
    logits = action_logits_reference(pred, embeds, tau=tau, mask=mask)
    top2 = logits.topk(min(2, logits.shape[-1]), dim=-1)
    if logits.shape[-1] > 1:
        near_tie = (top2.values[..., 0] - top2.values[..., 1]) < gap
        alternative = torch.where(near_tie, top2.indices[..., 1], expected)
    else:
        near_tie, alternative = torch.zeros_like(expected, dtype=torch.bool), expected
    ok = (actions == expected) | (actions == alternative)
    assert ok.all(), f"{int((~ok).sum())} rows differ from the reference argmax"
    assert near_tie.float().mean() < 0.05, "too many near-ties: the test would be vacuous"
    picked_available = expand_mask(None if mask is None else mask.cpu(), tuple(logits.shape)).to(logits.device)
    assert picked_available.gather(-1, actions[..., None]).all(), "picked an unavailable action"


def check_fp16_gradients(
    pred, embeds, targets, upstream, *, backend: str, tau: float, reduction: str, context, algorithm: str = "auto"
):
    """Both gradients of ``infonce_loss`` on fp16 inputs (run within ``context``) within 5% of the error of the
    fp32 reference's rounded to fp16, both against float64; return the fp32 and float64 gradients."""

    def grads(fn, dtype):
        p, e = pred.detach().to(dtype).requires_grad_(True), embeds.detach().to(dtype).requires_grad_(True)
        loss = fn(p, e, targets, tau=tau, reduction=reduction)
        return torch.autograd.grad(loss, (p, e), upstream.to(loss.dtype))

    with context:
        ours = grads(functools.partial(infonce_loss, backend=backend, algorithm=algorithm), torch.float16)
    fp32 = grads(infonce_loss_reference, torch.float32)
    truth = grads(infonce_loss_reference, torch.float64)
    for name, out, ref32, ref64 in zip(("grad_pred", "grad_embeds"), ours, fp32, truth):
        assert out.dtype == torch.float16
        error, rounded_error = relative_rms_error(out, ref64), relative_rms_error(ref32.half(), ref64)
        assert error <= 1.05 * rounded_error, (name, error, rounded_error)
    return fp32, truth


def check_select_nan(backend: str, device: str, where: str, algorithm: str = "auto") -> None:
    """NaN in ``pred`` or the map raises ValueError naming both arguments; with value checks off, every
    row still gets an available action (NaN scores rank lowest; rows of all-NaN scores take their first
    available action, never action 0 when it is masked). Also used by test_contrastive_algorithms.py."""
    from icrl_kernels import set_value_checks

    gen = torch.Generator().manual_seed(41)
    pred = torch.randn(2, 9, 16, generator=gen)
    embeds = torch.randn(150, 16, generator=gen)
    mask = random_mask((2, 9, 150), gen)
    mask[:, :, 0] = False
    if where == "pred":
        pred[1, 3] = float("nan")
    else:
        embeds[[5, 140]] = float("nan")
    pred, embeds, mask = pred.to(device), embeds.to(device), mask.to(device)
    for mode in ("argmax", "sample"):
        with pytest.raises(ValueError, match="pred or action_embeds contains NaN"):
            select_actions(pred, embeds, mode=mode, mask=mask, backend=backend, algorithm=algorithm)
        previous = set_value_checks("off")
        try:
            actions = select_actions(pred, embeds, mode=mode, mask=mask, backend=backend, algorithm=algorithm,
                                     generator=torch.Generator().manual_seed(1))  # fmt: skip
        finally:
            set_value_checks(previous)
        assert mask.gather(-1, actions[..., None]).all(), f"{mode} picked a masked action"
    # NaN only in the embedding of an action no row may take is harmless: no error.
    embeds_masked_nan = embeds.nan_to_num(0.0).clone()
    embeds_masked_nan[0] = float("nan")
    clean_pred = pred.nan_to_num(0.0)
    actions = select_actions(
        clean_pred, embeds_masked_nan, mode="argmax", mask=mask, backend=backend, algorithm=algorithm
    )
    assert mask.gather(-1, actions[..., None]).all()


def check_select_overflow(backend: str, device: str, mode: str, algorithm: str = "auto") -> None:
    """tau = 1e-38 sends every logit to +-inf. Rows whose available logits are all -inf must get their
    first available action (the kernel's running best once started at action 0, which is masked here);
    rows with several +inf available logits, the lowest of them in argmax mode. Also used by
    test_contrastive_algorithms.py."""
    gen = torch.Generator().manual_seed(42)
    embeds = torch.randn(150, 16, generator=gen)
    pred = torch.randn(40, 16, generator=gen) * 1000  # |logits| ~ 4e3 / 1e-38: +-inf in fp32
    dots = pred @ embeds.T
    mask = dots.abs() > 10  # |logit| > 1e39: every available logit overflows to +-inf
    mask[:20] &= dots[:20] < 0  # rows 0-19: only the actions of negative logit (all -inf)
    mask[:, 0] = False
    assert mask.any(-1).all()
    pred, embeds, mask = pred.to(device), embeds.to(device), mask.to(device)
    logits = action_logits_reference(pred, embeds, tau=1e-38, mask=mask)
    all_neg = ~(logits > float("-inf")).any(-1)
    assert all_neg[:20].all() and not all_neg[20:].any()
    actions = select_actions(pred, embeds, mode=mode, tau=1e-38, mask=mask, backend=backend, algorithm=algorithm,
                             generator=torch.Generator().manual_seed(2))  # fmt: skip
    assert mask.gather(-1, actions[:, None]).all(), "picked a masked action"
    first_available = mask.int().argmax(-1)
    assert torch.equal(actions[:20], first_available[:20]), "all -inf rows take their first available action"
    if mode == "argmax":  # +inf ties: the lowest available id among them, as torch.argmax
        assert (logits[20:] == float("inf")).sum(-1).min() > 1, "ties at +inf must be common"
        expected = select_actions_reference(pred, embeds, tau=1e-38, mask=mask)
        assert torch.equal(actions[20:], expected[20:])
