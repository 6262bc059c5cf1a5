"""GPT2-DTMA (Decision Transformer with MoA): one training step, gated against ungated (docs/performance.md#targets).

``test_train_step`` times one optimiser step (forward, backward, AdamW; bf16 autocast on CUDA) of
:class:`~icrl_models.models.dt_moa.DecisionTransformerMoA` on a batch of ``k``-step windows:

* ``moa``: layer 0 MoA-gated (softmax), the library's gating kernel (``backend="auto"``);
* ``moa+graph``: ``moa`` with the whole step replayed from a CUDA graph (CUDA only; ``icrl-markov
  --cuda-graph``);
* ``moa-fused`` / ``moa-fused+graph``: the MoA layer's attention as one ``gated_attention`` kernel with the gate
  in its epilogue (``DTMoAConfig(attention="fused")``) instead of SDPA + the gating op, eager and graphed;
* ``moa-reference``: the same model with the readable reference gating (``backend="reference"``);
* ``ungated`` / ``ungated+graph``: no MoA layer (``gate=None`` everywhere): plain GPT-2 attention, the floor.

Every variant runs without dropout (the fused kernel has no attention dropout), so all do the same work.

The CPU smoke set is tiny; the full set (CUDA, or ``ICRL_BENCH_FULL=1``) has the ``icrl-markov`` CPU
preset's model and, on CUDA, GPT-2 small (12 x 12 x 768) at the paper's batch 64 and ``k = 20``.

``extra_info`` records the variant as ``backend`` (the column ``benchmarks/summarize.py`` compares) and
``op = "dt_moa_train_step"``. Headline cases (``-m headline``): the three variants at the largest size
of the set that runs (``gpt2-small`` on CUDA, ``tiny`` on a smoke run).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from icrl_models.models import DecisionTransformerMoA, DTMoAConfig

from .bench_ad import _kernels, _time_train_step
from .conftest import as_params, bench_device, full_run


class Size(NamedTuple):
    name: str
    n_embd: int
    n_head: int
    n_layer: int
    context_len: int
    batch: int


SMOKE = [Size("tiny", 24, 3, 2, 5, 4)]
CPU_FULL = [Size("cpu-markov", 64, 4, 2, 10, 32)]
GPU_FULL = [Size("cpu-markov", 64, 4, 2, 10, 32), Size("gpt2-small", 768, 12, 12, 20, 64)]
SIZES = (GPU_FULL if torch.cuda.is_available() else CPU_FULL) if full_run() else SMOKE
VARIANTS = {
    "moa": dict(moa_layers=(0,), backend="auto"),
    "moa+graph": dict(moa_layers=(0,), backend="auto+graph"),
    "moa-fused": dict(moa_layers=(0,), backend="auto", attention="fused"),
    "moa-fused+graph": dict(moa_layers=(0,), backend="auto+graph", attention="fused"),
    "moa-reference": dict(moa_layers=(0,), backend="reference"),
    "ungated": dict(moa_layers=(), backend="auto"),
    "ungated+graph": dict(moa_layers=(), backend="auto+graph"),
}


def _batch(size: Size, config: DTMoAConfig, device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (size.batch, size.context_len)
    batch = {
        "rtg": torch.rand(shape, generator=generator) * 20,
        "states": torch.randint(0, config.num_states, shape, generator=generator),
        "actions": torch.randint(0, config.num_actions, shape, generator=generator),
        "timesteps": torch.randint(0, config.max_timestep, shape, generator=generator),
        "mask": torch.ones(shape, dtype=torch.bool),
    }
    return {name: value.to(device) for name, value in batch.items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("size", as_params(SIZES, headline=SIZES[-1:], ids=lambda s: s.name))
def test_train_step(benchmark, size: Size, variant: str):
    device = bench_device()
    config = DTMoAConfig(
        state_sizes=(81, 81), context_len=size.context_len, n_layer=size.n_layer, n_head=size.n_head,
        n_embd=size.n_embd, n_positions=max(3 * size.context_len, 60), dropout=0.0,
        **{**VARIANTS[variant], "backend": _kernels(VARIANTS[variant]["backend"], device)},
    )  # fmt: skip
    torch.manual_seed(0)
    net = DecisionTransformerMoA(config).to(device)
    batch = _batch(size, config, device)
    _time_train_step(benchmark, net, batch, size._asdict(), op="dt_moa_train_step", model="dt_moa", backend=variant,
                     graphed=variant.endswith("+graph"))  # fmt: skip
