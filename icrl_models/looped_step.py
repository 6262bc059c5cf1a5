"""The looped transformer's training step, written to be captured whole in a CUDA graph.

:func:`train_step` is one optimiser step: ``b`` loops of which the first ``b - T`` run without autograd,
the truncated loss over the last ``T``, the backward and the optimiser step. It reads no device value
on the host (no ``.item()``, no branch on a tensor value, no value-dependent shape) and returns the loss
as a 0-d device tensor, so on CUDA it can be

* captured with :func:`make_graphed_train_step` (PyTorch's whole-network capture: warm-up on a side
  stream, static input buffers, one graph of forward + backward + ``optimizer.step()``, replayed per
  batch), which needs ``torch.optim.Adam``/``AdamW`` with ``capturable=True`` (see
  :func:`make_optimizer`); or
* compiled with ``torch.compile(train_step, mode="reduce-overhead")`` (Inductor's CUDA graphs).

A graph is specific to the shapes it was captured with and to ``loops``/``grad_loops``: a curriculum that
changes them needs one graph per stage (the trainer in :mod:`icrl_models.experiments.looped` recaptures
when the stage changes and keeps only the current graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from icrl_kernels import LoopedBlock


def make_optimizer(params, lr: float, *, capturable: bool = False, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``torch.optim.Adam``; with ``capturable=True`` (CUDA only) the learning rate is a 0-d device tensor
    and the step counter lives on the device, so the step can be captured in a CUDA graph and a schedule
    set with :func:`set_learning_rate` reaches the graph."""
    params = list(params)
    if not capturable:
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    device = params[0].device if params and isinstance(params[0], torch.Tensor) else None
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), weight_decay=weight_decay, capturable=True)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate; a tensor ``lr`` (capturable optimisers) is filled in place, so
    captured graphs see it. ``fill_`` with a Python number launches a kernel, it does not synchronise."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def prepare_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Make an Adam/AdamW optimiser graph-capturable in place, e.g. after ``load_state_dict`` of a state
    saved without ``capturable`` (which restores ``capturable=False``, a float ``lr`` and CPU step counters).
    """
    _check_adam(optimizer)
    for group in optimizer.param_groups:
        device = group["params"][0].device
        group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], device=device)
        elif group["lr"].device != device:
            group["lr"] = group["lr"].to(device)
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != param.device:
                    state[name] = value.to(param.device)


def _check_adam(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"optimizer must be torch.optim.Adam or AdamW, got {type(optimizer).__name__}")


def _autocast(device: torch.device, dtype: torch.dtype | None):
    # The cast cache is safe inside a capture: it is filled and emptied within the captured region, so
    # the cast weights live in the graph's pool and every replay recomputes them.
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    xs: torch.Tensor,
    ys: torch.Tensor,
    *,
    loops: int,
    grad_loops: int,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One training step of ``model.loss(xs, ys, loops=, grad_loops=)``; returns the loss (0-d, detached,
    on the model's device). Gradients are set to ``None`` first, so a captured step writes them afresh.

    Args:
        model: a :class:`~icrl_models.models.looped.LoopedTransformer` (or anything with that ``loss``).
        xs: ``[B, k, d]`` inputs; ys: ``[B, k]`` labels.
        loops: ``b``; grad_loops: ``T <= b``, the loops with autograd.
        autocast_dtype: run the forward under autocast to this dtype (e.g. ``torch.bfloat16``); ``None``: off.
    """
    optimizer.zero_grad(set_to_none=True)
    with _autocast(xs.device, autocast_dtype):
        loss = model.loss(xs, ys, loops=loops, grad_loops=grad_loops)
    loss.backward()
    optimizer.step()
    return loss.detach()


class GraphedTrainStep:
    """A training step captured in one CUDA graph; call it with a batch to copy the batch into the static
    input buffers and replay. Returns the loss as a fresh 0-d device tensor (the graph's own output is
    overwritten by the next replay).

    Built by :func:`make_graphed_train_step` (or :func:`capture_train_step` for any step function).
    """

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        example_inputs: Sequence[torch.Tensor],
        *,
        warmup_steps: int = 3,
    ) -> None:
        _check_adam(optimizer)
        if not all(group.get("capturable", False) for group in optimizer.param_groups):
            raise ValueError(
                "optimizer must have capturable=True to be captured in a CUDA graph "
                "(make_optimizer(..., capturable=True) or prepare_capturable(optimizer))"
            )
        if not all(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            raise ValueError("example_inputs must be CUDA tensors: CUDA graphs need a CUDA device")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.static_inputs = [x.detach().clone() for x in example_inputs]
        device = self.static_inputs[0].device
        # The warm-up runs real optimiser steps on the example batch; undo them afterwards so that capturing
        # does not change training (the capture itself runs nothing).
        saved = _snapshot(model, optimizer)
        with _no_loop_graphs(model):
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup_steps):  # Triton compiles and autotunes, cuBLAS workspaces, Adam's state
                    step(*self.static_inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            _restore(saved, model, optimizer)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_loss = step(*self.static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for i, (static, value) in enumerate(zip(self.static_inputs, inputs)):
            if value.shape != static.shape:
                raise ValueError(
                    f"input {i} must have the captured shape {tuple(static.shape)}, got {tuple(value.shape)}"
                )
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.static_loss.clone()


def capture_train_step(
    step: Callable[..., torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_inputs: Sequence[torch.Tensor],
    *,
    warmup_steps: int = 3,
) -> GraphedTrainStep:
    """Capture ``step(*inputs) -> loss`` (forward, backward and ``optimizer.step()``) in a CUDA graph."""
    return GraphedTrainStep(step, model, optimizer, example_inputs, warmup_steps=warmup_steps)


def make_graphed_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: tuple[torch.Tensor, torch.Tensor],
    *,
    loops: int,
    grad_loops: int,
    autocast_dtype: torch.dtype | None = None,
    warmup_steps: int = 3,
) -> GraphedTrainStep:
    """:func:`train_step` of the looped model captured in one CUDA graph for batches shaped like
    ``example_batch = (xs [B, k, d], ys [B, k])`` and this ``loops``/``grad_loops``.

    ``graphed(xs, ys)`` then equals ``train_step(model, optimizer, xs, ys, ...)`` (same parameters, same
    optimiser state, same loss) with one graph launch. The optimiser must be Adam/AdamW with
    ``capturable=True``; the learning rate must be a tensor for a schedule to reach the graph (set it with
    :func:`set_learning_rate`). Capturing runs ``warmup_steps`` steps on the example batch and then restores
    the parameters and the optimiser state, so it leaves training unchanged.
    """

    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return train_step(model, optimizer, xs, ys, loops=loops, grad_loops=grad_loops, autocast_dtype=autocast_dtype)

    return GraphedTrainStep(step, model, optimizer, example_batch, warmup_steps=warmup_steps)


@contextlib.contextmanager
def _no_loop_graphs(model: nn.Module):
    """``LoopedBlock(cuda_graph=True)`` off while warming up and capturing: its no-grad loops become part of
    the step's graph (inside a capture it falls back by itself; this also keeps the warm-up from capturing
    loop graphs that the step would never replay)."""
    blocks = [m for m in model.modules() if isinstance(m, LoopedBlock) and m.cuda_graph]
    for block in blocks:
        block.cuda_graph = False
    try:
        yield
    finally:
        for block in blocks:
            block.cuda_graph = True


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    with torch.no_grad():
        return {
            "params": [t.detach().clone() for t in [*model.parameters(), *model.buffers()]],
            "state": {
                (id(p), name): value.detach().clone()
                for p, state in optimizer.state.items()
                for name, value in state.items()
                if isinstance(value, torch.Tensor)
            },
        }


def _restore(saved: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # In place: the graph records these storages' addresses.
    with torch.no_grad():
        for tensor, value in zip([*model.parameters(), *model.buffers()], saved["params"]):
            tensor.copy_(value)
        for p, state in optimizer.state.items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    old = saved["state"].get((id(p), name))
                    # State created by the warm-up: Adam's fresh state (step, moments) is all zeros.
                    value.copy_(old) if old is not None else value.zero_()
    optimizer.zero_grad(set_to_none=True)
