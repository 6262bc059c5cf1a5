"""``ActionMap``: Headless-AD's per-step random action map (the paper's ``ActionMapper``), as a module."""

from __future__ import annotations

import torch
from torch import nn

from .._backend import BACKENDS
from .._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_choice,
    check_int,
    check_positive_float,
    check_same_device,
    check_tensor,
    check_values,
)
from ..contrastive import infonce_loss, orthonormal_embeddings, select_actions


class ActionMap(nn.Module):
    """Random orthonormal embeddings of ``num_actions`` action ids, redrawn on demand.

    Headless-AD (Sinii et al.) has no action head: the model predicts an action *embedding*, scored by
    its dot product with every available action's embedding. The embeddings are random and redrawn
    every training step (the model must learn from context, not from the embeddings), and fixed for a
    whole evaluation rollout. This module owns that map and everything done with it.

    Typical training step::

        action_map.regenerate()                            # new map [A, D]
        prev = action_map.embed(batch["prev_actions"])     # [B, T, D], -1 -> zeros
        prompt = action_map.prompt(batch_size)             # [B, A, D] action-set prompt
        pred = model(states, prev, rewards, prompt)        # [B, T, D]
        loss = action_map(pred, batch["actions"], mask=available)   # = action_map.loss(...)

    Args:
        num_actions: size ``A`` of the action-id space (e.g. the largest arm count, or 125);
            :meth:`regenerate` can change it.
        embed_dim: embedding width ``D``; keep ``D >= A`` so the rows are orthonormal.
        tau: temperature of :meth:`loss` and :meth:`select`.
        backend: kernel backend of the scoring ops.

    The map is a non-persistent buffer (``embeddings``): ``[A, D]``, or ``[B, A, D]`` after
    ``regenerate(batch=B)`` (one independent map per sequence). It is not saved in ``state_dict``.
    """

    def __init__(self, num_actions: int, embed_dim: int, *, tau: float = 1.0, backend: str = "auto") -> None:
        super().__init__()
        self.num_actions = check_int(num_actions, "num_actions", min_value=1)
        self.embed_dim = check_int(embed_dim, "embed_dim", min_value=1)
        self.tau = check_positive_float(tau, "tau")
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.register_buffer("embeddings", torch.empty(0, embed_dim), persistent=False)

    @property
    def per_sequence(self) -> bool:
        return self.embeddings.dim() == 3

    @torch.no_grad()
    def regenerate(
        self,
        batch: int | None = None,
        *,
        num_actions: int | None = None,
        generator: torch.Generator | None = None,
        device=None,
    ) -> torch.Tensor:
        """Draw a new map (``batch``: one per sequence) on ``device`` (default: where the module is).

        ``num_actions`` resizes the map (the action set of this batch or rollout); default: unchanged."""
        if num_actions is not None:
            self.num_actions = check_int(num_actions, "num_actions", min_value=1)
        self.embeddings = self.draw(batch, generator=generator, device=device)
        return self.embeddings

    @torch.no_grad()
    def draw(
        self,
        batch: int | None = None,
        *,
        num_actions: int | None = None,
        generator: torch.Generator | None = None,
        device=None,
    ) -> torch.Tensor:
        """A fresh map as :meth:`regenerate` draws it (default ``num_actions``: the current one; default
        ``device``: where the module is), returned without being installed (see :meth:`set_map`)."""
        num_actions = self.num_actions if num_actions is None else check_int(num_actions, "num_actions", min_value=1)
        device = self.embeddings.device if device is None else device
        return orthonormal_embeddings(num_actions, self.embed_dim, batch=batch, generator=generator, device=device)

    def set_map(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Use ``embeddings`` (``[A, D]``, or ``[B, A, D]`` one map per sequence) as the map, as it is (not
        copied): e.g. a map drawn with :func:`~icrl_kernels.orthonormal_embeddings` outside a CUDA-graphed
        training step, whose graph then reads this very tensor on every replay. Sets ``num_actions = A``."""
        check_tensor(embeddings, "embeddings", dtypes=FLOAT_DTYPES)
        if embeddings.dim() not in (2, 3) or embeddings.shape[-1] != self.embed_dim or embeddings.shape[-2] == 0:
            raise ValueError(
                f"embeddings must be [A, {self.embed_dim}] or [B, A, {self.embed_dim}] with A >= 1, "
                f"got shape {tuple(embeddings.shape)}"
            )
        self.num_actions = embeddings.shape[-2]
        self.embeddings = embeddings
        return embeddings

    def _map(self) -> torch.Tensor:
        if self.embeddings.numel() == 0:
            raise RuntimeError("ActionMap has no map yet: call regenerate() first")
        return self.embeddings

    def embed(self, actions: torch.Tensor) -> torch.Tensor:
        """Embeddings of action ids ``[...]`` -> ``[..., D]``; -1 (no previous action) embeds to zeros.

        With per-sequence maps ``actions`` is ``[B, ...]`` and row ``b`` uses map ``b``."""
        check_tensor(actions, "actions", dtypes=INT_DTYPES)
        embeddings = self._map()
        check_same_device(actions=actions, embeddings=embeddings)
        actions = actions.long()
        outside = (actions < -1) | (actions >= self.num_actions)
        check_values(
            outside.any(),
            f"actions must lie in [-1, {self.num_actions})",
            lambda: f", got e.g. {actions[outside][:5].tolist()}",
        )
        index = actions.clamp_min(0)
        if self.per_sequence:
            if actions.dim() == 0 or actions.shape[0] != embeddings.shape[0]:
                raise ValueError(f"actions must be [B, ...] with B = {embeddings.shape[0]} for per-sequence maps")
            flat = index.reshape(index.shape[0], -1)
            picked = torch.gather(embeddings, 1, flat[..., None].expand(-1, -1, self.embed_dim))
            picked = picked.reshape(*actions.shape, self.embed_dim)
        else:
            picked = embeddings[index]
        return picked * (actions >= 0)[..., None].to(picked.dtype)

    def prompt(self, batch_size: int) -> torch.Tensor:
        """The action-set prompt: every action's embedding, ``[batch_size, A, D]`` (a view, no copy)."""
        embeddings = self._map()
        batch_size = check_int(batch_size, "batch_size", min_value=1)
        if self.per_sequence:
            if batch_size != embeddings.shape[0]:
                raise ValueError(f"batch_size must be {embeddings.shape[0]} for per-sequence maps, got {batch_size}")
            return embeddings
        return embeddings.expand(batch_size, -1, -1)

    def loss(
        self, pred: torch.Tensor, targets: torch.Tensor, *, mask: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """:func:`~icrl_kernels.infonce_loss` of ``pred`` against the map (cast to ``pred``'s dtype)."""
        check_tensor(pred, "pred", dtypes=FLOAT_DTYPES)
        embeddings = self._map().to(pred.dtype)
        return infonce_loss(
            pred, embeddings, targets, tau=self.tau, mask=mask, reduction=reduction, backend=self.backend
        )

    @torch.no_grad()
    def select(
        self,
        pred: torch.Tensor,
        *,
        mode: str = "sample",
        mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        tau: float | None = None,
    ) -> torch.Tensor:
        """:func:`~icrl_kernels.select_actions` against the map: action ids of shape ``pred.shape[:-1]``.

        ``tau``: the sampling temperature, default the map's (the training temperature)."""
        check_tensor(pred, "pred", dtypes=FLOAT_DTYPES)
        tau = self.tau if tau is None else check_positive_float(tau, "tau")
        embeddings = self._map().to(pred.dtype)
        return select_actions(
            pred, embeddings, mode=mode, tau=tau, mask=mask, generator=generator, backend=self.backend
        )

    def forward(
        self, pred: torch.Tensor, targets: torch.Tensor, *, mask: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """The training loss, :meth:`loss`: ``action_map(pred, targets)`` is ``action_map.loss(pred, targets)``.

        The forward returns the loss rather than the logits ``pred . e_a / tau`` because the logits are
        what the fused :func:`~icrl_kernels.infonce_loss` exists to never materialise (``[N, A]`` floats,
        with ``A`` up to millions); code that wants them can compute ``pred @ action_map.embeddings.T``.
        Being the forward also makes the loss visible to module hooks and wrappers that only call
        ``forward`` (``torch.compile(action_map)``, forward hooks).

        Args:
            pred: predicted action embeddings ``[N, D]`` or ``[B, T, D]`` (with per-sequence maps
                ``[B, D]`` or ``[B, T, D]``), float.
            targets: integer action ids of shape ``pred.shape[:-1]`` in ``[0, A)`` (``-100`` = padding).
            mask: bool availability, ``[A]``, ``[B, A]`` or ``pred.shape[:-1] + (A,)``.
            reduction: ``"mean"``, ``"sum"`` or ``"none"`` (then ``pred.shape[:-1]``).

        Returns:
            float32 loss, ``[]`` (or ``pred.shape[:-1]`` with ``reduction="none"``), differentiable
            w.r.t. ``pred``.
        """
        return self.loss(pred, targets, mask=mask, reduction=reduction)

    def extra_repr(self) -> str:
        return f"num_actions={self.num_actions}, embed_dim={self.embed_dim}, tau={self.tau}, backend={self.backend!r}"
