"""``icrl-headless``: the Headless-AD paper's experiments (Sinii et al., 2024, Sections 4.1-4.3).

One command trains Headless-AD (and, with ``--baseline``, AD with a fixed action head on the same
data) and evaluates both in context on action spaces never seen in training:

* ``bernoulli``: Thompson-sampling histories on Bernoulli bandits with 4-20 arms (95% of bandits with
  the high means on the odd arms); evaluated on that distribution, on the mirrored one (high means on
  the even arms), on uniform means, and on uniform bandits with 20, 25, 30, 40 and 50 arms.
* ``contextual``: LinUCB histories on contextual bandits with 4-20 arms; evaluated on 4-20 arms and
  on 20, 25, 30, 40 and 50 arms.
* ``darkroom``: Q-learning histories on Darkroom-125 with the 50 training actions; evaluated on the
  five action sets of the paper's Figure 7 (train, permuted train, sliced test, test, all).

Scores: the normalised score of the paper, ``(model - random) / (source - random)`` of the mean return
(0 = a uniformly random policy, 1 = the algorithm that generated the data, re-run from scratch on the
same tasks), and for Darkroom the success rate of the last in-context episodes. AD acts on positions
of the action set through a head of fixed width, so it is evaluated only on sets no larger than its
training sets (and on reordered or replaced sets of that size, where its actions change meaning),
as in the paper; it is reported "n/a" elsewhere (the paper retrains AD for those).

Protocol (held-out temperature selection): every model trains once per training seed (``--training-seeds``,
each with its own histories). How a model samples decides its score (the ablations: sampling at the training
temperature loses Headless-AD its score on many arms), so each model's sampling temperature is chosen from a
grid (``--select-temperatures``, fractions of its training temperature: tau for Headless-AD, 1 for AD's
softmax) on selection seeds (``--selection-seeds``: evaluation bandits used for nothing else), by the mean
score over its training seeds, selection seeds and the *seen* evaluation sets only (:func:`selection_sets`: arm
counts inside the training range 4-20, Darkroom's training action sets), so that the unseen sets, where the
claim is generalisation, play no part in the choice. The table reports each model at its chosen temperature on
disjoint report seeds (``--report-seeds``), every set on its own row: per training seed the mean over report
seeds, then mean ± sd over training seeds. Arm counts inside the training range (4-20) are "seen", the others
"unseen".

Presets: ``cpu`` (default) fits a 2-core laptop in minutes per model; ``paper`` uses the paper's
Tables 3-4 (our choice of steps and batch size: the tables do not give them) and wants a GPU.
Outputs in ``--out-dir``: one run folder per model and training seed (``seed<N>/<model>``, as ``icrl-train``
writes, with its evaluations kept in ``evaluations.json``), ``headless.json`` (every score, the chosen
temperatures, the seeds, CPU times), ``headless.md`` (the command line, the machine and the table) and
``headless.png`` (scores per evaluation set).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .._checks import check_float
from .._cli import command_line
from ..analysis import reward_dependence
from ..config import add_config_arguments, as_tuple, config_from_args, make_parser, torch_threads
from ..cuda_graphs import CUDA_GRAPH_HELP, cuda_graph_mode
from ..data import HistoryWindows, generate_histories, local_action_batch
from ..files import save_figure, write_json
from ..nonfinite import NONFINITE_HELP, check_nonfinite_policy
from ..train import (
    TrainConfig,
    auto_batch_runs,
    group_runs,
    load_trained,
    make_eval_env_factory,
    resolve_device,
    run_evaluation,
    train,
    train_batched,
)
from .harness import (
    cached_dataset,
    check_preset,
    command_string,
    machine_description,
    print_cpu_estimate,
    pyplot,
    run_folder,
    seed_stats,
    train_run_cpu_seconds,
    write_results,
)
from .sweep import SweepOptions, run_trials, sweep_options

EXPERIMENTS = ("bernoulli", "contextual", "darkroom")
PRESETS = ("cpu", "paper")

#: Evaluation sets per experiment: (name, TrainConfig overrides).
EVAL_SETS: dict[str, list[tuple[str, dict]]] = {
    "bernoulli": [
        ("train means, 4-20 arms", {"eval_distribution": "train", "eval_num_arms": "4-20"}),
        ("mirrored, 4-20 arms", {"eval_distribution": "mirrored", "eval_num_arms": "4-20"}),
        ("uniform, 4-20 arms", {"eval_distribution": "uniform", "eval_num_arms": "4-20"}),
        *(
            (f"uniform, {n} arms", {"eval_distribution": "uniform", "eval_num_arms": str(n)})
            for n in (20, 25, 30, 40, 50)
        ),
    ],
    "contextual": [
        ("4-20 arms", {"eval_num_arms": "4-20"}),
        *((f"{n} arms", {"eval_num_arms": str(n)}) for n in (20, 25, 30, 40, 50)),
    ],
    "darkroom": [
        (name.replace("_", " "), {"eval_action_set": name})
        for name in ("train", "permuted_train", "sliced_test", "test", "all")
    ],
}

#: Bernoulli ablations (``--ablations``): why does Headless-AD trained on 4-20 arms lose its score on more
#: arms? Each is the preset's Headless-AD with these training-config overrides, on the same histories; the
#: paper's values are noted where ours differ (its code also reads a step as separate action and reward
#: tokens and samples at temperature 1 after training at tau 1.34).
ABLATIONS: dict[str, dict] = {
    "preset": {},
    "tau 1.34 (paper)": {"tau": 1.34},
    "embedding width 128 (paper)": {"embed_dim": 128},
    "no action-set prompt": {"action_prompt": False},
    "beta1 0.68 (paper)": {"beta1": 0.68},
    "learning rate 3e-4": {"learning_rate": 3e-4},
    "4000 steps": {"steps": 4000},
    "separate action/reward/state tokens (paper)": {"step_tokens": "separate"},
    # Separate tokens at 2 layers learn to ignore the rewards (see reward use): does a third layer, room
    # for a previous-token head that joins each reward to its action, let them read the rewards?
    "separate tokens with 3 layers": {"step_tokens": "separate", "num_layers": 3},
}
#: Arm counts the ablations are scored on (uniform means): the training counts, then more arms.
ABLATION_ARMS = ("4-20", "20", "50")

_BANDIT_BASE = {
    "num_histories": 10000,
    "source_episodes": 1,
    "episode_subsample": 1,
    "seq_len": 300,
    "eval_episodes": 1,
    "eval_envs_per_task": 1,
}


def preset_configs(experiment: str, preset: str, out_dir: Path, data: str, seed: int) -> dict[str, TrainConfig]:
    """``{"headless_ad": ..., "ad": ...}`` training configs of one experiment and preset."""
    env = {"bernoulli": "bernoulli_bandit", "contextual": "contextual_bandit", "darkroom": "dark_room_composite"}
    common = {"env": env[experiment], "data": data, "seed": seed, "sample_actions": True}
    if experiment == "darkroom":
        common.update(num_histories=1000, episode_subsample=20, seq_len=100, eval_episodes=40, eval_envs_per_task=4)
    else:
        common.update(_BANDIT_BASE)
    if preset == "cpu":
        sizes = {"d_model": 64, "num_heads": 4, "num_layers": 2, "batch_size": 16, "learning_rate": 1e-3}
        steps = 3000 if experiment == "darkroom" else 1500
        headless = {**sizes, "embed_dim": 128 if experiment == "darkroom" else 64, "steps": steps}
        if experiment == "bernoulli":  # colder sampling keeps the score on 50 arms (the ablations); 0.35 x tau
            headless["select_tau"] = 0.35  # also keeps it on 4-20 arms, where 0.25 x tau over-exploits
        ad = {**sizes, "steps": steps}
    else:  # the paper's Tables 3 (Headless-AD) and 4 (AD)
        table3 = {
            "bernoulli": (4, 64, 512, 1.34, 3.1e-4, 4.4e-3, 0.68, 0.22, 0.12, True),
            "contextual": (8, 8, 1024, 3.0, 5.0e-5, 5.0e-2, 0.5, 0.3, 0.25, False),
            "darkroom": (4, 64, 512, 7.8, 1.7e-4, 1.7e-2, 0.72, 0.7, 0.19, True),
        }
        table4 = {
            "bernoulli": (4, 64, 512, 5.0e-3, 1.1e-5, 1.5e-4, 0.82, 0.1, 0.1, True),
            "contextual": (8, 8, 1024, 0.2, 1.3e-5, 0.25, 0.58, 0.28, 0.45, False),
            "darkroom": (2, 8, 512, 5.0e-2, 4.0e-4, 8.0e-6, 0.95, 3.0e-2, 1.0e-2, False),
        }
        layers, heads, width, tau, lr, wd, beta1, attention_dropout, dropout, sample = table3[experiment]
        headless = {"num_layers": layers, "num_heads": heads, "d_model": width, "tau": tau, "learning_rate": lr,
                    "weight_decay": wd, "beta1": beta1, "attention_dropout": attention_dropout,
                    "embedding_dropout": dropout, "residual_dropout": dropout, "sample_actions": sample,
                    "embed_dim": 128 if experiment == "darkroom" else 64}  # fmt: skip
        headless["select_tau"] = 1.0  # the official code samples from softmax(similarity): temperature 1, not tau
        layers, heads, width, smoothing, lr, wd, beta1, attention_dropout, dropout, sample = table4[experiment]
        ad = {"num_layers": layers, "num_heads": heads, "d_model": width, "label_smoothing": smoothing,
              "learning_rate": lr, "weight_decay": wd, "beta1": beta1, "attention_dropout": attention_dropout,
              "embedding_dropout": dropout, "residual_dropout": dropout, "sample_actions": sample}  # fmt: skip
        for settings in (headless, ad):
            settings.update(steps=30000, batch_size=128, warmup_steps=1000)
        if experiment == "darkroom":
            for settings in (headless, ad):
                settings.update(eval_episodes=1000, episode_subsample=1)
    return {
        "headless_ad": TrainConfig(**{**common, **headless}, model="headless_ad", out_dir=str(out_dir / "headless_ad")),
        "ad": TrainConfig(**{**common, **ad}, model="ad", out_dir=str(out_dir / "ad")),
    }


@dataclass
class HeadlessExperimentConfig(SweepOptions):
    """One experiment of the Headless-AD paper; see the module docstring. ``--ablations`` trains its variants
    as the trials of :mod:`~icrl_models.experiments.sweep` (on Ray Tune when installed)."""

    experiment: str = dataclasses.field(default="bernoulli", metadata={"help": f"one of {EXPERIMENTS}"})
    preset: str = dataclasses.field(default="cpu", metadata={"help": f"one of {PRESETS}"})
    baseline: bool = dataclasses.field(default=True, metadata={"help": "also train and evaluate AD"})
    steps: int | None = dataclasses.field(default=None, metadata={"help": "override the preset's training steps"})
    eval_tasks: int = dataclasses.field(default=100, metadata={"help": "bandits per evaluation set (paper: 100)"})
    out_dir: str = dataclasses.field(default="runs/headless", metadata={"help": "output folder"})
    seed: int = dataclasses.field(default=0, metadata={"help": "ablations: the training seed"})
    training_seeds: tuple[int, ...] = dataclasses.field(
        default=(0, 1, 2, 3, 4),
        metadata={"help": "training seeds (histories, initialisation, batches): one run per model and seed"},
    )
    selection_seeds: tuple[int, ...] = dataclasses.field(
        default=(1, 2),
        metadata={"help": "evaluation seeds used only to choose each model's sampling temperature"},
    )
    report_seeds: tuple[int, ...] = dataclasses.field(
        default=(3, 4, 5, 6, 7),
        metadata={"help": "evaluation seeds of the reported scores (disjoint from --selection-seeds)"},
    )
    device: str = dataclasses.field(default="auto", metadata={"help": "auto, cpu, cuda, ..."})
    progress: bool = True
    threads: int = dataclasses.field(default=0, metadata={"help": "torch CPU threads (0: half the cores, 1 to 4)"})
    compile: bool = dataclasses.field(default=False, metadata={"help": "torch.compile the training forward"})
    cuda_graph: str = dataclasses.field(
        default="auto", metadata={"help": f"--cuda-graph of each run (icrl-train): {CUDA_GRAPH_HELP}", "const": "on"}
    )
    nonfinite: str = dataclasses.field(
        default="stop", metadata={"help": f"each run's {NONFINITE_HELP}; a stopped run is a failed trial"}
    )
    ablations: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={"help": f"bernoulli: train these Headless-AD variants instead ('all' or any of {tuple(ABLATIONS)}) "
                  "and write headless-ablations.json/.md", "metavar": "NAME"},
    )  # fmt: skip
    select_temperatures: tuple[float, ...] = dataclasses.field(
        default=(1.0, 0.5, 0.35, 0.25),
        metadata={
            "help": "sampling temperatures tried, as fractions of each model's training temperature (tau; "
            "1 for AD): one is chosen per model on --selection-seeds; --ablations scores every one"
        },
    )
    eval_seeds: tuple[int, ...] = dataclasses.field(
        default=(1, 2),  # the selection seeds: the ablations choose, so they stay off the report seeds
        metadata={
            "help": "ablations: evaluation seeds (each a fresh set of --eval-tasks bandits; default: the "
            "selection seeds, disjoint from the report seeds)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cuda_graph = cuda_graph_mode(self.cuda_graph)
        check_nonfinite_policy(self.nonfinite)
        if self.experiment not in EXPERIMENTS:
            raise ValueError(f"experiment must be one of {EXPERIMENTS}, got {self.experiment!r}")
        check_preset(self.preset, PRESETS)
        self.ablations = as_tuple(self.ablations, str, "ablations")
        self.select_temperatures = as_tuple(self.select_temperatures, float, "select_temperatures")
        self.eval_seeds = as_tuple(self.eval_seeds, int, "eval_seeds")
        for name in ("training_seeds", "selection_seeds", "report_seeds"):
            setattr(self, name, as_tuple(getattr(self, name), int, name))
            if not getattr(self, name) or min(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be one or more ints >= 0, got {getattr(self, name)}")
        if set(self.selection_seeds) & set(self.report_seeds):
            raise ValueError(
                f"selection_seeds and report_seeds must be disjoint (the reported scores are held out from the "
                f"temperature choice), got {self.selection_seeds} and {self.report_seeds}"
            )
        if "all" in self.ablations:
            self.ablations = tuple(ABLATIONS)
        unknown = [name for name in self.ablations if name not in ABLATIONS]
        if unknown:
            raise ValueError(f"ablations must be 'all' or names from {tuple(ABLATIONS)}, got {unknown}")
        if self.ablations and self.experiment != "bernoulli":
            raise ValueError(f"ablations run on the bernoulli experiment only, got experiment={self.experiment!r}")
        if not self.select_temperatures or not all(
            check_float(t, "select_temperatures") > 0 for t in self.select_temperatures
        ):  # check_float: a NaN (which min() <= 0 let through) fails too
            raise ValueError(f"select_temperatures must be one or more numbers > 0, got {self.select_temperatures}")
        if not self.eval_seeds or min(self.eval_seeds) < 0:
            raise ValueError(f"eval_seeds must be one or more ints >= 0, got {self.eval_seeds}")


def _train_configs(config: HeadlessExperimentConfig, out_dir: Path) -> dict[str, TrainConfig]:
    data = out_dir / "train.icrl"
    configs = preset_configs(config.experiment, config.preset, out_dir, str(data), config.seed)
    overrides = {"device": config.device, "progress": config.progress, "threads": config.threads,
                 "compile": config.compile, "cuda_graph": config.cuda_graph, "nonfinite": config.nonfinite}  # fmt: skip
    if config.steps is not None:
        overrides["steps"] = config.steps
    if config.experiment != "darkroom":
        overrides["eval_tasks"] = config.eval_tasks
    configs = {name: dataclasses.replace(c, **overrides) for name, c in configs.items()}
    if not config.baseline:
        del configs["ad"]
    # Both models distil the same histories.
    cached_dataset(data, next(iter(configs.values())), progress=config.progress)
    return configs


def _train_batches(config: HeadlessExperimentConfig, runs: dict[int, dict[str, TrainConfig]]) -> dict:
    """``--batch-runs``: every model's runs over the training seeds trained up to K at a time as one batched model
    (:func:`~icrl_models.train.train_batched`; ``auto`` measures K per model); returns each batched run's share
    of its batch's CPU time, by ``(model, seed)``. Nothing with ``--batch-runs 1``."""
    shares: dict = {}
    if config.batch_runs == 1:
        return shares
    for name in runs[config.training_seeds[0]]:
        seeds = list(runs)
        configs = [runs[seed][name] for seed in seeds]
        size = config.batch_runs
        if size == "auto":
            size = auto_batch_runs(configs[0], runs=len(configs))
        for batch in group_runs(configs, size):
            if len(batch) > 1:
                start = time.process_time()
                train_batched([configs[index] for index in batch])
                for index in batch:
                    shares[(name, seeds[index])] = (time.process_time() - start) / len(batch)
    return shares


def run_experiment(config: HeadlessExperimentConfig, *, command: str | None = None) -> dict:
    """The held-out protocol of the module docstring: train every model once per training seed, choose its
    sampling temperature on the selection seeds, score it at that temperature on the report seeds (every set of
    :data:`EVAL_SETS`); write ``headless.json`` / ``.md`` / ``.png``; return the results. ``command``: the command
    line recorded in the files (default: this process's)."""
    with torch_threads(config.threads):  # the evaluations too, not only the trainings (icrl-train sets its own)
        return _run_experiment(config, command)


def _run_experiment(config: HeadlessExperimentConfig, command: str | None) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    out_dir = run_folder(config.out_dir)
    device = resolve_device(config.device, 0)
    runs = {
        seed: _train_configs(dataclasses.replace(config, seed=seed), out_dir / f"seed{seed}")
        for seed in config.training_seeds
    }
    grid = [float(fraction) for fraction in config.select_temperatures]
    chosen_on = selection_sets(config.experiment)
    results: dict = {
        "config": dataclasses.asdict(config),
        "training_seeds": list(config.training_seeds),
        "selection_seeds": list(config.selection_seeds),
        "report_seeds": list(config.report_seeds),
        "temperature_grid": grid,
        "selection_sets": chosen_on,
        "models": {},
    }
    batched_cpu = _train_batches(config, runs)  # --batch-runs: each model's training seeds as batched models
    for name in runs[config.training_seeds[0]]:
        evaluations = {}
        for seed, configs in runs.items():  # train, and score every temperature on the selection seeds
            train_config = configs[name]
            count = len(chosen_on) * len(grid) * len(config.selection_seeds) + len(EVAL_SETS[config.experiment]) * len(
                config.report_seeds
            )
            print_cpu_estimate(f"{name}, training seed {seed} (training and up to {count} evaluations)",
                               train_run_cpu_seconds(train_config, evaluations=count + 1), device=device)  # fmt: skip
            train_start = time.process_time()
            train(train_config)  # resumes, or returns at once, when the run folder already holds the checkpoint
            train_cpu = batched_cpu.get((name, seed), time.process_time() - train_start)
            evaluations[seed] = RunEvaluations(config.experiment, train_config, device, train_cpu_seconds=train_cpu)
            for fraction in grid:
                evaluations[seed].scores(fraction, config.selection_seeds, chosen_on)
        selection = {
            fraction: float(np.mean([
                _metric(summary, config.experiment)
                for run in evaluations.values()
                for summaries in run.scores(fraction, config.selection_seeds, chosen_on).values()
                if summaries is not None
                for summary in summaries
            ]))
            for fraction in grid
        }  # fmt: skip
        chosen = max(grid, key=lambda fraction: selection[fraction])  # ties: the first in the grid
        results["models"][name] = _report_model(config, evaluations, chosen, selection)
    results["cpu_seconds"] = round(time.process_time() - cpu_start, 1)
    results["wall_seconds"] = round(time.perf_counter() - start, 1)
    machine = machine_description(device)
    write_results(out_dir, "headless", results, results_table(results), command=command, machine=machine)
    plot_scores(results, out_dir / "headless.png")
    return results


def _training_temperature(train_config: TrainConfig) -> float:
    """The temperature a model's action probabilities were trained at: tau (Headless-AD's InfoNCE), 1 (AD)."""
    return train_config.tau if train_config.model == "headless_ad" else 1.0


class RunEvaluations:
    """The evaluations of one trained run at a sampling temperature (a fraction of its training temperature), on
    every set of :data:`EVAL_SETS` and evaluation seed. Each summary is kept in ``<run>/evaluations.json`` under
    what was evaluated, so a rerun (or a killed experiment run again) evaluates nothing twice; ``cpu_seconds``
    counts the evaluations this process ran."""

    def __init__(self, experiment: str, train_config: TrainConfig, device, *, train_cpu_seconds: float) -> None:
        self.experiment, self.train_config, self.device = experiment, train_config, device
        self.path = Path(train_config.out_dir) / "evaluations.json"
        self.stored: dict = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.train_cpu_seconds, self.cpu_seconds = train_cpu_seconds, 0.0
        self._loaded: tuple | None = None  # (select_tau, model, histories)

    def scores(self, fraction: float, seeds, set_names=None) -> dict[str, list[dict] | None]:
        """``{set name: [summary per seed] or None}`` at ``fraction`` x the training temperature, on the
        evaluation sets named in ``set_names`` (default: all of them); None: AD's head is narrower than the set's
        actions, so it cannot act there without retraining."""
        select_tau = fraction * _training_temperature(self.train_config)
        return {
            set_name: self._set_scores(
                dataclasses.replace(self.train_config, select_tau=select_tau, **overrides), seeds
            )
            for set_name, overrides in EVAL_SETS[self.experiment]
            if set_names is None or set_name in set_names
        }

    def _set_scores(self, scored: TrainConfig, seeds) -> list[dict] | None:
        fields = ("select_tau", "eval_distribution", "eval_num_arms", "eval_action_set", "eval_tasks", "eval_episodes",
                  "eval_envs_per_task", "sample_actions")  # fmt: skip
        setting = {name: getattr(scored, name) for name in fields}
        summaries = []
        for seed in seeds:
            key = json.dumps({**setting, "seed": seed}, sort_keys=True)
            if key not in self.stored:
                start = time.process_time()
                self.stored[key] = self._evaluate(scored, seed)
                self.cpu_seconds += time.process_time() - start
                partial = self.path.with_name(self.path.name + ".partial")
                partial.write_text(json.dumps(self.stored, indent=1))
                partial.replace(self.path)  # atomically: a killed run keeps every finished evaluation
            summaries.append(self.stored[key])
        return None if any(summary is None for summary in summaries) else summaries

    def _evaluate(self, scored: TrainConfig, seed: int) -> dict | None:
        if self._loaded is None or self._loaded[0] != scored.select_tau:
            self._loaded = (scored.select_tau, *load_trained(scored, self.device))
        _, model, histories = self._loaded
        offered = make_eval_env_factory(scored)(seed).action_sets().shape[1]
        if scored.model == "ad" and offered > model.config.num_actions:
            return None
        return run_evaluation(model, scored, histories, seed=seed).summary


def _report_model(
    config: HeadlessExperimentConfig, evaluations: dict[int, RunEvaluations], chosen: float, selection: dict
) -> dict:
    """One model's entry of ``headless.json``: the chosen temperature, the selection scores, and at the chosen
    temperature on the report seeds, per evaluation set ``seed_stats`` over training seeds of each seed's mean
    over report seeds (``None`` where the model cannot act), with every training seed's own values."""
    runs: dict = {}
    for seed, run in evaluations.items():
        scores = run.scores(chosen, config.report_seeds)
        runs[str(seed)] = {
            "scores": {
                set_name: None if summaries is None else {
                    "values": [_metric(summary, config.experiment) for summary in summaries],
                    "mean": float(np.mean([_metric(summary, config.experiment) for summary in summaries])),
                    "summaries": summaries,
                }
                for set_name, summaries in scores.items()
            },
            "reward_use": None if config.experiment == "darkroom"
            else _reward_use(run.train_config, config, run.device),
            "train_cpu_seconds": round(run.train_cpu_seconds, 1),
            "eval_cpu_seconds": round(run.cpu_seconds, 1),
        }  # fmt: skip
    set_names = [set_name for set_name, _ in EVAL_SETS[config.experiment]]
    first = runs[str(config.training_seeds[0])]
    entry: dict = {
        "temperature": chosen,
        "select_tau": chosen * _training_temperature(next(iter(evaluations.values())).train_config),
        "selection": {str(fraction): score for fraction, score in selection.items()},
        "scores": {
            set_name: None if first["scores"][set_name] is None
            else seed_stats([run["scores"][set_name]["mean"] for run in runs.values()])
            for set_name in set_names
        },
        "reward_use": None if first["reward_use"] is None
        else seed_stats([run["reward_use"]["gap"] for run in runs.values()]),
        "runs": runs,
    }  # fmt: skip
    return entry


def run_ablations(config: HeadlessExperimentConfig, *, command: str | None = None) -> dict:
    """Train every variant of ``config.ablations`` on the same histories; score each on uniform bandits with
    :data:`ABLATION_ARMS` arms, at every sampling temperature of ``config.select_temperatures`` (fractions of
    its tau), over ``config.eval_seeds``; write ``headless-ablations.json`` / ``.md``; return the results.
    Each variant is one trial (:func:`~icrl_models.experiments.sweep.run_trials`: on Ray Tune when installed)."""
    out_dir = run_folder(config.out_dir)
    preset = _train_configs(dataclasses.replace(config, baseline=False), out_dir)["headless_ad"]
    machine = machine_description(resolve_device(config.device, 0))
    names = list(config.ablations)
    train_configs = []
    for name in names:
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        train_configs.append(dataclasses.replace(preset, **ABLATIONS[name], out_dir=str(out_dir / "ablations" / slug)))
    results: dict = {"config": dataclasses.asdict(config), "arms": list(ABLATION_ARMS), "ablations": {}}

    def record(index: int, outcome: dict) -> None:
        # Written after every ablation, so a killed sweep keeps the finished rows; in the ablations' order.
        finished = {**results["ablations"], names[index]: {"overrides": ABLATIONS[names[index]], **outcome}}
        results["ablations"] = {name: finished[name] for name in names if name in finished}
        results["complete"] = len(results["ablations"]) == len(names)
        write_results(
            out_dir, "headless-ablations", results, ablations_table(results), command=command, machine=machine
        )

    trial = functools.partial(_ablation_trial, config=config)
    run_trials(train_configs, trial, sweep_options(config), name="headless-ablations", storage=out_dir / "ray",
               on_outcome=record)  # fmt: skip
    return results


def _ablation_trial(train_config: TrainConfig, *, config: HeadlessExperimentConfig) -> dict:
    """Train one variant (or find it trained) and score it: ``{"scores", "seconds"}``. Scores are kept beside
    the run, keyed by what was evaluated, so a rerun (or a resumed sweep) reuses them."""
    start = time.perf_counter()
    train(train_config)
    key = {"temperatures": list(config.select_temperatures), "arms": list(ABLATION_ARMS),
           "eval_seeds": list(config.eval_seeds), "eval_tasks": config.eval_tasks}  # fmt: skip
    cache = Path(train_config.out_dir) / "ablation-scores.json"
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    if cached.get("key") != key:
        cached = {"key": key}
    device = resolve_device(config.device, 0)
    if "scores" not in cached:
        cached["scores"] = _score_ablation(train_config, config, device)
    if "reward_use" not in cached:  # scores kept from before reward use was measured are reused
        cached["reward_use"] = _reward_use(train_config, config, device)
    write_json(cache, cached)
    rows, reward_use = cached["scores"], cached["reward_use"]
    return {"scores": rows, "reward_use": reward_use, "seconds": round(time.perf_counter() - start, 1)}


def _reward_use(train_config: TrainConfig, config: HeadlessExperimentConfig, device) -> dict:
    """Does the (bandit) model read the rewards? Teacher-forced loss on ``config.eval_tasks`` fresh histories of
    the source algorithm on the training distribution, with the true and with shuffled rewards
    (:func:`~icrl_models.analysis.reward_dependence`): ``{"loss", "shuffled_loss", "gap"}`` in nats."""
    model, _ = load_trained(train_config, device)
    generate = train_config.generate_config("test", config.eval_tasks, 1)  # the test split's seed stream
    generate = dataclasses.replace(generate, num_arms=train_config.num_arms)
    if train_config.env == "bernoulli_bandit":
        generate = dataclasses.replace(generate, distribution=train_config.distribution or "train")
    windows = HistoryWindows(generate_histories(generate, progress=False), train_config.seq_len)
    batch = local_action_batch(windows.get_batch(np.arange(min(len(windows), config.eval_tasks))))
    batch = {name: value.to(device) for name, value in batch.items()}
    reading = reward_dependence(model, batch, generator=torch.Generator(device).manual_seed(config.seed))
    return {"loss": reading.mean_loss, "shuffled_loss": reading.mean_shuffled_loss, "gap": reading.gap}


def _score_ablation(train_config: TrainConfig, config: HeadlessExperimentConfig, device) -> dict:
    """``{temperature fraction: {arms: seed_stats of the normalised score}}`` of one trained variant."""
    rows: dict = {}
    for fraction in config.select_temperatures:
        scored = dataclasses.replace(train_config, select_tau=fraction * train_config.tau)
        model, histories = load_trained(scored, device)
        rows[str(fraction)] = {}
        for arms in ABLATION_ARMS:
            eval_config = dataclasses.replace(scored, eval_distribution="uniform", eval_num_arms=arms)
            values = [
                run_evaluation(model, eval_config, histories, seed=seed).summary["normalized_score"]
                for seed in config.eval_seeds
            ]
            rows[str(fraction)][arms] = seed_stats(values)
    return rows


def ablations_table(results: dict) -> str:
    """Markdown: one row per (ablation, sampling temperature), the normalised score per arm count (mean ± sd
    over evaluation seeds) and the gap between 50 arms (never seen in training) and the training counts."""
    arms = results["arms"]
    seeds = results["config"]["eval_seeds"]
    lines = [
        f"Normalised score on uniform Bernoulli bandits (0 random, 1 Thompson sampling), mean ± sd over "
        f"{len(seeds)} evaluation seeds ({results['config']['eval_tasks']} bandits each); one training seed "
        f"({results['config']['seed']}). Temperature: sampling temperature as a fraction of the model's tau. "
        "Gap: 50 arms minus 4-20 arms. Reward use: how much the teacher-forced loss on fresh Thompson-sampling "
        "histories rises (nats a step) when the rewards are shuffled within each history; ~0: the model ignores "
        "rewards and imitates action frequencies (`icrl_models.analysis.reward_dependence`).",
        "",
        f"| ablation | temperature | {' | '.join(f'{a} arms' for a in arms)} | gap | reward use |",
        "|---|---|" + "---|" * (len(arms) + 2),
    ]
    for name, entry in results["ablations"].items():
        reward_use = entry.get("reward_use")  # absent from results written before it was measured
        use = "n/a" if reward_use is None else f"{reward_use['gap']:+.3f}"
        for fraction, row in entry["scores"].items():
            cells = [f"{row[a]['mean']:.2f} ± {row[a]['std']:.2f}" for a in arms]
            gap = row["50"]["mean"] - row["4-20"]["mean"]
            lines.append(f"| {name} | {fraction} | {' | '.join(cells)} | {gap:+.2f} | {use} |")
    return "\n".join(lines)


def _metric(summary: dict, experiment: str) -> float:
    return summary["final_return"] if experiment == "darkroom" else summary["normalized_score"]


def _arms_seen(experiment: str, overrides: dict) -> str:
    """ "seen" for a bandit evaluation set whose arm counts all lie in the training range (4-20 arms), else
    "unseen"; "" for Darkroom (its sets differ in which actions, not how many)."""
    if experiment == "darkroom":
        return ""
    low, _, high = overrides["eval_num_arms"].partition("-")
    return "seen" if 4 <= int(low) and int(high or low) <= 20 else "unseen"


#: Darkroom-125's evaluation sets made of the training actions (the others hold test actions).
DARKROOM_SEEN_SETS = ("train", "permuted train")


def selection_sets(experiment: str) -> list[str]:
    """The evaluation sets a sampling temperature is chosen on: the seen ones only (bandits: arm counts inside
    the training range; Darkroom: the training actions), so that no unseen set informs the choice."""
    return [
        set_name
        for set_name, overrides in EVAL_SETS[experiment]
        if (set_name in DARKROOM_SEEN_SETS if experiment == "darkroom" else _arms_seen(experiment, overrides) == "seen")
    ]


def results_table(results: dict) -> str:
    """Markdown: one row per evaluation set, one column per model at its chosen temperature (mean ± sd over
    training seeds of each seed's mean over the report seeds), then reward use, the selection and CPU times."""
    config = results["config"]
    experiment = config["experiment"]
    metric = "success rate (last episodes)" if experiment == "darkroom" else "normalised score (0 random, 1 source)"
    names = list(results["models"])
    models = results["models"]

    def temperature(name: str) -> str:
        return f"{models[name]['temperature']:g} x {'tau' if name == 'headless_ad' else 'the trained softmax'}"

    lines = [
        f"{metric}: mean ± sd over training seeds {_listed(results['training_seeds'])} of each seed's mean over "
        f"report seeds {_listed(results['report_seeds'])} ({config['eval_tasks']} tasks each); each model samples at "
        f"the temperature it scored best at on selection seeds {_listed(results['selection_seeds'])} (mean over "
        f"training seeds, selection seeds and the {_chosen_on(results)}), from "
        f"{_listed(results['temperature_grid'])} x its training temperature (tau for Headless-AD, 1 for AD's "
        "softmax). Arms seen: inside the training range.",
        "",
        f"| evaluation set | arms | {' | '.join(f'{name} ({temperature(name)})' for name in names)} |",
        "|---|---|" + "---|" * len(names),
    ]
    for set_name, overrides in EVAL_SETS[experiment]:
        cells = []
        for name in names:
            stats = models[name]["scores"][set_name]
            cells.append("n/a" if stats is None else f"{stats['mean']:.2f} ± {stats['std']:.2f}")
        lines.append(f"| {set_name} | {_arms_seen(experiment, overrides)} | {' | '.join(cells)} |")
    if experiment != "darkroom":  # how much the teacher-forced loss rises when the rewards are shuffled
        cells = [f"{models[n]['reward_use']['mean']:+.3f} ± {models[n]['reward_use']['std']:.3f} nats" for n in names]
        lines.append(f"| reward use (shuffled - true loss) | | {' | '.join(cells)} |")
    for fraction in results["temperature_grid"]:
        cells = [f"{models[name]['selection'][str(fraction)]:.3f}" for name in names]
        lines.append(f"| selection score at {fraction:g} x (selection seeds) | | {' | '.join(cells)} |")
    cells = []
    for name in names:
        runs = models[name]["runs"].values()
        cells.append(" / ".join(f"{run['train_cpu_seconds']:.0f} + {run['eval_cpu_seconds']:.0f}" for run in runs))
    lines.append(f"| CPU s per training seed (training + evaluations run here) | | {' | '.join(cells)} |")
    return "\n".join(lines)


def _chosen_on(results: dict) -> str:
    """Which evaluation sets chose the temperature, in words (files written before the seen-sets-only rule
    chose on every set)."""
    names = results.get("selection_sets")
    return "evaluation sets" if names is None else f"seen evaluation sets only: {', '.join(names)}"


def _listed(values) -> str:
    return ", ".join(f"{value:g}" if isinstance(value, float) else str(value) for value in values)


def plot_scores(results: dict, path: Path) -> None:
    """Grouped bars with error bars: every model's metric (mean ± sd over training seeds) on every evaluation
    set at its chosen temperature (n/a left empty)."""
    plt = pyplot()
    experiment = results["config"]["experiment"]
    set_names = [name for name, _ in EVAL_SETS[experiment]]
    names = list(results["models"])
    width = 0.8 / len(names)
    figure, axis = plt.subplots(figsize=(max(6, 1.1 * len(set_names)), 4), dpi=120)
    for index, name in enumerate(names):
        scores = results["models"][name]["scores"]
        means = [np.nan if scores[s] is None else scores[s]["mean"] for s in set_names]
        spreads = [np.nan if scores[s] is None else scores[s]["std"] for s in set_names]
        label = f"{name} ({results['models'][name]['temperature']:g} x)"
        axis.bar(np.arange(len(set_names)) + index * width, means, width, yerr=spreads, capsize=2, label=label)
    axis.axhline(1.0, linestyle="--", color="black", linewidth=1)
    axis.set_xticks(np.arange(len(set_names)) + width * (len(names) - 1) / 2, set_names, rotation=30, ha="right")
    axis.set_ylabel("success rate" if experiment == "darkroom" else "normalised score")
    seeds = len(results["training_seeds"])
    axis.set_title(f"Headless-AD vs AD, {experiment} ({results['config']['preset']} preset, {seeds} training seeds)")
    axis.set_ylim(min(0.0, axis.get_ylim()[0]), 1.25)  # headroom above the source's 1.0 for the legend
    axis.legend(loc="upper right")
    figure.tight_layout()
    save_figure(figure, path)


@command_line("icrl-headless")
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("icrl-headless", __doc__)
    add_config_arguments(parser, HeadlessExperimentConfig)
    config = config_from_args(HeadlessExperimentConfig, parser.parse_args(argv))
    if config.ablations:
        print(ablations_table(run_ablations(config, command=command_string("icrl-headless", argv))))
        return 0
    results = run_experiment(config, command=command_string("icrl-headless", argv))
    print(results_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
