"""Induction-head analysis: attention-pattern capture, per-head scores, OV copying, ICL score, ablation.

Conventions follow TransformerLens so that numbers are comparable (docs/models.md#analysis-metrics):

* **Repeated random tokens.** A random sequence of ``seq_len`` tokens repeated (``[t_0..t_{T-1},
  t_0..t_{T-1}]``, no BOS). Per head, the *previous-token* score is the mean attention on offset 1
  (key ``i - 1``), the *duplicate-token* score on offset ``seq_len`` (the same token one repeat
  earlier) and the *induction* (prefix-matching) score on offset ``seq_len - 1`` (the token that
  followed the earlier occurrence). :func:`repeat_scores` averages over the queries of every repeat
  after the first (the second repeat, for two copies) and over the batch. TransformerLens' tutorials
  average the whole stripe instead (``pattern.diagonal(-offset).mean()``), which also counts
  first-repeat queries: ``convention="diagonal"`` reproduces that (the duplicate score is the same
  either way; the induction stripe gains query ``seq_len - 1``; the previous-token stripe covers the
  whole sequence).
* **Token-matching scores** on arbitrary sequences (TransformerLens' ``detect_head`` with
  ``error_measure="mul"``): the fraction of all attention that lands on the detection pattern's keys
  (:func:`detection_patterns`, :func:`detection_score`). On repeated random tokens with no repeats
  inside one copy, those keys are exactly the offsets above, but every first-repeat query counts in
  the denominator, so the score is about half of :func:`repeat_scores`'.
* **Copying score** of a head: ``sum(eig).real / sum(|eig|)`` over the eigenvalues of its full OV
  circuit ``W_U W_O^h W_V^h W_E`` (column-vector convention; TransformerLens writes the transpose
  ``W_E W_V W_O W_U``, which has the same eigenvalues). +1: the head copies the attended token to the
  output; -1: it suppresses it. Biases and normalisation layers are left out, as in TransformerLens.
* **In-context learning score**: loss at a late token minus loss at an early token (negative when
  later tokens are predicted better thanks to the context).
* **Head importance**: the change of a metric (e.g. a loss) when one head's output is zeroed before
  the output projection.

Attention patterns come from forward hooks that *recompute* them on a reference path from the
module's own inputs (same projections, explicit softmax), so they work whatever fused kernel the
forward ran (SDPA, FlashAttention, Triton n-gram attention) and do not change the forward's output.
Supported modules: :class:`~icrl_kernels.modules.smeared_attention.SmearedKeyAttention`, AD's
:class:`~icrl_models.models.ad.CausalSelfAttention` (RoPE, optional sliding window) and
:class:`~icrl_kernels.NGramAttention` (one "head": its row-normalised n-gram match pattern).
Patterns are ``[B, H, L, L]`` (batch, head, query, key), fp32.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from icrl_kernels import NGramAttention, SmearedKeyAttention, ngram_match_matrix
from icrl_kernels.validation import check_device

from ..models.ad import CausalSelfAttention

REPEAT_SCORE_NAMES = ("previous_token", "duplicate_token", "induction")
CONVENTIONS = ("second_repeat", "diagonal")


# --- inputs ----------------------------------------------------------------------------------------


def repeated_random_tokens(
    batch: int,
    seq_len: int,
    vocab_size: int,
    *,
    repeats: int = 2,
    distinct: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random token sequences of ``seq_len`` repeated ``repeats`` times, no BOS: ``[batch, repeats * seq_len]`` int64.

    ``distinct=True`` draws each sequence without replacement (needs ``vocab_size >= seq_len``), so that
    every query in a later repeat has exactly one duplicate and one induction target, as with
    TransformerLens' 50k-token vocabulary; ``False`` draws uniformly with replacement.
    """
    if distinct:
        if vocab_size < seq_len:
            raise ValueError(f"distinct tokens need vocab_size >= seq_len, got {vocab_size} < {seq_len}")
        noise = torch.rand(batch, vocab_size, generator=generator)
        sequence = noise.argsort(dim=1)[:, :seq_len]
    else:
        sequence = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
    return sequence.repeat(1, repeats)


# --- scores of attention patterns -----------------------------------------------------------------


def uniform_causal_pattern(batch: int, length: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """``[batch, 1, L, L]``: each query attends evenly to itself and every earlier key (a baseline for any score)."""
    device = check_device(device) if device is not None else None
    causal = torch.ones(length, length, device=device).tril()
    return (causal / causal.sum(dim=-1, keepdim=True)).expand(batch, 1, length, length)


def _check_pattern(pattern: torch.Tensor) -> None:
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must be [B, H, L, L], got shape {tuple(pattern.shape)}")


def offset_score(pattern: torch.Tensor, offset: int, *, first_query: int = 0) -> torch.Tensor:
    """Mean attention from query ``i`` to key ``i - offset``, over the batch and queries ``i >= first_query``.

    Args:
        pattern: ``[B, H, L, L]`` attention weights.
        offset: key offset, ``>= 0`` (0 is the current token).
        first_query: the first query position that counts (queries before ``offset`` have no such key).

    Returns:
        ``[H]`` fp32 scores in ``[0, 1]``.
    """
    _check_pattern(pattern)
    length = pattern.shape[-1]
    start = max(first_query, offset)
    if offset < 0 or start >= length:
        raise ValueError(f"no query has a key at offset {offset} from position {first_query} in length {length}")
    queries = torch.arange(start, length, device=pattern.device)
    return pattern[..., queries, queries - offset].float().mean(dim=(0, 2))


def repeat_scores(pattern: torch.Tensor, seq_len: int, *, convention: str = "second_repeat") -> dict[str, torch.Tensor]:
    """Previous-token, duplicate-token and induction scores ``[H]`` of a pattern over repeated tokens.

    Args:
        pattern: ``[B, H, L, L]`` attention on sequences made of one random sequence of ``seq_len``
            tokens repeated (``L >= 2 * seq_len``; usually ``L = 2 * seq_len``), no BOS.
        seq_len: length of the repeated sequence.
        convention: ``"second_repeat"`` averages over queries ``i >= seq_len`` (those with a duplicate
            and an induction target); ``"diagonal"`` averages each whole stripe, as TransformerLens'
            ``pattern.diagonal(-offset).mean()`` does (see the module docstring).

    Returns:
        ``{"previous_token": [H], "duplicate_token": [H], "induction": [H]}``.
    """
    _check_pattern(pattern)
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if seq_len < 2 or pattern.shape[-1] < 2 * seq_len:
        raise ValueError(f"need seq_len >= 2 and L >= 2 * seq_len, got seq_len={seq_len}, L={pattern.shape[-1]}")
    first_query = seq_len if convention == "second_repeat" else 0
    offsets = dict(zip(REPEAT_SCORE_NAMES, (1, seq_len, seq_len - 1)))
    return {name: offset_score(pattern, offset, first_query=first_query) for name, offset in offsets.items()}


def detection_patterns(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """TransformerLens' detection patterns of token ids ``[B, L]`` as bool ``[B, L, L]`` (query, key).

    * ``previous_token``: key ``i - 1``;
    * ``duplicate_token``: keys ``j < i`` holding the query's token;
    * ``induction``: keys ``1 <= j <= i`` whose *previous* token is the query's token.

    Negative ids are padding and match nothing.
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, L], got shape {tuple(ids.shape)}")
    length = ids.shape[1]
    position = torch.arange(length, device=ids.device)
    query, key = position[:, None], position[None, :]
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    # same_as_previous[b, i, j] = ids[b, i] == ids[b, j - 1]; key 0 has no previous token.
    same_as_previous = torch.zeros_like(same)
    same_as_previous[:, :, 1:] = same[:, :, :-1]
    return {
        "previous_token": (key == query - 1).expand_as(same).clone(),
        "duplicate_token": same & (key < query),
        "induction": same_as_previous & (key <= query),
    }


def detection_score(pattern: torch.Tensor, detection: torch.Tensor) -> torch.Tensor:
    """Fraction of attention on ``detection``'s keys (TransformerLens ``error_measure="mul"``), ``[H]``.

    Args:
        pattern: ``[B, H, L, L]`` attention weights.
        detection: ``[B, L, L]`` or ``[L, L]`` 0/1 (bool) pattern of the keys each query should attend to.

    Returns:
        ``sum(pattern * detection) / sum(pattern)`` per sequence and head, averaged over the batch.
    """
    _check_pattern(pattern)
    detection = detection.to(pattern.dtype)
    if detection.dim() == 2:
        detection = detection.unsqueeze(0)
    hits = (pattern * detection.unsqueeze(1)).sum(dim=(-1, -2))
    return (hits / pattern.sum(dim=(-1, -2))).float().mean(dim=0)


def in_context_learning_score(token_losses: torch.Tensor, *, early: int, late: int) -> float:
    """Mean loss at position ``late`` minus mean loss at position ``early`` (``token_losses [B, L]``).

    Negative when the model predicts later tokens better thanks to the context (Olsson et al. use the
    500th and the 50th token of natural text).
    """
    if token_losses.dim() != 2:
        raise ValueError(f"token_losses must be [B, L], got shape {tuple(token_losses.shape)}")
    length = token_losses.shape[1]
    if not 0 <= early < length or not 0 <= late < length:
        raise ValueError(f"early and late must be positions in [0, {length}), got {early} and {late}")
    return (token_losses[:, late].float().mean() - token_losses[:, early].float().mean()).item()


def ov_copying_score(embed: torch.Tensor, value: torch.Tensor, output: torch.Tensor, unembed: torch.Tensor) -> float:
    """Copying score ``sum(eig).real / sum(|eig|)`` of the full OV circuit ``unembed @ output @ value @ embed``.

    Args:
        embed: ``W_E [D, V]`` (one column per input token).
        value: ``W_V^h [Dh, D]``.
        output: ``W_O^h [D, Dh]``.
        unembed: ``W_U [V, D]`` (one row per output token).

    The ``[V, V]`` circuit has rank at most ``Dh``; its nonzero eigenvalues are those of the
    ``[Dh, Dh]`` product ``value @ embed @ unembed @ output`` (``AB`` and ``BA`` share them), which is
    what is decomposed here, in fp64.
    """
    if embed.shape[1] != unembed.shape[0]:
        raise ValueError(f"embed has {embed.shape[1]} tokens, unembed {unembed.shape[0]}: the circuit must be square")
    small = value.double() @ embed.double() @ unembed.double() @ output.double()
    eigenvalues = torch.linalg.eigvals(small)
    total = eigenvalues.abs().sum().item()
    return eigenvalues.sum().real.item() / total if total > 0 else 0.0


def head_ov_weights(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(W_V^h [Dh, D], W_O^h [D, Dh])`` of every head of a softmax-attention module.

    Both supported modules project with ``qkv = nn.Linear(D, 3 D)`` laid out as ``(q|k|v, head, Dh)``
    and merge heads with ``out = nn.Linear(D, D)`` whose input concatenates the heads in order.
    """
    if not isinstance(module, (SmearedKeyAttention, CausalSelfAttention)):
        raise TypeError(f"module must be SmearedKeyAttention or CausalSelfAttention, got {type(module).__name__}")
    heads, head_dim = module.num_heads, module.head_dim
    d_model = heads * head_dim
    values = module.qkv.weight.detach()[2 * d_model :].view(heads, head_dim, d_model)
    outputs = module.out.weight.detach().view(d_model, heads, head_dim)
    return [(values[h], outputs[:, h]) for h in range(heads)]


# --- where the attention is: sites, pattern capture, ablation ---------------------------------------


@dataclass(frozen=True)
class AttentionSite:
    """An attention module of a model: its dotted name, the module, its head count and head-output map.

    ``head_output`` is the linear map whose input is the heads' outputs concatenated (head ``h`` at
    features ``[h * w, (h + 1) * w)``, ``w = in_features / num_heads``): zeroing a slice of its input
    removes exactly one head's contribution.
    """

    name: str
    module: nn.Module
    num_heads: int
    head_output: nn.Linear


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every supported attention module of ``model``, in ``named_modules`` (forward) order."""
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, (SmearedKeyAttention, CausalSelfAttention)):
            sites.append(AttentionSite(name, module, module.num_heads, module.out))
        elif isinstance(module, NGramAttention):
            sites.append(AttentionSite(name, module, 1, module.attn_proj))
    return sites


def causal_self_attention_pattern(
    module: CausalSelfAttention, x: torch.Tensor, positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """AD attention weights ``[B, H, L, L]`` recomputed from the block's input (RoPE, causal or banded mask).

    Matches ``CausalSelfAttention.forward`` without attention dropout (analysis runs in eval mode).
    """
    q, k, _ = module._project(x, positions)  # the module's own projection and rotation
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(module.head_dim)
    offsets = torch.arange(x.shape[1], device=x.device)
    distance = offsets[:, None] - offsets[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def ngram_attention_pattern(ids: torch.Tensor, n: int) -> torch.Tensor:
    """The row-normalised n-gram match pattern as ``[B, 1, L, L]`` (rows without a match are zero)."""
    match = ngram_match_matrix(ids.long(), n).float()
    return (match / match.sum(dim=-1, keepdim=True).clamp(min=1)).unsqueeze(1)


def _recompute_pattern(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    inputs = bound.arguments
    if isinstance(module, SmearedKeyAttention):
        return module.attention_pattern(inputs["x"])
    if isinstance(module, CausalSelfAttention):
        return causal_self_attention_pattern(module, inputs["x"], inputs["positions"], inputs["window"])
    if isinstance(module, NGramAttention):
        return ngram_attention_pattern(inputs["ids"], module.n)
    raise TypeError(f"no pattern recomputation for {type(module).__name__}")


@contextlib.contextmanager
def capture_attention(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, every forward of ``model`` records each attention site's pattern.

    Yields a dict ``site name -> [B, H, L, L]`` (fp32, detached; the latest forward wins). The
    patterns are recomputed on a reference path beside the real forward, whose output is unchanged.
    Example::

        with capture_attention(model) as patterns:
            model(tokens)
        scores = repeat_scores(patterns["layers.0"], seq_len)
    """
    patterns: dict[str, torch.Tensor] = {}
    handles = []
    for site in attention_sites(model):

        def hook(module, args, kwargs, output, name=site.name):
            with torch.no_grad():
                patterns[name] = _recompute_pattern(module, args, kwargs).detach().float()

        handles.append(site.module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield patterns
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def ablate_heads(model: nn.Module, heads: Mapping[str, Iterable[int]]) -> Iterator[None]:
    """Within the block, zero the outputs of the given heads (``site name -> head indices``) of ``model``.

    A head is removed by zeroing its slice of the input of the site's output projection, so the
    projection's bias (if any) and every other head are untouched; works for full forwards and for
    incremental decoding alike.
    """
    sites = {site.name: site for site in attention_sites(model)}
    handles = []
    try:
        for name, head_indices in heads.items():
            if name not in sites:
                raise ValueError(f"no attention site named {name!r}; sites: {sorted(sites)}")
            site = sites[name]
            width = site.head_output.in_features // site.num_heads
            keep = torch.ones(site.head_output.in_features)
            for head in head_indices:
                if not 0 <= head < site.num_heads:
                    raise ValueError(f"head {head} out of range for {name!r} with {site.num_heads} heads")
                keep[head * width : (head + 1) * width] = 0

            def pre_hook(linear, args, keep=keep):
                return (args[0] * keep.to(device=args[0].device, dtype=args[0].dtype), *args[1:])

            handles.append(site.head_output.register_forward_pre_hook(pre_hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def head_ablation_importance(model: nn.Module, metric: Callable[[], float]) -> dict[str, list[float]]:
    """``metric()`` with one head zeroed minus ``metric()`` intact, for every head of every site.

    ``metric`` runs the model itself (e.g. the loss on a fixed batch, under ``torch.no_grad``); a
    positive value for a loss means the head helps.
    """
    baseline = metric()
    importance = {}
    for site in attention_sites(model):
        changes = []
        for head in range(site.num_heads):
            with ablate_heads(model, {site.name: [head]}):
                changes.append(metric() - baseline)
        importance[site.name] = changes
    return importance


def scores_by_site(
    patterns: Mapping[str, torch.Tensor], score: Callable[[torch.Tensor], Mapping[str, torch.Tensor]]
) -> dict[str, dict[str, list[float]]]:
    """Apply ``score(pattern) -> {name: [H]}`` to every captured pattern; JSON-ready nested lists."""
    return {site: {name: values.tolist() for name, values in score(p).items()} for site, p in patterns.items()}
