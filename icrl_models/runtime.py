"""What every training command shares at run time: CPU threads, the CPU allocator, ``torch.compile`` and experiment
tracking.

One implementation behind ``--threads``, ``--compile`` and ``--track`` of ``icrl-train`` (and of the
commands that train through it: ``icrl-compare``, ``icrl-headless``) and behind ``--num-threads`` /
``--threads`` of the other experiment commands.

Threads. PyTorch's default is one OpenMP thread per core. The models here are small (d_model 64-512),
so their matrix products gain little from many threads, and when another process is busy on the same
cores an OpenMP thread that spin-waits for a core it cannot get stalls every step: on a 2-core VM with
one other busy process, training steps were measured 10-25x slower with 2 threads than with 1. The
default (``threads=0``, "auto") is therefore half of the cores this process may run on
(``os.sched_getaffinity``), at least 1 and at most 4: 1 on a 2-core machine, 4 on a workstation. That
this loses little on a quiet machine is a prediction; ``benchmarks/train_threads.py`` measures it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
import platform
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

#: Upper bound of the automatic thread count (small GEMMs stop scaling well before it: a prediction).
MAX_AUTO_THREADS = 4
TRACKERS = ("tensorboard", "wandb")


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or ``taskset``'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    """The intra-op thread count for ``threads``: itself when >= 1, else (0 or None) the automatic choice."""
    if isinstance(threads, bool) or not isinstance(threads, (int, type(None))):
        raise TypeError(f"threads must be an int, got {type(threads).__name__}")
    if threads is not None and threads < 0:
        raise ValueError(f"threads must be >= 0 (0: automatic), got {threads}")
    if threads:
        return threads
    return max(1, min(MAX_AUTO_THREADS, available_cores() // 2))


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the body with ``torch.set_num_threads(resolve_threads(threads))``, then restore the previous count.

    Yields the count in use. Inter-op threads are set too when that is still possible: PyTorch allows
    it once, before any inter-op work has started, and it cannot be undone (so it is not restored)."""
    count = resolve_threads(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    with contextlib.suppress(RuntimeError):  # "cannot set number of interop threads after parallel work..."
        torch.set_num_interop_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(previous)


#: glibc's ``mallopt`` parameters (malloc.h) and their values here: requests up to glibc's largest mmap threshold
#: come from the heap, and the heap keeps up to 2 GiB of freed memory at its top instead of returning it to the OS.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**31 - 1


@functools.cache
def retain_freed_memory() -> bool:
    """Make glibc's malloc keep memory the process frees for its next allocations (once per process; CPU training
    steps, see the module docstring): the mmap threshold fixed at :data:`MMAP_THRESHOLD` and the trim threshold at
    :data:`TRIM_THRESHOLD`. The process's resident memory then stays at its peak. Returns whether it was set:
    False off glibc, and where ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (glibc's own settings)
    are in the environment, which it leaves as they are."""
    if platform.libc_ver()[0] != "glibc" or any(
        name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - glibc always has it
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def maybe_compile(module: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """``torch.compile(module)`` when ``enabled`` (the training forward only; rollouts stay eager because
    their KV-cached decoding changes shapes every step), else ``module`` itself."""
    return torch.compile(module) if enabled else module


def check_trackers(track: Sequence[str]) -> None:
    """Raise a one-line ``ValueError`` for an unknown tracker or a tracker whose package is missing.

    Called before any data is generated, so a missing package costs nothing."""
    for name in track:
        if name not in TRACKERS:
            raise ValueError(f"track must name trackers from {TRACKERS}, got {name!r}")
    if "tensorboard" in track:
        _import("torch.utils.tensorboard", "tensorboard", "tensorboard")
    if "wandb" in track:
        _import("wandb", "wandb", "wandb")


def _import(module: str, flag: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"track {flag} needs the {package!r} package, which is not installed: pip install {package}"
        ) from None


class Tracker:
    """Scalars to TensorBoard (``<run_dir>/tensorboard``) and/or Weights & Biases; does nothing for ``track=()``.

    Args:
        track: tracker names, a subset of :data:`TRACKERS`.
        run_dir: the run folder (TensorBoard's log folder goes inside it).
        config: the run configuration, recorded as W&B config / a TensorBoard text entry.
        project, entity, name: the W&B project, entity (team or user; None: the default) and run name.
    """

    def __init__(
        self,
        track: Sequence[str],
        run_dir: str | os.PathLike,
        config: Mapping[str, Any],
        *,
        project: str = "icrl-kernels",
        entity: str | None = None,
        name: str | None = None,
    ) -> None:
        check_trackers(track)
        self._writer = self._wandb = None
        run_dir = Path(run_dir)
        if "tensorboard" in track:
            tensorboard = _import("torch.utils.tensorboard", "tensorboard", "tensorboard")
            self._writer = tensorboard.SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            self._writer.add_text("config", "\n".join(f"{key}: {value!r}  " for key, value in config.items()))
        if "wandb" in track:
            wandb = _import("wandb", "wandb", "wandb")
            self._wandb = wandb.init(
                project=project, entity=entity, name=name or run_dir.name, config=dict(config), dir=str(run_dir),
                resume="allow",
            )  # fmt: skip

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log ``scalars`` (name -> number; nested names like ``eval/final_return``) at ``step``."""
        scalars = {name: float(value) for name, value in scalars.items()}
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._writer = self._wandb = None
