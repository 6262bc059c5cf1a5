"""Function classes and baselines for in-context function learning (Garg et al., 2022).

A prompt is ``k`` points ``x_i ~ N(0, I_d)`` with labels ``y_i = f(x_i)`` for one ``f`` drawn per prompt.
The model sees ``(x_1, y_1, ..., x_k, y_k)`` and predicts every ``y_i`` from the ``i - 1`` examples
before it; errors are squared errors divided by the class's label variance ``E[y^2]`` (so predicting
zero scores about 1, as in the papers' "normalised squared error").

Curriculum: like Garg et al., only the first ``active_dims`` coordinates of ``x`` are non-zero early in
training (:class:`Curriculum` grows it, the number of points and the number of loops).

Classes (parameters drawn from ``N(0, I)`` as in the papers):

* ``linear_regression``: ``y = <w, x>``; ``E[y^2] = active_dims``.
* ``sparse_linear_regression``: ``w`` keeps ``sparsity`` random active coordinates; ``E[y^2] = sparsity``.
* ``decision_tree``: a complete binary tree of depth ``depth``; node ``j`` tests ``x[c_j] > 0`` for a
  random active coordinate ``c_j``, leaves hold ``N(0, 1)`` values; ``E[y^2] = 1``.
* ``relu_2nn``: ``y = sqrt(2 / hidden) * relu(x W1) w2`` with ``hidden`` units; ``E[y^2] = active_dims``.

Baselines (:func:`baseline_predictions`): least squares (minimum-norm, the optimum for noiseless
linear regression once ``i >= d``), averaging (``w = mean_j y_j x_j``) and 3-nearest-neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from icrl_kernels.validation import check_device, check_generator, check_int

FUNCTION_CLASSES: tuple[str, ...] = ("linear_regression", "sparse_linear_regression", "decision_tree", "relu_2nn")
BASELINES: tuple[str, ...] = ("least_squares", "averaging", "3nn")


@dataclass
class FunctionClassConfig:
    """Which functions prompts are drawn from.

    Args:
        name: one of :data:`FUNCTION_CLASSES`.
        n_dims: input width ``d`` (the model's read-in width).
        sparsity: non-zero weights of ``sparse_linear_regression``.
        depth: depth of ``decision_tree``.
        hidden: hidden units of ``relu_2nn``.
    """

    name: str = "linear_regression"
    n_dims: int = 5
    sparsity: int = 3
    depth: int = 4
    hidden: int = 100

    def __post_init__(self) -> None:
        if self.name not in FUNCTION_CLASSES:
            raise ValueError(f"name must be one of {FUNCTION_CLASSES}, got {self.name!r}")
        for field in ("n_dims", "sparsity", "depth", "hidden"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")

    def label_variance(self, active_dims: int) -> float:
        """``E[y^2]`` over functions and points, the normaliser of squared errors."""
        if self.name == "sparse_linear_regression":
            return float(min(self.sparsity, active_dims))
        if self.name == "decision_tree":
            return 1.0
        return float(active_dims)


@dataclass
class Curriculum:
    """A value that starts at ``start`` and grows by ``increment`` every ``interval`` steps up to ``end``."""

    start: int
    end: int
    increment: int = 1
    interval: int = 2000

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.end < self.start:
            raise ValueError(f"end ({self.end}) must be >= start ({self.start})")

    def value(self, step: int) -> int:
        return min(self.end, self.start + self.increment * (step // self.interval))


def _active_mask(n_dims: int, active_dims: int, device) -> torch.Tensor:
    return torch.arange(n_dims, device=device) < active_dims


def sample_prompts(
    config: FunctionClassConfig,
    batch: int,
    n_points: int,
    *,
    active_dims: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch`` prompts of ``n_points`` labelled points, one function per prompt.

    Args:
        config: the function class.
        batch: prompts ``B``.
        n_points: points per prompt ``k``.
        active_dims: coordinates of ``x`` that are non-zero (the dims curriculum); default all ``d``.
        generator: a CPU ``torch.Generator`` for reproducible draws (sampled on CPU, then moved).
        device: where the prompts go (default: the CPU); it must exist on this machine.

    Returns:
        ``xs [B, k, d]`` and ``ys [B, k]``, fp32 on ``device``.
    """
    d = config.n_dims
    active = d if active_dims is None else check_int(active_dims, "active_dims", min_value=1, max_value=d)
    batch = check_int(batch, "batch", min_value=1)
    n_points = check_int(n_points, "n_points", min_value=1)
    check_generator(generator)
    device = check_device(device) if device is not None else torch.device("cpu")
    mask = _active_mask(d, active, "cpu").float()
    xs = torch.randn(batch, n_points, d, generator=generator) * mask
    if config.name in ("linear_regression", "sparse_linear_regression"):
        w = torch.randn(batch, d, generator=generator) * mask
        if config.name == "sparse_linear_regression":
            # Keep `sparsity` active coordinates chosen uniformly: rank random keys, inactive ones last.
            keys = torch.rand(batch, d, generator=generator) + (1 - mask) * 2
            keep = keys.argsort(dim=1)[:, : min(config.sparsity, active)]
            w = w * torch.zeros_like(w).scatter_(1, keep, 1.0)
        ys = torch.einsum("bkd,bd->bk", xs, w)
    elif config.name == "decision_tree":
        ys = _decision_tree_labels(xs, config.depth, active, generator)
    else:
        w1 = torch.randn(batch, d, config.hidden, generator=generator)
        w2 = torch.randn(batch, config.hidden, generator=generator)
        ys = torch.einsum("bkh,bh->bk", torch.relu(xs @ w1), w2) * math.sqrt(2.0 / config.hidden)
    return xs.to(device), ys.to(device)


def _decision_tree_labels(xs: torch.Tensor, depth: int, active: int, generator) -> torch.Tensor:
    batch, n_points, _ = xs.shape
    internal = 2**depth - 1
    coords = torch.randint(active, (batch, internal), generator=generator)
    leaves = torch.randn(batch, 2**depth, generator=generator)
    node = torch.zeros(batch, n_points, dtype=torch.long)  # heap index: children of j are 2j+1, 2j+2
    for _ in range(depth):
        tested = xs.gather(2, coords.gather(1, node).unsqueeze(-1)).squeeze(-1)
        node = 2 * node + 1 + (tested > 0).long()
    return leaves.gather(1, node - internal)


def least_squares_predictions(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """``[B, k]``: position ``i`` predicted by the minimum-norm least-squares fit of the ``i`` points before it."""
    preds = torch.zeros_like(ys)
    for i in range(1, xs.shape[1]):
        w = torch.linalg.pinv(xs[:, :i]) @ ys[:, :i].unsqueeze(-1)  # [B, d, 1]
        preds[:, i] = (xs[:, i : i + 1] @ w).view(-1)
    return preds


def averaging_predictions(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """``[B, k]``: position ``i`` predicted with ``w = mean_{j < i} y_j x_j`` (zero for ``i = 0``)."""
    sums = torch.cumsum(ys.unsqueeze(-1) * xs, dim=1)
    counts = torch.arange(1, xs.shape[1] + 1, device=xs.device, dtype=xs.dtype).view(1, -1, 1)
    w = torch.cat([torch.zeros_like(sums[:, :1]), (sums / counts)[:, :-1]], dim=1)
    return (w * xs).sum(-1)


def nearest_neighbours_predictions(xs: torch.Tensor, ys: torch.Tensor, neighbours: int = 3) -> torch.Tensor:
    """``[B, k]``: mean label of the ``neighbours`` nearest earlier points (all of them when fewer; 0 at ``i = 0``)."""
    n_points = xs.shape[1]
    distances = torch.cdist(xs, xs)  # [B, k, k], query i against point j
    earlier = torch.ones(n_points, n_points, dtype=torch.bool, device=xs.device).tril(-1)
    distances = distances.masked_fill(~earlier, math.inf)
    count = min(neighbours, max(n_points - 1, 1))
    nearest = distances.topk(count, dim=-1, largest=False)
    valid = nearest.values.isfinite()
    labels = ys.unsqueeze(1).expand(-1, n_points, -1).gather(2, nearest.indices)
    total = (labels * valid).sum(-1)
    return total / valid.sum(-1).clamp(min=1)


def baseline_predictions(name: str, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Predictions ``[B, k]`` of one of :data:`BASELINES` for every prefix of ``xs [B, k, d]``, ``ys [B, k]``."""
    if name == "least_squares":
        return least_squares_predictions(xs, ys)
    if name == "averaging":
        return averaging_predictions(xs, ys)
    if name == "3nn":
        return nearest_neighbours_predictions(xs, ys, 3)
    raise ValueError(f"baseline must be one of {BASELINES}, got {name!r}")


def normalized_squared_error(preds: torch.Tensor, ys: torch.Tensor, label_variance: float) -> torch.Tensor:
    """Mean over prompts of ``(pred - y)^2 / E[y^2]``: ``[..., B, k]`` -> ``[..., k]`` (one value per prefix)."""
    return ((preds - ys) ** 2).mean(-2) / label_variance
