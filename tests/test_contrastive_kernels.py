"""Contrastive action scoring (Headless-AD, docs/ops.md#contrastive-action-scoring):
fused InfoNCE, action selection, action maps.

Every parity test draws fresh random inputs and compares the loss and BOTH gradients (``pred`` and
``action_embeds``) of the eager and Triton paths with ``infonce_loss_reference`` (the fp32 spec).
Half-precision results are compared with the fp32 reference evaluated on the same half inputs upcast,
at the tolerances of :data:`RMS_TOLERANCE` for the input dtype. Kernel outputs start NaN-poisoned
(tests/conftest.py), so an element a kernel never writes fails.

Kernel paths that only some shapes reach are forced and then *verified* to have been taken (by
spying on the allocations or the chunk iterator), so that a change of heuristics cannot silently
turn a test into one that no longer covers its path:

* the ``grad_embeds`` row split (``num_splits > 1``: fp32 partial sums added afterwards) and the
  single-pass layout (``num_splits == 1``);
* the eager path's two chunking branches (several sequences per chunk, or a slice of steps).

Shapes stay small: under ``TRITON_INTERPRET=1`` every program costs milliseconds on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
import zlib

import pytest
import torch
from _contrastive import (
    CASES,
    IGNORE,
    PARITY_CASES,
    Case,
    Inputs,
    assert_argmax_equal,
    check_all_rows_ignored,
    check_fp16_gradients,
    check_ignore_index_values,
    check_infonce_parity,
    check_select_nan,
    check_select_overflow,
    check_single_available_action,
    expand_mask,
    make_inputs,
    random_mask,
)

from benchmarks.kernel_tools import check_offline_reports, run_offline_compile
from icrl_kernels.contrastive import (
    OvercompleteEmbeddingWarning,
    action_logits_reference,
    infonce_loss,
    infonce_loss_reference,
    orthonormal_embeddings,
    select_actions,
    select_actions_reference,
)
from icrl_kernels.contrastive import eager as contrastive_eager
from icrl_kernels.contrastive.algorithms import FUSED, INFONCE_ALGORITHMS
from icrl_kernels.contrastive.function import infonce_backward_op, infonce_op, padded_mask, select_actions_op
from icrl_kernels.modules.action_map import ActionMap
from icrl_kernels.testing import (
    RMS_TOLERANCE,
    TESTED_DTYPES,
    assert_close_rel,
    relative_rms_error,
    triton_devices,
)

TRITON_DEVICES = triton_devices()
FAST_PATHS = [pytest.param("eager", "cpu", id="eager")] + [
    pytest.param("triton", device, id=f"triton-{device}") for device in TRITON_DEVICES
]
ALL_PATHS = FAST_PATHS + [pytest.param("reference", "cpu", id="reference")]
DTYPES = list(TESTED_DTYPES)


# --- input builders --------------------------------------------------------------------------------


# --- InfoNCE parity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.name)
def test_infonce_parity(case: Case, dtype, backend, device):
    inputs = make_inputs(case, dtype, device, seed=zlib.crc32(case.name.encode()))
    check_infonce_parity(inputs, backend, tau=case.tau, reduction=case.reduction)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", [CASES["A7-BTD-fullmask-ignore"]], ids=lambda c: c.name)
def test_infonce_reductions(case: Case, reduction, backend, device):
    inputs = make_inputs(case, torch.float32, device, seed=17)
    check_infonce_parity(inputs, backend, tau=case.tau, reduction=reduction)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("case", [CASES["A7-BTD-maskBA-tau1.7"], CASES["perseq-A300-fullmask"]], ids=lambda c: c.name)
def test_fixed_map_gets_no_gradient(case: Case, backend, device):
    """A random action map that does not require grad: no gradient for it, ``pred``'s still right."""
    inputs = make_inputs(case, torch.float32, device, seed=23)
    pred = inputs.pred.clone().requires_grad_(True)
    embeds = inputs.embeds.clone()
    loss = infonce_loss(pred, embeds, inputs.targets, tau=case.tau, mask=inputs.mask, backend=backend)
    loss.backward()
    assert embeds.grad is None
    pred_ref = inputs.pred.clone().requires_grad_(True)
    infonce_loss_reference(pred_ref, embeds, inputs.targets, tau=case.tau, mask=inputs.mask).backward()
    assert_close_rel(pred.grad, pred_ref.grad, name="grad_pred")
    # The helper also checks grad_pred through autograd.grad with a fixed map and a random upstream.
    check_infonce_parity(inputs, backend, tau=case.tau, reduction="none", embeds_grad=False)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_only_the_map_requires_grad(backend, device):
    """The reverse (e.g. learning the map against fixed predictions): gradient for the map only."""
    case = CASES["A150-D72-maskA"]
    inputs = make_inputs(case, torch.float32, device, seed=24)
    pred, embeds = inputs.pred.clone(), inputs.embeds.clone().requires_grad_(True)
    infonce_loss(pred, embeds, inputs.targets, tau=case.tau, mask=inputs.mask, backend=backend).backward()
    assert pred.grad is None
    embeds_ref = inputs.embeds.clone().requires_grad_(True)
    infonce_loss_reference(pred, embeds_ref, inputs.targets, tau=case.tau, mask=inputs.mask).backward()
    assert_close_rel(embeds.grad, embeds_ref.grad, name="grad_embeds")


def _expected_split_buffers(allocations, groups: int, num_actions: int, dim: int) -> list[int]:
    """Row-split counts of the fp32 partial-sum buffers ``[groups * splits, A, D]`` that were allocated."""
    return [
        shape[0] // groups
        for shape, dtype in allocations
        if len(shape) == 3 and shape[1:] == (num_actions, dim) and dtype == torch.float32 and shape[0] > groups
    ]


# 200 rows on one shared map / 130 rows per sequence: grad_embeds splits the rows.
SHARED_200_ROWS = Case("shared-200rows", (2, 100, 24), 5, False, "BA", 0.1, 1.0, "mean")
PERSEQ_130_ROWS = Case("perseq-T130", (2, 130, 24), 7, True, "full", 0.1, 0.8, "sum")

SPLIT_SCENARIOS = [
    # (case, dtype, TARGET_PROGRAMS override or None, expect a row split)
    pytest.param(SHARED_200_ROWS, torch.float32, None, True, id="shared-200rows-fp32"),
    pytest.param(SHARED_200_ROWS, torch.float16, None, True, id="shared-200rows-fp16"),
    pytest.param(SHARED_200_ROWS, torch.bfloat16, None, True, id="shared-200rows-bf16"),
    pytest.param(PERSEQ_130_ROWS, torch.float32, None, True, id="perseq-T130"),
    pytest.param(
        Case("shared-150rows-D130", (150, 130), 5, False, "A", 0.1, 0.9, "mean"),
        torch.float32,
        None,
        True,
        id="shared-150rows-D130",
    ),  # fmt: skip
    # Per-sequence maps with three action tiles each and few rows: one program per tile, no split.
    pytest.param(CASES["perseq-A300-fullmask"], torch.float32, None, False, id="perseq-A300-nosplit"),
    # Enough tiles to fill the device (TARGET_PROGRAMS=1): one program walks all 200 rows (7 row blocks).
    pytest.param(SHARED_200_ROWS, torch.float32, 1, False, id="shared-200rows-nosplit"),
    pytest.param(SHARED_200_ROWS, torch.float16, 1, False, id="shared-200rows-nosplit-fp16"),
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("case,dtype,target_programs,split", SPLIT_SCENARIOS)
def test_grad_embeds_row_split_paths(monkeypatch, case: Case, dtype, target_programs, split, device):
    """Both layouts of the grad_embeds launch, with a spy proving which one ran."""
    from icrl_kernels.contrastive import fused_kernels

    allocations: list = []
    real_empty_output = fused_kernels.empty_output

    def spy(shape, *, dtype, device):
        allocations.append((tuple(shape), dtype))
        return real_empty_output(shape, dtype=dtype, device=device)

    monkeypatch.setattr(fused_kernels, "empty_output", spy)
    if target_programs is not None:
        monkeypatch.setattr(fused_kernels, "TARGET_PROGRAMS", target_programs)
    inputs = make_inputs(case, dtype, device, seed=31)
    check_infonce_parity(inputs, "triton", tau=case.tau, reduction=case.reduction)
    groups = case.pred_shape[0] if case.per_sequence else 1
    splits = _expected_split_buffers(allocations, groups, case.num_actions, case.pred_shape[-1])
    if split:
        assert splits and all(s > 1 for s in splits), f"expected a row split, allocations: {allocations}"
    else:
        assert not splits, f"expected num_splits == 1, got splits {splits}"


CHUNK_SCENARIOS = [
    # (case, CHUNK_ELEMENTS, branch): "sequences" = several whole sequences per chunk, "steps" = a slice
    # of one sequence's steps.
    pytest.param(Case("BTD-A7", (5, 3, 24), 7, False, "full", 0.2, 0.9, "none"), 50, "sequences", id="seqs-shared"),
    pytest.param(Case("BTD-A7-ps", (5, 3, 24), 7, True, "BA", 0.2, 1.1, "sum"), 50, "sequences", id="seqs-perseq"),
    pytest.param(Case("BTD-A7", (2, 9, 24), 7, False, "BA", 0.1, 1.0, "mean"), 20, "steps", id="steps-shared"),
    pytest.param(Case("BTD-A7-ps", (2, 9, 24), 7, True, "full", 0.1, 0.6, "none"), 20, "steps", id="steps-perseq"),
    # Fewer elements than one row of logits: one row per chunk.
    pytest.param(Case("N-A7", (17, 24), 7, False, "A", 0.1, 1.0, "mean"), 3, "steps", id="chunk-smaller-than-A"),
]


def _spy_chunks(monkeypatch, chunk_elements: int) -> list[tuple[slice, slice]]:
    """Make the eager path chunk at ``chunk_elements`` and record every chunk it visits."""
    seen: list[tuple[slice, slice]] = []
    real_chunks = contrastive_eager._chunks

    def spy(pred, num_actions):
        for seqs, steps in real_chunks(pred, num_actions):
            seen.append((seqs, steps))
            yield seqs, steps

    monkeypatch.setattr(contrastive_eager, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(contrastive_eager, "_chunks", spy)
    return seen


def _check_chunks(seen, batch: int, steps: int, calls: int, branch: str) -> None:
    """Each of ``calls`` passes covered every ``[B, T]`` row exactly once, in more than one chunk."""
    coverage = torch.zeros(batch, steps, dtype=torch.int64)
    for seqs, step_slice in seen:
        coverage[seqs, step_slice] += 1
    assert torch.equal(coverage, torch.full_like(coverage, calls)), coverage
    assert len(seen) > calls, "the chunk size should force several chunks per pass"
    whole_sequences = all(s.indices(steps) == (0, steps, 1) for _, s in seen)
    assert whole_sequences == (branch == "sequences"), [(a, b) for a, b in seen]


@pytest.mark.parametrize("case,chunk_elements,branch", CHUNK_SCENARIOS)
def test_eager_chunking(monkeypatch, case: Case, chunk_elements, branch):
    seen = _spy_chunks(monkeypatch, chunk_elements)
    inputs = make_inputs(case, torch.float32, "cpu", seed=41)
    check_infonce_parity(inputs, "eager", tau=case.tau, reduction=case.reduction)
    batch, steps = (1, case.pred_shape[0]) if len(case.pred_shape) == 2 else case.pred_shape[:2]
    _check_chunks(seen, batch, steps, calls=2, branch=branch)  # forward + backward

    seen.clear()
    actions = select_actions(inputs.pred, inputs.embeds, mode="argmax", tau=case.tau, mask=inputs.mask, backend="eager")
    expected = select_actions_reference(inputs.pred, inputs.embeds, tau=case.tau, mask=inputs.mask)
    assert torch.equal(actions, expected)
    _check_chunks(seen, batch, steps, calls=1, branch=branch)


# --- InfoNCE properties and edges --------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "perseq"])
def test_single_available_action_is_zero_loss_and_gradient(backend, device, per_sequence):
    """With one available action the softmax is 1 on the target: loss and both gradients exactly 0."""
    check_single_available_action(backend, device, per_sequence)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_masked_actions_get_exactly_no_mass(backend, device):
    """Masked actions are outside the softmax: their embeddings do not matter and get zero gradient."""
    gen = torch.Generator().manual_seed(6)
    num_actions, masked = 150, [3, 40, 130, 149]  # in both action tiles
    pred = torch.randn(2, 13, 24, generator=gen).to(device)
    embeds = (torch.randn(num_actions, 24, generator=gen) * 0.4).to(device)
    mask = torch.ones(num_actions, dtype=torch.bool)
    mask[masked] = False
    kept = mask.nonzero().flatten()
    # Targets among the available actions only.
    targets = kept[torch.randint(0, len(kept), (2, 13), generator=gen)]
    mask, targets = mask.to(device), targets.to(device)
    # Make the masked actions the best-scoring ones by far: if they leaked into the softmax, they would dominate.
    embeds[masked] = pred.reshape(-1, 24)[:4] * 10.0

    pred_leaf = pred.clone().requires_grad_(True)
    embeds_leaf = embeds.clone().requires_grad_(True)
    loss = infonce_loss(pred_leaf, embeds_leaf, targets, mask=mask, tau=0.8, backend=backend)
    grad_pred, grad_embeds = torch.autograd.grad(loss, (pred_leaf, embeds_leaf))
    assert torch.equal(grad_embeds[masked], torch.zeros_like(grad_embeds[masked]))

    # Same as a problem without the masked actions at all (targets renumbered).
    kept = kept.to(device)
    renumber = torch.full((num_actions,), -1, dtype=torch.int64, device=device)
    renumber[kept] = torch.arange(len(kept), device=device)
    pred_ref = pred.clone().requires_grad_(True)
    embeds_ref = embeds[kept].clone().requires_grad_(True)
    expected = infonce_loss_reference(pred_ref, embeds_ref, renumber[targets], tau=0.8)
    expected_pred, expected_embeds = torch.autograd.grad(expected, (pred_ref, embeds_ref))
    assert_close_rel(loss, expected, name="loss without masked actions")
    assert_close_rel(grad_pred, expected_pred, name="grad_pred")
    assert_close_rel(grad_embeds[kept], expected_embeds, name="grad_embeds of kept actions")


def _float64_truth(pred, embeds, targets, mask, tau, grad_out):
    """Loss and gradients in float64 (shared map ``[A, D]``, ``pred [B, T, D]``, mask ``[B, A]``)."""
    pred64 = pred.detach().double().requires_grad_(True)
    embeds64 = embeds.detach().double().requires_grad_(True)
    logits = torch.einsum("btd,ad->bta", pred64, embeds64) / tau
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE
    ).view(targets.shape)
    return (loss, *torch.autograd.grad(loss, (pred64, embeds64), grad_out.double()))


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_large_logits_stay_finite(backend, device, dtype):
    """Logits in the thousands (pred x 50, tau 0.5): the online log-sum-exp must neither overflow nor
    lose accuracy beyond what the problem's conditioning allows.

    With logits near 1000, one fp32 rounding of a logit (6e-5) already moves a probability by 6e-5
    relative, so even the fp32 reference is only accurate to about 1e-6 here. The truth is therefore
    computed in float64, and each result must be within the dtype's usual tolerance or within 4x the
    fp32 reference's own error (ours recomputes the logits in the backward: two roundings, not one).
    """
    case = Case("large", (2, 21, 40), 150, False, "BA", 0.1, 0.5, "none")
    inputs = make_inputs(case, torch.float32, device, seed=8)
    pred, embeds = (inputs.pred * 50).to(dtype), inputs.embeds.to(dtype)
    assert action_logits_reference(pred, embeds, tau=case.tau).abs().max() > 500, "logits must be large"
    grad_out = torch.rand(inputs.targets.shape, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
    truth = _float64_truth(pred, embeds, inputs.targets, inputs.mask, case.tau, grad_out)

    def loss_and_grads(fn, p, e):
        p, e = p.detach().clone().requires_grad_(True), e.detach().clone().requires_grad_(True)
        loss = fn(p, e, inputs.targets, tau=case.tau, mask=inputs.mask, reduction="none")
        return (loss, *torch.autograd.grad(loss, (p, e), grad_out))

    ours = loss_and_grads(functools.partial(infonce_loss, backend=backend), pred, embeds)
    spec = loss_and_grads(infonce_loss_reference, pred.float(), embeds.float())
    for name, out, ref, exact in zip(("loss", "grad_pred", "grad_embeds"), ours, spec, truth):
        assert torch.isfinite(out).all(), f"{name} is not finite"
        tol = max(RMS_TOLERANCE[dtype], 4 * relative_rms_error(ref, exact))
        assert_close_rel(out, exact, rms_tol=tol, name=name)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("ignore_index", [-1, 2, 5, 1000])
def test_ignore_index_values(backend, device, ignore_index):
    """``ignore_index`` may be any int: negative, a valid action id, or an id past the action set."""
    check_ignore_index_values(backend, device, ignore_index)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_all_rows_ignored(backend, device):
    """Every row padding: the sum is 0 with zero gradients; the mean is NaN (0 / 0), as in the reference, and
    its gradients are zero too (the reference's are: ignored rows take no share of the inf upstream)."""
    check_all_rows_ignored(backend, device)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_non_contiguous_inputs_and_int32_targets(backend, device):
    """Strided views (transposed pred, every other map row, a transposed full mask) and int32 targets."""
    gen = torch.Generator().manual_seed(11)
    pred = torch.randn(2, 24, 9, generator=gen).to(device).transpose(1, 2)  # [2, 9, 24]
    embeds = (torch.randn(14, 24, generator=gen) * 0.4).to(device)[::2]  # [7, 24]
    mask = random_mask((2, 9, 7), gen).permute(2, 1, 0).contiguous().permute(2, 1, 0).to(device)  # strided
    assert not (pred.is_contiguous() or embeds.is_contiguous() or mask.is_contiguous())
    available = mask.reshape(-1, 7).float().cpu()
    targets = torch.multinomial(available, 1, generator=gen).reshape(2, 9).to(device=device, dtype=torch.int32)
    check_infonce_parity(Inputs(pred, embeds, targets, mask), backend, tau=0.9, reduction="none")
    per_seq_mask = random_mask((2, 7), gen).T.contiguous().T.to(device)  # [B, A], column-major
    assert not per_seq_mask.is_contiguous()
    targets = torch.multinomial(per_seq_mask.float().cpu(), 9, replacement=True, generator=gen).to(device)
    check_infonce_parity(Inputs(pred, embeds, targets, per_seq_mask), backend, tau=0.9, reduction="sum")


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("target_dtype", [torch.int8, torch.int16, torch.int32, torch.uint8], ids=str)
def test_small_integer_targets(backend, device, target_dtype):
    """Any integer dtype of targets gives the int64 result (ids below 128 fit every dtype)."""
    inputs = make_inputs(CASES["A7-BTD-maskBA-tau1.7"]._replace(ignore=0.0), torch.float32, device, seed=25)
    for reduction in ("mean", "sum", "none"):
        expected = infonce_loss(inputs.pred, inputs.embeds, inputs.targets, mask=inputs.mask, reduction=reduction)
        small = inputs.targets.to(target_dtype)
        loss = infonce_loss(inputs.pred, inputs.embeds, small, mask=inputs.mask, reduction=reduction, backend=backend)
        assert_close_rel(loss, expected, name=f"{target_dtype} targets, {reduction}")


@pytest.mark.parametrize("backend,device", ALL_PATHS)
def test_uint8_target_156_is_not_padding(backend, device):
    gen = torch.Generator().manual_seed(26)
    pred = torch.randn(64, 16, generator=gen).to(device)
    embeds = torch.randn(200, 16, generator=gen).to(device)
    targets = torch.randint(0, 200, (64,), generator=gen)
    targets[:5] = 156
    targets = targets.to(device)
    expected = infonce_loss(pred, embeds, targets, backend=backend)
    assert_close_rel(infonce_loss(pred, embeds, targets.to(torch.uint8), backend=backend), expected)


@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_float64_accepted_off_triton(backend):
    """float64 inputs are accepted off Triton; the math is fp32 (as the reference's), gradients float64."""
    gen = torch.Generator().manual_seed(12)
    pred = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    embeds = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 4), generator=gen)
    targets[0, 1] = IGNORE
    mask = random_mask((2, 4, 5), gen)
    mask[torch.arange(2)[:, None], torch.arange(4), targets.clamp_min(0)] = True
    check_infonce_parity(Inputs(pred, embeds, targets, mask), backend, tau=0.7, reduction="none")


# --- custom ops and torch.compile ----------------------------------------------------------------------


def _op_inputs(device: str, masked: bool):
    """Inputs of the custom ops as the public functions pass them: pred [B, T, D], embeds [A, D], the canonical
    uint8 mask [B, 1, A] or None."""
    gen = torch.Generator().manual_seed(13)
    pred = torch.randn(2, 7, 16, generator=gen).to(device)
    embeds = torch.randn(9, 16, generator=gen).to(device)
    mask = random_mask((2, 1, 9), gen) if masked else None
    allowed = expand_mask(mask, (2, 7, 9)).reshape(-1, 9).float()
    targets = torch.multinomial(allowed, 1, generator=gen).reshape(2, 7)
    targets[1, 3] = IGNORE
    mask = None if mask is None else mask.view(torch.uint8).to(device)
    return pred, embeds, targets.to(device), mask


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_opcheck(backend, device):
    """The ops of the fused kernels (Triton) and of the eager path (``impl``), and their backward op."""
    impl = "fused" if backend == "triton" else "eager"
    pred, embeds, targets, mask = _op_inputs(device, masked=True)
    for reduction in ("none", "mean"):
        args = (pred.requires_grad_(True), embeds.requires_grad_(True), targets, mask, 0.7, IGNORE, reduction, 1,
                True, True, impl)  # fmt: skip
        torch.library.opcheck(infonce_op, args)
    lse = infonce_op(*args)[1]
    grad = torch.rand((), device=device)
    for needs in ([True, True], [True, False]):
        backward_args = (grad, pred.detach(), embeds.detach(), targets, mask, lse.detach(), None, None, 0.7, IGNORE,
                         "mean", 1, impl)  # fmt: skip
        torch.library.opcheck(infonce_backward_op, (*backward_args, needs))
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    torch.library.opcheck(select_actions_op, (pred.detach(), embeds.detach(), mask, 0.7, True, seed, impl))
    torch.library.opcheck(select_actions_op, (pred.detach(), embeds.detach(), None, 0.7, False, seed * 0, impl))


COMPILE_PATHS = [pytest.param("eager", "auto", "cpu", id="eager")] + [
    pytest.param("triton", algorithm, device, id=f"{algorithm}-{device}")
    for device in TRITON_DEVICES
    for algorithm in INFONCE_ALGORITHMS
]


@pytest.mark.parametrize("backend,algorithm,device", COMPILE_PATHS)
def test_torch_compile_fullgraph_matches_eager(backend, algorithm, device):
    """A training step with both ops compiles without a graph break (``fullgraph=True``; the ops are
    ``triton_op``s, or opaque custom ops under the interpreter) and gives the eager loss, gradients and actions;
    the compiled graph still rejects bad targets (their check lives inside the op). Inductor for the fused
    algorithm, ``aot_eager`` (the same graph capture, no code generation) for the others."""
    gen = torch.Generator().manual_seed(14)
    pred = torch.randn(3, 7, 16, generator=gen).to(device)
    embeds = torch.randn(5, 16, generator=gen).to(device)
    targets = torch.randint(0, 5, (3, 7), generator=gen).to(device)
    targets[0, 0] = IGNORE

    def step(p, e, t):
        loss = infonce_loss(p, e, t, tau=0.7, backend=backend, algorithm=algorithm) * 3.0
        return loss, select_actions(p.detach(), e.detach(), mode="argmax", backend=backend, algorithm=algorithm)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if algorithm in ("auto", FUSED) else "aot_eager")
    p1, e1 = pred.clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    p2, e2 = pred.clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    out, actions = compiled(p1, e1, targets)
    out.backward()
    expected, expected_actions = step(p2, e2, targets)
    expected.backward()
    assert_close_rel(out.detach(), expected.detach(), name="compiled loss")
    assert_close_rel(p1.grad, p2.grad, name="compiled grad_pred")
    assert_close_rel(e1.grad, e2.grad, name="compiled grad_embeds")
    assert torch.equal(actions, expected_actions)
    bad = targets.clone()
    bad[1, 1] = 5
    with pytest.raises(ValueError, match="targets must lie in"):
        compiled(p1, e1, bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="traced kernels run on CUDA only (not the interpreter)")
@pytest.mark.parametrize("algorithm", INFONCE_ALGORITHMS, ids=lambda name: f"triton-{name}")  # the parity stage's ids
def test_torch_compile_traces_into_the_kernels(algorithm):
    """On CUDA the ops are ``triton_op``s: AOTAutograd's forward and backward graphs hold the Triton kernels
    (``triton_kernel_wrapper_functional``) and the torch ops around them, not an opaque ``icrl`` op, and the
    compiled step gives the eager values and gradients."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from icrl_kernels._library import uses_triton_op

    if not uses_triton_op():
        pytest.skip("the ops are plain custom ops in this process (ICRL_TRITON_OP=0)")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    gen = torch.Generator(device="cuda").manual_seed(15)
    pred = torch.randn(4, 50, 64, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    embeds = torch.randn(100, 64, generator=gen, device="cuda", dtype=torch.bfloat16) / 8
    targets = torch.randint(0, 100, (4, 50), generator=gen, device="cuda")

    def step(p, e, t):
        actions = select_actions(p.detach(), e, mode="argmax", algorithm=algorithm)
        return infonce_loss(p, e, t, tau=0.7, algorithm=algorithm), actions

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    loss, _ = compiled(pred, embeds, targets)
    (grad,) = torch.autograd.grad(loss, pred)
    expected_grad = torch.autograd.grad(step(pred, embeds, targets)[0], pred)[0]
    assert_close_rel(grad, expected_grad, rms_tol=RMS_TOLERANCE[torch.bfloat16], name="compiled grad_pred")
    for graph in graphs:
        targets_called = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
        assert any("triton_kernel_wrapper" in name for name in targets_called), targets_called
        assert not any(name.startswith("icrl.") for name in targets_called), targets_called


def test_torch_compile_fullgraph_with_mask():
    gen = torch.Generator().manual_seed(15)
    pred = torch.randn(3, 7, 16, generator=gen, requires_grad=True)
    embeds = torch.randn(5, 16, generator=gen)
    mask = torch.tensor([True, False, True, True, True])
    targets = torch.tensor([0, 2, 3, 4, 2, 0, 3]).repeat(3, 1)

    def step(p, e, t, m):
        return infonce_loss(p, e, t, mask=m, backend="eager")

    out = torch.compile(step, fullgraph=True)(pred, embeds, targets, mask)
    assert_close_rel(out, infonce_loss_reference(pred, embeds, targets, mask=mask))


# --- select_actions ----------------------------------------------------------------------------------

SELECT_CASES = [
    Case("shared-N-A5", (29, 24), 5, False, None, 0.0, 1.0, ""),
    Case("perseq-BD-A7-mask", (6, 24), 7, True, "BA", 0.0, 0.5, ""),
    Case("perseq-BTD-A150-maskBA", (2, 17, 40), 150, True, "BA", 0.0, 1.0, ""),
    Case("shared-BTD-A300-fullmask", (2, 13, 40), 300, False, "full", 0.0, 2.0, ""),
    Case("shared-N-A300-maskA", (37, 72), 300, False, "A", 0.0, 1.0, ""),
]


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: c.name)
def test_argmax_matches_reference(case: Case, backend, device):
    inputs = make_inputs(case, torch.float32, device, seed=zlib.crc32(case.name.encode()))
    actions = select_actions(inputs.pred, inputs.embeds, mode="argmax", tau=case.tau, mask=inputs.mask, backend=backend)
    assert_argmax_equal(actions, inputs.pred, inputs.embeds, case.tau, inputs.mask, gap=1e-5)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_argmax_half_precision(backend, device, dtype):
    """Half inputs: the argmax of the fp32 logits of the (upcast) half inputs, up to near-ties."""
    inputs = make_inputs(SELECT_CASES[2], dtype, device, seed=3)
    actions = select_actions(inputs.pred, inputs.embeds, mode="argmax", mask=inputs.mask, backend=backend)
    assert_argmax_equal(actions, inputs.pred, inputs.embeds, 1.0, inputs.mask, gap=1e-2)


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_ties_pick_the_lowest_id(backend, device, dtype):
    """Small-integer inputs make the logits exact in every dtype, so ties are real and common, within
    and across the 128-action tiles; the lowest available id must win, as with ``torch.argmax``."""
    gen = torch.Generator().manual_seed(16)
    embeds = torch.randint(-1, 2, (300, 8), generator=gen).float()
    embeds[7] = embeds[7].abs() + 1  # a direction that clearly wins for the rows aligned with it
    embeds[[140, 260]] = embeds[7].clone()  # exact duplicates of action 7 in the second and third tile
    pred = torch.randint(-2, 3, (2, 20, 8), generator=gen).float()
    pred[:, :3] = embeds[7] * 2  # rows aligned with action 7: its duplicates 140 and 260 tie with it
    mask = torch.ones(2, 20, 300, dtype=torch.bool)
    mask[1, :3, 7] = False  # the lowest tied id is unavailable: 140 must win
    pred, embeds, mask = pred.to(device=device, dtype=dtype), embeds.to(device=device, dtype=dtype), mask.to(device)
    logits = action_logits_reference(pred, embeds, tau=0.3)
    assert (logits == logits.amax(-1, keepdim=True)).sum(-1).gt(1).float().mean() > 0.3, "ties must be common"
    for m, aligned in ((None, [7, 7, 7]), (mask, [140, 140, 140])):
        actions = select_actions(pred, embeds, mode="argmax", tau=0.3, mask=m, backend=backend)
        assert torch.equal(actions, select_actions_reference(pred, embeds, tau=0.3, mask=m))
        assert actions[0, :3].tolist() == [7, 7, 7] and actions[1, :3].tolist() == aligned


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_select_accepts_inputs_that_require_grad(backend, device, mode):
    """Rollouts call select on a model's output (which requires grad) without no_grad: ids come back."""
    gen = torch.Generator().manual_seed(27)
    pred = torch.randn(3, 5, 16, generator=gen).to(device).requires_grad_(True)
    embeds = torch.randn(7, 16, generator=gen).to(device).requires_grad_(True)
    actions = select_actions(pred * 2, embeds, mode=mode, backend=backend, generator=torch.Generator().manual_seed(1))
    assert actions.dtype == torch.int64 and actions.shape == (3, 5) and not actions.requires_grad
    if mode == "argmax":
        assert torch.equal(actions, select_actions_reference(pred.detach() * 2, embeds.detach()))


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_masked_actions_are_never_chosen(backend, device, mode):
    """Each row's best-scoring action by far is masked: it must never be picked, in either mode."""
    gen = torch.Generator().manual_seed(17)
    # D = 64: e_best . e_best ~ 64 +- 11 while e_best . e_other ~ N(0, 64): the best action wins by far.
    embeds = torch.randn(150, 64, generator=gen)
    best = torch.randint(0, 150, (100,), generator=gen)
    pred = embeds[best] * 3 + 0.1 * torch.randn(100, 64, generator=gen)
    mask = torch.ones(100, 150, dtype=torch.bool)
    mask[torch.arange(100), best] = False
    mask[:, [3, 130]] = False  # also columns masked for every row, in both tiles
    pred, embeds, mask = pred.to(device), embeds.to(device), mask.to(device)
    actions = select_actions(
        pred, embeds, mode=mode, tau=2.0, mask=mask, backend=backend, generator=torch.Generator().manual_seed(0)
    )
    assert mask.gather(-1, actions[:, None]).all()
    unmasked = select_actions(pred, embeds, mode="argmax", backend=backend)
    assert torch.equal(unmasked, best.to(device)), "without the mask, the masked action is the argmax"


def _sampling_problem(name: str, device: str):
    """``(pred, embeds, mask, tau)``: one prediction repeated over many rows.

    * ``"A150"``: 150 random actions (two tiles), tau = 0.6, 2000 rows. The three most likely actions of
      the unmasked softmax (97, 94 and 138, in the second tile) are masked, with about 10 % of the others
      at random; about 30 actions keep most of the mass, in both tiles.
    * ``"A5"``: 5 orthonormal actions whose logits / tau are exactly ``[0, 1, 2, 4, -1]``, action 3
      masked, tau = 0.7, 3000 rows. With few competitors the *shape* of the noise matters: argmax with
      exponential instead of Gumbel noise gives [0.07, 0.20, 0.71, 0, 0.02] instead of the softmax
      [0.09, 0.24, 0.64, 0, 0.03] (with 150 competitors only the noise's exponential tail matters, and
      both are nearly the softmax).
    """
    gen = torch.Generator().manual_seed(2024)
    if name == "A150":
        num_actions, dim, tau, rows = 150, 16, 0.6, 2000
        embeds = torch.randn(num_actions, dim, generator=gen)
        direction = torch.randn(dim, generator=gen)
        pred = direction / direction.norm() * 1.2
        mask = torch.rand(num_actions, generator=gen) > 0.1
        mask[[97, 94, 138]] = False
    else:
        tau, rows = 0.7, 3000
        embeds = orthonormal_embeddings(5, 8, generator=gen)
        pred = tau * torch.tensor([0.0, 1.0, 2.0, 4.0, -1.0]) @ embeds
        mask = torch.tensor([True, True, True, False, True])
    pred = pred.expand(rows, embeds.shape[1]).contiguous()
    return pred.to(device), embeds.to(device), mask.to(device), tau


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic with categories of expected count < 5 pooled into one; returns (stat, df)."""
    total = counts.sum()
    expected = probs.double() * total
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    # A category the distribution gives no mass but that was observed makes the statistic infinite.
    impossible = counts[probs == 0].sum().item()
    stat = float(((observed - expected) ** 2 / expected).sum()) + (math.inf if impossible else 0.0)
    return stat, len(expected) - 1


def _chi_square_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal quantile ``z``."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("problem", ["A150", "A5"])
def test_sampling_matches_softmax(problem, backend, device):
    """Draws from one row's softmax(logits / tau) pass a chi-square test at p = 1e-6.

    z = 4.75 is the standard-normal 1 - 1e-6 quantile, so a correct sampler fails with probability about
    1e-6 per seed (the seed is fixed, so the test is deterministic). The same counts are also tested
    against the distributions plausible bugs would sample from (tau ignored, mask ignored, exponential
    instead of Gumbel noise): the test asserts that those fail the same bound, i.e. that it has the
    power to catch them. At the time of writing, A150: statistic about 40-60 at df 57 (bound 123), tau
    ignored about 500, mask ignored about 900; A5: df 3 (bound 33), exponential noise about 140.
    Identical noise for every row would put all draws on one action: a statistic in the thousands.
    """
    pred, embeds, mask, tau = _sampling_problem(problem, device)
    actions = select_actions(
        pred, embeds, mode="sample", tau=tau, mask=mask, generator=torch.Generator().manual_seed(99),
        backend=backend,
    )  # fmt: skip
    counts = torch.bincount(actions.cpu(), minlength=embeds.shape[0])
    assert counts[~mask.cpu()].sum() == 0, "sampled an unavailable action"
    row, embeds, mask = pred[:1].cpu(), embeds.cpu(), mask.cpu()

    def softmax(t, m):
        return torch.softmax(action_logits_reference(row, embeds, tau=t, mask=m)[0], -1)

    stat, df = _chi_square(counts, softmax(tau, mask))
    bound = _chi_square_quantile(df, 4.75)
    assert stat < bound, f"chi-square {stat:.1f} > {bound:.1f} (df {df}): samples do not follow softmax(logits/tau)"
    wrong = {"tau ignored": softmax(1.0, mask), "mask ignored": softmax(tau, None)}
    if problem == "A5":
        uniform = torch.rand(200_000, embeds.shape[0], generator=torch.Generator().manual_seed(0))
        exp_argmax = (action_logits_reference(row, embeds, tau=tau, mask=mask) - uniform.log()).argmax(-1)
        wrong["exponential noise"] = torch.bincount(exp_argmax, minlength=embeds.shape[0]).double() / len(uniform)
    for name, probs in wrong.items():
        wrong_stat, wrong_df = _chi_square(counts, probs)
        assert wrong_stat > _chi_square_quantile(wrong_df, 4.75), f"the test cannot tell '{name}' apart"


@pytest.mark.parametrize("backend,device", ALL_PATHS)
def test_sampling_is_reproducible(backend, device):
    case = Case("repro", (2, 32, 24), 150, True, "BA", 0.0, 1.5, "")
    inputs = make_inputs(case, torch.float32, device, seed=18)
    inputs = inputs._replace(pred=inputs.pred * 0.3)  # soft distributions: samples vary

    def draw(seed):
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        return select_actions(
            inputs.pred, inputs.embeds, tau=case.tau, mask=inputs.mask, generator=generator, backend=backend
        )

    first, again, other = draw(5), draw(5), draw(6)
    assert torch.equal(first, again), "the same seed must give the same actions"
    assert not torch.equal(first, other), "a different seed must give different actions"
    assert first.unique().numel() > 10, "rows are sampled independently"
    with torch.random.fork_rng():
        torch.manual_seed(7)
        global_first = draw(None)
        torch.manual_seed(7)
        assert torch.equal(global_first, draw(None)), "torch.manual_seed makes generator=None reproducible"


# --- orthonormal_embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_actions,dim", [(1, 1), (1, 9), (5, 24), (7, 7), (24, 40), (60, 64)])
@pytest.mark.parametrize("batch", [None, 3])
def test_embeddings_rows_orthonormal(num_actions, dim, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no OvercompleteEmbeddingWarning while A <= D
        e = orthonormal_embeddings(num_actions, dim, batch=batch, generator=torch.Generator().manual_seed(0))
    assert e.shape == ((num_actions, dim) if batch is None else (batch, num_actions, dim))
    assert e.dtype == torch.float32 and e.is_contiguous()
    gram = e @ e.transpose(-2, -1)
    assert (gram - torch.eye(num_actions)).abs().max() < 1e-5


@pytest.mark.parametrize("batch", [None, 2])
def test_embeddings_overcomplete_warns_and_columns_orthonormal(batch):
    with pytest.warns(OvercompleteEmbeddingWarning, match=r"num_actions \(10\) > dim \(4\)"):
        e = orthonormal_embeddings(10, 4, batch=batch, generator=torch.Generator().manual_seed(1))
    assert e.shape[-2:] == (10, 4)
    assert (e.transpose(-2, -1) @ e - torch.eye(4)).abs().max() < 1e-5
    assert e.norm(dim=-1).max() <= 1 + 1e-5
    with pytest.raises(ValueError, match="num_actions"):
        orthonormal_embeddings(10, 4, strict=True)
    orthonormal_embeddings(4, 4, strict=True)  # A == D is fine


def test_embeddings_generator_and_batch_independence():
    def draw(seed, **kwargs):
        return orthonormal_embeddings(6, 16, generator=torch.Generator().manual_seed(seed), **kwargs)

    assert torch.equal(draw(3), draw(3))
    assert not torch.allclose(draw(3), draw(4))
    assert torch.equal(draw(3, batch=4), draw(3, batch=4))
    maps = draw(3, batch=4)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.allclose(maps[i], maps[j], atol=1e-3), "each sequence gets its own map"


def test_embeddings_haar_statistics():
    """Rows of a Haar map are uniform on the sphere: E[0, 0]^2 has mean 1 / D (Beta(1/2, (D-1)/2)),
    and every entry is as often positive as negative. Plain QR without the sign fold fails the sign
    test: LAPACK's R has a negative diagonal, so the first entry would always have the same sign."""
    maps, dim = 4000, 8
    e = orthonormal_embeddings(3, dim, batch=maps, generator=torch.Generator().manual_seed(2))
    first = e[:, 0, 0].double()
    variance = 2 * (dim - 1) / (dim**2 * (dim + 2))  # of E[0, 0]^2 for a uniform unit vector
    assert abs(first.square().mean().item() - 1 / dim) < 5 * math.sqrt(variance / maps)
    for a, d in ((0, 0), (1, 1), (2, 5)):
        positive = (e[:, a, d] > 0).double().mean().item()
        assert abs(positive - 0.5) < 5 * math.sqrt(0.25 / maps), (a, d, positive)
    # Independence across the batch: two maps' first rows are as uncorrelated as two random unit vectors.
    overlap = (e[:-1, 0] * e[1:, 0]).sum(-1).double().square().mean().item()
    assert abs(overlap - 1 / dim) < 5 * math.sqrt(variance / maps)
    with pytest.warns(OvercompleteEmbeddingWarning):
        wide = orthonormal_embeddings(8, 3, batch=maps, generator=torch.Generator().manual_seed(3))
    # Overcomplete: columns are Haar unit vectors in R^8, so E[0, 0]^2 has mean 1 / 8.
    assert abs(wide[:, 0, 0].double().square().mean().item() - 1 / 8) < 5 * math.sqrt(variance / maps)
    assert abs((wide[:, 0, 0] > 0).double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / maps)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_embeddings_dtype_and_device(dtype, tol):
    e = orthonormal_embeddings(5, 12, dtype=dtype, device="cpu", generator=torch.Generator().manual_seed(4))
    assert e.dtype == dtype and e.device.type == "cpu"
    assert (e.double() @ e.double().T - torch.eye(5, dtype=torch.float64)).abs().max() < tol


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_actions": 0, "dim": 4}, ValueError, "num_actions must be >= 1"),
        ({"num_actions": 2.5, "dim": 4}, TypeError, "num_actions must be an int"),
        ({"num_actions": 3, "dim": 0}, ValueError, "dim must be >= 1"),
        ({"num_actions": 3, "dim": 4, "batch": 0}, ValueError, "batch must be >= 1"),
        ({"num_actions": 3, "dim": 4, "dtype": torch.int64}, TypeError, "dtype must be a floating-point"),
    ],
)
def test_embeddings_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        orthonormal_embeddings(**kwargs)


# --- ActionMap ---------------------------------------------------------------------------------------


def test_embeddings_from_a_cpu_generator_are_the_same_on_every_device():
    """The draw happens on the generator's device, so a CPU generator gives one map wherever it lands
    (``meta`` stands in for CUDA on a CPU-only machine: only the placement is checked there)."""
    on_cpu = orthonormal_embeddings(5, 8, generator=torch.Generator().manual_seed(3), device="cpu")
    on_meta = orthonormal_embeddings(5, 8, generator=torch.Generator().manual_seed(3), device="meta")
    assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape
    if torch.cuda.is_available():
        on_cuda = orthonormal_embeddings(5, 8, generator=torch.Generator().manual_seed(3), device="cuda")
        torch.testing.assert_close(on_cuda.cpu(), on_cpu)


def test_action_map_needs_regenerate_first():
    action_map = ActionMap(5, 8)
    for call in (lambda: action_map.embed(torch.tensor([0])), lambda: action_map.prompt(2)):
        with pytest.raises(RuntimeError, match="regenerate"):
            call()
    with pytest.raises(RuntimeError, match="regenerate"):
        action_map.loss(torch.randn(3, 8), torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="regenerate"):
        action_map.select(torch.randn(3, 8))


def test_action_map_regenerate_embed_prompt():
    action_map = ActionMap(5, 8, tau=0.5)
    e = action_map.regenerate(generator=torch.Generator().manual_seed(0))
    assert e.shape == (5, 8) and torch.equal(e, action_map.embeddings)
    assert (e @ e.T - torch.eye(5)).abs().max() < 1e-5
    assert "embeddings" not in action_map.state_dict(), "the map is redrawn, never saved"
    assert torch.equal(action_map.regenerate(generator=torch.Generator().manual_seed(0)), e)
    actions = torch.tensor([[-1, 0, 4], [2, -1, 2]])
    out = action_map.embed(actions)
    assert out.shape == (2, 3, 8)
    assert not out[0, 0].any() and not out[1, 1].any(), "-1 (no previous action) embeds to zeros"
    assert torch.equal(out[0, 2], e[4]) and torch.equal(out[1, 2], e[2])
    prompt = action_map.prompt(3)
    assert prompt.shape == (3, 5, 8) and torch.equal(prompt[2], e)

    maps = action_map.regenerate(batch=2, generator=torch.Generator().manual_seed(1))
    assert maps.shape == (2, 5, 8) and action_map.per_sequence
    out = action_map.embed(actions)
    assert torch.equal(out[0, 2], maps[0, 4]) and torch.equal(out[1, 0], maps[1, 2])
    assert not out[0, 0].any()
    assert torch.equal(action_map.prompt(2), maps)
    with pytest.raises(ValueError, match="batch_size"):
        action_map.prompt(3)
    with pytest.raises(ValueError, match="actions must be"):
        action_map.embed(actions[:1])
    with pytest.raises(ValueError, match="actions must lie in"):
        action_map.embed(torch.tensor([[5, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="actions must lie in"):
        action_map.embed(torch.tensor([[-2, 0, 0], [0, 0, 0]]))
    with pytest.raises(TypeError, match="actions"):
        action_map.embed(torch.zeros(2, 3))


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "perseq"])
def test_action_map_loss_and_select_delegate(backend, device, per_sequence):
    action_map = ActionMap(7, 16, tau=0.7, backend=backend)
    action_map.regenerate(batch=2 if per_sequence else None, generator=torch.Generator().manual_seed(2), device=device)
    gen = torch.Generator().manual_seed(3)
    pred = torch.randn(2, 9, 16, generator=gen).to(device).requires_grad_(True)
    mask = random_mask((2, 7), gen).to(device)
    targets = torch.multinomial(mask.float().cpu(), 9, replacement=True, generator=gen).to(device)
    loss = action_map.loss(pred, targets, mask=mask)
    pred_ref = pred.detach().clone().requires_grad_(True)
    expected = infonce_loss_reference(pred_ref, action_map.embeddings, targets, tau=0.7, mask=mask)
    assert_close_rel(loss, expected, name="ActionMap.loss")
    loss.backward()
    expected.backward()
    assert_close_rel(pred.grad, pred_ref.grad, name="ActionMap.loss grad")
    none = action_map.loss(pred, targets, mask=mask, reduction="none")
    assert none.shape == (2, 9)

    actions = action_map.select(pred.detach(), mode="argmax", mask=mask)
    assert torch.equal(actions, select_actions_reference(pred.detach(), action_map.embeddings, mask=mask))
    sampled = action_map.select(pred.detach(), mask=mask, generator=torch.Generator().manual_seed(4))
    again = action_map.select(pred.detach(), mask=mask, generator=torch.Generator().manual_seed(4))
    assert torch.equal(sampled, again) and mask.gather(-1, sampled).all()

    half = action_map.loss(pred.detach().half(), targets, mask=mask)  # the map is cast to pred's dtype
    assert_close_rel(half, expected.detach(), rms_tol=RMS_TOLERANCE[torch.float16])


def test_action_map_bad_config():
    with pytest.raises(ValueError, match="tau must be > 0"):
        ActionMap(5, 8, tau=0.0)
    with pytest.raises(ValueError, match="num_actions must be >= 1"):
        ActionMap(0, 8)
    with pytest.raises(ValueError, match="embed_dim must be >= 1"):
        ActionMap(5, 0)


# --- errors ------------------------------------------------------------------------------------------


def _base_args():
    gen = torch.Generator().manual_seed(19)
    pred = torch.randn(2, 5, 8, generator=gen)
    embeds = torch.randn(4, 8, generator=gen)
    targets = torch.randint(0, 4, (2, 5), generator=gen)
    return {"pred": pred, "action_embeds": embeds, "targets": targets}


def _bad(name: str, error: type, match: str, **changes):
    """A bad-input case: the base arguments with ``changes`` (callables are applied to the base arguments;
    ``embeds`` stands for ``action_embeds``)."""

    def transform(args: dict) -> dict:
        changed = {
            ("action_embeds" if k == "embeds" else k): (v(args) if callable(v) else v) for k, v in changes.items()
        }
        return {**args, **changed}

    return pytest.param(transform, error, match, id=name)


def _on_embeds(change):
    return lambda args: change(args["action_embeds"])


COMMON_ERRORS = [
    _bad("tau0", ValueError, "tau must be > 0", tau=0.0),
    _bad("tau-negative", ValueError, "tau must be > 0", tau=-1.0),
    _bad("tau-nan", ValueError, "tau must be > 0 and finite", tau=float("nan")),
    _bad("tau-inf", ValueError, "tau must be > 0 and finite", tau=float("inf")),
    _bad("tau-str", TypeError, "tau must be a real number", tau="1"),
    _bad("tau-bool", TypeError, "tau must be a real number", tau=True),
    _bad("pred-rank1", ValueError, "pred must be 2-D or 3-D", pred=lambda a: a["pred"][0, 0]),
    _bad("pred-rank4", ValueError, "pred must be 2-D or 3-D", pred=lambda a: a["pred"][None]),
    _bad("pred-int", TypeError, "pred must have dtype", pred=lambda a: a["pred"].long()),
    _bad("pred-list", TypeError, "pred must be a torch.Tensor", pred=[[1.0] * 8]),
    _bad("pred-empty", ValueError, "pred must not be empty", pred=lambda a: a["pred"][:, :, :0]),
    _bad("embeds-dtype", TypeError, "action_embeds must have pred's dtype", embeds=_on_embeds(lambda e: e.double())),
    _bad("embeds-int", TypeError, "action_embeds must have dtype", embeds=_on_embeds(lambda e: e.long())),
    _bad("embeds-rank1", ValueError, "action_embeds must be 2-D or 3-D", embeds=_on_embeds(lambda e: e[0])),
    _bad("width", ValueError, "action_embeds width 7 does not match pred width", embeds=_on_embeds(lambda e: e[:, :7])),
    _bad("perseq-batch", ValueError, "per-sequence action_embeds", embeds=_on_embeds(lambda e: e.expand(3, 4, 8))),
    _bad("embeds-device", ValueError, "action_embeds is on meta", embeds=_on_embeds(lambda e: e.to("meta"))),
    _bad("mask-dtype", TypeError, "mask must have dtype", mask=torch.ones(4, dtype=torch.int64)),
    _bad("mask-shape", ValueError, "mask must have shape", mask=torch.ones(5, dtype=torch.bool)),
    _bad("mask-shape-BTA", ValueError, "mask must have shape", mask=torch.ones(2, 4, 4, dtype=torch.bool)),
    _bad("mask-all-false-row", ValueError, "mask leaves a row", mask=torch.tensor([[True] * 4, [False] * 4])),
    _bad("backend", ValueError, "backend must be one of", backend="cuda"),
    _bad("algorithm", ValueError, "algorithm must be one of", algorithm="tiled"),
    _bad("algorithm-off-triton", ValueError, "algorithm='fused' runs on the Triton backend", algorithm="fused",
         backend="eager"),
]  # fmt: skip

LOSS_ERRORS = [
    _bad("reduction", ValueError, "reduction must be one of", reduction="avg"),
    _bad("targets-shape", ValueError, "targets must have shape", targets=lambda a: a["targets"][:, :-1]),
    _bad("targets-float", TypeError, "targets must have dtype", targets=lambda a: a["targets"].float()),
    _bad("targets-list", TypeError, "targets must be a torch.Tensor", targets=[0, 1]),
    _bad("ignore_index-float", TypeError, "ignore_index must be an int", ignore_index=1.5),
]

SELECT_ERRORS = [
    _bad("mode", ValueError, "mode must be one of", mode="greedy"),
    _bad("generator", TypeError, "generator must be a torch.Generator", generator=123),
]


@pytest.mark.parametrize("transform,error,match", COMMON_ERRORS + LOSS_ERRORS)
def test_infonce_bad_input_names_the_argument(transform, error, match):
    args = transform(_base_args())
    with pytest.raises(error, match=match):
        infonce_loss(args.pop("pred"), args.pop("action_embeds"), args.pop("targets"), **args)


@pytest.mark.parametrize("transform,error,match", COMMON_ERRORS + SELECT_ERRORS)
def test_select_bad_input_names_the_argument(transform, error, match):
    args = transform(_base_args())
    args.pop("targets")
    with pytest.raises(error, match=match):
        select_actions(args.pop("pred"), args.pop("action_embeds"), **args)


def test_checks_run_once_per_signature(monkeypatch):
    """A repeated argument signature skips the argument checks (one lookup); a change of any shape, dtype or
    device, or of an option's value or type, is a new signature, checked in full. Bad input raises at every
    call, also right after the same call with good input (``tau=True`` after ``tau=1.0``: equal, not the same)."""
    from icrl_kernels.contrastive import checks, function

    calls = []
    real = checks.check_pred_and_map
    monkeypatch.setattr(checks, "check_pred_and_map", lambda *args: calls.append(args) or real(*args))
    function._infonce_plan.cache.clear()  # no signature of an earlier test
    function._select_plan.cache.clear()
    args = _base_args()
    for _ in range(3):
        infonce_loss(**args, backend="eager")
        select_actions(args["pred"], args["action_embeds"], mode="argmax", backend="eager")
    assert len(calls) == 2, "one check per op and signature"
    infonce_loss(args["pred"][:1], args["action_embeds"], args["targets"][:1], backend="eager")
    infonce_loss(**args, tau=1, backend="eager")  # an int: another type than the float 1.0
    assert len(calls) == 4
    for _ in range(2):
        with pytest.raises(TypeError, match="tau must be a real number"):
            infonce_loss(**args, tau=True, backend="eager")
        with pytest.raises(ValueError, match="reduction must be one of"):
            infonce_loss(**args, reduction="avg", backend="eager")
        with pytest.raises(TypeError, match="pred must be a torch.Tensor"):
            infonce_loss(args["pred"].tolist(), args["action_embeds"], args["targets"], backend="eager")


@pytest.mark.parametrize("backend,device", ALL_PATHS)
def test_bad_target_values(backend, device):
    """Target values are checked on every backend (inside the op for eager/triton)."""
    args = {k: v.to(device) for k, v in _base_args().items()}
    for value, match in ((4, r"targets must lie in \[0, 4\)"), (-1, "targets must lie in")):
        targets = args["targets"].clone()
        targets[1, 2] = value
        with pytest.raises(ValueError, match=match):
            infonce_loss(args["pred"], args["action_embeds"], targets, backend=backend)
    mask = torch.tensor([True, False, True, True], device=device)
    targets = torch.where(args["targets"] == 1, 2, args["targets"])
    infonce_loss(args["pred"], args["action_embeds"], targets, mask=mask, backend=backend)  # all available: fine
    targets[0, 3] = 1
    with pytest.raises(ValueError, match="targets include actions that mask marks unavailable"):
        infonce_loss(args["pred"], args["action_embeds"], targets, mask=mask, backend=backend)
    # A masked target value is fine when it is the ignore_index of a padded row.
    loss = infonce_loss(args["pred"], args["action_embeds"], targets, mask=mask, ignore_index=1, backend=backend)
    assert torch.isfinite(loss)


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("num_actions", [37, 150])  # one action tile; ten streamed tiles of 16 (fp32)
@pytest.mark.parametrize("masked", [True, False])
def test_forward_status_flags_each_row_as_the_checks_do(num_actions, masked):
    """The fused forward reports the value checks per row from its own loads (no torch ops of their own):
    its status, row by row, against the conditions the eager path checks with torch ops."""
    from icrl_kernels.contrastive import checks
    from icrl_kernels.contrastive.fused_kernels import infonce_forward

    device = TRITON_DEVICES[0]
    gen = torch.Generator().manual_seed(num_actions)
    batch, steps, dim, ignore = 3, 13, 16, 5  # an ignore_index that is also an action id
    pred = torch.randn(batch, steps, dim, generator=gen)
    embeds = torch.randn(num_actions, dim, generator=gen)
    targets = torch.randint(-2, num_actions + 2, (batch, steps), generator=gen)
    targets[torch.rand(batch, steps, generator=gen) < 0.2] = ignore
    mask = torch.rand(batch, steps, num_actions, generator=gen) < 0.3
    mask[0, 2] = False  # a row with no available action, whatever its target
    mask[1, 4] = False
    targets[1, 4] = ignore  # ... also when the row is padding
    mask[2, 6, -1] = True
    targets[2, 6] = num_actions - 1  # the last action, in the last (partial) tile
    if not masked:
        mask[:] = True
    used = targets != ignore
    out_of_range = used & ((targets < 0) | (targets >= num_actions))
    available = mask.gather(-1, targets.clamp(0, num_actions - 1)[..., None])[..., 0]
    expected = torch.zeros(batch, steps, dtype=torch.int8)
    expected[used & ~out_of_range & ~available] = checks.ROW_TARGET_UNAVAILABLE
    expected[out_of_range] = checks.ROW_TARGET_OUT_OF_RANGE
    expected[~mask.any(-1)] = checks.ROW_NO_ACTION
    assert {int(v) for v in expected.unique()} == ({0, 1, 2, 3} if masked else {0, 2}), "every status must occur"

    mask3 = padded_mask(mask.to(torch.uint8)).to(device) if masked else None
    losses, lse, status, _, _ = infonce_forward(pred.to(device), embeds.to(device), targets.to(device), mask3, 0.5,
                                                ignore, "none", 1, False, False)  # fmt: skip
    assert torch.equal(status.cpu(), expected)
    fine = expected == 0
    assert torch.isfinite(losses.cpu()[fine]).all() and torch.isfinite(lse.cpu()[fine]).all()


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_gpu_value_check_path_names_every_rule():
    """On CUDA the fused forward's status is checked by one device assert, whose message names each rule
    (here run on the CPU with mode "async", which raises at once)."""
    from icrl_kernels import set_value_checks

    device = TRITON_DEVICES[0]
    args = {k: v.to(device) for k, v in _base_args().items()}
    mask = torch.tensor([True, False, True, True], device=device)
    bad = args["targets"].clone()
    bad[0, 0] = 1  # unavailable under the mask
    previous = set_value_checks("async")
    try:
        infonce_loss(args["pred"], args["action_embeds"], args["targets"].clamp(2, 3), mask=mask, backend="triton")
        with pytest.raises(RuntimeError, match=r"targets must lie in \[0, 4\).*unavailable.*no available action"):
            infonce_loss(args["pred"], args["action_embeds"], bad, mask=mask, backend="triton")
        with pytest.raises(RuntimeError, match=r"targets must lie in \[0, 4\) or equal ignore_index=-100$"):
            infonce_loss(args["pred"], args["action_embeds"], bad + 10, backend="triton")
    finally:
        set_value_checks(previous)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("num_actions", [37, 150])  # one action tile; streamed tiles
@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_select_status_flags_each_row_as_the_checks_do(backend, device, num_actions, mode):
    """The selection reports its value checks per row (no torch ops of their own): no available action
    (also where that row's logits are NaN), else a NaN logit of an available action; NaN only at masked
    actions is fine. Row by row against those conditions computed with torch ops."""
    from icrl_kernels.contrastive import checks
    from icrl_kernels.contrastive.eager import select_actions_eager

    gen = torch.Generator().manual_seed(num_actions)
    batch, steps, dim = 3, 11, 16
    pred = torch.randn(batch, steps, dim, generator=gen)
    embeds = torch.randn(1, num_actions, dim, generator=gen)
    mask = torch.rand(batch, steps, num_actions, generator=gen) < 0.3
    mask[:, :, 3] = True
    pred[0, 1] = float("nan")  # every logit of this row is NaN
    mask[0, 2] = False  # no available action
    pred[1, 5] = float("nan")
    mask[1, 5] = False  # no action and NaN logits: reported as no action
    embeds[0, -1] = float("nan")  # the last action's logits are NaN for every row ...
    mask[..., -1] = False
    mask[2, 7, -1] = True  # ... and available in one row only (the last, partial tile)
    expected = torch.zeros(batch, steps, dtype=torch.int8)
    logits_nan = (pred @ embeds[0].T).isnan()
    expected[(logits_nan & mask).any(-1)] = checks.ROW_NAN_LOGIT
    expected[~mask.any(-1)] = checks.ROW_NO_ACTION
    assert expected[0, 1] == expected[2, 7] == checks.ROW_NAN_LOGIT and expected[1, 5] == checks.ROW_NO_ACTION
    assert (expected == 0).sum() == batch * steps - 4

    seed = torch.tensor([7], device=device)
    if backend == "triton":
        from icrl_kernels.contrastive.fused_kernels import select

        mask3 = padded_mask(mask.to(torch.uint8)).to(device)
        actions, status = select(pred.to(device), embeds[0].to(device), mask3, 0.5, mode == "sample", seed, 33)
    else:
        actions, status = select_actions_eager(pred, embeds, mask.to(torch.uint8), 0.5, mode == "sample", seed)
    assert torch.equal(status.cpu(), expected)
    has_action = expected != checks.ROW_NO_ACTION
    assert mask[has_action].gather(-1, actions.cpu()[has_action][:, None]).all(), "picked a masked action"


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_gpu_select_check_path_names_every_rule():
    """On CUDA the selection's status is checked by one device assert whose message names each rule
    (here on the CPU with mode "async", which raises at once); rows that pass raise nothing."""
    from icrl_kernels import set_value_checks

    device = TRITON_DEVICES[0]
    pred = torch.randn(2, 5, 16, device=device)
    embeds = torch.randn(4, 16, device=device)
    mask = torch.ones(2, 5, 4, dtype=torch.bool, device=device)
    previous = set_value_checks("async")
    try:
        select_actions(pred, embeds, mask=mask, backend="triton")
        empty_row = mask.clone()
        empty_row[1, 2] = False
        with pytest.raises(RuntimeError, match="contains NaN .*; or mask leaves a row with no available action"):
            select_actions(pred, embeds, mask=empty_row, backend="triton")
        nan_pred = pred.clone()
        nan_pred[0, 0, 0] = float("nan")
        with pytest.raises(RuntimeError, match=r"a logit of an available action is NaN\)$"):
            select_actions(nan_pred, embeds, mode="argmax", backend="triton")
    finally:
        set_value_checks(previous)


@pytest.mark.skipif(not triton_devices(), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_triton_rejects_float64():
    device = TRITON_DEVICES[0]
    args = {k: (v.double() if v.is_floating_point() else v).to(device) for k, v in _base_args().items()}
    with pytest.raises(TypeError, match="pred must be float16, bfloat16 or float32"):
        infonce_loss(args["pred"], args["action_embeds"], args["targets"], backend="triton")
    with pytest.raises(TypeError, match="pred must be float16, bfloat16 or float32"):
        select_actions(args["pred"], args["action_embeds"], backend="triton")


# --- precision, launch layout, robustness of selection -----------------------------------------------


def _fp16_precision_problem(device: str):
    """N = 65536 rows (the mean's 1 / N = 1.5e-5 puts grad_pred in fp16's subnormal range), D = 16, A = 5."""
    gen = torch.Generator().manual_seed(65536)
    rows, dim, num_actions = 65536, 16, 5
    pred = torch.randn(rows, dim, generator=gen).half()
    embeds = (torch.randn(num_actions, dim, generator=gen) * 0.5).half()
    targets = torch.randint(0, num_actions, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < 0.1] = IGNORE
    weights = (torch.rand(rows, generator=gen) + 0.5) / rows  # reduction="none": per-row weights ~1 / N
    return pred.to(device), embeds.to(device), targets.to(device), weights.to(device)


def _large_tiles():
    """Force the fused algorithm and the 64/128-row configs of its kernels (fewer, larger programs: the
    interpreter's cost is per program), all with BLOCK_D = 64 so that the backward recomputes the forward's
    logits (test_contrastive_algorithms.py checks the other algorithms)."""
    from icrl_kernels._triton import autotune_configs
    from icrl_kernels.contrastive import fused_kernels as kernels
    from icrl_kernels.testing import forced_config

    stack = contextlib.ExitStack()
    for kernel, rows in ((kernels._infonce_forward_kernel, 128), (kernels._infonce_grad_pred_kernel, 64),
                         (kernels._infonce_grad_embeds_kernel, 64)):  # fmt: skip
        config = next(c for c in autotune_configs(kernel) if c.kwargs["BLOCK_N"] == rows and c.kwargs["BLOCK_D"] == 64)
        stack.enter_context(forced_config(kernel, config))
    return stack


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_fp16_gradients_as_accurate_as_rounded_fp32(backend, device):
    """fp16 gradients at N = 65536 are within 5 % of the error of the fp32 gradient rounded to fp16, both
    measured against float64: every scale (1 / tau, per-row weights ~1 / N like the mean's) is applied in
    fp32 and the result is rounded once. Scaling ``softmax - one_hot`` by ``w / tau`` before casting it to
    fp16 for the dot (the old kernels) fails: the check at the end shows this test would catch it."""
    pred, embeds, targets, weights = _fp16_precision_problem(device)
    tau = 0.7
    fp32, truth = check_fp16_gradients(
        pred, embeds, targets, weights, backend=backend, tau=tau, reduction="none",
        context=_large_tiles() if backend == "triton" else contextlib.nullcontext(),
        algorithm=FUSED if backend == "triton" else "auto",
    )  # fmt: skip
    # Power: scaling by w / tau before the fp16 cast (the old kernels) misses the bound on grad_pred.
    p64, e64 = pred.double(), embeds.double()
    probs = torch.softmax(p64 @ e64.T / tau, -1)
    grad_logits = probs - torch.nn.functional.one_hot(targets.clamp_min(0), probs.shape[-1])
    row_scale = weights.double() * (targets != IGNORE) / tau
    scaled_first = ((grad_logits * row_scale[:, None]).half().float() @ embeds.float()).half()
    bound = 1.05 * relative_rms_error(fp32[0].half(), truth[0])
    assert relative_rms_error(scaled_first, truth[0]) > bound, "the old scaling must fail this test"


def _launch_spy(monkeypatch):
    """Record ``(kernel name, grid function)`` of every launch of the contrastive kernels."""
    from icrl_kernels._triton import kernel_name
    from icrl_kernels.contrastive import fused_kernels

    launches: list = []
    real_launch = fused_kernels.launch

    def spy(kernel, grid):
        launches.append((kernel_name(kernel), grid))
        return real_launch(kernel, grid)

    monkeypatch.setattr(fused_kernels, "launch", spy)
    return launches


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "dim,num_actions,dtype,columns",
    [
        # (D, A, dtype, {MAX_DO: expected column blocks of grad_pred, grad_embeds})
        (260, 9, torch.float16, {512: (1, 1), 1024: (1, 1)}),  # one action tile: no accumulator
        (260, 150, torch.float16, {512: (1, 1), 1024: (1, 1)}),  # streamed: one full-width block
        (520, 150, torch.float16, {512: (2, 2), 1024: (1, 1)}),  # wider than MAX_DO: the fallback
        (520, 9, torch.float16, {512: (1, 2), 1024: (1, 1)}),  # one action tile: grad_pred has no limit
        (260, 150, torch.float32, {512: (2, 2), 1024: (2, 2)}),  # fp32 FMA dots: 256 columns at most
    ],
)
def test_backward_computes_each_softmax_gradient_once(monkeypatch, device, dim, num_actions, dtype, columns):
    """Both backward kernels span the whole width in one program (grid axis 1 = 1, so each logits tile
    is computed once per gradient) up to MAX_DO columns (FMA_MAX_DO = 256 with fp32 dots), in every
    config; wider outputs fall back to column blocks. Checked on the launch grids (evaluated for every
    config), with a parity check of the run itself."""
    from icrl_kernels._triton import autotune_configs
    from icrl_kernels.contrastive import fused_kernels as kernels

    launches = _launch_spy(monkeypatch)
    case = Case("width", (7, dim), num_actions, False, None, 0.0, 1.0, "sum")
    inputs = make_inputs(case, dtype, device, seed=dim)  # A = 9 would take the one-kernel algorithm: fused asked
    check_infonce_parity(inputs, "triton", tau=1.0, reduction="sum", algorithm=FUSED)
    grids = {name: grid for name, grid in launches}
    assert set(grids) == {"infonce_forward", "infonce_grad_pred", "infonce_grad_embeds"}
    for name, index in (("infonce_grad_pred", 0), ("infonce_grad_embeds", 1)):
        kernel = getattr(kernels, f"_{name}_kernel")
        for config in autotune_configs(kernel):
            blocks = grids[name](config.kwargs)[1]
            assert blocks == columns[config.kwargs["MAX_DO"]][index], (name, config.kwargs, blocks)


def test_autotune_keys_bucket_the_rows():
    from icrl_kernels.contrastive import fused_kernels as kernels

    for kernel in (kernels._infonce_forward_kernel, kernels._infonce_grad_pred_kernel,
                   kernels._infonce_grad_embeds_kernel, kernels._select_actions_kernel):  # fmt: skip
        assert "SIZE_BUCKET" in kernel.keys, kernel.keys


def test_padded_mask_layout():
    """Misaligned masks (A = 125, strided) get one zero-padded copy, 16-column aligned; aligned ones none."""
    gen = torch.Generator().manual_seed(3)
    for shape in ((1, 1, 125), (3, 1, 125), (3, 4, 125), (3, 4, 7)):
        mask = random_mask(shape, gen).view(torch.uint8)
        padded = padded_mask(mask)
        width = -(-shape[-1] // 16) * 16
        assert padded.shape == shape[:-1] + (width,) and padded.stride(-1) == 1
        assert torch.equal(padded[..., : shape[-1]], mask) and not padded[..., shape[-1] :].any()
    aligned = random_mask((3, 4, 128), gen).view(torch.uint8)
    assert padded_mask(aligned) is aligned
    strided = random_mask((3, 128, 4), gen).view(torch.uint8).transpose(1, 2)  # [3, 4, 128], stride 1 on T
    assert padded_mask(strided).is_contiguous() and torch.equal(padded_mask(strided), strided)
    assert padded_mask(None) is None


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("where", ["pred", "action_embeds"])
def test_select_nan_is_reported_and_masked_actions_never_chosen(backend, device, where):
    check_select_nan(backend, device, where)


@pytest.mark.parametrize("backend,device", ALL_PATHS)
@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_select_overflowing_logits_never_choose_masked(backend, device, mode):
    check_select_overflow(backend, device, mode)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_select_fast_paths_agree_with_the_reference_on_non_finite_scores(backend, device):
    """The reference is the spec for the non-finite cases too: argmax with scores that overflow to +-inf
    at a tiny tau under a mask, and NaN scores with value checks off, give the same actions on every path
    (and the reference raises on NaN as the fast paths do)."""
    from icrl_kernels import set_value_checks

    gen = torch.Generator().manual_seed(43)
    embeds = torch.randn(37, 8, generator=gen)
    pred = torch.randn(3, 11, 8, generator=gen) * 1000
    mask = random_mask((3, 11, 37), gen)
    mask[..., 0] = False
    mask[0, :, 1:] &= (pred[0] @ embeds.T)[:, 1:] < 0  # sequence 0: only -inf logits left available
    mask[0, :, 36] = True
    nan_pred = pred.clone()
    nan_pred[1, 2] = float("nan")
    nan_pred[2, :, 3] = float("nan")
    cases = [(pred, 1e-38, mask), (pred, 1e-38, None), (pred, 0.7, mask), (nan_pred, 1.0, mask), (nan_pred, 1.0, None)]
    with pytest.raises(ValueError, match="pred or action_embeds contains NaN"):
        select_actions_reference(nan_pred, embeds, mask=mask)
    previous = set_value_checks("off")  # NaN scores: compare what each path picks when nothing raises
    try:
        for case_pred, tau, case_mask in cases:
            expected = select_actions_reference(case_pred, embeds, tau=tau, mask=case_mask)
            moved = [t.to(device) if t is not None else None for t in (case_pred, embeds, case_mask)]
            actions = select_actions(moved[0], moved[1], mode="argmax", tau=tau, mask=moved[2], backend=backend)
            assert torch.equal(actions.cpu(), expected), (tau, case_mask is None, bool(case_pred.isnan().any()))
            if case_mask is not None:
                assert case_mask.gather(-1, expected[..., None]).all(), "the reference picked a masked action"
    finally:
        set_value_checks(previous)


def test_eager_gumbel_noise_is_a_device_function_of_the_seed():
    """The eager sampler's noise: standard Gumbel moments, reproducible, different across seeds and counters."""
    from icrl_kernels.contrastive.eager import _hashed_gumbel

    counter = torch.arange(100_000)
    seed = torch.tensor([2**61 + 12345])
    noise = _hashed_gumbel(seed, counter)
    assert torch.equal(noise, _hashed_gumbel(seed.clone(), counter))
    assert abs(noise.mean().item() - 0.5772) < 0.02 and abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.02
    other = _hashed_gumbel(seed + 1, counter)
    assert abs(torch.corrcoef(torch.stack([noise, other]))[0, 1].item()) < 0.02
    assert torch.isfinite(noise).all()


# --- compiled (non-interpreter) kernels, without a GPU --------------------------------------------

_OFFLINE_COMPILE = """
import itertools
from benchmarks.kernel_tools import compile_offline, config_jobs
from icrl_kernels.contrastive import chunked_kernels as ck
from icrl_kernels.contrastive import fused_kernels as k
from icrl_kernels.contrastive import small_kernels as sk

# benchmarks/bench_infonce.py (docs/performance.md#targets): N = B * T = 6400 rows (B = 32, T = 200), D = 512 and
# 1024, one shared map of A = 125 actions (one tile; not a multiple of 16, which changes the
# specialisation) or A = 4096 (streamed). Every autotune config in bf16 (tensor-core dots; fp16 takes the
# same path) and fp32 (FMA dots), without a mask as benchmarked and with a [B, T, A] mask padded to a
# multiple of 16 columns as function.py passes it (with Gumbel sampling in the selection kernel).
T, ROWS = 200, 6400
SHAPES = [(125, True, 512), (4096, False, 512), (4096, True, 512), (125, True, 1024), (4096, False, 1024),
          (4096, True, 1024)]
jobs = []
for (A, masked, D), dtype in itertools.product(SHAPES, ["bf16", "fp32"]):
    half = dtype != "fp32"
    mask_cols = -(-A // 16) * 16
    block_ae = k._block_a_embeds(A, D, half)
    splits = k._num_splits(ROWS, -(-A // block_ae))  # grad_embeds writes fp32 partials when split
    signature = {
        "pred_ptr": "*" + dtype, "embeds_ptr": "*" + dtype, "mask_ptr": "*u8" if masked else "*" + dtype,
        "targets_ptr": "*i64", "lse_ptr": "*fp32", "weights_ptr": "*fp32", "wmax_ptr": "*fp32", "status_ptr": "*i8",
        "loss_ptr": "*fp32", "grad_ptr": "*" + dtype, "seed_ptr": "*i64", "nan_ptr": "*i8",
        "T": T, "A": A, "D": D, "ROWS": ROWS, "tau": 0.5, "ignore_index": -100,
        "MASK_COLS": mask_cols if masked else 16, "SIZE_BUCKET": 8192,
        "ROWS_PER_SPLIT": -(-ROWS // splits), "NUM_SPLITS": splits,
        "stride_pb": T * D, "stride_pt": D, "stride_eg": A * D, "stride_ea": D,
        "stride_mb": T * mask_cols if masked else 0, "stride_mt": mask_cols if masked else 0,
        "stride_ma": 1 if masked else 0, "stride_gb": T * D, "stride_gt": D, "stride_os": A * D, "stride_oa": D,
        "out_ptr": "*fp32" if splits > 1 else "*" + dtype,  # grad_embeds; selection's is overridden below
        # The algorithms of contrastive/algorithms.py: the small kernel's mean count; the chunk kernels' chunk of
        # 2048 rows x A fp32 logits (row chunks; the gradient operand in place, half-precision rows of 2 A) and
        # their per-row state.
        "count_ptr": "*i64", "logits_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "hit_ptr": "*fp32",
        "actions_ptr": "*i32", "targets_ok_ptr": "*i32", "best_ptr": "*fp32", "choice_ptr": "*i64",
        "ROW0": 2048, "R": 2048, "A0": 0, "C": A, "stride_lr": A, "stride_gr": A if dtype == "fp32" else 2 * A,
        "SEED_ROWS": ROWS, "RUN_ROWS": ROWS,  # one run
    }
    flags = {"HAS_MASK": masked, "HALF_DOT": half, "SAMPLE": masked, "DO_FULL": k._do_full(D)}
    info = {"A": A, "D": D, "mask": masked, "dtype": dtype}
    block_a = k._block_a(A, half, D)  # as the wrappers pick
    jobs += config_jobs(k._infonce_grad_pred_kernel, signature,
                        {**flags, "BLOCK_A": block_a, "SINGLE_TILE": A <= block_a}, **info)
    jobs += config_jobs(k._infonce_grad_embeds_kernel, signature, {**flags, "BLOCK_A": block_ae}, **info,
                        splits=splits)
    if D == 512:  # no accumulator: the width does not change their tiles
        jobs += config_jobs(k._infonce_forward_kernel, signature, {**flags, "BLOCK_A": block_a}, **info)
        jobs += config_jobs(k._select_actions_kernel, {**signature, "out_ptr": "*i64"},
                            {**flags, "BLOCK_A": k._block_a(A, half)}, **info)
    if A <= 128:  # the small algorithm: one action tile, the gradient for pred in the same kernel (any width)
        # The mean counted by the kernel (a small call), and counted by torch with the lse the map's gradient reads.
        for weights, store_lse in ((sk.WEIGHT_MEAN_COUNTED, False), (sk.WEIGHT_MEAN, True)):
            jobs += config_jobs(sk._infonce_small_kernel, signature, {**flags, "BLOCK_A": 128, "WRITE_GRAD": True,
                                "ROW_WEIGHTS": weights, "STORE_LSE": store_lse}, **info, weights=weights)
    elif D == 512:  # the chunk kernels read logits, not pred: the width does not matter
        for stats, first, last, grad in ((True, True, True, True), (True, True, False, False),
                                         (True, False, True, False), (False, False, False, True)):
            jobs += config_jobs(ck._infonce_chunk_kernel, signature, {**flags, "STATS": stats, "FIRST": first,
                                "LAST": last, "WRITE_GRAD": grad}, **info, mode=f"stats{int(stats)}-grad{int(grad)}")
        for first, last in ((True, True), (False, False)):
            jobs += config_jobs(ck._select_chunk_kernel, {**signature, "out_ptr": "*i64", "nan_ptr": "*i32"},
                                {**flags, "FIRST": first, "LAST": last}, **info)
compile_offline(jobs)
"""

#: Shared memory an H100 program may take (227 KB): more fails at launch, not at compile time.
MAX_SHARED_BYTES = 232448


@pytest.mark.slow  # the exhaustive tier: every config compiled for sm_90 (docs/testing.md#test-tiers)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the compiled kernels for real")
def test_kernels_compile_for_sm90_offline():
    """The interpreter accepts code the compiler rejects: compile the InfoNCE and selection kernels to sm_90
    cubins in every autotune config, in bf16 and fp32, at the benchmark shapes (A = 125 and 4096, D = 512
    and 1024, masked and not), and check that none spills more than ``MAX_SPILL_BYTES`` per thread (the
    fp32 backward with 128-action tiles spilled 17-30 KB; full-width accumulators over 128 threads 1.2 KB)
    or needs more shared memory than an H100 has (128 actions x 1024 columns of bf16 map took 270 KB). The
    kernels of the other algorithms too (contrastive/algorithms.py): the small kernel at A = 125 (every
    width), the chunk kernels at A = 4096 in each of their modes (statistics, carried state, gradient)."""
    reports = run_offline_compile(_OFFLINE_COMPILE)
    check_offline_reports(reports, {"_infonce_forward_kernel", "_infonce_grad_pred_kernel",
                                    "_infonce_grad_embeds_kernel", "_select_actions_kernel", "_infonce_small_kernel",
                                    "_infonce_chunk_kernel", "_select_chunk_kernel"})  # fmt: skip
    heavy = [report for report in reports if report["shared"] > MAX_SHARED_BYTES]
    assert not heavy, f"shared memory above {MAX_SHARED_BYTES} bytes: {heavy}"
    # InfoNCE at A >= 4096 is bound by its dots (the H200 profile: 88-100% device-busy). On Hopper, tiles of
    # 64 rows or more must compile to warpgroup MMA (wgmma, "v3"); 32-row tiles get mma.sync ("v2"). A
    # change of layout or operand that makes a dot ineligible would halve its peak without failing a test.
    half_tiles = [r for r in reports if r["dtype"] == "bf16" and int(re.search(r"BLOCK_N(\d+)", r["config"])[1]) >= 64]
    assert {r["name"] for r in half_tiles} >= {"_infonce_forward_kernel", "_infonce_grad_pred_kernel",
                                               "_infonce_small_kernel"}  # fmt: skip
    not_wgmma = [(r["name"], r["config"], r["A"], r["mask"], r["mma"]) for r in half_tiles if "v3" not in r["mma"]]
    assert not not_wgmma, f"bf16 tiles of >= 64 rows without wgmma on sm_90: {not_wgmma}"
