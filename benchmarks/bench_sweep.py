"""Sweep throughput: one training step of one run, for a sweep's runs trained batched, one after another, or in
worker processes, for every family of runs (issues 44 and 54; docs/models.md#batched-runs).

``test_sweep_step[<case>-<mode>]``: the median is the time of **one training step of one run** (drawing the
run's batch included, as in the training loop, :func:`icrl_models.lifecycle.stepper`):

* ``batched``: the case's K runs as one batched model (``--batch-runs K``), the whole step one CUDA graph on CUDA;
  a round is one step of all K runs, and its time is divided by K.
* ``single``: the same runs one after another as each trains alone (on CUDA with the whole step graphed); a round
  is one run's step, the runs taken in turn.
* ``processes``: :data:`WORKERS` worker processes sharing the GPU (``--scheduler processes``), each training its
  own run with the whole step graphed; a round is :data:`STEPS_PER_ROUND` steps of every worker, its time
  divided by ``WORKERS * STEPS_PER_ROUND``. CUDA only, AD's case.

Cases (:data:`FAMILIES`): on the CPU, every family (``ad``: N-Gram AD; ``headless``: Headless-AD on Bernoulli
bandits; ``markov``: the DT-MoA of icrl-markov; ``looped``: the looped transformer at its last curriculum stage;
``induction``: the two-layer smeared-key model) at two sizes, K = 4 runs differing as a sweep's runs do (seed,
data stream, learning rate...): ``tiny`` (width 16, where the host's per-op cost dominates, as on a GPU) and
``preset`` (the family's CPU preset: the main job's N-Gram AD, icrl-headless's and icrl-markov's ``cpu`` models,
icrl-looped's ``cpu`` model at b = 15, icrl-induction's default model; with ``ICRL_BENCH_FULL=1``, the smoke set
is ``tiny``). Targets (summarize.py): ``batched`` >=
1.5x ``single`` at ``tiny`` and >= 1.0x at ``preset``. On CUDA, AD's ``goals-paper`` model (N-Gram AD, width 64,
context 200, 32 windows) at K = 16 and 64: >= 20x ``single`` and >= 3x ``processes`` at K = 64.

The committed CPU results (``benchmarks/results/cpu-sweep-<family>.{json,md}``) come from this file's command
line, on a quiet machine: ``OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.bench_sweep --family ad
--repeats 5`` (each repeat times every case and mode anew; the files hold every repeat and the median ratio).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from icrl_models import lifecycle
from icrl_models.data import generate_histories, save_histories
from icrl_models.experiments import induction_heads, looped, markov_heads
from icrl_models.train import TrainConfig, TrainRun

from .conftest import _choose_rounds, _sync, _versions, bench_device, device_name, full_run

#: Worker processes of the ``processes`` mode, and the steps each takes per timed round.
WORKERS = 8
STEPS_PER_ROUND = 5
MODES = ("batched", "single", "processes")


class Case(NamedTuple):
    name: str
    family: str
    size: str
    runs: int


# -- the runs of each family ------------------------------------------------------------------------------------------
#: Per-run values of a sweep's runs of one shape, taken in turn (Table 1 style).
_RUN_SCALARS = [
    dict(learning_rate=1e-3, weight_decay=1e-4, label_smoothing=0.1, episode_subsample=1),
    dict(learning_rate=3e-4, weight_decay=1e-2, label_smoothing=0.4, episode_subsample=4),
    dict(learning_rate=5e-3, weight_decay=1e-6, label_smoothing=0.0, episode_subsample=20),
    dict(learning_rate=1e-4, weight_decay=2e-3, label_smoothing=0.7, episode_subsample=8),
]
#: icrl-train sizes per case: the benchmark's tiny model, the main job's N-Gram AD, icrl-compare's goals-paper
#: model at the context of 200 Table 1 draws on a GPU, and icrl-headless's cpu preset on Bernoulli bandits.
_TRAIN_SIZES = {
    ("ad", "tiny"): dict(model="ngram_ad", d_model=16, num_heads=2, num_layers=1, seq_len=24, batch_size=4,
                         num_histories=8, source_episodes=8),
    ("ad", "preset"): dict(model="ngram_ad", num_histories=8, source_episodes=200),  # TrainConfig's defaults
    ("ad", "goals-paper"): dict(model="ngram_ad", seq_len=200, num_histories=32, source_episodes=200),
    ("headless", "tiny"): dict(model="headless_ad", env="bernoulli_bandit", d_model=16, num_heads=2, num_layers=1,
                               seq_len=24, batch_size=4, embed_dim=16, num_histories=8, source_episodes=1,
                               episode_subsample=1),
    ("headless", "preset"): dict(model="headless_ad", env="bernoulli_bandit", seq_len=300, batch_size=16,
                                 embed_dim=64, num_histories=16, source_episodes=1, episode_subsample=1),
}  # fmt: skip


def _train_runs(case: Case, folder: Path, device: torch.device) -> list[TrainRun]:
    base = TrainConfig(**_TRAIN_SIZES[(case.family, case.size)], steps=1_000_000, warmup_steps=0, progress=False,
                       device=str(device), cuda_graph="auto")  # fmt: skip
    data = folder / f"{case.family}-{case.size}.icrl"
    if not data.exists():
        generate = base.generate_config("train", base.num_histories, base.source_episodes)
        save_histories(generate_histories(generate, progress=False), data)
    configs = []
    for run in range(case.runs):
        scalars = dict(_RUN_SCALARS[run % len(_RUN_SCALARS)])
        if case.family == "headless":
            scalars.pop("episode_subsample")  # bandit histories are one episode
        configs.append(dataclasses.replace(base, data=str(data), seed=run, out_dir=str(folder / "runs" / str(run)),
                                           **scalars))  # fmt: skip
    shared: dict = {}
    return [TrainRun(config, histories=shared) for config in configs]


def _markov_runs(case: Case, folder: Path, device: torch.device) -> list[markov_heads.MarkovRun]:
    sizes = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--batch-size", "4", "--context-lens", "3"]
    if case.size == "preset":  # the cpu preset's model on the memory preset's task (one layout, quick data)
        sizes = ["--context-lens", "10"]
    argv = [*sizes, "--tasks", "cue_hidden", "--corridor-lengths", "4", "--num-histories", "16",
            "--episodes-per-history", "4", "--analysis-windows", "8", "--no-progress", "--device", str(device),
            "--seeds", *map(str, range(case.runs)), "--out-dir", str(folder / "runs")]  # fmt: skip
    config = markov_heads.config_from_args(markov_heads.MarkovConfig, markov_heads.build_parser().parse_args(argv))
    k = config.context_lens[0]
    return [markov_heads.MarkovTrial(config, seed, "cue_hidden", 4, k).run(quiet=True) for seed in range(case.runs)]


def _looped_runs(case: Case, folder: Path, device: torch.device) -> list[looped.LoopedRun]:
    sizes = dict(d_model=16, n_heads=2, batch_size=4, loops_end=3, grad_loops=2) if case.size == "tiny" else {}
    config = looped.LoopedExperimentConfig(**sizes, device=str(device), out_dir=str(folder / "runs"))
    # The last curriculum stage (the most loops, the longest prompts): where a run spends most of its steps.
    config = dataclasses.replace(config, loops_start=config.loops_end, dims_start=config.n_dims,
                                 points_start=config.n_points)  # fmt: skip
    return [
        looped.LoopedRun(dataclasses.replace(config, seed=seed, out_dir=str(folder / "runs" / str(seed))), True)
        for seed in range(case.runs)
    ]


def _induction_runs(case: Case, folder: Path, device: torch.device) -> list[induction_heads.InductionRun]:
    sizes = dict(vocab_size=16, context_len=16, min_period=3, max_period=6, eval_seq_len=6, eval_batch=4, d_model=16,
                 num_heads=2, batch_size=4) if case.size == "tiny" else {}  # fmt: skip
    runs = []
    for seed in range(case.runs):
        config = induction_heads.InductionConfig(**sizes, seed=seed, device=str(device), progress=False,
                                                 out_dir=str(folder / "runs" / str(seed)))  # fmt: skip
        runs.append(induction_heads.InductionTrial(config, "2L-smear", 2, True, 0).run(quiet=True))
    return runs


#: family -> builder of the case's K fresh runs in a folder.
FAMILIES: dict[str, Callable] = {"ad": _train_runs, "headless": _train_runs, "markov": _markov_runs,
                                 "looped": _looped_runs, "induction": _induction_runs}  # fmt: skip

CASES = (
    [Case("goals-paper-K16", "ad", "goals-paper", 16), Case("goals-paper-K64", "ad", "goals-paper", 64)]
    if torch.cuda.is_available()
    # The preset sizes take seconds a step: with the full set only (ICRL_BENCH_FULL=1), and in the script below.
    else [
        Case(f"{family}-{size}-K4", family, size, 4)
        for family in FAMILIES
        for size in (("tiny", "preset") if full_run() else ("tiny",))
    ]  # fmt: skip
)
PARAMS = [
    pytest.param(case, mode, id=f"{case.name}-{mode}", marks=[pytest.mark.headline]) for case in CASES for mode in MODES
]


def steppers(case: Case, folder: Path, device: torch.device, mode: str) -> list[Callable[[], torch.Tensor]]:
    """The case's K runs (built in ``folder``) as the mode steps them: one batched step of all, or each run's own
    step (``single``; at most :data:`WORKERS` of them, each run's step costs the same)."""
    runs = FAMILIES[case.family](case, folder / f"{case.name}-{mode}", device)
    if mode == "batched":
        lifecycle.open_runs(runs, batched=True)
        return [lifecycle.stepper(runs, batched=True)]
    steps = []
    for run in runs[: min(case.runs, WORKERS)]:
        lifecycle.open_runs([run])
        steps.append(lifecycle.stepper([run], batched=False))
    return steps


def _process_worker(case: Case, folder: Path, index: int, connection) -> None:
    """A worker of the ``processes`` mode: its own run, graphed, stepped ``n`` times per message ``n``."""
    torch.set_num_threads(1)
    device = bench_device()
    run = FAMILIES[case.family](case._replace(runs=index + 1), folder / f"worker{index}", device)[index]
    lifecycle.open_runs([run])
    step = lifecycle.stepper([run], batched=False)
    step()  # capture
    _sync(device)
    connection.send("ready")
    while (count := connection.recv()) > 0:
        for _ in range(count):
            step()
        _sync(device)
        connection.send("done")


@pytest.mark.parametrize("case, mode", PARAMS)
def test_sweep_step(benchmark, tmp_path_factory, case: Case, mode: str):
    device = bench_device()
    if mode == "processes" and device.type != "cuda":
        pytest.skip("processes sharing a GPU: CUDA only")
    folder = tmp_path_factory.getbasetemp() / "sweep"
    workers = []
    if mode in ("batched", "single"):
        steps = itertools.cycle(steppers(case, folder, device, mode))

        def call() -> None:
            next(steps)()
            _sync(device)

        run_steps = case.runs if mode == "batched" else 1
    else:
        context = multiprocessing.get_context("spawn")
        for index in range(WORKERS):
            parent, child = context.Pipe()
            process = context.Process(target=_process_worker, args=(case, folder, index, child), daemon=True)
            process.start()
            workers.append((process, parent))
        assert all(parent.recv() == "ready" for _, parent in workers)

        def call() -> None:
            for _, parent in workers:
                parent.send(STEPS_PER_ROUND)
            for _, parent in workers:
                assert parent.recv() == "done"

        run_steps = WORKERS * STEPS_PER_ROUND
    try:
        _time_per_run_step(benchmark, call, run_steps, device)
    finally:
        for process, parent in workers:
            parent.send(0)
            process.join(timeout=60)
    benchmark.group = f"sweep-step {case.name}"
    benchmark.extra_info.update(case._asdict(), op="sweep_step", backend=mode, case=case.name, model=case.family,
                                device=device_name(device), device_type=device.type, **_versions())  # fmt: skip
    if not benchmark.disabled:
        benchmark.extra_info["run_steps_per_second"] = 1.0 / benchmark.stats.stats.median


def _time_per_run_step(benchmark, call, run_steps: int, device: torch.device) -> None:
    """Time ``call()`` (``run_steps`` training steps of runs) for about ``ICRL_BENCH_SECONDS`` after one
    warm-up call, then divide every round's time by ``run_steps``: the statistics are per run-step."""
    call()  # warm-up: the capture of the CUDA graph(s), the allocator
    if benchmark.disabled:
        benchmark(call)
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    benchmark.pedantic(call, rounds=_choose_rounds(call, device), iterations=1, warmup_rounds=0)
    stats = benchmark.stats.stats
    stats.data[:] = [seconds / run_steps for seconds in stats.data]
    for cached in [name for name in vars(stats) if name != "data"]:  # statistics computed before the rescale
        delattr(stats, cached)
    benchmark.extra_info["run_steps_per_round"] = run_steps
    if device.type == "cuda":
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)


# -- the committed CPU results: python -m benchmarks.bench_sweep --family F --repeats N ------------------------------
#: Per size, the target of ``batched`` against ``single`` at K = 4 on the CPU (issue 54).
CPU_TARGETS = {"tiny": 1.5, "preset": 1.0}


def measure(case: Case, folder: Path, seconds: float) -> dict:
    """One repeat of a case: for each mode, rounds of about ``seconds`` (at least 5), the median wall and process
    CPU seconds per run-step; the batched and single rounds interleaved, so that a change in the machine's load
    falls on both."""
    device = torch.device("cpu")
    calls = {mode: itertools.cycle(steppers(case, folder, device, mode)) for mode in ("batched", "single")}
    per_round = {"batched": case.runs, "single": 1}
    for mode in calls:  # warm-up
        next(calls[mode])()
    times: dict[str, list] = {mode: [] for mode in calls}
    start = time.perf_counter()
    while min(len(t) for t in times.values()) < 5 or time.perf_counter() - start < 2 * seconds:
        for mode, steps in calls.items():
            for _ in range(per_round["batched"] if mode == "single" else 1):  # as many run-steps as a batched round
                wall, cpu = time.perf_counter(), time.process_time()
                next(steps)()
                times[mode].append(((time.perf_counter() - wall) / per_round[mode],
                                    (time.process_time() - cpu) / per_round[mode]))  # fmt: skip
    medians = {mode: {"wall_ms": 1e3 * statistics.median(t[0] for t in rows),
                      "cpu_ms": 1e3 * statistics.median(t[1] for t in rows), "rounds": len(rows)}
               for mode, rows in times.items()}  # fmt: skip
    return {**medians, "ratio": medians["single"]["wall_ms"] / medians["batched"]["wall_ms"],
            "cpu_ratio": medians["single"]["cpu_ms"] / medians["batched"]["cpu_ms"]}  # fmt: skip


def write_family(family: str, repeats: int, seconds: float, out: Path, command: str) -> dict:
    """Measure ``family``'s CPU cases ``repeats`` times; write ``cpu-sweep-<family>.json`` / ``.md`` into ``out``."""
    from icrl_models.experiments.harness import machine_description, write_results

    torch.set_num_threads(1)
    cases = [Case(f"{family}-{size}-K4", family, size, 4) for size in CPU_TARGETS]
    result: dict = {"family": family, "threads": torch.get_num_threads(), "repeats": repeats, "cases": {}}
    lines = [
        f"# Sweep throughput on the CPU: {family}, K = 4 runs batched against the same runs one at a time (issue 54)",
        "",
        "Median ms of one training step of one run (drawing its batch included), per repeat; ratio = one at a time "
        "/ batched (wall time; process CPU time in brackets). Target: >= "
        + ", ".join(f"{target}x at {size}" for size, target in CPU_TARGETS.items())
        + ".",
        "",
        "| case | repeat | batched ms | single ms | ratio (CPU) |",
        "|---|---|---|---|---|",
    ]
    for case in cases:
        rows = []
        for repeat in range(repeats):
            with tempfile.TemporaryDirectory(prefix="icrl-sweep-") as folder:
                rows.append(measure(case, Path(folder), seconds))
            row = rows[-1]
            ms = f"{row['batched']['wall_ms']:.2f} | {row['single']['wall_ms']:.2f}"
            lines.append(f"| {case.name} | {repeat + 1} | {ms} | {row['ratio']:.2f}x ({row['cpu_ratio']:.2f}x) |")
        median = statistics.median(row["ratio"] for row in rows)
        target = CPU_TARGETS[case.size]
        result["cases"][case.name] = {"size": case.size, "target": target, "median_ratio": median,
                                      "median_cpu_ratio": statistics.median(row["cpu_ratio"] for row in rows),
                                      "met": median >= target, "repeats": rows}  # fmt: skip
    lines.append("")
    for name, entry in result["cases"].items():
        verdict = "met" if entry["met"] else "NOT met"
        lines.append(f"- {name}: median ratio {entry['median_ratio']:.2f}x over {repeats} repeats (CPU time "
                     f"{entry['median_cpu_ratio']:.2f}x); target {entry['target']}x {verdict}.")  # fmt: skip
    write_results(out, f"cpu-sweep-{family}", result, "\n".join(lines), command=command,
                  machine=f"{machine_description('cpu')}; {torch.get_num_threads()} torch thread(s)")  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=list(FAMILIES), action="append", help="(default: every family)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of every case (default: 5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget per mode and repeat (default: 2)")
    parser.add_argument("--out", default="benchmarks/results", help="folder of the result files")
    args = parser.parse_args(argv)
    command = " ".join(["python -m benchmarks.bench_sweep", *(sys.argv[1:] if argv is None else argv)])
    for family in args.family or list(FAMILIES):
        result = write_family(family, args.repeats, args.seconds, Path(args.out), command)
        print(json.dumps({name: round(entry["median_ratio"], 2) for name, entry in result["cases"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
