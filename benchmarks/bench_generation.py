"""Learning-history generation and training-window sampling (issue: data is never the bottleneck).

``test_generate`` times one :func:`~icrl_models.data.generate_histories` call per case: a source
algorithm run on every task of a batch, all histories recorded, on this machine's CPU (generation
is numpy; there is no GPU path). The acceptance case is ``dark_room-q_learning-1000x200``: 1000 Dark
Room tasks x 200 episodes x 20 steps = 4M transitions, target <= 60 s on the 2-core development VM.
``extra_info`` records the transitions generated and transitions per second.

``test_window_batches`` times :meth:`~icrl_models.data.HistoryWindows.get_batch` of 64 random
windows of 200 steps from that 4M-transition dataset, with and without episode subsampling.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import pytest
import torch

from icrl_models.data import GenerateConfig, HistoryWindows, generate_histories

from .conftest import device_name, select_shapes


class Case(NamedTuple):
    env: str
    generator: str
    num_histories: int
    num_episodes: int


def case_id(case: Case) -> str:
    return f"{case.env}-{case.generator}-{case.num_histories}x{case.num_episodes}"


DARK_ROOM_4M = Case("dark_room", "q_learning", 1000, 200)
FULL_CASES = [
    DARK_ROOM_4M,
    Case("dark_room", "noise_distillation", 1000, 200),
    Case("key_to_door", "q_learning", 750, 200),  # the N-gram paper's 750 histories x 200 episodes
    Case("dark_room_composite", "q_learning", 1000, 200),
    Case("bernoulli_bandit", "thompson", 10_000, 1),  # Headless-AD: 10k bandits x 300 pulls
    Case("bernoulli_bandit", "ucb", 10_000, 1),
    Case("contextual_bandit", "linucb", 10_000, 1),
]
# The acceptance case runs in the smoke set too: it takes a few seconds.
SMOKE_CASES = [DARK_ROOM_4M] + [
    case._replace(num_histories=16, num_episodes=min(case.num_episodes, 5)) for case in FULL_CASES[1:]
]


@pytest.mark.parametrize("case", select_shapes(FULL_CASES, SMOKE_CASES), ids=case_id)
def test_generate(benchmark, case: Case):
    config = GenerateConfig(
        env=case.env, generator=case.generator, num_histories=case.num_histories, num_episodes=case.num_episodes
    )
    result = {}

    def generate():
        result["histories"] = generate_histories(config, progress=False)

    benchmark.group = "generate-histories"
    benchmark.extra_info.update(case._asdict(), op="generate_histories", device=cpu_name(), device_type="cpu")
    if benchmark.disabled:
        benchmark(generate)
    else:
        benchmark.pedantic(generate, rounds=3, iterations=1, warmup_rounds=0)
    transitions = result["histories"].num_transitions
    benchmark.extra_info["transitions"] = transitions
    if not benchmark.disabled:
        benchmark.extra_info["transitions_per_second"] = transitions / benchmark.stats.stats.median


def cpu_name() -> str:
    return device_name(torch.device("cpu"))


@pytest.fixture(scope="module")
def dark_room_histories():
    return generate_histories(GenerateConfig(env="dark_room", num_histories=1000, num_episodes=200), progress=False)


@pytest.mark.parametrize("episode_subsample", [1, 4])
def test_window_batches(benchmark, dark_room_histories, episode_subsample: int):
    start = time.perf_counter()
    windows = HistoryWindows(dark_room_histories, 200, episode_subsample=episode_subsample)
    benchmark.group = "window-batches"
    benchmark.extra_info.update(
        op="window_batches",
        device_type="cpu",
        episode_subsample=episode_subsample,
        batch=64,
        seq_len=200,
        index_build_seconds=time.perf_counter() - start,
        device=cpu_name(),
    )
    rng = np.random.default_rng(0)
    benchmark(lambda: windows.get_batch(rng.integers(0, len(windows), size=64)))
