"""Looped transformer for in-context function learning (Yang et al., "Looped transformers are better at
learning learning algorithms"), and its unlooped baseline.

The prompt ``(x_1, y_1, ..., x_k, y_k)`` becomes ``2k`` tokens of width ``d`` (a label token is
``[y, 0, ..., 0]``, as in Garg et al.), a linear read-in maps them to width ``D``, the loop body runs
``b`` times with the prompt injected every loop (:class:`icrl_kernels.LoopedBlock`), and a linear
read-out at the x tokens predicts each ``y_i`` from the examples before it. The unlooped baseline is
the same model with ``n_layers`` distinct blocks run once (``loops=1``): a GPT-2 of that depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from icrl_kernels import LoopedBlock


@dataclass
class LoopedConfig:
    """Model shape.

    Args:
        n_dims: input width ``d`` of the function class.
        max_points: the longest prompt in points ``k`` (positions ``2k``).
        d_model: width ``D`` (the paper: 256).
        n_heads: attention heads (the paper: 8).
        n_layers: blocks in the loop body (looped: 1; unlooped baseline: e.g. 12 in the paper).
        dropout: dropout inside blocks.
        backend: backend of the fused injection + LayerNorm op.
        cuda_graph: replay the no-grad loops from a CUDA graph on CUDA.
    """

    n_dims: int = 5
    max_points: int = 10
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 1
    dropout: float = 0.0
    backend: str = "auto"
    cuda_graph: bool = False


def interleave_prompt(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """``xs [B, k, d]``, ``ys [B, k]`` -> tokens ``[B, 2k, d]``: ``x_1, [y_1, 0..], x_2, [y_2, 0..], ...``."""
    label_tokens = torch.zeros_like(xs)
    label_tokens[..., 0] = ys
    return torch.stack([xs, label_tokens], dim=2).flatten(1, 2)


class LoopedTransformer(nn.Module):
    """Read-in, a looped body, read-out at the x tokens.

    ``forward(xs, ys, loops=b, grad_loops=T) -> [T, B, k]``: the predictions of the last ``T`` iterates,
    where entry ``i`` predicts ``y_i`` from ``(x_1, y_1, ..., x_{i-1}, y_{i-1}, x_i)``.
    """

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.config = config
        self.read_in = nn.Linear(config.n_dims, config.d_model)
        self.body = LoopedBlock(
            config.d_model,
            config.n_heads,
            2 * config.max_points,
            n_layers=config.n_layers,
            dropout=config.dropout,
            cuda_graph=config.cuda_graph,
            backend=config.backend,
        )
        self.read_out = nn.Linear(config.d_model, 1)
        # GPT-2's initialisation (normal, std 0.02) inside the backbone only, as in the official code (an
        # HF GPT-2 backbone); read-in and read-out keep PyTorch's default. This matters for looping: with a
        # 0.02 read-in the injected prompt is ~20x smaller than the LayerNormed iterate it is added to, and
        # the model sat on the predict-zero plateau for thousands of steps.
        self.body.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def embed(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        if xs.shape[-1] != self.config.n_dims:
            raise ValueError(f"xs must be [B, k, {self.config.n_dims}], got {tuple(xs.shape)}")
        if xs.shape[1] > self.config.max_points:
            raise ValueError(f"{xs.shape[1]} points exceed max_points={self.config.max_points}")
        return self.read_in(interleave_prompt(xs, ys))

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Read-out at the x tokens: ``[..., 2k, D]`` -> ``[..., k]``."""
        return self.read_out(hidden[..., ::2, :]).squeeze(-1)

    def forward(
        self, xs: torch.Tensor, ys: torch.Tensor, *, loops: int = 1, grad_loops: int | None = None
    ) -> torch.Tensor:
        return self.body(self.embed(xs, ys), loops=loops, grad_loops=grad_loops, read_out=self.predict)

    def loss(self, xs: torch.Tensor, ys: torch.Tensor, *, loops: int = 1, grad_loops: int | None = None):
        """Mean squared error over the last ``T`` iterates and every prefix (the paper's truncated loss)."""
        preds = self(xs, ys, loops=loops, grad_loops=grad_loops)
        return (preds.float() - ys.float()).square().mean()

    @torch.no_grad()
    def predictions_per_loop(self, xs: torch.Tensor, ys: torch.Tensor, loops: int) -> torch.Tensor:
        """``[loops, B, k]``: the prediction after every loop ``1..loops`` (no autograd, iterates not kept)."""
        return torch.stack(list(self.body.iterates(self.embed(xs, ys), loops, read_out=self.predict)))
