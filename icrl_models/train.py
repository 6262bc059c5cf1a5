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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from icrl_kernels.validation import check_device, check_int

from ._checks import check_training_fields
from ._cli import command_line
from ._cli import resolve_device as _resolve_device
from .checkpoint import CHECKPOINT_VERSION, CheckpointError, checkpoint_field, load_checkpoint, save_checkpoint
from .config import add_config_arguments, as_tuple, config_from_args, make_parser
from .cuda_graphs import (
    CUDA_GRAPH_HELP,
    StepRunner,
    cuda_graph_mode,
    eager_optimizer_state,
    pinned,
    prepare_capturable,
    set_learning_rate,
    use_cuda_graph,
)
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
from .evaluate import EvalReport, evaluate
from .files import JsonLines, read_json_lines, remove_partial_files, write_json, write_text
from .generators import make_agent
from .models.ad import ADConfig, ADModel, action_loss, count_parameters
from .models.headless_ad import HeadlessADConfig, HeadlessADModel
from .nonfinite import NONFINITE_HELP, NonFiniteGuard
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
    payload = load_checkpoint(run_dir / "checkpoint.pt", expect_config=run_identity(config))
    model.load_state_dict(payload["model"])
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
    ddp = Distributed(config.device)
    excluded = None
    if ddp.world_size > 1:
        excluded = "cuda_graph does not support data-parallel runs (torchrun): use --cuda-graph off"
    elif config.compile:
        excluded = _COMPILE_EXCLUDES_GRAPHS
    graphed = use_cuda_graph(config.cuda_graph, ddp.device, excluded=excluded)
    run_dir = Path(config.out_dir)
    if ddp.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_partial_files(run_dir)  # of writes a killed run left unfinished
        write_json(run_dir / "config.json", dataclasses.asdict(config))
    ddp.barrier()
    start_time = time.perf_counter()
    histories = load_or_generate(config, run_dir, ddp)
    windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)

    torch.manual_seed(config.seed)
    model = config.build_model(histories).to(ddp.device)
    betas = (config.beta1, config.beta2)
    optimizer = torch.optim.AdamW(model.parameters(), config.learning_rate, betas, weight_decay=config.weight_decay)
    rng = np.random.default_rng([config.seed, ddp.rank])
    step = 0
    checkpoint_path = run_dir / "checkpoint.pt"
    identity = run_identity(config)
    if checkpoint_path.exists():
        payload = load_checkpoint(checkpoint_path, expect_config=identity)
        step = payload["step"]
        if step > config.steps:
            raise CheckpointError(f"{checkpoint_path}: field 'step' is {step}, past the run's {config.steps} steps")
        numpy_states = checkpoint_field(payload, checkpoint_path, "rng", "numpy", kind=list)
        if len(numpy_states) <= ddp.rank:  # one state per process of the run that saved it
            raise CheckpointError(
                f"{checkpoint_path}: field ['rng']['numpy'] holds {len(numpy_states)} states, none for rank {ddp.rank}"
            )
        try:
            rng.bit_generator.state = numpy_states[ddp.rank]
        except (TypeError, ValueError, KeyError):
            raise CheckpointError(f"{checkpoint_path}: field ['rng']['numpy'] is not a numpy PCG64 state") from None
        torch_state = checkpoint_field(payload, checkpoint_path, "rng", "torch", kind=torch.Tensor)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])  # saved non-capturable (eager_optimizer_state)
        torch.set_rng_state(torch_state)
        if "cuda" in payload["rng"] and ddp.device.type == "cuda":  # Headless-AD's maps, dropout on the GPU
            torch.cuda.set_rng_state(payload["rng"]["cuda"], ddp.device)
    metrics_path = run_dir / "metrics.jsonl"
    if ddp.is_main:
        # Rows after the checkpoint's step come from a run killed before its next checkpoint: this run
        # redoes those steps, so drop them instead of logging every such step twice.
        _trim_metrics(metrics_path, step)
    ddp.barrier()
    finished = finished_summary(config, step, quiet=not ddp.is_main)
    if finished is not None:  # nothing left to do: no second evaluation (and no second row)
        return finished if ddp.is_main else {}

    if graphed:  # the learning rate and step counters move to the device, where the graph reads them
        prepare_capturable(optimizer)
    # Watches every step on the device; read below only where the loop reads the host anyway.
    guard = NonFiniteGuard(model, optimizer, policy=config.nonfinite, step=step)
    if checkpoint_path.exists():
        guard.saved(checkpoint_path, step)
    trained = torch.nn.parallel.DistributedDataParallel(model) if ddp.world_size > 1 else model
    trained = maybe_compile(trained, config.compile)
    tracker = (
        Tracker(config.track, run_dir, dataclasses.asdict(config), project=config.wandb_project,
                entity=config.wandb_entity)
        if ddp.is_main else Tracker((), run_dir, {})
    )  # fmt: skip

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=ddp.device.type == "cuda")
    metrics = JsonLines(metrics_path) if ddp.is_main else None
    show = config.progress and ddp.is_main
    bar = tqdm(total=config.steps, initial=step, desc=f"train {config.model}", disable=not show)
    if ddp.is_main and step == 0:
        size = f"{count_parameters(model):,} parameters, {len(windows):,} training windows"
        print(f"{config.model}: {size}", file=sys.stderr)
    model.train()
    last_log = (step, time.perf_counter())
    run_step = StepRunner(
        lambda batch: train_step(model, trained, optimizer, batch, config, autocast), model, optimizer, ddp.device,
        cuda_graph=graphed, fallback=config.cuda_graph == "auto", guard=guard,
    )  # fmt: skip
    try:
        while step < config.steps:
            learning_rate = learning_rate_at(step, config)
            set_learning_rate(optimizer, learning_rate)
            stats = run_step(_next_batch(windows, rng, config, model, ddp.device))
            step += 1
            bar.update(1)
            log_now = step % config.log_every == 0 or step == config.steps
            # Every rank (their gradients are all-reduced): raises if the run diverged ("stop"), before a NaN row.
            skipped = guard.check() if log_now else 0
            if metrics is not None and log_now:
                loss, grad_norm = stats.tolist()  # the host reads, every log_every steps
                record, last_log = metric_row(step, loss, learning_rate, grad_norm, last_log, start_time)
                if config.nonfinite == "skip":
                    record["skipped_steps"] = skipped
                metrics.write(record)
                tracker.log(step, {f"train/{name}": record[name] for name in _TRACKED})
                bar.set_postfix(loss=f"{record['loss']:.3f}")
            if step % config.checkpoint_every == 0 or step == config.steps:
                guard.check()  # every rank: never a checkpoint of a diverged model over the last good one
                if metrics is not None:
                    metrics.sync()  # the rows up to this step are on disk before the checkpoint refers to them
                _checkpoint(model, optimizer, rng, step, identity, checkpoint_path, ddp)
                guard.saved(checkpoint_path, step)
            if config.eval_every and step % config.eval_every == 0 and step < config.steps and ddp.is_main:
                guard.check()
                report = run_evaluation(model, config, histories, seed=config.seed + 1)
                metrics.write({"step": step, "eval": report.summary})
                tracker.log(step, _eval_scalars(report.summary))
                model.train()
        bar.close()

        summary: dict = {}
        if ddp.is_main:
            report = run_evaluation(model, config, histories, seed=config.seed + 1)
            summary = record_evaluation(report, config, step, metrics, tracker, start_time)
    finally:
        if metrics is not None:
            metrics.close()
        tracker.close()
    ddp.barrier()
    return summary


_TRACKED = ("loss", "lr", "grad_norm", "steps_per_second")


def finished_summary(config: TrainConfig, step: int, *, quiet: bool = False) -> dict | None:
    """The final evaluation summary of a run whose checkpoint is at ``step``, when the run is finished (at
    ``config.steps``, with its evaluation row in ``metrics.jsonl``), else None; says so on stderr."""
    if step != config.steps:
        return None
    metrics_path = Path(config.out_dir) / "metrics.jsonl"
    finished = [r["eval"] for r in _read_metrics(metrics_path) if r.get("step") == step and "eval" in r]
    if not finished:
        return None
    if not quiet:
        print(f"{config.out_dir} is already finished ({step} steps): final return "
              f"{finished[-1]['final_return']:.2f}", file=sys.stderr)  # fmt: skip
    return finished[-1]


def metric_row(step: int, loss: float, learning_rate: float, grad_norm: float, last_log: tuple, start_time: float):
    """A training row of ``metrics.jsonl`` at ``step`` and the new ``last_log`` ``(step, time)``; steps per
    second are counted since ``last_log``."""
    now = time.perf_counter()
    record = {"step": step, "loss": loss, "lr": learning_rate, "grad_norm": grad_norm,
              "steps_per_second": (step - last_log[0]) / (now - last_log[1]), "seconds": now - start_time}  # fmt: skip
    return record, (step, now)


def record_evaluation(report: EvalReport, config: TrainConfig, step: int, metrics, tracker, start_time: float) -> dict:
    """Write a run's final evaluation: ``eval.json`` / ``eval.png``, its ``metrics.jsonl`` row and tracker
    scalars; print its table and summary line. Returns the summary (with ``wall_seconds``)."""
    json_path, png_path = report.save(config.out_dir, title=f"{config.model} on {config.env}, held-out tasks")
    summary = {**report.summary, "wall_seconds": time.perf_counter() - start_time}
    metrics.write({"step": step, "eval": summary})
    tracker.log(step, _eval_scalars(summary))
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


def _read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``; a torn last line (a kill mid-write) is dropped."""
    return read_json_lines(path)


def _trim_metrics(path: Path, step: int) -> list[dict]:
    """Drop the rows of ``metrics.jsonl`` logged after ``step`` (atomically); returns the rows kept."""
    records = _read_metrics(path)
    kept = [record for record in records if int(record.get("step", 0)) <= step]
    if len(kept) != len(records) or (path.exists() and path.read_text().count("\n") != len(records)):
        write_text(path, "".join(json.dumps(record) + "\n" for record in kept))
    return kept


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
    optimizer.zero_grad(set_to_none=True)
    with autocast:
        loss = run_loss(model, trained, local_action_batch(batch), config.label_smoothing)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return torch.stack([loss.detach().float(), grad_norm.float()])


def run_loss(model, trained, batch, label_smoothing: float | torch.Tensor) -> torch.Tensor:
    """A run's training loss on a :func:`local_action_batch` batch; ``trained`` is the module whose forward runs
    (``model`` or its DDP / compiled wrapper). Batched runs call it under ``vmap`` with a per-run smoothing."""
    # Call the (possibly DDP-wrapped) module itself: DDP synchronises gradients through its forward.
    if isinstance(model, HeadlessADModel):
        return model.loss(batch, trained=trained, action_map=batch["action_map"])
    logits = trained(batch["states"], batch["local_prev_actions"], batch["prev_rewards"])
    return action_loss(logits, {**batch, "actions": batch["local_actions"]}, label_smoothing)


def _cuda_rng_state(model) -> dict:
    """``{"cuda": state}`` of the default CUDA generator of the model's device ({} off CUDA): a resumed run
    then draws the same Headless-AD maps and dropout masks as an uninterrupted one. Every rank of a
    data-parallel run seeds its device alike, so rank 0's state stands for all."""
    device = next(model.parameters()).device
    return {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}


def _checkpoint(model, optimizer, rng, step, identity, path, ddp: Distributed) -> None:
    states = [None] * ddp.world_size
    if ddp.world_size > 1:
        dist.all_gather_object(states, rng.bit_generator.state)
    else:
        states = [rng.bit_generator.state]
    if ddp.is_main:
        rng_states = {"numpy": states, "torch": torch.get_rng_state(), **_cuda_rng_state(model)}
        write_checkpoint(path, step, identity, model.state_dict(), eager_optimizer_state(optimizer), rng_states)


def write_checkpoint(path, step: int, identity: dict, model_state: dict, optimizer_state: dict, rng: dict) -> None:
    """A run's ``checkpoint.pt``: its model's ``state_dict``, its AdamW's (as a non-capturable optimiser saves
    it), its random states (``{"numpy": [per rank], "torch": CPU state, "cuda": ...}``) and its identity."""
    save_checkpoint(
        {"version": CHECKPOINT_VERSION, "step": step, "config": identity, "model": model_state,
         "optimizer": optimizer_state, "rng": rng},
        path,
    )  # fmt: skip


@command_line("icrl-train")
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("icrl-train", __doc__)
    add_config_arguments(parser, TrainConfig)
    train(config_from_args(TrainConfig, parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
