"""The run lifecycle: what every trainer of this package does with a run, written once.

Every training command (``icrl-train``, and through it ``icrl-compare`` and ``icrl-headless``; ``icrl-markov``,
``icrl-looped``, ``icrl-induction``) trains runs through :func:`train_runs`, alone or ``K`` at a time as one
batched model (``--batch-runs``). A trainer describes one run as a :class:`TrainingRun`: how to build its model
and optimiser, what one training step and one evaluation mean for its paper (its data stream, its loss, its
readings), and when it logs, evaluates and saves. Everything else is here:

* **The run folder and the run's identity** (:class:`RunFolder`): created, cleared of the temporary files a
  killed write left, its ``config.json`` written; the identity is the dict of settings a checkpoint must match.
* **Validated resume** (:func:`resume`, :class:`Resumed`): a checkpoint that is truncated, corrupt, of another
  run (its identity differs) or malformed (a field missing or of another kind, a model or optimiser state that
  does not fit, a random state that is not one) is a :class:`~icrl_models.checkpoint.CheckpointError` naming the
  file and what is wrong, never a ``KeyError`` deep inside ``load_state_dict``.
* **Atomic checkpoint writes** (:func:`save_run_checkpoint`, the checksummed files of :mod:`~icrl_models.checkpoint`)
  and **JSON-lines metrics trimmed on resume** (:func:`trim_metrics`): the rows a killed run logged after its
  last checkpoint are dropped, so a resumed run logs every step once; the rows up to a checkpoint are on disk
  before the checkpoint refers to them.
* **One factory for the step runner** (:func:`make_step_runner`): ``--cuda-graph auto|on|off`` (a whole step in
  one CUDA graph), the capturable optimiser that needs, and the non-finite policy (``--nonfinite stop|skip``,
  :class:`~icrl_models.nonfinite.NonFiniteGuard`) watching every step on the device.
* **The progress bar and the finished-run summary**: a run already at its last step with its final result
  stored is not trained or evaluated again.

One loop (:func:`train_runs`) drives single and batched runs alike: a single run steps its own model and
``torch.optim`` optimiser; a batch steps a :class:`~icrl_models.batched.StackedRuns` of the runs' models with a
:class:`~icrl_models.batched.RunAdamW`, each run keeping its own data stream, hyperparameters, checkpoint, metrics,
evaluation and non-finite guard, and resuming on its own (runs resumed at different steps train as consecutive
batches). Nothing in a step is read on the host: statistics stay on the device until a log point reads them all at
once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .batched import RunAdamW, StackedRuns, auto_batch_runs, batched_train_step
from .checkpoint import CHECKPOINT_VERSION, CheckpointError, checkpoint_field, load_checkpoint, save_checkpoint
from .cuda_graphs import (
    StepRunner,
    eager_optimizer_state,
    pinned,
    prepare_capturable,
    set_learning_rate,
    use_cuda_graph,
)
from .files import JsonLines, read_json_lines, remove_partial_files, write_json, write_text
from .nonfinite import NonFiniteGuard
from .runtime import retain_freed_memory


# -- the run folder ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunFolder:
    """Where a run keeps its files: ``path`` (the folder), its checkpoint and its JSON-lines metrics, by name.
    ``shared``: other runs keep their files in the same folder (icrl-looped's two models, which may train at the
    same time), so the run clears only its own files' unfinished writes."""

    path: Path
    checkpoint_name: str = "checkpoint.pt"
    metrics_name: str = "metrics.jsonl"
    shared: bool = False

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    @property
    def checkpoint(self) -> Path:
        return self.path / self.checkpoint_name

    @property
    def metrics(self) -> Path:
        return self.path / self.metrics_name

    def prepare(self, config: dict | None = None) -> RunFolder:
        """Create the folder, delete the temporary files of writes a killed run left unfinished, and write
        ``config.json`` (``config``, if given). Only for a folder no other process is writing into."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.shared:
            remove_partial_files(self.path)
        else:  # only this run's own killed writes (another run may be writing into the folder now)
            for name in (self.checkpoint_name, self.metrics_name):
                for path in self.path.glob(f".{name}.*.partial"):
                    path.unlink(missing_ok=True)
        if config is not None:
            write_json(self.path / "config.json", config)
        return self


# -- resume -------------------------------------------------------------------------------------------------------
class Resumed:
    """A checkpoint loaded for resuming, its every use checked: each method raises
    :class:`~icrl_models.checkpoint.CheckpointError` naming the file and the field that does not fit."""

    def __init__(self, path: Path, payload: dict) -> None:
        self.path, self.payload = Path(path), payload
        self.step: int = payload["step"]

    def field(self, *keys: str, kind: type | tuple = object) -> Any:
        """``payload[keys[0]][keys[1]]...``, checked to exist and be a ``kind``."""
        return checkpoint_field(self.payload, self.path, *keys, kind=kind)

    def restore_model(self, model: nn.Module) -> None:
        """Load the model state (every parameter and persistent buffer, each of its shape)."""
        try:
            model.load_state_dict(self.payload["model"])
        except RuntimeError as error:  # missing or unexpected keys, shape mismatches: torch lists them all
            details = " ".join(str(error).split())
            raise CheckpointError(f"{self.path}: field 'model' does not fit the model ({details[:300]})") from None

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Load the optimiser state (saved as a non-capturable optimiser saves it)."""
        state = self.field("optimizer", kind=dict)
        problem = _optimizer_state_problem(state, [len(group["params"]) for group in optimizer.param_groups])
        if problem is None:
            try:
                optimizer.load_state_dict(state)
                return
            except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as error:
                problem = f"{type(error).__name__}: {error}"
        raise CheckpointError(f"{self.path}: field 'optimizer' does not fit the optimiser ({problem})")

    def restore_numpy(self, rng: np.random.Generator, index: int = 0, *keys: str) -> None:
        """Set ``rng`` to the numpy state number ``index`` of the list at ``keys`` (default ``['rng']['numpy']``)."""
        keys = keys or ("rng", "numpy")
        states = self.field(*keys, kind=list)
        field = "".join(f"[{key!r}]" for key in keys)
        if len(states) <= index:
            raise CheckpointError(f"{self.path}: field {field} holds {len(states)} states, none for index {index}")
        try:
            rng.bit_generator.state = states[index]
        except (TypeError, ValueError, KeyError):
            raise CheckpointError(f"{self.path}: field {field} is not a numpy {type(rng.bit_generator).__name__} "
                                  "state") from None  # fmt: skip

    def restore_generator(self, generator: torch.Generator, *keys: str) -> None:
        """Set the torch generator to the state at ``keys`` (e.g. ``('rng', 'prompts')``)."""
        state = self.field(*keys, kind=torch.Tensor)
        try:
            generator.set_state(state)
        except (RuntimeError, TypeError, ValueError):
            field = "".join(f"[{key!r}]" for key in keys)
            raise CheckpointError(f"{self.path}: field {field} is not a torch generator state") from None

    def torch_state(self) -> torch.Tensor:
        """The saved state of torch's CPU generator (``['rng']['torch']``)."""
        return self.field("rng", "torch", kind=torch.Tensor)


def _optimizer_state_problem(state: dict, group_sizes: list[int]) -> str | None:
    """Why an optimiser ``state_dict`` cannot be one of an optimiser with groups of ``group_sizes`` parameters
    (None if it can): the structure ``load_state_dict`` would otherwise fail on with a bare ``KeyError``."""
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        return "no 'param_groups' list or 'state' dict"
    if not all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        return "a parameter group without a 'params' list"
    sizes = [len(group["params"]) for group in groups]
    if sizes != group_sizes:
        return f"parameter groups of {sizes} parameters, the optimiser's have {group_sizes}"
    return None


def resume(path: str | Path, identity: dict, *, steps: int | None = None) -> Resumed | None:
    """The run's checkpoint at ``path`` checked against its ``identity`` (the settings it must match), or None
    when there is none (a fresh run). ``steps``: the run's length, which the checkpoint's step may not exceed
    (None: any). Raises :class:`~icrl_models.checkpoint.CheckpointError` for a truncated, corrupt, foreign or
    malformed checkpoint."""
    path = Path(path)
    if not path.exists():
        return None
    payload = load_checkpoint(path, expect_config=identity)
    if steps is not None and payload["step"] > steps:
        raise CheckpointError(f"{path}: field 'step' is {payload['step']}, past the run's {steps} steps")
    return Resumed(path, payload)


def save_run_checkpoint(
    path: str | Path, step: int, identity: dict, model_state: dict, optimizer_state: dict, rng: dict, **extra: Any
) -> None:
    """A run's checkpoint, written atomically: its model's ``state_dict``, its optimiser's (as a non-capturable
    optimiser saves it), its random states, its identity, and any ``extra`` fields of its trainer."""
    save_checkpoint(
        {"version": CHECKPOINT_VERSION, "step": step, "config": identity, "model": model_state,
         "optimizer": optimizer_state, "rng": rng, **extra},
        path,
    )  # fmt: skip


# -- metrics ------------------------------------------------------------------------------------------------------
def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``; a torn last line (a kill mid-write) is dropped."""
    return read_json_lines(path)


def trim_metrics(path: str | Path, step: int) -> list[dict]:
    """Drop the rows logged after ``step`` (atomically): they come from a run killed before its next checkpoint,
    which the resumed run redoes. Returns the rows kept."""
    path = Path(path)
    records = read_metrics(path)
    kept = [record for record in records if int(record.get("step", 0)) <= step]
    if len(kept) != len(records) or (path.exists() and path.read_text().count("\n") != len(records)):
        write_text(path, "".join(json.dumps(record) + "\n" for record in kept))
    return kept


def final_evaluation(path: str | Path, steps: int) -> dict | None:
    """The evaluation row (``"eval"``) a finished run logged at its last step ``steps``, or None."""
    rows = [row["eval"] for row in read_metrics(path) if row.get("step") == steps and "eval" in row]
    return rows[-1] if rows else None


def metric_row(step: int, loss: float, learning_rate: float, grad_norm: float, last_log: tuple, start_time: float):
    """A training row at ``step`` and the new ``last_log`` ``(step, time)``; steps per second are counted since
    ``last_log``."""
    now = time.perf_counter()
    record = {"step": step, "loss": loss, "lr": learning_rate, "grad_norm": grad_norm,
              "steps_per_second": (step - last_log[0]) / (now - last_log[1]), "seconds": now - start_time}  # fmt: skip
    return record, (step, now)


# -- the step runner ------------------------------------------------------------------------------------------------
def make_step_runner(
    step: Callable[..., torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    cuda_graph: str,
    nonfinite: str,
    first_step: int = 0,
    excluded: str | None = None,
    runs: int | None = None,
    run_names: Sequence[str] | None = None,
    generators: Sequence[torch.Generator] = (),
) -> StepRunner:
    """The runner of a trainer's step ``step(batch, *static) -> [loss, grad_norm]`` (``[K, 2]`` for ``runs``):

    * ``cuda_graph`` (``--cuda-graph``): on CUDA, ``"auto"`` and ``"on"`` capture each step in a CUDA graph and
      replay it (``"auto"`` falls back to eager steps if a capture fails; ``excluded`` says why graphs cannot run
      here, e.g. ``--compile``); the optimiser is then made capturable (its learning rate and step counters on
      the device). ``"off"`` and CPUs step eagerly.
    * ``nonfinite`` (``--nonfinite``): the policy of the :class:`~icrl_models.nonfinite.NonFiniteGuard` that
      watches every step (inside the graph too); the runner's ``guard``. ``first_step``: the steps already done.
    * On a CPU, the process keeps the memory a step frees for the next step
      (:func:`~icrl_models.runtime.retain_freed_memory`).

    Returns the :class:`~icrl_models.cuda_graphs.StepRunner`, with the guard as its ``guard`` attribute."""
    if device.type == "cpu":
        retain_freed_memory()
    graphed = use_cuda_graph(cuda_graph, device, excluded=excluded)
    if graphed and not getattr(type(optimizer), "graph_capturable", False):
        prepare_capturable(optimizer)  # the learning rate and step counters move to the device, where graphs read them
    guard = NonFiniteGuard(model, optimizer, policy=nonfinite, step=first_step, runs=runs, run_names=run_names)
    runner = StepRunner(step, model, optimizer, device, cuda_graph=graphed, fallback=cuda_graph == "auto",
                        generators=generators, guard=guard)  # fmt: skip
    runner.guard = guard
    return runner


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    loss: Callable[..., torch.Tensor],
    *static: Any,
    grad_clip: float | None = None,
    autocast=None,
) -> torch.Tensor:
    """One optimiser step of a single run: ``loss(model, batch, *static)`` (under ``autocast``), backward, the
    gradient norm (clipped to ``grad_clip`` unless None), ``optimizer.step()``. Returns ``[loss, grad_norm]``
    (fp32, on the device; the norm before clipping). Reads no device value on the host: capturable whole."""
    optimizer.zero_grad(set_to_none=True)
    with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
        value = loss(model, batch, *static)
    value.backward()
    if grad_clip is None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return torch.stack([value.detach().float(), grad_norm.float()])


def progress_bar(total: int, initial: int, desc: str, *, enabled: bool, **kwargs: Any):
    """The progress bar of a run's (or a batch's) training steps."""
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, **kwargs)


def default_autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing elsewhere: every trainer's forward."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


# -- one run of a trainer -------------------------------------------------------------------------------------------
class TrainingRun:
    """One run, as a trainer describes it to :func:`train_runs`; a trainer subclasses it.

    Attributes a subclass sets: ``folder`` (:class:`RunFolder`), ``identity`` (dict), ``steps``, ``device``,
    ``cuda_graph``, ``nonfinite``, ``progress``, ``log_every``, ``eval_every`` (0: at the end only),
    ``checkpoint_every``, ``grad_clip`` (None: no clipping), ``name`` (how messages name the run; default its
    folder). Methods it must write: :meth:`build_model`, :meth:`build_optimizer`, :meth:`learning_rate`,
    :meth:`next_batch`, :meth:`loss`, :meth:`finish`. The others have defaults.

    Batched runs (``K`` runs of one shape, :func:`train_runs` with ``batched=True``) call :meth:`loss` under
    ``torch.func.vmap`` with one run's rows: per-run constants of the loss ride in the batch (:meth:`constants`).
    """

    folder: RunFolder
    identity: dict
    steps: int
    device: torch.device
    cuda_graph: str = "auto"
    nonfinite: str = "stop"
    progress: bool = True
    log_every: int = 50
    eval_every: int = 0
    checkpoint_every: int = 500
    grad_clip: float | None = None
    #: Why CUDA graphs cannot run for this run (``--compile``, data-parallel), or None.
    excluded: str | None = None
    #: Rank 0 of a data-parallel run (or a single process): the process that writes the run's files.
    is_main: bool = True
    #: Whether the run trains inside a batch (set before :meth:`build_model`): its model then runs under ``vmap``.
    batched: bool = False
    #: The run's own random streams (torch's CPU generator, its CUDA device's): see :meth:`own_streams`.
    torch_state: torch.Tensor
    cuda_state: torch.Tensor | None = None

    # Set by train_runs.
    model: nn.Module
    optimizer: torch.optim.Optimizer
    resumed: Resumed | None = None
    step: int = 0

    @property
    def name(self) -> str:
        return str(self.folder.path)

    # -- building ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Before the model is built: the run folder (default: created, with ``config.json`` of :meth:`config`)."""
        if self.is_main:
            self.folder.prepare(self.config_json())

    def config_json(self) -> dict | None:
        """What ``config.json`` holds (None: no such file)."""
        return None

    def build_model(self) -> nn.Module:
        """The run's model, initialised from its seed (moved to :attr:`device` afterwards)."""
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The run's ``torch.optim.Adam`` / ``AdamW`` over ``model``'s parameters (a batch reads each run's groups,
        weight decays and betas from it)."""
        raise NotImplementedError

    def restore(self, resumed: Resumed) -> None:
        """Restore the run's own random streams from its checkpoint (the model and optimiser are done)."""

    def random_state(self) -> dict:
        """The run's own random streams, saved under the checkpoint's ``"rng"`` (torch's generators are added)."""
        return {}

    def checkpoint_extra(self) -> dict:
        """More checkpoint fields of this trainer."""
        return {}

    def finished(self) -> Any:
        """The run's stored result when it is finished (at its last step, result kept), else None."""
        return None

    @contextlib.contextmanager
    def own_streams(self):
        """Draw from the run's own random streams inside the block (e.g. Headless-AD's per-step action maps): in a
        batch, torch's default generators hold the batch's shared stream, so the block runs with the run's own
        states swapped in (and kept for its checkpoint), drawing what the run draws alone. A run alone already
        draws from its own streams."""
        if not self.batched:
            yield
            return
        shared = torch.get_rng_state(), (torch.cuda.get_rng_state(self.device) if self.cuda_state is not None else None)
        _set_streams(self)
        try:
            yield
        finally:
            self.torch_state = torch.get_rng_state()
            torch.set_rng_state(shared[0])
            if self.cuda_state is not None:
                self.cuda_state = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(shared[1], self.device)

    # -- the step ---------------------------------------------------------------------------------------------
    def learning_rate(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        raise NotImplementedError

    def next_batch(self, step: int) -> dict[str, torch.Tensor]:
        """The run's batch for 0-based ``step`` from its own data stream (CPU tensors, or device tensors)."""
        raise NotImplementedError

    def static(self, step: int) -> tuple:
        """Host-side constants of ``step`` that shape it (a CUDA graph is captured per value), passed to the loss."""
        return ()

    def constants(self) -> dict[str, float]:
        """Per-run scalars the loss reads from the batch when runs train as one batch (one value per run)."""
        return {}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], *static: Any) -> torch.Tensor:
        """The training loss of ``model`` on ``batch`` (a 0-d tensor): what one step of the paper minimises."""
        raise NotImplementedError

    def single_step(self, model, optimizer, batch, *static) -> torch.Tensor:
        """One optimiser step of this run alone: ``[loss, grad_norm]`` on the device (default: :func:`train_step`)."""
        return train_step(model, optimizer, batch, self.loss, *static, grad_clip=self.grad_clip,
                          autocast=default_autocast(self.device))  # fmt: skip

    # -- when the loop reads the host -------------------------------------------------------------------------
    def log_due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps

    def eval_due(self, step: int) -> bool:
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.steps

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.steps

    def log_row(self, step: int, losses: list[float], grad_norms: list[float]) -> dict:
        """The ``metrics.jsonl`` fields of a log point, from every step's loss and gradient norm since the last one
        (the loop adds the step, learning rate, speed and time): by default the last step's values."""
        return {"loss": losses[-1], "grad_norm": grad_norms[-1]}

    def on_row(self, step: int, row: dict) -> None:
        """Called with every row written (e.g. a tracker's scalars)."""

    def write_row(self, row: dict) -> None:
        """Append ``row`` (with its ``"step"``) to the run's metrics, while it trains or finishes."""
        self._write_row(row)

    def evaluate(self, model: nn.Module, step: int) -> dict:
        """The row fields of an evaluation during training, at ``step`` (``model`` holds the run's values)."""
        return {}

    def finish(self, model: nn.Module, step: int) -> Any:
        """After the last step: the final evaluation, files and result of the run (what :func:`train_runs`
        returns for it)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the run holds open (trackers)."""

    # -- several runs at once (a trainer may do these together, e.g. one batched rollout for all) ---------------
    @classmethod
    def starting(cls, runs: Sequence[TrainingRun], model: nn.Module, step: int) -> None:
        """Before the first step of ``runs`` (one run, or a batch; ``model``: what trains)."""

    @classmethod
    def batch_runs(cls, runs: Sequence[TrainingRun], step: int) -> dict[str, torch.Tensor]:
        """The batch of a batched step: each run's :meth:`next_batch` stacked along a leading run dimension."""
        rows = [run.next_batch(step) for run in runs]
        return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}

    @classmethod
    def evaluate_runs(cls, runs: Sequence[TrainingRun], models: Sequence[nn.Module], step: int) -> list[dict]:
        """:meth:`evaluate` of each run on its model."""
        return [run.evaluate(model, step) for run, model in zip(runs, models)]

    @classmethod
    def finish_runs(cls, runs: Sequence[TrainingRun], models: Sequence[nn.Module], step: int) -> list[Any]:
        """:meth:`finish` of each run on its model."""
        return [run.finish(model, step) for run, model in zip(runs, models)]


class ReadingRun(TrainingRun):
    """A run whose evaluations are readings of its model along training: every ``eval_every`` steps, at its start
    (step 0, the initial model) and at its end, each logged with the mean training loss since the reading before
    (``"mean_loss"``; a log point is a reading). icrl-markov's G_Markov, icrl-induction's head scores."""

    def log_row(self, step: int, losses: list[float], grad_norms: list[float]) -> dict:
        return {"loss": losses[-1], "grad_norm": grad_norms[-1], "mean_loss": float(np.mean(losses, dtype=np.float64))}

    def eval_due(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.steps

    @classmethod
    def starting(cls, runs: Sequence[TrainingRun], model: nn.Module, step: int) -> None:
        for run in runs:
            run.train_start = time.perf_counter()
            if run.step == 0:  # where the readings start from: the initial model
                run.write_row({"step": 0, **run.evaluate(run.model, 0)})

    def readings(self, key: str) -> tuple[list[dict], list[float], int]:
        """The run's readings (the rows holding ``key``, in order), the mean training loss before each (NaN at
        step 0), and its non-finite steps (``--nonfinite skip``; 0 otherwise), from its metrics."""
        rows = read_metrics(self.folder.metrics)
        losses = {row["step"]: row["mean_loss"] for row in rows if "mean_loss" in row}
        readings = [row for row in rows if key in row]
        skipped = next((row["skipped_steps"] for row in reversed(rows) if "skipped_steps" in row), 0)
        return readings, [losses.get(row["step"], float("nan")) for row in readings], skipped


# -- the loop -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Progress:
    """What the loop keeps of a run while it trains: its log file, last log point and unread statistics."""

    metrics: JsonLines | None
    last_log: tuple
    losses: list = dataclasses.field(default_factory=list)
    grad_norms: list = dataclasses.field(default_factory=list)
    last_loss: float | None = None


def open_runs(runs: Sequence[TrainingRun], *, batched: bool = False) -> list[Any]:
    """Prepare each run's folder, build its model and optimiser, and resume it from its checkpoint; trim its
    metrics to the checkpoint's step. Returns each run's stored result if it is finished, else None. ``batched``:
    the runs will train in a batch."""
    results = []
    for run in runs:
        run.batched = batched
        run.prepare()
        model = run.build_model()
        # The run's own random streams where its initialisation left them: a single run continues them; a batch
        # draws its dropout masks from one shared stream, and a run's other draws from its own (own_streams).
        run.torch_state = torch.get_rng_state()
        run.cuda_state = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
        run.model = model.to(run.device)
        run.optimizer = run.build_optimizer(run.model)
        run.step = 0
        run.resumed = resume(run.folder.checkpoint, run.identity, steps=run.steps)
        if run.resumed is not None:
            run.step = run.resumed.step
            run.resumed.restore_model(run.model)
            run.resumed.restore_optimizer(run.optimizer)
            run.torch_state = run.resumed.torch_state()
            if run.cuda_state is not None and "cuda" in run.resumed.field("rng", kind=dict):
                run.cuda_state = run.resumed.field("rng", "cuda", kind=torch.Tensor)
            run.restore(run.resumed)
        if run.is_main:  # a fresh run logs from scratch: rows without a checkpoint come from a killed attempt
            trim_metrics(run.folder.metrics, run.step if run.resumed is not None else -1)
        results.append(run.finished())
    return results


def train_runs(runs: Sequence[TrainingRun], *, batched: bool = False) -> list[Any]:
    """Train (or resume) ``runs`` to their last steps and finish each; returns what each run's
    :meth:`TrainingRun.finish` returns (a finished run's stored result, without training). ``batched``: the runs
    train as one batched model (they must share a shape; runs resumed at different steps train as consecutive
    batches); otherwise one after another."""
    results = open_runs(runs, batched=batched)
    pending = [index for index, result in enumerate(results) if result is None]
    if batched:  # a batch per step the runs resumed at and per model shape their data give
        keys = {index: (runs[index].step, _architecture(runs[index].model)) for index in pending}
        groups = [
            [i for i in pending if keys[i] == key] for key in sorted(set(keys.values()), key=lambda k: (k[0], repr(k)))
        ]
    else:
        groups = [[index] for index in pending]
    for group in groups:
        for index, result in zip(group, _train_group([runs[i] for i in group], batched)):
            results[index] = result
    return results


def _architecture(model: nn.Module) -> tuple:
    """What models of one batch share: their class and parameter names and shapes."""
    return type(model).__qualname__, tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


class _Single:
    """A run alone: its own model and ``torch.optim`` optimiser."""

    def __init__(self, run: TrainingRun) -> None:
        self.runs, self.run = [run], run
        self.model, self.optimizer = run.model, run.optimizer
        # The stream of this run's dropout masks (and Headless-AD's maps): where its model's initialisation left
        # it, or where its checkpoint saved it.
        _set_streams(run)

    def step(self, batch: dict, *static) -> torch.Tensor:
        return self.run.single_step(self.model, self.optimizer, batch, *static)

    def batch(self, step: int, learning_rates: list[float]) -> dict:
        set_learning_rate(self.optimizer, learning_rates[0])
        return pinned(self.run.next_batch(step), self.run.device)

    def run_model(self, index: int) -> nn.Module:
        return self.model

    def states(self, index: int, learning_rate: float) -> tuple[dict, dict, dict]:
        rng = {"torch": torch.get_rng_state()}
        if self.run.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.run.device)
        return self.model.state_dict(), eager_optimizer_state(self.optimizer), rng


class _Stacked:
    """``K`` runs as one batched model: :class:`~icrl_models.batched.StackedRuns` of their models and a
    :class:`~icrl_models.batched.RunAdamW` holding their optimisers' states (restored ones included)."""

    def __init__(self, runs: list[TrainingRun]) -> None:
        self.runs = runs
        device = runs[0].device
        _set_streams(runs[0])  # one stream for the batch's dropout masks
        self.stacked = StackedRuns([run.model for run in runs]).to(device)
        self.optimizer = RunAdamW.for_runs(
            self.stacked.flat, [list(run.model.parameters()) for run in runs], [run.optimizer for run in runs]
        )
        for run in runs:
            run.optimizer = None  # its state lives in the batch's optimiser now
        self.model = self.stacked
        self.max_norms = torch.tensor([float("inf") if run.grad_clip is None else run.grad_clip for run in runs],
                                      device=device)  # fmt: skip
        names = sorted({name for run in runs for name in run.constants()})
        self.constants = {name: torch.tensor([float(run.constants()[name]) for run in runs]) for name in names}
        self.autocast = default_autocast(device)

    def step(self, batch: dict, *static) -> torch.Tensor:
        def loss(model, rows):
            return self.runs[0].loss(model, rows, *static)

        return batched_train_step(self.stacked, self.optimizer, batch, loss, self.max_norms, self.autocast)

    def batch(self, step: int, learning_rates: list[float]) -> dict:
        batch = type(self.runs[0]).batch_runs(self.runs, step)
        batch.update(self.constants)
        batch["learning_rate"] = torch.tensor(learning_rates, dtype=torch.float64)  # as exact as AdamW's float lr
        return pinned(batch, self.runs[0].device)

    def run_model(self, index: int) -> nn.Module:
        """Run ``index``'s own model, holding the run's current values (for its evaluations)."""
        model = self.runs[index].model
        model.load_state_dict(self.stacked.run_state_dict(index))
        return model.train(self.stacked.training)

    def states(self, index: int, learning_rate: float) -> tuple[dict, dict, dict]:
        run = self.runs[index]
        rng = {"torch": run.torch_state}  # the run's own streams (its dropout masks come from a shared one)
        if run.cuda_state is not None:
            rng["cuda"] = run.cuda_state
        return self.stacked.run_state_dict(index), self.optimizer.run_state_dict(index, learning_rate), rng


def stepper(runs: Sequence[TrainingRun], *, batched: bool, step: int = 0) -> Callable[[], torch.Tensor]:
    """One training step of opened ``runs`` (:func:`open_runs`) as the loop takes it, drawing their batches
    included, as a function (for timing: ``--batch-runs auto`` and ``benchmarks/bench_sweep.py``): all of them as
    one batch (``batched``), or the one run alone. Returns the step's statistics (not read on the host)."""
    runs = list(runs)
    if not batched and len(runs) != 1:
        raise ValueError(f"runs must be one run unless batched, got {len(runs)}")
    engine = _Stacked(runs) if batched else _Single(runs[0])
    runner = make_step_runner(engine.step, engine.model, engine.optimizer, runs[0].device,
                              cuda_graph=runs[0].cuda_graph, nonfinite="stop",
                              runs=len(runs) if batched else None)  # fmt: skip
    rates = [run.learning_rate(step) for run in runs]
    static = runs[0].static(step)
    engine.model.train()
    return lambda: runner(engine.batch(step, rates), *static)


def measure_batch_runs(
    make_runs: Callable[[int], list[TrainingRun]], device: torch.device, *, runs: int, share: int = 1
) -> int:
    """``--batch-runs auto`` of a trainer: :func:`icrl_models.batched.auto_batch_runs` timing real steps (drawing
    the runs' batches included) of ``make_runs(K)``, ``K`` fresh runs of the sweep's shape (e.g. on a small dataset
    in a temporary folder), stepped as the lifecycle steps them: one run alone, or ``K`` as one batch."""

    def make_step(count: int) -> Callable[[], None]:
        probe = make_runs(count)
        open_runs(probe, batched=count > 1)
        return stepper(probe, batched=count > 1)

    return auto_batch_runs(make_step, device, runs=runs, share=share, log=lambda line: print(line, file=sys.stderr))


def _set_streams(run: TrainingRun) -> None:
    """Torch's default generators (CPU, and the run's CUDA device) set to the run's own states."""
    torch.set_rng_state(run.torch_state)
    if run.cuda_state is not None:
        torch.cuda.set_rng_state(run.cuda_state, run.device)


def _train_group(runs: list[TrainingRun], batched: bool) -> list[Any]:
    first, family = runs[0], type(runs[0])
    device, step, start_time = first.device, first.step, time.perf_counter()
    engine = _Stacked(runs) if batched else _Single(first)
    runner = make_step_runner(
        engine.step, engine.model, engine.optimizer, device, cuda_graph=first.cuda_graph, nonfinite=first.nonfinite,
        first_step=step, excluded=first.excluded, runs=len(runs) if batched else None,
        run_names=[run.name for run in runs] if batched else None,
    )  # fmt: skip
    guard = runner.guard
    for index, run in enumerate(runs):
        if run.resumed is not None:
            guard.saved(run.resumed.path, step, run=index if batched else None)
    progress = [_Progress(JsonLines(run.folder.metrics) if run.is_main else None, (step, start_time)) for run in runs]
    for run, track in zip(runs, progress):
        run._write_row = functools.partial(_write, run, track)
    what = f"{len(runs)} runs" if batched else first.name
    bar = progress_bar(first.steps, step, f"train {what}", enabled=first.progress and first.is_main)
    family.starting(runs, engine.model, step)
    unread: list[torch.Tensor] = []  # every step's statistics since the last host read
    engine.model.train()
    try:
        while step < first.steps:
            learning_rates = [run.learning_rate(step) for run in runs]
            stats = runner(engine.batch(step, learning_rates), *first.static(step))
            unread.append(stats)
            step += 1
            bar.update(1)
            logging = [i for i, run in enumerate(runs) if run.log_due(step)]
            saving = [i for i, run in enumerate(runs) if run.checkpoint_due(step)]
            evaluating = [i for i, run in enumerate(runs) if run.eval_due(step)]
            if not (logging or saving or evaluating):
                continue
            # The one host read: every step's statistics since the last, after the guard's check ("stop": a
            # diverged run ends here, before a non-finite row is logged or a checkpoint of it saved).
            guard.check()
            values = torch.stack(unread).reshape(len(unread), len(runs), 2).tolist()
            unread.clear()
            for index, track in enumerate(progress):
                track.losses += [row[index][0] for row in values]
                track.grad_norms += [row[index][1] for row in values]
            for index in logging:
                _log(runs[index], progress[index], step, learning_rates[index], guard, index, start_time)
            if not batched and progress[0].last_loss is not None:
                bar.set_postfix(loss=f"{progress[0].last_loss:.3f}")
            if evaluating:  # before the checkpoint of the same step: a checkpoint's rows are all on disk
                models = [engine.run_model(i) for i in evaluating]
                for index, fields in zip(evaluating, family.evaluate_runs([runs[i] for i in evaluating], models, step)):
                    _write(runs[index], progress[index], {"step": step, **fields})
                engine.model.train()
            for index in saving:
                if progress[index].metrics is not None:
                    progress[index].metrics.sync()  # the rows up to this step are on disk before the checkpoint
                _save(runs[index], engine, index, step, learning_rates[index])
                guard.saved(runs[index].folder.checkpoint, step, run=index if batched else None)
        bar.close()
        guard.check()
        for run in runs:
            run.step = step
        return family.finish_runs(runs, [engine.run_model(index) for index in range(len(runs))], step)
    finally:
        for track in progress:
            if track.metrics is not None:
                track.metrics.close()
        for run in runs:
            run.close()


def _write(run: TrainingRun, track: _Progress, row: dict) -> None:
    if track.metrics is not None:
        track.metrics.write(row)
    run.on_row(row["step"], row)


def _log(run: TrainingRun, track: _Progress, step: int, learning_rate: float, guard, index: int, start: float) -> None:
    if not track.losses:
        return
    fields = run.log_row(step, track.losses, track.grad_norms)
    track.last_loss = track.losses[-1]
    row, track.last_log = metric_row(step, fields.pop("loss"), learning_rate, fields.pop("grad_norm"), track.last_log,
                                     start)  # fmt: skip
    row.update(fields)
    if run.nonfinite == "skip":
        row["skipped_steps"] = guard.skipped(index if guard.runs is not None else None)
    track.losses, track.grad_norms = [], []
    _write(run, track, row)


def _save(run: TrainingRun, engine, index: int, step: int, learning_rate: float) -> None:
    model_state, optimizer_state, rng = engine.states(index, learning_rate)
    rng = {**run.random_state(), **rng}  # on every rank (a data-parallel run gathers its ranks' streams)
    if run.is_main:
        save_run_checkpoint(run.folder.checkpoint, step, run.identity, model_state, optimizer_state, rng,
                            **run.checkpoint_extra())  # fmt: skip


__all__ = [
    "ReadingRun", "Resumed", "RunFolder", "TrainingRun", "default_autocast", "final_evaluation", "make_step_runner",
    "measure_batch_runs", "metric_row", "open_runs", "progress_bar", "read_metrics", "resume", "save_run_checkpoint",
    "stepper", "train_runs", "train_step", "trim_metrics",
]  # fmt: skip
