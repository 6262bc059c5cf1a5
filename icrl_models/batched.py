"""Many runs, one program: train K runs that share a model shape as one batched model.

A sweep is hundreds of small runs. One such run leaves a GPU idle most of each step (its step is bound by the
host's launches), and a 2-core CPU spends most of a tiny model's step in Python. Here K runs become one program
whose every launch does K runs' work; :func:`icrl_models.lifecycle.train_runs` trains them (``--batch-runs`` of
``icrl-compare``, ``icrl-headless``, ``icrl-markov``, ``icrl-looped`` and ``icrl-induction``):

* **Stacked parameters.** Each run builds its own model exactly as its single run would (same seed, same
  initialisation); :class:`StackedRuns` keeps run ``k``'s parameters as row ``k`` of one flat ``[K, P]``
  parameter and computes with the *existing* model code: ``torch.func.vmap`` over the runs of
  ``torch.func.functional_call`` of one template, the architecture without values. There is no second copy of
  the architecture. The ops take the run dimension as more batch rows (or heads) through their vmap rules
  (``icrl_kernels``: n-gram attention, MoA gating, gated attention, the looped block, smeared keys, and SDPA's
  CPU flash kernel; SDPA's own on CUDA). Decoding states are pytrees, so a state of K models' decoders goes
  through ``vmap`` as it is.
* **Per-run everything else.** Each run keeps its seed and data stream, learning rate and schedule, weight
  decay (per parameter group), betas, gradient clipping (its own norm), dropout rates (:class:`RunDropout`),
  optimiser state (:class:`RunAdamW`, read from and written as the run's own ``torch.optim`` state), run folder,
  checkpoint, metrics and evaluation, in the formats of its single run: a batched run's folder is a run folder
  like any other (resuming alone or in another batch reads it).
* **One graph.** The whole step (forward, backward, per-run clipping, per-run AdamW, the learning rates coming
  in with the batch) reads no device value on the host, so on CUDA ``--cuda-graph`` captures it in one CUDA
  graph (:class:`~icrl_models.cuda_graphs.StepRunner`).

Which runs can share a batch (:func:`batch_key`): those equal in every config field outside the trainer's
per-run fields (the model's shape, the environment, steps, batch size...). :func:`group_runs` splits a list of
runs into such batches; ``--batch-runs auto`` measures how many runs a batch should hold (:func:`auto_batch_runs`).

Equivalence: a run trained in a batch matches the same run trained alone (the same batches in the same order,
losses equal to fp32 rounding), except for dropout: a batch draws its dropout masks from one shared stream, so
with dropout on, a run's masks (and so its losses) differ from its single run's (the rates are the run's own).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree


# -- which runs batch together ------------------------------------------------------------------------------
def batch_key(config, per_run_fields: Sequence[str]) -> tuple:
    """What runs of one batch share: every field of the dataclass ``config`` outside ``per_run_fields``, as a
    hashable tuple. Runs with equal keys can train as one batch."""
    return tuple(
        (field.name, json.dumps(getattr(config, field.name), default=str))
        for field in dataclasses.fields(config)
        if field.name not in per_run_fields
    )


def group_runs(
    configs: Sequence, batch_runs: int, *, per_run_fields: Sequence[str], batchable: Callable = lambda config: None
) -> list[list[int]]:
    """Indices of ``configs`` in batches of at most ``batch_runs`` runs with equal :func:`batch_key`, each
    batch in the order of its runs and the batches in the order of their first runs. Runs that cannot be
    batched (``batchable(config)`` says why, else None) are batches of one."""
    batch_runs = check_batch_runs(batch_runs)
    groups: dict[tuple, list[list[int]]] = {}
    batches: list[list[int]] = []
    for index, config in enumerate(configs):
        if batchable(config) is not None:
            batches.append([index])
            continue
        open_batches = groups.setdefault(batch_key(config, per_run_fields), [])
        if not open_batches or len(open_batches[-1]) == batch_runs:
            open_batches.append([])
            batches.append(open_batches[-1])
        open_batches[-1].append(index)
    return batches


def check_batch_runs(batch_runs: int) -> int:
    if isinstance(batch_runs, bool) or not isinstance(batch_runs, int) or batch_runs < 1:
        raise ValueError(f"batch_runs must be an int >= 1, got {batch_runs!r}")
    return batch_runs


def parse_batch_runs(value) -> int | str:
    """``--batch-runs``: an int >= 1 (a string of one) or ``"auto"``; a ``ValueError`` naming the flag otherwise."""
    if value == "auto":
        return "auto"
    try:
        number = int(value) if not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"batch_runs must be an int >= 1 or 'auto', got {value!r}")
    return number


#: ``--help`` of every trainer's ``--batch-runs``.
BATCH_RUNS_HELP = (
    "train up to K runs of one shape at once as one batched model, each with its own seed, data, hyperparameters, "
    "checkpoint, metrics and results; auto: K from a short measured probe of throughput (and memory on CUDA), "
    "1 where batching does not pay"
)


def check_batch(configs: Sequence, *, per_run_fields: Sequence[str], out_dir: Callable = lambda c: c.out_dir,
                batchable: Callable = lambda config: None) -> list:  # fmt: skip
    """``configs`` as a list, checked to form one batch: runs that can be batched (``batchable``), with distinct
    run folders and equal :func:`batch_key`; a ``ValueError`` naming the problem (the first field that differs)."""
    configs = list(configs)
    if not configs:
        raise ValueError("configs must hold at least one run")
    for config in configs:
        reason = batchable(config)
        if reason is not None:
            raise ValueError(f"{out_dir(config)} cannot train in a batch: {reason}")
    folders = [os.path.abspath(out_dir(config)) for config in configs]
    if len(set(folders)) != len(folders):
        raise ValueError("configs must have distinct out_dir: each run writes its own folder")
    first = batch_key(configs[0], per_run_fields)
    for config in configs[1:]:
        differ = [name for (name, a), (_, b) in zip(first, batch_key(config, per_run_fields)) if a != b]
        if differ:
            raise ValueError(
                f"runs of one batch must share {differ[0]} (it shapes the batched model or its loop): "
                f"{out_dir(configs[0])} and {out_dir(config)} differ; group them with group_runs"
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


class RunLinear(nn.Linear):
    """``nn.Linear`` as the runs of a batch compute it: the input flattened to rows and one ``addmm``, which torch's
    vmap rule makes one batched matrix product of every run's rows and one add of the runs' biases. (A Python
    vmap rule folding the bias into one ``baddbmm`` costs more host time per call than the pass it saves:
    benchmarks/results/README.md, "Sweep throughput on the CPU".)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        return torch.addmm(self.bias, rows, self.weight.t()).view(*x.shape[:-1], self.weight.shape[0])


class RunLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` as the runs of a batch compute it: the normalisation, then the affine in one ``addcmul``.
    Under ``vmap`` with each run's own weight and bias, ``F.layer_norm`` becomes the normalisation followed by a
    separate multiply and add (each a pass over the activations, forward and backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or self.bias is None:
            return super().forward(x)
        normed = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return torch.addcmul(self.bias, normed, self.weight)


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


#: Elements between the starts of the parameters in a row of :class:`StackedRuns`'s flat parameter, and of its rows:
#: 64 bytes of fp32: the CPU's batched matrix products are slower on weights at unaligned offsets
#: (benchmarks/results/README.md, "Sweep throughput on the CPU").
FLAT_ALIGNMENT = 16


def flat_layout(sizes: Sequence[int], alignment: int = FLAT_ALIGNMENT) -> tuple[list[int], int]:
    """Where parameters of ``sizes`` elements (in order) start in a row of a flat parameter, each at a multiple of
    ``alignment`` elements, and the row's length (a multiple of ``alignment``): ``(offsets, length)``. The gaps
    hold zeros that no parameter view covers (their gradient is 0, so they change no norm and no update)."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + int(size)
    return offsets, -(-end // alignment) * alignment


def flat_rows(runs: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Each run's tensors (one list per run, equal shapes across runs) laid out as one row of a ``[K, length]``
    tensor at the offsets of :func:`flat_layout` (zeros between them): :class:`StackedRuns`'s ``flat`` and the
    layout :meth:`RunAdamW.for_runs` reads. The dtype is the one ``torch.cat`` gives the tensors."""
    offsets, length = flat_layout([tensor.numel() for tensor in runs[0]])
    empty = torch.cat([tensor.reshape(-1)[:0] for tensor in runs[0]])
    rows = torch.zeros(len(runs), length, dtype=empty.dtype, device=empty.device)
    with torch.no_grad():
        for row, tensors in zip(rows, runs):
            for start, tensor in zip(offsets, tensors):
                row[start : start + tensor.numel()] = tensor.reshape(-1)
    return rows


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
        sizes = [int(np.prod(shape)) for _, shape in self._shapes]
        offsets, length = flat_layout(sizes)
        # One split of each row into gap, parameter, gap, parameter, ..., gap (autograd: one concatenation back).
        self._pieces, previous_end = [], 0
        for start, size in zip(offsets, sizes):
            self._pieces += [start - previous_end, size]
            previous_end = start + size
        self._pieces.append(length - previous_end)
        self.flat = nn.Parameter(flat_rows([list(model.parameters()) for model in models]))
        #: ``models[k].state_dict()``'s keys, in order: the parameters and the persistent buffers.
        self._state_names = list(first.state_dict().keys())
        template = copy.deepcopy(first)
        for name, module in list(template.named_modules()):
            if type(module) is nn.Linear:
                module.__class__ = RunLinear
            elif type(module) is nn.LayerNorm:
                module.__class__ = RunLayerNorm
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
        pieces = self.flat.split(self._pieces, dim=1)[1::2]
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
    """Adam / AdamW for the runs of :class:`StackedRuns`: one flat parameter ``[K, P]``, each row with its own
    weight decay (applied where ``decay_mask [P]`` is True: the run's parameter groups with a weight decay), betas
    and step count; the learning rates come with each :meth:`step` (``[K]``, on the device).

    The update is torch's AdamW (decoupled weight decay, bias-corrected moments, ``eps`` outside the square
    root) row by row; without weight decay it is torch's Adam too. Every value lives on the device and nothing is
    read on the host, so a step can be captured in a CUDA graph. :meth:`for_runs` builds it from each run's own
    ``torch.optim`` optimiser (its groups, hyperparameters and any state a checkpoint restored), and
    :meth:`run_state_dict` gives a run's state back as that optimiser's ``state_dict``: checkpoints are those of
    single runs.
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
        decay_mask: torch.Tensor | None = None,
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
        #: Where weight decay applies (None: everywhere), a bool ``[P]`` on the device.
        self.decay_mask = None if decay_mask is None or bool(decay_mask.all()) else decay_mask.to(flat.device)
        #: Per run: its own optimiser's ``param_groups`` (a state_dict's, with parameter indices) and, for each
        #: index, the parameter's slice of a row of ``flat``; set by :meth:`for_runs`.
        self.templates: list[tuple[list[dict], list[tuple[int, int, tuple]]]] = []
        self.state[flat] = {
            "step": torch.zeros(runs, dtype=torch.float32, device=flat.device),
            "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
        }

    @classmethod
    def for_runs(
        cls,
        flat: torch.Tensor,
        parameters: Sequence[Sequence[torch.Tensor]],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> RunAdamW:
        """The optimiser of the runs whose parameters (each run's list, in the order of ``flat``'s rows) have the
        ``torch.optim.Adam`` / ``AdamW`` ``optimizers``: each run's groups give its weight decay (where it
        applies), betas and eps, and its state (a resumed run's moments and step) becomes its row's."""
        if len(parameters) != flat.shape[0] or len(optimizers) != flat.shape[0]:
            raise ValueError(f"parameters and optimizers must have one entry per run ({flat.shape[0]})")
        decays, betas, epss, masks, templates = [], [], [], [], []
        for run, (params, optimizer) in enumerate(zip(parameters, optimizers)):
            if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
                raise TypeError(f"runs in a batch need torch.optim.Adam or AdamW, run {run} has "
                                f"{type(optimizer).__name__}")  # fmt: skip
            offsets, offset = flat_layout([param.numel() for param in params])  # StackedRuns's row layout
            slices = {id(param): (start, start + param.numel(), tuple(param.shape))
                      for start, param in zip(offsets, params)}  # fmt: skip
            groups = optimizer.param_groups
            decay = {float(g["weight_decay"]) for g in groups} - {0.0}
            special = any(g["amsgrad"] or g["maximize"] for g in groups)
            if len(decay) > 1 or (decay and type(optimizer) is torch.optim.Adam) or special:
                raise ValueError(f"run {run}: a batch takes one decoupled weight decay per run, no amsgrad/maximize")
            if len({tuple(g["betas"]) for g in groups}) > 1 or len({g["eps"] for g in groups}) > 1:
                raise ValueError(f"run {run}: a batch takes one pair of betas and one eps per run")
            mask = torch.zeros(offset, dtype=torch.bool)
            for group in groups:
                for param in group["params"]:
                    start, end, _ = slices[id(param)]
                    mask[start:end] = float(group["weight_decay"]) != 0.0
            decays.append(decay.pop() if decay else 0.0)
            betas.append(tuple(groups[0]["betas"]))
            epss.append(float(groups[0]["eps"]))
            masks.append(mask)
            order = [slices[id(param)] for group in groups for param in group["params"]]
            templates.append((copy.deepcopy(optimizer.state_dict()["param_groups"]), order))
        # Where weight decay applies: the same parameters in every run that has any (a run without decays none).
        decaying = [mask for mask, decay in zip(masks, decays) if decay != 0.0]
        if len(set(epss)) > 1 or any(not torch.equal(mask, decaying[0]) for mask in decaying):
            raise ValueError("runs of one batch must share eps and which parameters have weight decay")
        mask = decaying[0] if decaying else None
        optimizer = cls(flat, weight_decay=decays, betas=betas, eps=epss[0], decay_mask=mask)
        optimizer.templates = templates
        state = optimizer.state[flat]
        with torch.no_grad():
            for run, single in enumerate(optimizers):
                for param, (start, end, _) in zip([p for g in single.param_groups for p in g["params"]],
                                                  templates[run][1]):  # fmt: skip
                    saved = single.state.get(param)
                    if not saved:
                        continue
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key][run, start:end] = saved[key].reshape(-1).to(flat.device, flat.dtype)
                    state["step"][run] = float(saved["step"])
        return optimizer

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
        decay = (1 - lr * group["weight_decay"]).to(dtype)
        flat.mul_(decay if self.decay_mask is None else torch.where(self.decay_mask, decay, 1))
        state["exp_avg"].lerp_(flat.grad, (1 - beta1).to(dtype))
        state["exp_avg_sq"].mul_(beta2.to(dtype)).add_(flat.grad.square() * (1 - beta2).to(dtype))
        denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step).sqrt().to(dtype)).add_(group["eps"])
        flat.sub_((lr / (1 - beta1**step)).to(dtype) * state["exp_avg"] / denom)

    def run_state_dict(self, run: int, learning_rate: float) -> dict:
        """Run ``run``'s state as its own (non-capturable) optimiser's ``state_dict()`` would hold it now, with
        ``learning_rate`` the last one set (what its single run's checkpoints hold)."""
        groups, order = self.templates[run]
        state = self.state[self.param_groups[0]["params"][0]]
        step = state["step"][run].detach().to("cpu", torch.float32)
        per_param = {
            index: {
                "step": step.clone(),
                "exp_avg": state["exp_avg"][run, start:end].view(shape).clone(),
                "exp_avg_sq": state["exp_avg_sq"][run, start:end].view(shape).clone(),
            }
            for index, (start, end, shape) in enumerate(order)
        }
        return {"state": per_param, "param_groups": [{**group, "lr": float(learning_rate)} for group in groups]}


def clip_run_gradients(grad: torch.Tensor, max_norms: torch.Tensor) -> torch.Tensor:
    """Clip each run's gradient (row of ``grad [K, P]``) to its own norm ``max_norms [K]`` (``inf``: no clipping)
    in place, as ``torch.nn.utils.clip_grad_norm_`` clips one run's; returns the norms before clipping ``[K]``."""
    norms = torch.linalg.vector_norm(grad, dim=1)
    grad.mul_((max_norms / (norms + 1e-6)).clamp(max=1.0)[:, None])
    return norms


def batched_train_step(
    runs: StackedRuns,
    optimizer: RunAdamW,
    batch: dict[str, torch.Tensor],
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
    max_norms: torch.Tensor,
    autocast,
) -> torch.Tensor:
    """One optimiser step of every run on a device batch (``[K, ...]`` tensors, each run's rows, and
    ``learning_rate [K]``): ``loss(model, rows)`` of all runs at once under ``autocast`` (:meth:`StackedRuns.map`
    of the trainer's own loss), backward, per-run gradient clipping and AdamW.

    Returns ``[K, 2]``: each run's ``[loss, grad_norm]`` (fp32, on the device). Reads no device value on the
    host: on CUDA the whole step can be one CUDA graph."""
    optimizer.zero_grad(set_to_none=True)
    rows = {name: value for name, value in batch.items() if name != "learning_rate"}
    with autocast:
        losses = runs.map(loss, rows)
    losses.sum().backward()  # the runs' losses share no parameter: each row of flat.grad is its run's gradient
    grad_norms = clip_run_gradients(runs.flat.grad, max_norms)
    optimizer.step(batch["learning_rate"])
    return torch.stack([losses.detach().float(), grad_norms.float()], dim=1)


# -- how many runs a batch takes ------------------------------------------------------------------------------
#: ``--batch-runs auto``: the batch sizes the probe tries (each at most the runs to train), and on CUDA at most
#: this fraction of the free device memory.
AUTO_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CUDA_MEMORY_FRACTION = 0.7
#: A batch must train this much faster per run-step than one run alone to be chosen (timings on a shared
#: machine wobble by about this much).
AUTO_MIN_GAIN = 1.1
#: Seconds the probe spends on one batch size at most (after its warm-up step).
AUTO_PROBE_SECONDS = 1.0


def auto_batch_runs(
    make_step: Callable[[int], Callable[[], None]],
    device: torch.device,
    *,
    runs: int,
    share: int = 1,
    log: Callable[[str], None] | None = None,
) -> int:
    """``--batch-runs auto``: how many of ``runs`` runs one batch should hold, measured. ``make_step(K)`` builds
    ``K`` fresh runs of the sweep's shape as one batch and returns a function doing one batched training step.
    For K = 1, 2, 4, ... (at most ``runs``) the probe times steps (one warm-up step, then up to
    :data:`AUTO_PROBE_SECONDS`) and measures run-steps per second; on CUDA it also measures the device memory
    one more run takes and stops where the batches would outgrow :data:`CUDA_MEMORY_FRACTION` of the free memory
    divided by ``share`` (batches training at once). It chooses the fastest K, and 1 unless that K trains at
    least :data:`AUTO_MIN_GAIN` times faster per run-step than one run alone."""
    cuda = device.type == "cuda"
    budget = None
    if cuda:
        budget = CUDA_MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0] / max(1, share)
    speeds: dict[int, float] = {}
    memory: dict[int, int] = {}
    for count in (k for k in AUTO_CANDIDATES if k <= max(1, runs)):
        if cuda and len(memory) >= 2:
            per_run = max(1, (memory[max(memory)] - memory[1]) // max(1, max(memory) - 1))
            if memory[1] + (count - 1) * per_run > budget:
                break
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        step = make_step(count)
        step()  # warm-up: allocations, kernel compilation and autotuning, a CUDA graph's capture
        _sync(device)
        steps, start = 0, time.perf_counter()
        while steps < 2 or (time.perf_counter() - start < AUTO_PROBE_SECONDS and steps < 50):
            step()
            steps += 1
        _sync(device)
        speeds[count] = count * steps / (time.perf_counter() - start)
        if cuda:
            memory[count] = torch.cuda.max_memory_allocated(device) - before
        del step
    if cuda:
        torch.cuda.empty_cache()  # the probe's memory back to the device, for the batches (maybe other processes)
    best = max(speeds, key=speeds.get)
    chosen = best if speeds[best] >= AUTO_MIN_GAIN * speeds[1] else 1
    if log is not None:
        measured = ", ".join(f"K={k}: {v:.1f}" for k, v in speeds.items())
        log(f"icrl: --batch-runs auto: run-steps per second {measured}; batches of {chosen}")
    return chosen


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = [
    "AUTO_CANDIDATES", "BATCH_RUNS_HELP", "RunAdamW", "RunDropout", "StackedRuns", "auto_batch_runs", "batch_key",
    "batched_train_step", "check_batch", "check_batch_runs", "clip_run_gradients", "group_runs", "parse_batch_runs",
]  # fmt: skip
