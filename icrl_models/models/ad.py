"""Algorithm Distillation (Laskin et al., 2022) and N-Gram AD (the N-gram paper) as one model.

One token per step (the N-gram paper, Appendix A): the step's state, the *previous* action and the
previous reward are embedded, concatenated and projected to ``d_model``; a causal transformer reads
the tokens and the action head predicts the step's action. N-Gram AD makes the first blocks
:class:`~icrl_kernels.NGramAttention` layers (one per entry of ``ngram_sizes``) whose attention
pattern is hard-coded from state ids or from transition ids ``(state, previous action, previous
reward)``.

Positions are encoded with rotary embeddings (RoPE), so attention depends only on relative offsets:
in-context evaluation can run far past the training window with a sliding window of ``seq_len``
tokens and a key/value cache (:class:`ADDecodeState`), each step costing the same whatever the
context length. :meth:`ADModel.forward` with ``window=seq_len`` computes exactly what stepping
computes (a banded causal mask); the n-gram layers always see the whole context (their mean over
matches has no length scale to outgrow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from icrl_kernels import NGramAttention, transition_ids
from icrl_kernels.validation import check_generator, check_int

from .._checks import check_float

NGRAM_TOKEN_MODES = ("state", "transition")


@dataclass
class ADConfig:
    """Model settings; the knobs of the N-gram paper's Table 1 (learning rate and weight decay live in
    the training config)."""

    num_states: int = 81
    #: > 0: observations are float vectors of this width (contextual bandits), embedded linearly.
    observation_dim: int = 0
    num_actions: int = 5
    #: Rewards are embedded as scalars; transition ids need them discrete in ``[0, num_rewards)``.
    num_rewards: int = 2
    seq_len: int = 200
    d_model: int = 64
    num_heads: int = 4
    #: Softmax-attention blocks after the n-gram blocks.
    num_layers: int = 2
    #: One :class:`NGramAttention` block per entry, in order; empty for plain AD.
    ngram_sizes: tuple[int, ...] = ()
    ngram_tokens: str = "state"
    pre_norm: bool = True
    qk_norm: bool = False
    embedding_dropout: float = 0.1
    residual_dropout: float = 0.1
    attention_dropout: float = 0.0
    #: Kernel backend of the n-gram layers: "auto", "triton", "eager" or "reference".
    backend: str = "auto"
    #: Temperature of action sampling (evaluation): actions are drawn from ``softmax(logits / select_tau)``;
    #: ``None``: 1, the softmax the head was trained with. ``icrl-headless`` chooses it on held-out bandits
    #: for AD as for Headless-AD, whose sampling temperature decides its score.
    select_tau: float | None = None

    def __post_init__(self) -> None:
        check_backbone_fields(self)
        for name in ("num_actions", "num_rewards"):
            check_int(getattr(self, name), name, min_value=1)
        if self.select_tau is not None and not check_float(self.select_tau, "select_tau") > 0:
            raise ValueError(f"select_tau must be > 0 (or None: 1), got {self.select_tau}")
        check_int(self.num_layers, "num_layers", min_value=0)
        if isinstance(self.ngram_sizes, (str, bytes)) or not hasattr(self.ngram_sizes, "__iter__"):
            raise TypeError(f"ngram_sizes must be a tuple of ints, got {self.ngram_sizes!r}")
        self.ngram_sizes = tuple(check_int(n, "ngram_sizes", min_value=1) for n in self.ngram_sizes)
        if self.ngram_tokens not in NGRAM_TOKEN_MODES:
            raise ValueError(f"ngram_tokens must be one of {NGRAM_TOKEN_MODES}, got {self.ngram_tokens!r}")
        if self.num_layers < 0 or self.num_layers + len(self.ngram_sizes) == 0:
            raise ValueError("the model needs at least one block (num_layers or ngram_sizes)")
        if self.ngram_sizes and self.observation_dim:
            raise ValueError("n-gram layers match discrete state ids; they cannot use vector observations")


def check_backbone_fields(config) -> None:
    """Check the transformer fields that AD and Headless-AD configs share (sizes, dropouts, head split);
    a ``ValueError`` / ``TypeError`` naming the field."""
    for name in ("num_states", "seq_len", "d_model", "num_heads"):
        check_int(getattr(config, name), name, min_value=1)
    check_int(config.observation_dim, "observation_dim", min_value=0)
    for name in ("embedding_dropout", "residual_dropout", "attention_dropout"):
        if not 0.0 <= check_float(getattr(config, name), name, low=0.0) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {getattr(config, name)}")
    if config.d_model % config.num_heads or (config.d_model // config.num_heads) % 2:
        raise ValueError(f"d_model ({config.d_model}) must split into num_heads ({config.num_heads}) even widths")


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[..., head_dim / 2]`` for integer ``positions`` of any shape."""
    inverse = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inverse
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs ``(x[2i], x[2i+1])`` of ``x [..., head_dim]`` by the angles of ``cos, sin``."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return rotated.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE and optional qk-norm; SDPA for whole sequences."""

    def __init__(self, config: ADConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.d_model // config.num_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.q_norm = nn.LayerNorm(self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if config.qk_norm else nn.Identity()
        self.attention_dropout = config.attention_dropout

    def _heads(self, x: torch.Tensor):
        """``x [B, L, D]`` -> ``q, k, v`` each ``[B, L, H, Dh]`` (qk-normed, not rotated)."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).unbind(2)
        return self.q_norm(q), self.k_norm(k), v

    def _rotate(self, positions: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """RoPE of each ``[B, L, H, Dh]`` tensor at ``positions [B, L]``."""
        cos, sin = rotary_tables(positions, self.head_dim)
        cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
        return [apply_rotary(t, cos, sin) for t in tensors]

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """``x [B, L, D]``, ``positions [B, L]`` -> rotated ``q, k`` and ``v``, each ``[B, H, L, Dh]``."""
        q, k, v = self._heads(x)
        q, k = self._rotate(positions, q, k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self._project(x, positions)
        dropout = self.attention_dropout if self.training else 0.0
        if window is None or window >= L:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            offsets = torch.arange(L, device=x.device)
            distance = offsets[:, None] - offsets[None, :]
            band = (distance >= 0) & (distance < window)  # each query sees itself and window - 1 before it
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout)
        return self.out(y.transpose(1, 2).reshape(B, L, D))

    def step(self, x_t: torch.Tensor, position: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per row: ``x_t [B, D]``, ``position [B]`` -> ``[B, D]``, appending to ``cache``."""
        q, k, v = self._project(x_t[:, None], position[:, None])  # [B, H, 1, Dh]
        keys, values, valid = cache.append(k[:, :, 0], v[:, :, 0])
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :])
        return self.out(y.reshape(x_t.shape))


class KVCache:
    """A ring buffer of the last ``window`` keys and values of one attention layer.

    Keys are ``[B, H, P + W, key_dim]`` and values ``[B, H, P + W, head_dim]``: an optional fixed
    ``prefix`` of ``P`` entries (Headless-AD's action-set prompt) stays in front of the ring forever.
    """

    def __init__(self, batch: int, heads: int, window: int, head_dim: int, device, dtype, *, key_dim=None, prefix=None):
        key_dim = head_dim if key_dim is None else key_dim
        prefix_length = 0 if prefix is None else prefix[0].shape[2]
        self.keys = torch.zeros(batch, heads, prefix_length + window, key_dim, device=device, dtype=dtype)
        self.values = torch.zeros(batch, heads, prefix_length + window, head_dim, device=device, dtype=dtype)
        self.valid = torch.zeros(batch, prefix_length + window, dtype=torch.bool, device=device)
        if prefix is not None:  # (keys, values, valid [B, P])
            self.keys[:, :, :prefix_length], self.values[:, :, :prefix_length] = prefix[0], prefix[1]
            self.valid[:, :prefix_length] = prefix[2]
        self.prefix_length, self.window = prefix_length, window
        self.count = 0  # tokens appended so far (all rows step together)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v [B, H, *]``; return the key and value buffers and the ``[B, P + W]`` filled mask."""
        slot = self.prefix_length + self.count % self.window
        self.keys[:, :, slot], self.values[:, :, slot] = k, v
        self.valid[:, slot] = True
        self.count += 1
        return self.keys, self.values, self.valid


def register_decode_state(cls: type, tensors: tuple[str, ...]) -> type:
    """Register the decoding-state class ``cls`` as a pytree whose leaves are its attributes ``tensors`` (tensors,
    or lists of other registered states); every other attribute (host-side step counts, sizes) is its context.
    ``torch.func.vmap`` then takes a state of many models' decoders as it is (each tensor with a leading model
    dimension: :meth:`icrl_models.batched.StackedRuns.decode_step`) and returns the updated one. Returns ``cls``."""

    def flatten(state) -> tuple[list, tuple]:
        return [getattr(state, name) for name in tensors], tuple(
            (name, value) for name, value in vars(state).items() if name not in tensors
        )

    def unflatten(values, context: tuple):
        state = cls.__new__(cls)
        state.__dict__.update(context)
        state.__dict__.update(zip(tensors, values))
        return state

    pytree.register_pytree_node(cls, flatten, unflatten)
    return cls


register_decode_state(KVCache, ("keys", "values", "valid"))


class MLP(nn.Sequential):
    def __init__(self, config: ADConfig) -> None:
        super().__init__(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )


class Block(nn.Module):
    """Residual block: a token mixer (softmax attention or n-gram attention) then an MLP, pre- or post-norm.

    ``mixer`` replaces the default mixer (another model's attention); such blocks are driven through
    :meth:`residual` by their model."""

    def __init__(self, config: ADConfig, ngram_size: int | None = None, mixer: nn.Module | None = None) -> None:
        super().__init__()
        self.pre_norm = config.pre_norm
        self.norm1, self.norm2 = nn.LayerNorm(config.d_model), nn.LayerNorm(config.d_model)
        if mixer is not None:
            self.mixer = mixer
        elif ngram_size is None:
            self.mixer = CausalSelfAttention(config)
        else:
            self.mixer = NGramAttention(config.d_model, ngram_size, backend=config.backend)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.residual_dropout)

    @property
    def is_ngram(self) -> bool:
        return isinstance(self.mixer, NGramAttention)

    def residual(self, x: torch.Tensor, mix) -> torch.Tensor:
        """``x`` plus the mixer (``mix``, a function of the normalised input) and the MLP."""
        if self.pre_norm:
            x = x + self.dropout(mix(self.norm1(x)))
            return x + self.dropout(self.mlp(self.norm2(x)))
        x = self.norm1(x + self.dropout(mix(x)))
        return self.norm2(x + self.dropout(self.mlp(x)))

    def forward(self, x, positions, ids, window):
        if self.is_ngram:
            return self.residual(x, lambda h: self.mixer(h, ids))
        return self.residual(x, lambda h: self.mixer(h, positions, window))

    def step(self, x_t, position, ids_t, state):
        if self.is_ngram:
            return self.residual(x_t, lambda h: self.mixer.step(state, h, ids_t))
        return self.residual(x_t, lambda h: self.mixer.step(h, position, state))


class ADModel(nn.Module):
    """AD / N-Gram AD: ``forward(states, prev_actions, prev_rewards) -> logits [B, L, num_actions]``.

    Inputs (``[B, L]`` each): ``states`` int ids in ``[0, num_states)``; ``prev_actions`` int in
    ``[-1, num_actions)`` (-1: no previous action, the first step of a context); ``prev_rewards``
    float (0 with no previous step).
    """

    def __init__(self, config: ADConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        if config.observation_dim:
            self.state_embedding = nn.Linear(config.observation_dim, d)
        else:
            self.state_embedding = nn.Embedding(config.num_states, d)
        self.action_embedding = nn.Embedding(config.num_actions + 1, d)  # row 0: no previous action
        self.reward_embedding = nn.Linear(1, d)
        self.token_projection = nn.Linear(3 * d, d)
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.blocks = nn.ModuleList(
            [Block(config, n) for n in config.ngram_sizes] + [Block(config) for _ in range(config.num_layers)]
        )
        self.final_norm = nn.LayerNorm(d) if config.pre_norm else nn.Identity()
        self.action_head = nn.Linear(d, config.num_actions)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _tokens(self, states, prev_actions, prev_rewards) -> torch.Tensor:
        if self.config.observation_dim:
            states = states.to(self.state_embedding.weight.dtype)
        parts = [
            self.state_embedding(states),
            self.action_embedding(prev_actions + 1),
            self.reward_embedding(prev_rewards[..., None].to(self.reward_embedding.weight.dtype)),
        ]
        return self.embedding_dropout(self.token_projection(torch.cat(parts, dim=-1)))

    def ngram_ids(self, states, prev_actions, prev_rewards) -> torch.Tensor | None:
        """The token ids the n-gram layers match (``None`` for plain AD)."""
        if not self.config.ngram_sizes:
            return None
        c = self.config
        if c.ngram_tokens == "state":
            return states
        rewards = prev_rewards.round().long().clamp(0, c.num_rewards - 1)
        return transition_ids(
            states, prev_actions + 1, rewards,
            num_states=c.num_states, num_actions=c.num_actions + 1, num_rewards=c.num_rewards,
        )  # fmt: skip

    def forward(self, states, prev_actions, prev_rewards, *, window: int | None = None) -> torch.Tensor:
        """Logits ``[B, L, num_actions]``. ``window``: each token attends to at most this many tokens
        (itself included); ``None`` attends to the whole prefix (training windows)."""
        x = self._tokens(states, prev_actions, prev_rewards)
        positions = torch.arange(states.shape[1], device=states.device).expand(prev_actions.shape)
        ids = self.ngram_ids(states, prev_actions, prev_rewards)
        for block in self.blocks:
            x = block(x, positions, ids, window)
        return self.action_head(self.final_norm(x))

    def loss(self, batch: dict[str, torch.Tensor], label_smoothing: float = 0.0) -> torch.Tensor:
        """:func:`action_loss` of this model on a :class:`~icrl_models.data.HistoryWindows` batch."""
        return action_loss(self(batch["states"], batch["prev_actions"], batch["prev_rewards"]), batch, label_smoothing)

    def init_decode_state(self, batch: int, max_steps: int, **_) -> ADDecodeState:
        """A fresh incremental-decoding state for ``batch`` contexts of up to ``max_steps`` steps.

        (Keyword arguments that other models' decoders need, such as ``available``, are ignored.)"""
        return ADDecodeState(self, batch, max_steps)

    @torch.no_grad()
    def act(
        self, state: ADDecodeState, states_t, prev_actions_t, prev_rewards_t, *, available, sample: bool, generator
    ) -> torch.Tensor:
        """Actions ``[B]`` for one new step: a draw from the softmax over ``available [B, A]`` actions at
        temperature ``config.select_tau`` (``sample``, with ``generator``) or the argmax."""
        check_generator(generator)
        available = self.head_availability(available)
        logits = self.step(state, states_t, prev_actions_t, prev_rewards_t)
        return choose_actions(logits, available, sample, generator, self.config.select_tau)

    def head_availability(self, available: torch.Tensor) -> torch.Tensor:
        """``available [B, A]`` padded to the head's ``num_actions`` outputs (``ValueError`` for a larger set)."""
        num_actions, offered = self.config.num_actions, available.shape[1]
        if offered > num_actions:
            raise ValueError(
                f"AD's action head has {num_actions} outputs but the environment offers {offered} actions: "
                "AD must be retrained for larger action sets"
            )
        return F.pad(available, (0, num_actions - offered), value=False)

    @torch.no_grad()
    def step(self, state: ADDecodeState, states_t, prev_actions_t, prev_rewards_t) -> torch.Tensor:
        """Logits ``[B, num_actions]`` of one new step per context (``[B]`` inputs), updating ``state``.

        Equal to the last row of ``forward(..., window=seq_len)`` over the whole context so far."""
        x = self._tokens(states_t, prev_actions_t, prev_rewards_t)
        ids = self.ngram_ids(states_t, prev_actions_t, prev_rewards_t)
        position = torch.full_like(prev_actions_t, state.steps)
        for block, layer_state in zip(self.blocks, state.layers):
            x = block.step(x, position, ids, layer_state)
        state.steps += 1
        return self.action_head(self.final_norm(x))


@torch.no_grad()
def choose_actions(
    logits: torch.Tensor,
    available: torch.Tensor,
    sample: bool,
    generator: torch.Generator | None,
    select_tau: float | None = None,
) -> torch.Tensor:
    """:meth:`ADModel.act`'s choice from ``logits [B, A]`` among ``available [B, A]`` actions: a draw from the
    softmax of ``logits / select_tau`` (``sample``, with ``generator``; ``select_tau=None`` leaves the logits as
    trained, bit for bit) or the argmax. Batched evaluation (:mod:`icrl_models.batched`) calls it per run, with
    that run's generator and temperature, so that each run draws what it draws alone."""
    logits = logits.float().masked_fill(~available, -torch.inf)
    if sample:
        if select_tau is not None:
            logits = logits / select_tau
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
    return logits.argmax(dim=-1)


class ADDecodeState:
    """Per-layer incremental state of :meth:`ADModel.step`: a key/value ring buffer of ``seq_len``
    tokens for attention blocks, an :class:`~icrl_kernels.NGramDecodeState` for n-gram blocks."""

    def __init__(self, model: ADModel, batch: int, max_steps: int) -> None:
        config = model.config
        weight = model.action_head.weight
        self.steps = 0
        self.layers = []
        for block in model.blocks:
            if block.is_ngram:
                self.layers.append(block.mixer.init_decode_state(batch, max_steps))
            else:
                head_dim = config.d_model // config.num_heads
                self.layers.append(
                    KVCache(batch, config.num_heads, config.seq_len, head_dim, weight.device, weight.dtype)
                )


register_decode_state(ADDecodeState, ("layers",))


def action_loss(
    logits: torch.Tensor, batch: dict[str, torch.Tensor], label_smoothing: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Cross-entropy of ``logits [B, L, A]`` against ``batch["actions"]`` over unpadded steps (``batch["mask"]``)."""
    return masked_cross_entropy(logits, batch["actions"], batch["mask"], label_smoothing)


def masked_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, label_smoothing: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Mean cross-entropy (fp32) of ``logits [..., A]`` against ``targets [...]`` over the steps where ``mask
    [...]`` (bool) is True; NaN when no step is.

    Padded steps are left out through ``ignore_index``, not by boolean indexing: ``logits[mask]`` has a
    shape that depends on the mask's values, so on a GPU every training step would wait for the device
    to count them, and the step could not be captured in a CUDA graph.

    ``label_smoothing``: a float, or a 0-d tensor (the per-run value of runs trained as one batched model
    under ``torch.func.vmap``, :mod:`icrl_models.batched`): the same loss as ``F.cross_entropy``'s, written
    out, since ``F.cross_entropy`` takes a Python float only.
    """
    ignored = targets.masked_fill(~mask, _IGNORED)
    flat_logits, flat_targets = logits.flatten(0, -2).float(), ignored.flatten()
    if not isinstance(label_smoothing, torch.Tensor):
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=_IGNORED, label_smoothing=label_smoothing)
    # (1 - e) * NLL(target) + e * mean over classes of -log p, averaged over the unpadded steps.
    log_probs = F.log_softmax(flat_logits, dim=-1)
    kept = flat_targets != _IGNORED
    target_nll = -log_probs.gather(-1, flat_targets.clamp_min(0)[:, None])[:, 0]
    smoothed = (1 - label_smoothing) * target_nll - label_smoothing * log_probs.mean(dim=-1)
    return torch.where(kept, smoothed, 0.0).sum() / kept.sum()


_IGNORED = -100  # cross_entropy's default ignore_index


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "ADConfig", "ADDecodeState", "ADModel", "KVCache", "action_loss", "choose_actions", "count_parameters",
    "masked_cross_entropy", "register_decode_state",
]  # fmt: skip
