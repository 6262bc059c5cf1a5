"""Run an experiment's trials one after another in this process, or as Ray Tune trials (the ``sweep`` extra).

A trial is one training run: an ``icrl-train`` run (a :class:`~icrl_models.train.TrainConfig` with its own
run folder) for ``icrl-compare`` and ``icrl-headless --ablations``, or a small dataclass naming one run of
``icrl-markov``, ``icrl-looped`` or ``icrl-induction``. The experiment gives :func:`run_trials` the trials
and the module-level function that runs one; it gets the outcomes back in the trials' order, whichever way
they ran, and gathers them exactly as before.

* **local** (the default without Ray): a loop in this process, as the commands always ran.
* **ray** (the default when ``ray[tune]`` is installed): each config is one Ray Tune trial on a Ray
  instance started inside this process (this machine's CPUs and GPUs), or on the cluster at
  ``ray_address``. A trial asks for ``trial_cpus`` CPUs (its run uses that many torch threads) and
  ``trial_gpus`` GPUs (default: one where the cluster has GPUs, so one trial per GPU; none otherwise).

Resuming needs nothing from Ray: an ``icrl-train`` run whose folder holds its finished evaluation is not
trained again and an interrupted one resumes from its ``checkpoint.pt``; other trials keep their outcome
with :func:`reuse_or_run`. Rerunning a killed sweep's command therefore trains only what was left.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checks import check_float
from ..config import torch_threads

SCHEDULERS = ("auto", "ray", "local")
SWEEP_HINT = "(runs trials one at a time; pip install 'icrl-kernels[sweep]' runs them in parallel on Ray Tune)"


def ray_tune_available() -> bool:
    """Whether Ray Tune can be imported (the ``sweep`` extra)."""
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.tune") is not None


@dataclass
class SweepOptions:
    """How an experiment runs its trials (the fields an experiment's config adds as flags)."""

    scheduler: str = dataclasses.field(
        default="auto",
        metadata={"help": "auto (Ray Tune if installed, else one trial at a time), ray or local"},
    )
    ray_address: str | None = dataclasses.field(
        default=None, metadata={"help": "Ray cluster to run on, e.g. ray://head:10001 (default: start Ray here)"}
    )
    trial_cpus: float = dataclasses.field(default=1.0, metadata={"help": "CPUs per Ray trial (its torch threads)"})
    trial_gpus: float | None = dataclasses.field(
        default=None, metadata={"help": "GPUs per Ray trial (default: 1 where the cluster has GPUs, else 0)"}
    )

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if not check_float(self.trial_cpus, "trial_cpus") > 0:
            raise ValueError(f"trial_cpus must be > 0, got {self.trial_cpus}")
        if self.trial_gpus is not None and not check_float(self.trial_gpus, "trial_gpus") >= 0:
            raise ValueError(f"trial_gpus must be >= 0, got {self.trial_gpus}")
        if self.scheduler == "ray" and not ray_tune_available():
            raise ValueError("scheduler='ray' needs Ray Tune: pip install 'icrl-kernels[sweep]'")

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
    """``[runner(config) for config in configs]``, locally or as Ray Tune trials (see the module docstring).

    Args:
        configs: one trial each (a ``TrainConfig`` with its own ``out_dir``, or an experiment's trial).
        runner: runs one trial (train, evaluate, score); returns a JSON-serialisable dict. Must be a
            module-level function (Ray sends it to its workers by reference). On Ray it runs with
            ``trial_cpus`` torch threads.
        options: the scheduler and the resources of a Ray trial.
        name, storage: Ray Tune's experiment name and the folder of its own records (under the sweep's
            output folder); unused locally.
        on_outcome: called with ``(index, outcome)`` as each trial finishes (locally: in order).
    Returns:
        the outcomes, in the order of ``configs``.
    """
    if not options.uses_ray(len(configs)):
        if len(configs) > 1 and options.scheduler == "auto":
            print(f"icrl: {len(configs)} trials {SWEEP_HINT}", file=sys.stderr)
        outcomes = []
        for index, config in enumerate(configs):
            outcomes.append(runner(config))
            if on_outcome is not None:
                on_outcome(index, outcomes[-1])
        return outcomes
    return _run_on_ray(configs, runner, options, name=name, storage=Path(storage), on_outcome=on_outcome)


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
    threads = max(1, int(options.trial_cpus))
    # A trial's torch threads follow its CPU share (_ray_trial). icrl-train runs set their own from
    # TrainConfig.threads: its automatic 0 becomes the share too; an explicit --threads of the sweep wins.
    configs = [dataclasses.replace(c, threads=threads) if getattr(c, "threads", None) == 0 else c for c in configs]
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
        missing = [configs[i].out_dir for i, outcome in enumerate(outcomes) if outcome is None]
        raise RuntimeError(f"Ray Tune trials failed ({'; '.join(errors) or 'no result'}): {missing}")
    return outcomes  # type: ignore[return-value]


# --- results kept per trial (resuming experiments whose trials are not icrl-train runs) ---------------------


def settings_key(config: Any, run_only: Sequence[str] = (), **run: Any) -> dict:
    """What a trial's result depends on: the dataclass ``config`` without the fields that only say where and
    how it runs (``run_only`` and :class:`SweepOptions`'), plus the trial's own ``run`` values; as JSON reads
    it back (tuples become lists), so that it compares equal to a stored key."""
    where = {*run_only, *(field.name for field in dataclasses.fields(SweepOptions))}
    settings = {name: value for name, value in dataclasses.asdict(config).items() if name not in where}
    return json.loads(json.dumps({**settings, **run}))


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
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"key": key, "outcome": outcome}))
    partial.replace(path)
    return outcome
