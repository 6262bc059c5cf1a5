"""Run an experiment's trials one after another in this process, in worker processes on this machine, or as
Ray Tune trials (the ``sweep`` extra).

A trial is one training run: an ``icrl-train`` run (a :class:`~icrl_models.train.TrainConfig` with its own
run folder) for ``icrl-compare`` and ``icrl-headless --ablations``, or a small dataclass naming one run of
``icrl-markov``, ``icrl-looped`` or ``icrl-induction``; with ``icrl-compare --batch-runs K`` a trial is a
:class:`~icrl_models.batched.RunBatch` of up to ``K`` runs trained as one batched model, so every scheduler
hands out whole batches. The experiment gives :func:`run_trials` the trials
and the module-level function that runs one; it gets the outcomes back in the trials' order, whichever way
they ran, and gathers them exactly as before.

* **local** (the default without Ray): a loop in this process, as the commands always ran.
* **processes**: ``workers`` trials at a time on this machine (default: its CPUs / ``trial_cpus``), each in a
  fresh worker process of a :mod:`multiprocessing` pool (started with ``spawn``, so each has its own CUDA
  context; one trial per process) with ``trial_cpus`` torch threads. Every trial uses this machine's default
  device: on a one-GPU machine the trials share the GPU, which pays where each run is bound by its host
  (small models, Python-side launches) rather than by the GPU. A trial's output goes to its log,
  ``<storage>/<name>/trial-<index>.log``. Needs nothing beyond the standard library (no Ray).
* **ray** (the default when ``ray[tune]`` is installed): each config is one Ray Tune trial on a Ray
  instance started inside this process (this machine's CPUs and GPUs), or on the cluster at
  ``ray_address``. A trial asks for ``trial_cpus`` CPUs (its run uses that many torch threads) and
  ``trial_gpus`` GPUs (default: one where the cluster has GPUs, so one trial per GPU; none otherwise).

Resuming needs nothing from Ray: an ``icrl-train`` run whose folder holds its finished evaluation is not
trained again and an interrupted one resumes from its ``checkpoint.pt``; other trials keep their outcome
with :func:`reuse_or_run`. Rerunning a killed sweep's command therefore trains only what was left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icrl_kernels.validation import check_int

from .._checks import check_float
from .._cli import ReportedFailure
from ..batched import BATCH_RUNS_HELP, parse_batch_runs
from ..config import torch_threads
from ..files import write_json
from ..nonfinite import TrainingDiverged

SCHEDULERS = ("auto", "ray", "processes", "local")
SWEEP_HINT = (
    "(runs trials one at a time; --scheduler processes runs them in parallel here, "
    "pip install 'icrl-kernels[sweep]' on Ray Tune)"
)


class TrialsFailed(ReportedFailure):
    """Trials of a sweep failed (on Ray or in worker processes: any error, with its log; locally: a diverged
    run); the message names each one."""


def ray_tune_available() -> bool:
    """Whether Ray Tune can be imported (the ``sweep`` extra)."""
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.tune") is not None


@dataclass
class SweepOptions:
    """How an experiment runs its trials (the fields an experiment's config adds as flags)."""

    scheduler: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto (Ray Tune if installed, else one trial at a time), ray, processes (worker "
            "processes on this machine, no Ray) or local"
        },
    )
    ray_address: str | None = dataclasses.field(
        default=None, metadata={"help": "Ray cluster to run on, e.g. ray://head:10001 (default: start Ray here)"}
    )
    trial_cpus: float = dataclasses.field(
        default=1.0, metadata={"help": "CPUs per Ray or processes trial (its torch threads)"}
    )
    trial_gpus: float | None = dataclasses.field(
        default=None, metadata={"help": "GPUs per Ray trial (default: 1 where the cluster has GPUs, else 0)"}
    )
    workers: int = dataclasses.field(
        default=0,
        metadata={"help": "trials at a time with --scheduler processes (0: the CPUs here / trial_cpus)"},
    )
    batch_runs: str = dataclasses.field(
        default="1", metadata={"help": f"{BATCH_RUNS_HELP}. Default 1: one run at a time", "metavar": "K"}
    )

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if not check_float(self.trial_cpus, "trial_cpus") > 0:
            raise ValueError(f"trial_cpus must be > 0, got {self.trial_cpus}")
        if self.trial_gpus is not None and not check_float(self.trial_gpus, "trial_gpus") >= 0:
            raise ValueError(f"trial_gpus must be >= 0, got {self.trial_gpus}")
        self.workers = check_int(self.workers, "workers", min_value=0)
        self.batch_runs = parse_batch_runs(self.batch_runs)
        if self.scheduler == "ray" and not ray_tune_available():
            raise ValueError("scheduler='ray' needs Ray Tune: pip install 'icrl-kernels[sweep]'")

    def trials_at_once(self, trials: int) -> int:
        """How many of ``trials`` trials run at the same time on this machine: ``workers`` (0: the CPUs here /
        ``trial_cpus``) with the processes scheduler, one otherwise (locally; on Ray, one per GPU by default)."""
        if self.scheduler != "processes":
            return 1
        workers = self.workers or max(1, int(_available_cpus() // self.trial_cpus))
        return max(1, min(workers, trials))

    def uses_ray(self, trials: int = 2) -> bool:
        """Whether ``trials`` trials run on Ray: always with ``"ray"``; with ``"auto"`` when Ray Tune is
        installed and there are at least two (one trial gains nothing from Ray's start-up)."""
        return self.scheduler == "ray" or (self.scheduler == "auto" and trials > 1 and ray_tune_available())


def sweep_options(config: Any) -> SweepOptions:
    """The :class:`SweepOptions` fields of an experiment config that carries them."""
    return SweepOptions(**{field.name: getattr(config, field.name) for field in dataclasses.fields(SweepOptions)})


def run_trials(
    configs: Sequence[Any],
    runner: Callable[[Any], dict],
    options: SweepOptions,
    *,
    name: str,
    storage: str | Path,
    on_outcome: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """``[runner(config) for config in configs]``, locally, in worker processes or as Ray Tune trials (see the
    module docstring).

    Args:
        configs: one trial each (a ``TrainConfig`` with its own ``out_dir``, or an experiment's trial).
        runner: runs one trial (train, evaluate, score); returns a JSON-serialisable dict. Must be a
            module-level function (Ray and worker processes import it by name). On Ray and in worker
            processes it runs with ``trial_cpus`` torch threads.
        options: the scheduler and the resources of a trial.
        name, storage: the experiment's name and the folder of the scheduler's own records (under the
            sweep's output folder): Ray Tune's, or the trial logs of worker processes; unused locally.
        on_outcome: called with ``(index, outcome)`` as each trial finishes (locally: in order).
    Returns:
        the outcomes, in the order of ``configs``.
    Raises:
        TrialsFailed: after the other trials finished, naming each trial that failed: on Ray or in worker
            processes any error; locally a run that diverged (:class:`~icrl_models.nonfinite.TrainingDiverged`),
            while any other exception propagates at once (a bug). A command prints it as one line.
    """
    if options.scheduler == "processes":
        return _run_in_processes(configs, runner, options, log_dir=Path(storage) / name, on_outcome=on_outcome)
    if not options.uses_ray(len(configs)):
        if len(configs) > 1 and options.scheduler == "auto":
            print(f"icrl: {len(configs)} trials {SWEEP_HINT}", file=sys.stderr)
        outcomes: list[dict | None] = []
        errors = []
        for index, config in enumerate(configs):
            try:
                outcomes.append(runner(config))
            except TrainingDiverged as error:  # a failed trial, not a bug: the others still run
                print(f"icrl: trial {index} failed: {error}", file=sys.stderr)
                errors.append(f"{index}: {type(error).__name__}: {error}")
                outcomes.append(None)
                continue
            if on_outcome is not None:
                on_outcome(index, outcomes[-1])
        _raise_failed(configs, outcomes, errors, "trials failed")
        return outcomes  # type: ignore[return-value]
    return _run_on_ray(configs, runner, options, name=name, storage=Path(storage), on_outcome=on_outcome)


@dataclass
class TrialBatch:
    """Trials of one shape trained as one batched model (``--batch-runs``): one trial of a scheduler."""

    trials: tuple

    @property
    def out_dir(self) -> str:
        """The trials' folders (a failed batch names them)."""
        return ", ".join(str(getattr(trial, "out_dir", index)) for index, trial in enumerate(self.trials))


def run_trial_batches(
    trials: Sequence[Any],
    run_one: Callable[[Any], dict],
    run_batch: Callable[[TrialBatch], dict],
    options: SweepOptions,
    *,
    batch_runs: int,
    key: Callable[[Any], Any],
    name: str,
    storage: str | Path,
    on_outcome: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """:func:`run_trials` of ``trials``, with up to ``batch_runs`` trials of equal ``key(trial)`` (one shape) handed
    out as one :class:`TrialBatch` that ``run_batch`` trains as one batched model (``{"outcomes": [...]}`` in the
    batch's order); ``run_one`` runs a batch of one, or every trial when ``batch_runs`` is 1. Outcomes come back in
    the trials' order, ``on_outcome`` called per trial."""
    if batch_runs == 1 or len(trials) < 2:
        return run_trials(trials, run_one, options, name=name, storage=storage, on_outcome=on_outcome)
    groups: dict[Any, list[list[int]]] = {}
    batches: list[list[int]] = []
    for index, trial in enumerate(trials):
        open_batches = groups.setdefault(json.dumps(key(trial), default=str), [])
        if not open_batches or len(open_batches[-1]) == batch_runs:
            open_batches.append([])
            batches.append(open_batches[-1])
        open_batches[-1].append(index)
    print(f"icrl: {len(trials)} runs in {len(batches)} batches (--batch-runs {batch_runs})", file=sys.stderr)
    work = [TrialBatch(tuple(trials[i] for i in batch)) for batch in batches]

    def report(index: int, outcome: dict) -> None:
        for member, member_outcome in zip(batches[index], outcome["outcomes"]):
            if on_outcome is not None:
                on_outcome(member, member_outcome)

    ran = run_trials(work, run_batch, options, name=name, storage=storage, on_outcome=report)
    outcomes: list[dict | None] = [None] * len(trials)
    for batch, result in zip(batches, ran):
        for member, outcome in zip(batch, result["outcomes"]):
            outcomes[member] = outcome
    return outcomes  # type: ignore[return-value]


def _ray_trial(params: dict, *, configs: Sequence[Any], runner: Callable[[Any], dict], threads: int) -> None:
    """One Ray Tune trial: run config ``params["trial"]`` with ``threads`` torch threads (its CPU share) and
    report its outcome (as JSON: Ray flattens dicts)."""
    from ray import tune

    index = params["trial"]
    with torch_threads(threads):
        outcome = runner(configs[index])
    tune.report({"trial": index, "outcome": json.dumps(outcome)})


def _run_on_ray(
    configs: Sequence[Any],
    runner: Callable[[Any], dict],
    options: SweepOptions,
    *,
    name: str,
    storage: Path,
    on_outcome: Callable[[int, dict], None] | None,
) -> list[dict]:
    import ray
    from ray import tune

    if not ray.is_initialized():  # a caller (a test, a notebook) may have started Ray with its own limits
        ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False)
    gpus = options.trial_gpus
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    threads, configs = _with_trial_threads(configs, options)
    trainable = tune.with_resources(
        tune.with_parameters(_ray_trial, configs=configs, runner=runner, threads=threads),
        {"cpu": options.trial_cpus, "gpu": gpus},
    )
    tuner = tune.Tuner(
        trainable,
        param_space={"trial": tune.grid_search(list(range(len(configs))))},
        run_config=tune.RunConfig(name=name, storage_path=str(storage.resolve()), verbose=0),
    )
    results = tuner.fit()
    outcomes: list[dict | None] = [None] * len(configs)
    errors = []
    for result in results:
        if result.error is not None:
            errors.append(f"{result.config.get('trial')}: {result.error}")
            continue
        index = int(result.metrics["trial"])
        outcomes[index] = json.loads(result.metrics["outcome"])
        if on_outcome is not None:
            on_outcome(index, outcomes[index])
    if errors or any(outcome is None for outcome in outcomes):
        missing = [_trial_label(configs[i], i) for i, outcome in enumerate(outcomes) if outcome is None]
        raise TrialsFailed(f"Ray Tune trials failed ({'; '.join(errors) or 'no result'}): {missing}")
    return outcomes  # type: ignore[return-value]


def _trial_label(trial: Any, index: int) -> str:
    """A trial's name in an error: its run folder where it has one (an icrl-train config), else its index."""
    out_dir = getattr(trial, "out_dir", None)
    return str(out_dir) if out_dir is not None else f"trial {index}"


def _with_trial_threads(configs: Sequence[Any], options: SweepOptions) -> tuple[int, list[Any]]:
    """A trial's torch threads (its CPU share, ``trial_cpus``) and the configs to run. icrl-train runs set
    their own threads from ``TrainConfig.threads``: its automatic 0 becomes the share too; an explicit
    ``--threads`` of the sweep wins."""
    threads = max(1, int(options.trial_cpus))
    return threads, [
        dataclasses.replace(c, threads=threads) if getattr(c, "threads", None) == 0 else c for c in configs
    ]


def _available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it, e.g. in a container)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _process_trial(job: tuple[int, Callable[[Any], dict], Any, int, str]) -> tuple[int, dict | None, str | None]:
    """Trial ``index`` in a worker process: ``runner(config)`` with ``threads`` torch threads, its output
    (prints, progress bars, warnings, a traceback) written to ``log_path``. Returns ``(index, outcome, None)``,
    or ``(index, None, "ErrorType: message")`` where the trial raised (the other trials go on)."""
    index, runner, config, threads, log_path = job
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            with torch_threads(threads):
                return index, runner(config), None
        except Exception as error:  # noqa: BLE001 -- reported with the trial's name once all have ended
            traceback.print_exc()
            return index, None, f"{type(error).__name__}: {error}"


def _run_in_processes(
    configs: Sequence[Any],
    runner: Callable[[Any], dict],
    options: SweepOptions,
    *,
    log_dir: Path,
    on_outcome: Callable[[int, dict], None] | None,
) -> list[dict]:
    """The ``processes`` scheduler: ``options.workers`` trials at a time (0: the CPUs here / ``trial_cpus``) in
    ``spawn``-ed worker processes; each outcome is reported as it arrives, failures after all trials ended.
    An interrupt (Ctrl-C, a time limit's SIGINT) or a failing ``on_outcome`` terminates the workers at once."""
    threads, configs = _with_trial_threads(configs, options)
    workers = options.trials_at_once(len(configs))
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"trial-{index:04d}.log" for index in range(len(configs))]
    print(f"icrl: {len(configs)} trials, {workers} at a time in worker processes (logs in {log_dir})", file=sys.stderr)
    outcomes: list[dict | None] = [None] * len(configs)
    errors = []
    # spawn, not fork: a forked child of a process that has touched CUDA (or holds torch's thread pools) breaks.
    # One trial per worker process (maxtasksperchild=1): each starts clean, as a trial of its own command would.
    pool = multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1)
    try:
        jobs = [(index, runner, config, threads, str(logs[index])) for index, config in enumerate(configs)]
        for index, outcome, error in pool.imap_unordered(_process_trial, jobs):
            if error is not None:
                errors.append(f"{index}: {error} (log: {logs[index]})")
                continue
            outcomes[index] = outcome
            if on_outcome is not None:
                on_outcome(index, outcome)
        pool.close()
    except BaseException:
        pool.terminate()  # a queued or running trial would otherwise run to its end before this process exits
        raise
    finally:
        pool.join()
    _raise_failed(configs, outcomes, errors, "trials failed in worker processes")
    return outcomes  # type: ignore[return-value]


def _raise_failed(configs: Sequence[Any], outcomes: Sequence[dict | None], errors: list[str], what: str) -> None:
    """Raise :class:`TrialsFailed` naming each failed trial (``errors``) and the run folders left without an
    outcome, if any trial failed."""
    if errors:
        missing = [getattr(configs[i], "out_dir", i) for i, outcome in enumerate(outcomes) if outcome is None]
        raise TrialsFailed(f"{what} ({'; '.join(errors)}): {missing}")


# --- results kept per trial (resuming experiments whose trials are not icrl-train runs) ---------------------


def settings_key(config: Any, run_only: Sequence[str] = (), **run: Any) -> dict:
    """What a trial's result depends on: the dataclass ``config`` without the fields that only say where and
    how it runs (``run_only`` and :class:`SweepOptions`'), plus the trial's own ``run`` values; as JSON reads
    it back (tuples become lists), so that it compares equal to a stored key."""
    where = {*run_only, *(field.name for field in dataclasses.fields(SweepOptions))}
    settings = {name: value for name, value in dataclasses.asdict(config).items() if name not in where}
    return json.loads(json.dumps({**settings, **run}))


def reuse_or_run_batch(paths: Sequence[str | Path], keys: Sequence[dict], run: Callable[[list[int]], list[dict]]):
    """:func:`reuse_or_run` of several trials trained together: the outcomes stored under their keys are read
    back, ``run(indices)`` trains the others at once (their outcomes in that order), each then stored."""
    outcomes: list[dict | None] = [None] * len(paths)
    for index, (path, key) in enumerate(zip(paths, keys)):
        if Path(path).exists():
            stored = json.loads(Path(path).read_text())
            if stored.get("key") == key:
                outcomes[index] = stored["outcome"]
    missing = [index for index, outcome in enumerate(outcomes) if outcome is None]
    if missing:
        for index, outcome in zip(missing, run(missing)):
            write_json(paths[index], {"key": keys[index], "outcome": outcome}, indent=None)
            outcomes[index] = outcome
    return outcomes


def reuse_or_run(path: str | Path, key: dict, run: Callable[[], dict]) -> dict:
    """``run()``'s outcome, kept in the JSON file ``path`` under ``key``: a later call with the same key reads
    it back instead of running again, which is how a rerun (or a resumed sweep) skips finished trials. The
    file is replaced atomically, so a killed trial leaves no half-written result."""
    path = Path(path)
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["outcome"]
    outcome = run()
    write_json(path, {"key": key, "outcome": outcome}, indent=None)
    return outcome
