"""``icrl-train``: train AD, N-Gram AD or Headless-AD on learning histories, then evaluate it in context.

The default is the project's main job, sized for a 2-core CPU: Dark Room, N-Gram AD (n-gram layers
with n = 1, 2 over state ids, then two attention blocks), Q-learning histories on 60 training goals,
evaluated on the 21 held-out goals. Everything is one dataclass, :class:`TrainConfig`; every field is
a command-line flag (``icrl-train --help``).

Steps: (1) load the training dataset, or generate it with the source algorithm and cache it in the
run folder; (2) train with AdamW, linear warm-up then cosine decay, bf16 autocast on CUDA, a
progress bar, metrics appended to ``metrics.jsonl`` (one row per step: a resumed or rerun run
rewrites none), optionally to TensorBoard / Weights & Biases (``--track``), and an atomic
``checkpoint.pt`` every ``checkpoint_every`` steps (a killed run resumes from it); (3) roll the model
out in context on held-out tasks and write ``eval.json`` / ``eval.png``, printing a table. Rerunning
a finished run prints its stored result without training or evaluating again.

Faults: a step whose loss or gradient norm is inf or NaN ends the run with one line naming the step, the
values and the last good checkpoint, which stays intact (``--nonfinite skip`` undoes such steps instead);
every file is written atomically, so a killed run resumes from its last complete checkpoint, and a full
disk is one line with exit status 2 (docs/models.md, "Faults").

Speed: ``--threads`` sets torch's CPU threads (default: half the available cores, at most 4: on a
shared CPU more threads made steps 10-25x slower), ``--compile`` compiles the training forward with
``torch.compile``, and on CUDA each training step (forward, backward, gradient clipping, AdamW) is captured
in one CUDA graph and replayed (``--cuda-graph auto``, the default; ``off`` trains eagerly, ``on`` fails where
a graph cannot run): on a GPU these models' steps are bound by the host's kernel launches, not by the device.

Action sets: models act on *positions* in an environment's action set (local indices), as the
Headless-AD paper does; AD's head therefore has one output per position of the largest training set,
and cannot act in larger sets. Bandits (``--env bernoulli_bandit`` / ``contextual_bandit``) train on
``--num-arms`` arms and evaluate on ``--eval-distribution`` / ``--eval-num-arms``; composite Darkroom
trains on ``--action-set`` and evaluates on ``--eval-action-set``.

Data parallel: ``torchrun --nproc-per-node G -m icrl_models.train ...`` trains on G GPUs (NCCL) or
processes (gloo); each rank samples its own windows, rank 0 writes data, checkpoints and reports.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from icrl_kernels.validation import check_device, check_int

from . import batched
from ._checks import check_training_fields
from ._cli import command_line
from ._cli import resolve_device as _resolve_device
from .batched import StackedRuns
from .config import add_config_arguments, as_tuple, config_from_args, make_parser
from .cuda_graphs import CUDA_GRAPH_HELP, cuda_graph_mode, pinned, use_cuda_graph
from .data import (
    DatasetError,
    GenerateConfig,
    HistoryWindows,
    LearningHistories,
    generate_histories,
    load_histories,
    local_action_batch,
    save_histories,
)
from .data.generate import BANDITS, ENV_HELP, TASKS_HELP, build_env, check_env_and_tasks, is_gym_env, split_size
from .evaluate import EvalReport, evaluate, make_report, reference_returns, rollout_runs
from .generators import make_agent
from .lifecycle import (
    Resumed,
    RunFolder,
    TrainingRun,
    default_autocast,
    final_evaluation,
    measure_batch_runs,
    resume,
    train_runs,
)
from .lifecycle import train_step as lifecycle_train_step
from .models.ad import ADConfig, ADModel, action_loss, choose_actions, count_parameters
from .models.headless_ad import HeadlessADConfig, HeadlessADModel
from .nonfinite import NONFINITE_HELP
from .runtime import TRACKERS, Tracker, check_trackers, maybe_compile, torch_threads

MODEL_KINDS = ("ngram_ad", "ad", "headless_ad")
#: Held-out bandits evaluated when ``eval_tasks`` is not given.
DEFAULT_EVAL_BANDITS = 100


@dataclass
class TrainConfig:
    """One run. Model knobs follow the N-gram paper's Table 1; defaults are the CPU-sized main job."""

    # -- data --------------------------------------------------------------------------------------
    env: str = dataclasses.field(default="dark_room", metadata={"help": ENV_HELP, "aliases": ("--gym",)})
    tasks: str | None = dataclasses.field(default=None, metadata={"help": TASKS_HELP})
    data: str | None = dataclasses.field(
        default=None, metadata={"help": "training dataset (icrl-data); default: generate into the run folder"}
    )
    num_histories: int = dataclasses.field(default=1000, metadata={"help": "histories to generate"})
    num_train_tasks: int | None = dataclasses.field(default=None, metadata={"help": "size of the train split"})
    source_episodes: int = dataclasses.field(default=200, metadata={"help": "episodes per generated history"})
    episode_length: int | None = dataclasses.field(default=None, metadata={"help": "env episode length"})
    num_arms: str = dataclasses.field(default="4-20", metadata={"help": "bandits: training arm count, N or LOW-HIGH"})
    distribution: str | None = dataclasses.field(
        default=None, metadata={"help": "Bernoulli bandit training means: train, mirrored or uniform (default train)"}
    )
    action_set: str = dataclasses.field(default="train", metadata={"help": "composite Darkroom: training action set"})
    # -- model -------------------------------------------------------------------------------------
    model: str = dataclasses.field(default="ngram_ad", metadata={"help": f"one of {MODEL_KINDS}"})
    ngram_sizes: tuple[int, ...] = dataclasses.field(
        default=(1, 2), metadata={"help": "n of each n-gram block (ngram_ad)"}
    )
    ngram_tokens: str = dataclasses.field(default="state", metadata={"help": "state or transition ids"})
    embed_dim: int = dataclasses.field(default=64, metadata={"help": "headless_ad: random action embedding width"})
    tau: float = dataclasses.field(default=1.0, metadata={"help": "headless_ad: InfoNCE temperature"})
    action_prompt: bool = dataclasses.field(default=True, metadata={"help": "headless_ad: prepend the action set"})
    step_tokens: str = dataclasses.field(
        default="joint",
        metadata={"help": "headless_ad: joint (one token per step) or separate (action, reward, state)"},
    )
    seq_len: int = 100
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = dataclasses.field(default=2, metadata={"help": "softmax-attention blocks"})
    pre_norm: bool = True
    qk_norm: bool = False
    embedding_dropout: float = 0.0
    residual_dropout: float = 0.0
    attention_dropout: float = 0.0
    label_smoothing: float = 0.0
    episode_subsample: int = dataclasses.field(default=20, metadata={"help": "train on every k-th episode"})
    backend: str = dataclasses.field(default="auto", metadata={"help": "kernels: auto, triton, eager, reference"})
    # -- optimisation ------------------------------------------------------------------------------
    steps: int = 3000
    batch_size: int = 32
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    warmup_steps: int = 100
    grad_clip: float = 1.0
    # -- evaluation --------------------------------------------------------------------------------
    eval_episodes: int = dataclasses.field(default=60, metadata={"help": "in-context episodes per task"})
    eval_envs_per_task: int = dataclasses.field(default=4, metadata={"help": "rollouts per held-out task"})
    eval_tasks: int | None = dataclasses.field(
        default=None, metadata={"help": "held-out tasks to evaluate on (default all; Key-to-Door has 6461)"}
    )
    eval_distribution: str | None = dataclasses.field(
        default=None, metadata={"help": "Bernoulli bandit evaluation means (default uniform)"}
    )
    eval_num_arms: str | None = dataclasses.field(
        default=None, metadata={"help": "bandits: evaluation arm count (default --num-arms)"}
    )
    eval_action_set: str = dataclasses.field(default="train", metadata={"help": "composite Darkroom: eval set"})
    eval_every: int = dataclasses.field(default=0, metadata={"help": "also evaluate every N steps (0: at the end)"})
    sample_actions: bool = dataclasses.field(default=True, metadata={"help": "sample (else argmax) at evaluation"})
    select_tau: float | None = dataclasses.field(
        default=None, metadata={"help": "sampling temperature at evaluation (default: --tau; AD: 1, as trained)"}
    )
    # -- run ---------------------------------------------------------------------------------------
    out_dir: str = dataclasses.field(default="runs/main", metadata={"help": "run folder"})
    checkpoint_every: int = 500
    log_every: int = 50
    seed: int = 0
    device: str = dataclasses.field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:1, ..."})
    progress: bool = True
    nonfinite: str = dataclasses.field(default="stop", metadata={"help": NONFINITE_HELP})
    # -- speed and tracking (not part of the run's identity: a run may resume with other values) -----
    threads: int = dataclasses.field(
        default=0, metadata={"help": "torch CPU threads (default 0: half the available cores, 1 to 4)"}
    )
    compile: bool = dataclasses.field(default=False, metadata={"help": "torch.compile the training forward"})
    cuda_graph: str = dataclasses.field(default="auto", metadata={"help": CUDA_GRAPH_HELP, "const": "on"})
    track: tuple[str, ...] = dataclasses.field(
        default=(), metadata={"help": f"log loss, lr, steps/s, eval returns to any of {TRACKERS}", "metavar": "NAME"}
    )
    wandb_project: str = dataclasses.field(default="icrl-kernels", metadata={"help": "W&B project (--track wandb)"})
    wandb_entity: str | None = dataclasses.field(
        default=None, metadata={"help": "W&B team or user (default: your default entity)"}
    )

    def __post_init__(self) -> None:
        # JSON (config.json) and older callers spell lists as lists or comma strings: normalise to tuples.
        self.ngram_sizes = as_tuple(self.ngram_sizes, int, "ngram_sizes")
        self.track = as_tuple(self.track, str, "track")
        check_trackers(self.track)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"threads must be an int >= 0 (0: automatic), got {self.threads!r}")
        if self.data is not None and self.tasks is not None:
            raise ValueError("tasks (--tasks) generate the training data; a dataset (--data) records its own")
        check_env_and_tasks(self.env, self.tasks, needed=self.data is None)
        if self.tasks is not None:  # the task list and its split, checked before anything runs
            self.generate_config("train", self.num_histories, self.source_episodes)
        if self.model not in MODEL_KINDS:
            raise ValueError(f"model must be one of {MODEL_KINDS}, got {self.model!r}")
        self.cuda_graph = cuda_graph_mode(self.cuda_graph)
        if self.cuda_graph == "on" and self.compile:
            raise ValueError(_COMPILE_EXCLUDES_GRAPHS)
        # Everything is checked here, before minutes of data generation, so that a typo fails at once.
        check_training_fields(self)
        for name in ("seq_len", "episode_subsample", "eval_episodes", "eval_envs_per_task", "num_histories",
                     "source_episodes"):  # fmt: skip
            check_int(getattr(self, name), name, min_value=1)
        for name in ("num_train_tasks", "episode_length", "eval_tasks"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, min_value=1)
        for name in ("seed", "eval_every"):
            check_int(getattr(self, name), name, min_value=0)
        if any(n < 1 for n in self.ngram_sizes):
            raise ValueError(f"ngram_sizes must be ints >= 1, got {self.ngram_sizes!r}")
        # The model's own checks, with placeholder environment sizes (the data's are not known yet).
        self._model_config(num_states=1, observation_dim=0, num_actions=1, num_rewards=2)

    def ngram_tuple(self) -> tuple[int, ...]:
        """The n-gram sizes the model gets: ``ngram_sizes`` for ``ngram_ad``, none for the other models."""
        return self.ngram_sizes if self.model == "ngram_ad" else ()

    def generate_config(self, split: str, num_histories: int, num_episodes: int, **overrides) -> GenerateConfig:
        """The data config of ``split`` for this run; ``overrides`` replace fields (a gymnasium evaluation takes the
        tasks and time limit its training data recorded)."""
        evaluating = split == "test"
        settings = dict(
            env=self.env,
            split=split,
            num_histories=num_histories,
            num_episodes=num_episodes,
            episode_length=self.episode_length,
            num_train_tasks=self.num_train_tasks,
            num_arms=(self.eval_num_arms or self.num_arms) if evaluating else self.num_arms,
            distribution=(self.eval_distribution if evaluating else self.distribution or "train")
            if self.env == "bernoulli_bandit"
            else None,
            action_set=self.eval_action_set if evaluating else self.action_set,
            seed=self.seed,
            tasks=self.tasks,
        )
        return GenerateConfig(**{**settings, **overrides})

    def model_config(self, histories: LearningHistories) -> ADConfig | HeadlessADConfig:
        env = histories.metadata["env"]
        high_reward = env["reward_range"][1]
        return self._model_config(
            num_states=max(1, env["num_observations"]),
            observation_dim=env.get("observation_dim", 0),
            num_actions=int(histories.action_sets.shape[1]),  # one output per action-set position
            num_rewards=int(high_reward) + 1 if math.isfinite(high_reward) else 2,
        )

    def _model_config(
        self, num_states: int, observation_dim: int, num_actions: int, num_rewards: int
    ) -> ADConfig | HeadlessADConfig:
        """The model config of this run for the given environment sizes (Headless-AD ignores the action and
        reward counts: it scores action embeddings, and embeds rewards as scalars)."""
        shared = {
            "num_states": num_states,
            "observation_dim": observation_dim,
            "seq_len": self.seq_len,
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "pre_norm": self.pre_norm,
            "qk_norm": self.qk_norm,
            "embedding_dropout": self.embedding_dropout,
            "residual_dropout": self.residual_dropout,
            "attention_dropout": self.attention_dropout,
            "backend": self.backend,
        }
        if self.model == "headless_ad":
            return HeadlessADConfig(
                embed_dim=self.embed_dim, tau=self.tau, select_tau=self.select_tau, action_prompt=self.action_prompt,
                step_tokens=self.step_tokens, **shared,
            )  # fmt: skip
        return ADConfig(
            num_actions=num_actions,
            num_rewards=num_rewards,
            ngram_sizes=self.ngram_tuple(),
            ngram_tokens=self.ngram_tokens,
            select_tau=self.select_tau,
            **shared,
        )

    def build_model(self, histories: LearningHistories) -> ADModel | HeadlessADModel:
        config = self.model_config(histories)
        return HeadlessADModel(config) if isinstance(config, HeadlessADConfig) else ADModel(config)


#: Config fields that define what a checkpoint holds; resuming with any of them changed is refused.
RUN_IDENTITY_FIELDS = (
    "env", "data", "num_histories", "num_train_tasks", "source_episodes", "episode_length", "num_arms", "distribution",
    "action_set", "model", "ngram_sizes", "ngram_tokens", "embed_dim", "tau", "action_prompt", "seq_len", "d_model",
    "num_heads", "num_layers", "pre_norm", "qk_norm", "episode_subsample", "steps", "batch_size", "learning_rate",
    "weight_decay", "beta1", "beta2", "warmup_steps", "seed",
)  # fmt: skip


def run_identity(config: TrainConfig) -> dict:
    """The config fields a checkpoint must match (:data:`RUN_IDENTITY_FIELDS`).

    ``ngram_sizes`` is stored as the comma string checkpoints have always held, so that runs written
    before it became a list still resume."""
    identity = {name: getattr(config, name) for name in RUN_IDENTITY_FIELDS}
    identity["ngram_sizes"] = ",".join(str(n) for n in config.ngram_sizes)
    if config.step_tokens != "joint":  # added later: compared only when set, so earlier runs still resume
        identity["step_tokens"] = config.step_tokens
    if config.tasks is not None:  # likewise
        identity["tasks"] = config.tasks
    return identity


def load_trained(config: TrainConfig, device: str | torch.device = "cpu"):
    """The model a finished (or interrupted) run of ``config`` saved, in eval mode, and its training histories
    (``device``: where the model goes; it must exist on this machine)."""
    device = check_device(device)
    run_dir = Path(config.out_dir)
    histories = load_histories(config.data if config.data is not None else run_dir / "train.icrl")
    model = config.build_model(histories)
    resumed = resume(run_dir / "checkpoint.pt", run_identity(config))
    if resumed is None:
        raise FileNotFoundError(f"no checkpoint at {run_dir / 'checkpoint.pt'}")
    resumed.restore_model(model)
    return model.to(device).eval(), histories


def learning_rate_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 0 at ``steps``."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``config.device`` as a torch device that exists here (a clear error for ``cuda`` without CUDA)."""
    return _resolve_device(name, local_rank=local_rank)


class Distributed:
    """Rank bookkeeping; a single process when not launched by ``torchrun``."""

    def __init__(self, device_name: str) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = resolve_device(device_name, local_rank)
        if self.world_size > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def load_or_generate(config: TrainConfig, run_dir: Path, ddp: Distributed) -> LearningHistories:
    """The training histories: ``config.data``, or ``run_dir/train.icrl`` generated once (by rank 0)."""
    if config.data is not None:
        histories = load_histories(config.data, expect={"split": "train"})
        name = histories.metadata["env"]["name"]
        if name != config.env and (is_gym_env(config.env) or "tasks" in histories.metadata):  # gymnasium data
            raise DatasetError(f"{config.data} holds learning histories of {name!r}, not of env {config.env!r}: "
                               f"pass --env {name}")  # fmt: skip
        return histories
    generate = config.generate_config("train", config.num_histories, config.source_episodes)
    path = run_dir / "train.icrl"
    expected = {"env": {"name": config.env}, "config": generate.as_metadata()}
    if ddp.is_main and not path.exists():
        save_histories(generate_histories(generate, progress=config.progress), path)
    ddp.barrier()
    histories = load_histories(path, expect=expected)
    if is_gym_env(config.env) and histories.metadata["tasks"] != generate.task_split().to_json():
        raise DatasetError(f"{path} was generated from other tasks than {config.tasks} gives now: remove it to "
                           "generate the data again, or use another --out-dir")  # fmt: skip
    return histories


def make_eval_env_factory(config: TrainConfig, histories: LearningHistories | None = None):
    """``seed -> BatchedEnv`` over the held-out (test-split) tasks, ``eval_envs_per_task`` rollouts each; for a
    gymnasium environment, the held-out tasks and time limit that the training data ``histories`` recorded."""
    if config.env in BANDITS:  # every bandit is its own task, drawn from the evaluation distribution
        generate = config.generate_config("test", config.eval_tasks or DEFAULT_EVAL_BANDITS, 1)
    else:
        recorded = {}
        if histories is not None and is_gym_env(config.env):
            meta = histories.metadata
            recorded = {"tasks": json.dumps(meta["tasks"]), "num_train_tasks": None,
                        "episode_length": meta["env"]["config"]["episode_length"]}  # fmt: skip
        generate = config.generate_config("test", 1, 1, **recorded)
        num_tasks = config.eval_tasks or split_size(generate)
        generate = dataclasses.replace(generate, num_histories=num_tasks * config.eval_envs_per_task,
                                       num_tasks=config.eval_tasks)  # fmt: skip
    # A partial of a module-level function: ``make.args[0]`` tells which environments it builds (batched
    # evaluation shares the references of runs evaluated on the same ones).
    return functools.partial(_eval_env, generate)


def _eval_env(generate: GenerateConfig, seed: int):
    return build_env(dataclasses.replace(generate, seed=seed))[0]


def run_evaluation(
    model: ADModel | HeadlessADModel, config: TrainConfig, histories: LearningHistories, seed: int
) -> EvalReport:
    return evaluate(model, **evaluation_settings(config, histories), seed=seed, progress=config.progress)


def evaluation_settings(config: TrainConfig, histories: LearningHistories) -> dict:
    """The keyword arguments of :func:`~icrl_models.evaluate.evaluate` that a run's config and training data
    fix (all but the model, the seed and the progress bar)."""
    source = histories.metadata["generator"]
    return {
        "make_env": make_eval_env_factory(config, histories),
        "num_episodes": config.eval_episodes,
        "source": make_agent(source["name"], **source["config"]),
        "source_episodes": int(histories.metadata["num_episodes"]),
        "episode_subsample": config.episode_subsample,
        "sample": config.sample_actions,
    }


def train(config: TrainConfig) -> dict:
    """Run (or resume) one training run; returns the final evaluation summary (rank 0; {} elsewhere).

    A run whose checkpoint is at ``config.steps`` and whose ``metrics.jsonl`` holds the final evaluation
    is finished: it returns that evaluation's summary at once (no training, no second evaluation row)."""
    with torch_threads(config.threads):
        return _train(config)


_COMPILE_EXCLUDES_GRAPHS = (
    "cuda_graph and compile exclude each other: --compile traces the forward, --cuda-graph records the whole step; "
    "choose one"
)


def _train(config: TrainConfig) -> dict:
    (summary,) = train_runs([TrainRun(config)])
    return summary


class TrainRun(TrainingRun):
    """An ``icrl-train`` run in the run lifecycle (:mod:`icrl_models.lifecycle`): windows of learning histories
    drawn from the run's own generator, the action loss (InfoNCE over a fresh random action map for Headless-AD),
    and in-context evaluation on held-out tasks. ``ddp``: the process group of a data-parallel run (default: one
    process); ``histories``: datasets already loaded, by path (runs of one batch share them)."""

    def __init__(self, config: TrainConfig, ddp: Distributed | None = None, *, histories: dict | None = None) -> None:
        self.config = config
        self.ddp = ddp if ddp is not None else Distributed(config.device)
        self.device, self.is_main = self.ddp.device, self.ddp.is_main
        self.folder = RunFolder(config.out_dir)
        self.identity = run_identity(config)
        self.steps, self.cuda_graph, self.nonfinite = config.steps, config.cuda_graph, config.nonfinite
        self.progress = config.progress and self.ddp.is_main
        self.log_every, self.eval_every = config.log_every, config.eval_every
        self.checkpoint_every = config.checkpoint_every
        self.grad_clip = config.grad_clip
        if self.ddp.world_size > 1:
            self.excluded = "cuda_graph does not support data-parallel runs (torchrun): use --cuda-graph off"
        elif config.compile:
            self.excluded = _COMPILE_EXCLUDES_GRAPHS
        use_cuda_graph(config.cuda_graph, self.device, excluded=self.excluded)  # "on" where it cannot run: fail now
        self.start_time = time.perf_counter()
        self._histories = histories if histories is not None else {}
        self.tracker = Tracker((), self.folder.path, {})

    # -- building ---------------------------------------------------------------------------------------------
    def config_json(self) -> dict:
        return dataclasses.asdict(self.config)

    def prepare(self) -> None:
        super().prepare()
        self.ddp.barrier()
        config = self.config
        path = str(Path(config.data if config.data is not None else self.folder.path / "train.icrl").resolve())
        if path not in self._histories:  # runs of one batch on the same data load it once
            self._histories[path] = load_or_generate(config, self.folder.path, self.ddp)
        self.histories = self._histories[path]
        key = (path, config.seq_len, config.episode_subsample)
        if key not in self._histories:  # and share one index of windows
            self._histories[key] = HistoryWindows(
                self.histories, config.seq_len, episode_subsample=config.episode_subsample
            )
        self.windows = self._histories[key]
        self.rng = np.random.default_rng([config.seed, self.ddp.rank])
        if self.is_main and config.track:
            self.tracker = Tracker(config.track, self.folder.path, dataclasses.asdict(config),
                                   project=config.wandb_project, entity=config.wandb_entity)  # fmt: skip

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.config.seed)
        return self.config.build_model(self.histories)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        config = self.config
        betas = (config.beta1, config.beta2)
        return torch.optim.AdamW(model.parameters(), config.learning_rate, betas, weight_decay=config.weight_decay)

    def restore(self, resumed: Resumed) -> None:
        resumed.restore_numpy(self.rng, self.ddp.rank)  # one state per process of the run that saved it

    def random_state(self) -> dict:
        states = [None] * self.ddp.world_size
        if self.ddp.world_size > 1:
            dist.all_gather_object(states, self.rng.bit_generator.state)
        else:
            states = [self.rng.bit_generator.state]
        return {"numpy": states}

    def finished(self) -> dict | None:
        self.ddp.barrier()
        summary = finished_summary(self.config, self.step, quiet=not self.is_main)
        if summary is None:
            return None
        return summary if self.is_main else {}

    # -- the step ---------------------------------------------------------------------------------------------
    def learning_rate(self, step: int) -> float:
        return learning_rate_at(step, self.config)

    def next_batch(self, step: int) -> dict[str, torch.Tensor]:
        return _next_batch(self.windows, self.rng, self.config, self.model, self.device)

    def constants(self) -> dict[str, float]:
        return {"label_smoothing": self.config.label_smoothing}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one run of a batch (under ``vmap``; its label smoothing a 0-d tensor of the batch)."""
        return run_loss(model, model, local_action_batch(batch), batch["label_smoothing"])

    @functools.cached_property
    def trained(self) -> nn.Module:
        """The module whose forward a single step calls: the model, or its data-parallel / compiled wrapper (DDP
        synchronises gradients through its forward)."""
        trained = DistributedDataParallel(self.model) if self.ddp.world_size > 1 else self.model
        return maybe_compile(trained, self.config.compile)

    def single_step(self, model, optimizer, batch) -> torch.Tensor:
        return train_step(model, self.trained, optimizer, batch, self.config, default_autocast(self.device))

    @classmethod
    def starting(cls, runs: Sequence[TrainRun], model: nn.Module, step: int) -> None:
        first = runs[0]
        sizes = {dataclasses.astuple(dataclasses.replace(run.model.config, embedding_dropout=0.0, residual_dropout=0.0))
                 for run in runs}  # fmt: skip
        if len(sizes) > 1:  # dropout rates are each run's own (RunDropout); every other model setting must agree
            raise ValueError(
                "runs of one batch must have equal model sizes, but their data give different ones "
                f"(environment sizes, action sets): {[run.model.config for run in runs]}"
            )
        if step == 0 and first.is_main:
            size = f"{count_parameters(first.model):,} parameters"
            if len(runs) == 1:
                print(f"{first.config.model}: {size}, {len(first.windows):,} training windows", file=sys.stderr)
            else:
                print(f"{first.config.model}: {len(runs)} runs of {size} as one batch", file=sys.stderr)

    @classmethod
    def batch_runs(cls, runs: Sequence[TrainRun], step: int) -> dict[str, torch.Tensor]:
        """Each run's ``batch_size`` windows, drawn from its own generator exactly as its single run draws them
        (``[K, B, ...]`` tensors of the keys a step reads); runs on the same windows are gathered in one call."""
        batch_size = runs[0].config.batch_size
        indices = [run.rng.integers(0, len(run.windows), size=batch_size) for run in runs]
        rows: list[dict | None] = [None] * len(runs)
        by_windows: dict[int, list[int]] = {}
        for index, run in enumerate(runs):
            by_windows.setdefault(id(run.windows), []).append(index)
        for members in by_windows.values():
            gathered = runs[members[0]].windows.get_batch(np.concatenate([indices[i] for i in members]))
            for position, index in enumerate(members):
                rows[index] = {name: gathered[name][position * batch_size : (position + 1) * batch_size]
                               for name in _STEP_KEYS}  # fmt: skip
        # Action sets as wide as the widest run's (-1: no action), where the runs' data differ (bandits of a
        # range of arm counts); a run's padded positions are never available to it.
        width = max(row["action_set"].shape[1] for row in rows)
        for row in rows:
            row["action_set"] = F.pad(row["action_set"], (0, width - row["action_set"].shape[1]), value=-1)
        batch = {name: torch.stack([row[name] for row in rows]) for name in _STEP_KEYS}
        if isinstance(runs[0].model, HeadlessADModel):  # each run's map of the step, as wide as its own data's
            maps = []
            for run in runs:
                with run.own_streams():
                    drawn = run.model.draw_action_map(run.histories.action_sets.shape[1])
                maps.append(F.pad(drawn, (0, 0, 0, width - drawn.shape[0])))  # unavailable rows: never read
            batch["action_map"] = torch.stack(maps)
        return batch

    # -- rows, evaluations, the end ---------------------------------------------------------------------------
    def on_row(self, step: int, row: dict) -> None:
        if "eval" in row:
            self.tracker.log(step, _eval_scalars(row["eval"]))
        elif "loss" in row:
            self.tracker.log(step, {f"train/{name}": row[name] for name in _TRACKED})

    def evaluate(self, model: nn.Module, step: int) -> dict:
        if not self.is_main:
            return {}
        return {"eval": run_evaluation(model, self.config, self.histories, seed=self.config.seed + 1).summary}

    def finish(self, model: nn.Module, step: int) -> dict:
        summary: dict = {}
        if self.is_main:
            report = run_evaluation(model, self.config, self.histories, seed=self.config.seed + 1)
            summary = record_evaluation(report, self.config, step, self.write_row, self.start_time)
        self.ddp.barrier()
        return summary

    def close(self) -> None:
        self.tracker.close()

    @classmethod
    def evaluate_runs(cls, runs: Sequence[TrainRun], models: Sequence[nn.Module], step: int) -> list[dict]:
        if len(runs) == 1 or isinstance(models[0], HeadlessADModel):  # Headless-AD: each run's rollouts alone
            return super().evaluate_runs(runs, models, step)
        return [{"eval": report.summary} for report in evaluate_runs(models, runs)]

    @classmethod
    def finish_runs(cls, runs: Sequence[TrainRun], models: Sequence[nn.Module], step: int) -> list[dict]:
        if len(runs) == 1 or isinstance(models[0], HeadlessADModel):
            return super().finish_runs(runs, models, step)
        reports = evaluate_runs(models, runs)
        return [record_evaluation(report, run.config, step, run.write_row, run.start_time)
                for run, report in zip(runs, reports)]  # fmt: skip


_TRACKED = ("loss", "lr", "grad_norm", "steps_per_second")


def finished_summary(config: TrainConfig, step: int, *, quiet: bool = False) -> dict | None:
    """The final evaluation summary of a run whose checkpoint is at ``step``, when the run is finished (at
    ``config.steps``, with its evaluation row in ``metrics.jsonl``), else None; says so on stderr."""
    if step != config.steps:
        return None
    finished = final_evaluation(Path(config.out_dir) / "metrics.jsonl", step)
    if finished is None:
        return None
    if not quiet:
        print(f"{config.out_dir} is already finished ({step} steps): final return "
              f"{finished['final_return']:.2f}", file=sys.stderr)  # fmt: skip
    return finished


def record_evaluation(report: EvalReport, config: TrainConfig, step: int, write_row, start_time: float) -> dict:
    """Write a run's final evaluation: ``eval.json`` / ``eval.png`` and its ``metrics.jsonl`` row (``write_row``,
    which also gives the tracker its scalars); print its table and summary line. Returns the summary (with
    ``wall_seconds``)."""
    json_path, png_path = report.save(config.out_dir, title=f"{config.model} on {config.env}, held-out tasks")
    summary = {**report.summary, "wall_seconds": time.perf_counter() - start_time}
    write_row({"step": step, "eval": summary})
    print(report.table())
    print(
        f"last {report.final_episodes} in-context episodes: return {summary['final_return']:.2f} = "
        f"{summary['fraction_of_source']:.2f} of {report.source_name}'s final return "
        f"({summary['source_final_return']:.2f}), {summary['fraction_of_optimal']:.2f} of optimal; "
        f"{summary['wall_seconds']:.0f} s in all; {json_path}, {png_path}"
    )
    return summary


def _eval_scalars(summary: dict) -> dict:
    return {f"eval/{name}": value for name, value in summary.items() if isinstance(value, (int, float))}


def _next_batch(windows: HistoryWindows, rng: np.random.Generator, config: TrainConfig, model, device) -> dict:
    """The next training batch of ``config.batch_size`` random windows, on the CPU (in pinned memory when
    ``device`` is CUDA, so that its copy to the device need not wait for the device), plus
    for Headless-AD the step's random action map, drawn on ``device`` (``action_map``)."""
    batch = pinned(windows.get_batch(rng.integers(0, len(windows), size=config.batch_size)), device)
    if isinstance(model, HeadlessADModel):
        batch["action_map"] = model.draw_action_map(batch["action_set"].shape[1])
    return batch


def train_step(
    model, trained, optimizer, batch: dict[str, torch.Tensor], config: TrainConfig, autocast
) -> torch.Tensor:
    """One optimiser step on a device batch of :func:`_next_batch`: forward under ``autocast``, loss,
    backward, gradient clipping, ``optimizer.step()``.

    Returns ``[loss, grad_norm]`` (fp32, on the device). It reads no device value on the host, so on CUDA it
    can be captured whole in a CUDA graph (``--cuda-graph``, :class:`~icrl_models.cuda_graphs.StepRunner`).
    """

    def loss(model, batch):
        return run_loss(model, trained, local_action_batch(batch), config.label_smoothing)

    return lifecycle_train_step(model, optimizer, batch, loss, grad_clip=config.grad_clip, autocast=autocast)


def run_loss(model, trained, batch, label_smoothing: float | torch.Tensor) -> torch.Tensor:
    """A run's training loss on a :func:`local_action_batch` batch; ``trained`` is the module whose forward runs
    (``model`` or its DDP / compiled wrapper). Batched runs call it under ``vmap`` with a per-run smoothing."""
    # Call the (possibly DDP-wrapped) module itself: DDP synchronises gradients through its forward.
    if isinstance(model, HeadlessADModel):
        return model.loss(batch, trained=trained, action_map=batch["action_map"])
    logits = trained(batch["states"], batch["local_prev_actions"], batch["prev_rewards"])
    return action_loss(logits, {**batch, "actions": batch["local_actions"]}, label_smoothing)


# -- many runs as one batched model (icrl-compare --batch-runs) ---------------------------------------------------
#: :class:`TrainConfig` fields that may differ between the runs of one batch; every other field (the model's
#: shape, the environment, steps, batch size, device, evaluation length...) must be equal.
PER_RUN_FIELDS = (
    "data", "num_histories", "num_train_tasks", "source_episodes", "seed", "out_dir",
    "learning_rate", "weight_decay", "beta1", "beta2", "warmup_steps", "grad_clip",
    "embedding_dropout", "residual_dropout", "label_smoothing", "episode_subsample",
    "eval_tasks", "eval_envs_per_task", "eval_distribution", "eval_num_arms", "eval_action_set", "sample_actions",
    "checkpoint_every", "log_every",
)  # fmt: skip
#: Model kinds a batch can train.
BATCHED_MODELS = ("ad", "ngram_ad", "headless_ad")
#: The batch tensors a training step reads (the rest of a windows batch stays on the host).
_STEP_KEYS = ("states", "actions", "prev_actions", "prev_rewards", "mask", "action_set")


def batchable(config: TrainConfig) -> str | None:
    """None if ``config``'s run can train inside a batch, else why not (one phrase)."""
    if config.model not in BATCHED_MODELS:
        return f"model {config.model!r} trains alone (batched: {', '.join(BATCHED_MODELS)})"
    if config.compile:
        return "compile traces one model's forward (batched runs use --cuda-graph on CUDA instead)"
    if config.track:
        return "track logs one run per process (batched runs write metrics.jsonl only)"
    return None


def check_batch(configs: Sequence[TrainConfig]) -> list[TrainConfig]:
    """``configs`` as a list, checked to form one batch (:func:`icrl_models.batched.check_batch` with
    :data:`PER_RUN_FIELDS` and :func:`batchable`); a ``ValueError`` / ``TypeError`` naming the problem."""
    for config in configs:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"configs must be TrainConfig objects, got {type(config).__name__}")
    return batched.check_batch(configs, per_run_fields=PER_RUN_FIELDS, batchable=batchable)


def group_runs(configs: Sequence[TrainConfig], batch_runs: int) -> list[list[int]]:
    """Indices of ``configs`` in batches of at most ``batch_runs`` runs of one shape (:data:`PER_RUN_FIELDS` may
    differ), in order; runs that cannot be batched (:func:`batchable`) are batches of one."""
    return batched.group_runs(configs, batch_runs, per_run_fields=PER_RUN_FIELDS, batchable=batchable)


def train_batched(configs: Sequence[TrainConfig]) -> list[dict]:
    """Run (or resume) ``configs`` as one batch (:func:`check_batch`); returns each run's final evaluation
    summary, as :func:`train` returns it.

    Each run resumes from its own ``checkpoint.pt`` (written alone or in any batch); runs at different steps
    train as consecutive batches, and a finished run returns its stored evaluation (no training, no second
    evaluation row)."""
    configs = check_batch(configs)
    with torch_threads(configs[0].threads):
        ddp, shared = Distributed(configs[0].device), {}
        return train_runs([TrainRun(config, ddp, histories=shared) for config in configs], batched=True)


@dataclass
class RunBatch:
    """One trial of a sweep made of several runs trained as one batch (:func:`run_batch` runs it); ``threads``:
    the torch CPU threads of the batch's process (0: automatic, or the scheduler's share)."""

    configs: tuple[TrainConfig, ...]
    threads: int = 0

    @property
    def out_dir(self) -> str:
        """The runs' folders (a failed trial names them)."""
        return ", ".join(config.out_dir for config in self.configs)


def run_batch(batch: RunBatch) -> dict:
    """A sweep trial made of several runs (:class:`RunBatch`): train them as one batch; ``{"summaries": [...]}``
    in the runs' order (each as :func:`train` returns it). Module-level, so that worker processes and Ray import
    it by name."""
    configs = [dataclasses.replace(config, threads=batch.threads) for config in batch.configs]
    return {"summaries": train_batched(configs)}


@torch.no_grad()
def evaluate_runs(models: Sequence[nn.Module], runs: Sequence[TrainRun]) -> list[EvalReport]:
    """Each run's in-context evaluation, as :func:`run_evaluation` does it alone (seed ``config.seed + 1``, its
    own tasks, source and sampling), with every run's environments stepped together: one decoding step of all
    models (:meth:`~icrl_models.batched.StackedRuns.decode_step`), then each run's choice with its own generator,
    so a run draws the actions it would draw alone. The references are computed once per distinct evaluation."""
    stacked = StackedRuns(models).eval()
    device = runs[0].device
    configs = [run.config for run in runs]
    settings = [evaluation_settings(run.config, run.histories) for run in runs]
    seeds = [config.seed + 1 for config in configs]
    envs = [setting["make_env"](seed) for setting, seed in zip(settings, seeds)]
    num_episodes = configs[0].eval_episodes
    width = max(env.num_envs for env in envs)
    state = stacked.init_decode_state(width, num_episodes * max(env.episode_length for env in envs))
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    available = [models[0].head_availability(torch.from_numpy(env.action_sets()).to(device) >= 0) for env in envs]

    def act(states, prev_actions, prev_rewards, active):
        nonlocal state
        logits, state = stacked.decode_step(state, states, prev_actions, prev_rewards)
        actions = torch.zeros(logits.shape[:2], dtype=torch.long, device=device)
        for run, env in enumerate(envs):
            if active[run]:
                size = env.num_envs
                actions[run, :size] = choose_actions(logits[run, :size], available[run], settings[run]["sample"],
                                                     generators[run], configs[run].select_tau)  # fmt: skip
        return actions

    progress = configs[0].progress
    returns, _ = rollout_runs(envs, num_episodes, act, device=device, progress=progress)
    references: dict[str, object] = {}
    reports = []
    for run, setting, seed, model_returns in zip(runs, settings, seeds, returns):
        key = json.dumps([repr(setting["make_env"].args), seed, run.histories.metadata["generator"],
                          setting["source_episodes"], num_episodes], default=str)  # fmt: skip
        if key not in references:
            references[key] = reference_returns(
                setting["make_env"],
                setting["source"],
                seed=seed,
                source_episodes=setting["source_episodes"],
                num_episodes=num_episodes,
            )
        reports.append(make_report(model_returns, references[key], episode_subsample=setting["episode_subsample"]))
    return reports


#: ``--batch-runs auto`` on a CPU: at most this many runs per batch (a CPU step costs about K times a run's
#: compute, so larger batches gain little once Python's per-op overhead is shared, and delay every run's result).
CPU_MAX_AUTO_BATCH = 8


def auto_batch_runs(config: TrainConfig, *, runs: int, share: int = 1) -> int:
    """``--batch-runs auto`` for ``runs`` runs shaped like ``config``: the lifecycle's measured probe
    (:func:`~icrl_models.lifecycle.measure_batch_runs`) of 1, 2, 4, ... fresh runs of its model on a small dataset
    generated into a temporary folder (the model's sizes, not its data, matter), one run stepping as ``icrl-train``
    steps it. At most :data:`CPU_MAX_AUTO_BATCH` on a CPU; runs that cannot batch: 1."""
    if batchable(config) is not None:
        return 1
    device = Distributed(config.device).device
    maximum = runs if device.type == "cuda" else min(runs, CPU_MAX_AUTO_BATCH)
    with tempfile.TemporaryDirectory(prefix="icrl-batch-probe-") as folder:
        shared: dict = {}
        data = Path(folder) / "train.icrl"
        save_histories(generate_histories(config.generate_config("train", 2, 2), progress=False), data)

        def make_runs(count: int) -> list[TrainRun]:
            probe = [
                dataclasses.replace(
                    config,
                    data=str(data),
                    seed=index,
                    progress=False,
                    threads=0,
                    out_dir=str(Path(folder) / f"k{count}-run{index}"),
                )
                for index in range(count)
            ]
            return [TrainRun(run, histories=shared) for run in probe]  # fmt: skip

        return measure_batch_runs(make_runs, device, runs=maximum, share=share)


@command_line("icrl-train")
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("icrl-train", __doc__)
    add_config_arguments(parser, TrainConfig)
    train(config_from_args(TrainConfig, parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
