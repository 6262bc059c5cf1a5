"""Training steps per second of ``icrl-train``'s model against torch's CPU thread count.

Measures the choice behind ``--threads`` (``icrl_models/runtime.py``: half the available cores, 1 to 4).
Run it on a quiet machine, e.g. ``python -m benchmarks.train_threads --threads 1 2 4``: timings taken
while other processes share the cores say more about the load than about the thread count (that
contention is exactly why the default stays low). Prints one line per thread count, steps/s median of
``--repeats`` timed runs of ``--steps`` steps each, after one warm-up run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from icrl_models.data import GenerateConfig, HistoryWindows, generate_histories, local_action_batch
from icrl_models.models.ad import action_loss
from icrl_models.runtime import available_cores, resolve_threads
from icrl_models.train import TrainConfig


def steps_per_second(config: TrainConfig, windows: HistoryWindows, model, steps: int) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), config.learning_rate)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(steps):
        batch = local_action_batch(windows.get_batch(rng.integers(0, len(windows), size=config.batch_size)))
        logits = model(batch["states"], batch["local_prev_actions"], batch["prev_rewards"])
        loss = action_loss(logits, {**batch, "actions": batch["local_actions"]})
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, 2, 4, available_cores()}))
    parser.add_argument("--steps", type=int, default=30, help="steps per timed run (default: 30)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per thread count (default: 3)")
    parser.add_argument("--model", default="ngram_ad", help="ngram_ad or ad (default: ngram_ad)")
    args = parser.parse_args()

    config = TrainConfig(model=args.model, backend="auto", progress=False)  # the default run's model and batch
    generate = config.generate_config("train", 64, config.source_episodes)
    histories = generate_histories(GenerateConfig(**{**generate.__dict__}), progress=False)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
    print(f"{available_cores()} cores available; automatic choice: {resolve_threads(0)} threads")
    for threads in args.threads:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        model = config.build_model(histories).train()
        steps_per_second(config, windows, model, max(1, args.steps // 3))  # warm-up
        rates = [steps_per_second(config, windows, model, args.steps) for _ in range(args.repeats)]
        print(f"threads {threads:>3}: {statistics.median(rates):7.1f} steps/s (runs: "
              + ", ".join(f"{rate:.1f}" for rate in rates) + ")")  # fmt: skip


if __name__ == "__main__":
    main()
