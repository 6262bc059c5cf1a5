"""Learning-curve plots (PNG) shared by the data, training and evaluation commands."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from .files import save_figure


def plot_curves(
    curves: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    reference_lines: Mapping[str, float] | None = None,
) -> None:
    """Save one line per curve with a shaded +- 1 standard error band.

    Args:
        curves: ``label -> [runs, points]`` values (NaN entries are ignored); the x axis is ``1..points``.
        path: the PNG to write.
        reference_lines: ``label -> y`` horizontal lines (e.g. the optimal return).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=120)
    for label, values in curves.items():
        values = np.atleast_2d(np.asarray(values, dtype=np.float64))
        counts = np.sum(~np.isnan(values), axis=0)
        mean = np.nanmean(values, axis=0)
        stderr = np.nanstd(values, axis=0) / np.sqrt(np.maximum(counts, 1))
        x = np.arange(1, values.shape[1] + 1)
        axis.plot(x, mean, label=label)
        axis.fill_between(x, mean - stderr, mean + stderr, alpha=0.25)
    for label, y in (reference_lines or {}).items():
        axis.axhline(y, linestyle="--", color="black", linewidth=1, label=label)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    save_figure(figure, path)
