"""Sweep throughput: one training step of one run, for a sweep's runs trained batched, one after another, or
in worker processes (issue 44; docs/models.md#batched-runs).

``test_sweep_step[<case>-<mode>]``: the median is the time of **one training step of one run** (drawing the
run's windows included, as in the training loop):

* ``batched``: the case's K runs as one batched model (``icrl-compare --batch-runs K``,
  :class:`~icrl_models.batched.BatchedTrainer`'s own step), the whole step one CUDA graph on CUDA; a round is
  one step of all K runs, and its time is divided by K.
* ``single``: the same runs one after another as ``icrl-train`` trains them (on CUDA with the whole step
  graphed, ``--cuda-graph``); a round is one run's step, the runs taken in turn.
* ``processes``: :data:`WORKERS` worker processes sharing the GPU (``--scheduler processes``), each training its
  own run with the whole step graphed; a round is :data:`STEPS_PER_ROUND` steps of every worker, its time
  divided by ``WORKERS * STEPS_PER_ROUND``. CUDA only.

Cases: ``goals-paper-K16`` and ``goals-paper-K64`` on CUDA, the ``goals-paper`` preset's model (N-Gram AD:
n-gram blocks n = 1, 2 then 2 attention blocks, width 64, 4 heads, 32 windows a step) at a context of 200
steps (Table 1 draws 100 to 250), K = 16 and 64; ``tiny-K4`` on the CPU (width 16, one attention block,
4 windows of 24 steps, K = 4), for the CPU target. The K runs differ as a sweep's runs of one shape do (seed,
learning rate, weight decay, label smoothing, episode subsampling) and share one dataset. Every case is a
headline case. Targets (summarize.py): ``batched`` >= 20x ``single`` and >= 3x ``processes`` at K = 64 on a
GPU; >= 1.5x ``single`` for ``tiny-K4`` on the 2-core CPU (measure it on a quiet machine:
``OMP_NUM_THREADS=1 PYTHONPATH=. python -m pytest benchmarks/bench_sweep.py -k tiny-K4
--benchmark-json=sweep.json`` then ``python benchmarks/summarize.py sweep.json``).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from icrl_models.batched import BatchedTrainer, check_batch
from icrl_models.cuda_graphs import StepRunner, prepare_capturable, set_learning_rate
from icrl_models.data import HistoryWindows, generate_histories, load_histories, save_histories
from icrl_models.train import TrainConfig, _next_batch, learning_rate_at, train_step

from .conftest import _choose_rounds, _sync, _versions, bench_device, device_name

#: Worker processes of the ``processes`` mode, and the steps each takes per timed round.
WORKERS = 8
STEPS_PER_ROUND = 5
MODES = ("batched", "single", "processes")


class Case(NamedTuple):
    name: str
    runs: int
    d_model: int
    num_heads: int
    num_layers: int
    seq_len: int
    batch_size: int
    num_histories: int
    source_episodes: int


GOALS_PAPER = dict(d_model=64, num_heads=4, num_layers=2, seq_len=200, batch_size=32, num_histories=32,
                   source_episodes=200)  # fmt: skip
TINY = dict(d_model=16, num_heads=2, num_layers=1, seq_len=24, batch_size=4, num_histories=8, source_episodes=8)
CASES = (
    [Case("goals-paper-K16", 16, **GOALS_PAPER), Case("goals-paper-K64", 64, **GOALS_PAPER)]
    if torch.cuda.is_available()
    else [Case("tiny-K4", 4, **TINY)]
)
PARAMS = [
    pytest.param(case, mode, id=f"{case.name}-{mode}", marks=[pytest.mark.headline]) for case in CASES for mode in MODES
]
#: Per-run values of a sweep's runs of one shape, taken in turn (Table 1 style: learning rate, weight decay,
#: label smoothing, episode subsampling).
_RUN_SCALARS = [
    dict(learning_rate=1e-3, weight_decay=1e-4, label_smoothing=0.1, episode_subsample=1),
    dict(learning_rate=3e-4, weight_decay=1e-2, label_smoothing=0.4, episode_subsample=4),
    dict(learning_rate=5e-3, weight_decay=1e-6, label_smoothing=0.0, episode_subsample=20),
    dict(learning_rate=1e-4, weight_decay=2e-3, label_smoothing=0.7, episode_subsample=8),
]


def _configs(case: Case, folder: Path) -> list[TrainConfig]:
    """The case's K runs: one shape, one dataset (generated once into ``folder``), per-run scalars."""
    base = TrainConfig(
        model="ngram_ad", num_histories=case.num_histories, source_episodes=case.source_episodes,
        seq_len=case.seq_len, d_model=case.d_model, num_heads=case.num_heads, num_layers=case.num_layers,
        batch_size=case.batch_size, steps=1_000_000, warmup_steps=0, cuda_graph=True, progress=False,
        device=str(bench_device()),
    )  # fmt: skip
    data = folder / f"{case.name}.icrl"
    if not data.exists():
        generate = base.generate_config("train", case.num_histories, case.source_episodes)
        save_histories(generate_histories(generate, progress=False), data)
    return [
        dataclasses.replace(
            base,
            data=str(data),
            seed=run,
            out_dir=str(folder / case.name / f"run{run:03d}"),
            **_RUN_SCALARS[run % len(_RUN_SCALARS)],
        )  # fmt: skip
        for run in range(case.runs)
    ]


def _single_step(config: TrainConfig, device: torch.device):
    """``step()``: one ``icrl-train`` step of ``config``'s run (its windows drawn, then its step, graphed with
    ``cuda_graph`` on CUDA), as ``icrl_models.train`` runs it."""
    histories = load_histories(config.data)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    torch.manual_seed(config.seed)
    model = config.build_model(histories).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), config.learning_rate, (config.beta1, config.beta2),
                                  weight_decay=config.weight_decay)  # fmt: skip
    graphed = config.cuda_graph and device.type == "cuda"
    if graphed:
        prepare_capturable(optimizer)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    runner = StepRunner(lambda batch: train_step(model, model, optimizer, batch, config, autocast), model, optimizer,
                        device, cuda_graph=graphed)  # fmt: skip
    rng = np.random.default_rng([config.seed, 0])
    model.train()

    def step() -> None:
        set_learning_rate(optimizer, learning_rate_at(0, config))
        runner(_next_batch(windows, rng, config, model, device))

    return step


def _process_worker(config: TrainConfig, connection) -> None:
    """A worker of the ``processes`` mode: its own run, graphed, stepped ``n`` times per message ``n``."""
    torch.set_num_threads(1)
    device = bench_device()
    step = _single_step(config, device)
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
    configs = _configs(case, tmp_path_factory.getbasetemp() / "sweep")
    workers = []
    if mode == "batched":
        trainer = BatchedTrainer(check_batch(configs))
        stacked, _, run_step = trainer.step_runner(trainer.runs)
        stacked.train()
        learning_rates = [learning_rate_at(0, config) for config in configs]

        def call() -> None:
            run_step(trainer.next_batch(trainer.runs, learning_rates))
            _sync(device)

        run_steps = case.runs
    elif mode == "single":  # up to WORKERS of the runs, in turn (each run's step costs the same)
        steps = itertools.cycle([_single_step(config, device) for config in configs[: min(case.runs, WORKERS)]])

        def call() -> None:
            next(steps)()
            _sync(device)

        run_steps = 1
    else:
        context = multiprocessing.get_context("spawn")
        for config in configs[:WORKERS]:
            parent, child = context.Pipe()
            process = context.Process(target=_process_worker, args=(config, child), daemon=True)
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
    benchmark.extra_info.update(case._asdict(), op="sweep_step", backend=mode, case=case.name, model="ngram_ad",
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
