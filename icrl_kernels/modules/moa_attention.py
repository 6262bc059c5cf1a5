"""``MoAAttention``: causal multi-head self-attention with per-head Mixture-of-Attention gates (GPT2-DTMA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._backend import BACKENDS
from .._validation import (
    FLOAT_DTYPES,
    check_bool,
    check_choice,
    check_features,
    check_int,
    check_matches_params,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
)
from ..moa import GATES, gate_weights_reference, mixture_of_heads


class MoAAttention(nn.Module):
    """``y = W_O concat_h(G_h(e) * head_h(x))`` with ``G(e) = gate(W_g e)`` over heads (GPT2-DTMA).

    ``head_h = softmax(q_h k_h^T / sqrt(Dh) + mask) v_h`` with ``q, k, v = W_QKV x`` (PyTorch's fused
    SDPA), ``e`` is the gate input (by default ``x``, the block's normalised input, as in the paper),
    and the gating + head merge is one op, :func:`icrl_kernels.mixture_of_heads`, which reads SDPA's
    output in place. ``gate=None`` gives ordinary causal attention (no ``gate_proj``), so one module
    serves both GPT-2's plain layers and the gated ones and is the benchmark floor.

    Parameter names follow GPT-2 so that checkpoints map one to one: ``qkv`` is ``c_attn`` (output
    layout ``[q | k | v]``, heads contiguous within each, as ``nn.Linear`` i.e. the transpose of
    GPT-2's ``Conv1D`` weight), ``out_proj`` is ``c_proj``; ``gate_proj`` is the MoA gate ``W_g``.

    Args:
        d_model: residual width ``D``.
        n_heads: heads ``H``; ``D`` must split into ``H`` heads of ``Dh = D / H``.
        gate: ``"softmax"`` (the paper), ``"sigmoid"``, ``"linear"`` (the official code's layer-0
            gate) or ``None`` (no gating).
        bias: whether ``qkv`` and ``out_proj`` have biases (``gate_proj`` always has one).
        dropout: GPT-2's ``attn_pdrop`` / ``resid_pdrop``: dropout on the attention probabilities
            (inside SDPA) and on the output projection, in training mode only.
        backend: kernel backend of :func:`~icrl_kernels.mixture_of_heads` (``"auto"``, ``"triton"``,
            ``"eager"``, ``"reference"``).

    Shapes:
        ``x [B, L, D]`` -> ``[B, L, D]``; gates ``[B, L, H]``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        gate: str | None = "softmax",
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.d_model = check_int(d_model, "d_model", min_value=1)
        self.n_heads = check_int(n_heads, "n_heads", min_value=1)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.head_dim = d_model // n_heads
        self.gate = None if gate is None else check_choice(gate, "gate", GATES)
        check_bool(bias, "bias")
        self.dropout = check_probability(dropout, "dropout")
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)  # input: head h at features [h*Dh, (h+1)*Dh)
        self.gate_proj = nn.Linear(d_model, n_heads, bias=True) if gate is not None else None
        self.resid_dropout = nn.Dropout(self.dropout)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, L, D]`` -> ``q, k, v``, each ``[B, H, L, Dh]`` (strided views of one projection)."""
        qkv = rearrange(self.qkv(x), "b l (three h e) -> three b h l e", three=3, h=self.n_heads)
        return qkv.unbind(0)

    def gate_weights(self, gate_input: torch.Tensor) -> torch.Tensor | None:
        """Normalised gate weights ``[B, L, H]`` (fp32) for a gate input ``[B, L, D]``; ``None`` when ungated."""
        if self.gate_proj is None:
            return None
        return gate_weights_reference(self.gate_proj(gate_input), self.gate)

    def _mask(self, attn_mask: torch.Tensor | None, is_causal: bool, x: torch.Tensor) -> torch.Tensor | None:
        batch, length, device = x.shape[0], x.shape[1], x.device
        if attn_mask is None:
            return None
        check_tensor(attn_mask, "attn_mask", dtypes=(torch.bool,))
        full = (batch, self.n_heads, length, length)
        if attn_mask.dim() > 4 or _broadcast_shape(attn_mask.shape, full) != full:
            raise ValueError(
                f"attn_mask must be broadcastable to [B, H, L, L] = {list(full)} (query, key), "
                f"got {list(attn_mask.shape)}"
            )
        check_same_device(x=x, attn_mask=attn_mask)
        if is_causal:
            attn_mask = attn_mask & torch.ones(length, length, dtype=torch.bool, device=device).tril()
        return attn_mask

    def _check_inputs(self, x: torch.Tensor, gate_input: torch.Tensor | None, head_mask: torch.Tensor | None) -> None:
        """Shapes, dtypes and devices of :meth:`forward`'s tensors (no values are read)."""
        check_features(x, "x", self.d_model)
        check_matches_params(x, "x", self.qkv.weight)
        if gate_input is not None:
            # Checked even when ungated (then unused), so a stack of mixed layers fails the same way.
            check_features(gate_input, "gate_input", self.d_model)
            check_shape(gate_input, "gate_input", tuple(x.shape), "x.shape, [B, L, D]")
            check_same_device(x=x, gate_input=gate_input)
            if self.gate_proj is not None:
                check_matches_params(gate_input, "gate_input", self.gate_proj.weight)
        if head_mask is not None:
            check_tensor(head_mask, "head_mask", ndim=1, dtypes=FLOAT_DTYPES)
            check_shape(head_mask, "head_mask", (self.n_heads,), "(n_heads,)")
            check_same_device(x=x, head_mask=head_mask)

    def forward(
        self,
        x: torch.Tensor,
        *,
        gate_input: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        head_mask: torch.Tensor | None = None,
        return_gates: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Gated attention of ``x [B, L, D]``.

        Args:
            x: ``[B, L, D]``.
            gate_input: ``[B, L, D]`` the gate reads (default ``x``); unused (but checked) when ungated.
            attn_mask: bool, broadcastable to ``[B, H, L, L]`` (query, key); ``True`` = may attend. With
                ``is_causal`` it is combined with the causal mask. A query that may attend to nothing
                gets NaN from SDPA, as in PyTorch.
            is_causal: mask future keys.
            head_mask: ``[H]`` float multiplying each head's contribution (0 ablates a head): applied to
                the gate weights after normalisation, or to the head outputs when ungated.
            return_gates: also return the gate weights.

        Returns:
            ``y [B, L, D]``, or ``(y, gates)`` with ``gates [B, L, H]`` the normalised gate weights in
            fp32 before ``head_mask`` (all ones when ungated, in ``x.dtype``), differentiable.

        Raises:
            TypeError: a non-tensor or non-float ``x``/``gate_input``/``head_mask``, a non-bool
                ``attn_mask``, or activations whose dtype differs from the parameters' outside autocast.
            ValueError: ``x`` not ``[B, L, d_model]``, ``gate_input`` not ``x``'s shape, ``attn_mask`` not
                broadcastable to ``[B, H, L, L]``, ``head_mask`` not ``[H]``, tensors on different devices.
        """
        self._check_inputs(x, gate_input, head_mask)
        batch, length, _ = x.shape
        q, k, v = self.project(x)
        mask = self._mask(attn_mask, is_causal, x)
        attended = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and mask is None,
        )  # fmt: skip
        heads = rearrange(attended, "b h l e -> b l h e")  # a view: the gating op reads the strides
        gates = None
        if self.gate_proj is None:
            if head_mask is not None:
                heads = heads * head_mask.to(heads.dtype).view(1, 1, -1, 1)
            merged = rearrange(heads, "b l h e -> b l (h e)")
            if return_gates:
                gates = x.new_ones(batch, length, self.n_heads)
        else:
            logits = self.gate_proj(x if gate_input is None else gate_input)
            if head_mask is None:
                merged = mixture_of_heads(heads, logits, gate=self.gate, backend=self.backend)
                if return_gates:
                    gates = gate_weights_reference(logits, self.gate)
            else:
                # The mask scales normalised weights, so normalise here and pass the weights as
                # "linear" logits (the op's identity gate): one kernel still does scaling and merge.
                gates = gate_weights_reference(logits, self.gate)
                merged = mixture_of_heads(heads, gates * head_mask.to(gates.dtype), gate="linear", backend=self.backend)
        y = self.resid_dropout(self.out_proj(merged))
        return (y, gates) if return_gates else y

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_q, W_k)``, each ``[H, D, Dh]`` with ``q_h = x @ W_q[h]``: ``M_h = W_q[h] @ W_k[h].T`` is the
        ``[D, D]`` bilinear form of head ``h``'s scores (Definition 4.1 of the Markov-heads paper)."""
        weight = self.qkv.weight.detach()  # [3D, D]: rows [q | k | v], head h at rows h*Dh:(h+1)*Dh of each
        w_q, w_k, _ = rearrange(weight, "(three h e) d -> three h d e", three=3, h=self.n_heads).unbind(0)
        return w_q, w_k

    def ov_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_v [H, D, Dh], W_o [H, Dh, D])``: head ``h`` writes ``x @ W_v[h] @ W_o[h]`` (times its gate and
        attention weights) to the residual stream; ``W_v[h] @ W_o[h]`` is its ``[D, D]`` OV circuit."""
        weight = self.qkv.weight.detach()
        w_v = rearrange(weight[2 * self.d_model :], "(h e) d -> h d e", h=self.n_heads)
        w_o = rearrange(self.out_proj.weight.detach(), "d (h e) -> h e d", h=self.n_heads)
        return w_v, w_o

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, gate={self.gate!r}, dropout={self.dropout}, "
            f"backend={self.backend!r}"
        )


def _broadcast_shape(shape: torch.Size, target: tuple[int, ...]) -> tuple[int, ...] | None:
    """``torch.broadcast_shapes(shape, target)``, or ``None`` where they do not broadcast."""
    try:
        return tuple(torch.broadcast_shapes(shape, target))
    except RuntimeError:
        return None
