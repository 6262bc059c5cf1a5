"""``NGramAttention``: the n-gram induction-head layer of N-Gram AD as a drop-in ``nn.Module``."""

from __future__ import annotations

import torch
from torch import nn

from .._backend import BACKENDS
from .._validation import check_bool, check_choice, check_features, check_int, check_matches_params
from ..ngram import NGramDecodeState, ngram_attention
from ..ngram.plan import NGramPlan


class NGramAttention(nn.Module):
    """``forward(h, ids) = W_a(A(n) h) + W_h(h)`` with ``A(n)`` the n-gram match pattern.

    ``A(n)`` is hard-coded from token ids (see :func:`icrl_kernels.ngram_attention`); the two
    ``nn.Linear(d_model, d_model)`` maps are the layer's only parameters. Stack layers with different
    ``n`` (the paper uses n = 1, 2, 3 or 1, 2, 4).

    Args:
        d_model: feature width ``D``.
        n: n-gram length, ``>= 1``.
        bias: whether the two linear maps have a bias.
        backend: ``"auto"``, ``"triton"``, ``"eager"`` or ``"reference"`` (see ``ngram_attention``).
            ``"auto"`` is Triton where it runs; on the CPU it is the dense reference up to
            ``CPU_DENSE_MAX_LENGTH`` positions (``CPU_DENSE_MAX_LENGTH_WIDE`` from ``D = CPU_WIDE_DIM``; faster
            there) and the eager sort path beyond, unless
            :meth:`forward` gets a ``plan``, which always means the sort path.

    Shapes:
        ``h [B, L, D]``, ``ids [B, L]`` (int, negative = padding) -> ``[B, L, D]``.
    """

    def __init__(self, d_model: int, n: int, bias: bool = True, *, backend: str = "auto") -> None:
        super().__init__()
        self.d_model = check_int(d_model, "d_model", min_value=1)
        self.n = check_int(n, "n", min_value=1)
        self.backend = check_choice(backend, "backend", BACKENDS)
        check_bool(bias, "bias")
        self.attn_proj = nn.Linear(d_model, d_model, bias=bias)  # W_a
        self.skip_proj = nn.Linear(d_model, d_model, bias=bias)  # W_h

    def forward(self, h: torch.Tensor, ids: torch.Tensor, *, plan: NGramPlan | None = None) -> torch.Tensor:
        """``h [B, L, D]``, ``ids [B, L]`` -> ``[B, L, D]``; ``plan``: a shared :func:`ngram_plan` of ``(ids, n)``.

        Raises ``ValueError``/``TypeError`` naming ``h`` (not ``[B, L, d_model]``, not float, a dtype other
        than the parameters' outside autocast); :func:`ngram_attention` checks ``ids`` and ``plan``."""
        check_features(h, "h", self.d_model)
        check_matches_params(h, "h", self.attn_proj.weight)
        mixed = ngram_attention(h, ids, self.n, backend=self.backend, plan=plan)
        return self.attn_proj(mixed) + self.skip_proj(h)

    def init_decode_state(self, batch_size: int, max_len: int, *, device=None, dtype=None) -> NGramDecodeState:
        """A fresh :class:`NGramDecodeState` for :meth:`step` (defaults: the layer's device and dtype)."""
        weight = self.attn_proj.weight
        return NGramDecodeState(
            batch_size, self.d_model, self.n, max_len,
            device=device if device is not None else weight.device,
            dtype=dtype if dtype is not None else weight.dtype,
        )  # fmt: skip

    def step(self, state: NGramDecodeState, h_t: torch.Tensor, ids_t: torch.Tensor) -> torch.Tensor:
        """One position of :meth:`forward` for incremental decoding: ``h_t [B, D]``, ``ids_t [B]`` -> ``[B, D]``."""
        if not isinstance(state, NGramDecodeState):
            raise TypeError(f"state must be an NGramDecodeState (from init_decode_state), got {type(state).__name__}")
        if state.n != self.n or state.dim != self.d_model:
            raise ValueError(
                f"state must be made for this layer (n={self.n}, dim={self.d_model}), "
                f"got n={state.n}, dim={state.dim}: use init_decode_state()"
            )
        check_features(h_t, "h_t", self.d_model, dims="B")
        check_matches_params(h_t, "h_t", self.attn_proj.weight)
        mixed = state.step(h_t, ids_t).to(h_t.dtype)
        return self.attn_proj(mixed) + self.skip_proj(h_t)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n={self.n}, backend={self.backend!r}"
