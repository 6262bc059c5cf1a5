"""Markov heads (the Markov-heads / GPT2-DTMA paper, Definition 4.1) and the MoA weight they receive.

**Definition 4.1.** A matrix ``A in R^{d x d}`` is a *Markov matrix* iff (i) every diagonal entry is
positive and (ii) ``mean_i |A_ii| / mean_{i != j} |A_ij| > r`` (the mean over the ``d`` diagonal
entries over the mean over the ``d^2 - d`` off-diagonal ones) for some large ``r``. **Definition 4.2.**
Head ``h`` is a *Markov head* iff ``M_h = W_q^h (W_k^h)^T`` is a Markov matrix, with ``W_q^h, W_k^h
[D, Dh]`` the head's query and key maps (``q = x W_q^h``), so ``M_h`` is the ``[D, D]`` bilinear form
of the head's attention scores, ``score(x_i, x_j) = x_i M_h x_j^T / sqrt(Dh)`` (biases aside). Under
random token embeddings such a head attends mostly to the current (last) token (Theorem 4.3).

**The threshold.** Remark 4.7 derives ``r > ln(d - 1) + 1`` from asking the softmax weight of the
diagonal to be at least 1/2; :func:`default_markov_threshold` returns exactly ``ln(d - 1) + 1``, and a
head passes when its ratio is strictly greater. Here ``d`` is the size of the matrix the definition
is applied to (``D``, the model width), as Definition 4.1 states it. The paper's own numbers are not
consistent on this: it says ``d = 64`` (GPT-2's head width) and uses ``r = 8``, while its matrices
``W_q W_k^T`` are ``768 x 768`` for GPT-2 small, where ``ln(767) + 1 = 7.64``, close to its 8. Pass
``r=8`` to reproduce the paper's choice.

**G_Markov** (Tables 5-6): the sum of the MoA weights of the Markov heads, :func:`g_markov`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from icrl_kernels import MoAAttention


def default_markov_threshold(d: int) -> float:
    """``r = ln(d - 1) + 1`` (Remark 4.7), for a ``d x d`` matrix, ``d >= 2``."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 2:
        raise ValueError(f"d must be an int >= 2, got {d!r}")
    return math.log(d - 1) + 1.0


def _check_square(matrix: torch.Tensor) -> torch.Tensor:
    if not isinstance(matrix, torch.Tensor):
        raise TypeError(f"M must be a torch.Tensor, got {type(matrix).__name__}")
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 2:
        raise ValueError(f"M must be a square [d, d] matrix with d >= 2, got shape {tuple(matrix.shape)}")
    if not matrix.dtype.is_floating_point:
        raise TypeError(f"M must be a float tensor, got {matrix.dtype}")
    return matrix.detach().double()


def markov_ratio(matrix: torch.Tensor) -> float:
    """``mean|diag(M)| / mean|offdiag(M)|`` of a ``[d, d]`` matrix (``inf`` when every off-diagonal entry is 0)."""
    m = _check_square(matrix)
    d = m.shape[0]
    absolute = m.abs()
    diagonal = absolute.diagonal()
    off_mean = (absolute.sum() - diagonal.sum()) / (d * d - d)
    diag_mean = diagonal.mean()
    if off_mean == 0:
        return math.inf if diag_mean > 0 else math.nan
    return float(diag_mean / off_mean)


def markov_conditions(matrix: torch.Tensor, r: float | None = None) -> tuple[bool, float, bool]:
    """``(diagonal all positive, ratio, ratio > r)`` for Definition 4.1 (``r`` defaults to ``ln(d-1)+1``)."""
    m = _check_square(matrix)
    r = default_markov_threshold(m.shape[0]) if r is None else float(r)
    ratio = markov_ratio(m)
    return bool((m.diagonal() > 0).all()), ratio, bool(ratio > r)


def is_markov_head(matrix: torch.Tensor, r: float | None = None) -> bool:
    """Whether ``M = W_q W_k^T`` (``[d, d]``) is a Markov matrix (Definition 4.1): all diagonal entries
    positive and ``mean|diag| / mean|offdiag| > r``, ``r`` by default ``ln(d - 1) + 1``."""
    positive, _, large = markov_conditions(matrix, r)
    return positive and large


# --- heads of a model --------------------------------------------------------------------------------


def qk_products(module: nn.Module) -> torch.Tensor:
    """``M_h = W_q^h (W_k^h)^T`` of every head of an attention module: ``[H, D, D]`` (fp32).

    Works for :class:`~icrl_kernels.MoAAttention` (through ``qk_weights()``) and any module with a fused
    ``qkv = nn.Linear(D, 3D)`` (layout ``[q | k | v]``, heads contiguous) and ``num_heads`` / ``n_heads``.
    For a rotary-embedding module (AD's attention) this is the form at relative offset 0 only.
    """
    if hasattr(module, "qk_weights"):
        w_q, w_k = module.qk_weights()
    elif isinstance(getattr(module, "qkv", None), nn.Linear):
        heads = getattr(module, "num_heads", None) or getattr(module, "n_heads", None)
        weight = module.qkv.weight.detach()
        d = weight.shape[1]
        if heads is None or weight.shape[0] != 3 * d or d % heads:
            raise TypeError(f"cannot read per-head query/key maps of {type(module).__name__}")
        w_q, w_k, _ = weight.view(3, heads, d // heads, d).transpose(-1, -2).unbind(0)
    else:
        raise TypeError(f"{type(module).__name__} has no per-head query/key maps")
    return (w_q.float() @ w_k.float().transpose(-1, -2)).detach()


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every :class:`~icrl_kernels.MoAAttention` of ``model`` (gated or not), in ``named_modules`` order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoAAttention)]


@dataclass
class MarkovReport:
    """Definition 4.1 applied to every head of every attention layer of a model.

    ``sites`` are the attention modules' names; ``ratio[s][h]``, ``diagonal_positive[s][h]`` and
    ``markov[s][h]`` the head's ``mean|diag| / mean|offdiag|``, condition (i), and both conditions;
    ``r`` the threshold used and ``d`` the matrix size.
    """

    sites: list[str]
    r: float
    d: int
    ratio: list[list[float]] = field(default_factory=list)
    diagonal_positive: list[list[bool]] = field(default_factory=list)
    markov: list[list[bool]] = field(default_factory=list)

    def mask(self, site: str | int) -> torch.Tensor:
        """``[H]`` bool: which heads of ``site`` (a name or an index into ``sites``) are Markov heads."""
        index = site if isinstance(site, int) else self.sites.index(site)
        return torch.tensor(self.markov[index], dtype=torch.bool)

    def heads(self) -> list[tuple[str, int]]:
        """``(site, head)`` of every Markov head."""
        return [(site, h) for site, flags in zip(self.sites, self.markov) for h, flag in enumerate(flags) if flag]

    def to_dict(self) -> dict:
        return {
            "sites": self.sites, "r": self.r, "d": self.d, "ratio": self.ratio,
            "diagonal_positive": self.diagonal_positive, "markov": self.markov, "markov_heads": self.heads(),
        }  # fmt: skip

    def table(self) -> str:
        """Markdown: one row per head, conditions (i) and (ii) and the ratio (the paper's Table 1)."""
        lines = [
            f"Markov heads (Definition 4.1, d = {self.d}, r = {self.r:.2f})",
            "",
            "| layer | head | (i) diag > 0 | ratio | (ii) ratio > r | Markov |",
            "|---|---|---|---|---|---|",
        ]
        for site, ratios, positive, markov in zip(self.sites, self.ratio, self.diagonal_positive, self.markov):
            for head, (value, pos, flag) in enumerate(zip(ratios, positive, markov)):
                mark = lambda ok: "yes" if ok else "no"
                lines.append(f"| {site} | {head} | {mark(pos)} | {value:.2f} | {mark(value > self.r)} | {mark(flag)} |")
        return "\n".join(lines)


def markov_heads(model: nn.Module, r: float | None = None) -> MarkovReport:
    """:class:`MarkovReport` of every head of every :class:`~icrl_kernels.MoAAttention` in ``model``
    (or of ``model`` itself when it is one). ``r`` defaults to ``ln(D - 1) + 1``, ``D`` the model width."""
    sites = [("", model)] if isinstance(model, MoAAttention) else attention_modules(model)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no MoAAttention layer")
    products = [(name, qk_products(module)) for name, module in sites]
    d = int(products[0][1].shape[-1])
    threshold = default_markov_threshold(d) if r is None else float(r)
    report = MarkovReport(sites=[name for name, _ in products], r=threshold, d=d)
    for _, matrices in products:
        conditions = [markov_conditions(m, threshold) for m in matrices]
        report.diagonal_positive.append([c[0] for c in conditions])
        report.ratio.append([c[1] for c in conditions])
        report.markov.append([c[0] and c[2] for c in conditions])
    return report


def g_markov(gate_weights: torch.Tensor, markov_mask: torch.Tensor) -> torch.Tensor:
    """``G_Markov``: the summed MoA weight of the Markov heads (Tables 5-6 of the paper).

    Args:
        gate_weights: ``[..., H]`` MoA weights (per token, or already averaged over tokens).
        markov_mask: ``[H]`` bool, True for Markov heads.

    Returns:
        ``[...]``: the sum of ``gate_weights`` over the Markov heads (0 when there are none).
    """
    if not isinstance(gate_weights, torch.Tensor) or not isinstance(markov_mask, torch.Tensor):
        raise TypeError("gate_weights and markov_mask must be tensors")
    if markov_mask.dtype != torch.bool or markov_mask.dim() != 1:
        raise ValueError(f"markov_mask must be a 1-D bool tensor, got {markov_mask.dtype} {tuple(markov_mask.shape)}")
    if gate_weights.dim() < 1 or gate_weights.shape[-1] != markov_mask.shape[0]:
        raise ValueError(
            f"gate_weights must end in H = {markov_mask.shape[0]} heads, got shape {tuple(gate_weights.shape)}"
        )
    return (gate_weights * markov_mask.to(device=gate_weights.device, dtype=gate_weights.dtype)).sum(dim=-1)


__all__ = [
    "MarkovReport",
    "attention_modules",
    "default_markov_threshold",
    "g_markov",
    "is_markov_head",
    "markov_conditions",
    "markov_heads",
    "markov_ratio",
    "qk_products",
]
