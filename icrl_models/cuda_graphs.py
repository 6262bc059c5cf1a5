"""Training steps captured whole in a CUDA graph: one graph launch per step instead of hundreds of kernels.

The models of this package are small enough that a training step on a GPU is bound by the host: Python,
argument checks and kernel launches (``benchmarks/results/README.md``: ~80 steps per second at widths 64
and 512 alike on an H200, the device mostly idle). A step that reads no device value on the host (no
``.item()``, no branch on a tensor value, no value-dependent shape) and draws its random numbers from the
default CUDA generator can be recorded once and replayed:

* :func:`capture_train_step` records ``step(*inputs)`` (forward, backward, gradient clipping and the
  optimiser step) with PyTorch's whole-network capture: warm-up on a side stream, static input buffers,
  one graph, replayed per batch. The optimiser must be ``torch.optim.Adam``/``AdamW`` with
  ``capturable=True`` (the step counter and the learning rate live on the device), or one that keeps all
  its state on the device by itself (:class:`~icrl_models.batched.RunAdamW`, many runs' AdamW);
  :func:`prepare_capturable` makes one so, e.g. after ``load_state_dict``.
* :class:`StepRunner` runs a trainer's ``step(batch)`` on dict batches, eagerly or captured on the first
  batch and replayed; :func:`pinned` puts a CPU batch in pinned memory so that its copy to the GPU runs
  asynchronously.
* :func:`set_learning_rate` changes a capturable optimiser's learning rate in place, so a schedule reaches
  the graph; :func:`eager_optimizer_state` saves its state as a non-capturable optimiser would, so
  checkpoints load into graphed and eager runs alike.

Used by ``icrl-train --cuda-graph`` (:mod:`icrl_models.train`; also ``icrl-compare`` and ``icrl-headless``),
``icrl-markov --cuda-graph`` and the looped transformer's trainer (:mod:`icrl_models.looped_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from icrl_kernels import LoopedBlock


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


def eager_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` as the same optimiser without ``capturable`` would save it: a float learning
    rate, ``capturable=False`` and float32 step counters on the CPU, so that a checkpoint of a graphed run
    loads into an eager run (and on a machine without CUDA). A graphed run calls :func:`prepare_capturable`
    after loading. Reads the learning rate on the host: for checkpoints, not for the step.
    """
    state = optimizer.state_dict()
    groups = [
        {**group, "capturable": False, "lr": float(group["lr"])} if group.get("capturable") else group
        for group in state["param_groups"]
    ]
    per_param = {
        index: {
            name: value.detach().to("cpu", torch.float32) if name == "step" else value
            for name, value in param_state.items()
        }
        for index, param_state in state["state"].items()
    }
    return {**state, "state": per_param, "param_groups": groups}


class GraphedTrainStep:
    """A training step captured in one CUDA graph; call it with a batch to copy the batch into the static
    input buffers and replay. Returns the step's output (its loss, or any tensor of statistics) as a fresh
    device tensor (the graph's own output is overwritten by the next replay).

    Built by :func:`capture_train_step` (or the looped model's
    :func:`~icrl_models.looped_step.make_graphed_train_step`). Inputs must keep the captured shapes; they
    are copied with ``non_blocking=True``, so pinned CPU tensors let the host run ahead of the device.
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
        # Adam / AdamW made capturable, or an optimiser that keeps every value on the device by design (the
        # per-run AdamW of batched runs, icrl_models.batched.RunAdamW, says so with graph_capturable = True).
        if not getattr(type(optimizer), "graph_capturable", False):
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
                self.static_output = step(*self.static_inputs)

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
        return self.static_output.clone()


def capture_train_step(
    step: Callable[..., torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_inputs: Sequence[torch.Tensor],
    *,
    warmup_steps: int = 3,
) -> GraphedTrainStep:
    """Capture ``step(*inputs) -> tensor`` (forward, backward and ``optimizer.step()``) in a CUDA graph for
    inputs shaped like ``example_inputs`` (CUDA tensors).

    ``step`` must read no device value on the host and draw random numbers only from the default CUDA
    generator (each replay then draws fresh ones). Capturing runs ``warmup_steps`` steps on the example
    inputs (Triton compiles and autotunes, cuBLAS workspaces, the optimiser's state) and then restores the
    parameters, buffers and optimiser state, so it leaves training unchanged.
    """
    return GraphedTrainStep(step, model, optimizer, example_inputs, warmup_steps=warmup_steps)


def pinned(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A CPU batch in pinned memory when ``device`` is CUDA (as it is otherwise): its copy to the device
    then runs asynchronously, where CUDA documents that a copy from pageable memory may make the host wait
    for the stream."""
    if device.type != "cuda":
        return dict(batch)
    return {name: value.pin_memory() if value.device.type == "cpu" else value for name, value in batch.items()}


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


class StepRunner:
    """Runs a training step ``step(batch) -> tensor`` on dict batches (CPU tensors, see :func:`pinned`, or
    device tensors): eagerly, or with ``cuda_graph=True`` on a CUDA ``device`` captured on the first batch
    (:func:`capture_train_step`) and replayed on every later one, whose tensors must keep the first batch's
    names and shapes. ``step`` gets the batch on ``device`` and must return a device tensor (the loss, or
    a few statistics), read on the host only when the caller asks.

    A graphed runner needs ``optimizer`` made capturable first (:func:`prepare_capturable`).
    """

    def __init__(
        self,
        step: Callable[[dict[str, torch.Tensor]], torch.Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        cuda_graph: bool = False,
    ) -> None:
        self.step, self.model, self.optimizer, self.device = step, model, optimizer, device
        self.graphed = bool(cuda_graph) and device.type == "cuda"
        self.captured: GraphedTrainStep | None = None
        self.names: tuple[str, ...] = ()

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not self.graphed:
            return self.step(to_device(batch, self.device))
        if self.captured is None:
            self.names = tuple(batch)

            def named_step(*tensors: torch.Tensor) -> torch.Tensor:
                return self.step(dict(zip(self.names, tensors)))

            example = list(to_device(batch, self.device).values())
            try:
                self.captured = capture_train_step(named_step, self.model, self.optimizer, example)
            except RuntimeError as error:  # an op that cannot be captured: a bug of ours, with its traceback
                raise RuntimeError(
                    f"cuda_graph: capturing the training step failed ({error}); train without the CUDA graph "
                    "(--cuda-graph off) and report this"
                ) from error
        if tuple(batch) != self.names:
            raise ValueError(f"batch must hold the captured tensors {self.names}, got {tuple(batch)}")
        return self.captured(*batch.values())  # copies the batch into the graph's inputs and replays


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
    """Copies of the model's state (parameters and persistent buffers, by name) and the optimiser's state.

    Non-persistent buffers are not state (no checkpoint holds them) and are left out: a step may replace
    them, e.g. Headless-AD's action map, which the step points at a static input of the graph."""
    with torch.no_grad():
        return {
            "model": {name: t.detach().clone() for name, t in model.state_dict(keep_vars=True).items()},
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
        for name, tensor in model.state_dict(keep_vars=True).items():
            tensor.copy_(saved["model"][name])
        for p, state in optimizer.state.items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    old = saved["state"].get((id(p), name))
                    # State created by the warm-up: Adam's fresh state (step, moments) is all zeros.
                    value.copy_(old) if old is not None else value.zero_()
    optimizer.zero_grad(set_to_none=True)
