"""``icrl-markov``: MoA weights of Markov heads on a short-term vs a long-term task (GPT2-DTMA, Tables 5-6).

The Markov-heads paper finds heads in GPT-2's first layer whose ``W_q W_k^T`` is a Markov matrix
(Definition 4.1): they attend to the last input token, which helps when the current state suffices
(short-term tasks, MuJoCo) and hurts when memory is needed (long-term tasks, PointMaze). GPT2-DTMA
gates the heads with a Mixture of Attention, and the summed gate weight of the Markov heads,
``G_Markov``, comes out higher on the short-term task (Tables 5-6, Appendix G). This command runs the
same comparison on our grid worlds, with our offline data:

* ``dark_room_visible`` (short-term): Dark Room with the goal cell in the observation
  (:class:`~icrl_models.envs.VisibleGoalDarkRoom`, all 81 goals): the current observation determines
  an optimal action.
* ``key_to_door`` (long-term): Key-to-Door with position-only observations, fixed layouts
  (``--key-to-door-layouts``; default one, the key at the centre and the door in a corner) and random
  starts. Whether the key is held is not in the observation, and it decides the action: a cell
  between the centre and the door is crossed towards the centre before the key and towards the door
  after it. It must be read from the episode so far (the return-to-go also drops when the key is
  collected, but hindsight returns-to-go of imperfect episodes make that signal ambiguous in the data).
* ``dark_room`` (long-term): hidden-goal Dark Room, the same rooms and data generator as
  ``dark_room_visible`` with only the goal hidden; the goal must be inferred from the trajectory so far.

Data: noise-distillation histories (an optimal policy whose actions are replaced by random ones with
a probability that decays from 1 to 0 along each history), so episodes range from random to optimal,
as a Decision Transformer's offline data should. Each task trains a
:class:`~icrl_models.models.dt_moa.DecisionTransformerMoA` with the same settings, starting from the
**same backbone**. No GPT-2 checkpoint can be downloaded here, so the backbone is
*Markov-initialised* (the analogue of a GPT-2 init): ``markov_heads`` of layer 0 get ``W_q = W_k``
built so that ``W_q W_k^T`` is a Markov matrix
(:meth:`~icrl_models.models.dt_moa.DecisionTransformerMoA.markov_init_`), every other weight
GPT-2's random init. ``--gpt2 DIR`` loads a local Hugging Face GPT-2 checkpoint instead (its first
``n_layer`` layers; width and heads from its ``config.json``). MoA gates layer 0 (the official
code's choice; ``--moa-layers``).

Reported per task (and per context length ``k`` of ``--context-lens``): which heads are Markov before
and after training (the ratio of Definition 4.1), the mean MoA weight per head (over every token and
over state tokens, on held-out windows), ``G_Markov`` (with the heads that were Markov at
initialisation), its course over training (the paper's Appendix G), head importance by zero-ablation,
and the trained policy's mean return against the data's, a random policy's and the optimum. With
several ``k``, ``R_Markov = G_Markov(k) / G_Markov(first k)`` as in Tables 5-6. Numbers over seeds read
``mean ± sample sd (n=seeds)``. Outputs in ``--out-dir`` (default ``runs/markov``): ``markov.json``,
``markov.md`` (the command line, the machine and the tables) and ``markov.png``.

Presets: ``cpu`` (default; a tiny model, about 10 minutes on one CPU thread) and ``paper``
(GPT-2-small-sized, 12 layers x 12 heads x 768, ``k = 10..50``, for a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .._cli import command_line
from .._cli import resolve_device as _resolve_device
from ..analysis.markov import MarkovReport, g_markov, markov_heads
from ..config import add_config_arguments, as_tuple, config_from_args, make_parser, torch_threads
from ..envs import DarkRoom, KeyToDoor, VisibleGoalDarkRoom
from ..envs.base import BatchedEnv
from ..generators import NoiseDistillation, RandomAgent, collect_histories
from ..models.dt_moa import DecisionTransformerMoA, DTMoAConfig, TrajectoryWindows, dt_config_dict, rollout_dt
from .harness import (
    command_string,
    fill_from_preset,
    format_stats,
    machine_description,
    preset_help,
    pyplot,
    run_folder,
    seed_stats,
    warmup_then_constant,
    write_results,
)

PRESETS = ("cpu", "paper")
#: task name -> (horizon, what the observation lacks)
TASKS = {
    "dark_room_visible": ("short-term", "nothing: the goal is in the observation"),
    "key_to_door": ("long-term", "whether the key is held (and where the key and door are)"),
    "dark_room": ("long-term", "where the goal is"),
}
#: Settings a preset fills in when the command line leaves them at None.
PRESET_VALUES = {
    "cpu": dict(
        n_layer=2,
        n_head=4,
        n_embd=64,
        context_lens=(10,),
        markov_heads=(0, 1),
        seeds=(0, 1, 2),
        steps=1500,
        batch_size=32,
        learning_rate=1e-3,
        warmup_steps=100,
        num_histories=324,
        episodes_per_history=40,
        eval_every=100,
        analysis_windows=256,
        eval_envs=162,
    ),
    "paper": dict(
        n_layer=12,
        n_head=12,
        n_embd=768,
        context_lens=(10, 20, 30, 40, 50),
        markov_heads=(1, 5, 10),
        seeds=(0, 1, 2),
        steps=20000,
        batch_size=64,
        learning_rate=1e-4,
        warmup_steps=2000,
        num_histories=1620,
        episodes_per_history=100,
        eval_every=500,
        analysis_windows=1024,
        eval_envs=810,
    ),
}


def _preset_help(name: str, text: str = "") -> str:
    return preset_help(PRESET_VALUES, name, text)


@dataclass
class MarkovConfig:
    """The experiment; ``None`` fields take the preset's value (:data:`PRESET_VALUES`)."""

    preset: str = dataclasses.field(default="cpu", metadata={"help": " or ".join(PRESETS)})
    # List fields take several values (--seeds 0 1 2); a comma-separated 0,1,2 (older command lines,
    # configs and markov.json files) is read the same.
    tasks: tuple[str, ...] = dataclasses.field(
        default=tuple(TASKS),
        metadata={"help": "tasks to run: dark_room_visible (short-term), key_to_door, dark_room (long-term)",
                  "metavar": "TASK"},
    )  # fmt: skip
    context_lens: tuple[int, ...] | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("context_lens", "context lengths k (steps); one training per task and k"),
                  "metavar": "K"},
    )  # fmt: skip
    n_layer: int | None = dataclasses.field(default=None, metadata={"help": _preset_help("n_layer")})
    n_head: int | None = dataclasses.field(default=None, metadata={"help": _preset_help("n_head")})
    n_embd: int | None = dataclasses.field(default=None, metadata={"help": _preset_help("n_embd")})
    dropout: float = 0.1
    moa_layers: tuple[int, ...] = dataclasses.field(
        default=(0,), metadata={"help": "layers whose attention the MoA gates", "metavar": "LAYER"}
    )
    gate: str = dataclasses.field(default="softmax", metadata={"help": "softmax, sigmoid or linear"})
    markov_heads: tuple[int, ...] | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("markov_heads", "layer-0 heads made Markov at initialisation; the flag "
                                       "with no value: none"), "metavar": "HEAD"},
    )  # fmt: skip
    markov_scale: float = dataclasses.field(default=1.0, metadata={"help": "scale of the Markov heads' W_q, W_k"})
    gpt2: str | None = dataclasses.field(
        default=None, metadata={"help": "local Hugging Face GPT-2 directory to initialise from (no Markov init)"}
    )
    steps: int | None = dataclasses.field(default=None, metadata={"help": _preset_help("steps")})
    batch_size: int | None = dataclasses.field(default=None, metadata={"help": _preset_help("batch_size")})
    learning_rate: float | None = dataclasses.field(default=None, metadata={"help": _preset_help("learning_rate")})
    weight_decay: float = 1e-4
    warmup_steps: int | None = dataclasses.field(default=None, metadata={"help": _preset_help("warmup_steps")})
    grad_clip: float = 0.25
    num_histories: int | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("num_histories",
                                       "noise-distillation histories per task family (spread over its layouts)")},
    )  # fmt: skip
    episodes_per_history: int | None = dataclasses.field(
        default=None, metadata={"help": _preset_help("episodes_per_history")}
    )
    key_to_door_layouts: tuple[str, ...] = dataclasses.field(
        default=("40:0",),
        metadata={"help": "Key-to-Door layouts as KEY:DOOR cells in [0, 81) (default: 40:0, the key at the "
                  "centre and the door in a corner)", "metavar": "KEY:DOOR"},
    )  # fmt: skip
    key_to_door_episode_length: int = 40
    eval_every: int | None = dataclasses.field(
        default=None, metadata={"help": _preset_help("eval_every", "steps between G_Markov readings")}
    )
    analysis_windows: int | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("analysis_windows", "held-out windows for gate weights and head importance")},
    )
    eval_envs: int | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("eval_envs", "rollout episodes per task family (spread over its layouts)")},
    )
    sample_actions: bool = dataclasses.field(
        default=False, metadata={"help": "sample actions in rollouts (else argmax)"}
    )
    backend: str = dataclasses.field(default="auto", metadata={"help": "MoA kernel backend"})
    device: str = dataclasses.field(default="auto", metadata={"help": "auto, cpu, cuda, ..."})
    #: Tiny models gain nothing from intra-op threads on a shared CPU (see icrl-induction).
    num_threads: int = dataclasses.field(
        default=1,
        metadata={"help": "torch CPU threads (0: half the available cores, 1 to 4)", "aliases": ("--threads",)},
    )
    seeds: tuple[int, ...] | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("seeds", "seeds (>= 0): one backbone, dataset and training per seed"),
                  "metavar": "SEED"},
    )  # fmt: skip
    out_dir: str = "runs/markov"
    progress: bool = True

    def __post_init__(self) -> None:
        fill_from_preset(self, PRESET_VALUES)
        # The command line gives tuples, markov.json lists, older callers comma strings: normalise to tuples.
        self.tasks = as_tuple(self.tasks, str, "tasks")
        self.key_to_door_layouts = as_tuple(self.key_to_door_layouts, str, "key_to_door_layouts")
        for name in ("context_lens", "moa_layers", "markov_heads", "seeds"):
            setattr(self, name, as_tuple(getattr(self, name), int, name))
        if not self.tasks or any(task not in TASKS for task in self.tasks):
            raise ValueError(f"tasks must be one or more of {tuple(TASKS)}, got {self.tasks!r}")
        if not self.seeds or min(self.seeds) < 0:
            raise ValueError(f"seeds must be one or more ints >= 0, got {self.seeds!r}")
        if not self.context_lens or min(self.context_lens) < 1:
            raise ValueError(f"context_lens must be one or more ints >= 1, got {self.context_lens!r}")
        if not self.moa_layers or min(self.moa_layers) < 0:  # the report reads the gate of a MoA layer
            raise ValueError(f"moa_layers must be one or more ints >= 0, got {self.moa_layers!r}")
        if self.markov_heads and min(self.markov_heads) < 0:
            raise ValueError(f"markov_heads must be ints >= 0, got {self.markov_heads!r}")
        self.key_to_door_task_ids()  # a bad layout fails here, before any training
        for name in ("steps", "batch_size", "num_histories", "episodes_per_history", "eval_every",
                     "analysis_windows", "eval_envs"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def key_to_door_task_ids(self) -> np.ndarray:
        """Task ids ``key * 81 + door`` of :attr:`key_to_door_layouts`."""
        ids = []
        for pair in self.key_to_door_layouts:
            key, _, door = str(pair).strip().partition(":")
            if not (key.isdigit() and door.isdigit() and int(key) < 81 and int(door) < 81):
                raise ValueError(f"key_to_door_layouts must be KEY:DOOR cells in [0, 81), got {pair!r}")
            ids.append(int(key) * 81 + int(door))
        if not ids:
            raise ValueError("key_to_door_layouts must name at least one layout")
        return np.asarray(ids, dtype=np.int64)

    # Accessors kept from the comma-string days; the fields themselves are tuples now.
    def task_list(self) -> list[str]:
        return list(self.tasks)

    def context_list(self) -> list[int]:
        return list(self.context_lens)

    def seed_list(self) -> list[int]:
        return list(self.seeds)

    def markov_head_list(self) -> list[int]:
        return list(self.markov_heads)

    def moa_layer_list(self) -> tuple[int, ...]:
        return tuple(self.moa_layers)


# --- tasks and data -----------------------------------------------------------------------------------


@dataclass
class Task:
    """One environment family of the experiment: how to build its envs, and how states are packed."""

    name: str
    state_sizes: tuple[int, ...]
    episode_length: int
    make_env: object  # (task ids, seed) -> BatchedEnv
    task_ids: np.ndarray

    def env(self, count: int, seed: int) -> BatchedEnv:
        """``count`` environments (at least one per layout), the layouts dealt round-robin."""
        return self.make_env(np.resize(self.task_ids, max(count, self.task_ids.size)), seed)


def make_task(name: str, config: MarkovConfig) -> Task:
    if name == "dark_room_visible":
        goals = np.arange(81)
        return Task(name, (81, 81), 20, lambda ids, seed: VisibleGoalDarkRoom(ids, seed=seed), goals)
    if name == "dark_room":
        goals = np.arange(81)
        return Task(name, (81,), 20, lambda ids, seed: DarkRoom(ids, seed=seed), goals)
    length = config.key_to_door_episode_length
    layouts = config.key_to_door_task_ids()
    return Task(
        name, (81,), length, lambda ids, seed: KeyToDoor.from_task_ids(ids, episode_length=length, seed=seed), layouts
    )


def task_data(task: Task, config: MarkovConfig, seed: int):
    """Noise-distillation histories on every task, and per-task targets (the best return in the data)."""
    env = task.env(config.num_histories, seed)
    histories = collect_histories(
        env, NoiseDistillation(), config.episodes_per_history, seed=seed, progress=config.progress
    )
    returns = histories.episode_returns()  # [H, E]
    task_ids = np.asarray(histories.task_ids)
    best = {int(t): float(np.nanmax(returns[task_ids == t])) for t in np.unique(task_ids)}
    return histories, returns, best


# --- training and analysis ------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``--device`` as a torch device that exists here (a clear error for ``cuda`` without CUDA)."""
    return _resolve_device(name)


def build_backbone(config: MarkovConfig, seed: int) -> tuple[DTMoAConfig, dict]:
    """The shared initial backbone (``wpe``, ``blocks``, ``ln_f``): Markov-initialised or a GPT-2 checkpoint."""
    k_max = max(config.context_list())
    common = dict(
        context_len=k_max, moa_layers=config.moa_layer_list(), gate=config.gate, dropout=config.dropout,
        backend=config.backend, max_timestep=max(20, config.key_to_door_episode_length),
    )  # fmt: skip
    torch.manual_seed(seed)
    if config.gpt2:
        model_config = DTMoAConfig.from_gpt2(config.gpt2, **common, **({"n_layer": config.n_layer}
                                                                      if config.n_layer else {}))  # fmt: skip
        model = DecisionTransformerMoA(model_config)
        model.load_gpt2(config.gpt2)
    else:
        model_config = DTMoAConfig(
            n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, n_positions=3 * k_max, **common
        )
        model = DecisionTransformerMoA(model_config)
        heads = config.markov_head_list()
        if heads:
            model.markov_init_(0, heads, scale=config.markov_scale, generator=torch.Generator().manual_seed(seed))
    backbone = {name: value.detach().clone() for name, value in model.state_dict().items() if _is_backbone(name)}
    return model_config, backbone


def _is_backbone(name: str) -> bool:
    return name.startswith(("blocks.", "wpe.", "ln_f."))


def learning_rate_at(step: int, config: MarkovConfig) -> float:
    """Linear warm-up, then constant (the official Decision Transformer's schedule)."""
    return warmup_then_constant(step, config.learning_rate, config.warmup_steps)


def _markov_summary(report: MarkovReport) -> dict:
    return {"markov_heads": report.heads(), "ratio": report.ratio, "diagonal_positive": report.diagonal_positive}


def _to(batch: dict, device) -> dict:
    return {name: value.to(device) for name, value in batch.items()}


def run_task(
    task: Task, k: int, seed: int, config: MarkovConfig, model_config: DTMoAConfig, backbone: dict, device
) -> dict:
    """Generate data, train one DT-MoA with context ``k`` on ``task``, analyse it; JSON-ready results."""
    start = time.perf_counter()
    data_seed = 10_000 * seed + 1000 * list(TASKS).index(task.name)
    histories, data_returns, best = task_data(task, config, data_seed)
    windows = TrajectoryWindows(histories, k)
    # Analysis windows come from separately generated histories of the same tasks (held out).
    held_out, _, _ = task_data(task, dataclasses.replace(config, progress=False), data_seed + 1)
    analysis = TrajectoryWindows(held_out, k)
    analysis_batch = _to(analysis.sample(config.analysis_windows, np.random.default_rng(data_seed)), device)

    torch.manual_seed(seed)
    model_config = dataclasses.replace(model_config, state_sizes=task.state_sizes, context_len=k)
    model = DecisionTransformerMoA(model_config)
    keys = model.load_state_dict(backbone, strict=False)
    if keys.unexpected_keys or any(_is_backbone(name) for name in keys.missing_keys):
        raise RuntimeError(f"backbone does not fit the task model: {keys}")
    model.to(device)
    report_before = markov_heads(model)
    init_mask = {i: report_before.mask(f"blocks.{i}.attn").to(device) for i in model_config.moa_layers}

    def g_markov_now() -> dict[str, float]:
        gates = model.gate_weights(analysis_batch)
        return {str(layer): float(g_markov(weights, init_mask[layer])) for layer, weights in gates.items()}

    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        (decay if parameter.dim() >= 2 and "embed" not in name and "wpe" not in name else no_decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate, betas=(0.9, 0.95),
    )  # fmt: skip
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    rng = np.random.default_rng(seed + 7)
    curve = {"step": [0], "loss": [float("nan")], "g_markov": [g_markov_now()]}
    running: list[float] = []
    train_start = time.perf_counter()
    model.train()
    bar = tqdm(range(1, config.steps + 1), desc=f"{task.name} k={k} seed {seed}", disable=not config.progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(step - 1, config)
        batch = _to(windows.sample(config.batch_size, rng), device)
        with autocast:
            loss = model.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        running.append(loss.item())
        if step % config.eval_every == 0 or step == config.steps:
            curve["step"].append(step)
            curve["loss"].append(float(np.mean(running)))
            curve["g_markov"].append(g_markov_now())
            running = []
            bar.set_postfix(loss=f"{curve['loss'][-1]:.3f}", g_markov=str(curve["g_markov"][-1]))
    bar.close()
    train_seconds = time.perf_counter() - train_start

    model.eval()
    report_after = markov_heads(model)
    gates_all = model.gate_weights(analysis_batch, tokens="all")
    gates_state = model.gate_weights(analysis_batch, tokens="state")
    final_mask = {i: report_after.mask(f"blocks.{i}.attn").to(device) for i in model_config.moa_layers}
    with torch.no_grad():
        held_out_loss = float(model.loss(analysis_batch))
    importance = model.head_importance(analysis_batch)

    eval_env = task.env(config.eval_envs, data_seed + 99)
    targets = np.array([best[int(t)] for t in eval_env.task_ids()])
    model_returns = rollout_dt(model, eval_env, targets, sample=config.sample_actions, seed=seed)
    random_env = task.env(config.eval_envs, data_seed + 99)
    random_returns = collect_histories(random_env, RandomAgent(), 1, seed=seed, progress=False).episode_returns()
    last_tenth = max(1, config.episodes_per_history // 10)
    return {
        "task": task.name,
        "horizon": TASKS[task.name][0],
        "k": k,
        "seed": seed,
        "markov_before": _markov_summary(report_before),
        "markov_after": _markov_summary(report_after),
        "r": report_before.r,
        "gate_weights_all_tokens": {str(layer): w.tolist() for layer, w in gates_all.items()},
        "gate_weights_state_tokens": {str(layer): w.tolist() for layer, w in gates_state.items()},
        "g_markov_init_heads": {str(layer): float(g_markov(w, init_mask[layer])) for layer, w in gates_all.items()},
        "g_markov_init_heads_state_tokens": {
            str(layer): float(g_markov(w, init_mask[layer])) for layer, w in gates_state.items()
        },
        "g_markov_final_heads": {str(layer): float(g_markov(w, final_mask[layer])) for layer, w in gates_all.items()},
        "g_markov_at_init": curve["g_markov"][0],
        "curve": curve,
        "head_importance": importance.tolist(),
        "final_train_loss": curve["loss"][-1],
        "held_out_loss": held_out_loss,
        "returns": {
            "model": float(model_returns.mean()),
            "data_mean": float(np.nanmean(data_returns)),
            "data_last_tenth": float(np.nanmean(data_returns[:, -last_tenth:])),
            "data_best_per_task_mean": float(np.mean(targets)),
            "random": float(np.nanmean(random_returns)),
            "optimal": float(eval_env.optimal_returns().mean()),
        },
        "num_transitions": len(windows),
        "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - start,
    }


# --- the whole experiment ---------------------------------------------------------------------------------


def run_experiment(config: MarkovConfig, *, command: str | None = None) -> dict:
    """Train and analyse every (task, k); write ``markov.json``, ``markov.md`` and ``markov.png``.
    ``command``: the command line recorded in ``markov.json`` and ``markov.md`` (default: this process's)."""
    with torch_threads(config.num_threads):
        return _run_experiment(config, command)


def _run_experiment(config: MarkovConfig, command: str | None) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    out_dir = run_folder(config.out_dir)
    device = resolve_device(config.device)
    results = []
    for seed in config.seed_list():
        model_config, backbone = build_backbone(config, seed)  # one backbone per seed, shared by the tasks
        for k in config.context_list():
            for task_name in config.task_list():
                task = make_task(task_name, config)
                results.append(run_task(task, k, seed, config, model_config, backbone, device))
    report = {
        "config": dataclasses.asdict(config),
        "model_config": dt_config_dict(model_config),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "summary": summarize(results),
        "results": results,
        "wall_seconds": time.perf_counter() - start,
        # On a CPU shared with other jobs the wall time overstates the cost; this is this process's CPU time.
        "cpu_seconds": time.process_time() - cpu_start,
    }
    write_results(out_dir, "markov", report, format_tables(report), command=command,
                  machine=machine_description(device))  # fmt: skip
    plot_markov(report, out_dir / "markov.png")
    return report


def _g(result: dict, key: str = "g_markov_init_heads") -> float:
    """G_Markov summed over the gated layers."""
    return float(sum(result[key].values()))


def summarize(results: list[dict]) -> dict:
    """Per ``task`` and ``k``: mean, standard deviation (over seeds) and per-seed values of the headline numbers."""
    summary: dict = {}
    for key in dict.fromkeys((r["task"], r["k"]) for r in results):
        group = [r for r in results if (r["task"], r["k"]) == key]
        first = group[0]
        gates = {layer: np.mean([r["gate_weights_all_tokens"][layer] for r in group], axis=0).tolist()
                 for layer in first["gate_weights_all_tokens"]}  # fmt: skip
        summary.setdefault(key[0], {})[str(key[1])] = {
            "horizon": first["horizon"],
            "seeds": [r["seed"] for r in group],
            "g_markov_at_init": seed_stats([sum(r["g_markov_at_init"].values()) for r in group]),
            "g_markov": seed_stats([_g(r) for r in group]),
            "g_markov_state_tokens": seed_stats([_g(r, "g_markov_init_heads_state_tokens") for r in group]),
            "g_markov_final_heads": seed_stats([_g(r, "g_markov_final_heads") for r in group]),
            "gate_weights_all_tokens_mean": gates,
            "head_importance_mean": np.mean([r["head_importance"] for r in group], axis=0).tolist(),
            "markov_heads_still_markov": [
                r["markov_after"]["markov_heads"] == r["markov_before"]["markov_heads"] for r in group
            ],  # fmt: skip
            **{f"return_{name}": seed_stats([r["returns"][name] for r in group]) for name in first["returns"]},
            "held_out_loss": seed_stats([r["held_out_loss"] for r in group]),
            "train_seconds": seed_stats([r["train_seconds"] for r in group]),
        }
    return summary


def _paired_lines(summary: dict, k: str) -> list[str]:
    """Short-term minus long-term G_Markov per seed: both tasks start from the same backbone in a seed,
    so the paired difference removes the (large) variation between initialisations."""
    short = [task for task, by_k in summary.items() if by_k[k]["horizon"] == "short-term"]
    long = [task for task, by_k in summary.items() if by_k[k]["horizon"] == "long-term"]
    if not short or not long or len(summary[short[0]][k]["seeds"]) < 2:
        return []
    lines = ["", "Paired by seed (same backbone), G_Markov trained of the short-term task minus the long-term one:"]
    for name in ("g_markov", "g_markov_state_tokens"):
        where = "all tokens" if name == "g_markov" else "state tokens"
        for task in long:
            diff = np.subtract(summary[short[0]][k][name]["values"], summary[task][k][name]["values"])
            per_seed = [round(float(v), 3) for v in diff]
            lines.append(f"- {short[0]} - {task} ({where}): per seed {per_seed}, mean {format_stats(seed_stats(diff))}")
    return lines


def _head_table(rows: list[tuple[str, str, list[str]]], heads: int) -> list[str]:
    lines = ["| task | layer | " + " | ".join(f"head {h}" for h in range(heads)) + " |", "|---|---|" + "---|" * heads]
    return lines + [f"| {task} | {layer} | " + " | ".join(cells) + " |" for task, layer, cells in rows]


def _listed(value) -> str:
    """A list field of a report's config as markov.md has always shown it: ``0,1`` (older reports hold
    the comma string itself, newer ones a list)."""
    return value if isinstance(value, str) else ",".join(str(v) for v in value)


def format_tables(report: dict) -> str:
    """Markdown: returns and G_Markov per task (mean ± sd over seeds), gate weight, importance and
    Markov ratio per head, and G_Markov against k when several k were run."""
    config, results, summary = report["config"], report["results"], report["summary"]
    model = report["model_config"]
    first_k = min(r["k"] for r in results)
    tasks = list(summary)
    seeds = summary[tasks[0]][str(first_k)]["seeds"]
    backbone = (f"GPT-2 weights from {config['gpt2']}" if config["gpt2"]
                else f"Markov-initialised heads {_listed(config['markov_heads'])} of layer 0")  # fmt: skip
    lines = [
        f"# Markov heads and MoA weights, short- vs long-term tasks (preset {config['preset']})",
        "",
        f"Model: {model['n_layer']} layers x {model['n_head']} heads x {model['n_embd']}, MoA ({config['gate']}) "
        f"in layers {_listed(config['moa_layers'])}; {backbone}; {config['steps']} steps per run; seeds {seeds} "
        "(mean ± sd over seeds). Wall time "
        f"{report['wall_seconds']:.0f} s, process CPU time {report['cpu_seconds']:.0f} s ({report['device']}, "
        f"{report['torch_threads']} torch threads).",
        "",
        f"## Returns and G_Markov (k = {first_k})",
        "",
        "G_Markov: the summed MoA weight of the heads that were Markov at initialisation, averaged over "
        "every token (or the state tokens, where the action is read) of held-out windows.",
        "",
        "| task | horizon | model return | data mean | data last 10% | random | optimal | held-out loss | "
        "G_Markov init | G_Markov trained | G_Markov trained (state tokens) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        s = summary[task][str(first_k)]
        returns = [format_stats(s[f"return_{name}"], 2) for name in ("model", "data_mean", "data_last_tenth",
                                                                       "random", "optimal")]  # fmt: skip
        losses_and_g = [format_stats(s[name]) for name in ("held_out_loss", "g_markov_at_init", "g_markov",
                                                           "g_markov_state_tokens")]  # fmt: skip
        lines.append(f"| {task} | {s['horizon']} | " + " | ".join(returns + losses_and_g) + " |")
    lines += [
        "",
        "Per seed, G_Markov trained: "
        + "; ".join(
            f"{task} {[round(v, 3) for v in summary[task][str(first_k)]['g_markov']['values']]}" for task in tasks
        ),
    ]
    lines += _paired_lines(summary, str(first_k))
    heads = model["n_head"]
    markov_before = {tuple(pair) for pair in results[0]["markov_before"]["markov_heads"]}
    rows = []
    for task in tasks:
        for layer, weights in summary[task][str(first_k)]["gate_weights_all_tokens_mean"].items():
            rows.append((task, layer, [f"{w:.3f}{' (M)' if (f'blocks.{layer}.attn', h) in markov_before else ''}"
                                       for h, w in enumerate(weights)]))  # fmt: skip
    lines += ["", f"## MoA weight per head after training (all tokens, k = {first_k}, mean over seeds)", ""]
    lines += _head_table(rows, heads) + ["", "(M): a Markov head at initialisation."]
    rows = [
        (task, str(layer), [f"{v:.4f}" for v in row])
        for task in tasks
        for layer, row in enumerate(summary[task][str(first_k)]["head_importance_mean"])
    ]
    lines += ["", "## Head importance (zero-ablation, mean over held-out steps of ||a - a_-i||_2, mean over seeds)", ""]
    lines += _head_table(rows, heads)
    first_seed = [r for r in results if r["k"] == first_k and r["seed"] == seeds[0]]
    rows = []
    for r in first_seed:
        before, after = r["markov_before"], r["markov_after"]
        for layer, (ratios_before, ratios_after) in enumerate(zip(before["ratio"], after["ratio"])):
            flags = after["diagonal_positive"][layer]
            rows.append((r["task"], str(layer), [f"{b:.2f} -> {a:.2f}{'' if ok else ' (diag<=0)'}"
                                                 for b, a, ok in zip(ratios_before, ratios_after, flags)]))  # fmt: skip
    lines += ["", f"## Markov ratio before -> after training (Definition 4.1, r = {first_seed[0]['r']:.2f}, "
              f"seed {seeds[0]})", ""]  # fmt: skip
    lines += _head_table(rows, heads)
    kept = {task: summary[task][str(first_k)]["markov_heads_still_markov"] for task in tasks}
    lines += ["", "Heads Markov at initialisation still Markov after training (per seed): "
              + "; ".join(f"{task} {flags}" for task, flags in kept.items())]  # fmt: skip
    ks = sorted({r["k"] for r in results})
    if len(ks) > 1:
        lines += ["", "## G_Markov against context length k (R_Markov: relative to the smallest k)", ""]
        lines += ["| k | " + " | ".join(f"{t} return | {t} G_Markov | {t} R_Markov" for t in tasks) + " |",
                  "|---|" + "---|---|---|" * len(tasks)]  # fmt: skip
        for k in ks:
            cells = []
            for task in tasks:
                s, base = summary[task][str(k)], summary[task][str(ks[0])]["g_markov"]["mean"]
                ratio = s["g_markov"]["mean"] / base if base else math.nan
                model_return, g = format_stats(s["return_model"], 2), format_stats(s["g_markov"])
                cells.append(f"{model_return} | {g} | {100 * ratio:.1f}%")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_markov(report: dict, path: Path) -> None:
    """Left: MoA weight per head (first gated layer, mean over seeds) per task, Markov heads hatched.
    Right: G_Markov against training steps per task, mean over seeds (the paper's Appendix G)."""
    from matplotlib.patches import Patch

    plt = pyplot()

    results, summary = report["results"], report["summary"]
    first_k = min(r["k"] for r in results)
    tasks = list(summary)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    width = 0.8 / len(tasks)
    markov = {tuple(pair) for pair in results[0]["markov_before"]["markov_heads"]}
    for index, task in enumerate(tasks):
        group = [r for r in results if r["task"] == task and r["k"] == first_k]
        layer = next(iter(group[0]["gate_weights_all_tokens"]))
        weights = np.array([r["gate_weights_all_tokens"][layer] for r in group])
        label = f"{task} ({group[0]['horizon']})"
        x = np.arange(weights.shape[1]) + index * width
        errors = weights.std(axis=0, ddof=1) if len(group) > 1 else None
        bars = left.bar(x, weights.mean(axis=0), width, yerr=errors, capsize=2, label=label)
        for head, bar in enumerate(bars):
            if (f"blocks.{layer}.attn", head) in markov:
                bar.set_hatch("//")
                bar.set_edgecolor("black")
        curves = np.array([[sum(g.values()) for g in r["curve"]["g_markov"]] for r in group])
        (line,) = right.plot(group[0]["curve"]["step"], curves.mean(axis=0), label=label)
        if len(group) > 1:
            spread = curves.std(axis=0, ddof=1)
            right.fill_between(group[0]["curve"]["step"], curves.mean(0) - spread, curves.mean(0) + spread,
                               color=line.get_color(), alpha=0.2)  # fmt: skip
    heads = report["model_config"]["n_head"]
    uniform = left.axhline(1.0 / heads, color="gray", linestyle="--", linewidth=1, label="uniform")
    # Legend swatches without hatching (the first bar of each task is a Markov head's), plus one hatch key.
    handles = [Patch(color=container.patches[0].get_facecolor(), label=container.get_label())
               for container in left.containers if hasattr(container, "patches")]  # fmt: skip
    handles += [Patch(facecolor="white", edgecolor="black", hatch="//", label="Markov head at init"),
                uniform]  # fmt: skip
    left.set_xticks(np.arange(heads) + 0.4 - width / 2, [f"head {h}" for h in range(heads)])
    left.set_ylabel("mean MoA weight (held-out tokens)")
    left.set_title(f"MoA weight per head, k = {first_k} (hatched: Markov at init)")
    right.set_xlabel("training step")
    right.set_ylabel("G_Markov (sum of Markov heads' weights)")
    right.set_title("G_Markov during training (mean ± sd over seeds)")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    left.legend(handles=handles, fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def format_summary(report: dict) -> str:
    """A plain-text table of the summary (mean ± sd over seeds) and the run's time."""
    lines = [f"{'task':<18} {'k':>3} {'return':>18} {'data':>6} {'random':>6} {'G_init':>7} {'G_trained':>21}"]
    for task, by_k in report["summary"].items():
        for k, s in by_k.items():
            model_return, g = format_stats(s["return_model"], 2), format_stats(s["g_markov"])
            lines.append(
                f"{task:<18} {k:>3} {model_return:>18} {s['return_data_mean']['mean']:>6.2f} "
                f"{s['return_random']['mean']:>6.2f} {s['g_markov_at_init']['mean']:>7.3f} {g:>21}"
            )
    lines.append(f"total {report['wall_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("icrl-markov", __doc__)
    add_config_arguments(parser, MarkovConfig)
    return parser


@command_line("icrl-markov")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(MarkovConfig, args)
    report = run_experiment(config, command=command_string("icrl-markov", argv))
    print(format_summary(report))
    out_dir = Path(config.out_dir)
    print(f"wrote {out_dir / 'markov.json'}, {out_dir / 'markov.md'} and {out_dir / 'markov.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
