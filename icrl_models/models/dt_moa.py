"""Decision Transformer on a GPT-2 backbone with Mixture-of-Attention gates (GPT2-DTMA).

A Decision Transformer (Chen et al., 2021) reads a trajectory as tokens ``(R_0, s_0, a_0, R_1, s_1,
a_1, ...)``: the return-to-go ``R_t`` (the sum of the episode's rewards from step ``t`` on, a target
at evaluation time), the state and the action. Each token is embedded by its own map, the step's
timestep embedding is added to all three, the stack goes through LayerNorm (the official DT's
``embed_ln``), GPT-2's learned position embedding ``wpe`` and a GPT-2 stack (nanoGPT-style pre-LN
blocks: ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, tanh GELU, 4x MLP, final ``ln_f``), and the
action head reads the hidden state of each **state** token to predict that step's action.

GPT2-DTMA (the Markov-heads paper, Section 4.2) gates the attention heads of chosen layers
(``moa_layers``; layer 0 as in the official code) with :class:`~icrl_kernels.MoAAttention`:
``y = W_O concat_h(G_h(e) head_h)``, ``G = softmax(W_g e)`` over heads, ``e`` the block's
normalised input. Other layers are plain GPT-2 attention (``gate=None``). A GPT-2 checkpoint from a
local directory loads with :meth:`DecisionTransformerMoA.load_gpt2` (:mod:`icrl_models.gpt2_checkpoint`).

Here states and actions are discrete (grid worlds): a state id is embedded by one table per part of
a packed id (``state_sizes``, least significant first; e.g. ``(81, 81)`` for ``cell + 81 * goal``
in :class:`~icrl_models.envs.VisibleGoalDarkRoom`), the parts' embeddings summed; actions by a table;
the return-to-go linearly, divided by ``rtg_scale``.

Analysis hooks for the Markov-head experiment: :meth:`~DecisionTransformerMoA.gate_weights` (mean
MoA weight per layer and head), :meth:`~DecisionTransformerMoA.head_importance` (zero-ablation, the
paper's ``||a - a_(-i)||_2``), and :meth:`~DecisionTransformerMoA.markov_init_` (heads whose
``W_q W_k^T`` is a Markov matrix by construction, Definition 4.1).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from icrl_kernels import BACKENDS
from icrl_kernels.modules import ATTENTION_IMPLEMENTATIONS, GPT2Block
from icrl_kernels.validation import check_generator, check_values

from ..data.histories import LearningHistories
from ..envs.base import BatchedEnv, as_index_array
from .ad import masked_cross_entropy

MOA_GATES = ("softmax", "sigmoid", "linear")
TOKENS_PER_STEP = 3  # return-to-go, state, action
STATE_TOKEN = 1


@dataclass
class DTMoAConfig:
    """Model settings (GPT-2 names for the backbone: ``n_layer``, ``n_head``, ``n_embd``, ``n_positions``)."""

    #: Radices of the packed discrete state id, least significant first; one embedding table each.
    state_sizes: tuple[int, ...] = (81,)
    num_actions: int = 5
    #: Steps per training window (the paper's ``k``); ``3 * context_len`` tokens.
    context_len: int = 20
    #: Rows of the timestep embedding (the longest episode).
    max_timestep: int = 64
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128
    #: Rows of ``wpe`` (GPT-2: 1024); at least ``3 * context_len``.
    n_positions: int = 1024
    #: Layers whose attention is MoA-gated; the others are plain GPT-2 attention.
    moa_layers: tuple[int, ...] = (0,)
    #: Gate of the MoA layers: "softmax" (the paper), "sigmoid" or "linear" (the official code).
    gate: str = "softmax"
    #: GPT-2's embd/attn/resid dropout.
    dropout: float = 0.1
    layer_norm_epsilon: float = 1e-5
    #: Returns-to-go are divided by this before their linear embedding.
    rtg_scale: float = 1.0
    #: Kernel backend of the MoA gating op ("auto", "triton", "eager", "reference").
    backend: str = "auto"
    #: Attention of the MoA layers: "sdpa" (PyTorch's SDPA, then the gating op) or "fused" (one
    #: ``gated_attention`` kernel with the gate in its epilogue; needs ``dropout=0``, and takes no head masks,
    #: so head ablations need "sdpa"). Plain layers always use SDPA.
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        self.state_sizes = tuple(int(n) for n in self.state_sizes)
        self.moa_layers = tuple(sorted({int(i) for i in self.moa_layers}))
        for name in ("num_actions", "context_len", "max_timestep", "n_layer", "n_head", "n_embd", "n_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.state_sizes or min(self.state_sizes) < 1:
            raise ValueError(f"state_sizes must be non-empty positive ints, got {self.state_sizes}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if TOKENS_PER_STEP * self.context_len > self.n_positions:
            raise ValueError(f"3 * context_len ({3 * self.context_len}) exceeds n_positions ({self.n_positions})")
        if any(not 0 <= i < self.n_layer for i in self.moa_layers):
            raise ValueError(f"moa_layers must lie in [0, {self.n_layer}), got {self.moa_layers}")
        if self.gate not in MOA_GATES:
            raise ValueError(f"gate must be one of {MOA_GATES}, got {self.gate!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rtg_scale <= 0:
            raise ValueError(f"rtg_scale must be > 0, got {self.rtg_scale}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
        if self.attention == "fused" and self.dropout > 0:
            raise ValueError(
                f"attention='fused' needs dropout=0 (its kernel has no attention dropout), got {self.dropout}"
            )

    @property
    def num_states(self) -> int:
        return math.prod(self.state_sizes)

    @classmethod
    def from_gpt2(cls, directory: str | os.PathLike, **overrides) -> DTMoAConfig:
        """A config whose backbone matches the GPT-2 checkpoint in ``directory`` (``config.json``:
        ``n_layer``, ``n_head``, ``n_embd``, ``n_positions``, ``layer_norm_epsilon``). ``overrides`` set
        the other fields, and ``n_layer`` may be lowered to use the first layers only (as LaMo does)."""
        from ..gpt2_checkpoint import read_gpt2_config

        gpt2 = read_gpt2_config(directory)
        settings = {name: gpt2[name] for name in ("n_layer", "n_head", "n_embd", "n_positions", "layer_norm_epsilon")}
        settings.update(overrides)
        return cls(**settings)


class DecisionTransformerMoA(nn.Module):
    """GPT2-DTMA: ``forward(rtg, states, actions, timesteps) -> logits [B, T, num_actions]``.

    Inputs (``[B, T]`` each, ``T <= n_positions / 3``): ``rtg`` float returns-to-go (unscaled),
    ``states`` int ids in ``[0, prod(state_sizes))``, ``actions`` int in ``[0, num_actions)`` (the
    last step's action may be anything: only later tokens see it), ``timesteps`` int in
    ``[0, max_timestep)``. ``logits[:, t]`` predicts ``actions[:, t]`` from ``R_0, s_0, a_0, ..., R_t, s_t``.
    """

    def __init__(self, config: DTMoAConfig) -> None:
        super().__init__()
        self.config = config
        d = config.n_embd
        self.embed_timestep = nn.Embedding(config.max_timestep, d)
        self.embed_return = nn.Linear(1, d)
        self.embed_state = nn.ModuleList(nn.Embedding(size, d) for size in config.state_sizes)
        self.embed_action = nn.Embedding(config.num_actions, d)
        self.embed_ln = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.wpe = nn.Embedding(config.n_positions, d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            GPT2Block(d, config.n_head, gate=config.gate if i in config.moa_layers else None, dropout=config.dropout,
                      eps=config.layer_norm_epsilon, backend=config.backend,
                      attention=config.attention if i in config.moa_layers else "sdpa")
            for i in range(config.n_layer)
        )  # fmt: skip
        self.ln_f = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.action_head = nn.Linear(d, config.num_actions)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 n_layer) (nanoGPT does the same).
        for name, parameter in self.named_parameters():
            if name.endswith("attn.out_proj.weight") or name.endswith("mlp.c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation; it also makes the MoA gates start near uniform (small gate logits).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # -- the forward pass --------------------------------------------------------------------------
    def _check_inputs(self, rtg, states, actions, timesteps) -> None:
        c = self.config
        shape = states.shape
        if states.dim() != 2 or any(t.shape != shape for t in (rtg, actions, timesteps)):
            raise ValueError(
                "rtg, states, actions and timesteps must all be [B, T], got shapes "
                f"{[tuple(t.shape) for t in (rtg, states, actions, timesteps)]}"
            )
        if TOKENS_PER_STEP * shape[1] > c.n_positions:
            raise ValueError(f"T = {shape[1]} steps need {3 * shape[1]} positions, the model has {c.n_positions}")
        for name, tensor, high in (
            ("states", states, c.num_states), ("actions", actions, c.num_actions),
            ("timesteps", timesteps, c.max_timestep),
        ):  # fmt: skip
            if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor, got {tensor.dtype}")
            # A device-side check on CUDA: reading min/max on the host would make every step wait for the GPU.
            check_values(
                ((tensor < 0) | (tensor >= high)).any(),
                f"{name} must lie in [0, {high})",
                lambda t=tensor: f", got [{int(t.min())}, {int(t.max())}]",
            )

    def embed(self, rtg, states, actions, timesteps) -> torch.Tensor:
        """Token embeddings ``[B, 3T, D]`` in the order ``(R_t, s_t, a_t)`` per step, after ``embed_ln``,
        ``wpe`` and dropout: the input of the first block."""
        batch, steps = states.shape
        time = self.embed_timestep(timesteps)
        dtype = self.embed_return.weight.dtype
        returns = self.embed_return((rtg.to(dtype) / self.config.rtg_scale)[..., None])
        state_emb = 0
        remainder = states
        for size, table in zip(self.config.state_sizes, self.embed_state):
            state_emb = state_emb + table(remainder % size)
            remainder = remainder // size
        tokens = torch.stack([returns, state_emb, self.embed_action(actions)], dim=2) + time[:, :, None]
        tokens = self.embed_ln(tokens.reshape(batch, TOKENS_PER_STEP * steps, -1))
        positions = torch.arange(TOKENS_PER_STEP * steps, device=states.device)
        return self.drop(tokens + self.wpe(positions))

    def forward(
        self,
        rtg: torch.Tensor,
        states: torch.Tensor,
        actions: torch.Tensor,
        timesteps: torch.Tensor,
        *,
        head_masks: dict[int, torch.Tensor] | None = None,
        return_gates: bool = False,
    ):
        """Action logits ``[B, T, num_actions]`` read at the state tokens.

        Args:
            head_masks: ``layer -> [H]`` float multipliers of that layer's heads (0 zero-ablates a head).
            return_gates: also return ``layer -> [B, 3T, H]`` normalised MoA weights of the gated layers.
        """
        self._check_inputs(rtg, states, actions, timesteps)
        x = self.embed(rtg, states, actions, timesteps)
        gates = {}
        for index, block in enumerate(self.blocks):
            x, layer_gates = block(
                x, head_mask=None if head_masks is None else head_masks.get(index), return_gates=True
            )
            if layer_gates is not None:
                gates[index] = layer_gates
        logits = self.action_head(self.ln_f(x[:, STATE_TOKEN::TOKENS_PER_STEP]))
        return (logits, gates) if return_gates else logits

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of the predicted actions over the unpadded steps of a :class:`TrajectoryWindows` batch."""
        logits = self(batch["rtg"], batch["states"], batch["actions"], batch["timesteps"])
        return masked_cross_entropy(logits, batch["actions"], batch["mask"])

    # -- analysis ----------------------------------------------------------------------------------
    @torch.no_grad()
    def gate_weights(self, batch: dict[str, torch.Tensor], *, tokens: str = "all") -> dict[int, torch.Tensor]:
        """Mean MoA weight of every head of every gated layer over a batch: ``layer -> [H]`` (fp32).

        ``tokens``: average over every unpadded token (``"all"``) or the state tokens only
        (``"state"``, where the action is read). Dropout is off while measuring.
        """
        if tokens not in ("all", "state"):
            raise ValueError(f"tokens must be 'all' or 'state', got {tokens!r}")
        with _eval_mode(self):
            _, gates = self(batch["rtg"], batch["states"], batch["actions"], batch["timesteps"], return_gates=True)
        mask = batch["mask"]
        out = {}
        for layer, weights in gates.items():
            per_step = weights.float().unflatten(1, (-1, TOKENS_PER_STEP))  # [B, T, 3, H]
            if tokens == "state":
                per_step = per_step[:, :, STATE_TOKEN : STATE_TOKEN + 1]
            out[layer] = per_step[mask].mean(dim=(0, 1))
        return out

    @torch.no_grad()
    def head_importance(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Zero-ablation importance ``[n_layer, H]``: the mean over unpadded steps of ``||a - a_(-i)||_2``,
        ``a`` the predicted action distribution (softmax) and ``a_(-i)`` the same with head ``i`` of that
        layer zeroed (its gate weight set to 0 after normalisation in gated layers). The paper's
        importance score, with its continuous action replaced by the action distribution."""
        config = self.config
        inputs = (batch["rtg"], batch["states"], batch["actions"], batch["timesteps"])
        mask = batch["mask"]
        importance = torch.zeros(config.n_layer, config.n_head)
        with _eval_mode(self):
            probs = self(*inputs).float().softmax(-1)[mask]
            for layer in range(config.n_layer):
                for head in range(config.n_head):
                    head_mask = torch.ones(config.n_head, device=probs.device)
                    head_mask[head] = 0.0
                    ablated = self(*inputs, head_masks={layer: head_mask}).float().softmax(-1)[mask]
                    importance[layer, head] = (probs - ablated).norm(dim=-1).mean().cpu()
        return importance

    @torch.no_grad()
    def markov_init_(
        self,
        layer: int,
        heads,
        *,
        scale: float = 1.0,
        noise_std: float = 0.02,
        generator: torch.Generator | None = None,
    ) -> None:
        """Make ``heads`` of ``layer`` Markov heads by construction (Definition 4.1 of the paper).

        Head ``h``'s query and key maps become ``W_q^h = W_k^h = scale * S + noise`` with ``S [D, Dh]``
        the 0/1 matrix ``S[i, j] = 1`` iff ``i mod Dh == j``: then ``M = W_q W_k^T`` has every diagonal
        entry near ``scale^2`` and off-diagonal ones near ``scale^2`` only for the ``D / Dh - 1`` other
        indices of the same residue class (near 0 elsewhere), so ``mean|diag| / mean|offdiag|`` is about
        ``(D - 1) / (D / Dh - 1)`` (21 at D = 64, H = 4; 70 for GPT-2 small's 768 / 12), well above
        the default ``r = ln(D - 1) + 1``. Such a head scores ``q_i . k_j`` as a dot product of
        group-summed inputs, which is largest for the token itself: it attends to the last input token,
        the behaviour of GPT-2's Markov heads. The heads' ``q, k`` biases are zeroed; ``v`` is untouched.
        """
        check_generator(generator)
        attn = self.blocks[layer].attn
        d, head_dim = attn.d_model, attn.head_dim
        pattern = (torch.arange(d)[:, None] % head_dim == torch.arange(head_dim)[None, :]).float()  # [D, Dh]
        weight = attn.qkv.weight  # [3D (+ H), D]: rows [q | k | v (| gate)]; head h at rows h*Dh:(h+1)*Dh of each
        for head in [int(h) for h in heads]:
            if not 0 <= head < attn.n_heads:
                raise ValueError(f"head {head} out of range for {attn.n_heads} heads")
            for part in (0, 1):  # q, k
                rows = slice(part * d + head * head_dim, part * d + (head + 1) * head_dim)
                noise = torch.randn(d, head_dim, generator=generator) * noise_std
                weight[rows] = (scale * pattern + noise).t().to(weight)
                if attn.qkv.bias is not None:
                    attn.qkv.bias[rows] = 0.0

    # -- GPT-2 checkpoints -------------------------------------------------------------------------
    def load_gpt2(self, directory: str | os.PathLike, *, strict: bool = True):
        """Load a local Hugging Face GPT-2 checkpoint into the backbone
        (:func:`~icrl_models.gpt2_checkpoint.load_gpt2_weights`); returns its report."""
        from ..gpt2_checkpoint import load_gpt2_weights

        return load_gpt2_weights(self, directory, strict=strict)

    # -- acting ------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(
        self,
        rtg: torch.Tensor,
        states: torch.Tensor,
        actions: torch.Tensor,
        timesteps: torch.Tensor,
        *,
        sample: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Actions ``[B]`` for the last step of contexts ``[B, T]`` (the last ``context_len`` steps are
        used; ``actions[:, -1]`` is a placeholder): a softmax draw (``sample``) or the argmax."""
        check_generator(generator)
        k = self.config.context_len
        rtg, states, actions, timesteps = (t[:, -k:] for t in (rtg, states, actions, timesteps))
        logits = self(rtg, states, actions, timesteps)[:, -1].float()
        if sample:
            return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        return logits.argmax(-1)


class _eval_mode:
    """Temporarily put a module in eval mode (no dropout) and restore its previous mode."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.was_training = module, module.training

    def __enter__(self):
        self.module.eval()

    def __exit__(self, *exc):
        self.module.train(self.was_training)


# --- offline data: windows of single episodes ------------------------------------------------------


class TrajectoryWindows:
    """Decision-Transformer training windows cut from the episodes of :class:`LearningHistories`.

    Every recorded step starts a window of up to ``context_len`` steps that stays inside its episode
    (sampling a start uniformly over steps is the official DT's length-weighted choice of trajectory
    followed by a uniform start). Windows that reach the episode's end are padded at the right;
    the causal mask keeps padding from affecting earlier tokens and ``mask`` drops it from the loss.
    A batch: ``rtg`` (float, the episode's reward from the step on), ``states``, ``actions``,
    ``timesteps`` (step within the episode), ``rewards`` and ``mask``, each ``[B, context_len]``.
    """

    def __init__(self, histories: LearningHistories, context_len: int) -> None:
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        if np.asarray(histories.states).ndim != 2:
            raise ValueError("TrajectoryWindows needs discrete (integer) states")
        self.context_len = int(context_len)
        lengths = np.asarray(histories.lengths)
        valid = np.arange(histories.max_length)[None, :] < lengths[:, None]
        dones = np.asarray(histories.dones, dtype=bool) & valid
        # Flatten the recorded steps, history by history; padding never enters.
        self.states = np.asarray(histories.states)[valid].astype(np.int64)
        self.actions = np.asarray(histories.actions)[valid].astype(np.int64)
        self.rewards = np.asarray(histories.rewards)[valid].astype(np.float32)
        done = dones[valid]
        done[np.cumsum(lengths)[lengths > 0] - 1] = True  # a history's last step ends its last episode
        episode = np.cumsum(done) - done  # episode index of each step
        ends = np.flatnonzero(done) + 1  # one past each episode's last step
        starts = np.concatenate([[0], ends[:-1]])
        self.episode_end = ends[episode]
        self.timesteps = np.arange(done.size) - starts[episode]
        # Return-to-go: the episode's rewards from each step on (a reverse cumulative sum per episode).
        totals = np.cumsum(self.rewards[::-1])[::-1]
        self.rtg = (totals - np.append(totals, 0.0)[self.episode_end]).astype(np.float32)
        self.episode_returns = np.add.reduceat(self.rewards, starts) if done.size else np.zeros(0, np.float32)
        self.max_timestep = int(self.timesteps.max(initial=0)) + 1

    def __len__(self) -> int:
        return int(self.states.size)

    def get_batch(self, starts) -> dict[str, torch.Tensor]:
        """Windows starting at flat step indices ``starts`` (``[B]`` ints in ``[0, len(self))``; others raise
        ``TypeError``/``ValueError`` naming ``starts``)."""
        starts = as_index_array(starts, "starts", low=0, high=len(self))
        if starts.ndim != 1:
            raise ValueError(f"starts must be 1-D, got shape {starts.shape}")
        index = starts[:, None] + np.arange(self.context_len)[None, :]
        mask = index < self.episode_end[starts][:, None]
        index = np.where(mask, index, starts[:, None])  # padding repeats the first step (masked out)
        return {
            "rtg": torch.from_numpy(np.where(mask, self.rtg[index], 0.0).astype(np.float32)),
            "states": torch.from_numpy(np.where(mask, self.states[index], 0)),
            "actions": torch.from_numpy(np.where(mask, self.actions[index], 0)),
            "timesteps": torch.from_numpy(np.where(mask, self.timesteps[index], 0)),
            "rewards": torch.from_numpy(np.where(mask, self.rewards[index], 0.0).astype(np.float32)),
            "mask": torch.from_numpy(mask),
        }

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        return self.get_batch(rng.integers(0, len(self), size=batch_size))


# --- rollouts ----------------------------------------------------------------------------------------


@torch.no_grad()
def rollout_dt(
    model: DecisionTransformerMoA,
    env: BatchedEnv,
    target_returns,
    *,
    num_episodes: int = 1,
    sample: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """Run ``model`` for ``num_episodes`` episodes in every environment of ``env``; ``[N, num_episodes]`` returns.

    Each episode starts a fresh context with return-to-go ``target_returns`` (a scalar or ``[N]``),
    lowered by every reward received (the DT protocol). All environments start together; one whose
    episode ends early (Key-to-Door's door) is reset and stepped on with its results ignored until
    the others finish, since a batched environment steps every environment at once.
    """
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    num_envs = env.num_envs
    targets = np.broadcast_to(np.asarray(target_returns, dtype=np.float32), (num_envs,))
    returns = np.zeros((num_envs, num_episodes))
    for episode in range(num_episodes):
        observations = env.reset()
        finished = np.zeros(num_envs, dtype=bool)
        rtg = [torch.from_numpy(targets.copy())]
        states = [torch.from_numpy(np.asarray(observations, dtype=np.int64))]
        actions: list[torch.Tensor] = []
        for t in range(env.episode_length):
            placeholder = torch.zeros(num_envs, dtype=torch.long)
            context = [
                torch.stack(rtg, 1), torch.stack(states, 1), torch.stack([*actions, placeholder], 1),
                torch.arange(t + 1).expand(num_envs, t + 1),
            ]  # fmt: skip
            chosen = model.act(*(c.to(device) for c in context), sample=sample, generator=generator).cpu()
            result = env.step(chosen.numpy())
            returns[:, episode] += np.where(finished, 0.0, result.rewards)
            finished |= result.terminated | result.truncated
            if finished.all() or t + 1 == env.episode_length:
                break
            ended = np.flatnonzero(result.terminated | result.truncated)
            observations = env.reset(ended) if ended.size else result.observations
            actions.append(chosen)
            rtg.append(rtg[-1] - torch.from_numpy(result.rewards))
            states.append(torch.from_numpy(np.asarray(observations, dtype=np.int64)))
    return returns


def dt_config_dict(config: DTMoAConfig) -> dict:
    """JSON-ready settings of a config."""
    return {
        key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(config).items()
    }


__all__ = [
    "DTMoAConfig",
    "DecisionTransformerMoA",
    "TrajectoryWindows",
    "dt_config_dict",
    "rollout_dt",
]
