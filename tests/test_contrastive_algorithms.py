"""The algorithms of InfoNCE and action selection (``contrastive/algorithms.py``), each asked for by name
(``algorithm=``) at small sizes and checked against the fp32 reference.

``chunk_sizes`` makes chunks so small that several chunks of rows (and, for ``action_chunks``, of actions) run
under the interpreter; a spy on the kernel launches then proves that the algorithm asked for ran (and the fused
kernels did not). Kernel outputs start NaN-poisoned (tests/conftest.py). The
fused algorithm's own tests are in test_contrastive_kernels.py; it is also run here beside the others at the
small action sets that now take the ``small`` path by default.

Cases come from test_contrastive_kernels.py: odd sizes, masks ``[A]``, ``[B, A]`` and per row, padding
(``ignore_index``), per-sequence maps, temperatures, every reduction, random upstream weights.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import pytest
import torch
from _contrastive import (  # the fused path's checks, here under each forced algorithm
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
    make_inputs,
)

from icrl_kernels import set_value_checks
from icrl_kernels.contrastive import (
    action_logits_reference,
    infonce_loss,
    infonce_loss_reference,
    select_actions,
)
from icrl_kernels.contrastive.algorithms import (
    ACTION_CHUNK,
    ACTION_CHUNKS,
    CHUNK_BYTES,
    FUSED,
    HUGE_ALGORITHM,
    HUGE_MIN_ACTIONS,
    INFONCE_ALGORITHMS,
    ROW_CHUNKS,
    ROW_CHUNKS_MIN_ACTIONS,
    SELECT_CHUNKS_MIN_ACTIONS,
    SMALL,
    SMALL_MAX_ACTIONS,
    chunk_shape,
    chunk_sizes,
    infonce_algorithm,
    infonce_memory_bytes,
    select_algorithm,
)
from icrl_kernels.testing import RMS_TOLERANCE, TESTED_DTYPES, assert_close_rel, triton_devices

TRITON_DEVICES = triton_devices()
needs_triton = pytest.mark.skipif(not TRITON_DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")
DEVICES = [pytest.param(device, id=device) for device in TRITON_DEVICES]
CHUNKED = (ROW_CHUNKS, ACTION_CHUNKS)
#: The kernels each algorithm launches (``_triton.kernel_name``); ``small`` adds the fused grad_embeds kernel
#: when the map needs a gradient.
KERNELS = {
    SMALL: {"infonce_small"},
    FUSED: {"infonce_forward", "infonce_grad_pred"},
    ROW_CHUNKS: {"infonce_chunk"},
    ACTION_CHUNKS: {"infonce_chunk"},
}


def _rows(case: Case) -> int:
    return math.prod(case.pred_shape[:-1])


def tiny_chunks(algorithm: str, num_rows: int, num_actions: int) -> dict:
    """Chunk sizes that split ``num_rows`` rows into about three chunks and, for ``action_chunks``, the actions
    into about three chunks too (several chunks of each kind under the interpreter)."""
    actions = -(-num_actions // 3) if algorithm == ACTION_CHUNKS else num_actions
    return {"chunk_bytes": 4 * actions * -(-num_rows // 3), "action_chunk": actions}


def forced(algorithm: str, num_rows: int, num_actions: int):
    """Tiny chunks (:func:`tiny_chunks`) for the calls in the block, which ask for ``algorithm`` themselves."""
    return chunk_sizes(**tiny_chunks(algorithm, num_rows, num_actions))


def launch_spy(monkeypatch) -> list[str]:
    """Record the name of every kernel launched by the contrastive kernel modules."""
    from icrl_kernels._triton import kernel_name
    from icrl_kernels.contrastive import chunked_kernels, fused_kernels, small_kernels

    launches: list[str] = []
    for module in (fused_kernels, small_kernels, chunked_kernels):
        real = module.launch

        def spy(kernel, grid, real=real):
            launches.append(kernel_name(kernel))
            return real(kernel, grid)

        monkeypatch.setattr(module, "launch", spy)
    return launches


def assert_ran(launches: list[str], algorithm: str, *, grad_embeds: bool = False, chunks: int = 2) -> None:
    """The forced ``algorithm``'s kernels, and no other, ran; chunked ones in at least ``chunks`` launches."""
    expected = KERNELS[algorithm] | ({"infonce_grad_embeds"} if grad_embeds and algorithm in (SMALL, FUSED) else set())
    assert set(launches) <= expected and KERNELS[algorithm] <= set(launches), (algorithm, launches)
    if algorithm in CHUNKED:
        assert launches.count("infonce_chunk") >= chunks, f"expected several chunks, got {launches}"


def _parity_params():
    for case in PARITY_CASES:
        for algorithm in INFONCE_ALGORITHMS:
            if algorithm == SMALL and case.num_actions > SMALL_MAX_ACTIONS:
                continue
            for dtype in TESTED_DTYPES:
                yield pytest.param(case, algorithm, dtype, id=f"{case.name}-{algorithm}-{str(dtype)[6:]}")


# --- InfoNCE: parity of every path ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,algorithm,dtype", list(_parity_params()))
def test_parity_every_path(monkeypatch, case: Case, algorithm, dtype, device):
    """Loss and both gradients of every algorithm against the fp32 reference, fresh inputs per case."""
    launches = launch_spy(monkeypatch)
    inputs = make_inputs(case, dtype, device, seed=zlib.crc32(f"{case.name}-{algorithm}".encode()))
    with forced(algorithm, _rows(case), case.num_actions):
        check_infonce_parity(inputs, "triton", tau=case.tau, reduction=case.reduction, algorithm=algorithm)
    assert_ran(launches, algorithm, grad_embeds=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("wrt", ["pred", "embeds", "both"])
@pytest.mark.parametrize("algorithm", [SMALL, ROW_CHUNKS, ACTION_CHUNKS])
def test_gradients_only_where_asked(monkeypatch, algorithm, wrt, reduction, device):
    """``wrt``: a gradient for the inputs that require one, none for the others (a fixed map, Headless-AD's
    case, launches no map-gradient work), in every reduction."""
    case = CASES["A7-BTD-fullmask-ignore"]._replace(reduction=reduction)
    inputs = make_inputs(case, torch.float32, device, seed=51)
    pred = inputs.pred.clone().requires_grad_(wrt != "embeds")
    embeds = inputs.embeds.clone().requires_grad_(wrt != "pred")
    launches = launch_spy(monkeypatch)
    kwargs = {"tau": case.tau, "mask": inputs.mask, "reduction": reduction}
    with forced(algorithm, _rows(case), case.num_actions):
        loss = infonce_loss(pred, embeds, inputs.targets, backend="triton", algorithm=algorithm, **kwargs)
    assert_ran(launches, algorithm, grad_embeds=wrt != "pred")
    grad_out = torch.rand(loss.shape, generator=torch.Generator().manual_seed(2)).to(device) + 0.5
    with forced(algorithm, _rows(case), case.num_actions):
        loss.backward(grad_out)
    pred_ref = inputs.pred.clone().requires_grad_(True)
    embeds_ref = inputs.embeds.clone().requires_grad_(True)
    infonce_loss_reference(pred_ref, embeds_ref, inputs.targets, **kwargs).backward(grad_out)
    for leaf, ref, asked in ((pred, pred_ref, wrt != "embeds"), (embeds, embeds_ref, wrt != "pred")):
        if asked:
            assert_close_rel(leaf.grad, ref.grad, name=f"grad {wrt}")
        else:
            assert leaf.grad is None
    if wrt == "pred" and algorithm == SMALL:
        assert "infonce_grad_embeds" not in launches, "a fixed map must cost no gradient kernel"


@pytest.mark.parametrize("algorithm", CHUNKED)
@pytest.mark.parametrize(
    "case,rows_per_chunk",
    [
        (Case("shared-N", (23, 24), 11, False, "A", 0.1, 0.9, "mean"), 5),  # ranges across flat rows
        (Case("perseq-whole", (5, 3, 24), 11, True, "BA", 0.2, 1.1, "sum"), 7),  # two whole sequences a chunk
        (Case("perseq-steps", (2, 9, 24), 11, True, "full", 0.1, 0.6, "none"), 4),  # slices of one sequence
        (Case("shared-one-row", (5, 24), 11, False, None, 0.0, 1.0, "mean"), 1),
    ],
    ids=lambda value: value.name if isinstance(value, Case) else str(value),
)
def test_chunks_cover_every_row_once_and_stay_in_their_budget(monkeypatch, case: Case, rows_per_chunk, algorithm):
    """The chunk iterator covers every row once per sweep, in more than one chunk, with each row against its
    own map; no logits block exceeds the chunk budget. Checked by spying on the chunks and the GEMMs."""
    if not TRITON_DEVICES:
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    from icrl_kernels.contrastive import chunked

    action_chunk = 4 if algorithm == ACTION_CHUNKS else case.num_actions
    budget = 4 * rows_per_chunk * action_chunk
    seen, blocks = [], []
    real_chunks, real_matmul = chunked.row_chunks, chunked.matmul_fp32

    def chunks_spy(pred, groups, rows):
        for chunk in real_chunks(pred, groups, rows):
            seen.append(chunk)
            yield chunk

    def matmul_spy(a, b):
        out = real_matmul(a, b)
        blocks.append(tuple(out.shape))
        return out

    monkeypatch.setattr(chunked, "row_chunks", chunks_spy)
    monkeypatch.setattr(chunked, "matmul_fp32", matmul_spy)
    inputs = make_inputs(case, torch.float32, TRITON_DEVICES[0], seed=53)
    with chunk_sizes(chunk_bytes=budget, action_chunk=action_chunk):
        check_infonce_parity(inputs, "triton", tau=case.tau, reduction=case.reduction, algorithm=algorithm)
    batch, steps = (1, case.pred_shape[0]) if len(case.pred_shape) == 2 else case.pred_shape[:2]
    coverage = torch.zeros(batch * steps, dtype=torch.int64)
    for chunk in seen:
        coverage[chunk.start : chunk.stop] += 1
        assert chunk.stop - chunk.start <= rows_per_chunk
        if case.per_sequence:  # the chunk's rows belong to the maps it multiplies by
            assert chunk.maps == slice(chunk.start // steps, (chunk.stop - 1) // steps + 1)
    passes = 2 if case.reduction == "none" else 1  # "none": the backward runs the chunks again
    assert torch.equal(coverage, torch.full_like(coverage, passes)), coverage
    assert len(seen) > passes
    logit_blocks = [shape for shape in blocks if shape[-1] != case.pred_shape[-1]]  # the gradients' end in D
    assert logit_blocks and all(4 * math.prod(shape) <= budget for shape in logit_blocks), logit_blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_rows", [0, 10**6], ids=["torch-count", "kernel-count"])
def test_small_mean_counts_its_rows(monkeypatch, device, max_rows):
    """The small kernel's mean: its rows counted by the kernel itself (up to ``COUNT_IN_KERNEL_MAX_ROWS`` rows of
    one run: no torch op around the launch) or by torch ops, the same loss and gradient either way, also where
    every row is padding (NaN, gradient 0); a spy on the torch ops shows which one ran."""
    from icrl_kernels.contrastive import small_kernels

    monkeypatch.setattr(small_kernels, "COUNT_IN_KERNEL_MAX_ROWS", max_rows)
    counts = []
    real_count = small_kernels.count_rows
    monkeypatch.setattr(small_kernels, "count_rows", lambda *args: counts.append(args) or real_count(*args))
    case = CASES["A7-BTD-maskBA-tau1.7"]
    inputs = make_inputs(case, torch.float32, device, seed=61)
    check_infonce_parity(inputs, "triton", tau=case.tau, reduction="mean", algorithm=SMALL, embeds_grad=False)
    pred = inputs.pred.clone().requires_grad_(True)
    padding = torch.full_like(inputs.targets, IGNORE)
    loss = infonce_loss(pred, inputs.embeds, padding, backend="triton", algorithm=SMALL)
    assert torch.isnan(loss) and not torch.autograd.grad(loss, pred)[0].any()
    assert bool(counts) == (max_rows == 0), counts


# --- InfoNCE: edge cases, on every new path --------------------------------------------------------------

NEW_PATHS = [pytest.param(algorithm, device, id=f"{algorithm}-{device}") for algorithm in (SMALL, *CHUNKED)
             for device in TRITON_DEVICES]  # fmt: skip


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "perseq"])
def test_single_available_action_is_zero_loss_and_gradient(algorithm, device, per_sequence):
    """One action, or one available action per row: the softmax is exactly 1 on the target, so the loss and
    both gradients are exactly 0 (the log-sum-exp of one logit is that logit). The fused path's test, forced."""
    with forced(algorithm, 33, 7):
        check_single_available_action("triton", device, per_sequence, algorithm=algorithm)


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_all_rows_ignored(algorithm, device):
    """Every row padding: the sum is 0, the mean NaN (0 / 0) as in the reference, both with zero gradients."""
    with forced(algorithm, 10, 7):
        check_all_rows_ignored("triton", device, algorithm=algorithm)


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_masked_actions_get_exactly_no_mass(algorithm, device):
    """Masked actions are outside the softmax: the map rows of masked actions get exactly zero gradient, and
    the result equals the problem without them, although they would dominate it if they leaked in."""
    gen = torch.Generator().manual_seed(63)
    num_actions, masked = 13, [0, 5, 12]
    pred = torch.randn(2, 9, 24, generator=gen).to(device)
    embeds = (torch.randn(num_actions, 24, generator=gen) * 0.4).to(device)
    embeds[masked] = pred.reshape(-1, 24)[:3] * 10.0
    mask = torch.ones(num_actions, dtype=torch.bool, device=device)
    mask[masked] = False
    kept = mask.nonzero().flatten()
    targets = kept[torch.randint(0, len(kept), (2, 9), generator=gen).to(device)]
    pred_leaf, embeds_leaf = pred.clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    with forced(algorithm, 18, num_actions):
        loss = infonce_loss(pred_leaf, embeds_leaf, targets, mask=mask, tau=0.8, backend="triton", algorithm=algorithm)
        grad_pred, grad_embeds = torch.autograd.grad(loss, (pred_leaf, embeds_leaf))
    assert torch.equal(grad_embeds[masked], torch.zeros_like(grad_embeds[masked]))
    renumber = torch.full((num_actions,), -1, dtype=torch.int64, device=device)
    renumber[kept] = torch.arange(len(kept), device=device)
    pred_ref, embeds_ref = pred.clone().requires_grad_(True), embeds[kept].clone().requires_grad_(True)
    expected = infonce_loss_reference(pred_ref, embeds_ref, renumber[targets], tau=0.8)
    expected_pred, expected_embeds = torch.autograd.grad(expected, (pred_ref, embeds_ref))
    assert_close_rel(loss, expected, name="loss without the masked actions")
    assert_close_rel(grad_pred, expected_pred, name="grad_pred")
    assert_close_rel(grad_embeds[kept], expected_embeds, name="grad_embeds of the kept actions")


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
@pytest.mark.parametrize("ignore_index", [-1, 2, 5, 1000])
def test_ignore_index_values(algorithm, device, ignore_index):
    """``ignore_index`` may be negative, a valid action id (a padded row may then "target" an action its
    mask excludes) or an id past the action set. The fused path's test, forced."""
    with forced(algorithm, 36, 5):
        check_ignore_index_values("triton", device, ignore_index, algorithm=algorithm)


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_one_step_sequences_and_strided_inputs(algorithm, device):
    """``T = 1`` (one row per sequence, per-sequence maps), a single row, strided views and int32 targets."""
    gen = torch.Generator().manual_seed(65)
    pred = torch.randn(2, 24, 9, generator=gen).to(device).transpose(1, 2)  # [2, 9, 24], strided
    embeds = (torch.randn(14, 24, generator=gen) * 0.4).to(device)[::2]  # [7, 24], strided
    targets = torch.randint(0, 7, (2, 9), generator=gen).to(device=device, dtype=torch.int32)
    cases = [(pred, embeds, targets), (pred[:, :1], embeds, targets[:, :1]), (pred[:1, :1], embeds, targets[:1, :1])]
    per_seq = torch.randn(5, 7, 24, generator=gen).to(device) * 0.4
    cases.append((torch.randn(5, 1, 24, generator=gen).to(device), per_seq, targets[:, :1].repeat(3, 1)[:5]))
    for p, e, t in cases:
        with forced(algorithm, max(3, t.numel()), 7):
            check_infonce_parity(Inputs(p, e, t, None), "triton", tau=0.9, reduction="none", algorithm=algorithm)


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_an_outlier_row_changes_no_other_row(algorithm, device):
    """A row with huge finite logits (pred x 1e4, logits ~ 1e4) leaves every other row's loss and gradient
    as they were, within fp32 rounding: rows never share a shift, a scale or a chunk statistic."""
    case = Case("outlier", (3, 7, 24), 11, False, "BA", 0.1, 0.7, "none")
    inputs = make_inputs(case, torch.float32, device, seed=66)
    outlier = inputs.pred.clone()
    outlier[1, 4] *= 1e4
    results = []
    for pred in (inputs.pred, outlier):
        pred = pred.clone().requires_grad_(True)
        with forced(algorithm, 21, 11):
            loss = infonce_loss(pred, inputs.embeds, inputs.targets, tau=case.tau, mask=inputs.mask,
                                reduction="none", backend="triton", algorithm=algorithm)  # fmt: skip
            (grad,) = torch.autograd.grad(loss, pred, torch.ones_like(loss))
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        results.append((loss.detach(), grad))
    others = torch.ones(3, 7, dtype=torch.bool, device=device)
    others[1, 4] = False
    for name, clean, shifted in zip(("loss", "grad_pred"), *results):
        assert_close_rel(shifted[others], clean[others], rms_tol=1e-6, name=f"{name} of the other rows")
    assert action_logits_reference(outlier, inputs.embeds, tau=case.tau)[1, 4].abs().max() > 1e3


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_value_checks_raise_as_on_the_fused_path(algorithm, device):
    """Out-of-range targets, masked targets and mask rows with no action raise the fused path's errors,
    from the status the new kernels write; a masked ignore_index is fine."""
    gen = torch.Generator().manual_seed(67)
    pred = torch.randn(2, 6, 16, generator=gen).to(device)
    embeds = torch.randn(4, 16, generator=gen).to(device)
    targets = torch.randint(0, 4, (2, 6), generator=gen).to(device)
    mask = torch.tensor([True, False, True, True], device=device)
    valid = torch.where(targets == 1, 2, targets)
    with forced(algorithm, 12, 4):
        for value, match in ((4, r"targets must lie in \[0, 4\)"), (-1, "targets must lie in")):
            bad = targets.clone()
            bad[1, 2] = value
            with pytest.raises(ValueError, match=match):
                infonce_loss(pred, embeds, bad, backend="triton", algorithm=algorithm)
        infonce_loss(
            pred, embeds, valid, mask=mask, backend="triton", algorithm=algorithm
        )  # every target available: fine
        bad = valid.clone()
        bad[0, 3] = 1
        with pytest.raises(ValueError, match="targets include actions that mask marks unavailable"):
            infonce_loss(pred, embeds, bad, mask=mask, backend="triton", algorithm=algorithm)
        assert torch.isfinite(
            infonce_loss(pred, embeds, bad, mask=mask, ignore_index=1, backend="triton", algorithm=algorithm)
        )
        empty_row = torch.ones(2, 6, 4, dtype=torch.bool, device=device)
        empty_row[1, 5] = False
        with pytest.raises(ValueError, match="mask leaves a row with no available action"):
            infonce_loss(pred, embeds, targets, mask=empty_row, backend="triton", algorithm=algorithm)


def _precision_problem(rows: int):
    """fp16 inputs (D = 16, A = 5, 10% padding) and per-row weights ~1 / 65536: gradients in fp16's subnormal
    range, where rounding them once matters most (the mean's ``1 / N`` at N = 65536)."""
    gen = torch.Generator().manual_seed(rows)
    pred = torch.randn(rows, 16, generator=gen).half()
    embeds = (torch.randn(5, 16, generator=gen) * 0.5).half()
    targets = torch.randint(0, 5, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < 0.1] = IGNORE
    weights = (torch.rand(rows, generator=gen) + 0.5) / 65536
    return pred, embeds, targets, weights


def _large_row_tiles():
    """The 64-row config of the small kernel and the 32-row one of the chunk kernel: fewer, larger programs
    (the interpreter's cost is per program)."""
    from icrl_kernels._triton import autotune_configs
    from icrl_kernels.contrastive import chunked_kernels, small_kernels
    from icrl_kernels.testing import forced_config

    stack = contextlib.ExitStack()
    for kernel, rows in ((small_kernels._infonce_small_kernel, 64), (chunked_kernels._infonce_chunk_kernel, 32)):
        stack.enter_context(
            forced_config(kernel, next(c for c in autotune_configs(kernel) if c.kwargs["BLOCK_N"] == rows))
        )
    return stack


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
@pytest.mark.parametrize(
    "reduction,rows", [("none", 4096), pytest.param("mean", 65536, marks=pytest.mark.slow)], ids=["none", "mean"]
)
def test_fp16_gradients_as_accurate_as_rounded_fp32(algorithm, device, reduction, rows):
    """fp16 gradients within 5% of the error of the fp32 gradient rounded to fp16 (both against float64), with
    gradients in fp16's subnormal range: every scale is applied in fp32 and the result rounded once. ``none``:
    per-row weights ~1 / 65536, which the backward folds in; ``mean`` (``slow``: 65536 rows): the forward folds
    ``1 / N`` and ``loss.backward()`` multiplies by exactly 1. (In fp16's normal range the dots' half-precision
    operand adds a rounding of its own, on every path, the fused one included; scaling before the fp16 cast
    fails this bound: test_contrastive_kernels.py's version of this test shows it.)"""
    pred, embeds, targets, weights = (t.to(device) for t in _precision_problem(rows))
    upstream = weights if reduction == "none" else torch.tensor(1.0, device=device)
    context = contextlib.ExitStack()
    context.enter_context(_large_row_tiles())
    context.enter_context(chunk_sizes(chunk_bytes=4 * 5 * rows // 4, action_chunk=2))
    check_fp16_gradients(pred, embeds, targets, upstream, backend="triton", tau=0.7, reduction=reduction,
                         context=context, algorithm=algorithm)  # fmt: skip


# --- action selection ---------------------------------------------------------------------------------

SELECT_PATHS = [pytest.param(algorithm, device, id=f"{algorithm}-{device}") for algorithm in CHUNKED
                for device in TRITON_DEVICES]  # fmt: skip
SELECT_CASES = [
    Case("shared-A150-maskA", (37, 40), 150, False, "A", 0.0, 1.0, ""),
    Case("BTD-A37-full", (3, 11, 24), 37, False, "full", 0.0, 0.7, ""),
    Case("perseq-A29-BA", (3, 10, 24), 29, True, "BA", 0.0, 1.3, ""),
    Case("perseq-steps-A29", (2, 9, 24), 29, True, "full", 0.0, 1.0, ""),
]


def _select(inputs, algorithm: str, mode: str, tau: float, seed: int = 5):
    with forced(algorithm, _rows_of(inputs.pred), inputs.embeds.shape[-2]):
        return select_actions(inputs.pred, inputs.embeds, mode=mode, tau=tau, mask=inputs.mask,
                              generator=torch.Generator().manual_seed(seed), backend="triton",
                              algorithm=algorithm)  # fmt: skip


def _rows_of(pred: torch.Tensor) -> int:
    return math.prod(pred.shape[:-1])


@pytest.mark.parametrize("algorithm,device", SELECT_PATHS)
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: c.name)
def test_select_every_path(monkeypatch, case: Case, algorithm, device):
    """Argmax: the reference's choice up to near-ties; sampling: exactly the fused kernel's draw (the same
    Gumbel noise per (row, action); tau = 1e4 makes logit rounding irrelevant); never a masked action."""
    launches = launch_spy(monkeypatch)
    inputs = make_inputs(case, torch.float32, device, seed=zlib.crc32(case.name.encode()))
    actions = _select(inputs, algorithm, "argmax", case.tau)
    assert set(launches) == {"select_chunk"} and len(launches) >= 2, launches
    assert_argmax_equal(actions, inputs.pred, inputs.embeds, case.tau, inputs.mask, gap=1e-5)
    for seed in (1, 2):
        fused = select_actions(inputs.pred, inputs.embeds, mode="sample", tau=1e4, mask=inputs.mask,
                               generator=torch.Generator().manual_seed(seed), backend="triton",
                               algorithm=FUSED)  # fmt: skip
        chunked = _select(inputs, algorithm, "sample", 1e4, seed=seed)
        assert torch.equal(chunked, fused), f"{int((chunked != fused).sum())} draws differ from the fused kernel's"


@pytest.mark.parametrize("algorithm,device", SELECT_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_select_half_precision(algorithm, device, dtype):
    inputs = make_inputs(SELECT_CASES[1], dtype, device, seed=71)
    actions = _select(inputs, algorithm, "argmax", 0.7)
    assert_argmax_equal(actions, inputs.pred, inputs.embeds, 0.7, inputs.mask, gap=1e-2)


@pytest.mark.parametrize("algorithm,device", SELECT_PATHS)
@pytest.mark.parametrize("where", ["pred", "action_embeds"])
def test_select_nan_never_chooses_masked(algorithm, device, where):
    """NaN in ``pred`` or the map raises; with checks off every row still gets an available action."""
    with forced(algorithm, 18, 150):
        check_select_nan("triton", device, where, algorithm=algorithm)


@pytest.mark.parametrize("algorithm,device", SELECT_PATHS)
@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_select_overflow_never_chooses_masked(algorithm, device, mode):
    """Logits overflowing to +-inf: rows whose available logits are all -inf take their first available action
    (never the masked action 0), +inf ties the lowest available id."""
    with forced(algorithm, 40, 150):
        check_select_overflow("triton", device, mode, algorithm=algorithm)


# --- custom ops, host reads, dispatch, memory ----------------------------------------------------------


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_opcheck(algorithm, device):
    """The one op of every algorithm (``impl``), every reduction, one run and two (how vmap folds runs)."""
    from icrl_kernels.contrastive.function import infonce_op, select_actions_op

    gen = torch.Generator().manual_seed(73)
    pred = torch.randn(2, 7, 16, generator=gen).to(device).requires_grad_(True)
    embeds = torch.randn(9, 16, generator=gen).to(device).requires_grad_(True)
    targets = torch.randint(0, 9, (2, 7), generator=gen).to(device)
    targets[1, 3] = IGNORE
    mask = torch.ones(2, 1, 9, dtype=torch.uint8, device=device)
    with forced(algorithm, 14, 9):
        for reduction, runs in (("mean", 1), ("sum", 1), ("none", 1), ("mean", 2)):
            for embeds_grad in (True, False):  # the gradients the forward computes are those autograd needs
                leaf = embeds.detach().requires_grad_(embeds_grad)
                args = (pred, leaf, targets, mask, 0.7, IGNORE, reduction, runs, True, embeds_grad, algorithm)
                torch.library.opcheck(infonce_op, args)
        if algorithm != SMALL:
            seed = torch.tensor([1234], dtype=torch.int64, device=device)
            args = (pred.detach(), embeds.detach(), mask, 0.7, True, seed, algorithm)
            torch.library.opcheck(select_actions_op, args)


@pytest.mark.parametrize("algorithm,device", NEW_PATHS)
def test_no_host_reads(algorithm, device):
    """Forward and backward of every reduction, and both selection modes, with value checks in their GPU
    mode: no op that would read a device value on the host (everything capturable in a CUDA graph)."""
    from _helpers import HostReadDetector, gpu_value_checks

    gen = torch.Generator().manual_seed(74)
    embeds = torch.randn(12, 16, generator=gen).to(device)
    targets = torch.randint(0, 12, (2, 9), generator=gen).to(device)
    targets[0, 0] = IGNORE
    mask = torch.ones(12, dtype=torch.bool, device=device)
    mask[3] = False
    targets[targets == 3] = 4

    def run():
        for reduction in ("mean", "sum", "none"):
            pred = torch.randn(2, 9, 16, device=device, requires_grad=True)
            loss = infonce_loss(pred, embeds, targets, mask=mask, reduction=reduction, backend="triton",
                                algorithm=algorithm)  # fmt: skip
            loss.sum().backward()
        for mode in ("argmax", "sample"):
            select_actions(pred.detach(), embeds, mode=mode, mask=mask, backend="triton", algorithm=algorithm)

    with forced(algorithm, 18, 12):
        run()  # warm-up: imports and first compiles
        with gpu_value_checks(), HostReadDetector() as detector:
            run()
    assert not detector.reads, f"{algorithm} reads device values on the host: {detector.reads}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", [SMALL, FUSED])
def test_ops_launch_two_frames_below_their_forward(monkeypatch, algorithm, device):
    """The ops' implementations reach the launch through one function, the table's entry (its launcher):
    ``_forward`` / ``_select`` -> the entry -> ``launch`` (the backward, which autograd calls, may take one more).
    With the registered op's fast path (public function -> the op's ``__call__`` -> its forward) that is the
    issue's five frames from the public function to the launch, at the action counts these algorithms serve (the
    chunked ones, for ``A >= 1024``, loop over chunks in a few more)."""
    import sys

    from icrl_kernels.contrastive import function, fused_kernels, small_kernels

    impls = {function._forward.__code__, function._select.__code__}
    depths = []
    for module in (fused_kernels, small_kernels):
        real = module.launch

        def spy(kernel, grid, real=real):
            frame, depth = sys._getframe(1), 1
            while frame is not None and frame.f_code not in impls:
                frame, depth = frame.f_back, depth + 1
            depths.append((frame.f_code.co_name if frame else None, depth))
            return real(kernel, grid)

        monkeypatch.setattr(module, "launch", spy)
    pred = torch.randn(2, 5, 16, device=device, requires_grad=True)
    embeds = torch.randn(7, 16, device=device)
    targets = torch.randint(0, 7, (2, 5), device=device)
    infonce_loss(pred, embeds, targets, backend="triton", algorithm=algorithm).backward()
    select_actions(pred.detach(), embeds, backend="triton", algorithm=algorithm)
    called = [(name, depth) for name, depth in depths if name is not None]  # (the backward's launches: None)
    assert {name for name, _ in called} == {"_forward", "_select"}, depths
    assert max(depth for _, depth in called) == 2, depths


def test_dispatch_by_number_of_actions():
    """The named thresholds pick the algorithms (their values are placeholders for the GPU sweep)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert infonce_algorithm(1, dtype) == infonce_algorithm(SMALL_MAX_ACTIONS, dtype) == SMALL
        assert infonce_algorithm(SMALL_MAX_ACTIONS + 1, dtype) == FUSED
        assert infonce_algorithm(ROW_CHUNKS_MIN_ACTIONS, dtype) == ROW_CHUNKS
        assert infonce_algorithm(HUGE_MIN_ACTIONS - 1, dtype) == ROW_CHUNKS
        assert infonce_algorithm(HUGE_MIN_ACTIONS, dtype) == infonce_algorithm(10**6, dtype) == HUGE_ALGORITHM
        assert select_algorithm(SELECT_CHUNKS_MIN_ACTIONS - 1, dtype) == FUSED
        assert select_algorithm(SELECT_CHUNKS_MIN_ACTIONS, dtype) == ROW_CHUNKS
        assert select_algorithm(10**6, dtype) == HUGE_ALGORITHM


@pytest.mark.parametrize("device", DEVICES)
def test_algorithm_argument(monkeypatch, device):
    """``algorithm=`` names the table's entry the call runs (``"small"`` asked of a selection runs the fused
    kernel, its one-kernel path); a name outside the table, ``"small"`` beyond one action tile, and any name but
    ``"auto"`` off the Triton backend are ValueErrors naming the argument."""
    launches = launch_spy(monkeypatch)
    pred = torch.randn(2, 5, 16, device=device)
    targets = torch.randint(0, 5, (2, 5), device=device)
    embeds = torch.randn(5, 16, device=device)
    for algorithm in INFONCE_ALGORITHMS:
        launches.clear()
        with forced(algorithm, 10, 5):
            infonce_loss(pred.requires_grad_(True), embeds, targets, backend="triton", algorithm=algorithm).backward()
        assert_ran(launches, algorithm)
        launches.clear()
        with forced(algorithm, 10, 5):
            select_actions(pred.detach(), embeds, mode="argmax", backend="triton", algorithm=algorithm)
        assert set(launches) == ({"select_chunk"} if algorithm in CHUNKED else {"select_actions"}), launches
    with pytest.raises(ValueError, match="algorithm must be one of"):
        infonce_loss(pred, embeds, targets, backend="triton", algorithm="tiled")
    with pytest.raises(ValueError, match="holds at most 128 actions"):
        infonce_loss(pred, torch.randn(129, 16, device=device), targets, backend="triton", algorithm=SMALL)
    with pytest.raises(ValueError, match="algorithm='fused' runs on the Triton backend"):
        select_actions(pred.cpu(), embeds.cpu(), backend="eager", algorithm=FUSED)


def test_fp32_keeps_the_kernels_when_tf32_matmuls_are_allowed():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert infonce_algorithm(4096, torch.float32) == FUSED and select_algorithm(4096, torch.float32) == FUSED
        assert infonce_algorithm(4096, torch.bfloat16) == ROW_CHUNKS
    finally:
        torch.set_float32_matmul_precision(previous)


def test_chunk_sizes_and_peak_memory_at_the_headline_shape():
    """Chunk arithmetic: a chunk holds at most ``CHUNK_BYTES`` of fp32 logits (whole 64-row GEMM tiles), and at
    N = 65536, D = 512, A = 4096 in bf16 (gradient for ``pred``) a call's predicted peak stays within the
    inputs, the gradient it returns and 64 MiB (the issue's memory target; the GPU run measures the real peak)."""
    rows, actions = chunk_shape(4096, ROW_CHUNKS)
    assert actions == 4096 and rows * actions * 4 <= CHUNK_BYTES and rows % 64 == 0 and rows == 2048
    rows, actions = chunk_shape(10**6, ACTION_CHUNKS)
    assert actions == ACTION_CHUNK and rows * actions * 4 <= CHUNK_BYTES and rows >= 1024
    assert chunk_shape(10**6, ROW_CHUNKS)[0] == 8  # why huge action sets take action chunks: 8-row GEMMs
    default = chunk_shape(7, ACTION_CHUNKS)
    with chunk_sizes(chunk_bytes=40, action_chunk=3):
        assert chunk_shape(7, ACTION_CHUNKS) == (3, 3) and chunk_shape(7, ROW_CHUNKS) == (1, 7)
    assert chunk_shape(7, ACTION_CHUNKS) == default  # restored on exit
    N, D, A, itemsize = 65536, 512, 4096, 2
    grad_bytes = N * D * itemsize
    for algorithm in INFONCE_ALGORITHMS:
        if algorithm == SMALL:
            continue
        peak = infonce_memory_bytes(algorithm, N, D, A, itemsize=itemsize)
        assert peak - grad_bytes <= 64 * 2**20, (algorithm, peak / 2**20)
    # The forward's gradient and the backward's scaled copy exist at once: one extra N D s, the 64 MiB.
    assert infonce_memory_bytes(ROW_CHUNKS, N, D, A, itemsize=itemsize) == 2 * grad_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", [SMALL, *CHUNKED])
def test_cuda_graph_replay_matches_eager(algorithm):
    """One forward + backward captured in a CUDA graph under the forced algorithm (default chunk sizes, so a
    few chunks at A = 4096) replays to the eager results."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(75)
    num_actions = 100 if algorithm == SMALL else 4096
    pred = torch.randn(4096, 256, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_(True)
    embeds = torch.randn(num_actions, 256, generator=gen, device=device, dtype=torch.bfloat16) / 16
    targets = torch.randint(0, num_actions, (4096,), generator=gen, device=device)

    def step():
        pred.grad = None
        infonce_loss(pred, embeds, targets, tau=0.7, algorithm=algorithm).backward()
        return select_actions(pred.detach(), embeds, mode="argmax", algorithm=algorithm)

    previous = set_value_checks("auto")
    try:
        with chunk_sizes(chunk_bytes=4 * 1024 * 4096):
            expected_actions = step()
            expected_grad = pred.grad.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                actions = step()
            graph.replay()
            torch.cuda.synchronize()
    finally:
        set_value_checks(previous)
    assert torch.equal(actions, expected_actions)
    assert_close_rel(pred.grad, expected_grad, rms_tol=RMS_TOLERANCE[torch.float32], name="replayed grad_pred")
