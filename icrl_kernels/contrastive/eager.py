"""The ``eager`` algorithm of InfoNCE and action selection (``algorithms.EAGER``, what ``backend="eager"`` runs):
the kernels' algorithm in PyTorch, in row chunks.

``infonce_forward``, ``infonce_backward`` and ``select`` are its entry of ``algorithms.ALGORITHMS``; they view
their inputs in the canonical layout (``algorithms.canonical_views``: ``pred [B, T, D]``, ``embeds [1 or B, A,
D]``, ``targets [B, T]``; ``mask [1 or B, 1 or T, A_pad]`` uint8 with ``A_pad >= A``, or ``None``). Logits
exist only one chunk of rows at a time (at most :data:`CHUNK_ELEMENTS` of them), so memory stays
O(N D + chunk A) even for a million actions; the backward recomputes each chunk's logits from the saved
log-sum-exp instead of keeping them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .algorithms import canonical_views, count_rows, reduce_losses
from .checks import ROW_NAN_LOGIT, ROW_NO_ACTION, check_rows_have_actions, check_target_values

#: Largest logits chunk (elements) the eager path materialises at once: 128 MB of fp32. Larger chunks
#: read the map fewer times (each chunk multiplies its rows by the whole map): at a million actions,
#: 2^22 meant 4-row chunks and a run 2.4x slower than the dense reference on a 2-core CPU.
CHUNK_ELEMENTS = 1 << 25


def _chunks(pred: torch.Tensor, num_actions: int) -> Iterator[tuple[slice, slice]]:
    """``(sequences, steps)`` slices covering ``[B, T]`` with at most ``CHUNK_ELEMENTS`` logits each."""
    batch, steps = pred.shape[:2]
    rows = max(1, CHUNK_ELEMENTS // max(1, num_actions))
    if rows >= steps:
        per_chunk = max(1, rows // steps)
        for b in range(0, batch, per_chunk):
            yield slice(b, b + per_chunk), slice(0, steps)
    else:
        for b in range(batch):
            for t in range(0, steps, rows):
                yield slice(b, b + 1), slice(t, t + rows)


def _chunk_logits(pred, embeds, mask, tau, seqs: slice, steps: slice) -> torch.Tensor:
    """fp32 logits ``[b, t, A]`` of one chunk, ``-inf`` on unavailable actions."""
    chunk_embeds = embeds if embeds.shape[0] == 1 else embeds[seqs]
    logits = torch.matmul(pred[seqs, steps].float(), chunk_embeds.float().transpose(1, 2)) / tau
    if mask is not None:
        chunk_mask = mask if mask.shape[0] == 1 else mask[seqs]
        chunk_mask = (chunk_mask if chunk_mask.shape[1] == 1 else chunk_mask[:, steps])[..., : logits.shape[-1]]
        logits = logits.masked_fill(chunk_mask == 0, float("-inf"))
    return logits


def infonce_forward(
    pred, embeds, targets, mask, tau: float, ignore_index: int, reduction: str, runs: int, want_pred, want_embeds
):  # fmt: skip
    """The entry's forward (``algorithms.Algorithm``): the reduced loss and each row's float32 log-sum-exp,
    after the value checks (torch ops of their own: ``status`` is None); the gradients are the backward's."""
    pred3, embeds3, targets2 = canonical_views(pred, embeds, targets)
    check_rows_have_actions(mask)
    check_target_values(targets2, mask, embeds.shape[-2], ignore_index)
    losses, lse = _forward(pred3, embeds3, targets2, mask, tau, ignore_index)
    count = count_rows(targets, ignore_index, runs) if reduction == "mean" else None
    return reduce_losses(losses.view(targets.shape), reduction, runs, count), lse.view(targets.shape), None, None, None


def infonce_backward(
    weights, pred, embeds, targets, mask, lse, tau: float, ignore_index: int, want_pred: bool, want_embeds: bool
):  # fmt: skip
    """The entry's backward: ``(grad_pred, grad_embeds)`` in the inputs' shapes and dtype (None where not
    wanted), recomputing each chunk's logits from the forward's log-sum-exps."""
    pred3, embeds3, targets2, weights2, lse2 = canonical_views(pred, embeds, targets, weights, lse)
    grad_pred, grad_embeds = _backward(weights2, pred3, embeds3, targets2, mask, lse2, tau, want_embeds=want_embeds)
    return grad_pred.view(pred.shape) if want_pred else None, grad_embeds.view(embeds.shape) if want_embeds else None


def select(pred, embeds, mask, tau: float, sample: bool, seed: torch.Tensor, seed_rows: int):
    """The entry's selection: ``(actions, status)`` of ``pred.shape[:-1]`` (:func:`select_actions_eager`)."""
    pred3, embeds3 = canonical_views(pred, embeds)
    actions, status = select_actions_eager(pred3, embeds3, mask, tau, sample, seed, seed_rows)
    return actions.view(pred.shape[:-1]), status.view(pred.shape[:-1])


def _forward(pred, embeds, targets, mask, tau: float, ignore_index: int):
    """Per-row losses and log-sum-exps, both ``[B, T]`` float32."""
    losses = torch.empty(targets.shape, dtype=torch.float32, device=pred.device)
    lse = torch.empty_like(losses)
    for seqs, steps in _chunks(pred, embeds.shape[1]):
        logits = _chunk_logits(pred, embeds, mask, tau, seqs, steps)
        chunk_targets = targets[seqs, steps]
        ignored = chunk_targets == ignore_index
        # ignore_index may be any int (even >= A): clamp so ignored rows index something, then drop them.
        picked = logits.gather(-1, chunk_targets.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0]
        chunk_lse = torch.logsumexp(logits, dim=-1)
        lse[seqs, steps] = chunk_lse
        losses[seqs, steps] = torch.where(ignored, 0.0, chunk_lse - picked)
    return losses, lse


def _backward(row_weights, pred, embeds, targets, mask, lse, tau: float, *, want_embeds: bool = True):
    """Gradients for ``pred`` and ``embeds`` given each row's loss gradient ``row_weights [B, T]``
    (zero on ignored rows); ``want_embeds=False`` returns an empty tensor for ``embeds``."""
    grad_pred = torch.empty(pred.shape, dtype=torch.float32, device=pred.device)
    grad_embeds = torch.zeros(embeds.shape if want_embeds else (0,), dtype=torch.float32, device=pred.device)
    for seqs, steps in _chunks(pred, embeds.shape[1]):
        logits = _chunk_logits(pred, embeds, mask, tau, seqs, steps)
        probs = torch.exp(logits - lse[seqs, steps, None])
        # d loss / d logits = softmax - one_hot(target), scaled by the row's gradient and 1 / tau. Ignored
        # rows have weight 0, so their (clamped, meaningless) one-hot does not matter.
        grad_logits = probs
        index = targets[seqs, steps].clamp(0, logits.shape[-1] - 1)[..., None]
        grad_logits.scatter_add_(-1, index, torch.full(index.shape, -1.0, device=index.device))
        grad_logits *= (row_weights[seqs, steps] / tau)[..., None]
        chunk_embeds = embeds if embeds.shape[0] == 1 else embeds[seqs]
        grad_pred[seqs, steps] = torch.matmul(grad_logits, chunk_embeds.float())
        if not want_embeds:
            continue
        contribution = torch.matmul(grad_logits.transpose(1, 2), pred[seqs, steps].float())
        if embeds.shape[0] == 1:
            grad_embeds += contribution.sum(0, keepdim=True)
        else:
            grad_embeds[seqs] += contribution
    return grad_pred.to(pred.dtype), grad_embeds.to(embeds.dtype)


def select_actions_eager(
    pred, embeds, mask, tau: float, sample: bool, seed: torch.Tensor, seed_rows: int | None = None
):
    """``([B, T] int64 actions, [B, T] int8 status)``: per row the lowest available action of highest
    ``logit`` (+ Gumbel noise when sampling: flat row ``r`` draws from the device seed ``seed[r // seed_rows]``
    at counter ``(r % seed_rows) * A + action``; ``seed_rows=None``: every row from ``seed[0]``, counting from
    its flat row), and the row's status as the
    Triton kernel writes it (``checks.ROW_NO_ACTION``: the mask leaves no action, the id is then
    ``A``; ``checks.ROW_NAN_LOGIT``: an available action's logit is NaN; 0 otherwise).

    Never a masked action, whatever the values: NaN scores rank lowest, and a row whose available
    scores are all -inf or NaN gets its first available action. No host read anywhere.
    """
    batch, steps = pred.shape[:2]
    num_actions = embeds.shape[1]
    actions = torch.empty((batch, steps), dtype=torch.int64, device=pred.device)
    status = torch.empty((batch, steps), dtype=torch.int8, device=pred.device)
    for seqs, step_slice in _chunks(pred, num_actions):
        logits = _chunk_logits(pred, embeds, mask, tau, seqs, step_slice)  # -inf on unavailable actions
        if sample:
            rows = (
                torch.arange(batch, device=pred.device)[seqs, None] * steps
                + torch.arange(steps, device=pred.device)[None, step_slice]
            )
            run_seed = seed if seed_rows is None else seed[rows // seed_rows][..., None]
            local = rows if seed_rows is None else rows % seed_rows
            counter = local[..., None] * num_actions + torch.arange(num_actions, device=pred.device)
            logits = logits + _hashed_gumbel(run_seed, counter)
        # NaN only where the action is available (_chunk_logits filled the others with -inf).
        is_nan = logits.isnan()
        row_status = is_nan.any(dim=-1).to(torch.int8) * ROW_NAN_LOGIT
        # torch.argmax takes the lowest id among equal maxima; NaN would rank highest, so it ranks lowest.
        pick = logits.masked_fill(is_nan, float("-inf")).argmax(dim=-1)
        if mask is not None:
            # From the mask, not from the logits: a real logit may be -inf too (overflow at a tiny tau).
            chunk_mask = mask if mask.shape[0] == 1 else mask[seqs]
            chunk_mask = (chunk_mask if chunk_mask.shape[1] == 1 else chunk_mask[:, step_slice])[..., :num_actions]
            available = chunk_mask.expand(logits.shape) != 0
            any_available = available.any(dim=-1)
            row_status = torch.where(any_available, row_status, ROW_NO_ACTION)
            # Where every available score is -inf or NaN, argmax's -inf tie may be an unavailable action:
            # take the first available one instead (the mask's first nonzero), or A where there is none.
            first_available = torch.where(any_available, available.to(torch.uint8).argmax(dim=-1), num_actions)
            stuck = ~(available & (logits > float("-inf"))).any(dim=-1)
            pick = torch.where(stuck, first_available, pick)
        status[seqs, step_slice] = row_status
        actions[seqs, step_slice] = pick
    return actions, status


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)`` and a 32-bit constant, without int64 overflow
    (16-bit halves: each product stays below 2^48)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (an avalanching bijection of ``[0, 2^32)``), in int64 arithmetic."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _hashed_gumbel(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """fp32 standard Gumbel noise, a pure function of ``(seed, counter)`` computed on the device.

    ``seed``: int64 ``[1]`` in ``[0, 2^62)``; ``counter``: int64 ``row * A + action``. Two 32-bit hashes
    chained over the seed's and the counter's 32-bit halves give 64 random bits per draw, of which 52
    make ``u = (k + 1/2) / 2^52`` uniform in (0, 1) (exact in float64), so ``-log(-log(u))`` stays finite.
    """
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _fmix32(seed_lo ^ _fmix32(seed_hi ^ 0x9E3779B9))
    count_lo, count_hi = counter & _MASK32, (counter >> 32) & _MASK32
    first = _fmix32(count_lo ^ _fmix32(count_hi ^ key))
    second = _fmix32(first ^ _fmix32(key ^ 0x7F4A7C15))
    bits = (first << 20) | (second >> 12)  # 52 bits: first's 32 and second's top 20
    uniform = (bits.double() + 0.5) / 2.0**52
    return (-torch.log(-torch.log(uniform))).float()


def gumbel_noise(shape, *, generator=None, device=None) -> torch.Tensor:
    """Standard Gumbel samples ``-log(-log(u))``, ``u ~ U(0, 1)`` kept away from 0 and 1, on ``device``;
    drawn on the generator's device (a CPU generator serves a CUDA ``device`` too)."""
    draw_device = generator.device if generator is not None else device
    uniform = torch.rand(shape, generator=generator, device=draw_device).to(device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))
