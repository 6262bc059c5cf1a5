"""``icrl-demo``: a short tour of n-gram attention on an in-context RL token stream.

Builds Dark-Room-like learning histories (81 states, 5 actions, binary reward), turns them into
transition token ids, and for growing context lengths runs n-gram attention with the fast path of
this machine and with the dense O(L^2) reference: it checks they agree, times both, and finishes
with incremental decoding (one step at a time) against the full computation (docs/training.md).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from icrl_kernels import NGramAttention, NGramDecodeState, ngram_attention, resolve_backend, transition_ids
from icrl_kernels.testing import relative_rms_error

from ._cli import command_line, non_negative_int, positive_int
from .config import plain_text

NUM_STATES, NUM_ACTIONS, NUM_REWARDS = 81, 5, 2


@dataclass
class DemoConfig:
    batch: int = 4
    dim: int = 128
    n: int = 2
    lengths: tuple[int, ...] = (256, 1024, 4096, 16384)
    dense_max_length: int = 4096
    decode_length: int = 300
    seed: int = 0


def random_histories(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids of random-walk Dark Room histories, ``[batch, length]`` (transition mode)."""
    moves = torch.tensor([[0, 0], [-1, 0], [0, 1], [1, 0], [0, -1]])  # noop, up, right, down, left
    actions = torch.randint(0, NUM_ACTIONS, (batch, length), generator=generator)
    position = torch.full((batch, 2), 4)
    states = torch.empty(batch, length, dtype=torch.long)
    for t in range(length):
        position = (position + moves[actions[:, t]]).clamp(0, 8)
        states[:, t] = position[:, 0] * 9 + position[:, 1]
    goal = torch.randint(0, NUM_STATES, (batch, 1), generator=generator)
    rewards = (states == goal).long()
    return transition_ids(states, actions, rewards, num_states=NUM_STATES, num_actions=NUM_ACTIONS,
                          num_rewards=NUM_REWARDS)  # fmt: skip


def _time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def run(config: DemoConfig) -> list[dict]:
    gen = torch.Generator().manual_seed(config.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fast = resolve_backend("auto", device)
    print(f"n-gram attention demo: device={device}, fast backend={fast!r}, B={config.batch}, "
          f"D={config.dim}, n={config.n}")  # fmt: skip
    rows = []
    for length in tqdm(config.lengths, desc="context lengths"):
        ids = random_histories(config.batch, length, gen).to(device)
        h = torch.randn(config.batch, length, config.dim, generator=gen).to(device).requires_grad_(True)

        def fwd_bwd(backend: str, h: torch.Tensor = h, ids: torch.Tensor = ids) -> torch.Tensor:
            out = ngram_attention(h, ids, config.n, backend=backend)
            out.sum().backward()
            return out

        row = {"L": length, "fast_ms": 1e3 * _time(lambda: fwd_bwd(fast))}
        if length <= config.dense_max_length:
            row["dense_ms"] = 1e3 * _time(lambda: fwd_bwd("reference"))
            row["rel_err"] = relative_rms_error(fwd_bwd(fast).detach(), fwd_bwd("reference").detach())
        rows.append(row)

    print(f"\n{'L':>7} | {fast + ' fwd+bwd (ms)':>20} | {'dense ref (ms)':>14} | {'speed-up':>8} | {'rel. error':>10}")
    for row in rows:
        dense = row.get("dense_ms")
        print(f"{row['L']:>7} | {row['fast_ms']:>20.2f} | "
              + (f"{dense:>14.2f} | {dense / row['fast_ms']:>7.1f}x | {row['rel_err']:>10.1e}" if dense else
                 f"{'(too large)':>14} | {'':>8} | {'':>10}"))  # fmt: skip

    layer = NGramAttention(config.dim, config.n).to(device)
    ids = random_histories(1, config.decode_length, gen).to(device)
    h = torch.randn(1, config.decode_length, config.dim, generator=gen).to(device)
    state = NGramDecodeState(1, config.dim, config.n, max_len=config.decode_length, device=device)
    with torch.no_grad():
        full = layer(h, ids)
        steps = torch.stack([layer.step(state, h[:, t], ids[:, t]) for t in range(config.decode_length)], dim=1)
    print(f"\nincremental decoding over {config.decode_length} steps vs full forward: "
          f"relative error {relative_rms_error(steps, full):.1e}")  # fmt: skip
    return rows


@command_line("icrl-demo")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="icrl-demo", description=plain_text(__doc__.splitlines()[0]))
    parser.add_argument("--batch", type=positive_int, default=DemoConfig.batch)
    parser.add_argument("--dim", type=positive_int, default=DemoConfig.dim)
    parser.add_argument("--n", type=positive_int, default=DemoConfig.n)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=list(DemoConfig.lengths))
    parser.add_argument("--seed", type=non_negative_int, default=DemoConfig.seed)
    args = parser.parse_args(argv)
    run(DemoConfig(batch=args.batch, dim=args.dim, n=args.n, lengths=tuple(args.lengths), seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
