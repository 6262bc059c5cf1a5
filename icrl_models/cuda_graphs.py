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
  :func:`prepare_capturable` makes one so, e.g. after ``load_state_dict``. The last warm-up step runs
  under torch's sync-debug mode (a host read fails there, naming its line), and a failed capture raises
  :class:`CaptureError` with the model, optimiser and random generators as before.
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
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from icrl_kernels import LoopedBlock, device_side_value_checks
from icrl_kernels.validation import check_device


class StepWatcher(Protocol):
    """What :class:`StepRunner` needs of a watcher of every step (:class:`~icrl_models.nonfinite.NonFiniteGuard`,
    which imports this module, not the other way round): the step wrapped, and the device tensors that the
    wrapped step updates in place (restored after a capture's warm-up steps)."""

    def watch(self, step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]: ...

    def state_tensors(self) -> list[torch.Tensor]: ...


#: ``--cuda-graph`` of every trainer: ``"auto"`` (the default) graphs the training steps on CUDA devices where
#: nothing excludes it (``--compile``, data-parallel runs) and falls back to eager steps, with a one-line
#: note, if a capture fails; ``"on"`` graphs them or fails with the reason; ``"off"`` never graphs. Off CUDA
#: nothing changes (``"on"`` is ignored there with a note).
CUDA_GRAPH_MODES = ("auto", "on", "off")
CUDA_GRAPH_HELP = (
    "auto (default: on CUDA devices, each training step captured in one CUDA graph and replayed; eager "
    "where a capture fails), on, or off; the flag alone means on; nothing changes off CUDA"
)


def cuda_graph_mode(value: object) -> str:
    """``value`` as one of :data:`CUDA_GRAPH_MODES`; ``True`` / ``False`` (configs written before the modes)
    are ``"on"`` / ``"off"``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graph must be one of {CUDA_GRAPH_MODES}, got {value!r}")
    return value  # type: ignore[return-value]


def use_cuda_graph(mode: str, device: torch.device, *, excluded: str | None = None) -> bool:
    """Whether a trainer on ``device`` captures its steps in CUDA graphs, for ``--cuda-graph mode``.

    ``excluded``: why graphs cannot run in this run (``--compile``, a data-parallel run), or ``None``:
    ``"auto"`` then trains eagerly, ``"on"`` raises ``ValueError`` with that text. Off CUDA, ``"on"`` prints
    a one-line note on stderr and trains eagerly."""
    mode = cuda_graph_mode(mode)
    if mode == "off":
        return False
    if excluded is not None:
        if mode == "on":
            raise ValueError(excluded)
        return False
    if device.type != "cuda":
        if mode == "on":
            print(f"cuda_graph: ignored on {device} (CUDA only); training eagerly", file=sys.stderr)
        return False
    return True


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


class CaptureError(RuntimeError):
    """A training step could not be captured in a CUDA graph (it synchronises the host with the device, or
    runs an operation a graph cannot hold). The attempt is undone: the model's parameters and buffers, the
    optimiser's state and the random generators are as they were before it, and no graph is kept."""


class _CudaGraphs:
    """What capturing needs from CUDA, in one place: a side stream for the warm-up, torch's sync-debug mode,
    the generators' states and the capture itself. (The tests substitute an emulation of it on the CPU.)

    ``generators``: non-default CUDA generators the step draws from; each is registered with the graph, so
    that every replay draws fresh numbers from it (the default generator of the device always is)."""

    def __init__(self, device: torch.device, generators: Sequence[torch.Generator] = ()) -> None:
        if device.type != "cuda":
            raise ValueError(f"example_inputs must be CUDA tensors: CUDA graphs need a CUDA device, got {device}")
        for i, generator in enumerate(generators):
            if not isinstance(generator, torch.Generator) or generator.device.type != "cuda":
                raise TypeError(f"generators[{i}] must be a CUDA torch.Generator, got {generator!r}")
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.extra_generators = list(generators)
        self.generators = [torch.cuda.default_generators[index], *self.extra_generators]

    @contextlib.contextmanager
    def side_stream(self):
        """Run the body on a fresh stream that waits for, and is then waited on by, the current one."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(side)

    @contextlib.contextmanager
    def host_syncs_raise(self):
        """torch's sync-debug mode ``"error"``: an operation that synchronises with the host raises at once,
        with the traceback of the line that called it."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def generator_states(self) -> list[torch.Generator]:
        return [generator.clone_state() for generator in self.generators]

    def restore_generator_states(self, states: list[torch.Generator]) -> None:
        # graphsafe_set_state swaps in a clean state object: a failed capture can leave the old one marked
        # as capturing, and every later random draw outside a graph would then fail.
        for generator, state in zip(self.generators, states):
            generator.graphsafe_set_state(state)

    def capture(self, record: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``record()`` captured in a new graph; returns the graph and the static output."""
        graph = torch.cuda.CUDAGraph()
        for generator in self.extra_generators:
            graph.register_generator_state(generator)
        try:
            with torch.cuda.graph(graph):
                output = record()
        except BaseException:
            graph.reset()  # drops what was recorded and the graph's hold on the generators and memory pool
            raise
        return graph, output


class GraphedTrainStep:
    """A training step captured in one CUDA graph; call it with a batch to copy the batch into the static
    input buffers and replay. Returns the step's output (its loss, or any tensor of statistics) as a fresh
    device tensor (the graph's own output is overwritten by the next replay).

    Built by :func:`capture_train_step` (or the looped model's
    :func:`~icrl_models.looped_step.make_graphed_train_step`). Inputs must keep the captured shapes; they
    are copied with ``non_blocking=True``, so pinned CPU tensors let the host run ahead of the device.

    Capturing first runs ``warmup_steps`` real steps on a side stream (Triton compiles and autotunes, cuBLAS
    workspaces, the optimiser's state), the last of them under torch's sync-debug mode: a step that reads a
    device value on the host fails there, with the traceback of the line that reads, instead of as an
    invalid capture. Then it restores the model and optimiser state and records one step. If anything fails,
    it raises :class:`CaptureError` with everything restored (generators included) and no graph kept.
    """

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        example_inputs: Sequence[torch.Tensor],
        *,
        warmup_steps: int = 3,
        generators: Sequence[torch.Generator] = (),
        extra_state: Sequence[torch.Tensor] = (),
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
        if not example_inputs or not all(isinstance(x, torch.Tensor) for x in example_inputs):
            raise TypeError("example_inputs must be a non-empty sequence of tensors")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
            raise ValueError(
                f"warmup_steps must be an int >= 2 (the last runs under sync-debug mode), got {warmup_steps!r}"
            )
        graphs = _CudaGraphs(example_inputs[0].device, generators)
        self.static_inputs = [x.detach().clone() for x in example_inputs]
        # The warm-up runs real optimiser steps on the example batch; undo them afterwards so that capturing
        # does not change training (the capture itself runs nothing).
        saved, generator_states = _snapshot(model, optimizer, extra_state), graphs.generator_states()
        try:
            with _no_loop_graphs(model):
                with graphs.side_stream():
                    for _ in range(warmup_steps - 1):  # compiles and autotunes: these may synchronise
                        step(*self.static_inputs)
                    # The step as the graph will record it: value checks as device asserts, any host sync an error.
                    with device_side_value_checks(), graphs.host_syncs_raise():
                        step(*self.static_inputs)
                _restore(saved, model, optimizer)
                with device_side_value_checks():
                    self.graph, self.static_output = graphs.capture(lambda: step(*self.static_inputs))
        except BaseException as error:
            _restore(saved, model, optimizer)
            graphs.restore_generator_states(generator_states)
            if isinstance(error, KeyboardInterrupt):
                raise
            raise CaptureError(
                f"capturing the training step in a CUDA graph failed: {type(error).__name__}: {error}"
            ) from error

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
    generators: Sequence[torch.Generator] = (),
    extra_state: Sequence[torch.Tensor] = (),
) -> GraphedTrainStep:
    """Capture ``step(*inputs) -> tensor`` (forward, backward and ``optimizer.step()``) in a CUDA graph for
    inputs shaped like ``example_inputs`` (CUDA tensors).

    ``step`` must read no device value on the host (the last warm-up step checks it under torch's
    sync-debug mode) and draw random numbers from the default CUDA generator or from ``generators``
    (registered with the graph; each replay then draws fresh numbers). Capturing runs ``warmup_steps >= 2``
    steps on the example inputs and then restores the parameters, buffers and optimiser state, and the device
    tensors ``extra_state`` that ``step`` updates in place (a :class:`~icrl_models.nonfinite.NonFiniteGuard`'s
    counters), so it leaves training unchanged; a failure raises :class:`CaptureError` and leaves nothing
    changed.
    """
    return GraphedTrainStep(
        step, model, optimizer, example_inputs, warmup_steps=warmup_steps, generators=generators,
        extra_state=extra_state,
    )  # fmt: skip


def _device(device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device``; a name or index is checked (``check_device``), a ``torch.device`` passed
    as it is (these run every step: no per-step cost for the trainers, which resolve their device once)."""
    return device if isinstance(device, torch.device) else check_device(device)


def pinned(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A CPU batch in pinned memory when ``device`` is CUDA (as it is otherwise): its copy to the device
    then runs asynchronously, where CUDA documents that a copy from pageable memory may make the host wait
    for the stream."""
    if _device(device).type != "cuda":
        return dict(batch)
    return {name: value.pin_memory() if value.device.type == "cpu" else value for name, value in batch.items()}


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors copied to ``device`` (asynchronously where the source is pinned)."""
    device = _device(device)
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


class StepRunner:
    """Runs a training step ``step(batch, *static) -> tensor`` on dict batches (CPU tensors, see :func:`pinned`, or
    device tensors): eagerly, or with ``cuda_graph=True`` on a CUDA ``device`` captured on the first batch
    (:func:`capture_train_step`) and replayed on every later one. ``static``: host-side values that shape the
    step (the looped transformer's loop counts); a batch of other tensor names or shapes, or other ``static``
    values, is captured anew (the previous graph dropped first: a curriculum stage at a time). ``step`` gets the
    batch on ``device`` and must return a device tensor (the loss, or a few statistics), read on the host only
    when the caller asks.

    A graphed runner needs ``optimizer`` made capturable first (:func:`prepare_capturable`). ``generators``:
    non-default CUDA generators the step draws from (see :func:`capture_train_step`). With ``guard`` (a
    :class:`~icrl_models.nonfinite.NonFiniteGuard` of this model and optimiser) every step is watched for a
    non-finite loss or gradient norm, inside the graph too. If the capture fails, the call raises
    :class:`CaptureError` (nothing changed, see there), and so does every later call; with ``fallback``
    (``--cuda-graph auto``) it prints the error on one line instead and runs this and every later step
    eagerly.
    """

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        cuda_graph: bool = False,
        fallback: bool = False,
        generators: Sequence[torch.Generator] = (),
        guard: StepWatcher | None = None,
    ) -> None:
        self.step = guard.watch(step) if guard is not None else step
        self.model, self.optimizer, self.device = model, optimizer, check_device(device)
        self.extra_state = guard.state_tensors() if guard is not None else []
        self.graphed = bool(cuda_graph) and self.device.type == "cuda"
        self.generators = tuple(generators)
        self.fallback = fallback
        self.captured: GraphedTrainStep | None = None
        self.failure: CaptureError | None = None
        self.names: tuple[str, ...] = ()
        self.key: tuple | None = None

    def __call__(self, batch: Mapping[str, torch.Tensor], *static) -> torch.Tensor:
        if not self.graphed:
            return self.step(to_device(batch, self.device), *static)
        if self.failure is not None:
            raise self.failure
        key = (static, tuple((name, tuple(value.shape)) for name, value in batch.items()))
        if self.captured is None or key != self.key:
            self.captured = None  # the previous graph's memory goes back to the pool before the next capture
            self.names, self.key = tuple(batch), key

            def named_step(*tensors: torch.Tensor) -> torch.Tensor:
                return self.step(dict(zip(self.names, tensors)), *static)

            example = list(to_device(batch, self.device).values())
            try:
                self.captured = capture_train_step(
                    named_step, self.model, self.optimizer, example, generators=self.generators,
                    extra_state=self.extra_state,
                )  # fmt: skip
            except CaptureError as error:  # an op that cannot be captured: a bug of ours, with its traceback
                if self.fallback:  # --cuda-graph auto: nothing was changed by the attempt; go on eagerly
                    print(f"cuda_graph: {error}; training eagerly (--cuda-graph off skips this)", file=sys.stderr)
                    self.graphed = False
                    return self.step(to_device(batch, self.device), *static)
                self.failure = CaptureError(f"cuda_graph: {error}; train without the CUDA graph (--cuda-graph off)")
                raise self.failure from error
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


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, extra_state: Sequence[torch.Tensor] = ()) -> dict:
    """Copies of the model's state (parameters and persistent buffers, by name), the optimiser's state and the
    tensors ``extra_state`` (restored in place by :func:`_restore`).

    Non-persistent buffers are not state (no checkpoint holds them) and are left out: a step may replace
    them, e.g. Headless-AD's action map, which the step points at a static input of the graph."""
    with torch.no_grad():
        return {
            "extra": [(tensor, tensor.detach().clone()) for tensor in extra_state],
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
        for tensor, value in saved["extra"]:
            tensor.copy_(value)
    optimizer.zero_grad(set_to_none=True)
