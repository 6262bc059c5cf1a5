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
* ``cue_visible`` (short-term) and ``cue_hidden`` (long-term): the Cue Corridor T-maze
  (:class:`~icrl_models.envs.CueCorridor`), once per corridor length ``C`` of ``--corridor-lengths``
  (tables say ``cue_hidden C=4``). A cue drawn per episode says which end of the junction pays; it is shown
  on every step (``cue_visible``: the observation alone decides the turn, memory need 0) or on the first
  step only (``cue_hidden``: the turn at the junction needs the cue seen ``C`` steps earlier, memory need
  ``C``). Unlike Key-to-Door, nothing on the way (cells, rewards, return-to-go) carries the cue, so a
  Decision Transformer truly needs memory. Both variants of a seed and ``C`` train on the **same**
  trajectories (same data seed; the oracle and the noise do not depend on what is observed): the paired
  difference isolates the cue's visibility. Episodes last ``C + 4`` steps (the optimal one ``C + 1``),
  and a DT window never leaves its episode, so a context ``k > C + 4`` adds only padding, and with
  ``k < C + 1`` the cue is never in the context at the junction.

Data: noise-distillation histories (an optimal policy whose actions are replaced by random ones with
a probability that decays from 1 to 0 along each history), so episodes range from random to optimal,
as a Decision Transformer's offline data should. Training windows (``--windows``): ``uniform``, the
official DT's (every recorded step starts a window), in the ``cpu`` and ``paper`` presets; ``rollout``
in the memory presets: each window is the context a rollout has at a uniformly drawn step (from the
episode's start, or the ``k`` steps ending there), since uniform starts hide the cue from most junction
steps that could see it, and the tiny model did not learn ``cue_hidden`` from them. Each task trains a
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
``mean ± sample sd (n=seeds)``; a number that came out NaN (a diverged training) is left out of the mean
and counted in the table. For the cue tasks: ``G_Markov`` (all tokens and state tokens) against memory
need (0 for ``cue_visible``, ``C`` for ``cue_hidden``) and against ``k``, the per-seed paired difference
visible minus hidden (the paper's sign: positive) and the success rate (episodes ending on the cued end).

Runs: the grid-world tasks run once per ``k`` of ``--context-lens``. A cue task runs the union of the
memory-need axis (every corridor length at ``k = --memory-k``) and the k axis (every ``k`` of
``--context-lens`` at ``C = --k-sweep-corridor``); with neither flag, every corridor length at every
``k`` (:meth:`MarkovConfig.runs`).

Outputs in ``--out-dir`` (default ``runs/markov``): ``<stem>.json`` (the config, every run's raw results
under ``"results"``, written after each run, so a crash or a NaN loses nothing, then the ``"summary"``,
keyed by row (the task name, or ``<task>_C<C>`` for a cue task) and ``k``, and ``"memory_pairs"``, the
paired differences of the cue tasks), ``<stem>.md`` (the command line, the machine and the tables), and the
figures ``markov.png`` (grid-world tasks: MoA weight per head, G_Markov over training) and
``markov-memory.png`` (cue tasks: G_Markov against memory need and against ``k``). The stem is
``markov-memory`` when every task is a cue task, else ``markov``. The summary over seeds, the tables and the
figures are drawn by :mod:`icrl_models.experiments.markov_report`.

Presets: ``cpu`` (default; a tiny model, about 10 minutes on one CPU thread), ``paper``
(GPT-2-small-sized, 12 layers x 12 heads x 768, ``k = 10..50``, for a GPU), ``memory`` (the cue tasks with
``cpu``'s model: ``C`` in 2, 4, 8 at ``k = 10`` and ``k`` in 3, 5, 10 at ``C = 4``, 5 seeds) and
``paper-memory`` (the cue tasks with ``paper``'s model: ``C`` in 2, 4, 8, 16 at ``k = 20`` and ``k`` in
5, 9, 20 at ``C = 8``, 5 seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from icrl_kernels.validation import check_int

from .._checks import check_float, check_training_fields
from .._cli import command_line
from .._cli import resolve_device as _resolve_device
from ..analysis.markov import MarkovReport, g_markov, markov_heads
from ..config import add_config_arguments, as_tuple, config_from_args, make_parser, torch_threads
from ..cuda_graphs import CUDA_GRAPH_HELP, cuda_graph_mode, to_device
from ..envs import CueCorridor, DarkRoom, KeyToDoor, VisibleGoalDarkRoom
from ..envs.base import BatchedEnv
from ..generators import NoiseDistillation, RandomAgent, collect_histories
from ..lifecycle import ReadingRun, Resumed, RunFolder, measure_batch_runs, train_runs
from ..models.dt_moa import DecisionTransformerMoA, DTMoAConfig, TrajectoryWindows, dt_config_dict, rollout_dt
from ..nonfinite import NONFINITE_HELP
from .harness import (
    StepCost,
    command_string,
    fill_from_preset,
    machine_description,
    preset_help,
    print_cpu_estimate,
    run_folder,
    transformer_work,
    warmup_then_constant,
    write_results,
)
from .markov_report import format_summary, format_tables, grid_view, memory_pairs, plot_markov, plot_memory, summarize
from .sweep import (
    SweepOptions,
    TrialBatch,
    reuse_or_run,
    reuse_or_run_batch,
    run_trial_batches,
    settings_key,
    sweep_options,
)

PRESETS = ("cpu", "paper", "memory", "paper-memory")
#: task name -> (horizon, what the observation lacks)
TASKS = {
    "dark_room_visible": ("short-term", "nothing: the goal is in the observation"),
    "key_to_door": ("long-term", "whether the key is held (and where the key and door are)"),
    "dark_room": ("long-term", "where the goal is"),
    "cue_visible": ("short-term", "nothing: the cue is shown on every step"),
    "cue_hidden": ("long-term", "the cue, shown on the first step only (memory need: the corridor length)"),
}
#: The Cue Corridor tasks: one run per corridor length (:meth:`MarkovConfig.runs`).
CUE_TASKS = ("cue_visible", "cue_hidden")
GRID_TASKS = tuple(task for task in TASKS if task not in CUE_TASKS)
#: What the grid-world presets run (no cue task) and what the memory presets change on top of a model preset.
GRID_DESIGN = dict(windows="uniform", tasks=GRID_TASKS, corridor_lengths=(4,), memory_k=None, k_sweep_corridor=None)
MEMORY_DESIGN = dict(windows="rollout", tasks=CUE_TASKS, seeds=(0, 1, 2, 3, 4))
#: Settings a preset fills in when the command line leaves them at None.
PRESET_VALUES = {
    "cpu": dict(
        **GRID_DESIGN,
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
        **GRID_DESIGN,
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
# The cue tasks on cpu's model, 2 tasks x 5 runs x 5 seeds = 50 trainings: the memory-need axis (C = 2, 4, 8 at
# k = 10, which covers every episode of C <= 5 and the optimal path of C = 8) and the k axis at C = 4 (episodes
# of 8 steps): k = 3 (the cue never in context at the junction), 5 (just in), 10 (the whole episode; k = 20
# would add only padding, as a window never leaves its episode). One layout and episodes of C + 4 steps:
# 128 histories x 20 episodes are 2,560 episodes (about 17,000 steps at C = 4, 25,000 at C = 8). Rollout
# windows: with the official DT's uniform starts this model stayed at chance on cue_hidden C = 4 (k = 10, 1000
# or 3000 steps); with rollout windows it solved C = 4 in 1000 steps, and C = 8 in 2000 but not in 1000.
PRESET_VALUES["memory"] = {
    **PRESET_VALUES["cpu"], **MEMORY_DESIGN, "corridor_lengths": (2, 4, 8), "memory_k": 10, "k_sweep_corridor": 4,
    "context_lens": (3, 5, 10), "steps": 2000, "num_histories": 128, "episodes_per_history": 20, "eval_envs": 200,
}  # fmt: skip
# The same design on paper's model (a GPU): C up to 16 at k = 20 (>= C + 1 = 17), the k axis at C = 8
# (episodes of 12 steps): k = 5 (below the need), 9 (= C + 1, just in), 20 (the whole episode).
PRESET_VALUES["paper-memory"] = {
    **PRESET_VALUES["paper"], **MEMORY_DESIGN, "corridor_lengths": (2, 4, 8, 16), "memory_k": 20,
    "k_sweep_corridor": 8, "context_lens": (5, 9, 20), "steps": 10000, "warmup_steps": 1000, "num_histories": 512,
    "episodes_per_history": 50, "eval_envs": 1000,
}  # fmt: skip


def _preset_help(name: str, text: str = "") -> str:
    return preset_help(PRESET_VALUES, name, text)


@dataclass
class MarkovConfig(SweepOptions):
    """The experiment; ``None`` fields take the preset's value (:data:`PRESET_VALUES`). Its runs are the
    trials of :mod:`~icrl_models.experiments.sweep` (on Ray Tune when installed)."""

    preset: str = dataclasses.field(default="cpu", metadata={"help": " or ".join(PRESETS)})
    # List fields take several values (--seeds 0 1 2); a comma-separated 0,1,2 (older command lines,
    # configs and markov.json files) is read the same.
    # Empty (the default): the preset's tasks. Not None-defaulted like the other preset fields, so that the
    # flag keeps taking one or more values.
    tasks: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={"help": _preset_help("tasks", "tasks to run: dark_room_visible, cue_visible (short-term), "
                                       "key_to_door, dark_room, cue_hidden (long-term)"),
                  "metavar": "TASK"},
    )  # fmt: skip
    corridor_lengths: tuple[int, ...] | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("corridor_lengths", "Cue Corridor lengths C (the memory need of cue_hidden)"),
                  "metavar": "C"},
    )  # fmt: skip
    memory_k: int | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("memory_k", "context length at which the cue tasks run every corridor "
                                       "length (the memory-need axis)")},
    )  # fmt: skip
    k_sweep_corridor: int | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("k_sweep_corridor", "corridor length at which the cue tasks run every k of "
                                       "--context-lens (the k axis); with neither this nor --memory-k, every "
                                       "corridor length runs at every k")},
    )  # fmt: skip
    windows: str | None = dataclasses.field(
        default=None,
        metadata={"help": _preset_help("windows", "training and analysis windows: uniform (the official DT: a "
                                       "window starts at every step) or rollout (the context a rollout has at "
                                       "every step)")},
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
    cuda_graph: str = dataclasses.field(default="auto", metadata={"help": CUDA_GRAPH_HELP, "const": "on"})
    nonfinite: str = dataclasses.field(default="stop", metadata={"help": NONFINITE_HELP})
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
        super().__post_init__()
        self.cuda_graph = cuda_graph_mode(self.cuda_graph)
        fill_from_preset(self, PRESET_VALUES)
        # The command line gives tuples, markov.json lists, older callers comma strings: normalise to tuples.
        self.tasks = as_tuple(self.tasks, str, "tasks") or PRESET_VALUES[self.preset]["tasks"]
        self.corridor_lengths = as_tuple(self.corridor_lengths, int, "corridor_lengths")
        self.key_to_door_layouts = as_tuple(self.key_to_door_layouts, str, "key_to_door_layouts")
        for name in ("context_lens", "moa_layers", "markov_heads", "seeds"):
            setattr(self, name, as_tuple(getattr(self, name), int, name))
        if not self.tasks or any(task not in TASKS for task in self.tasks):
            raise ValueError(f"tasks must be one or more of {tuple(TASKS)}, got {self.tasks!r}")
        if not self.seeds or min(self.seeds) < 0:
            raise ValueError(f"seeds must be one or more ints >= 0, got {self.seeds!r}")
        if not self.context_lens or min(self.context_lens) < 1:
            raise ValueError(f"context_lens must be one or more ints >= 1, got {self.context_lens!r}")
        if self.windows not in WINDOW_SAMPLERS:
            raise ValueError(f"windows must be one of {tuple(WINDOW_SAMPLERS)}, got {self.windows!r}")
        if not self.corridor_lengths or min(self.corridor_lengths) < 1:
            raise ValueError(f"corridor_lengths must be one or more ints >= 1, got {self.corridor_lengths!r}")
        if self.memory_k is not None and (isinstance(self.memory_k, bool) or not isinstance(self.memory_k, int)
                                          or self.memory_k < 1):  # fmt: skip
            raise ValueError(f"memory_k must be an int >= 1 or None, got {self.memory_k!r}")
        if self.k_sweep_corridor is not None and self.k_sweep_corridor not in self.corridor_lengths:
            raise ValueError(
                f"k_sweep_corridor must be one of corridor_lengths {self.corridor_lengths}, "
                f"got {self.k_sweep_corridor!r}"
            )
        if not self.moa_layers or min(self.moa_layers) < 0:  # the report reads the gate of a MoA layer
            raise ValueError(f"moa_layers must be one or more ints >= 0, got {self.moa_layers!r}")
        if self.markov_heads and min(self.markov_heads) < 0:
            raise ValueError(f"markov_heads must be ints >= 0, got {self.markov_heads!r}")
        self.key_to_door_task_ids()  # a bad layout fails here, before any training
        check_training_fields(self)
        check_float(self.markov_scale, "markov_scale")  # finite: a NaN scale would make every weight NaN
        for name in ("num_histories", "episodes_per_history", "eval_every", "analysis_windows", "eval_envs"):
            check_int(getattr(self, name), name, min_value=1)

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

    def runs(self) -> list[tuple[str, int | None, int]]:
        """The trainings of one seed, in order, as ``(task, corridor length or None, k)``.

        Grid-world tasks: every ``k`` of :attr:`context_lens` (``k`` outer, tasks inner, as always). Cue tasks
        (after them): the memory-need axis, every corridor length at ``k =`` :attr:`memory_k`, then the
        k axis, every ``k`` of :attr:`context_lens` at ``C =`` :attr:`k_sweep_corridor`, a ``(C, k)`` on
        both axes run once; with neither field set, every corridor length at every ``k``.
        """
        grid = [task for task in self.tasks if task not in CUE_TASKS]
        cue = [task for task in self.tasks if task in CUE_TASKS]
        runs: list[tuple[str, int | None, int]] = [(task, None, k) for k in self.context_lens for task in grid]
        if not cue:
            return runs
        if self.memory_k is None and self.k_sweep_corridor is None:
            points = [(c, k) for c in self.corridor_lengths for k in self.context_lens]
        else:
            points = [(c, self.memory_k) for c in self.corridor_lengths] if self.memory_k is not None else []
            if self.k_sweep_corridor is not None:
                points += [(self.k_sweep_corridor, k) for k in self.context_lens]
        return runs + [(task, c, k) for c, k in dict.fromkeys(points) for task in cue]

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
    corridor_length: int | None = None  # the Cue Corridor's C (cue tasks only)
    num_actions: int = 5  # the grid worlds' 5 moves; the Cue Corridor's 3 (forward, left, right)

    @property
    def row(self) -> str:
        """The summary key: the task name, or ``<task>_C<C>`` for a cue task."""
        return self.name if self.corridor_length is None else f"{self.name}_C{self.corridor_length}"

    @property
    def label(self) -> str:
        """The table label: the task name, or ``<task> C=<C>`` for a cue task."""
        return self.name if self.corridor_length is None else f"{self.name} C={self.corridor_length}"

    @property
    def memory_need(self) -> int | None:
        """Steps the turn must be remembered over: 0 (cue visible), ``C`` (cue hidden); None for grid worlds."""
        if self.corridor_length is None:
            return None
        return 0 if self.name == "cue_visible" else self.corridor_length

    def data_seed(self, seed: int) -> int:
        """The seed of the task's data, held-out windows and evaluation episodes in the run of ``seed``.

        Both cue tasks of a corridor length share it, so that they see the same trajectories (the oracle and
        the noise do not depend on the observation) and differ only in the cue's visibility."""
        family = "cue_visible" if self.name in CUE_TASKS else self.name
        return 10_000 * seed + 1000 * list(TASKS).index(family) + 1_000_000 * (self.corridor_length or 0)

    def env(self, count: int, seed: int) -> BatchedEnv:
        """``count`` environments (at least one per layout), the layouts dealt round-robin."""
        return self.make_env(np.resize(self.task_ids, max(count, self.task_ids.size)), seed)


def make_task(name: str, config: MarkovConfig, corridor_length: int | None = None) -> Task:
    """The task ``name``; a cue task needs its ``corridor_length`` (state sizes ``(C + 3, 3)``, episodes of
    ``C + 4`` steps, CueCorridor's defaults)."""
    if name in CUE_TASKS:
        if corridor_length is None:
            raise ValueError(f"corridor_length is needed for the cue task {name!r}")
        cue_steps = None if name == "cue_visible" else 1
        probe = CueCorridor(1, corridor_length=corridor_length, cue_steps=cue_steps)
        return Task(
            name, probe.observation_parts, probe.episode_length,
            lambda ids, seed: CueCorridor(ids.size, corridor_length=corridor_length, cue_steps=cue_steps, seed=seed),
            np.zeros(1, dtype=np.int64), corridor_length, probe.num_actions,
        )  # fmt: skip
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
    runs = config.runs()
    k_max = max(k for _, _, k in runs)
    # Timestep embeddings cover the longest episode: Dark Room's 20, Key-to-Door's, a corridor's C + 4.
    longest_corridor = max((c for _, c, _ in runs if c is not None), default=0)
    common = dict(
        context_len=k_max, moa_layers=config.moa_layer_list(), gate=config.gate, dropout=config.dropout,
        backend=config.backend, max_timestep=max(20, config.key_to_door_episode_length, longest_corridor + 4),
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


def rollout_windows(windows: TrajectoryWindows, count: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """``count`` windows, each the context a DT rollout has at a uniformly drawn step ``t``: from the episode's
    start when ``t < k``, else the ``k`` steps ending at ``t``. Unlike the official DT's uniform start
    (:meth:`TrajectoryWindows.sample`), no window starts in mid-episode while its end could still see the
    episode's start: such windows never occur in a rollout, and on the Cue Corridor they hide the cue from a
    junction step whose label depends on it (with uniform starts the tiny model did not learn the hidden cue)."""
    steps = rng.integers(0, len(windows), size=count)
    episode_starts = steps - windows.timesteps[steps]
    return windows.get_batch(np.maximum(episode_starts, steps - windows.context_len + 1))


#: ``--windows``: how training (and held-out analysis) windows are drawn.
WINDOW_SAMPLERS = {
    "uniform": lambda windows, count, rng: windows.sample(count, rng),
    "rollout": rollout_windows,
}


def _markov_summary(report: MarkovReport) -> dict:
    return {"markov_heads": report.heads(), "ratio": report.ratio, "diagonal_positive": report.diagonal_positive}


class MarkovRun(ReadingRun):
    """One run of the experiment in the run lifecycle (:mod:`icrl_models.lifecycle`): a DT-MoA with context ``k``
    on ``task``, from the seed's backbone, trained on the task's windows with the action cross-entropy; every
    ``eval_every`` steps (and at the start and end) G_Markov is read on held-out windows, and the run is
    checkpointed, so a killed run resumes (``<out_dir>/runs/<trial>/``); at the end the analysis and rollouts."""

    def __init__(self, task: Task, k: int, seed: int, config: MarkovConfig, model_config: DTMoAConfig,
                 backbone: dict, device: torch.device, *, folder: Path, identity: dict) -> None:  # fmt: skip
        self.task, self.k, self.seed, self.config, self.backbone = task, k, seed, config, backbone
        self.model_config = dataclasses.replace(
            model_config, state_sizes=task.state_sizes, num_actions=task.num_actions, context_len=k
        )
        self.device, self.folder, self.identity = device, RunFolder(folder), identity
        self.steps, self.cuda_graph, self.nonfinite = config.steps, config.cuda_graph, config.nonfinite
        self.progress, self.grad_clip = config.progress, config.grad_clip
        self.log_every = self.eval_every = self.checkpoint_every = config.eval_every

    def prepare(self) -> None:
        super().prepare()
        config, task = self.config, self.task
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        data_seed = task.data_seed(self.seed)
        self.histories, self.data_returns, self.best = task_data(task, config, data_seed)
        self.windows = TrajectoryWindows(self.histories, self.k)
        # Analysis windows come from separately generated histories of the same tasks (held out).
        held_out, _, _ = task_data(task, dataclasses.replace(config, progress=False), data_seed + 1)
        self.sample = WINDOW_SAMPLERS[config.windows]
        analysis = self.sample(TrajectoryWindows(held_out, self.k), config.analysis_windows,
                               np.random.default_rng(data_seed))  # fmt: skip
        self.analysis_batch = to_device(analysis, self.device)
        self.rng = np.random.default_rng(self.seed + 7)

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        model = DecisionTransformerMoA(self.model_config)
        keys = model.load_state_dict(self.backbone, strict=False)
        if keys.unexpected_keys or any(_is_backbone(name) for name in keys.missing_keys):
            raise RuntimeError(f"backbone does not fit the task model: {keys}")
        # The heads that are Markov at initialisation (a resumed run rebuilds its initial model to know them).
        self.report_before = markov_heads(model)
        self.init_mask = {i: self.report_before.mask(f"blocks.{i}.attn").to(self.device)
                          for i in self.model_config.moa_layers}  # fmt: skip
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay, no_decay = [], []
        for name, parameter in model.named_parameters():
            matrix = parameter.dim() >= 2 and "embed" not in name and "wpe" not in name
            (decay if matrix else no_decay).append(parameter)
        groups = [{"params": decay, "weight_decay": self.config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
        return torch.optim.AdamW(groups, lr=self.config.learning_rate, betas=(0.9, 0.95))

    def restore(self, resumed: Resumed) -> None:
        resumed.restore_numpy(self.rng)

    def random_state(self) -> dict:
        return {"numpy": [self.rng.bit_generator.state]}

    def learning_rate(self, step: int) -> float:
        return learning_rate_at(step, self.config)

    def next_batch(self, step: int) -> dict[str, torch.Tensor]:
        return self.sample(self.windows, self.config.batch_size, self.rng)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model.loss(batch)

    def evaluate(self, model: nn.Module, step: int) -> dict:
        return {"g_markov": self.g_markov(model)}

    def g_markov(self, model: nn.Module) -> dict[str, float]:
        """G_Markov of every gated layer on the held-out windows, with the heads Markov at initialisation."""
        gates = model.gate_weights(self.analysis_batch)
        return {str(layer): float(g_markov(weights, self.init_mask[layer])) for layer, weights in gates.items()}

    def finish(self, model: nn.Module, step: int) -> dict:
        config, task, k, seed, device = self.config, self.task, self.k, self.seed, self.device
        train_seconds = time.perf_counter() - getattr(self, "train_start", self.start)
        readings, losses, skipped = self.readings("g_markov")
        curve = {"step": [row["step"] for row in readings], "loss": losses,
                 "g_markov": [row["g_markov"] for row in readings]}  # fmt: skip
        analysis_batch, moa_layers = self.analysis_batch, self.model_config.moa_layers
        model.eval()
        report_after = markov_heads(model)
        gates_all = model.gate_weights(analysis_batch, tokens="all")
        gates_state = model.gate_weights(analysis_batch, tokens="state")
        init_mask = self.init_mask
        final_mask = {i: report_after.mask(f"blocks.{i}.attn").to(device) for i in moa_layers}
        with torch.no_grad():
            held_out_loss = float(model.loss(analysis_batch))
        importance = model.head_importance(analysis_batch)

        data_seed = task.data_seed(seed)
        eval_env = task.env(config.eval_envs, data_seed + 99)
        targets = np.array([self.best[int(t)] for t in eval_env.task_ids()])
        model_returns = rollout_dt(model, eval_env, targets, sample=config.sample_actions, seed=seed)
        random_env = task.env(config.eval_envs, data_seed + 99)
        random_returns = collect_histories(random_env, RandomAgent(), 1, seed=seed, progress=False).episode_returns()
        last_tenth = max(1, config.episodes_per_history // 10)
        data_returns = self.data_returns
        cue = {}
        if task.corridor_length is not None:
            # Reward 1 comes only on the cued end (and ends the episode), so a return of 1 is a success.
            cue = {"success_rate": _success(model_returns), "success_rate_data": _success(data_returns),
                   "success_rate_random": _success(random_returns)}  # fmt: skip
        return {
            "task": task.name,
            "row": task.row,
            "label": task.label,
            "corridor_length": task.corridor_length,
            "memory_need": task.memory_need,
            "horizon": TASKS[task.name][0],
            "k": k,
            "seed": seed,
            **cue,
            "markov_before": _markov_summary(self.report_before),
            "markov_after": _markov_summary(report_after),
            "r": self.report_before.r,
            "gate_weights_all_tokens": {str(layer): w.tolist() for layer, w in gates_all.items()},
            "gate_weights_state_tokens": {str(layer): w.tolist() for layer, w in gates_state.items()},
            "g_markov_init_heads": {str(layer): float(g_markov(w, init_mask[layer])) for layer, w in gates_all.items()},
            "g_markov_init_heads_state_tokens": {
                str(layer): float(g_markov(w, init_mask[layer])) for layer, w in gates_state.items()
            },
            "g_markov_final_heads": {
                str(layer): float(g_markov(w, final_mask[layer])) for layer, w in gates_all.items()
            },
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
            "num_transitions": len(self.windows),
            "skipped_steps": skipped,
            "train_seconds": train_seconds,
            "wall_seconds": time.perf_counter() - self.start,
            # Kept with the run: a rerun that reuses it still reports it (a batch's runs: their shares, below).
            "cpu_seconds": time.process_time() - self.cpu_start,
        }


def run_task(
    task: Task, k: int, seed: int, config: MarkovConfig, model_config: DTMoAConfig, backbone: dict, device,
    *, folder: Path, identity: dict,
) -> dict:  # fmt: skip
    """Generate data, train one DT-MoA with context ``k`` on ``task`` (resuming its checkpoint in ``folder``, which
    must match ``identity``), analyse it; JSON-ready results."""
    (result,) = train_runs([MarkovRun(task, k, seed, config, model_config, backbone, device, folder=folder,
                                      identity=identity)])  # fmt: skip
    return result


def _success(returns) -> float:
    """Fraction of the recorded episodes (NaN: none recorded) of return 1, the Cue Corridor's success."""
    returns = np.asarray(returns, dtype=np.float64)
    return float(np.mean(returns[~np.isnan(returns)] > 0.5))


# --- the whole experiment ---------------------------------------------------------------------------------


def run_experiment(config: MarkovConfig, *, command: str | None = None) -> dict:
    """Train and analyse every run of :meth:`MarkovConfig.runs` per seed; write ``<stem>.json`` (after every
    run, the raw results; at the end with the summary), ``<stem>.md`` and the figures (:func:`output_stem`;
    ``report["files"]`` names them). ``command``: the command line recorded in the ``.json`` and ``.md``
    (default: this process's)."""
    with torch_threads(config.num_threads):
        return _run_experiment(config, command)


@dataclass
class MarkovTrial:
    """One run of the experiment: ``task`` (a Cue Corridor of ``corridor_length``, or a grid world with
    None) at context length ``k``, for one seed."""

    config: MarkovConfig
    seed: int
    task: str
    corridor_length: int | None
    k: int

    def result_path(self) -> Path:
        corridor = "" if self.corridor_length is None else f"-c{self.corridor_length}"
        return Path(self.config.out_dir) / "runs" / f"seed{self.seed}-{self.task}{corridor}-k{self.k}.json"

    @property
    def out_dir(self) -> Path:
        """The run's folder (its checkpoint and metrics while it trains): the result's path without ``.json``."""
        return self.result_path().with_suffix("")

    def shape(self) -> tuple:
        """What runs of one batch share (``--batch-runs``): the task, corridor and context length; seeds differ."""
        return (self.task, self.corridor_length, self.k)

    def parts(self, *, quiet: bool = False) -> tuple[Task, DTMoAConfig, dict, torch.device]:
        """The run's task, its seed's backbone (config and weights) and its device; says what it will cost."""
        config = self.config
        device = resolve_device(config.device)
        if not quiet:
            work = transformer_work(config.batch_size, 3 * self.k, config.n_layer, config.n_embd)  # rtg, state, action
            corridor = "" if self.corridor_length is None else f" C={self.corridor_length}"
            print_cpu_estimate(f"{self.task}{corridor} k={self.k}, seed {self.seed}",
                               STEP_COST.estimate(config.steps, work), device=device)  # fmt: skip
        model_config, backbone = _shared_backbone(config, self.seed)
        return make_task(self.task, config, self.corridor_length), model_config, backbone, device

    def run(self, *, quiet: bool = False) -> MarkovRun:
        """This trial as a run of the lifecycle."""
        task, model_config, backbone, device = self.parts(quiet=quiet)
        return MarkovRun(task, self.k, self.seed, self.config, model_config, backbone, device, folder=self.out_dir,
                         identity=self.key())  # fmt: skip

    def key(self) -> dict:
        """What the run's result depends on: the config without where and how it runs, and the run."""
        # nonfinite: a stored result is of a run that finished, under "stop" one with no non-finite step. seeds:
        # the list only says which trials a sweep runs; the run's own seed is in the key.
        run_only = ("out_dir", "progress", "device", "cuda_graph", "num_threads", "nonfinite", "seeds")
        return settings_key(self.config, run_only, seed=self.seed, task=self.task,
                            corridor_length=self.corridor_length, k=self.k)  # fmt: skip


#: The last backbones built (config, seed) -> (model config, weights): the runs of one seed share it (a batch of
#: runs holds one per seed).
_BACKBONE_CACHE: dict[str, tuple[DTMoAConfig, dict]] = {}
_BACKBONES_KEPT = 16


def _shared_backbone(config: MarkovConfig, seed: int) -> tuple[DTMoAConfig, dict]:
    key = json.dumps([dataclasses.asdict(config), seed], sort_keys=True, default=str)
    if key not in _BACKBONE_CACHE:
        if len(_BACKBONE_CACHE) >= _BACKBONES_KEPT:
            _BACKBONE_CACHE.pop(next(iter(_BACKBONE_CACHE)))
        _BACKBONE_CACHE[key] = build_backbone(config, seed)
    return _BACKBONE_CACHE[key]


#: CPU seconds of a training step (its share of the run's data, analysis and rollouts included) with 1 torch
#: thread on the 2-core VM: the memory preset's 50 runs (k 3-10, 2000 steps) of ``markov-memory.json``.
STEP_COST = StepCost(0.0247, transformer_work(32, 30, 2, 64), "markov-memory.json")


def run_markov_trial(trial: MarkovTrial) -> dict:
    """Train and analyse one run (:func:`run_task`): ``{"result", "model_config"}``. The outcome is kept in
    ``<out_dir>/runs/`` under :meth:`MarkovTrial.key`, so a rerun (or a resumed sweep) reuses it; a run killed
    before its end resumes from its checkpoint (:attr:`MarkovTrial.out_dir`)."""

    def run() -> dict:
        task, model_config, backbone, device = trial.parts()
        result = run_task(task, trial.k, trial.seed, trial.config, model_config, backbone, device,
                          folder=trial.out_dir, identity=trial.key())  # fmt: skip
        return {"result": result, "model_config": dt_config_dict(model_config)}

    return reuse_or_run(trial.result_path(), trial.key(), run)


def run_markov_batch(batch: TrialBatch) -> dict:
    """``--batch-runs``: the runs of ``batch`` (one task, corridor and ``k``; seeds differ) trained as one batched
    model, each kept as :func:`run_markov_trial` keeps it; ``{"outcomes": [...]}`` in the batch's order."""
    trials = batch.trials

    def run(indices: list[int]) -> list[dict]:
        start = time.process_time()
        runs = [trials[index].run() for index in indices]
        results = train_runs(runs, batched=True)
        for result in results:  # the batch's process time, shared among its runs
            result["cpu_seconds"] = (time.process_time() - start) / len(results)
        configs = [_shared_backbone(trials[index].config, trials[index].seed)[0] for index in indices]
        return [{"result": result, "model_config": dt_config_dict(model_config)}
                for result, model_config in zip(results, configs)]  # fmt: skip

    paths, keys = [trial.result_path() for trial in trials], [trial.key() for trial in trials]
    return {"outcomes": reuse_or_run_batch(paths, keys, run)}


def _batch_size(config: MarkovConfig, trials: Sequence[MarkovTrial]) -> int:
    """``--batch-runs`` as a number of runs; ``auto`` measures steps of fresh runs of the first trial's shape on a
    small dataset (:func:`~icrl_models.lifecycle.measure_batch_runs`)."""
    if config.batch_runs != "auto" or len(trials) < 2:
        return 1 if config.batch_runs == "auto" else config.batch_runs
    trial = trials[0]
    small = dataclasses.replace(config, num_histories=max(2, len(make_task(trial.task, config, trial.corridor_length)
                                                                 .task_ids)), episodes_per_history=2,
                                analysis_windows=8, progress=False)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="icrl-batch-probe-") as folder:

        def make_runs(count: int) -> list[MarkovRun]:
            probe = dataclasses.replace(small, out_dir=f"{folder}/{count}")
            return [MarkovTrial(probe, seed, trial.task, trial.corridor_length, trial.k).run(quiet=True)
                    for seed in range(count)]  # fmt: skip

        return measure_batch_runs(make_runs, resolve_device(config.device), runs=len(trials),
                                  share=sweep_options(config).trials_at_once(len(trials)))  # fmt: skip


def output_stem(config: MarkovConfig) -> str:
    """``markov-memory`` when every task is a cue task (``--preset memory``), else ``markov``."""
    return "markov-memory" if all(task in CUE_TASKS for task in config.tasks) else "markov"


def _run_experiment(config: MarkovConfig, command: str | None) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    out_dir = run_folder(config.out_dir)
    device = resolve_device(config.device)
    stem, machine = output_stem(config), machine_description(device)
    report: dict = {"config": dataclasses.asdict(config), "model_config": None, "device": str(device),
                    "torch_threads": torch.get_num_threads(), "complete": False, "results": []}  # fmt: skip

    def times() -> dict:
        # On a CPU shared with other jobs the wall time overstates the cost; this is this process's CPU time.
        return {"wall_seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start}

    trials = [MarkovTrial(config, seed, task_name, corridor_length, k)
              for seed in config.seed_list() for task_name, corridor_length, k in config.runs()]  # fmt: skip
    finished: list[dict | None] = [None] * len(trials)

    def record(index: int, outcome: dict) -> None:
        finished[index] = outcome["result"]
        report["model_config"] = outcome["model_config"]
        report["results"] = [result for result in finished if result is not None]  # in run order
        # The raw results so far, before any summary: a later crash (or a NaN) loses no finished run.
        write_results(out_dir, stem, {**report, **times()}, None, command=command, machine=machine)

    run_trial_batches(trials, run_markov_trial, run_markov_batch, sweep_options(config),
                      batch_runs=_batch_size(config, trials), key=MarkovTrial.shape, name=stem, storage=out_dir / "ray",
                      on_outcome=record)  # fmt: skip
    results = report["results"]
    report.update(summary=summarize(results), memory_pairs=memory_pairs(results), complete=True, **times())
    files = [f"{stem}.json", f"{stem}.md"]
    files += ["markov.png"] if any(r["corridor_length"] is None for r in results) else []
    files += ["markov-memory.png"] if any(r["corridor_length"] is not None for r in results) else []
    report["files"] = files
    write_results(out_dir, stem, report, None, command=command, machine=machine)  # the summary before any table
    write_results(out_dir, stem, report, format_tables(report), command=command, machine=machine)
    if "markov.png" in files:
        plot_markov(grid_view(report), out_dir / "markov.png")
    if "markov-memory.png" in files:
        plot_memory(report, out_dir / "markov-memory.png")
    return report


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
    print("wrote " + ", ".join(str(out_dir / name) for name in report["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
