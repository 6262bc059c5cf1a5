"""Test helpers shared by every op's parity tests (importable by downstream projects too)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import _library
from ._backend import triton_available, triton_interpreter_enabled

__all__ = [
    "RMS_TOLERANCE",
    "TESTED_DTYPES",
    "assert_close_rel",
    "fast_impls",
    "fast_paths",
    "forced_config",
    "poisoned_outputs",
    "relative_rms_error",
    "triton_devices",
]

#: Relative-RMS tolerance by input dtype (docs/testing.md#parity-with-the-reference).
RMS_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within the block, kernel outputs start as NaN (floats) / -1 (ints) instead of uninitialised memory."""
    previous = _library.set_output_poisoning(True)
    try:
        yield
    finally:
        _library.set_output_poisoning(previous)


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (``expected`` all zero: the absolute norm)."""
    actual64, expected64 = actual.detach().double(), expected.detach().double()
    diff = torch.linalg.vector_norm(actual64 - expected64).item()
    scale = torch.linalg.vector_norm(expected64).item()
    return diff / scale if scale > 0 else diff


def assert_close_rel(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rms_tol: float | None = None,
    max_abs_tol: float | None = None,
    name: str = "output",
) -> None:
    """Assert ``actual`` matches ``expected`` by relative RMS error and by max absolute error.

    Shapes must agree and ``actual`` must not contain NaN or inf where ``expected`` is finite.
    ``rms_tol`` defaults to :data:`RMS_TOLERANCE` of ``actual.dtype``; ``max_abs_tol`` defaults to
    ``50 * rms_tol * max(1, max|expected|)``, which catches a single badly wrong element that the RMS
    would average away.
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    finite = torch.isfinite(expected)
    bad = ~torch.isfinite(actual) & finite
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values (e.g. unwritten, NaN-poisoned elements)"
    if rms_tol is None:
        rms_tol = RMS_TOLERANCE[actual.dtype]
    err = relative_rms_error(actual, expected)
    assert err <= rms_tol, f"{name}: relative RMS error {err:.3e} > {rms_tol:.1e}"
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    if max_abs_tol is None:
        max_abs_tol = 50 * rms_tol * scale
    max_abs = (actual.detach().double() - expected.detach().double()).abs().max().item() if expected.numel() else 0.0
    assert max_abs <= max_abs_tol, f"{name}: max abs error {max_abs:.3e} > {max_abs_tol:.1e}"


def triton_devices() -> list[str]:
    """Devices on which the Triton path can run in this process: ``"cpu"`` when Triton's interpreter is on
    (``TRITON_INTERPRET=1``), ``"cuda"`` when a CUDA device is present.

    Plain strings, so that they can be nested in other parameters; the repository's ``conftest.py``
    marks every test that runs on ``"cuda"`` with ``gpu`` (``pytest -m gpu`` selects the CUDA tests).
    """
    devices: list[str] = []
    if triton_available() and triton_interpreter_enabled():
        devices.append("cpu")
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


#: The activation dtypes every kernel is tested in.
TESTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fast_paths() -> list:
    """``(backend, device)`` pytest parameters of an op's fast paths: the eager path on the CPU, then the
    Triton path on every device of :func:`triton_devices` (ids ``eager``, ``triton-cpu``, ``triton-cuda``)."""
    import pytest

    return [pytest.param("eager", "cpu", id="eager")] + [
        pytest.param("triton", device, id=f"triton-{device}") for device in triton_devices()
    ]


def fast_impls() -> list[str]:
    """The fast backends that can run in this process: ``["eager"]``, plus ``"triton"`` where Triton runs."""
    return ["eager"] + (["triton"] if triton_devices() else [])


# --- forcing one autotune config ------------------------------------------------------------------


@contextlib.contextmanager
def forced_config(kernel, config) -> Iterator[None]:
    """Within the block, the autotuned ``kernel`` launches with ``config`` only (no timing, no cached pick).

    Works on a GPU and under the interpreter, whose autotuner keeps only the first config: any config of
    :func:`icrl_kernels._triton.autotune_configs` can be forced. The kernel's configs and its tuning cache
    are restored afterwards, even if the block raises.
    """
    saved_configs, saved_cache = kernel.configs, dict(kernel.cache)
    kernel.configs = [config]  # a single config is launched as is (Autotuner.run skips the cache)
    kernel.cache.clear()
    try:
        yield
    finally:
        kernel.configs = saved_configs
        kernel.cache.clear()
        kernel.cache.update(saved_cache)
