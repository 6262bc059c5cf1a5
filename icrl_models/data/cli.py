"""``icrl-data``: generate, inspect and check learning-history datasets.

Examples::

    icrl-data generate --env dark_room --num-histories 1000 --output data/dark_room-train.icrl
    icrl-data generate --env key_to_door --num-tasks 100 --num-histories 750 --episode-length 40 -o k2d.icrl
    icrl-data generate --env bernoulli_bandit --split test --distribution mirrored -o bandit-mirrored.icrl
    icrl-data generate --gym FrozenLake-v1 --tasks tasks.json --num-histories 500 -o frozen-lake.icrl
    icrl-data info data/dark_room-train.icrl
    icrl-data export data/dark_room-train.icrl dark_room-train.npz     # or .h5 (needs h5py)
    icrl-data import dark_room-train.h5 data/dark_room-train.icrl
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from .._cli import UsageError, command_line
from ..config import add_config_arguments, config_from_args, make_parser
from ..plots import plot_curves
from .generate import GenerateConfig, generate_histories
from .histories import LearningHistories
from .interop import FORMATS, MissingDependencyError, export_histories, import_histories
from .storage import load_histories, save_histories


def learning_summary(histories: LearningHistories) -> dict[str, float]:
    """Mean return of the first and last tenth of every history, and of an optimal policy.

    Multi-episode histories compare episode returns; single-episode ones (bandits) compare the reward
    per step, with the optimal return divided by the episode length.
    """
    optimal = np.asarray(histories.task_params["optimal_return"], dtype=np.float64)
    if histories.metadata["num_episodes"] > 1:
        returns = histories.episode_returns()
        tenth = max(1, returns.shape[1] // 10)
        return {
            "first_return": float(np.nanmean(returns[:, :tenth])),
            "last_return": float(np.nanmean(returns[:, -tenth:])),
            "optimal_return": float(optimal.mean()),
            # NaN where no task knows its optimal return (a gymnasium environment without a model)
            "last_fraction_of_optimal": float(np.nanmean(returns[:, -tenth:].mean(axis=1) / optimal))
            if np.isfinite(optimal).any()
            else float("nan"),
        }
    rewards = np.asarray(histories.rewards, dtype=np.float64)
    tenth = max(1, histories.max_length // 10)
    return {
        "first_reward_per_step": float(rewards[:, :tenth].mean()),
        "last_reward_per_step": float(rewards[:, -tenth:].mean()),
        "optimal_reward_per_step": float(optimal.mean() / histories.max_length),
    }


def plot_learning_curve(histories: LearningHistories, path: str) -> None:
    """The source algorithm's mean return per episode (reward per step for one-episode histories)
    against the optimal one, with a +- 1 standard error band over histories."""
    meta = histories.metadata
    optimal = np.asarray(histories.task_params["optimal_return"], dtype=np.float64)
    label = f"{meta['generator']['name']} ({histories.num_histories} histories)"
    if meta["num_episodes"] > 1:
        curves, xlabel, ylabel, best = {label: histories.episode_returns()}, "episode", "return", optimal.mean()
    else:
        curves, xlabel, ylabel = {label: np.asarray(histories.rewards)}, "step", "reward"
        best = optimal.mean() / histories.max_length
    plot_curves(
        curves,
        path,
        xlabel=xlabel,
        ylabel=ylabel,
        title=f"{meta['env']['name']}, {meta['split']} split",
        reference_lines={"optimal": best},
    )


def _task_counts(tasks: list[dict]) -> str:
    """``80 training, 20 held out`` from a gymnasium dataset's task list (``metadata["tasks"]``)."""
    held_out = sum(task.get("split") == "test" for task in tasks)
    return f"{len(tasks) - held_out} training, {held_out} held out (recorded in the metadata)"


def _describe(histories: LearningHistories) -> str:
    meta = histories.metadata
    lines = [
        f"env          {meta['env']['name']} {json.dumps(meta['env']['config'])}",
        f"generator    {meta['generator']['name']} {json.dumps(meta['generator']['config'])}",
        f"split        {meta['split']} (seed {meta['seed']})",
        *([f"tasks        {_task_counts(meta['tasks'])}"] if "tasks" in meta else []),
        f"histories    {histories.num_histories} x {meta['num_episodes']} episodes, "
        f"{histories.num_transitions:,} transitions, {np.unique(histories.task_ids).size} distinct tasks",
    ]
    lines += [f"{name:<12} {value:.4g}" for name, value in learning_summary(histories).items()]
    return "\n".join(lines)


@command_line("icrl-data")
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("icrl-data", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="run a source algorithm and write its learning histories")
    add_config_arguments(generate, GenerateConfig)
    generate.add_argument("-o", "--output", required=True, help="dataset file to write (atomically)")
    generate.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for command in (generate, info := commands.add_parser("info", help="validate a dataset and describe it")):
        command.add_argument("--plot", metavar="PNG", help="also save the source algorithm's learning curve")
    info.add_argument("path")
    export = commands.add_parser("export", help="write a dataset (.icrl) as .npz or HDF5 (.h5, .hdf5)")
    export.add_argument("path", help="the .icrl dataset to read")
    export.add_argument("output", help="the .npz / .h5 / .hdf5 file to write")
    load = commands.add_parser("import", help="validate a .npz or HDF5 container and write it as a dataset (.icrl)")
    load.add_argument("path", help="the .npz / .h5 / .hdf5 container to read")
    load.add_argument("output", help="the .icrl dataset to write")
    for command in (export, load):
        command.add_argument("--format", choices=FORMATS, help="container format (default: from the file suffix)")
    args = parser.parse_args(argv)

    if args.command == "generate":
        config = config_from_args(GenerateConfig, args)
        start = time.perf_counter()
        histories = generate_histories(config, progress=not args.no_progress)
        path = save_histories(histories, args.output)
        print(_describe(histories))
        print(f"wrote        {path} in {time.perf_counter() - start:.1f} s")
    elif args.command in ("export", "import"):
        try:
            if args.command == "export":
                path = export_histories(load_histories(args.path), args.output, args.format)
            else:
                path = save_histories(import_histories(args.path, args.format), args.output)
        except MissingDependencyError as error:
            raise UsageError(str(error)) from None
        print(f"wrote        {path}")
        return 0
    else:
        histories = load_histories(args.path)
        print(_describe(histories))
    if args.plot:
        plot_learning_curve(histories, args.plot)
        print(f"plot         {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
