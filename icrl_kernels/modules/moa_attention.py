"""``MoAAttention``: causal multi-head self-attention with per-head Mixture-of-Attention gates (GPT2-DTMA)."""

from __future__ import annotations

import math

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
from ..moa import GATES, mixture_of_heads
from ..moa import eager as moa_eager

#: ``attention=`` choices of :class:`MoAAttention` and :class:`~icrl_kernels.SmearedKeyAttention`.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "fused")


class MoAAttention(nn.Module):
    """``y = W_O concat_h(G_h(e) * head_h(x))`` with ``G(e) = gate(W_g e + b_g)`` over heads (GPT2-DTMA).

    ``head_h = softmax(q_h k_h^T / sqrt(Dh) + mask) v_h`` with ``q, k, v = W_QKV x``, ``e`` is the gate
    input (by default ``x``, the block's normalised input, as in the paper). ``gate=None`` gives
    ordinary causal attention (no gate rows), so one module serves both GPT-2's plain layers and the
    gated ones and is the benchmark floor.

    **One parameter for q, k, v and the gate, two GEMMs.** ``qkv`` is a single ``nn.Linear(D, 3D + H)``
    when gated (``nn.Linear(D, 3D)`` ungated): weight rows ``[q | k | v | gate]``, heads contiguous within
    each of q, k, v. The forward runs it as two GEMMs on views of that weight: ``[q | k | v]`` (``3D`` wide,
    the same GEMM as the ungated layer's, whose width cuBLAS tiles well) and the ``H`` gate rows (a small
    GEMM). One ``3D + H``-wide GEMM padded to aligned strides measured 1.2-1.3x the ungated layer on an H100
    (benchmarks/results/README.md, issue 43); the split's weight gradient is still one buffer. The gate rows
    ``qkv.weight[3D:]`` are ``W_g``; :attr:`gate_weight` / :attr:`gate_bias` are read-only views of them.
    The gate always has a bias: with ``bias=True`` it is ``qkv.bias[3D:]``; with ``bias=False`` (no q/k/v
    bias) it is the separate parameter ``qkv_gate_bias [H]``. Every row, gate rows included, is initialised
    as ``nn.Linear(D, .)`` initialises (``U(-1/sqrt(D), 1/sqrt(D))``, weight and bias), the distribution the
    former ``gate_proj = nn.Linear(D, H)`` had. State dicts saved with a separate ``gate_proj.weight`` /
    ``gate_proj.bias`` still load (they are concatenated onto ``qkv`` while loading).

    With a separate ``gate_input`` (not the tensor ``x``) the gate logits are ``gate_input @ W_g^T + b_g``
    with the same gate rows, and ``x`` gets the q/k/v rows only.

    **Attention implementation** (``attention=``): ``"sdpa"`` runs PyTorch's fused SDPA and then the
    gating + head merge as one op, :func:`icrl_kernels.mixture_of_heads`, which reads SDPA's output in
    place; ``"fused"`` is one call to :func:`icrl_kernels.gated_attention` (causal attention with the
    gate applied in its epilogue, so the ungated head outputs never reach memory). SDPA is the
    default: measured on an H200 (B=16, H=12, L=1024, Dh=64, bf16, forward + backward), SDPA plus the
    separate gate took 0.54 ms against the fused kernel's 0.98 ms (benchmarks/results/README.md,
    "GPU"); the choice is this one documented argument. ``"fused"`` is plain causal attention: it
    takes no ``attn_mask`` or ``head_mask``, needs ``is_causal=True`` and ``dropout=0``.

    Parameter names follow GPT-2 so that checkpoints map one to one: ``qkv`` is ``c_attn`` (its first
    ``3D`` rows, layout ``[q | k | v]``, as ``nn.Linear`` i.e. the transpose of GPT-2's ``Conv1D``
    weight; the gate rows are not GPT-2's), ``out_proj`` is ``c_proj``.

    Args:
        d_model: residual width ``D``.
        n_heads: heads ``H``; ``D`` must split into ``H`` heads of ``Dh = D / H``.
        gate: ``"softmax"`` (the paper), ``"sigmoid"``, ``"linear"`` (the official code's layer-0
            gate) or ``None`` (no gating).
        bias: whether ``qkv`` (its q/k/v rows) and ``out_proj`` have biases (the gate always has one).
        dropout: GPT-2's ``attn_pdrop`` / ``resid_pdrop``: dropout on the attention probabilities
            (inside SDPA) and on the output projection, in training mode only. Must be 0 with
            ``attention="fused"``.
        backend: kernel backend of :func:`~icrl_kernels.mixture_of_heads` /
            :func:`~icrl_kernels.gated_attention` (``"auto"``, ``"triton"``, ``"eager"``, ``"reference"``).
        attention: ``"sdpa"`` (default) or ``"fused"``, see above.

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
        attention: str = "sdpa",
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
        self.attention = check_choice(attention, "attention", ATTENTION_IMPLEMENTATIONS)
        if self.attention == "fused" and self.dropout > 0:
            raise ValueError(
                f"dropout must be 0 with attention='fused' (its kernel has no attention dropout), got {self.dropout}"
            )
        gate_rows = 0 if gate is None else n_heads
        # One parameter for q, k, v and the gate logits: rows [q | k | v | gate] (two GEMMs in the forward).
        self.qkv = nn.Linear(d_model, 3 * d_model + gate_rows, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)  # input: head h at features [h*Dh, (h+1)*Dh)
        if gate is not None and not bias:
            # The gate keeps its bias when q, k, v have none; same init as nn.Linear(D, H)'s bias.
            bound = 1.0 / math.sqrt(d_model)
            self.qkv_gate_bias = nn.Parameter(torch.empty(n_heads).uniform_(-bound, bound))
        else:
            self.register_parameter("qkv_gate_bias", None)
        self.resid_dropout = nn.Dropout(self.dropout)

    # -- the projection -------------------------------------------------------------------------------
    @property
    def gate_weight(self) -> torch.Tensor | None:
        """``W_g [H, D]``: a view of the gate rows ``qkv.weight[3D:]`` (``None`` when ungated)."""
        return None if self.gate is None else self.qkv.weight[3 * self.d_model :]

    @property
    def gate_bias(self) -> torch.Tensor | None:
        """``b_g [H]``: ``qkv.bias[3D:]`` or ``qkv_gate_bias`` when ``bias=False`` (``None`` when ungated)."""
        if self.gate is None:
            return None
        return self.qkv_gate_bias if self.qkv_gate_bias is not None else self.qkv.bias[3 * self.d_model :]

    def gate_logits(self, gate_input: torch.Tensor) -> torch.Tensor | None:
        """Gate logits ``gate_input @ W_g^T + b_g``, ``[B, L, H]``, for a gate input ``[B, L, D]``;
        ``None`` when ungated."""
        if self.gate is None:
            return None
        return F.linear(gate_input, self.gate_weight, self.gate_bias)

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (rearrange(t, "b l (h e) -> b h l e", h=self.n_heads) for t in qkv.split(self.d_model, dim=-1))
        return q, k, v

    def project_with_gate(
        self, x: torch.Tensor, gate_input: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x [B, L, D]`` -> ``q, k, v`` (each ``[B, H, L, Dh]``, strided views of one ``3D``-wide projection)
        and the gate logits ``[B, L, H]`` of ``gate_input`` (default ``x``; ``None`` when ungated)."""
        if self.gate is None:
            return (*self._split_heads(self.qkv(x)), None)
        # split (not sliced twice): its backward writes the q/k/v and gate gradients into one buffer.
        w_qkv, w_gate = self.qkv.weight.split([3 * self.d_model, self.n_heads])
        if self.qkv_gate_bias is None:
            b_qkv, b_gate = self.qkv.bias.split([3 * self.d_model, self.n_heads])
        else:
            b_qkv, b_gate = None, self.qkv_gate_bias
        logits = F.linear(x if gate_input is None else gate_input, w_gate, b_gate)
        return (*self._split_heads(F.linear(x, w_qkv, b_qkv)), logits)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, L, D]`` -> ``q, k, v``, each ``[B, H, L, Dh]`` (strided views of one projection)."""
        return self.project_with_gate(x)[:3]

    def gate_weights(self, gate_input: torch.Tensor) -> torch.Tensor | None:
        """Normalised gate weights ``[B, L, H]`` (fp32) for a gate input ``[B, L, D]``; ``None`` when ungated."""
        if self.gate is None:
            return None
        return moa_eager.gate_weights(self.gate_logits(gate_input), self.gate)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        # State dicts from before the gate was folded into qkv hold a separate gate_proj Linear:
        # append its rows (and bias) to qkv's. The dict is the loader's own copy, so editing it is safe.
        old_weight, old_bias = prefix + "gate_proj.weight", prefix + "gate_proj.bias"
        qkv_weight, qkv_bias = prefix + "qkv.weight", prefix + "qkv.bias"
        if self.gate is not None and old_weight in state_dict and qkv_weight in state_dict:
            weight = state_dict.pop(old_weight)
            state_dict[qkv_weight] = torch.cat([state_dict[qkv_weight], weight.to(state_dict[qkv_weight])])
            if old_bias in state_dict:
                gate_bias = state_dict.pop(old_bias)
                if self.qkv_gate_bias is not None:
                    state_dict[prefix + "qkv_gate_bias"] = gate_bias
                elif qkv_bias in state_dict:
                    state_dict[qkv_bias] = torch.cat([state_dict[qkv_bias], gate_bias.to(state_dict[qkv_bias])])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

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
            if self.gate is not None:
                check_matches_params(gate_input, "gate_input", self.qkv.weight)
        if head_mask is not None:
            check_tensor(head_mask, "head_mask", ndim=1, dtypes=FLOAT_DTYPES)
            check_shape(head_mask, "head_mask", (self.n_heads,), "(n_heads,)")
            check_same_device(x=x, head_mask=head_mask)

    def _check_fused(self, attn_mask: torch.Tensor | None, is_causal: bool, head_mask: torch.Tensor | None) -> None:
        """``attention="fused"`` is plain causal attention: reject what it cannot do, naming the argument."""
        for name, value in (("attn_mask", attn_mask), ("head_mask", head_mask)):
            if value is not None:
                raise ValueError(
                    f"{name} is not supported with attention='fused' (the fused kernel is plain causal "
                    "attention); use attention='sdpa'"
                )
        if not is_causal:
            raise ValueError("is_causal must be True with attention='fused' (the fused kernel is causal only)")

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
                broadcastable to ``[B, H, L, L]``, ``head_mask`` not ``[H]``, tensors on different devices;
                with ``attention="fused"``: an ``attn_mask`` or ``head_mask``, or ``is_causal=False``.
        """
        self._check_inputs(x, gate_input, head_mask)
        if self.attention == "fused":
            self._check_fused(attn_mask, is_causal, head_mask)
        batch, length, _ = x.shape
        q, k, v, logits = self.project_with_gate(x, gate_input)
        gates = None
        if return_gates and logits is None:
            gates = x.new_ones(batch, length, self.n_heads)
        elif return_gates:
            gates = moa_eager.gate_weights(logits, self.gate)
        if self.attention == "fused":
            from ..attention import gated_attention  # imported here: the module loads without it

            merged = gated_attention(q, k, v, logits, gate=self.gate or "softmax", backend=self.backend)
            y = self.resid_dropout(self.out_proj(merged))
            return (y, gates) if return_gates else y
        mask = self._mask(attn_mask, is_causal, x)
        attended = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and mask is None,
        )  # fmt: skip
        heads = rearrange(attended, "b h l e -> b l h e")  # a view: the gating op reads the strides
        if logits is None:
            if head_mask is not None:
                heads = heads * head_mask.to(heads.dtype).view(1, 1, -1, 1)
            merged = rearrange(heads, "b l h e -> b l (h e)")
        elif head_mask is None:
            merged = mixture_of_heads(heads, logits, gate=self.gate, backend=self.backend)
        else:
            # The mask scales normalised weights, so normalise here and pass the weights as
            # "linear" logits (the op's identity gate): one kernel still does scaling and merge.
            weights = gates if gates is not None else moa_eager.gate_weights(logits, self.gate)
            merged = mixture_of_heads(heads, weights * head_mask.to(weights.dtype), gate="linear", backend=self.backend)
        y = self.resid_dropout(self.out_proj(merged))
        return (y, gates) if return_gates else y

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_q, W_k)``, each ``[H, D, Dh]`` with ``q_h = x @ W_q[h]``: ``M_h = W_q[h] @ W_k[h].T`` is the
        ``[D, D]`` bilinear form of head ``h``'s scores (Definition 4.1 of the Markov-heads paper)."""
        # rows [q | k | v | gate]; head h at rows h*Dh:(h+1)*Dh of each of q, k, v
        weight = self.qkv.weight.detach()[: 3 * self.d_model]
        w_q, w_k, _ = rearrange(weight, "(three h e) d -> three h d e", three=3, h=self.n_heads).unbind(0)
        return w_q, w_k

    def ov_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_v [H, D, Dh], W_o [H, Dh, D])``: head ``h`` writes ``x @ W_v[h] @ W_o[h]`` (times its gate and
        attention weights) to the residual stream; ``W_v[h] @ W_o[h]`` is its ``[D, D]`` OV circuit."""
        weight = self.qkv.weight.detach()
        w_v = rearrange(weight[2 * self.d_model : 3 * self.d_model], "(h e) d -> h d e", h=self.n_heads)
        w_o = rearrange(self.out_proj.weight.detach(), "d (h e) -> h e d", h=self.n_heads)
        return w_v, w_o

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, gate={self.gate!r}, dropout={self.dropout}, "
            f"backend={self.backend!r}, attention={self.attention!r}"
        )


def _broadcast_shape(shape: torch.Size, target: tuple[int, ...]) -> tuple[int, ...] | None:
    """``torch.broadcast_shapes(shape, target)``, or ``None`` where they do not broadcast."""
    try:
        return tuple(torch.broadcast_shapes(shape, target))
    except RuntimeError:
        return None
