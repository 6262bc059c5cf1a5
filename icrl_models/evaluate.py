"""In-context evaluation: roll a trained AD / N-Gram AD / Headless-AD model out on held-out tasks.

The model never updates its weights here; it improves, if at all, from its own growing context. Every
environment of a batched env is stepped in parallel and the model decodes incrementally
(``model.act``: a key/value cache of ``seq_len`` tokens, the n-gram layers' running state, and for
Headless-AD the action-set prompt as a fixed prefix), so a step costs the same at step 10 as at
step 10,000. Models act on positions in each environment's action set (local indices); the rollout
maps them to the environment's action ids.

Reported against two references run on the same tasks: the source algorithm that generated the
training data (its own learning curve, from scratch) and a uniformly random policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .envs.base import BatchedEnv
from .files import write_json
from .generators import Agent, RandomAgent, collect_histories
from .models.ad import ADModel
from .models.headless_ad import HeadlessADModel
from .plots import plot_curves


@torch.no_grad()
def rollout_in_context(
    model: ADModel | HeadlessADModel,
    env: BatchedEnv,
    num_episodes: int,
    *,
    sample: bool = True,
    seed: int = 0,
    progress: bool = False,
    record: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Run ``model`` in every environment of ``env`` for ``num_episodes`` episodes, one context each.

    Actions are sampled from the model's softmax (``sample=True``, seeded) or taken greedily, among
    each environment's action set only. Returns ``[N, num_episodes]`` episode returns, and with
    ``record=True`` also the ``[N, steps]`` environment action ids taken (``-1`` after an environment's
    last episode), e.g. for a bandit's expected regret.
    """
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    num_envs = env.num_envs
    rows = np.arange(num_envs)
    action_sets = torch.from_numpy(env.action_sets()).to(device)  # [N, S] env ids, -1 padded
    available = action_sets >= 0
    returns = np.zeros((num_envs, num_episodes))
    episode = np.zeros(num_envs, dtype=np.int64)
    state = model.init_decode_state(
        num_envs, num_episodes * env.episode_length, available=available, generator=generator
    )
    observations = env.reset()
    prev_actions = torch.full((num_envs,), -1, dtype=torch.long, device=device)
    prev_rewards = torch.zeros(num_envs, device=device)
    taken: list[np.ndarray] = []
    bar = tqdm(total=num_episodes, desc="in-context episodes", unit="episode", disable=not progress)
    while episode.min() < num_episodes:
        states = torch.from_numpy(observations).to(device)
        actions = model.act(
            state, states, prev_actions, prev_rewards, available=available, sample=sample, generator=generator
        )
        env_actions = action_sets.gather(1, actions[:, None])[:, 0].cpu().numpy()
        result = env.step(env_actions)
        active = episode < num_episodes
        if record:
            taken.append(np.where(active, env_actions, -1))
        returns[rows[active], episode[active]] += result.rewards[active]
        finished = result.terminated | result.truncated
        episode += finished
        bar.update(int(episode.min()) - bar.n)
        observations = env.reset(np.flatnonzero(finished)) if finished.any() else result.observations
        prev_actions = actions
        prev_rewards = torch.from_numpy(result.rewards).to(device)
    bar.close()
    if record:
        return returns, np.stack(taken, axis=1)
    return returns


@dataclass
class EvalReport:
    """Mean episode returns over the evaluation tasks (each a list over episodes), and the summary."""

    model_returns: list[float]
    source_returns: list[float]
    random_returns: list[float]
    optimal_return: float
    source_name: str
    episode_subsample: int
    final_episodes: int
    summary: dict[str, float] = field(default_factory=dict)

    def table(self, block: int = 5) -> str:
        """Markdown table of mean return per block of in-context episodes."""
        lines = ["| in-context episodes | model | random | model / optimal |", "|---|---|---|---|"]
        for first in range(0, len(self.model_returns), block):
            model = float(np.mean(self.model_returns[first : first + block]))
            random = float(np.mean(self.random_returns[first : first + block]))
            last = min(first + block, len(self.model_returns))
            lines.append(f"| {first + 1}-{last} | {model:.2f} | {random:.2f} | {model / self.optimal_return:.2f} |")
        return "\n".join(lines)

    def save(self, folder: str | Path, title: str) -> tuple[Path, Path]:
        """Write ``eval.json`` and ``eval.png`` (learning curves) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        json_path, png_path = folder / "eval.json", folder / "eval.png"
        write_json(json_path, self.__dict__)
        k = self.episode_subsample
        # The model distils the source's k-times-subsampled history, so source episode k*i lines up
        # with in-context episode i.
        source = np.asarray(self.source_returns)[k - 1 :: k][: len(self.model_returns)]
        plot_curves(
            {
                "model (in context)": np.asarray(self.model_returns)[None],
                f"{self.source_name} (every {k}th episode)": source[None],
                "random": np.asarray(self.random_returns)[None],
            },
            png_path,
            xlabel="in-context episode",
            ylabel="mean return on held-out tasks",
            title=title,
            reference_lines={"optimal": self.optimal_return},
        )
        return json_path, png_path


def evaluate(
    model: ADModel | HeadlessADModel,
    make_env,
    *,
    num_episodes: int,
    source: Agent,
    source_episodes: int,
    episode_subsample: int = 1,
    final_episodes: int = 5,
    sample: bool = True,
    seed: int = 0,
    progress: bool = False,
) -> EvalReport:
    """Evaluate ``model`` on the tasks of ``make_env(seed)`` (a fresh batched env per rollout).

    The summary's ``final_return`` is the model's mean return over its last ``final_episodes``
    in-context episodes; ``source_final_return`` the source algorithm's over its last 10 of
    ``source_episodes`` episodes, learned from scratch on the same tasks. Environments with a
    ``success_return`` (Key-to-Door) add ``final_success_rate`` and ``source_final_success_rate``: the
    fraction of those episodes that reached it.
    """
    final_episodes = min(final_episodes, num_episodes)
    model_returns = rollout_in_context(model, make_env(seed), num_episodes, sample=sample, seed=seed, progress=progress)
    source_env = make_env(seed)
    source_returns = collect_histories(source_env, source, source_episodes, seed=seed, progress=False).episode_returns()
    random_returns = collect_histories(make_env(seed), RandomAgent(), num_episodes, seed=seed, progress=False)
    optimal = float(source_env.optimal_returns().mean())
    final = float(model_returns[:, -final_episodes:].mean())
    source_final = float(source_returns[:, -10:].mean())
    report = EvalReport(
        model_returns=model_returns.mean(axis=0).tolist(),
        source_returns=source_returns.mean(axis=0).tolist(),
        random_returns=random_returns.episode_returns().mean(axis=0).tolist(),
        optimal_return=optimal,
        source_name=source.name,
        episode_subsample=episode_subsample,
        final_episodes=final_episodes,
    )
    random_final = float(np.mean(report.random_returns[-final_episodes:]))
    report.summary = {
        "final_return": final,
        "source_final_return": source_final,
        "fraction_of_source": final / source_final if source_final else float("nan"),
        "fraction_of_optimal": final / optimal if optimal else float("nan"),
        "random_final_return": random_final,
        # 0 = random, 1 = the source algorithm (the Headless-AD paper's normalised score).
        "normalized_score": normalized_score(final, random_final, source_final),
        "num_tasks": int(np.unique(source_env.task_ids()).size),
        "num_envs": int(source_env.num_envs),
    }
    if source_env.success_return is not None:  # the fraction of final episodes that solved the task
        report.summary["final_success_rate"] = float(
            (model_returns[:, -final_episodes:] >= source_env.success_return).mean()
        )
        report.summary["source_final_success_rate"] = float(
            (source_returns[:, -10:] >= source_env.success_return).mean()
        )
    return report


def normalized_score(value: float, random: float, reference: float) -> float:
    """``(value - random) / (reference - random)``: 0 is a random policy, 1 the reference algorithm."""
    gap = reference - random
    return (value - random) / gap if gap else float("nan")
