"""``icrl-looped``: a looped transformer vs an unlooped one on in-context function learning.

Trains the looped transformer (one weight-tied block, ``b`` loops with the prompt injected every loop,
loss over the last ``T`` loops, ``b`` growing on the official schedule) and an unlooped GPT-2 of the
same width (``unlooped_layers`` blocks, one pass) on the same stream of prompts, with the same steps,
batch and optimiser. Then, on ``eval_prompts`` fresh prompts:

* normalised squared error vs the number of in-context examples, for both models and the baselines
  (least squares, averaging, 3-nearest-neighbours);
* the looped model's error vs the number of loops at inference, up to ``eval_loop_factor`` times the
  trained ``b`` (does it stay flat beyond what it was trained for?).

Presets: ``cpu`` (the paper's analysis setting d = 5, k = 10 with a narrow model; minutes on a laptop)
and ``paper`` (d = 20, k = 40, D = 256, 8 heads, a 12-layer unlooped baseline, the official
curricula; for a GPU). Every field can be overridden. Outputs in ``out_dir``: ``looped.json``,
``looped.md`` (the command line, the machine and the summary) and ``looped.png``. ``--seeds 0 1 2`` runs
the experiment once per seed (each in ``out_dir/seed<N>``, as ``--seed N`` would, resuming what is there)
and writes the three files over all seeds: mean ± sd over seeds of each method's error at ``k``, the
looped-minus-unlooped difference per seed, and every seed's report (without the per-step training losses,
which stay in the seed folders).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from icrl_kernels.validation import check_int

from .._checks import check_training_fields
from .._cli import command_line, resolve_device
from ..config import add_config_arguments, as_tuple, config_from_args, make_parser, torch_threads
from ..cuda_graphs import CUDA_GRAPH_HELP, cuda_graph_mode, use_cuda_graph
from ..files import save_figure, write_text
from ..function_classes import (
    BASELINES,
    FUNCTION_CLASSES,
    Curriculum,
    FunctionClassConfig,
    baseline_predictions,
    normalized_squared_error,
    sample_prompts,
)
from ..lifecycle import (
    Resumed,
    RunFolder,
    TrainingRun,
    default_autocast,
    measure_batch_runs,
    read_metrics,
    train_runs,
)
from ..looped_step import make_optimizer
from ..models.looped import LoopedConfig, LoopedTransformer
from ..nonfinite import NONFINITE_HELP
from .harness import (
    StepCost,
    command_string,
    fill_from_preset,
    format_stats,
    machine_description,
    per_seed_configs,
    print_cpu_estimate,
    pyplot,
    run_folder,
    seed_stats,
    transformer_work,
    warmup_then_constant,
    write_results,
)
from .sweep import SweepOptions, TrialBatch, run_trial_batches, sweep_options

PRESETS: dict[str, dict] = {
    # The paper's Section 5 setting (d = 5, k = 10) shrunk to a 2-core budget: D = 64 instead of 256,
    # b up to 15 with T = 5, and a fast dims/points curriculum (from d = 2, 5 points) so the models
    # leave the predict-zero plateau within a few thousand steps (they had not after 1000 steps at d = 5).
    "cpu": dict(
        n_dims=5, n_points=11, d_model=64, n_heads=4, unlooped_layers=4, steps=5000, batch_size=32,
        learning_rate=1e-3, warmup_steps=200, loops_start=5, loops_end=15, loops_increment=2,
        loops_interval=300, grad_loops=5, dims_start=2, points_start=5, curriculum_interval=400,
        eval_prompts=1280,
    ),
    # Section 4.1 with the official schedules: b from 15 to 30 (+2 every 500 steps), T = 15; d from
    # 5 to 20 and points from 11 to 41 (every 2000 steps, Garg et al.). The paper trains 500k steps.
    "paper": dict(
        n_dims=20, n_points=41, d_model=256, n_heads=8, unlooped_layers=12, steps=500_000, batch_size=64,
        learning_rate=1e-4, warmup_steps=0, loops_start=15, loops_end=30, loops_increment=2,
        loops_interval=500, grad_loops=15, dims_start=5, points_start=11, curriculum_interval=2000,
        eval_prompts=1280,
    ),
}  # fmt: skip


def _field(help_text: str, default=None):
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass
class LoopedExperimentConfig(SweepOptions):
    """One run of ``icrl-looped``; ``None`` fields take the preset's value. The looped and the unlooped model
    train as two trials of :mod:`~icrl_models.experiments.sweep` (on Ray Tune when installed)."""

    preset: str = _field(f"one of {tuple(PRESETS)}", "cpu")
    task: str = _field(f"function class, one of {FUNCTION_CLASSES}", "linear_regression")
    n_dims: int | None = _field("input dimension d")
    n_points: int | None = _field("points per prompt (the last one is predicted from k = n_points - 1 examples)")
    d_model: int | None = _field("model width D")
    n_heads: int | None = _field("attention heads")
    unlooped_layers: int | None = _field("blocks of the unlooped baseline")
    steps: int | None = _field("training steps of each model")
    batch_size: int | None = _field("prompts per step")
    learning_rate: float | None = _field("Adam learning rate")
    warmup_steps: int | None = _field("linear learning-rate warm-up steps")
    loops_start: int | None = _field("loops b at step 0")
    loops_end: int | None = _field("largest trained b")
    loops_increment: int | None = _field("b increment")
    loops_interval: int | None = _field("steps between b increments")
    grad_loops: int | None = _field("T: loops with gradient (the last T of b)")
    dims_start: int | None = _field("active dimensions at step 0 (dims curriculum)")
    points_start: int | None = _field("points at step 0 (points curriculum)")
    curriculum_interval: int | None = _field("steps between dims (+1) and points (+2) increments")
    eval_prompts: int | None = _field("fresh prompts for evaluation")
    eval_loop_factor: int = _field("evaluate the looped model up to this many times the trained b", 5)
    skip_unlooped: bool = _field("train only the looped model", False)
    seed: int = _field("random seed", 0)
    seeds: tuple[int, ...] = dataclasses.field(
        default=(),
        metadata={"help": "several seeds: the experiment once per seed (as --seed, in OUT_DIR/seed<N>), then the "
                  "files over all seeds", "metavar": "SEED"},
    )  # fmt: skip
    threads: int | None = _field("torch CPU threads (default: half the available cores, 1 to 4)")
    device: str = _field("cpu or cuda", "cpu")
    backend: str = _field("backend of the fused injection + LayerNorm op", "auto")
    cuda_graph: str = dataclasses.field(
        default="auto",
        metadata={"help": f"{CUDA_GRAPH_HELP}; one graph of the whole step (loops, backward, Adam) per curriculum "
                  "stage, and evaluation replays graphs of 50 loops", "const": "on"},
    )  # fmt: skip
    eval_every: int = _field("steps between logged errors at k on 256 fixed prompts", 250)
    checkpoint_every: int = _field("steps between checkpoints (a rerun resumes from them)", 1000)
    nonfinite: str = _field(NONFINITE_HELP, "stop")
    out_dir: str = _field("output folder", "runs/looped")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cuda_graph = cuda_graph_mode(self.cuda_graph)
        fill_from_preset(self, PRESETS)
        check_training_fields(self)
        for name in ("n_dims", "n_points", "d_model", "n_heads", "unlooped_layers", "loops_start", "loops_end",
                     "loops_increment", "loops_interval", "grad_loops", "curriculum_interval", "eval_prompts",
                     "eval_loop_factor", "eval_every"):  # fmt: skip
            check_int(getattr(self, name), name, min_value=1)
        check_int(self.seed, "seed", min_value=0)
        self.seeds = as_tuple(self.seeds, int, "seeds")
        if any(seed < 0 for seed in self.seeds):
            raise ValueError(f"seeds must be ints >= 0, got {self.seeds}")
        if self.grad_loops > self.loops_start:
            raise ValueError(f"grad_loops ({self.grad_loops}) must be <= loops_start ({self.loops_start})")
        if not 1 <= self.dims_start <= self.n_dims:
            raise ValueError(f"dims_start must be in [1, n_dims={self.n_dims}], got {self.dims_start}")
        if not 2 <= self.points_start <= self.n_points:
            raise ValueError(f"points_start must be in [2, n_points={self.n_points}], got {self.points_start}")
        FunctionClassConfig(self.task, self.n_dims)  # validates the task name

    def function_class(self) -> FunctionClassConfig:
        return FunctionClassConfig(self.task, self.n_dims)

    def loops_schedule(self) -> Curriculum:
        return Curriculum(self.loops_start, self.loops_end, self.loops_increment, self.loops_interval)

    def dims_schedule(self) -> Curriculum:
        return Curriculum(self.dims_start, self.n_dims, 1, self.curriculum_interval)

    def points_schedule(self) -> Curriculum:
        return Curriculum(self.points_start, self.n_points, 2, self.curriculum_interval)

    def model_config(self, looped: bool, graphed: bool = False) -> LoopedConfig:
        """The model of the looped (or unlooped) run; ``graphed``: its no-grad loops replay CUDA graphs."""
        return LoopedConfig(
            n_dims=self.n_dims,
            max_points=self.n_points,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=1 if looped else self.unlooped_layers,
            backend=self.backend,
            cuda_graph=graphed and looped,
        )


#: Fields that do not change what a checkpoint holds (where and how fast a run goes, and when it stops).
RUN_ONLY_FIELDS = ("steps", "eval_prompts", "eval_loop_factor", "skip_unlooped", "threads", "device", "out_dir",
                   "checkpoint_every", "eval_every", "seeds", "nonfinite", "cuda_graph",
                   *(f.name for f in dataclasses.fields(SweepOptions)))  # fmt: skip


def run_identity(config: LoopedExperimentConfig) -> dict:
    """The config fields a checkpoint must match to be resumed."""
    return {key: value for key, value in dataclasses.asdict(config).items() if key not in RUN_ONLY_FIELDS}


@torch.no_grad()
def error_at_k(model: LoopedTransformer, xs: torch.Tensor, ys: torch.Tensor, loops: int, variance: float) -> float:
    """Normalised squared error of the last prediction (all other points as examples) after ``loops`` loops."""
    model.eval()
    # grad_loops=1: the first loops - 1 run as no-grad loops (graph-replayed with cuda_graph), one is kept.
    preds = model(xs, ys, loops=loops, grad_loops=1)[-1].float()
    model.train()
    return float(((preds[:, -1] - ys[:, -1].float()) ** 2).mean() / variance)


class LoopedRun(TrainingRun):
    """One model of the experiment in the run lifecycle (:mod:`icrl_models.lifecycle`): the looped (or unlooped)
    transformer on the curriculum's prompts (drawn from the seed, so both models see the same stream), the
    truncated loss over its last ``T`` loops; every ``eval_every`` steps the error at ``k`` on 256 fixed prompts;
    ``out_dir/<name>.pt`` every ``checkpoint_every`` steps (its per-step losses in ``<name>-metrics.jsonl``), from
    which a rerun resumes, also to more steps."""

    def __init__(self, config: LoopedExperimentConfig, looped: bool) -> None:
        self.config, self.looped = config, looped
        self.label = "looped" if looped else "unlooped"
        self.device = resolve_device(config.device)
        # Two runs share the folder: each removes only its own killed writes.
        self.folder = RunFolder(config.out_dir, f"{self.label}.pt", f"{self.label}-metrics.jsonl", shared=True)
        self.identity = {**run_identity(config), "model": self.label}
        self.steps, self.cuda_graph, self.nonfinite = config.steps, config.cuda_graph, config.nonfinite
        self.log_every, self.eval_every = config.eval_every, config.eval_every
        self.checkpoint_every = config.checkpoint_every
        self.function_class = config.function_class()
        self.variance = self.function_class.label_variance(config.n_dims)

    @property
    def name(self) -> str:
        return self.label if self.looped else f"unlooped-{self.config.unlooped_layers}L"

    def prepare(self) -> None:
        super().prepare()
        config = self.config
        self.generator = torch.Generator().manual_seed(config.seed + 1)
        self.monitor = sample_prompts(
            self.function_class,
            256,
            config.n_points,
            generator=torch.Generator().manual_seed(config.seed + 2),
            device=self.device,
        )
        self.wall_s = 0.0  # training time of the earlier invocations (from the checkpoint)
        self.started = time.perf_counter()

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.config.seed)
        # The no-grad loops replay CUDA graphs of their own, except in a batch (vmap runs them).
        graphed = use_cuda_graph(self.config.cuda_graph, self.device) and not self.batched
        return LoopedTransformer(self.config.model_config(self.looped, graphed))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return make_optimizer(model.parameters(), self.config.learning_rate)

    def restore(self, resumed: Resumed) -> None:
        resumed.restore_generator(self.generator, "rng", "prompts")
        if "wall_s" in resumed.payload:
            self.wall_s = float(resumed.field("wall_s", kind=(int, float)))
        elif "history" in resumed.payload:  # a checkpoint written before the metrics file: its history
            history = resumed.field("history", kind=dict)
            self.wall_s = float(history.get("wall_s", 0.0))
            if not self.folder.metrics.exists():
                self._rows_from_history(history, resumed.step)

    def _rows_from_history(self, history: dict, step: int) -> None:
        """The metrics rows of a run resumed from a checkpoint that kept its history inside."""
        rows = [{"step": step, "losses": list(history.get("loss", []))}]
        rows += [{"step": s, "eval_error_at_k": e} for s, e in zip(history.get("eval_steps", []),
                                                                   history.get("eval_error_at_k", []))]  # fmt: skip
        write_text(self.folder.metrics, "".join(json.dumps(row) + "\n" for row in rows))

    def random_state(self) -> dict:
        return {"prompts": self.generator.get_state()}

    def checkpoint_extra(self) -> dict:
        return {"wall_s": self.wall_s + time.perf_counter() - self.started}

    def learning_rate(self, step: int) -> float:
        return warmup_then_constant(step, self.config.learning_rate, self.config.warmup_steps)

    def loops(self, step: int) -> tuple[int, int]:
        """``(b, T)`` of 0-based ``step``: the loop curriculum (one pass for the unlooped model)."""
        if not self.looped:
            return 1, 1
        loops = self.config.loops_schedule().value(step)
        return loops, min(self.config.grad_loops, loops)

    def static(self, step: int) -> tuple:
        return self.loops(step)  # a graph per curriculum stage (and per prompt length, the batch's shape)

    def next_batch(self, step: int) -> dict[str, torch.Tensor]:
        config = self.config
        xs, ys = sample_prompts(self.function_class, config.batch_size, config.points_schedule().value(step),
                                active_dims=config.dims_schedule().value(step), generator=self.generator)  # fmt: skip
        return {"xs": xs, "ys": ys}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], loops: int, grad_loops: int) -> torch.Tensor:
        return model.loss(batch["xs"], batch["ys"], loops=loops, grad_loops=grad_loops)

    def log_due(self, step: int) -> bool:
        return step % self.eval_every == 0 or step % self.checkpoint_every == 0 or step == self.steps

    def eval_due(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.steps

    def log_row(self, step: int, losses: list[float], grad_norms: list[float]) -> dict:
        # Every step's loss normalised by the label variance of its active dimensions: stages are comparable.
        first = step - len(losses)
        dims = self.config.dims_schedule()
        normalised = [loss / self.function_class.label_variance(dims.value(first + i)) for i, loss in enumerate(losses)]
        return {"loss": losses[-1], "grad_norm": grad_norms[-1], "losses": normalised}

    def evaluate(self, model: nn.Module, step: int) -> dict:
        with default_autocast(self.device):
            error = error_at_k(model, *self.monitor, self.loops(step - 1)[0], self.variance)
        return {"eval_error_at_k": error}

    def finish(self, model: nn.Module, step: int) -> tuple[LoopedTransformer, dict]:
        rows = read_metrics(self.folder.metrics)
        history = {"loss": [loss for row in rows for loss in row.get("losses", [])],
                   "eval_steps": [row["step"] for row in rows if "eval_error_at_k" in row],
                   "eval_error_at_k": [row["eval_error_at_k"] for row in rows if "eval_error_at_k" in row],
                   "wall_s": self.wall_s + time.perf_counter() - self.started}  # fmt: skip
        return model, history


def train_model(config: LoopedExperimentConfig, looped: bool) -> tuple[LoopedTransformer, dict]:
    """Train one model on the curriculum (:class:`LoopedRun`); returns it and its history. A rerun of the same
    configuration resumes from ``out_dir/<name>.pt`` (at its last step: returns at once).

    History: ``{"loss": [per step, normalised], "eval_steps": [...], "eval_error_at_k": [...], "wall_s"}``.
    """
    ((model, history),) = train_runs([LoopedRun(config, looped)])
    return model, history


@torch.no_grad()
def evaluate(config: LoopedExperimentConfig, looped_model, unlooped_model) -> dict:
    """Errors vs examples (models and baselines) and the looped model's error vs loops, on fresh prompts."""
    device = resolve_device(config.device)
    function_class = config.function_class()
    generator = torch.Generator().manual_seed(config.seed + 12345)
    xs, ys = sample_prompts(function_class, config.eval_prompts, config.n_points, generator=generator, device=device)
    variance = function_class.label_variance(config.n_dims)
    looped_model.eval()
    max_loops = config.eval_loop_factor * config.loops_end
    per_loop = looped_model.predictions_per_loop(xs, ys, max_loops).float().cpu()  # [loops, B, k]
    xs, ys = xs.cpu(), ys.cpu()
    predictions = {name: baseline_predictions(name, xs, ys) for name in BASELINES}
    predictions["looped"] = per_loop[config.loops_end - 1]
    if unlooped_model is not None:
        unlooped_model.eval()
        predictions["unlooped"] = unlooped_model(xs.to(device), ys.to(device))[0].float().cpu()
    errors = {name: normalized_squared_error(preds, ys, variance) for name, preds in predictions.items()}
    per_loop_errors = normalized_squared_error(per_loop, ys, variance)  # [loops, k]
    # Bootstrap 90% interval of the error at k = n_points - 1 examples, as the paper reports.
    last = config.n_points - 1
    resample = torch.randint(config.eval_prompts, (1000, config.eval_prompts), generator=generator)
    intervals = {}
    for name, preds in predictions.items():
        means = ((preds[:, last] - ys[:, last]) ** 2 / variance)[resample].mean(dim=1)
        intervals[name] = [float(means.quantile(0.05)), float(means.quantile(0.95))]
    return {
        "examples": list(range(config.n_points)),
        "error_vs_examples": {name: values.tolist() for name, values in errors.items()},
        "error_at_k": {name: float(values[last]) for name, values in errors.items()},
        "error_at_k_90ci": intervals,
        "loops": list(range(1, max_loops + 1)),
        "looped_error_vs_loops_at_k": per_loop_errors[:, last].tolist(),
        "looped_error_vs_loops_mean": per_loop_errors.mean(dim=1).tolist(),
    }


def run_experiment(config: LoopedExperimentConfig, *, command: str | None = None) -> dict:
    """Train both models, evaluate, write ``looped.json/.md/.png`` to ``out_dir``; returns the report. With
    ``config.seeds``: once per seed in ``out_dir/seed<N>``, then the files over all seeds (:func:`seeds_report`).
    ``command``: the command line recorded in ``looped.json`` and ``looped.md`` (default: this process's)."""
    with torch_threads(config.threads):
        if not config.seeds:
            return _run_experiment(config, command)
        seed_configs = per_seed_configs(config)
        # Every seed's models at once: with --batch-runs, the seeds' looped (and unlooped) models train as batches.
        trials = [trial for seed_config in seed_configs.values() for trial in _trials(seed_config)]
        outcomes = _train_trials(config, trials)
        per_seed = len(_trials(config))
        reports = {
            seed: _run_experiment(seed_config, command, outcomes[index * per_seed : (index + 1) * per_seed])
            for index, (seed, seed_config) in enumerate(seed_configs.items())
        }
        report = seeds_report(config, reports)
        write_results(config.out_dir, "looped", report, format_seeds_summary(report), command=command,
                      machine=machine_description(resolve_device(config.device)))  # fmt: skip
        plot_seeds(report, Path(config.out_dir) / "looped.png")
        return report


#: CPU seconds of a training step with 1 torch thread on the 2-core VM at the cpu preset's sizes, per model
#: (the 20000-step runs of ``cpu-looped-20k.json``); work: prompts x tokens x blocks run (b loops, or the
#: unlooped layers) x width^2.
STEP_COSTS = {
    "looped": StepCost(0.078, transformer_work(32, 22, 15, 64), "cpu-looped-20k.json"),
    "unlooped": StepCost(0.028, transformer_work(32, 22, 4, 64), "cpu-looped-20k.json"),
}


def _estimate_cpu_seconds(config: LoopedExperimentConfig, looped: bool) -> float:
    """The CPU time of training one model from scratch (:data:`STEP_COSTS`, at the largest b and prompt)."""
    blocks = config.loops_end if looped else config.unlooped_layers
    work = transformer_work(config.batch_size, 2 * config.n_points, blocks, config.d_model)
    return STEP_COSTS["looped" if looped else "unlooped"].estimate(config.steps, work)


@dataclass
class LoopedTrial:
    """One model of the experiment to train (:func:`train_model`)."""

    config: LoopedExperimentConfig
    looped: bool

    @property
    def out_dir(self) -> str:
        return self.config.out_dir

    def estimate(self) -> None:
        """Say what training the model from scratch will cost (on stderr)."""
        name = "looped" if self.looped else "unlooped"
        print_cpu_estimate(f"{name} model, seed {self.config.seed} (from scratch)",
                           _estimate_cpu_seconds(self.config, self.looped), device=self.config.device)  # fmt: skip


def train_trial(trial: LoopedTrial) -> dict:
    """Train one model to its final checkpoint (``out_dir/<name>.pt``); ``{"wall_s", "cpu_s"}`` (``cpu_s``: the
    process CPU time of this call, which resumes a checkpoint if there is one)."""
    trial.estimate()
    start = time.process_time()
    _, history = train_model(trial.config, trial.looped)
    return {"wall_s": history["wall_s"], "cpu_s": time.process_time() - start}


def train_batch(batch: TrialBatch) -> dict:
    """``--batch-runs``: the models of ``batch`` (one kind, several seeds) trained to their final checkpoints as one
    batched model; ``{"outcomes": [train_trial's dict per model]}`` (``cpu_s``: each one's share)."""
    for trial in batch.trials:
        trial.estimate()
    start = time.process_time()
    results = train_runs([LoopedRun(trial.config, trial.looped) for trial in batch.trials], batched=True)
    share = (time.process_time() - start) / len(batch.trials)
    return {"outcomes": [{"wall_s": history["wall_s"], "cpu_s": share} for _, history in results]}


def _trials(config: LoopedExperimentConfig) -> list[LoopedTrial]:
    return [LoopedTrial(config, looped) for looped in ((True,) if config.skip_unlooped else (True, False))]


def _train_trials(config: LoopedExperimentConfig, trials: list[LoopedTrial]) -> list[dict]:
    """Every model trained to its final checkpoint: as trials (in parallel on Ray Tune), with ``--batch-runs`` the
    models of one kind (the seeds of ``--seeds``) as batched models."""
    batch_runs = config.batch_runs
    if batch_runs == "auto":
        batch_runs = _auto_batch_runs(config, trials)
    return run_trial_batches(trials, train_trial, train_batch, sweep_options(config), batch_runs=batch_runs,
                             key=lambda trial: trial.looped, name="looped",
                             storage=Path(config.out_dir) / "ray")  # fmt: skip


def _auto_batch_runs(config: LoopedExperimentConfig, trials: list[LoopedTrial]) -> int:
    """``--batch-runs auto``: the lifecycle's measured probe of the looped model's runs at the last curriculum
    stage (the most loops, the longest prompts)."""
    per_kind = sum(1 for trial in trials if trial.looped)
    if per_kind < 2:
        return 1
    late = dict(loops_start=config.loops_end, dims_start=config.n_dims, points_start=config.n_points,
                grad_loops=min(config.grad_loops, config.loops_end))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="icrl-batch-probe-") as folder:

        def make_runs(count: int) -> list[LoopedRun]:
            probe = [dataclasses.replace(config, **late, seed=seed, seeds=(), out_dir=f"{folder}/{count}-{seed}")
                     for seed in range(count)]  # fmt: skip
            return [LoopedRun(run, True) for run in probe]

        return measure_batch_runs(make_runs, resolve_device(config.device), runs=per_kind,
                                  share=sweep_options(config).trials_at_once(len(trials)))  # fmt: skip


def _run_experiment(config: LoopedExperimentConfig, command: str | None, outcomes: list[dict] | None = None) -> dict:
    """One seed's experiment: train both models (unless their ``outcomes`` are given, trained already), evaluate,
    write its files, return its report."""
    out_dir = run_folder(config.out_dir)
    # Both models train as trials; each ends with its final checkpoint, from which train_model below returns at
    # once with the model and its history.
    trials = _trials(config)
    if outcomes is None:
        outcomes = _train_trials(config, trials)
    cpu_start = time.process_time()
    looped_model, looped_history = train_model(config, looped=True)
    unlooped_model, unlooped_history = (None, None) if config.skip_unlooped else train_model(config, looped=False)
    evaluation_start = time.perf_counter()
    results = evaluate(config, looped_model, unlooped_model)
    evaluation_wall = time.perf_counter() - evaluation_start
    b, k = config.loops_end, config.n_points - 1
    at_b = results["looped_error_vs_loops_at_k"][b - 1]
    far = results["looped_error_vs_loops_at_k"][b:]
    report = {
        "config": dataclasses.asdict(config),
        "parameters": {"looped": _count(looped_model), "unlooped": _count(unlooped_model)},
        "training": {"looped": looped_history, "unlooped": unlooped_history},
        "evaluation": results,
        "extrapolation": {
            "trained_loops": b,
            "error_at_trained_loops": at_b,
            "max_error_beyond": max(far) if far else None,
            "error_at_max_loops": results["looped_error_vs_loops_at_k"][-1],
        },
        "wall_s": {
            "looped_train": looped_history["wall_s"],
            "unlooped_train": None if unlooped_history is None else unlooped_history["wall_s"],
            "evaluation": evaluation_wall,
            # Training times come from the checkpoints, so a resumed run still reports the whole run.
            "total": looped_history["wall_s"] + (unlooped_history or {"wall_s": 0.0})["wall_s"] + evaluation_wall,
        },
        # Process CPU time (user + sys) of this invocation: each model's training (none when its checkpoint was
        # already final; the part after a resume) and the evaluation.
        "cpu_s": {
            **{("looped" if trial.looped else "unlooped") + "_train": o["cpu_s"] for trial, o in zip(trials, outcomes)},
            "evaluation": time.process_time() - cpu_start,
        },
        "k": k,
        "device": str(config.device),
        "torch": torch.__version__,
    }
    write_results(out_dir, "looped", report, format_summary(report), command=command,
                  machine=machine_description(resolve_device(config.device)))  # fmt: skip
    plot_results(report, out_dir / "looped.png")
    return report


def seeds_report(config: LoopedExperimentConfig, reports: dict[int, dict]) -> dict:
    """``looped.json`` over seeds: per method :func:`~.harness.seed_stats` of the error at ``k``, of the looped
    minus unlooped error (paired by seed) and of the looped model's error at the trained ``b`` and at the most
    loops evaluated; the summed CPU times; every seed's report without its per-step training losses."""
    seeds = list(config.seeds)
    errors = {name: [reports[s]["evaluation"]["error_at_k"][name] for s in seeds]
              for name in reports[seeds[0]]["evaluation"]["error_at_k"]}  # fmt: skip
    summary = {"error_at_k": {name: seed_stats(values) for name, values in errors.items()}}
    if "unlooped" in errors:
        summary["looped_minus_unlooped"] = seed_stats(np.subtract(errors["looped"], errors["unlooped"]))
    for key in ("error_at_trained_loops", "error_at_max_loops"):
        summary[key] = seed_stats([reports[s]["extrapolation"][key] for s in seeds])
    per_seed = {}
    for seed, report in reports.items():
        training = {name: None if history is None else {k: v for k, v in history.items() if k != "loss"}
                    for name, history in report["training"].items()}  # fmt: skip
        per_seed[str(seed)] = {**report, "training": training}
    return {
        "config": dataclasses.asdict(config),
        "seeds": seeds,
        "k": reports[seeds[0]]["k"],
        "summary": summary,
        "cpu_s": {name: sum(r["cpu_s"][name] for r in reports.values()) for name in reports[seeds[0]]["cpu_s"]},
        "per_seed": per_seed,
    }


def format_seeds_summary(report: dict) -> str:
    """Markdown: the error at ``k`` per method (mean ± sd over seeds, and each seed's), the paired looped minus
    unlooped difference, the looped model's error against loops at inference, and the CPU times."""
    seeds, summary, k = report["seeds"], report["summary"], report["k"]
    config = report["config"]
    lines = [
        f"## Looped transformer, {config['task']} (d = {config['n_dims']}, k = {k}; {config['preset']} preset, "
        f"{config['steps']} steps), seeds {', '.join(map(str, seeds))}",
        "",
        f"Normalised squared error at k = {k} in-context examples ({config['eval_prompts']} fresh prompts per "
        "seed): mean ± sd over seeds, then each seed's value.",
        "",
        f"| method | error (mean ± sd) | {' | '.join(f'seed {seed}' for seed in seeds)} |",
        "|---|---|" + "---|" * len(seeds),
    ]
    rows = list(summary["error_at_k"].items())
    if "looped_minus_unlooped" in summary:
        rows.append(("looped - unlooped (paired)", summary["looped_minus_unlooped"]))
    most_loops = config["eval_loop_factor"] * config["loops_end"]
    rows.append((f"looped at b = {config['loops_end']} loops", summary["error_at_trained_loops"]))
    rows.append((f"looped at {most_loops} loops", summary["error_at_max_loops"]))
    for name, stats in rows:
        lines.append(f"| {name} | {format_stats(stats, 4)} | {' | '.join(f'{v:.4g}' for v in stats['values'])} |")
    cpu = ", ".join(f"{name} {seconds:.0f}" for name, seconds in report["cpu_s"].items())
    lines += ["", f"CPU time of this invocation, summed over seeds (process user + sys, s): {cpu}."]
    return "\n".join(lines)


def plot_seeds(report: dict, path: Path) -> None:
    """Two panels over seeds: every method's error against in-context examples, and the looped model's error at
    ``k`` against loops at inference; one line per seed, a colour per method."""
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4), dpi=120)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (seed, seed_report) in enumerate(report["per_seed"].items()):
        evaluation = seed_report["evaluation"]
        for colour, (name, values) in zip(colours, evaluation["error_vs_examples"].items()):
            left.plot(evaluation["examples"], values, color=colour, linewidth=1, label=name if index == 0 else None)
        right.plot(evaluation["loops"], evaluation["looped_error_vs_loops_at_k"], linewidth=1, label=f"seed {seed}")
    left.set(xlabel="in-context examples", ylabel="normalised squared error", yscale="log")
    left.legend(fontsize=8)
    right.axvline(report["config"]["loops_end"], color="grey", linestyle="--", linewidth=1, label="trained b")
    right.set(xlabel="loops at inference", ylabel=f"error at k = {report['k']}", xscale="log", yscale="log")
    right.legend(fontsize=8)
    figure.suptitle(f"Looped transformer, {report['config']['task']}, seeds {', '.join(map(str, report['seeds']))}")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _count(model) -> int | None:
    return None if model is None else sum(p.numel() for p in model.parameters())


def format_summary(report: dict) -> str:
    """A Markdown summary: error at k examples per method, extrapolation over loops, wall times."""
    config, evaluation, k = report["config"], report["evaluation"], report["k"]
    lines = [
        f"## Looped transformer, {config['task']} (d = {config['n_dims']}, k = {k}; {config['preset']} preset)",
        "",
        f"Normalised squared error at k = {k} in-context examples, {config['eval_prompts']} prompts "
        "(90% bootstrap CI):",
        "",
        "| method | error | 90% CI |",
        "|---|---|---|",
    ]
    for name, value in evaluation["error_at_k"].items():
        low, high = evaluation["error_at_k_90ci"][name]
        lines.append(f"| {name} | {value:.4g} | [{low:.3g}, {high:.3g}] |")
    extrapolation, max_loops = report["extrapolation"], len(evaluation["loops"])
    lines += [
        "",
        f"Looped model vs loops at inference (trained b = {extrapolation['trained_loops']}): error at k "
        f"{extrapolation['error_at_trained_loops']:.4g} at b, worst {extrapolation['max_error_beyond']:.4g} over "
        f"b+1..{max_loops}, {extrapolation['error_at_max_loops']:.4g} at {max_loops} loops.",
        "",
        "Wall time (s): " + ", ".join(f"{name} {value:.0f}" for name, value in report["wall_s"].items() if value),
        f"Parameters: looped {report['parameters']['looped']}, unlooped {report['parameters']['unlooped']}.",
    ]
    return "\n".join(lines)


def plot_results(report: dict, path: Path) -> None:
    """Three panels: error vs in-context examples (all methods), error vs loops (looped model), and the
    error at ``k`` during training (both models)."""
    plt = pyplot()
    evaluation = report["evaluation"]
    figure, (left, right, curves) = plt.subplots(1, 3, figsize=(16, 4), dpi=120)
    for name, values in evaluation["error_vs_examples"].items():
        left.plot(evaluation["examples"], values, marker="o", markersize=3, label=name)
    left.set(xlabel="in-context examples", ylabel="normalised squared error", yscale="log")
    left.axvline(report["config"]["n_dims"], color="grey", linestyle=":", linewidth=1)
    left.legend(fontsize=8)
    right.plot(evaluation["loops"], evaluation["looped_error_vs_loops_at_k"], label=f"k = {report['k']}")
    right.plot(evaluation["loops"], evaluation["looped_error_vs_loops_mean"], label="mean over k")
    right.axvline(
        report["extrapolation"]["trained_loops"], color="grey", linestyle="--", linewidth=1, label="trained b"
    )
    right.set(xlabel="loops at inference", ylabel="normalised squared error", xscale="log", yscale="log")
    right.legend(fontsize=8)
    for name, history in report["training"].items():
        if history is not None:
            curves.plot(history["eval_steps"], history["eval_error_at_k"], label=name)
    curves.set(xlabel="training step", ylabel=f"error at k = {report['k']} (256 prompts)", yscale="log")
    curves.legend(fontsize=8)
    figure.suptitle(f"Looped transformer, {report['config']['task']}, d = {report['config']['n_dims']}")
    figure.tight_layout()
    save_figure(figure, path)


@command_line("icrl-looped")
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("icrl-looped", __doc__)
    add_config_arguments(parser, LoopedExperimentConfig)
    args = parser.parse_args(argv)
    config = config_from_args(LoopedExperimentConfig, args)
    report = run_experiment(config, command=command_string("icrl-looped", argv))
    print(format_seeds_summary(report) if config.seeds else format_summary(report))
    print(f"wrote {Path(args.out_dir) / 'looped.json'}, looped.md and looped.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
