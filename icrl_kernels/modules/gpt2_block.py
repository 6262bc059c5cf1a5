"""GPT-2's pre-LayerNorm transformer block, with optional Mixture-of-Attention gating.

Parameter names follow GPT-2 (``ln_1``, ``attn.qkv`` = ``c_attn`` (its first ``3D`` rows; a gated
block's MoA gate rows follow them), ``attn.out_proj`` = ``c_proj``, ``ln_2``, ``mlp.c_fc``,
``mlp.c_proj``), so Hugging Face GPT-2 checkpoints map onto any stack of these blocks one to one
(:mod:`icrl_models.gpt2_checkpoint`). Used by the Decision Transformer with MoA and as the loop body
of :class:`~icrl_kernels.modules.looped.LoopedBlock`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import (
    FLOAT_DTYPES,
    check_features,
    check_int,
    check_matches_params,
    check_positive_float,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
)
from .moa_attention import MoAAttention


class GPT2MLP(nn.Module):
    """GPT-2's feed-forward: ``dropout(c_proj(gelu_tanh(c_fc(x))))`` with a 4x hidden width."""

    def __init__(self, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        d_model = check_int(d_model, "d_model", min_value=1)
        dropout = check_probability(dropout, "dropout")
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    """``h = x + attn(ln_1(x))``, ``h + mlp(ln_2(h))`` with causal :class:`~icrl_kernels.MoAAttention`.

    Args:
        d_model: width ``D``.
        n_heads: attention heads.
        gate: the MoA gate (``"softmax"``, ``"sigmoid"``, ``"linear"``) or ``None`` for plain attention.
        dropout: GPT-2's attention and residual dropout.
        eps: the LayerNorms' epsilon.
        backend: backend of the gating op.
        attention: :class:`~icrl_kernels.MoAAttention`'s implementation, ``"sdpa"`` (default) or
            ``"fused"`` (:func:`icrl_kernels.gated_attention`; needs ``dropout=0`` and no ``head_mask``).

    Shapes:
        ``x [B, L, D]`` -> ``[B, L, D]``; with ``return_gates``, also the gate weights ``[B, L, H]``
        (``None`` for an ungated block).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        gate: str | None = None,
        dropout: float = 0.0,
        eps: float = 1e-5,
        backend: str = "auto",
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        self.d_model = check_int(d_model, "d_model", min_value=1)  # before nn.LayerNorm(-1) fails obscurely
        eps = check_positive_float(eps, "eps")
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = MoAAttention(d_model, n_heads, gate=gate, dropout=dropout, backend=backend, attention=attention)
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = GPT2MLP(d_model, dropout)

    @property
    def gated(self) -> bool:
        return self.attn.gate is not None

    def forward(
        self,
        x: torch.Tensor,
        *,
        normed: torch.Tensor | None = None,
        head_mask: torch.Tensor | None = None,
        return_gates: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``normed``: ``ln_1(x)`` when the caller computed it already (a fused injection + LayerNorm);
        ``head_mask [H]`` scales each head's contribution (0 ablates a head).

        Raises ``ValueError``/``TypeError`` naming ``x``, ``normed`` or ``head_mask`` for a wrong shape or
        dtype (see :meth:`MoAAttention.forward`)."""
        check_features(x, "x", self.d_model)
        check_matches_params(x, "x", self.ln_1.weight)
        if normed is None:
            normed = self.ln_1(x)
        else:
            check_tensor(normed, "normed", ndim=3, dtypes=FLOAT_DTYPES)
            check_shape(normed, "normed", tuple(x.shape), "x.shape, [B, L, D]")
            check_same_device(x=x, normed=normed)
        if return_gates:
            attended, gates = self.attn(normed, head_mask=head_mask, return_gates=True)
        else:
            attended, gates = self.attn(normed, head_mask=head_mask), None
        h = x + attended
        h = h + self.mlp(self.ln_2(h))
        if return_gates:
            return h, (gates if self.gated else None)
        return h
