"""Assemble ``benchmarks/results/gym-frozen-lake.json`` from the folders where docs/gymnasium.md's commands ran.

Each folder holds the training dataset, the ``icrl-train`` run folder ``runs/<name>`` and ``run.log``, where every
command ran under ``/usr/bin/time -f "<step>: %U user %S sys %e wall"`` (``generate``, then ``train``)::

    python benchmarks/gym_example.py --frozen-lake DIR --taxi DIR --machine "..." --machine-state "..." \\
        --commit 05e1775 -o benchmarks/results/gym-frozen-lake.json

The JSON holds per environment the commands, the run's config, the dataset's summary (what ``icrl-data info``
prints), the final evaluation (``eval.json`` and its summary row), the loss curve and the CPU time (user + sys of
each command). The plots are the runs' ``eval.png``, copied as they are.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from icrl_models.data import load_histories
from icrl_models.data.cli import learning_summary

FROZEN_LAKE_COMMANDS = [
    "python make_tasks.py  # the snippet of docs/gymnasium.md: writes frozen_lake_tasks.json "
    "(gym-frozen-lake-tasks.json)",
    "icrl-data generate --gym FrozenLake-v1 --tasks frozen_lake_tasks.json --num-train-tasks 80 --num-histories 1000 "
    "--num-episodes 200 --episode-length 20 -o frozen_lake-train.icrl --no-progress",
    "icrl-train --gym FrozenLake-v1 --data frozen_lake-train.icrl --steps 1000 --episode-subsample 10 "
    "--eval-episodes 40 --out-dir runs/frozen_lake --threads 1 --no-progress",
]
TAXI_COMMANDS = [
    """python -c 'import json; json.dump([{"is_rainy": True, "rainy_probability": round(0.5 + 0.05 * i, 2)} """
    """for i in range(11)], open("taxi_tasks.json", "w"))'""",
    "icrl-data generate --gym Taxi-v4 --tasks taxi_tasks.json --generator noise_distillation --num-histories 300 "
    "--num-episodes 100 --episode-length 50 -o taxi-train.icrl --no-progress",
    "icrl-train --gym Taxi-v4 --data taxi-train.icrl --steps 1000 --episode-subsample 5 --eval-episodes 20 "
    "--out-dir runs/taxi --threads 1 --no-progress",
]
_TIME = re.compile(r"(\w+): ([\d.]+) user ([\d.]+) sys ([\d.]+) wall")


def run_section(folder: Path, data_name: str, run_name: str, commands: list[str]) -> dict:
    """One environment's entry: see the module docstring."""
    times = {step: (float(user), float(system), float(wall)) for step, user, system, wall in
             _TIME.findall((folder / "run.log").read_text())}  # fmt: skip
    if set(times) != {"generate", "train"}:
        raise SystemExit(f"{folder / 'run.log'} must hold the /usr/bin/time lines of generate and train, got {times}")
    run = folder / "runs" / run_name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    training = [row for row in rows if "loss" in row]
    histories = load_histories(folder / data_name)
    meta = histories.metadata
    cpu = {step: round(user + system, 2) for step, (user, system, _) in times.items()}
    return {
        "commands": commands,
        "config": json.loads((run / "config.json").read_text()),
        "data": {
            "env": meta["env"],
            "generator": meta["generator"],
            "num_histories": histories.num_histories,
            "num_episodes": meta["num_episodes"],
            "num_transitions": histories.num_transitions,
            "num_train_tasks": meta["num_train_tasks"],
            "num_tasks": len(meta["tasks"]),
            "held_out_tasks": [i for i, task in enumerate(meta["tasks"]) if task["split"] == "test"],
            "learning_summary": learning_summary(histories),
            "generation_seconds": meta["generation_seconds"],
        },
        "summary": rows[-1]["eval"],
        "evaluation": json.loads((run / "eval.json").read_text()),
        "training": {
            "steps": [row["step"] for row in training],
            "loss": [row["loss"] for row in training],
            "seconds": training[-1]["seconds"],
        },  # fmt: skip
        "cpu_seconds": {**cpu, "total": round(sum(cpu.values()), 2)},
        "cpu_seconds_source": "/usr/bin/time: user + sys of each command (data generation; training and evaluation)",
        "wall_seconds": {step: wall for step, (_, _, wall) in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frozen-lake", type=Path, required=True, help="folder of the FrozenLake-v1 commands")
    parser.add_argument("--taxi", type=Path, required=True, help="folder of the Taxi-v4 commands")
    parser.add_argument("--machine", required=True, help="CPU, cores; torch, Python and gymnasium versions")
    parser.add_argument("--machine-state", required=True, help="what else ran on the machine")
    parser.add_argument("--commit", required=True, help="the code the commands ran")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    taxi = run_section(args.taxi, "taxi-train.icrl", "taxi", TAXI_COMMANDS)
    taxi["tasks"] = json.loads((args.taxi / "taxi_tasks.json").read_text())
    result = {
        "machine": args.machine,
        "machine_state": args.machine_state,
        "commit": args.commit,
        "frozen_lake": run_section(args.frozen_lake, "frozen_lake-train.icrl", "frozen_lake", FROZEN_LAKE_COMMANDS),
        "taxi": taxi,
    }
    args.output.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
