"""Many runs, one program: train K runs that share a model shape as one batched model.

A sweep (``icrl-compare``) is hundreds of small runs. One such run leaves a GPU idle most of each step (its
step is bound by the host's launches), and a 2-core CPU spends most of a tiny model's step in Python. Here K
runs become one program whose every launch does K runs' work:

* **Stacked parameters.** Each run builds its own model exactly as ``icrl-train`` would (same seed, same
  initialisation); :class:`StackedRuns` keeps run ``k``'s parameters as row ``k`` of one flat ``[K, P]``
  parameter and computes with the *existing* model code: ``torch.func.vmap`` over the runs of
  ``torch.func.functional_call`` of one template model. There is no second copy of the architecture. Ops
  take the run dimension as more batch rows (the n-gram kernels' vmap rule,
  :func:`icrl_kernels._library.fold_vmap_into_batch`; SDPA's own on CUDA).
* **Per-run everything else.** Each run keeps its seed and data stream (the windows its single run would
  draw, from its own ``numpy`` generator), learning rate and schedule, weight decay, betas, gradient clipping
  (its own norm), residual and embedding dropout rates (:class:`RunDropout`), label smoothing, optimiser state
  (:class:`RunAdamW`), run folder, ``checkpoint.pt``, ``metrics.jsonl`` and evaluation (``eval.json`` /
  ``eval.png``), in the formats of ``icrl-train``: a batched run's folder is a run folder like any other
  (reports, ``--reuse-results`` and resuming, alone or in another batch, all read it).
* **One graph.** The whole step (forward, backward, per-run clipping, per-run AdamW, the learning rates
  coming in with the batch) reads no device value on the host, so on CUDA ``--cuda-graph`` captures it in one
  CUDA graph (:class:`~icrl_models.cuda_graphs.StepRunner`).
* **Batched evaluation.** The in-context rollouts of all K models step together: one vmapped decoding step
  for every run's environments, then each run's action choice with its own generator, so a run draws the
  actions it would draw alone. The references (source algorithm, random policy) are computed once per
  distinct set of evaluation tasks.

Which runs can share a batch (:func:`batch_key`): those equal in every :class:`~icrl_models.train.TrainConfig`
field outside :data:`PER_RUN_FIELDS`, i.e. the same model shape (model kind, width, heads, layers, n-gram
sizes, sequence length, pre-/qk-norm, ...), environment, steps and batch size. :func:`group_runs` splits a list
of runs into such batches.

Equivalence: a run trained in a batch matches the same run trained alone (the same windows in the same
order, losses equal to fp32 rounding), except for dropout: a batch draws its dropout masks from one shared
stream, so with dropout on, a run's masks (and so its losses) differ from its single run's (the rates are
the run's own). Models: ``ad`` and ``ngram_ad``. ``headless_ad`` is not supported (its per-step random action
map would need a per-run map through the fused InfoNCE op); such runs train alone.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree
from tqdm.auto import tqdm

from .checkpoint import CheckpointError, load_checkpoint
from .cuda_graphs import StepRunner, pinned, use_cuda_graph
from .data import HistoryWindows, LearningHistories, generate_histories, local_action_batch
from .evaluate import EvalReport, make_report, reference_returns, rollout_runs
from .files import JsonLines, remove_partial_files, write_json
from .models.ad import choose_actions
from .nonfinite import NonFiniteGuard
from .runtime import Tracker, torch_threads
from .train import (
    Distributed,
    TrainConfig,
    _trim_metrics,
    evaluation_settings,
    finished_summary,
    learning_rate_at,
    load_or_generate,
    metric_row,
    record_evaluation,
    run_identity,
    run_loss,
    write_checkpoint,
)

#: :class:`~icrl_models.train.TrainConfig` fields that may differ between the runs of one batch; every other
#: field (the model's shape, the environment, steps, batch size, device, evaluation length...) must be equal.
PER_RUN_FIELDS = (
    "data", "num_histories", "num_train_tasks", "source_episodes", "seed", "out_dir",
    "learning_rate", "weight_decay", "beta1", "beta2", "warmup_steps", "grad_clip",
    "embedding_dropout", "residual_dropout", "label_smoothing", "episode_subsample",
    "eval_tasks", "eval_envs_per_task", "eval_distribution", "eval_num_arms", "eval_action_set", "sample_actions",
    "checkpoint_every", "log_every",
)  # fmt: skip
# On a CPU, SDPA's flash kernel has no vmap rule: vmap runs it once per run (and says so). In a rough A/B on
# the shared 2-core VM (K = 4, N-Gram AD width 64, contexts 100 and 200; other jobs running) that per-run loop
# was faster per step than the math kernel vmap batches, and it is the single run's own kernel: the warning
# is left out.
warnings.filterwarnings(
    "ignore", message=r".*batching rule for aten::_scaled_dot_product_flash_attention_for_cpu", category=UserWarning
)

#: Model kinds a batch can train.
BATCHED_MODELS = ("ad", "ngram_ad")
#: The batch tensors a training step reads (the rest of a windows batch stays on the host).
_STEP_KEYS = ("states", "actions", "prev_actions", "prev_rewards", "mask", "action_set")
#: ``--batch-runs auto`` on a CPU: runs per batch. A CPU step costs about K times a run's compute, so larger
#: batches gain little once Python's per-op overhead is shared, and only delay every run's result.
CPU_AUTO_BATCH = 4
#: ``--batch-runs auto`` on CUDA: at most this many runs per batch, and at most this fraction of the free
#: device memory, measured per run (:func:`auto_batch_runs`).
CUDA_MAX_AUTO_BATCH = 256
CUDA_MEMORY_FRACTION = 0.7


# -- which runs batch together ------------------------------------------------------------------------------
def batch_key(config: TrainConfig) -> tuple:
    """What runs of one batch share: every field of ``config`` outside :data:`PER_RUN_FIELDS`, as a hashable
    tuple. Runs with equal keys can train as one batch (the data they load must also give equal model sizes,
    which :func:`train_batched` checks)."""
    return tuple(
        (field.name, json.dumps(getattr(config, field.name)))
        for field in dataclasses.fields(config)
        if field.name not in PER_RUN_FIELDS
    )


def group_runs(configs: Sequence[TrainConfig], batch_runs: int) -> list[list[int]]:
    """Indices of ``configs`` in batches of at most ``batch_runs`` runs with equal :func:`batch_key`, each
    batch in the order of its runs and the batches in the order of their first runs. Runs that cannot be
    batched (:data:`BATCHED_MODELS`, ``--compile``, trackers) are batches of one."""
    batch_runs = _check_batch_runs(batch_runs)
    groups: dict[tuple, list[list[int]]] = {}
    batches: list[list[int]] = []
    for index, config in enumerate(configs):
        if batchable(config) is not None:
            batches.append([index])
            continue
        open_batches = groups.setdefault(batch_key(config), [])
        if not open_batches or len(open_batches[-1]) == batch_runs:
            open_batches.append([])
            batches.append(open_batches[-1])
        open_batches[-1].append(index)
    return batches


def batchable(config: TrainConfig) -> str | None:
    """None if ``config``'s run can train inside a batch, else why not (one phrase)."""
    if config.model not in BATCHED_MODELS:
        return f"model {config.model!r} trains alone (batched: {', '.join(BATCHED_MODELS)})"
    if config.compile:
        return "compile traces one model's forward (batched runs use --cuda-graph on CUDA instead)"
    if config.track:
        return "track logs one run per process (batched runs write metrics.jsonl only)"
    return None


def _check_batch_runs(batch_runs: int) -> int:
    if isinstance(batch_runs, bool) or not isinstance(batch_runs, int) or batch_runs < 1:
        raise ValueError(f"batch_runs must be an int >= 1, got {batch_runs!r}")
    return batch_runs


def check_batch(configs: Sequence[TrainConfig]) -> list[TrainConfig]:
    """``configs`` as a list, checked to form one batch: TrainConfigs that can be batched (:func:`batchable`),
    with distinct run folders and equal :func:`batch_key`; a ``ValueError`` / ``TypeError`` naming the
    problem (the first field that differs)."""
    configs = list(configs)
    if not configs:
        raise ValueError("configs must hold at least one run")
    for config in configs:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"configs must be TrainConfig objects, got {type(config).__name__}")
        reason = batchable(config)
        if reason is not None:
            raise ValueError(f"{config.out_dir} cannot train in a batch: {reason}")
    folders = [os.path.abspath(config.out_dir) for config in configs]
    if len(set(folders)) != len(folders):
        raise ValueError("configs must have distinct out_dir: each run writes its own folder")
    first = batch_key(configs[0])
    for config in configs[1:]:
        differ = [name for (name, a), (_, b) in zip(first, batch_key(config)) if a != b]
        if differ:
            raise ValueError(
                f"runs of one batch must share {differ[0]} (it shapes the batched model or its loop): "
                f"{configs[0].out_dir} and {config.out_dir} differ; group them with group_runs"
            )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("batched runs do not support data-parallel runs (torchrun): run them in one process")
    return configs


# -- the batched model ---------------------------------------------------------------------------------------
class RunDropout(nn.Module):
    """Dropout whose rate is a buffer, so that each run of a batch keeps its own (:class:`StackedRuns` stacks
    it like any buffer). In training, ``x * keep / (1 - rate)`` with ``keep`` drawn per element; a rate of 0
    returns ``x`` unchanged. Evaluation: the identity."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.register_buffer("rate", torch.tensor(float(rate)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = 1 - self.rate
        return x * (torch.rand_like(x) < keep).to(x.dtype) / keep.to(x.dtype)


class _Call(nn.Module):
    """``functional_call`` target running any function of the wrapped model: ``forward(function, *args)`` is
    ``function(model, *args)`` with the parameters and buffers ``functional_call`` supplies."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, function: Callable, *args):
        return function(self.model, *args)


def _without_tensors(model: nn.Module) -> nn.Module:
    """``model`` with every parameter and buffer slot emptied (set to None, in place): the structure and code of
    the architecture, holding no values (``functional_call`` supplies them, per run)."""
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name in slots:
                slots[name] = None
    return model


class StackedRuns(nn.Module):
    """K models of one architecture as one module, computing with the models' own code.

    Run ``k``'s parameters are row ``k`` of the flat parameter ``flat [K, P]`` (one gradient tensor for all runs,
    so per-run gradient norms and AdamW are a few whole-tensor ops); its buffers are stacked ``[K, ...]``, and
    each ``nn.Dropout`` becomes a :class:`RunDropout` with the run's own rate (its model's dropout ``p``), or
    the identity where every run's rate is 0. :meth:`map` runs ``function(model, *args)`` for all runs at
    once: ``torch.func.vmap`` over ``functional_call`` of :attr:`template`, the architecture without values.

    Args:
        models: the runs' models, all of one class with equal parameter names and shapes; their current values
            become the runs' starting values (the models themselves are not used afterwards).
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        models = list(models)
        if not models:
            raise ValueError("models must hold at least one model")
        first = models[0]
        self._shapes = [(name, tuple(p.shape)) for name, p in first.named_parameters()]
        for model in models[1:]:
            shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
            if type(model) is not type(first) or shapes != self._shapes:
                raise ValueError("models must share one architecture (class, parameter names and shapes)")
        self.count = len(models)
        self._sizes = [int(np.prod(shape)) for _, shape in self._shapes]
        with torch.no_grad():
            self.flat = nn.Parameter(torch.stack([torch.cat([p.reshape(-1) for p in m.parameters()]) for m in models]))
        #: ``models[k].state_dict()``'s keys, in order: the parameters and the persistent buffers.
        self._state_names = list(first.state_dict().keys())
        template = copy.deepcopy(first)
        for name, module in list(template.named_modules()):
            if isinstance(module, nn.Dropout):
                rates = [model.get_submodule(name).p for model in models]
                template.set_submodule(name, RunDropout(rates[0]) if any(rates) else nn.Identity())
        self._buffer_names = []
        for name, _ in template.named_buffers():
            owner, _, leaf = name.rpartition(".")
            if isinstance(template.get_submodule(owner), RunDropout):
                stacked = torch.tensor([model.get_submodule(owner).p for model in models])
            else:
                stacked = torch.stack([model.get_buffer(name).detach().clone() for model in models])
            self.register_buffer(self._buffer_attribute(name), stacked, persistent=True)
            self._buffer_names.append(name)
        # A submodule like any other: it holds no tensor (the runs' values come with every map() call), so it
        # adds nothing to parameters(), state_dict() or a move between devices.
        self.call = _Call(_without_tensors(template))

    @staticmethod
    def _buffer_attribute(name: str) -> str:
        return "stacked__" + name.replace(".", "__")

    @property
    def template(self) -> nn.Module:
        """The model code the runs share: the architecture, without parameter or buffer values."""
        return self.call.model

    def parameter_views(self) -> dict[str, torch.Tensor]:
        """Each parameter of every run, ``name -> [K, *shape]``: views of :attr:`flat` (gradients flow into it)."""
        pieces = self.flat.split(self._sizes, dim=1)
        return {name: piece.view(self.count, *shape) for (name, shape), piece in zip(self._shapes, pieces)}

    def buffer_views(self) -> dict[str, torch.Tensor]:
        """Each buffer of every run, ``name -> [K, ...]``."""
        return {name: getattr(self, self._buffer_attribute(name)) for name in self._buffer_names}

    def map(self, function: Callable, *args, randomness: str = "different"):
        """``function(model, *row_k_of_args)`` for every run ``k`` at once, its outputs stacked along a new
        leading run dimension. ``args``: tensors, or pytrees of them (lists, tuples, dicts, decoding states),
        with the runs along dimension 0; constants go in ``function``'s closure. ``randomness``: as
        ``torch.func.vmap``'s (each run draws its own dropout masks by default)."""
        named = {f"model.{name}": value for name, value in {**self.parameter_views(), **self.buffer_views()}.items()}

        def one(tensors, *row):
            return torch.func.functional_call(self.call, tensors, (function, *row))

        return torch.func.vmap(one, randomness=randomness)(named, *args)

    def run_state_dict(self, run: int) -> dict[str, torch.Tensor]:
        """What run ``run``'s own model's ``state_dict()`` would hold now (copies, on this module's device)."""
        values = {**self.parameter_views(), **self.buffer_views()}
        return {name: values[name][run].detach().clone() for name in self._state_names}

    @torch.no_grad()
    def init_decode_state(self, batch: int, max_steps: int, **kwargs):
        """Every run's incremental-decoding state (its model's ``init_decode_state(batch, max_steps, **kwargs)``):
        one state whose tensors hold the runs along dimension 0, for :meth:`decode_step`."""
        state = self.map(lambda model: model.init_decode_state(batch, max_steps, **kwargs), randomness="error")
        # A tensor that no run's values entered comes back broadcast: give each run its own copy to write into.
        return pytree.tree_map(lambda tensor: tensor.contiguous(), state)

    @torch.no_grad()
    def decode_step(self, state, states_t, prev_actions_t, prev_rewards_t):
        """Every run's ``model.step`` at once: ``[K, B]`` inputs -> (``[K, B, A]`` logits, the updated ``state``)
        (from :meth:`init_decode_state`; its tensors hold the runs along dimension 0)."""

        def one(model, run_state, states, prev_actions, prev_rewards):
            logits = model.step(run_state, states, prev_actions, prev_rewards)
            return logits, run_state

        return self.map(one, state, states_t, prev_actions_t, prev_rewards_t, randomness="error")


class RunAdamW(torch.optim.Optimizer):
    """AdamW for the runs of :class:`StackedRuns`: one flat parameter ``[K, P]``, each row with its own weight
    decay, betas and step count; the learning rates come with each :meth:`step` (``[K]``, on the device).

    The update is torch's AdamW (decoupled weight decay, bias-corrected moments, ``eps`` outside the square
    root) row by row. Every value lives on the device and nothing is read on the host, so a step can be
    captured in a CUDA graph (``capturable=True``). The state is created at construction; a run's state moves
    to and from ``torch.optim.AdamW``'s ``state_dict`` format with :meth:`run_state_dict` /
    :meth:`load_run_state_dict`, so checkpoints are those of single runs.
    """

    #: Every value lives on the device: a CUDA graph can capture its step (cuda_graphs.GraphedTrainStep).
    graph_capturable = True

    def __init__(
        self,
        flat: torch.Tensor,
        *,
        weight_decay: Sequence[float],
        betas: Sequence[tuple[float, float]],
        eps: float = 1e-8,
    ) -> None:
        if not isinstance(flat, torch.Tensor) or flat.dim() != 2:
            raise ValueError("flat must be the [K, P] parameter of StackedRuns")
        runs = flat.shape[0]
        if len(weight_decay) != runs or len(betas) != runs:
            raise ValueError(f"weight_decay and betas must have one entry per run ({runs})")
        super().__init__([flat], {"capturable": True, "eps": eps})

        def column(values) -> torch.Tensor:
            # float64: the scalars and bias corrections are computed as torch's AdamW computes them (Python
            # floats), then rounded once to the parameters' dtype.
            return torch.tensor(list(values), dtype=torch.float64, device=flat.device)[:, None]

        group = self.param_groups[0]
        group["weight_decay"] = column(weight_decay)
        group["beta1"], group["beta2"] = column(b[0] for b in betas), column(b[1] for b in betas)
        # The runs' values as given (Python floats), for the state_dict of each run's AdamW.
        self.run_settings = [{"weight_decay": float(w), "betas": (float(b[0]), float(b[1]))}
                             for w, b in zip(weight_decay, betas)]  # fmt: skip
        self.state[flat] = {
            "step": torch.zeros(runs, dtype=torch.float32, device=flat.device),
            "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
        }

    @torch.no_grad()
    def step(self, learning_rates: torch.Tensor) -> None:  # type: ignore[override]
        """One AdamW step of every run with the learning rates ``[K]`` (a device tensor, read by no host)."""
        group = self.param_groups[0]
        flat = group["params"][0]
        state = self.state[flat]
        dtype = flat.dtype
        lr = learning_rates.to(torch.float64)[:, None]
        beta1, beta2 = group["beta1"], group["beta2"]
        step = state["step"].add_(1)[:, None].to(torch.float64)
        flat.mul_((1 - lr * group["weight_decay"]).to(dtype))
        state["exp_avg"].lerp_(flat.grad, (1 - beta1).to(dtype))
        state["exp_avg_sq"].mul_(beta2.to(dtype)).add_(flat.grad.square() * (1 - beta2).to(dtype))
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step).sqrt().to(dtype)).add_(group["eps"])
        flat.sub_((lr / (1 - beta1**step)).to(dtype) * state["exp_avg"] / denom)

    def run_state_dict(self, run: int, shapes: Sequence[tuple[str, tuple]], learning_rate: float) -> dict:
        """Run ``run``'s state as ``torch.optim.AdamW(model.parameters(), ...).state_dict()`` of a
        non-capturable AdamW would save it (what ``icrl-train`` checkpoints hold): one entry per parameter of
        ``shapes`` (``StackedRuns``' parameter names and shapes, in order), ``learning_rate`` the last one set."""
        group = self.param_groups[0]
        flat = group["params"][0]
        state = self.state[flat]
        settings = self.run_settings[run]
        reference = torch.optim.AdamW([torch.zeros(1)], lr=learning_rate, eps=group["eps"], **settings)
        reference = reference.state_dict()["param_groups"][0]
        sizes = [int(np.prod(shape)) for _, shape in shapes]
        moments = [state[name][run].split(sizes) for name in ("exp_avg", "exp_avg_sq")]
        step = state["step"][run].detach().to("cpu", torch.float32)
        per_param = {
            index: {"step": step.clone(), "exp_avg": m.view(shape).clone(), "exp_avg_sq": v.view(shape).clone()}
            for index, ((_, shape), m, v) in enumerate(zip(shapes, *moments))
        }
        return {"state": per_param, "param_groups": [{**reference, "params": list(range(len(shapes)))}]}

    def load_run_state_dict(self, run: int, state_dict: dict, shapes: Sequence[tuple[str, tuple]]) -> None:
        """Load run ``run``'s state from an AdamW ``state_dict`` of its single model (a checkpoint's)."""
        flat = self.param_groups[0]["params"][0]
        state = self.state[flat]
        per_param = state_dict.get("state", {})
        if sorted(per_param) != list(range(len(shapes))):
            raise CheckpointError(f"the optimizer state holds {len(per_param)} parameters, the model {len(shapes)}")
        with torch.no_grad():
            offset = 0
            for index, (name, shape) in enumerate(shapes):
                size = int(np.prod(shape))
                for key in ("exp_avg", "exp_avg_sq"):
                    value = per_param[index][key]
                    if tuple(value.shape) != shape:
                        raise CheckpointError(f"the optimizer's {key} of {name} has shape {tuple(value.shape)}")
                    state[key][run, offset : offset + size] = value.reshape(-1).to(flat.device, flat.dtype)
                offset += size
            state["step"][run] = float(per_param[0]["step"])


def clip_run_gradients(grad: torch.Tensor, max_norms: torch.Tensor) -> torch.Tensor:
    """Clip each run's gradient (row of ``grad [K, P]``) to its own norm ``max_norms [K]`` in place, as
    ``torch.nn.utils.clip_grad_norm_`` clips one run's; returns the norms before clipping ``[K]``."""
    norms = torch.linalg.vector_norm(grad, dim=1)
    grad.mul_((max_norms / (norms + 1e-6)).clamp(max=1.0)[:, None])
    return norms


def batched_train_step(
    runs: StackedRuns,
    optimizer: RunAdamW,
    batch: dict[str, torch.Tensor],
    label_smoothing: torch.Tensor,
    max_norms: torch.Tensor,
    autocast,
) -> torch.Tensor:
    """One optimiser step of every run on a device batch of :meth:`BatchedTrainer.next_batch` (``[K, B, ...]``
    windows and ``learning_rate [K]``): forward of all runs under ``autocast`` (:meth:`StackedRuns.map` of
    icrl-train's loss), backward, per-run gradient clipping and AdamW.

    Returns ``[K, 2]``: each run's ``[loss, grad_norm]`` (fp32, on the device). Reads no device value on the
    host: on CUDA the whole step can be one CUDA graph."""
    optimizer.zero_grad(set_to_none=True)
    runs_count, batch_size = batch["states"].shape[:2]
    folded = local_action_batch({name: batch[name].flatten(0, 1) for name in _STEP_KEYS})  # rows are independent
    windows = {name: value.unflatten(0, (runs_count, batch_size)) for name, value in folded.items()}
    with autocast:
        losses = runs.map(lambda model, rows, smoothing: run_loss(model, model, rows, smoothing), windows,
                          label_smoothing)  # fmt: skip
    losses.sum().backward()  # the runs' losses share no parameter: each row of flat.grad is its run's gradient
    grad_norms = clip_run_gradients(runs.flat.grad, max_norms)
    optimizer.step(batch["learning_rate"])
    return torch.stack([losses.detach().float(), grad_norms.float()], dim=1)


# -- training ------------------------------------------------------------------------------------------------
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


def train_batched(configs: Sequence[TrainConfig]) -> list[dict]:
    """Run (or resume) ``configs`` as one batch (:func:`check_batch`); returns each run's final evaluation
    summary, as :func:`~icrl_models.train.train` returns it.

    Each run resumes from its own ``checkpoint.pt`` (written alone or in any batch); runs at different steps
    train as consecutive batches, and a finished run returns its stored evaluation (no training, no second
    evaluation row)."""
    configs = check_batch(configs)
    with torch_threads(configs[0].threads):
        trainer = BatchedTrainer(configs)
        return trainer.train()


@dataclass
class _Run:
    """What the trainer keeps of one run: its config, data and random streams, log file and progress."""

    config: TrainConfig
    histories: LearningHistories
    windows: HistoryWindows
    model: nn.Module
    rng: np.random.Generator
    torch_state: torch.Tensor
    step: int = 0
    #: The checkpoint it resumed from (None: a fresh run), its open ``metrics.jsonl`` and last log point.
    payload: dict | None = None
    metrics: object = None
    last_log: tuple = (0, 0.0)


class BatchedTrainer:
    """Trains the runs of one batch (see the module docstring); :func:`train_batched` is the entry point."""

    def __init__(self, configs: Sequence[TrainConfig]) -> None:
        self.configs = list(configs)
        shared = self.configs[0]
        self.ddp = Distributed(shared.device)  # one process (check_batch refused torchrun)
        self.device = self.ddp.device
        self.graphed = use_cuda_graph(shared.cuda_graph, self.device)
        self.start_time = time.perf_counter()
        self.learning_rates: list[float] = []  # each run's at the last step, for its log rows and checkpoint
        self.runs = self._load_runs()

    def _load_runs(self) -> list[_Run]:
        """Each run's folder, data, windows, model (initialised as its single run would be) and checkpoint."""
        histories_by_path: dict[str, LearningHistories] = {}
        windows_by_key: dict[tuple, HistoryWindows] = {}
        runs = []
        for config in self.configs:
            run_dir = Path(config.out_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            remove_partial_files(run_dir)  # of writes a killed run left unfinished
            write_json(run_dir / "config.json", dataclasses.asdict(config))
            path = str(Path(config.data if config.data is not None else run_dir / "train.icrl").resolve())
            if path not in histories_by_path:
                histories_by_path[path] = load_or_generate(config, run_dir, self.ddp)
            histories = histories_by_path[path]
            key = (path, config.seq_len, config.episode_subsample)
            if key not in windows_by_key:  # runs on the same data share one index of windows
                windows = HistoryWindows(histories, config.seq_len, episode_subsample=config.episode_subsample)
                windows_by_key[key] = windows
            torch.manual_seed(config.seed)
            model = config.build_model(histories)
            run = _Run(config, histories, windows_by_key[key], model, np.random.default_rng([config.seed, 0]),
                       torch.get_rng_state())  # fmt: skip
            checkpoint = run_dir / "checkpoint.pt"
            if checkpoint.exists():
                run.payload = load_checkpoint(checkpoint, expect_config=run_identity(config))
                model.load_state_dict(run.payload["model"])
                run.rng.bit_generator.state = run.payload["rng"]["numpy"][0]
                run.torch_state = run.payload["rng"]["torch"]
                run.step = int(run.payload["step"])
            runs.append(run)
        # The dropout rates are the runs' own (RunDropout); every other model setting must agree.
        sizes = {dataclasses.astuple(dataclasses.replace(run.model.config, embedding_dropout=0.0, residual_dropout=0.0))
                 for run in runs}  # fmt: skip
        if len(sizes) > 1:
            raise ValueError(
                "runs of one batch must have equal model sizes, but their data give different ones "
                f"(environment sizes, action sets): {[run.model.config for run in runs]}"
            )
        return runs

    def train(self) -> list[dict]:
        summaries: list[dict | None] = [None] * len(self.runs)
        pending = []
        for index, run in enumerate(self.runs):
            _trim_metrics(Path(run.config.out_dir) / "metrics.jsonl", run.step)
            summaries[index] = finished_summary(run.config, run.step)
            if summaries[index] is None:
                pending.append(index)
        for step in sorted({self.runs[index].step for index in pending}):  # runs resumed at one step train together
            together = [index for index in pending if self.runs[index].step == step]
            for index, summary in zip(together, self._train_together([self.runs[i] for i in together])):
                summaries[index] = summary
        return summaries  # type: ignore[return-value]

    def step_runner(self, runs: list[_Run]) -> tuple[StackedRuns, RunAdamW, StepRunner]:
        """The batched model of ``runs`` (from their models, which it replaces), its optimiser (with the runs'
        checkpointed states) and the runner of one training step (``run_step(next_batch(...)) -> [K, 2]``,
        graphed with ``cuda_graph`` on CUDA, watched by :attr:`guard`): what the training loop (and
        ``benchmarks/bench_sweep.py``) steps."""
        device = self.device
        if device.type == "cuda" and runs[0].payload is not None and "cuda" in runs[0].payload["rng"]:
            torch.cuda.set_rng_state(runs[0].payload["rng"]["cuda"], device)  # the batch's dropout stream
        stacked = StackedRuns([run.model for run in runs]).to(device)
        configs = [run.config for run in runs]
        optimizer = RunAdamW(stacked.flat, weight_decay=[c.weight_decay for c in configs],
                             betas=[(c.beta1, c.beta2) for c in configs])  # fmt: skip
        for index, run in enumerate(runs):
            if run.payload is not None:
                optimizer.load_run_state_dict(index, run.payload["optimizer"], stacked._shapes)
            run.model = None  # its values now live in the stacked parameter
        label_smoothing = torch.tensor([c.label_smoothing for c in configs], device=device)
        max_norms = torch.tensor([c.grad_clip for c in configs], device=device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        # Each run's first non-finite step, on the device; read where the loop reads the host anyway.
        self.guard = NonFiniteGuard(stacked, optimizer, policy=configs[0].nonfinite, step=runs[0].step,
                                    runs=len(runs), run_names=[run.config.out_dir for run in runs])  # fmt: skip
        for index, run in enumerate(runs):
            if run.payload is not None:
                self.guard.saved(Path(run.config.out_dir) / "checkpoint.pt", run.step, run=index)
        run_step = StepRunner(
            lambda batch: batched_train_step(stacked, optimizer, batch, label_smoothing, max_norms, autocast),
            stacked, optimizer, device, cuda_graph=self.graphed, fallback=configs[0].cuda_graph == "auto",
            guard=self.guard,
        )  # fmt: skip
        return stacked, optimizer, run_step

    def _train_together(self, runs: list[_Run]) -> list[dict]:
        shared = runs[0].config
        device = self.device
        configs = [run.config for run in runs]
        stacked, optimizer, run_step = self.step_runner(runs)
        step = runs[0].step
        self.learning_rates = [learning_rate_at(max(step - 1, 0), c) for c in configs]
        tracker = Tracker((), Path(shared.out_dir), {})  # batched runs track nothing (batchable)
        for run in runs:
            run.metrics = JsonLines(Path(run.config.out_dir) / "metrics.jsonl")
            run.last_log = (step, time.perf_counter())
        bar = tqdm(total=shared.steps, initial=step, desc=f"train {len(runs)} {shared.model} runs",
                   disable=not shared.progress)  # fmt: skip
        if step == 0:
            size = sum(stacked._sizes)
            print(f"{shared.model}: {len(runs)} runs of {size:,} parameters as one batch", file=sys.stderr)
        stacked.train()
        try:
            while step < shared.steps:
                self.learning_rates = [learning_rate_at(step, c) for c in configs]
                stats = run_step(self.next_batch(runs, self.learning_rates))
                step += 1
                bar.update(1)
                self.on_step(runs, step, stats)
                saving = [index for index, run in enumerate(runs)
                          if step % run.config.checkpoint_every == 0 or step == shared.steps]  # fmt: skip
                if saving:
                    self.guard.check()  # never a checkpoint of a diverged run over its last good one
                for index in saving:
                    self._checkpoint(stacked, optimizer, index, runs[index], step)
                if shared.eval_every and step % shared.eval_every == 0 and step < shared.steps:
                    self.guard.check()
                    for run, report in zip(runs, evaluate_runs(stacked, runs, device, progress=shared.progress)):
                        run.metrics.write({"step": step, "eval": report.summary})
                    stacked.train()
            bar.close()
            self.guard.check()
            summaries = []
            for run, report in zip(runs, evaluate_runs(stacked, runs, device, progress=shared.progress)):
                summaries.append(record_evaluation(report, run.config, step, run.metrics, tracker, self.start_time))
        finally:
            for run in runs:
                run.metrics.close()
            tracker.close()
        return summaries

    def next_batch(self, runs: list[_Run], learning_rates: Sequence[float]) -> dict[str, torch.Tensor]:
        """The step's batch: each run's ``batch_size`` windows, drawn from its own generator exactly as its
        single run draws them (``[K, B, ...]`` tensors of the keys a step reads), and ``learning_rate [K]``;
        in pinned memory on CUDA. Runs on the same data and windows are gathered in one call."""
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
        batch = {name: torch.stack([row[name] for row in rows]) for name in _STEP_KEYS}
        batch["learning_rate"] = torch.tensor(learning_rates, dtype=torch.float64)  # as exact as AdamW's float lr
        return pinned(batch, self.device)

    def on_step(self, runs: list[_Run], step: int, stats: torch.Tensor) -> None:
        """Called after every optimiser step with its per-run statistics ``stats [K, 2]`` (loss, gradient norm
        before clipping; fp32, on the device, not read on the host here): each run's ``metrics.jsonl`` row
        every ``log_every`` steps of its own (one host read for all runs). A check of every step's statistics
        (e.g. stopping runs whose loss is not finite) belongs here."""
        due = [index for index, run in enumerate(runs) if step % run.config.log_every == 0 or step == run.config.steps]
        if not due:
            return
        self.guard.check()  # a diverged run ("stop") ends the batch here, before a NaN row is written
        values = stats.tolist()  # the host read, at log points only
        for index in due:
            run = runs[index]
            loss, grad_norm = values[index]
            record, run.last_log = metric_row(step, loss, self.learning_rates[index], grad_norm, run.last_log,
                                              self.start_time)  # fmt: skip
            run.metrics.write(record)

    def _checkpoint(self, stacked: StackedRuns, optimizer: RunAdamW, index: int, run: _Run, step: int) -> None:
        rng = {"numpy": [run.rng.bit_generator.state], "torch": run.torch_state}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        optimizer_state = optimizer.run_state_dict(index, stacked._shapes, self.learning_rates[index])
        run.metrics.sync()  # the rows up to this step are on disk before the checkpoint refers to them
        path = Path(run.config.out_dir) / "checkpoint.pt"
        write_checkpoint(path, step, run_identity(run.config), stacked.run_state_dict(index), optimizer_state, rng)
        self.guard.saved(path, step, run=index)


# -- evaluation ----------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_runs(
    stacked: StackedRuns, runs: Sequence[_Run], device: torch.device, *, progress: bool
) -> list[EvalReport]:
    """Each run's in-context evaluation, as :func:`~icrl_models.train.run_evaluation` does it alone (seed
    ``config.seed + 1``, its own tasks, source and sampling), with every run's environments stepped together:
    one decoding step of all models (:meth:`StackedRuns.decode_step`), then each run's choice with its own
    generator. The references are computed once per distinct evaluation."""
    stacked.eval()
    configs = [run.config for run in runs]
    settings = [evaluation_settings(run.config, run.histories) for run in runs]
    seeds = [config.seed + 1 for config in configs]
    envs = [setting["make_env"](seed) for setting, seed in zip(settings, seeds)]
    num_episodes = configs[0].eval_episodes
    sizes = [env.num_envs for env in envs]
    width = max(sizes)
    state = stacked.init_decode_state(width, num_episodes * max(env.episode_length for env in envs))
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    available = [
        stacked.template.head_availability(torch.from_numpy(env.action_sets()).to(device) >= 0) for env in envs
    ]

    def act(states, prev_actions, prev_rewards, active):
        nonlocal state
        logits, state = stacked.decode_step(state, states, prev_actions, prev_rewards)
        actions = torch.zeros(logits.shape[:2], dtype=torch.long, device=device)
        for run, size in enumerate(sizes):
            if active[run]:
                actions[run, :size] = choose_actions(logits[run, :size], available[run], settings[run]["sample"],
                                                     generators[run], configs[run].select_tau)  # fmt: skip
        return actions

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


# -- sweeps --------------------------------------------------------------------------------------------------
def auto_batch_runs(config: TrainConfig, *, share: int = 1) -> int:
    """``--batch-runs auto``: how many runs like ``config`` one batch takes on its device. On a CPU
    :data:`CPU_AUTO_BATCH`. On CUDA: a batched step of 1 and of 2 fresh runs (on a small generated dataset)
    measures the device memory one more run takes; the batch fills :data:`CUDA_MEMORY_FRACTION` of the free
    memory divided by ``share`` (batches training at once, e.g. worker processes), at most
    :data:`CUDA_MAX_AUTO_BATCH` runs."""
    device = Distributed(config.device).device
    if device.type != "cuda":
        return CPU_AUTO_BATCH
    peaks = []
    for runs in (1, 2):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _probe_step(config, runs, device)
        peaks.append(torch.cuda.max_memory_allocated(device) - before)
    torch.cuda.empty_cache()  # the probe's memory back to the device, for the batches (maybe other processes)
    per_run = max(peaks[1] - peaks[0], 1)
    budget = CUDA_MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0] / max(1, share)
    return int(max(1, min(CUDA_MAX_AUTO_BATCH, (budget - peaks[0]) // per_run + 1)))


def _probe_step(config: TrainConfig, runs: int, device: torch.device) -> None:
    """One batched training step of ``runs`` freshly initialised models like ``config``'s on windows of a
    small generated dataset (two histories of two episodes: the model's sizes, not its data, matter here)."""
    histories = generate_histories(config.generate_config("train", 2, 2), progress=False)
    models = [config.build_model(histories) for _ in range(runs)]
    stacked = StackedRuns(models).to(device)
    optimizer = RunAdamW(stacked.flat, weight_decay=[0.0] * runs, betas=[(0.9, 0.99)] * runs)
    windows = HistoryWindows(histories, config.seq_len)
    rows = windows.get_batch(np.arange(config.batch_size) % len(windows))
    batch = {name: rows[name][None].expand(runs, *rows[name].shape).to(device) for name in _STEP_KEYS}
    batch["learning_rate"] = torch.zeros(runs, dtype=torch.float64, device=device)
    zeros = torch.zeros(runs, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    batched_train_step(stacked, optimizer, batch, zeros, zeros + 1, autocast)


def run_batch(batch: RunBatch) -> dict:
    """A sweep trial made of several runs (:class:`RunBatch`): train them as one batch; ``{"summaries": [...]}``
    in the runs' order (each as :func:`~icrl_models.train.train` returns it). Module-level, so that worker
    processes and Ray import it by name."""
    configs = [dataclasses.replace(config, threads=batch.threads) for config in batch.configs]
    return {"summaries": train_batched(configs)}


__all__ = [
    "BATCHED_MODELS", "PER_RUN_FIELDS", "BatchedTrainer", "RunAdamW", "RunBatch", "RunDropout", "StackedRuns",
    "auto_batch_runs", "batch_key", "batchable", "batched_train_step", "check_batch", "clip_run_gradients",
    "evaluate_runs", "group_runs", "run_batch", "train_batched",
]  # fmt: skip
