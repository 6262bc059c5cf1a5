"""AD / N-Gram AD / Headless-AD: training steps and in-context evaluation steps per second
(docs/performance.md#targets).

* ``test_train_step``: one optimiser step (forward, backward, AdamW) on a batch of windows, for AD and
  N-Gram AD, with the library's kernels (``backend="auto"``), the same step replayed from a CUDA graph
  (``"auto+graph"``, CUDA only: ``icrl-train --cuda-graph``), with ``backend="reference"`` (the
  dense O(L^2) n-gram reference), and the peer a user would pick instead of our kernels: the reference
  model's loss under ``torch.compile(mode="reduce-overhead")`` (Inductor's kernels in CUDA graphs;
  ``"reference+compile"``, CUDA only: an Inductor CPU compile of the model takes minutes).
  ``test_headless_train_step``: the same for Headless-AD (a new action
  map every step, InfoNCE over a 20-action set), fused InfoNCE against the reference (materialised
  logits).
* ``test_eval_step``: one in-context decision for ``num_envs`` environments at a context of
  ``context`` steps. ``incremental`` is :meth:`ADModel.step` (KV cache + n-gram running state: cost
  independent of the context); ``recompute`` runs the whole context through the model again with the
  reference n-gram path, what an implementation without a cache does.

The CPU smoke set is tiny; the full set (CUDA, or ``ICRL_BENCH_FULL=1``) uses the main job's CPU
model and, on CUDA, a paper-sized one (d_model 512, 8 heads, 4 blocks).

``extra_info`` keys: ``op`` (``ad_train_step``, ``ad_eval_step``), ``backend`` (the column
``benchmarks/summarize.py`` compares: ``auto`` / ``auto+graph`` / ``reference``, or ``incremental`` /
``recompute``),
``model`` and the size. Headline cases (``-m headline``): both training-step benchmarks at the largest
size of the set that runs (``paper`` on CUDA, ``tiny`` on a smoke run), every model and backend.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from icrl_models.cuda_graphs import StepRunner
from icrl_models.models import ADConfig, ADModel
from icrl_models.models.headless_ad import HeadlessADConfig, HeadlessADModel

from .conftest import _versions, as_params, bench_device, device_name, full_run


class Size(NamedTuple):
    name: str
    d_model: int
    num_heads: int
    num_layers: int
    seq_len: int
    batch: int


SMOKE = [Size("tiny", 16, 2, 1, 24, 4)]
CPU_FULL = [Size("cpu-main", 64, 4, 2, 200, 32)]
GPU_FULL = [Size("cpu-main", 64, 4, 2, 200, 32), Size("paper", 512, 8, 2, 250, 64)]
SIZES = (GPU_FULL if torch.cuda.is_available() else CPU_FULL) if full_run() else SMOKE
SIZE_PARAMS = as_params(SIZES, headline=SIZES[-1:], ids=lambda s: s.name)
MODELS = {"ad": (), "ngram_ad": (1, 2)}
#: The fused kernels with the whole step captured in one CUDA graph and replayed (CUDA only).
GRAPH = "auto+graph"
#: The reference model's loss compiled by Inductor with its CUDA graphs (CUDA only).
COMPILED = "reference+compile"
TRAIN_BACKENDS = ["auto", GRAPH, "reference", COMPILED]
EVAL_ROUNDS = 50


def _model(size: Size, model: str, backend: str, device) -> ADModel:
    config = ADConfig(
        seq_len=size.seq_len, d_model=size.d_model, num_heads=size.num_heads, num_layers=size.num_layers,
        ngram_sizes=MODELS[model], backend=backend,
    )  # fmt: skip
    return ADModel(config).to(device)


def _inputs(batch: int, length: int, device):
    generator = torch.Generator().manual_seed(0)
    states = torch.randint(0, 81, (batch, length), generator=generator)
    prev_actions = torch.randint(-1, 5, (batch, length), generator=generator)
    prev_rewards = torch.randint(0, 2, (batch, length), generator=generator).float()
    return states.to(device), prev_actions.to(device), prev_rewards.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("size", SIZE_PARAMS)
def test_train_step(benchmark, size: Size, model: str, backend: str):
    device = bench_device()
    net = _model(size, model, _kernels(backend, device), device)
    states, prev_actions, prev_rewards = _inputs(size.batch, size.seq_len, device)
    batch = {
        "states": states, "prev_actions": prev_actions, "prev_rewards": prev_rewards,
        "actions": torch.randint(0, 5, states.shape, device=device), "mask": torch.ones_like(states, dtype=torch.bool),
    }  # fmt: skip
    _time_train_step(
        benchmark,
        net,
        batch,
        size._asdict(),
        op="ad_train_step",
        model=model,
        backend=backend,
        graphed=backend == GRAPH,
        compiled=backend == COMPILED,
    )


def _kernels(backend: str, device: torch.device) -> str:
    """The model's ``backend=`` for a benchmark backend; a graphed or compiled one needs CUDA (else the case is
    skipped)."""
    if backend not in (GRAPH, COMPILED):
        return backend
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device" if backend == GRAPH else "reduce-overhead compiles for CUDA")
    return "auto" if backend == GRAPH else "reference"


def _time_train_step(
    benchmark, net, batch: dict, *info, graphed: bool = False, compiled: bool = False, **more_info
) -> None:
    """Time one optimiser step of ``net.loss(batch)`` (bf16 autocast on CUDA), after one warm-up step;
    ``graphed``: the step is captured in a CUDA graph first and each timed step replays it (CUDA only);
    ``compiled``: ``net.loss`` runs under ``torch.compile(mode="reduce-overhead")`` (three warm-up steps: the
    compile, then the recording of its CUDA graphs).

    ``extra_info`` gets ``info`` and ``more_info`` (which must name the ``op`` and the ``backend``), the
    device and, on CUDA, the peak memory of the timed steps. The benchmark group is the op and the size.
    """
    device = bench_device()
    lr = torch.tensor(1e-3, device=device) if graphed else 1e-3
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, capturable=graphed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    headless = isinstance(net, HeadlessADModel)
    loss_of = torch.compile(net.loss, mode="reduce-overhead") if compiled else net.loss
    map_outside = headless and (graphed or compiled)  # the map's QR stays out of the graph and the compile

    def optimizer_step(inputs: dict) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            # A graphed Headless-AD step reads the map drawn outside the graph; an eager one draws its own.
            loss = loss_of(inputs, action_map=inputs.get("action_map")) if headless else loss_of(inputs)
        loss.backward()
        optimizer.step()
        return loss.detach()

    runner = StepRunner(optimizer_step, net, optimizer, device, cuda_graph=graphed)

    def step():
        # Graphed as icrl-train --cuda-graph runs it: Headless-AD's map is drawn per step outside the graph.
        inputs = {**batch, "action_map": net.draw_action_map(batch["available"].shape[1])} if map_outside else batch
        runner(inputs)
        _sync(device)

    for _ in range(3 if compiled else 1):
        step()  # warm-up (allocator, kernels; the compile and its graphs' recording)
    for extra in info:
        benchmark.extra_info.update(extra)
    benchmark.extra_info.update(more_info, device=device_name(device), device_type=device.type, **_versions())
    benchmark.group = f"{more_info['op'].replace('_', '-')} {benchmark.extra_info.get('name', '')}".rstrip()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    benchmark(step)
    if not benchmark.disabled:
        benchmark.extra_info["steps_per_second"] = 1.0 / benchmark.stats.stats.median
    if device.type == "cuda":
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)


@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
@pytest.mark.parametrize("size", SIZE_PARAMS)
def test_headless_train_step(benchmark, size: Size, backend: str):
    device = bench_device()
    config = HeadlessADConfig(
        num_states=81, embed_dim=64, seq_len=size.seq_len, d_model=size.d_model, num_heads=size.num_heads,
        num_layers=size.num_layers, backend=_kernels(backend, device),
    )  # fmt: skip
    net = HeadlessADModel(config).to(device)
    states, prev_actions, prev_rewards = _inputs(size.batch, size.seq_len, device)
    num_actions = 20
    batch = {
        "states": states, "local_prev_actions": prev_actions, "prev_rewards": prev_rewards,
        "local_actions": torch.randint(0, num_actions, states.shape, device=device),
        "available": torch.ones(size.batch, num_actions, dtype=torch.bool, device=device),
        "mask": torch.ones_like(states, dtype=torch.bool),
    }  # fmt: skip
    _time_train_step(benchmark, net, batch, size._asdict(), op="ad_train_step", model="headless_ad", backend=backend,
                     graphed=backend == GRAPH, compiled=backend == COMPILED)  # fmt: skip


@pytest.mark.parametrize("mode", ["incremental", "recompute"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: s.name)
def test_eval_step(benchmark, size: Size, model: str, mode: str):
    device = bench_device()
    context = 4 * size.seq_len
    num_envs = 84 if full_run() else 4
    net = _model(size, model, "auto" if mode == "incremental" else "reference", device).eval()
    states, prev_actions, prev_rewards = _inputs(num_envs, context + 1, device)
    if mode == "incremental":
        # Room for the timed steps after the context (each timed step extends it by one).
        state = net.init_decode_state(num_envs, context + EVAL_ROUNDS + 8)
        for t in range(context):  # fill the cache: the timed steps see a context of `context` steps
            net.step(state, states[:, t], prev_actions[:, t], prev_rewards[:, t])

        def step():
            net.step(state, states[:, -1], prev_actions[:, -1], prev_rewards[:, -1])
            _sync(device)

    else:

        @torch.no_grad()
        def step():
            net(states, prev_actions, prev_rewards, window=size.seq_len)[:, -1]
            _sync(device)

    benchmark.group = f"ad-eval-step {size.name}"
    benchmark.extra_info.update(size._asdict(), op="ad_eval_step", model=model, backend=mode, context=context,
                                num_envs=num_envs, device=device_name(device), device_type=device.type)  # fmt: skip
    if benchmark.disabled:
        benchmark(step)
    else:
        benchmark.pedantic(step, rounds=EVAL_ROUNDS, iterations=1, warmup_rounds=2)
        benchmark.extra_info["env_steps_per_second"] = num_envs / benchmark.stats.stats.median
