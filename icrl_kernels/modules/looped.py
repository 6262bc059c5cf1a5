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
        cuda_graph: on CUDA, replay the no-grad loops (``forward``'s first ``b - T``, ``run_without_grad``
            and ``iterates``) from captured CUDA graphs of ``graph_chunk`` loops each, so ``graph_chunk``
            loops cost one graph launch instead of Python and one launch per kernel. Ignored on CPU, while
            a CUDA graph is being captured (the loops are then part of the caller's graph) and under
            ``torch.compile``.
        graph_chunk: loops per captured graph (``C``): ``n`` loops replay the ``C``-loop graph ``n // C``
            times and one graph of ``n % C`` loops (captured at its first use), with no host sync in
            between. Larger ``C`` means fewer launches; the graph's memory is one loop's activations.
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
        graph_chunk: int = 50,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.d_model = check_int(d_model, "d_model", min_value=1)
        self.max_positions = check_int(max_positions, "max_positions", min_value=1)
        check_int(n_layers, "n_layers", min_value=1)
        check_probability(dropout, "dropout")
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.cuda_graph = check_bool(cuda_graph, "cuda_graph")
        self.graph_chunk = check_int(graph_chunk, "graph_chunk", min_value=1)
        self.wpe = nn.Embedding(max_positions, d_model)
        self.blocks = nn.ModuleList(GPT2Block(d_model, n_heads, dropout=dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self._graphs: dict[tuple, _GraphedLoops] = {}

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
        if self._use_graphs(prompt):
            for chunk in self._graphed(prompt).iterate_chunks(prompt, loops, read_out):
                yield from chunk.unbind(0)
            return
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
        if self._use_graphs(prompt):
            return self._graphed(prompt).run(prompt, loops)
        y = None
        with torch.no_grad():
            for _ in range(loops):
                y = self._step(y, prompt)
        return y

    def _use_graphs(self, prompt: torch.Tensor) -> bool:
        # Inside a capture (a whole training step being graphed) the loops are recorded into the caller's
        # graph, and torch.compile makes its own graphs: a nested capture of ours would fail in both.
        return (
            self.cuda_graph
            and prompt.is_cuda
            and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()
        )

    def _graphed(self, prompt: torch.Tensor) -> _GraphedLoops:
        autocast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        key = (tuple(prompt.shape), prompt.dtype, prompt.device, autocast, self.training)
        if self.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.modules()):
            raise ValueError("cuda_graph=True needs dropout=0 while training (a graph would replay one mask)")
        if key not in self._graphs:
            self._graphs[key] = _GraphedLoops(self, prompt, self.graph_chunk)
        return self._graphs[key]


def _check_read_out(read_out: object) -> None:
    if read_out is not None and not callable(read_out):
        raise TypeError(f"read_out must be a module or callable, got {type(read_out).__name__}")


class _GraphedLoops:
    """CUDA graphs of ``n`` no-grad loop steps (``n = chunk`` and the remainders) on a static iterate.

    ``run(prompt, loops)`` replays the ``chunk``-loop graph ``loops // chunk`` times and the
    ``loops % chunk``-loop graph once: ``ceil(loops / chunk)`` launches and no host sync. Each graph
    updates ``self.y`` in place, so its memory is one loop's activations whatever ``n``. Parameters are
    read from their storage at replay time, so in-place optimiser steps are seen without recapture.

    Autocast: warm-up and capture run with the caller's autocast dtype but ``cache_enabled=False``: a cast
    weight cached before the capture would be read by the graph from memory that autocast frees when its
    region ends; without the cache the casts are recorded in the graph and redone on every replay.
    """

    def __init__(self, block: LoopedBlock, prompt: torch.Tensor, chunk: int) -> None:
        self.block, self.chunk = block, chunk
        self.prompt = prompt.detach().clone()
        self.y = torch.zeros_like(self.prompt)
        self.run_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # (read_out, n) -> (graph, static [n, ...] outputs); only the latest read_out's graphs are kept.
        self.iterate_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._warm_up()

    def _warm_up(self, read_out=None) -> None:
        # Outside capture, on a side stream (PyTorch's recipe): Triton compilation and autotuning, cuBLAS
        # workspaces, lazy initialisation. Writes only self.y, which every run resets.
        device = self.prompt.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad(), self._autocast():
            for _ in range(2):
                self.y.copy_(self.block._step(self.y, self.prompt))
                if read_out is not None:
                    read_out(self.y)
        torch.cuda.current_stream(device).wait_stream(side)

    def _autocast(self):
        device = self.prompt.device.type
        return torch.autocast(
            device,
            dtype=torch.get_autocast_dtype(device),
            enabled=torch.is_autocast_enabled(device),
            cache_enabled=False,
        )

    def _capture(self, n: int, read_out=None, keep: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """A graph of ``n`` loops; with ``keep``, each loop's ``read_out(Y)`` (or ``Y``) is copied into a
        static ``[n, ...]`` buffer as soon as it is computed (a read-out may return a view of ``Y``,
        which the next loop overwrites)."""
        graph = torch.cuda.CUDAGraph()
        outputs = None
        with torch.cuda.graph(graph), torch.no_grad(), self._autocast():
            for i in range(n):
                self.y.copy_(self.block._step(self.y, self.prompt))
                if keep:
                    out = self.y if read_out is None else read_out(self.y)
                    if outputs is None:  # allocated inside the capture: a static buffer in the graph's pool
                        outputs = out.new_empty((n, *out.shape))
                    outputs[i].copy_(out)
        return graph, outputs

    def _run_graph(self, n: int) -> torch.cuda.CUDAGraph:
        if n not in self.run_graphs:
            self.run_graphs[n] = self._capture(n)[0]
        return self.run_graphs[n]

    def _start(self, prompt: torch.Tensor) -> None:
        self.prompt.copy_(prompt.detach())
        self.y.zero_()  # Y_0 = 0: the first step then equals step(None, prompt)

    def run(self, prompt: torch.Tensor, loops: int) -> torch.Tensor:
        """``Y_loops`` (a fresh tensor) after ``loops >= 1`` loops from ``Y_0 = 0``."""
        full, rest = divmod(loops, self.chunk)
        # Capture first (a capture synchronises the device), then only replays.
        graphs = [self._run_graph(self.chunk)] * full + ([self._run_graph(rest)] if rest else [])
        self._start(prompt)
        for graph in graphs:
            graph.replay()
        return self.y.clone()

    def iterate_chunks(self, prompt: torch.Tensor, loops: int, read_out=None):
        """Yield ``[n, B, L, D]`` (or ``[n, *read_out shape]``): the iterates of each chunk of ``n`` loops.

        One replay per chunk; the chunk's outputs are cloned out of the graph's static buffer. The
        generator keeps its own iterate and prompt (copied into the static ones before each replay), so
        other runs on this object between two chunks do not disturb it."""
        if any(key[0] is not read_out and key[0] != read_out for key in self.iterate_graphs):
            self.iterate_graphs.clear()  # a different read-out: drop the old graphs (and their memory)
        full, rest = divmod(loops, self.chunk)
        sizes = [self.chunk] * full + ([rest] if rest else [])
        if read_out is not None and not self.iterate_graphs:
            self._warm_up(read_out)
        for n in sorted(set(sizes)):
            if (read_out, n) not in self.iterate_graphs:
                self.iterate_graphs[(read_out, n)] = self._capture(n, read_out, keep=True)
        graphs = {n: self.iterate_graphs[(read_out, n)] for n in set(sizes)}  # kept if another read-out clears
        prompt, y = prompt.detach().clone(), torch.zeros_like(self.y)
        for n in sizes:
            graph, outputs = graphs[n]
            self.prompt.copy_(prompt)
            self.y.copy_(y)
            graph.replay()
            y.copy_(self.y)
            yield outputs.clone()
