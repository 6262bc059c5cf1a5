"""Headless-AD (Sinii et al., 2024): Algorithm Distillation for variable action spaces.

AD's action head fixes the number and the meaning of actions. Headless-AD removes it:

* **Random action embeddings.** Actions are represented by a random orthonormal map
  (:class:`~icrl_kernels.ActionMap`), redrawn at every training step and fixed for a whole rollout,
  so the model cannot learn what any particular action means; it must infer it from the context.
* **Predicted embeddings, contrastive loss.** The model outputs a vector ``[E]``; the probability
  of action ``a`` is ``softmax_a(pred . e_a / tau)`` over the available actions, trained with the
  fused InfoNCE loss (:func:`~icrl_kernels.infonce_loss`) and acted on by
  :func:`~icrl_kernels.select_actions`.
* **Action-set prompt.** The embeddings of all available actions are prepended to the context.

Actions are *local indices* into an environment's action set (position ``i`` of the set), the
convention of the paper's code: ``i`` gets the map's ``i``-th embedding.

Prompt tokens form a set. They carry no position, attend to each other (all of them) and never to
steps; step tokens attend to every available prompt token without any positional signal and
causally to earlier steps with rotary embeddings (RoPE). Both kinds of score come from one
attention call by widening the heads: ``q' = [q, rot(q)]``, prompt keys ``[k, 0]``, step keys
``[0, rot(k)]`` (:class:`PromptedSelfAttention`). The model is therefore exactly equivariant to
reordering the action set, and decodes incrementally with a key/value cache (the prompt is a fixed
prefix), equal to ``forward(..., window=seq_len)``.

Step tokens (``step_tokens``): ``"joint"`` (default), one token per step as in our AD: the state, the
previous action's embedding (zeros before the first action) and the previous reward, concatenated and
projected. ``"separate"``, as the paper's code: three tokens per step, the previous action, the previous
reward and the state, in that order, each embedded on its own; positions count tokens, and the action is
read at the state token. Three times the tokens: about 3x the MLP and 9x the attention work.
Experimental: at the CPU preset's size (Bernoulli, 2 blocks, 1500 steps) it predicts Thompson sampling's
actions as well as the joint model (teacher-forced) but ignores the rewards: shuffling them changes its
loss by ~0 nats (:func:`icrl_models.analysis.reward_dependence`), so it imitates its context's action
frequencies, and in a rollout it reinforces its own first random pulls and scores at the random level
(see the ablations in ``benchmarks/results/README.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from icrl_kernels import ActionMap
from icrl_kernels.validation import check_generator, check_int

from .._checks import check_float
from .ad import ADModel, Block, CausalSelfAttention, KVCache, check_backbone_fields, register_decode_state

#: How a step becomes tokens: one joint token, or separate action, reward and state tokens.
STEP_TOKENS = ("joint", "separate")


@dataclass
class HeadlessADConfig:
    """Model settings (Headless-AD paper, Table 3); learning rate etc. live in the training config."""

    num_states: int = 81
    #: > 0: observations are float vectors of this width (contextual bandits), embedded linearly.
    observation_dim: int = 0
    #: Width ``E`` of the random action embeddings; keep it >= the largest action set (orthonormal rows).
    embed_dim: int = 64
    seq_len: int = 100
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 4
    #: InfoNCE temperature; divides the similarity.
    tau: float = 1.0
    #: Temperature of action sampling (evaluation); ``None``: ``tau``. The model learns its probabilities
    #: on the training arm counts; on more actions the same logit gaps leave more mass on the others, and
    #: sampling colder keeps it on the predicted action (the paper's code samples at 1 with ``tau`` 1.34).
    select_tau: float | None = None
    #: Prepend the action-set prompt (the paper's "prompt ablation" sets this False).
    action_prompt: bool = True
    #: "joint": one token per step; "separate": action, reward and state tokens (see the module docstring).
    step_tokens: str = "joint"
    pre_norm: bool = True
    qk_norm: bool = False
    embedding_dropout: float = 0.0
    residual_dropout: float = 0.0
    attention_dropout: float = 0.0
    #: Kernel backend of the scoring ops: "auto", "triton", "eager" or "reference".
    backend: str = "auto"

    @property
    def tokens_per_step(self) -> int:
        return 1 if self.step_tokens == "joint" else 3

    def __post_init__(self) -> None:
        check_backbone_fields(self)
        check_int(self.embed_dim, "embed_dim", min_value=1)
        check_int(self.num_layers, "num_layers", min_value=1)
        if not check_float(self.tau, "tau") > 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if self.step_tokens not in STEP_TOKENS:
            raise ValueError(f"step_tokens must be one of {STEP_TOKENS}, got {self.step_tokens!r}")
        if self.select_tau is not None and not check_float(self.select_tau, "select_tau") > 0:
            raise ValueError(f"select_tau must be > 0 (or None: tau), got {self.select_tau}")


def prompt_attention_mask(prompt_valid: torch.Tensor, steps: int, window: int | None) -> torch.Tensor:
    """``[B, 1, P + L, P + L]`` bool: prompt tokens see valid prompt tokens; step ``i`` sees valid prompt
    tokens and steps ``j`` with ``i - window < j <= i``."""
    batch, prompt_length = prompt_valid.shape
    offsets = torch.arange(steps, device=prompt_valid.device)
    distance = offsets[:, None] - offsets[None, :]
    causal = (distance >= 0) & (distance < (steps if window is None else window))
    sees_prompt = prompt_valid[:, None, :]
    top = torch.cat(
        [sees_prompt.expand(batch, prompt_length, prompt_length), prompt_valid.new_zeros(batch, prompt_length, steps)],
        dim=2,
    )
    bottom = torch.cat([sees_prompt.expand(batch, steps, prompt_length), causal.expand(batch, steps, steps)], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]


class PromptedSelfAttention(CausalSelfAttention):
    """Self-attention over ``[prompt; steps]``: a position-free prompt set, then causal RoPE steps."""

    def forward(self, z: torch.Tensor, prompt_valid: torch.Tensor, positions: torch.Tensor, window=None):
        """``z [B, P + L, D]`` (the ``P`` prompt tokens first), ``prompt_valid [B, P]``, ``positions [B, L]``."""
        prompt_length = prompt_valid.shape[1]
        if prompt_length == 0:
            return super().forward(z, positions, window)
        batch, total, width = z.shape
        q, k, v = self._heads(z)
        q_steps, k_steps = self._rotate(positions, q[:, prompt_length:], k[:, prompt_length:])
        zeros_prompt = torch.zeros_like(q[:, :prompt_length])
        zeros_steps = torch.zeros_like(q_steps)
        wide_q = torch.cat([q, torch.cat([zeros_prompt, q_steps], dim=1)], dim=-1)  # prompt queries: [q, 0]
        wide_k = torch.cat(
            [torch.cat([k[:, :prompt_length], zeros_prompt], dim=-1), torch.cat([zeros_steps, k_steps], dim=-1)], dim=1
        )
        mask = prompt_attention_mask(prompt_valid, total - prompt_length, window)
        # Values padded to the widened key width: fused SDPA kernels need one head width for q, k and v
        # (on a CPU the unfused fallback was 16x slower at L = 300).
        wide_v = F.pad(v, (0, self.head_dim))
        y = F.scaled_dot_product_attention(
            wide_q.transpose(1, 2), wide_k.transpose(1, 2), wide_v.transpose(1, 2),
            attn_mask=mask, dropout_p=self.attention_dropout if self.training else 0.0,
            scale=1.0 / math.sqrt(self.head_dim),
        )[..., : self.head_dim]  # fmt: skip
        return self.out(y.transpose(1, 2).reshape(batch, total, width))

    def prompt_keys_values(self, h_prompt: torch.Tensor):
        """Cache prefix of the (normalised) prompt tokens ``[B, P, D]``: widened keys ``[B, H, P, 2 Dh]``
        and values ``[B, H, P, Dh]``."""
        _, k, v = self._heads(h_prompt)
        wide_k = torch.cat([k, torch.zeros_like(k)], dim=-1)
        return wide_k.transpose(1, 2), v.transpose(1, 2)

    def step(self, x_t: torch.Tensor, position: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new step token per row: ``x_t [B, D]``, ``position [B]`` -> ``[B, D]``, appending to ``cache``."""
        if cache.prefix_length == 0:
            return super().step(x_t, position, cache)
        q, k, v = self._heads(x_t[:, None])
        q_rot, k_rot = self._rotate(position[:, None], q, k)
        wide_q = torch.cat([q, q_rot], dim=-1).transpose(1, 2)  # [B, H, 1, 2 Dh]
        wide_k = torch.cat([torch.zeros_like(k_rot), k_rot], dim=-1)[:, 0]  # [B, H, 2 Dh]
        keys, values, valid = cache.append(wide_k, v[:, 0])
        y = F.scaled_dot_product_attention(
            wide_q, keys, values, attn_mask=valid[:, None, None, :], scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.out(y.reshape(x_t.shape))


class HeadlessADModel(nn.Module):
    """Headless-AD: ``forward(states, prev_actions, prev_rewards, available) -> pred [B, L, E]``.

    Inputs (``[B, L]`` each): ``states`` int ids in ``[0, num_states)`` (or ``[B, L, observation_dim]``
    floats); ``prev_actions`` local action indices, -1 for none; ``prev_rewards`` float.
    ``available [B, A]`` bool marks each sequence's action set (local indices ``0..A-1``; padding False).
    The action map (``self.action_map``) must hold at least ``A`` actions: :meth:`loss` and
    :meth:`init_decode_state` redraw it with exactly ``A``.
    """

    def __init__(self, config: HeadlessADConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.action_map = ActionMap(1, config.embed_dim, tau=config.tau, backend=config.backend)
        if config.observation_dim:
            self.state_embedding = nn.Linear(config.observation_dim, d)
        else:
            self.state_embedding = nn.Embedding(config.num_states, d)
        self.action_embedding = nn.Linear(config.embed_dim, d)
        self.reward_embedding = nn.Linear(1, d)
        self.token_projection = nn.Linear(3 * d, d) if config.step_tokens == "joint" else None
        self.prompt_projection = nn.Linear(config.embed_dim, d) if config.action_prompt else None
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.blocks = nn.ModuleList(
            [Block(config, mixer=PromptedSelfAttention(config)) for _ in range(config.num_layers)]
        )
        self.final_norm = nn.LayerNorm(d) if config.pre_norm else nn.Identity()
        self.prediction_head = nn.Linear(d, config.embed_dim)
        self.apply(ADModel._init_weights)

    @property
    def device(self) -> torch.device:
        return self.prediction_head.weight.device

    def _tokens(self, states, prev_actions, prev_rewards) -> torch.Tensor:
        dtype = self.prediction_head.weight.dtype
        if self.config.observation_dim:
            states = states.to(dtype)
        parts = [
            self.state_embedding(states),
            self.action_embedding(self.action_map.embed(prev_actions).to(dtype)),
            self.reward_embedding(prev_rewards[..., None].to(dtype)),
        ]
        if self.token_projection is None:  # [..., 3, D]: previous action, previous reward, state
            return self.embedding_dropout(torch.stack([parts[1], parts[2], parts[0]], dim=-2))
        return self.embedding_dropout(self.token_projection(torch.cat(parts, dim=-1)))

    def _prompt(self, available: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected prompt tokens ``[B, P, D]`` and their validity ``[B, P]`` (``P = 0`` without prompt)."""
        batch, num_actions = available.shape
        if self.action_map.num_actions < num_actions:
            raise ValueError(
                f"the action map holds {self.action_map.num_actions} actions but available has {num_actions}: "
                "regenerate it (the model's loss and init_decode_state do)"
            )
        if self.prompt_projection is None:
            return available.new_zeros(batch, 0, self.config.d_model, dtype=torch.float), available[:, :0]
        embeddings = self.action_map.prompt(batch)[:, :num_actions].to(self.prediction_head.weight.dtype)
        return self.embedding_dropout(self.prompt_projection(embeddings)), available

    def forward(self, states, prev_actions, prev_rewards, available, *, window: int | None = None) -> torch.Tensor:
        """Predicted action embeddings ``[B, L, E]``. ``window``: each step attends to at most this many
        steps (itself included) plus the prompt; ``None``: the whole prefix."""
        per_step = self.config.tokens_per_step
        x = self._tokens(states, prev_actions, prev_rewards)
        if per_step > 1:
            x = rearrange(x, "b l t d -> b (l t) d")
            window = None if window is None else window * per_step
        prompt, prompt_valid = self._prompt(available)
        tokens = x.shape[1]
        positions = torch.arange(tokens, device=x.device).expand(x.shape[0], tokens)
        z = torch.cat([prompt.to(x.dtype), x], dim=1)
        for block in self.blocks:
            z = block.residual(z, lambda h, block=block: block.mixer(h, prompt_valid, positions, window))
        # The prediction of each step is read at its last token (the state token when tokens are separate).
        return self.prediction_head(self.final_norm(z[:, prompt_valid.shape[1] + per_step - 1 :: per_step]))

    def loss(
        self,
        batch: dict[str, torch.Tensor],
        *,
        generator: torch.Generator | None = None,
        trained: nn.Module = None,
        action_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One training step's loss: draw a new action map, then the InfoNCE loss over each sequence's
        action set on a :func:`~icrl_models.data.local_action_batch` batch; padded steps are ignored.

        ``trained``: the module whose forward runs (this model, default, or its DDP wrapper).
        ``action_map``: the step's map ``[A, embed_dim]`` (``A = batch["available"].shape[1]``), drawn by the
        caller with :meth:`draw_action_map` instead of here (a CUDA-graphed step draws it outside the
        graph: the QR of the draw is no graph-capturable op); ``generator`` is then unused."""
        available = batch["available"]
        if action_map is None:
            check_generator(generator)
            self.action_map.regenerate(num_actions=available.shape[1], generator=generator, device=self.device)
        else:
            self.action_map.set_map(action_map)
        trained = self if trained is None else trained
        pred = trained(batch["states"], batch["local_prev_actions"], batch["prev_rewards"], available)
        targets = batch["local_actions"].masked_fill(~batch["mask"], -100)
        return self.action_map.loss(pred, targets, mask=available)

    def draw_action_map(self, num_actions: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """A fresh random orthonormal action map ``[num_actions, embed_dim]`` on the model's device, drawn
        exactly as :meth:`loss` draws its own (for ``loss(..., action_map=)``)."""
        check_generator(generator)
        return self.action_map.draw(num_actions=num_actions, generator=generator, device=self.device)

    def init_decode_state(
        self, batch: int, max_steps: int, *, available: torch.Tensor, generator: torch.Generator | None = None
    ) -> HeadlessDecodeState:
        """Draw the rollout's action map (one for all rows, as in the paper) and cache the prompt."""
        check_generator(generator)
        self.action_map.regenerate(num_actions=available.shape[1], generator=generator, device=self.device)
        return HeadlessDecodeState(self, available.to(self.device))

    @torch.no_grad()
    def step(self, state: HeadlessDecodeState, states_t, prev_actions_t, prev_rewards_t) -> torch.Tensor:
        """Predicted embedding ``[B, E]`` of one new step per row, updating ``state``; equal to the last row
        of ``forward(..., window=seq_len)`` over the context so far."""
        per_step = self.config.tokens_per_step
        tokens = self._tokens(states_t, prev_actions_t, prev_rewards_t)
        tokens = tokens[:, None] if per_step == 1 else tokens  # [B, T, D]
        for index in range(per_step):
            x = tokens[:, index]
            position = torch.full(x.shape[:1], state.steps * per_step + index, device=x.device, dtype=torch.long)
            for block, cache in zip(self.blocks, state.layers):
                x = block.residual(x, lambda h, b=block, c=cache, p=position: b.mixer.step(h, p, c))
        state.steps += 1
        return self.prediction_head(self.final_norm(x))

    @torch.no_grad()
    def act(
        self, state: HeadlessDecodeState, states_t, prev_actions_t, prev_rewards_t, *, available, sample, generator
    ) -> torch.Tensor:
        """Actions ``[B]`` (local indices) for one new step: Gumbel-max sampling or argmax of the similarity
        to the available actions' embeddings."""
        pred = self.step(state, states_t, prev_actions_t, prev_rewards_t)
        mode = "sample" if sample else "argmax"
        return self.action_map.select(pred, mode=mode, mask=available, generator=generator, tau=self.config.select_tau)


class HeadlessDecodeState:
    """Per-layer key/value caches of :meth:`HeadlessADModel.step`: the prompt's keys and values as a
    fixed prefix, then a ring of ``seq_len`` steps."""

    def __init__(self, model: HeadlessADModel, available: torch.Tensor) -> None:
        config = model.config
        head_dim = config.d_model // config.num_heads
        batch = available.shape[0]
        weight = model.prediction_head.weight
        prompt, prompt_valid = model._prompt(available)
        prompt = prompt.to(weight.dtype)
        self.steps = 0
        self.layers: list[KVCache] = []
        no_steps = torch.zeros(batch, 0, dtype=torch.long, device=weight.device)  # prompt-only positions
        with torch.no_grad():
            for block in model.blocks:
                mixer = block.mixer
                prefix = None
                if prompt_valid.shape[1]:
                    keys, values = mixer.prompt_keys_values(block.norm1(prompt) if block.pre_norm else prompt)
                    prefix = (keys, values, prompt_valid)
                    prompt = block.residual(prompt, lambda h, m=mixer: m(h, prompt_valid, no_steps))
                key_dim = 2 * head_dim if prefix is not None else head_dim
                self.layers.append(
                    KVCache(
                        batch,
                        config.num_heads,
                        config.seq_len * config.tokens_per_step,
                        head_dim,
                        weight.device,
                        weight.dtype,
                        key_dim=key_dim,
                        prefix=prefix,
                    )  # fmt: skip
                )


register_decode_state(HeadlessDecodeState, ("layers",))

__all__ = ["HeadlessADConfig", "HeadlessADModel", "HeadlessDecodeState", "PromptedSelfAttention"]
