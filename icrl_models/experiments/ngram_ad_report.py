"""The reporting of ``icrl-compare`` (:mod:`icrl_models.experiments.ngram_ad`, the protocol): the Markdown tables
(Expected Max Performance per setting, every trial) and the figures (EMP against the number of
assignments, or the score against the data budget), from the sweep's result dict.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import numpy as np

from ..files import save_figure
from .harness import format_stats, pyplot


class ReportedSweep(Protocol):
    """What the report reads of the sweep's config (:class:`icrl_models.experiments.ngram_ad.CompareConfig`),
    named here so that the report does not import the protocol module that imports it."""

    env: str
    hyperparameters: str
    steps: int
    runs: int

    def model_names(self) -> dict[str, str]: ...


#: Display titles of the environments.
ENV_TITLES = {"dark_room": "Dark Room", "key_to_door": "Key-to-Door"}


def _emp_rows(runs: int) -> list[int]:
    """n = 1, 2, 4, 8, ... and ``runs`` itself."""
    rows = [2**k for k in range(runs.bit_length()) if 2**k <= runs]
    return rows if rows[-1] == runs else [*rows, runs]


def _setting_title(config: ReportedSweep, setting: dict) -> str:
    env = ENV_TITLES.get(config.env, config.env)
    goals = "" if setting["train_goals"] is None else f" {setting['train_goals']} training goals,"
    return f"{env}:{goals} {setting['num_histories']} histories"


def _score_caption(config: ReportedSweep) -> str:
    if config.hyperparameters == "defaults":
        return (
            f"Fraction of the source's final return with icrl-train's default hyperparameters ({config.steps} "
            "steps a run, one run per model and seed), mean ± sd over seeds:"
        )
    return (
        f"Expected max fraction of the source's final return after n assignments ({config.steps} steps a run), "
        "mean ± sd over seeds:"
    )


def markdown_tables(config: ReportedSweep, result: dict) -> str:
    """Per setting: EMP at n = 1, 2, 4, ... runs (mean ± sd over seeds), the best single run, the source's numbers."""
    models = config.model_names()
    parts = []
    for setting in result["settings"]:
        emp = setting["expected_max_performance"]
        seeds = ", ".join(map(str, setting["seeds"])) or "none"
        if setting.get("seeds_not_run"):
            seeds += f"; not run: {', '.join(map(str, setting['seeds_not_run']))}"
        lines = [
            f"## {_setting_title(config, setting)} (seeds {seeds})", "",
            _score_caption(config), "",
            "| assignments | " + " | ".join(models.values()) + " |", "|---|" + "---|" * len(models),
        ]  # fmt: skip
        if not setting["seeds"]:
            lines[2:] = ["No seed has run all its trials here (`--report-only`): nothing to report."]
            parts.append("\n".join(lines))
            continue
        for n in _emp_rows(config.runs):
            cells = []
            for curve in (emp[model] for model in models):
                if curve is None:
                    cells.append("n/a")
                    continue
                cells.append(format_stats({"mean": curve["mean"][n - 1], "std": curve["std"][n - 1],
                                           "n": len(curve["seeds"])}))  # fmt: skip
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        success = setting.get("success_rate") or {}
        if any(success.get(model) is not None for model in models):
            which = "each run" if config.hyperparameters == "defaults" else "each seed's best-scoring run"
            cells = [format_stats(success[model]) if success.get(model) else "n/a" for model in models]
            lines += ["", f"Success rate (final episodes that solve the task) of {which}, mean ± sd over seeds: "
                      + ", ".join(f"{name} {cell}" for name, cell in zip(models.values(), cells)) + "."]  # fmt: skip
        best = setting["best"]
        if best is None:
            lines += ["", "Best single run: none scored (the source's final return was 0)."]
        else:
            success = "" if best["success_rate"] is None else f", success rate {best['success_rate']:.2f}"
            where = f"{config.model_names()[best['model']]}, seed {best['seed']}, assignment {best['index']}"
            lines += [
                "",
                f"Best single run: {where}: {best['score']:.3f} of the source{success} (`{best['out_dir']}`).",
            ]
        source = setting["source"]
        if source["source_final_return"] is not None:
            text = "The source algorithm on the same held-out tasks: final return "
            text += format_stats(source["source_final_return"])
            if source["source_success_rate"] is not None:
                text += f", success rate {format_stats(source['source_success_rate'])}"
            lines += ["", text + "."]
        if source.get("random_score") is not None:
            random = format_stats(source["random_score"])
            lines += ["", f"The random policy there: {random} of the source's final return."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _short(assignment: dict) -> str:
    if not assignment:
        return "icrl-train defaults"
    a = assignment
    return (f"seq {a['seq_len']}, pre-norm {int(a['pre_norm'])}, qk-norm {int(a['qk_norm'])}, "
            f"ls {a['label_smoothing']:.2f}, lr {a['learning_rate']:.1e}, wd {a['weight_decay']:.1e}, "
            f"res-drop {a['residual_dropout']:.2f}, emb-drop {a['embedding_dropout']:.2f}, "
            f"subsample {a['episode_subsample']}")  # fmt: skip


def trial_table(config: ReportedSweep, result: dict) -> str:
    """One row per trial: setting, seed, model, assignment, score, success rate, status."""
    names = config.model_names()
    lines = ["## Trials", "", "| goals | histories | seed | model | # | config | score | success | status |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["trials"]:
        goals = "default" if r["num_train_tasks"] is None else r["num_train_tasks"]
        score = "n/a" if r["score"] is None else f"{r['score']:.3f}"
        success = "n/a" if r["success_rate"] is None else f"{r['success_rate']:.2f}"
        lines.append(f"| {goals} | {r['num_histories']} | {r['seed']} | {names[r['model']]} | {r['index']} | "
                     f"{_short(r['assignment'])} | {score} | {success} | {r['status']} |")  # fmt: skip
    return "\n".join(lines)


def plot_emp(config: ReportedSweep, result: dict, path: Path) -> None:
    """One panel per setting: EMP against assignments for both models, mean line and a ± sd band over seeds."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    settings = result["settings"]
    columns = min(3, len(settings))
    rows = math.ceil(len(settings) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.5 * rows), dpi=120, squeeze=False)
    x = np.arange(1, config.runs + 1)
    for axis, setting in zip(axes.flat, settings):
        for model, label in config.model_names().items():
            curve = setting["expected_max_performance"][model]
            if curve is None:
                continue
            mean, std = np.asarray(curve["mean"]), np.asarray(curve["std"])
            marker = "o" if config.runs <= 32 else None  # a curve of one assignment is a single point
            seeds = len(curve["seeds"])
            axis.plot(x, mean, marker=marker, label=f"{label} ({seeds} seed{'' if seeds == 1 else 's'})")
            axis.fill_between(x, mean - std, mean + std, alpha=0.25)
        random = setting["source"].get("random_score")
        if random is not None:
            axis.axhline(random["mean"], color="gray", linestyle="--", linewidth=1, label="random policy")
        axis.set_ylim(0, max(1.0, axis.get_ylim()[1]))  # 0 to the source: scores at the floor must look like it
        if config.runs >= 32:  # the paper's hundreds of assignments: the first few matter most
            axis.set_xscale("log")
        else:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_title(_setting_title(config, setting), fontsize=9)
        axis.set_xlabel("hyperparameter assignments")
        axis.set_ylabel("expected max fraction of source")
        axis.grid(alpha=0.3)
        if setting["seeds"]:
            axis.legend(fontsize=8)
        else:  # --report-only: no seed ran all its trials here
            axis.text(0.5, 0.5, "not run", transform=axis.transAxes, ha="center", va="center", color="gray")
    for axis in list(axes.flat)[len(settings) :]:
        axis.set_visible(False)
    figure.suptitle(f"{' vs '.join(config.model_names().values())}, {config.steps} steps per run (mean ± sd over "
                    "seeds)", fontsize=10)  # fmt: skip
    figure.tight_layout()
    save_figure(figure, path)


def plot_against_budget(config: ReportedSweep, result: dict, path: Path) -> None:
    """Fixed hyperparameters: each model's score against the data budget that varies (training goals, else
    histories), mean ± sd over seeds with every seed's score as a dot, and the random policy's level; where
    the environment has a success rate (Key-to-Door), a second panel shows it the same way beside the
    source algorithm's."""
    plt = pyplot()

    settings = result["settings"]
    by_goals = len({s["train_goals"] for s in settings}) > 1
    key, label = ("train_goals", "training goals") if by_goals else ("num_histories", "learning histories")
    x = [s[key] for s in settings]
    models = config.model_names()
    with_success = any(s.get("success_rate", {}).get(model) for s in settings for model in models)
    figure, axes = plt.subplots(1, 2 if with_success else 1, figsize=(10 if with_success else 5.5, 3.8), dpi=120,
                                squeeze=False)  # fmt: skip
    spread = float(np.diff(x).min()) if len(x) > 1 else 1.0

    def draw(axis, per_setting: list[tuple[float, float, list[float]] | None], name: str, offset: float) -> None:
        """One model: ``(mean, sd, per-seed values)`` per setting as a line with error bars and dots."""
        means = [np.nan if cell is None else cell[0] for cell in per_setting]
        stds = [np.nan if cell is None else cell[1] for cell in per_setting]
        line = axis.errorbar(x, means, yerr=stds, marker="o", capsize=3, label=name)
        for position, cell in zip(x, per_setting):  # each seed's value, beside the mean
            values = [] if cell is None else cell[2]
            axis.scatter([position + offset * spread] * len(values), values, s=12, alpha=0.6,
                         color=line.lines[0].get_color())  # fmt: skip

    score_axis = axes[0][0]
    for offset, (model, name) in zip((-0.1, 0.1), models.items()):
        curves = [setting["expected_max_performance"][model] for setting in settings]
        seeds = max((len(curve["seeds"]) for curve in curves if curve is not None), default=0)
        cells = [None if curve is None else (curve["mean"][0], curve["std"][0],
                                             [values[0] for values in curve["per_seed"].values()])
                 for curve in curves]  # fmt: skip
        draw(score_axis, cells, f"{name} ({seeds} seeds)", offset)
    randoms = [s["source"].get("random_score") for s in settings]
    if all(random is not None for random in randoms):
        # The marker: with one setting there is no line to see.
        score_axis.plot(x, [random["mean"] for random in randoms], color="gray", linestyle="--", marker="_",
                        markersize=24, label="random policy")  # fmt: skip
    score_axis.set_ylim(0, max(1.0, score_axis.get_ylim()[1]))
    score_axis.set_ylabel("fraction of the source's final return")
    env = ENV_TITLES.get(config.env, config.env)
    score_axis.set_title(f"{env}: {' vs '.join(models.values())}, default hyperparameters, {config.steps} steps",
                         fontsize=9)  # fmt: skip
    if with_success:
        success_axis = axes[0][1]
        for offset, (model, name) in zip((-0.1, 0.1), models.items()):
            stats = [s["success_rate"].get(model) for s in settings]
            draw(success_axis, [None if st is None else (st["mean"], st["std"], st["values"]) for st in stats],
                 name, offset)  # fmt: skip
        sources = [s["source"].get("source_success_rate") for s in settings]
        if all(source is not None for source in sources):
            success_axis.plot(x, [source["mean"] for source in sources], color="black", linestyle=":", marker="_",
                              markersize=24, label="source algorithm")  # fmt: skip
        success_axis.set_ylim(0, 1)
        success_axis.set_ylabel("success rate of the final episodes")
        success_axis.set_title(f"{env}: episodes that solve the task", fontsize=9)
    for axis in axes[0]:
        axis.set_xlim(min(x) - 0.4 * spread, max(x) + 0.4 * spread)  # room for the per-seed dots, one setting too
        axis.set_xticks(x)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path)
