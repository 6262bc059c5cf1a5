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

from collections.abc import Callable, Sequence
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
    available = torch.from_numpy(env.action_sets()).to(device) >= 0
    state = model.init_decode_state(
        env.num_envs, num_episodes * env.episode_length, available=available, generator=generator
    )

    def act(states, prev_actions, prev_rewards, active):
        actions = model.act(
            state, states[0], prev_actions[0], prev_rewards[0], available=available, sample=sample, generator=generator
        )
        return actions[None]

    returns, taken = rollout_runs([env], num_episodes, act, device=device, progress=progress)
    return (returns[0], taken[0]) if record else returns[0]


def rollout_runs(
    envs: Sequence[BatchedEnv], num_episodes: int, act: Callable, *, device: torch.device, progress: bool = False
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The in-context rollout loop of ``K = len(envs)`` runs stepped together, one batched env per run (one run:
    :func:`rollout_in_context`; many runs of one batched model: :mod:`icrl_models.batched`).

    ``act(states, prev_actions, prev_rewards, active)`` gets ``[K, W, ...]`` observations (``W`` = the most
    environments of any run; rows past a run's own ``N_k`` are padding: zeros, previous action -1), ``[K, W]``
    previous local actions and rewards, and ``active`` (``K`` bools: runs still rolling out), and returns
    ``[K, W]`` local actions (only the active runs' first ``N_k`` rows are read). A run stops being stepped once
    each of its environments has finished ``num_episodes`` episodes.

    Returns per run its ``[N_k, num_episodes]`` episode returns and ``[N_k, steps_k]`` environment action ids
    taken (``-1`` after an environment's last episode).
    """
    sizes = [env.num_envs for env in envs]
    width = max(sizes)
    action_sets = torch.from_numpy(_pad_stack([env.action_sets() for env in envs], width, fill=-1)).to(device)
    returns = [np.zeros((size, num_episodes)) for size in sizes]
    episode = [np.zeros(size, dtype=np.int64) for size in sizes]
    observations = [env.reset() for env in envs]
    rewards = [np.zeros(size, dtype=np.float32) for size in sizes]
    prev_actions = torch.full((len(envs), width), -1, dtype=torch.long, device=device)
    prev_rewards = torch.zeros(len(envs), width, device=device)
    taken: list[list[np.ndarray]] = [[] for _ in envs]
    active = [True] * len(envs)
    bar = tqdm(total=num_episodes, desc="in-context episodes", unit="episode", disable=not progress)
    while any(active):
        states = torch.from_numpy(_pad_stack(observations, width)).to(device)
        actions = act(states, prev_actions, prev_rewards, active)
        env_actions = action_sets.gather(2, actions[..., None].clamp_min(0))[..., 0].cpu().numpy()
        for run, env in enumerate(envs):
            if not active[run]:
                continue
            rows = np.arange(sizes[run])
            chosen = env_actions[run, : sizes[run]]
            result = env.step(chosen)
            live = episode[run] < num_episodes
            taken[run].append(np.where(live, chosen, -1))
            returns[run][rows[live], episode[run][live]] += result.rewards[live]
            finished = result.terminated | result.truncated
            episode[run] += finished
            observations[run] = env.reset(np.flatnonzero(finished)) if finished.any() else result.observations
            rewards[run] = result.rewards
            active[run] = bool(episode[run].min() < num_episodes)
        bar.update(min(int(count.min()) for count in episode) - bar.n)
        prev_actions = actions
        prev_rewards = torch.from_numpy(_pad_stack(rewards, width)).to(device)
    bar.close()
    return returns, [np.stack(steps, axis=1) for steps in taken]


def _pad_stack(arrays: Sequence[np.ndarray], width: int, fill=0) -> np.ndarray:
    """``[K, width, ...]``: the ``[N_k, ...]`` arrays stacked, each padded with ``fill`` to ``width`` rows and
    along its last dimension to the widest (action sets of different sizes)."""
    trailing = tuple(max(sizes) for sizes in zip(*(array.shape[1:] for array in arrays)))
    out = np.full((len(arrays), width, *trailing), fill, dtype=np.result_type(*arrays))
    for index, array in enumerate(arrays):
        out[(index, slice(0, array.shape[0]), *(slice(0, size) for size in array.shape[1:]))] = array
    return out


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
    model_returns = rollout_in_context(model, make_env(seed), num_episodes, sample=sample, seed=seed, progress=progress)
    references = reference_returns(make_env, source, source_episodes=source_episodes, num_episodes=num_episodes,
                                   seed=seed)  # fmt: skip
    return make_report(model_returns, references, episode_subsample=episode_subsample, final_episodes=final_episodes)


@dataclass
class References:
    """What an evaluation compares a model with, on the tasks of ``make_env(seed)``: the source algorithm's
    ``[N, source_episodes]`` and a random policy's ``[N, num_episodes]`` episode returns, the optimal return,
    and the env's task count, size and success return. They do not depend on the model: runs evaluated on the
    same tasks share them (:mod:`icrl_models.batched` computes them once per distinct evaluation)."""

    source_name: str
    source_returns: np.ndarray
    random_returns: np.ndarray
    optimal_return: float
    num_tasks: int
    num_envs: int
    success_return: float | None


def reference_returns(make_env, source: Agent, *, source_episodes: int, num_episodes: int, seed: int) -> References:
    """:class:`References` on the tasks of ``make_env(seed)``: the source learning from scratch and a random policy."""
    source_env = make_env(seed)
    source_returns = collect_histories(source_env, source, source_episodes, seed=seed, progress=False).episode_returns()
    random_returns = collect_histories(make_env(seed), RandomAgent(), num_episodes, seed=seed, progress=False)
    return References(
        source_name=source.name,
        source_returns=source_returns,
        random_returns=random_returns.episode_returns(),
        optimal_return=float(source_env.optimal_returns().mean()),
        num_tasks=int(np.unique(source_env.task_ids()).size),
        num_envs=int(source_env.num_envs),
        success_return=source_env.success_return,
    )


def make_report(
    model_returns: np.ndarray, references: References, *, episode_subsample: int = 1, final_episodes: int = 5
) -> EvalReport:
    """The :class:`EvalReport` of a model's ``[N, num_episodes]`` in-context returns against ``references``
    (see :func:`evaluate` for the summary's fields)."""
    final_episodes = min(final_episodes, model_returns.shape[1])
    source_returns, optimal = references.source_returns, references.optimal_return
    final = float(model_returns[:, -final_episodes:].mean())
    source_final = float(source_returns[:, -10:].mean())
    report = EvalReport(
        model_returns=model_returns.mean(axis=0).tolist(),
        source_returns=source_returns.mean(axis=0).tolist(),
        random_returns=references.random_returns.mean(axis=0).tolist(),
        optimal_return=optimal,
        source_name=references.source_name,
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
        "num_tasks": references.num_tasks,
        "num_envs": references.num_envs,
    }
    if references.success_return is not None:  # the fraction of final episodes that solved the task
        report.summary["final_success_rate"] = float(
            (model_returns[:, -final_episodes:] >= references.success_return).mean()
        )
        report.summary["source_final_success_rate"] = float(
            (source_returns[:, -10:] >= references.success_return).mean()
        )
    return report


def normalized_score(value: float, random: float, reference: float) -> float:
    """``(value - random) / (reference - random)``: 0 is a random policy, 1 the reference algorithm."""
    gap = reference - random
    return (value - random) / gap if gap else float("nan")
