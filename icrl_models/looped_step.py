"""The looped transformer's training step, written to be captured whole in a CUDA graph.

:func:`train_step` is one optimiser step: ``b`` loops of which the first ``b - T`` run without autograd,
the truncated loss over the last ``T``, the backward and the optimiser step. It reads no device value
on the host (no ``.item()``, no branch on a tensor value, no value-dependent shape) and returns the loss
as a 0-d device tensor, so on CUDA it can be

* captured with :func:`make_graphed_train_step` (PyTorch's whole-network capture: warm-up on a side
  stream, static input buffers, one graph of forward + backward + ``optimizer.step()``, replayed per
  batch; :mod:`icrl_models.cuda_graphs`), which needs ``torch.optim.Adam``/``AdamW`` with
  ``capturable=True`` (see :func:`make_optimizer`); or
* compiled with ``torch.compile(train_step, mode="reduce-overhead")`` (Inductor's CUDA graphs).

A graph is specific to the shapes it was captured with and to ``loops``/``grad_loops``: a curriculum that
changes them needs one graph per stage (the trainer in :mod:`icrl_models.experiments.looped` recaptures
when the stage changes and keeps only the current graph).
"""

from __future__ import annotations

import torch
from torch import nn

from .cuda_graphs import GraphedTrainStep
from .nonfinite import NonFiniteGuard


def make_optimizer(params, lr: float, *, capturable: bool = False, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``torch.optim.Adam``; with ``capturable=True`` (CUDA only) the learning rate is a 0-d device tensor
    and the step counter lives on the device, so the step can be captured in a CUDA graph and a schedule
    set with :func:`~icrl_models.cuda_graphs.set_learning_rate` reaches the graph."""
    params = list(params)
    if not capturable:
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    device = params[0].device if params and isinstance(params[0], torch.Tensor) else None
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), weight_decay=weight_decay, capturable=True)


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


def make_graphed_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: tuple[torch.Tensor, torch.Tensor],
    *,
    loops: int,
    grad_loops: int,
    autocast_dtype: torch.dtype | None = None,
    warmup_steps: int = 3,
    guard: NonFiniteGuard | None = None,
) -> GraphedTrainStep:
    """:func:`train_step` of the looped model captured in one CUDA graph for batches shaped like
    ``example_batch = (xs [B, k, d], ys [B, k])`` and this ``loops``/``grad_loops``.

    ``graphed(xs, ys)`` then equals ``train_step(model, optimizer, xs, ys, ...)`` (same parameters, same
    optimiser state, same loss) with one graph launch. The optimiser must be Adam/AdamW with
    ``capturable=True``; the learning rate must be a tensor for a schedule to reach the graph (set it with
    :func:`set_learning_rate`). Capturing runs ``warmup_steps`` steps on the example batch and then restores
    the parameters and the optimiser state, so it leaves training unchanged. ``guard``: a
    :class:`~icrl_models.nonfinite.NonFiniteGuard` of this model and optimiser that watches every replayed step.
    """

    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return train_step(model, optimizer, xs, ys, loops=loops, grad_loops=grad_loops, autocast_dtype=autocast_dtype)

    if guard is None:
        return GraphedTrainStep(step, model, optimizer, example_batch, warmup_steps=warmup_steps)
    return GraphedTrainStep(
        guard.watch(step), model, optimizer, example_batch, warmup_steps=warmup_steps, extra_state=guard.state_tensors()
    )
