"""``LoopedBlock``: a weight-tied GPT-2 block iterated with input injection (looped transformers).

``Y_0 = 0``, ``Y_{t+1} = M(Y_t + P)`` where ``M`` is the loop body (one or more GPT-2 blocks that add a
learned position embedding first and apply a final LayerNorm last, as the official code's GPT-2
backbone does on every loop). Training runs ``b`` loops and keeps the last ``T``: the first ``b - T``
run without autograd, so activation memory is proportional to ``T``, not ``b``.
"""

from __future__ import annotations

import torch
from torch import nn

from .._backend import BACKENDS
from .._validation import (
    check_bool,
    check_choice,
    check_features,
    check_int,
    check_matches_params,
    check_probability,
)
from ..looped import inject_layer_norm
from .gpt2_block import GPT2Block


class LoopedBlock(nn.Module):
    """A weight-tied loop body iterated ``b`` times from ``Y_0 = 0`` with the prompt injected every loop.

    One loop: ``hidden = Y_t + P + pos`` fused with the first block's LayerNorm
    (:func:`icrl_kernels.inject_layer_norm`), the ``n_layers`` causal GPT-2 blocks
    (:class:`~icrl_kernels.modules.gpt2_block.GPT2Block`, GPT-2 parameter names), then ``ln_f``:
    ``Y_{t+1} = ln_f(blocks(Y_t + P + pos))``. With ``loops=1`` this is a plain GPT-2 backbone of
    ``n_layers`` blocks (the unlooped baseline).

    Args:
        d_model: width ``D``.
        n_heads: attention heads (``D`` divisible by it).
        max_positions: rows of the learned position embedding (the longest prompt ``L``).
        n_layers: distinct blocks inside the loop body (the paper's ``L``; 1 for the looped model).
        dropout: dropout inside the blocks (must be 0 to use CUDA graphs while training).
        cuda_graph: on CUDA, replay the no-grad loops from a captured CUDA graph of one loop step, so a
            loop costs one graph launch instead of Python and one launch per kernel. Ignored on CPU.
        backend: backend of the fused injection op (``"auto"``, ``"triton"``, ``"eager"``, ``"reference"``).

    Shapes:
        ``prompt [B, L, D]`` -> ``[T, B, L, D]`` (the last ``T`` iterates ``Y_{b-T+1} .. Y_b``), or
        ``[T, B, L, *]`` after ``read_out``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        max_positions: int,
        *,
        n_layers: int = 1,
        dropout: float = 0.0,
        cuda_graph: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.d_model = check_int(d_model, "d_model", min_value=1)
        self.max_positions = check_int(max_positions, "max_positions", min_value=1)
        check_int(n_layers, "n_layers", min_value=1)
        check_probability(dropout, "dropout")
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.cuda_graph = check_bool(cuda_graph, "cuda_graph")
        self.wpe = nn.Embedding(max_positions, d_model)
        self.blocks = nn.ModuleList(GPT2Block(d_model, n_heads, dropout=dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self._graphs: dict[tuple, _GraphedLoopStep] = {}

    def _check_prompt(self, prompt: torch.Tensor) -> None:
        """``prompt [B, L, D]``: a float tensor, ``D = d_model``, ``L <= max_positions``, the parameters' dtype."""
        check_features(prompt, "prompt", self.d_model)
        if prompt.shape[1] > self.max_positions:
            raise ValueError(f"prompt length {prompt.shape[1]} exceeds max_positions={self.max_positions}")
        check_matches_params(prompt, "prompt", self.wpe.weight)

    def step(self, y: torch.Tensor | None, prompt: torch.Tensor) -> torch.Tensor:
        """One loop: ``Y_{t+1} = ln_f(blocks(Y_t + P + pos))`` (``y=None`` is ``Y_0 = 0``); ``[B, L, D]``.

        ``y`` must have ``prompt``'s shape; errors name ``prompt`` or ``y``."""
        self._check_prompt(prompt)
        return self._step(y, prompt)

    def _step(self, y: torch.Tensor | None, prompt: torch.Tensor) -> torch.Tensor:
        # Unchecked: the loops check the prompt once, not once per iteration.
        first = self.blocks[0]
        pos = self.wpe.weight[: prompt.shape[1]]
        if y is not None and y.dtype != prompt.dtype:
            y = y.to(prompt.dtype)  # autocast runs ln_f in fp32; the injection op takes one activation dtype
        hidden, normed = inject_layer_norm(
            y, prompt, pos, first.ln_1.weight, first.ln_1.bias, eps=first.ln_1.eps, backend=self.backend
        )
        h = first(hidden, normed=normed)
        for block in self.blocks[1:]:
            h = block(h)
        return self.ln_f(h)

    def forward(
        self,
        prompt: torch.Tensor,
        *,
        loops: int,
        grad_loops: int | None = None,
        read_out: nn.Module | None = None,
    ) -> torch.Tensor:
        """Run ``loops`` iterations from ``Y_0 = 0`` and return the last ``grad_loops`` iterates.

        Args:
            prompt: the embedded prompt ``P``, ``[B, L, D]`` with ``L <= max_positions``.
            loops: ``b >= 1``, the number of iterations.
            grad_loops: ``T`` in ``[1, b]`` (default ``b``): only these last iterations record autograd
                (memory proportional to ``T``); the first ``b - T`` run under ``torch.no_grad``.
            read_out: applied to each returned iterate (e.g. the prediction head), so only read-outs are
                stacked.

        Returns:
            ``[T, B, L, D]``, or ``[T, B, L, *]`` with ``read_out``.
        """
        self._check_prompt(prompt)
        loops = check_int(loops, "loops", min_value=1)
        grad_loops = loops if grad_loops is None else check_int(grad_loops, "grad_loops", min_value=1)
        if grad_loops > loops:
            raise ValueError(f"grad_loops ({grad_loops}) must be <= loops ({loops})")
        _check_read_out(read_out)
        y = self._run_without_grad(prompt, loops - grad_loops)
        outputs = []
        for _ in range(grad_loops):
            y = self._step(y, prompt)
            outputs.append(y if read_out is None else read_out(y))
        return torch.stack(outputs)

    def iterates(self, prompt: torch.Tensor, loops: int, read_out: nn.Module | None = None):
        """Yield ``Y_1 .. Y_loops`` (or their read-outs) without autograd: for evaluating many loops cheaply.

        Arguments are checked at the call, not at the first ``next()``."""
        self._check_prompt(prompt)
        loops = check_int(loops, "loops", min_value=1)
        _check_read_out(read_out)
        return self._iterates(prompt, loops, read_out)

    def _iterates(self, prompt: torch.Tensor, loops: int, read_out: nn.Module | None):
        y = None
        with torch.no_grad():
            for _ in range(loops):
                y = self._step(y, prompt)
                yield y if read_out is None else read_out(y)

    def run_without_grad(self, prompt: torch.Tensor, loops: int) -> torch.Tensor | None:
        """``Y_loops`` computed under ``torch.no_grad`` (``None`` for zero loops, i.e. ``Y_0 = 0``)."""
        self._check_prompt(prompt)
        return self._run_without_grad(prompt, check_int(loops, "loops", min_value=0))

    def _run_without_grad(self, prompt: torch.Tensor, loops: int) -> torch.Tensor | None:
        if loops == 0:
            return None
        if self.cuda_graph and prompt.is_cuda:
            return self._graphed(prompt).run(prompt, loops)
        y = None
        with torch.no_grad():
            for _ in range(loops):
                y = self._step(y, prompt)
        return y

    def _graphed(self, prompt: torch.Tensor) -> _GraphedLoopStep:
        autocast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        key = (tuple(prompt.shape), prompt.dtype, prompt.device, autocast, self.training)
        if self.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.modules()):
            raise ValueError("cuda_graph=True needs dropout=0 while training (a graph would replay one mask)")
        if key not in self._graphs:
            self._graphs[key] = _GraphedLoopStep(self, prompt)
        return self._graphs[key]


def _check_read_out(read_out: object) -> None:
    if read_out is not None and not callable(read_out):
        raise TypeError(f"read_out must be a module or callable, got {type(read_out).__name__}")


class _GraphedLoopStep:
    """A CUDA graph of one no-grad loop step that updates a static iterate in place.

    Replaying it ``n`` times advances ``Y`` by ``n`` loops with one launch per loop. Parameters are read
    from their storage at replay time, so optimiser steps (in place) are seen without recapture.
    """

    def __init__(self, block: LoopedBlock, prompt: torch.Tensor) -> None:
        self.prompt = prompt.detach().clone()
        self.y = torch.zeros_like(self.prompt)
        side = torch.cuda.Stream(device=prompt.device)
        side.wait_stream(torch.cuda.current_stream(prompt.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):  # warm-up outside capture: Triton compilation, cuBLAS workspaces
                self.y.copy_(block._step(self.y, self.prompt))
        torch.cuda.current_stream(prompt.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.y.copy_(block._step(self.y, self.prompt))

    def run(self, prompt: torch.Tensor, loops: int) -> torch.Tensor:
        self.prompt.copy_(prompt.detach())
        self.y.zero_()  # Y_0 = 0: the first step then equals step(None, prompt)
        for _ in range(loops):
            self.graph.replay()
        return self.y.clone()
