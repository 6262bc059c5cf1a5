"""``icrl-compare``: AD against N-Gram AD over a random hyperparameter sweep, as in the N-gram paper.

Both models train on the same data budget (one dataset: the same training goals and histories) with
the same randomly drawn hyperparameter assignments (the paper's Table 1 space, paired draws), and
each run is scored by its final in-context return on held-out goals as a fraction of the source
algorithm's. Expected Max Performance (Dodge et al., 2019) then says how good the best model is
expected to be after ``n`` assignments: the paper's Figure 2. Writes ``compare.json`` (with the
command line and machine) and ``compare.png`` into the output folder and prints a table.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

import numpy as np

from .._cli import command_line
from ..config import add_config_arguments, as_tuple, config_from_args, make_parser
from ..data.generate import ENV_NAMES
from ..plots import plot_curves
from ..train import TrainConfig, train
from .harness import cached_dataset, command_string, run_folder, write_results


def expected_max_performance(scores, max_assignments: int | None = None) -> np.ndarray:
    """``E[max of n scores]`` for ``n = 1..max_assignments`` draws with replacement from ``scores``.

    With ``v_(1) <= ... <= v_(N)`` sorted, ``E[max_n] = sum_i v_(i) * ((i/N)^n - ((i-1)/N)^n)``.
    """
    values = np.sort(np.asarray(scores, dtype=np.float64))
    if values.size == 0 or np.isnan(values).any():
        raise ValueError("scores must be a non-empty array without NaN")
    count = values.size
    n = np.arange(1, (max_assignments or count) + 1)[:, None]
    ranks = np.arange(1, count + 1)[None, :]
    weights = (ranks / count) ** n - ((ranks - 1) / count) ** n
    return weights @ values


def sample_assignment(rng: np.random.Generator) -> dict:
    """One draw from the N-gram paper's Table 1 search space."""
    log_uniform = lambda low, high: float(math.exp(rng.uniform(math.log(low), math.log(high))))
    return {
        "seq_len": int(rng.choice([100, 150, 200, 250])),
        "pre_norm": bool(rng.integers(2)),
        "qk_norm": bool(rng.integers(2)),
        "label_smoothing": float(rng.uniform(0.0, 0.8)),
        "learning_rate": log_uniform(1e-4, 1e-2),
        "weight_decay": log_uniform(1e-7, 2e-2),
        "residual_dropout": float(rng.uniform(0.0, 0.5)),
        "embedding_dropout": float(rng.uniform(0.0, 0.9)),
        "episode_subsample": int(rng.choice([1, 2, 4, 8, 20])),
    }


@dataclass
class CompareConfig:
    """The sweep; fields not listed here come from :class:`TrainConfig`'s defaults (``--steps`` etc.)."""

    runs: int = dataclasses.field(default=8, metadata={"help": "hyperparameter assignments per model"})
    steps: int = dataclasses.field(default=1500, metadata={"help": "gradient steps per run"})
    env: str = "dark_room"
    num_histories: int = dataclasses.field(default=1000, metadata={"help": "data budget: histories"})
    num_train_tasks: int | None = dataclasses.field(default=None, metadata={"help": "data budget: training goals"})
    source_episodes: int = 200
    ngram_sizes: tuple[int, ...] = (1, 2)
    backend: str = dataclasses.field(default="auto", metadata={"help": "n-gram kernels (see icrl-train)"})
    eval_episodes: int = 40
    eval_envs_per_task: int = 2
    out_dir: str = "runs/compare"
    seed: int = 0
    progress: bool = True
    threads: int = dataclasses.field(default=0, metadata={"help": "torch CPU threads (0: half the cores, 1 to 4)"})
    compile: bool = dataclasses.field(default=False, metadata={"help": "torch.compile each run's training forward"})

    def __post_init__(self) -> None:
        self.ngram_sizes = as_tuple(self.ngram_sizes, int, "ngram_sizes")
        # Checked here, before the sweep generates data, not when the first TrainConfig is built.
        if self.env not in ENV_NAMES:
            raise ValueError(f"env must be one of {ENV_NAMES}, got {self.env!r}")
        for name in ("runs", "steps", "num_histories", "source_episodes", "eval_episodes", "eval_envs_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def compare(config: CompareConfig, *, command: str | None = None) -> dict:
    """Run the sweep (both models on every assignment), write ``compare.json`` and ``compare.png``, print
    the Expected Max Performance table; returns the results. ``command``: the command line recorded in
    ``compare.json`` (default: this process's)."""
    out = run_folder(config.out_dir)
    base = TrainConfig(
        env=config.env, num_histories=config.num_histories, num_train_tasks=config.num_train_tasks,
        source_episodes=config.source_episodes, ngram_sizes=config.ngram_sizes, backend=config.backend,
        steps=config.steps, eval_episodes=config.eval_episodes, eval_envs_per_task=config.eval_envs_per_task,
        seed=config.seed, progress=config.progress, threads=config.threads, compile=config.compile,
    )  # fmt: skip
    data = cached_dataset(out / "train.icrl", base, progress=config.progress)  # one data budget for both models
    rng = np.random.default_rng(config.seed)
    assignments = [sample_assignment(rng) for _ in range(config.runs)]
    scores: dict[str, list[float]] = {"ad": [], "ngram_ad": []}
    for index, assignment in enumerate(assignments):
        for model in scores:
            run = dataclasses.replace(base, model=model, data=str(data), out_dir=str(out / f"{model}-{index:03d}"))
            summary = train(dataclasses.replace(run, **assignment))
            score = summary["fraction_of_source"]
            print(f"run {index} {model}: {score:.3f} of the source's final return", file=sys.stderr)
            scores[model].append(score)
    emp = {model: expected_max_performance(values).tolist() for model, values in scores.items()}
    result = {
        "assignments": assignments,
        "scores": scores,
        "expected_max_performance": emp,
        "config": dataclasses.asdict(config),
    }
    write_results(out, "compare", result, None, command=command)  # no compare.md: the table goes to stdout
    plot_curves(
        {model: np.asarray(curve)[None] for model, curve in emp.items()},
        out / "compare.png",
        xlabel="hyperparameter assignments",
        ylabel="expected max fraction of source return",
        title=f"{config.env}: {config.num_histories} histories, {config.steps} steps per run",
    )
    print("| assignments | AD | N-Gram AD |\n|---|---|---|")
    for n in range(config.runs):
        print(f"| {n + 1} | {emp['ad'][n]:.3f} | {emp['ngram_ad'][n]:.3f} |")
    return result


@command_line("icrl-compare")
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("icrl-compare", __doc__)
    add_config_arguments(parser, CompareConfig)
    compare(config_from_args(CompareConfig, parser.parse_args(argv)), command=command_string("icrl-compare", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
