"""``SmearedKeyAttention``: causal multi-head self-attention with optional smeared keys (induction-heads lecture)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._backend import BACKENDS
from .._validation import (
    check_bool,
    check_choice,
    check_features,
    check_finite_float,
    check_int,
    check_matches_params,
)
from ..smeared import smeared_keys, smeared_keys_reference
from .moa_attention import ATTENTION_IMPLEMENTATIONS


class SmearedKeyAttention(nn.Module):
    """Causal self-attention with optional smeared keys ``k'_j = s_h k_j + (1 - s_h) k_{j-1}``, ``s_h = sigmoid(a_h)``.

    ``forward(x) = W_O concat_h softmax(q_h k'_h^T / sqrt(Dh) + causal) v_h`` with ``q, k, v = W_QKV x``.
    No positional encoding inside: positions come from the model (e.g. learned position embeddings
    added to the residual stream), as in the lecture's attention-only transformers.

    **Attention implementation** (``attention=``): with ``"sdpa"`` (the default) smearing is its own
    kernel (:func:`icrl_kernels.smeared_keys`) before PyTorch's fused SDPA, one extra elementwise pass
    over ``K``; with ``"fused"`` it is one call to :func:`icrl_kernels.gated_attention` with
    ``smear_alpha``, which smears the key tiles as it loads them (our own causal flash-attention
    kernel instead of SDPA's). SDPA is the default: measured on an H200 (B=16, H=12, L=1024, Dh=64,
    bf16, forward + backward, gated and smeared), the separate passes took 1.04 ms against the fused
    kernel's 1.33 ms (benchmarks/results/README.md, "GPU"); the choice is this one documented argument.

    Attention weights are never materialised by SDPA; :meth:`attention_pattern` recomputes them on the
    reference path (same projections, reference smearing, explicit softmax) for analysis, and
    ``forward(x, need_weights=True)`` returns them alongside the output.

    Args:
        d_model: residual width ``D``.
        num_heads: heads ``H``; ``D`` must split into ``H`` heads of ``Dh = D / H``.
        smear: learn one smearing logit per head (``smear_logit``, ``[H]``); without it, plain attention.
        smear_init: initial logit; 0 starts every head at an even blend of the current and previous key.
        bias: whether the QKV and output projections have biases.
        backend: kernel backend of :func:`~icrl_kernels.smeared_keys` / :func:`~icrl_kernels.gated_attention`
            (``"auto"``, ``"triton"``, ``"eager"``, ``"reference"``).
        attention: ``"sdpa"`` (default) or ``"fused"``, see above.

    Shapes:
        ``x [B, L, D]`` -> ``[B, L, D]``; patterns are ``[B, H, L, L]`` (query, key), fp32.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        smear: bool = True,
        smear_init: float = 0.0,
        bias: bool = False,
        backend: str = "auto",
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        self.d_model = check_int(d_model, "d_model", min_value=1)
        self.num_heads = check_int(num_heads, "num_heads", min_value=1)
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.head_dim = d_model // num_heads
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.attention = check_choice(attention, "attention", ATTENTION_IMPLEMENTATIONS)
        smear, bias = check_bool(smear, "smear"), check_bool(bias, "bias")
        smear_init = check_finite_float(smear_init, "smear_init")
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)  # input: heads concatenated, head h at [h*Dh, (h+1)*Dh)
        self.smear_logit = nn.Parameter(torch.full((num_heads,), float(smear_init))) if smear else None

    @property
    def smear(self) -> bool:
        return self.smear_logit is not None

    def smear_weight(self) -> torch.Tensor | None:
        """``sigmoid(alpha)`` per head ``[H]`` (the weight of the current key), ``None`` without smearing."""
        return None if self.smear_logit is None else torch.sigmoid(self.smear_logit.detach())

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, L, D]`` -> unsmeared ``q, k, v``, each ``[B, H, L, Dh]`` (strided views of one projection)."""
        self._check_input(x)
        qkv = rearrange(self.qkv(x), "b l (three h e) -> three b h l e", three=3, h=self.num_heads)
        return qkv.unbind(0)

    def _check_input(self, x: torch.Tensor) -> None:
        check_features(x, "x", self.d_model)
        check_matches_params(x, "x", self.qkv.weight)

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """Per-head outputs ``[B, H, L, Dh]`` -> ``W_O`` of their concatenation, ``[B, L, D]``."""
        return self.out(rearrange(y, "b h l e -> b l (h e)"))

    def forward(
        self, x: torch.Tensor, *, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of ``x [B, L, D]`` -> ``[B, L, D]``; with ``need_weights`` also the pattern
        ``[B, H, L, L]`` (:meth:`attention_pattern`).

        Raises ``ValueError`` (``x`` not ``[B, L, d_model]``) or ``TypeError`` (not a float tensor, or a
        dtype other than the parameters' outside autocast), naming ``x``."""
        q, k, v = self.project(x)
        if self.attention == "fused":
            from ..attention import gated_attention  # imported here: the module loads without it

            out = self.out(gated_attention(q, k, v, smear_alpha=self.smear_logit, backend=self.backend))
        else:
            if self.smear_logit is not None:
                k = smeared_keys(k, self.smear_logit, backend=self.backend)
            out = self.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        if need_weights:
            return out, self.attention_pattern(x)
        return out

    def attention_pattern(self, x: torch.Tensor) -> torch.Tensor:
        """Attention weights ``[B, H, L, L]`` (fp32, rows sum to 1, zero above the diagonal) on the reference path."""
        q, k, _ = self.project(x)
        q, k = q.float(), k.float()
        if self.smear_logit is not None:
            k = smeared_keys_reference(k, self.smear_logit)
        length = x.shape[1]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        return scores.masked_fill(future, float("-inf")).softmax(dim=-1)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, smear={self.smear}, backend={self.backend!r}, "
            f"attention={self.attention!r}"
        )
